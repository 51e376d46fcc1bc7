"""The OCI archives this machine builds images as, shared by pyproxy's own image (`make image`,
image/build.py) and the test kit's cluster images (testkit/images.py, which imports this; this
imports nothing of the test kit).

No container registry is reachable from the machines this project runs on (package
registries only), so an image is written here as an OCI image layout in a tar
(``oci-layout``, ``index.json``, ``blobs/sha256/…``) whose index names it with the
``io.containerd.image.name`` annotation: ``ctr -n k8s.io images import`` takes it under that
name. An archive's file name holds a hash of its inputs (`Recipe`), so a second run finds it
and builds nothing; the costly intermediates (Debian rootfs, wheels) are cached the same way
under ``build/``. Everything lives in ``${PYPROXY_K8S_CACHE:-~/.cache/pyproxy}/images``,
outside the checkout.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRRORS = (
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
)
# What bookworm-slim leaves out (debuerreotype's --slimify list, shortened): docs, man pages,
# locales. Copyright files stay.
SLIM_DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
)

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
NAME_ANNOTATION = "io.containerd.image.name"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageBuildError(RuntimeError):
    """An image could not be built; the message says which step and why."""


@dataclass(frozen=True)
class ImageArchive:
    """An OCI archive that `ctr -n k8s.io images import PATH` imports as NAME."""

    name: str
    path: Path


def cache_dir() -> Path:
    """The archives' folder: beside the control plane's binaries (e2e/k8s/build.sh's cache)."""
    base = os.environ.get("PYPROXY_K8S_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pyproxy")
    return Path(base) / "images"


def log(message: str) -> None:
    print(f"images: {message}", file=sys.stderr, flush=True)


def run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
        capture: bool = False) -> str:
    """Runs a build step; its output goes to stderr (or is returned), a failure raises."""
    argv = [str(a) for a in args]
    result = subprocess.run(argv, cwd=cwd, env=env, check=False, text=True,
                            stdout=subprocess.PIPE if capture else sys.stderr,
                            stderr=subprocess.PIPE if capture else None)
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if capture else ""
        raise ImageBuildError(f"{' '.join(argv)} exited {result.returncode}"
                              + (f": {detail}" if detail else ""))
    return result.stdout if capture else ""


def digest_of(*parts: str | bytes | Path) -> str:
    """sha256 over the parts in order; a Path counts by its content."""
    hasher = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            with part.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    hasher.update(chunk)
        else:
            hasher.update(part.encode() if isinstance(part, str) else part)
        hasher.update(b"\0")
    return hasher.hexdigest()


def publish(build: Callable[[Path], None], target: Path) -> Path:
    """Builds into target's .partial and renames it, so an interrupted build leaves nothing
    that looks finished."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    if partial.is_dir():
        shutil.rmtree(partial)
    partial.unlink(missing_ok=True)
    build(partial)
    partial.rename(target)
    return target


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _gzip_layer(layer: Path, blobs: Path) -> tuple[str, str, int]:
    """(diff_id, digest, size) of a layer tar, its gzip blob written into blobs/."""
    raw, packed = hashlib.sha256(), hashlib.sha256()
    partial = blobs / "layer.partial"
    # mtime 0 and no file name: the same layer gives the same blob, hence the same digest.
    with layer.open("rb") as src, partial.open("wb") as out, gzip.GzipFile(
            filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            raw.update(chunk)
            gz.write(chunk)
    with partial.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            packed.update(chunk)
    size = partial.stat().st_size
    partial.rename(blobs / packed.hexdigest())
    return "sha256:" + raw.hexdigest(), "sha256:" + packed.hexdigest(), size


def image_config(entrypoint: Sequence[str] | None = None, cmd: Sequence[str] | None = None,
                 user: str = "", env: Sequence[str] = (PATH_ENV,), ports: Sequence[str] = (),
                 workdir: str = "/", labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The runtime part of an OCI image config (``config``), as a Dockerfile would set it."""
    config: dict[str, Any] = {"Env": list(env), "WorkingDir": workdir}
    if entrypoint:
        config["Entrypoint"] = list(entrypoint)
    if cmd:
        config["Cmd"] = list(cmd)
    if user:
        config["User"] = user
    if ports:
        config["ExposedPorts"] = {port: {} for port in ports}
    if labels:
        config["Labels"] = dict(labels)
    return config


def tar_layout(layout: Path, out: Path) -> None:
    """An OCI layout folder as a tar, deterministic, files first sorted."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(layout.rglob("*")):
            info = tar.gettarinfo(str(path), str(path.relative_to(layout)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def _index(name: str, manifest_digest: str, manifest_size: int) -> dict[str, Any]:
    # containerd imports under io.containerd.image.name; the OCI ref.name is the tag alone
    # (what `ctr images export` writes), for tools that read only that.
    return {"schemaVersion": 2, "mediaType": INDEX_MEDIA, "manifests": [{
        "mediaType": MANIFEST_MEDIA, "digest": manifest_digest, "size": manifest_size,
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {NAME_ANNOTATION: name, REF_ANNOTATION: name.rpartition(":")[2]}}]}


def write_archive(out: Path, name: str, layers: Sequence[Path], config: dict[str, Any],
                  history: str = "") -> None:
    """An OCI archive of one linux/amd64 image: the layer tars (uncompressed, bottom first)
    gzipped, the config with their diff IDs, a manifest, and an index naming it."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".layout-") as tmp:
        layout = Path(tmp)
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        diff_ids, descriptors = [], []
        for layer in layers:
            diff_id, digest, size = _gzip_layer(layer, blobs)
            diff_ids.append(diff_id)
            descriptors.append({"mediaType": LAYER_MEDIA, "digest": digest, "size": size})
        full_config = {
            "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
            "config": config, "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "1970-01-01T00:00:00Z",
                         "created_by": history or "image/oci.py"} for _ in layers]}
        config_bytes = _canonical(full_config)
        config_digest = hashlib.sha256(config_bytes).hexdigest()
        (blobs / config_digest).write_bytes(config_bytes)
        manifest_bytes = _canonical({
            "schemaVersion": 2, "mediaType": MANIFEST_MEDIA,
            "config": {"mediaType": CONFIG_MEDIA, "digest": "sha256:" + config_digest,
                       "size": len(config_bytes)},
            "layers": descriptors})
        manifest_digest = hashlib.sha256(manifest_bytes).hexdigest()
        (blobs / manifest_digest).write_bytes(manifest_bytes)
        (layout / "oci-layout").write_bytes(_canonical({"imageLayoutVersion": "1.0.0"}))
        (layout / "index.json").write_bytes(_canonical(
            _index(name, "sha256:" + manifest_digest, len(manifest_bytes))))
        tar_layout(layout, out)


def name_layout(layout: Path, name: str) -> None:
    """Names the (only) image of an OCI layout folder as `_index` does (buildah's `oci:` push
    sets only ref.name, which containerd does not read as a full name)."""
    index = json.loads((layout / "index.json").read_text())
    (manifest,) = index["manifests"]
    manifest.setdefault("annotations", {}).update(
        {NAME_ANNOTATION: name, REF_ANNOTATION: name.rpartition(":")[2]})
    (layout / "index.json").write_bytes(_canonical(index))


def read_archive(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(index, manifest, config) of an OCI archive, read without unpacking it."""
    with tarfile.open(path) as tar:
        def blob(digest: str) -> Any:
            member = tar.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
            assert member is not None
            return json.loads(member.read())

        member = tar.extractfile("index.json")
        assert member is not None
        index = json.loads(member.read())
        manifest = blob(index["manifests"][0]["digest"])
        return index, manifest, blob(manifest["config"]["digest"])


def need(command: str, package: str) -> str:
    found = shutil.which(command)
    if not found:
        raise ImageBuildError(f"{command} not found: install Debian's {package} "
                              "(make images / make image install what they need)")
    return found


def deb_version(package: str) -> str:
    try:
        return run("dpkg-query", "-W", "-f", "${Version}", package, capture=True)
    except ImageBuildError as err:
        raise ImageBuildError(f"Debian package {package} is not installed") from err


# /usr merged by mmdebstrap's hooks, as debootstrap does it: mmdebstrap's default for bookworm
# installs the usrmerge package instead, which brings all of perl (~45 MB) into the image.
MERGED_USR_HOOKS = "/usr/share/mmdebstrap/hooks/merged-usr"


def rootfs_path(packages: Sequence[str] = ()) -> Path:
    """Where `debian_rootfs(packages)` keeps its tar (the name holds its inputs' hash)."""
    key = digest_of(DEBIAN_SUITE, *DEBIAN_MIRRORS, *SLIM_DPKG_OPTIONS, *sorted(packages),
                    MERGED_USR_HOOKS, deb_version("mmdebstrap"))[:16]
    return cache_dir() / "build" / f"rootfs-{DEBIAN_SUITE}-{key}.tar"


def debian_rootfs(packages: Sequence[str] = ()) -> Path:
    """A minbase Debian rootfs tar (slimmed as bookworm-slim is) with packages, made by
    mmdebstrap once per package list; its .debs are kept, so the next one downloads less."""
    target = rootfs_path(packages)
    if target.exists():
        return target
    debs = cache_dir() / "build" / "debs"
    debs.mkdir(parents=True, exist_ok=True)

    def build(partial: Path) -> None:
        log(f"mmdebstrap {DEBIAN_SUITE} minbase + {' '.join(packages) or 'nothing'}")
        argv: list[str | Path] = [need("mmdebstrap", "mmdebstrap"), "--variant=minbase",
                                  "--quiet", "--format=tar", "--skip=essential/unlink",
                                  f"--hook-dir={MERGED_USR_HOOKS}",
                                  "--setup-hook", 'mkdir -p "$1"/var/cache/apt/archives',
                                  "--setup-hook", f"sync-in {debs} /var/cache/apt/archives",
                                  "--customize-hook", f"sync-out /var/cache/apt/archives {debs}"]
        argv += [f"--dpkgopt={option}" for option in SLIM_DPKG_OPTIONS]
        if packages:
            argv.append("--include=" + ",".join(packages))
        # SOURCE_DATE_EPOCH: mmdebstrap clamps timestamps to it (a reproducible tar).
        run(*argv, DEBIAN_SUITE, partial, *DEBIAN_MIRRORS,
            env={**os.environ, "SOURCE_DATE_EPOCH": "0"})

    return publish(build, target)


@dataclass(frozen=True)
class Recipe:
    """How one image is made: `inputs` returns what its archive's key hashes (cheap to
    compute), `build` writes the archive."""

    name: str
    slug: str
    # The module whose code builds it: its code is an input too, as is this one's.
    source: Path
    inputs: Callable[[], list[str | bytes | Path]]
    build: Callable[[Path], None]
    # Whatever else must exist besides the archive (pyproxy's image in buildah's storage).
    present: Callable[[], bool] = lambda: True


def archive_path(recipe: Recipe) -> Path:
    """Where recipe's archive is for its current inputs (the builders' code counts too)."""
    key = digest_of(Path(__file__), recipe.source, recipe.name, *recipe.inputs())[:16]
    tag = recipe.name.rpartition(":")[2]
    return cache_dir() / f"{recipe.slug}-{tag}-{key}.tar"


def ensure_image(recipe: Recipe) -> ImageArchive:
    """recipe's archive, built if its inputs changed; older archives of it are removed."""
    target = archive_path(recipe)
    if not target.exists() or not recipe.present():
        start = time.monotonic()
        log(f"building {recipe.name}")
        publish(recipe.build, target)
        log(f"{recipe.name}: {target.stat().st_size / 2**20:.1f} MiB in "
            f"{time.monotonic() - start:.1f} s")
        for old in stale_archives(target, target.parent.glob(f"{recipe.slug}-*.tar"),
                                  time.time()):
            old.unlink(missing_ok=True)
            sbom_path(old).unlink(missing_ok=True)
    return ImageArchive(recipe.name, target)


# The image's bill of materials (`make image`): syft's SPDX document (JSON) of the archive,
# beside it. syft (`make tools`) finds Debian's packages (dpkg's status) and the virtualenv's
# Python packages (their dist-info), with versions, licenses and purls.
SBOM_SUFFIX = ".spdx.json"


def sbom_path(archive: Path) -> Path:
    return archive.with_name(archive.name.removesuffix(".tar") + SBOM_SUFFIX)


# Another checkout of another commit (a helper's worktree, a pinned bench or drill run) may
# be importing its own archive of the same image right now: removing every other archive of
# it made a cluster drill fail with "no such file" when a second checkout built its own.
STALE_ARCHIVE_AGE = 24 * 3600.0


def stale_archives(target: Path, candidates: Iterable[Path], now: float) -> list[Path]:
    """The same image's other archives (same name and tag, another inputs key; another tag,
    e.g. `make image IMAGE=...`, stays) untouched for STALE_ARCHIVE_AGE: old enough that no
    running checkout still needs them."""
    mine = re.compile(re.escape(target.name[:-len("0123456789abcdef.tar")])
                      + r"[0-9a-f]{16}\.tar")
    stale = []
    for path in candidates:
        if path == target or not mine.fullmatch(path.name):
            continue
        try:
            if now - path.stat().st_mtime > STALE_ARCHIVE_AGE:
                stale.append(path)
        except FileNotFoundError:  # another checkout removed it meanwhile
            continue
    return stale


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    """One builder at a time per cache: two (the cluster harness and `make image`, say) would
    otherwise build into the same .partial files."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield

