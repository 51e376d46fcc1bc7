"""pyproxy's container image, as `make image` builds it: the Containerfile (the recipe that
ships) built by buildah on a minimal context, written as an OCI archive that
``ctr -n k8s.io images import`` takes, with syft's bill of materials beside it.

- The base, ``debian:bookworm-slim``, is taken from buildah's storage, else pulled, else made
  here from Debian's packages (mmdebstrap) when no registry answers.
- The Python wheels are fetched by the host's pip into the build context (the host trusts
  the CAs of an egress proxy; the image does not).
- The archive's name holds a hash of its inputs (the sources, the lock, the commit), so a
  second run finds it and builds nothing; it lives in the cache outside the checkout
  (image/oci.py), and the image stays in buildah's storage for ``buildah push``.

The test kit's cluster images (testkit/images.py) build this one through `pyproxy_recipe`;
nothing here imports the test kit.

    python -m image.build [--tag NAME] [--sbom]    # prints the archive's path
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

from image.oci import (
    DEBIAN_SUITE,
    SBOM_SUFFIX,
    ImageBuildError,
    Recipe,
    cache_dir,
    cache_lock,
    debian_rootfs,
    digest_of,
    ensure_image,
    image_config,
    log,
    name_layout,
    need,
    publish,
    rootfs_path,
    run,
    sbom_path,
    tar_layout,
    write_archive,
)
from pyproxy import version as pyproxy_version

REPO = Path(__file__).resolve().parent.parent
CONTAINERFILE = REPO / "Containerfile"
# syft, built by `make tools` (e2e/tools/build.sh) into the cache outside the checkout.
TOOLS_SCRIPT = REPO / "e2e" / "tools" / "build.sh"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# A local name: nothing is pushed anywhere; the cluster harness puts it into the DaemonSet.
PYPROXY = f"localhost/pyproxy:{VERSION}"
# The Containerfile's FROM, made here when no registry has it.
DEBIAN_BASE = f"docker.io/library/debian:{DEBIAN_SUITE}-slim"

# What the Containerfile COPYs: the build context holds these and a wheelhouse, nothing else.
CONTEXT_FILES = ("pyproject.toml", "setup.py", "README.md", "requirements.lock", "pyproxy")


def source_commit() -> str:
    """The commit the image is built from, "-dirty" when the checkout's tracked files differ
    from it; "" outside a git checkout (the image then says "unknown")."""
    return pyproxy_version.git_commit(REPO) or ""


def context_files() -> list[Path]:
    files = []
    for name in CONTEXT_FILES:
        path = REPO / name
        files += sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and p.suffix != ".pyc") if path.is_dir() else [path]
    return files


def build_requires() -> list[str]:
    requires: list[str] = tomllib.loads((REPO / "pyproject.toml").read_text())[
        "build-system"]["requires"]
    return requires


def wheelhouse_path() -> Path:
    """Where `wheelhouse` keeps the wheels of the current lock and build backend."""
    key = digest_of(REPO / "requirements.lock", *build_requires())[:16]
    return cache_dir() / "build" / f"wheels-{key}"


def wheelhouse() -> Path:
    """requirements.lock's wheels for the image's Python (Debian 12's 3.11, x86_64), and the
    build backend's (pyproject's build-system.requires) for installing pyproxy itself, fetched
    by the host's pip: it trusts the host's CAs (an egress proxy's included), which the image
    does not have. Once per lock and backend."""
    lock, backend = REPO / "requirements.lock", build_requires()
    target = wheelhouse_path()
    if target.exists():
        return target

    def download(partial: Path) -> None:
        log("pip download requirements.lock (wheels for cp311 manylinux x86_64)")
        # pip does not widen a manylinux --platform to the older ones it covers: list them.
        platforms = [f"--platform={p}" for p in ("manylinux_2_36_x86_64", "manylinux_2_28_x86_64",
                                                  "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
        target_python = ["--only-binary=:all:", "--implementation=cp", "--python-version=3.11",
                         "--abi=cp311", *platforms]
        pip: list[str | Path] = [sys.executable, "-m", "pip", "download", "--quiet",
                                  "--dest", partial]
        run(*pip, "--no-deps", "-r", lock, *target_python)
        run(*pip, *backend, *target_python)

    return publish(download, target)


def buildah_has(image: str) -> bool:
    result = subprocess.run(["buildah", "images", "--quiet", image], capture_output=True,
                            text=True, check=False)
    return result.returncode == 0 and bool(result.stdout.strip())


# On a base made here: the rootfs it was made from (whose name holds its recipe's hash).
BASE_LABEL = "io.pyproxy.rootfs"


def ensure_debian_base(pull_timeout: float = 30) -> str:
    """Makes sure buildah has the Containerfile's base (DEBIAN_BASE): already there, pulled
    if a registry answers, else made here from Debian's packages (mmdebstrap) and imported
    under that name. Returns where it came from."""
    need("buildah", "buildah")
    if buildah_has(DEBIAN_BASE):
        made_from = run("buildah", "inspect", "--type=image", "--format",
                        f'{{{{index .OCIv1.Config.Labels "{BASE_LABEL}"}}}}', DEBIAN_BASE,
                        capture=True).strip()
        # A pulled base has no such label and stays; one made here by an older recipe is
        # made again.
        if made_from in ("", "<no value>", rootfs_path().name):
            return "local"
        log(f"{DEBIAN_BASE} was made from {made_from}: making it again")
    else:
        try:
            subprocess.run(["buildah", "pull", "--quiet", DEBIAN_BASE], check=True,
                           timeout=pull_timeout, capture_output=True)
            return "pulled"
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            log(f"no registry has {DEBIAN_BASE}: making it from Debian's packages")
    rootfs = debian_rootfs()
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "base.tar"
        write_archive(archive, DEBIAN_BASE, [rootfs],
                      image_config(cmd=["bash"], labels={BASE_LABEL: rootfs.name}),
                      history=f"mmdebstrap --variant=minbase {DEBIAN_SUITE}")
        # buildah names an image pulled from an archive by its ID only: tag it.
        image_id = run("buildah", "pull", "--quiet", f"oci-archive:{archive}",
                       capture=True).split()[-1]
        run("buildah", "tag", image_id, DEBIAN_BASE)
    return "mmdebstrap"


def build_pyproxy(out: Path, tag: str = PYPROXY) -> None:
    """`buildah bud` of the Containerfile (the shipped recipe) on a minimal context, then the
    image as an OCI archive named tag."""
    need("buildah", "buildah")
    base = ensure_debian_base()
    log(f"base {DEBIAN_BASE}: {base}")
    with tempfile.TemporaryDirectory(prefix="pyproxy-image-") as tmp:
        context = Path(tmp) / "context"
        for path in context_files():
            dest = context / path.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        shutil.copytree(wheelhouse(), context / "wheels")
        start = time.monotonic()
        # chroot isolation: no nested user namespaces or cgroups needed (and this machine's
        # cgroups are v1); host network: apt reaches Debian's archive as the host does.
        commit = source_commit()
        # The Containerfile's labels cannot read pyproject.toml: the version and the commit
        # are labelled here (OCI's annotation keys), the commit also recorded in the package.
        labels = [f"org.opencontainers.image.version={VERSION}",
                  *([f"org.opencontainers.image.revision={commit}"] if commit else [])]
        run("buildah", "bud", "--isolation=chroot", "--network=host", "--pull=never", "--force-rm",
            "--layers", "--build-arg", "WHEELS=wheels", "--build-arg", f"REVISION={commit}",
            *(arg for label in labels for arg in ("--label", label)),
            "-f", CONTAINERFILE, "-t", tag,
            context)
        log(f"buildah bud: {time.monotonic() - start:.0f} s")
        layout = Path(tmp) / "layout"
        run("buildah", "push", "--quiet", tag, f"oci:{layout}")
        name_layout(layout, tag)
        tar_layout(layout, out)


def pyproxy_recipe(tag: str) -> Recipe:
    # The commit is an input: the image records it (`pyproxy version`), so an archive built
    # at another commit, even of the same files, is not this commit's image.
    return Recipe(tag, "pyproxy", Path(__file__),
                  lambda: [tag, VERSION, source_commit(), CONTAINERFILE,
                           REPO / "requirements.lock",
                           *(str(p.relative_to(REPO)) for p in context_files()),
                           *context_files()],
                  lambda out: build_pyproxy(out, tag),
                  # `make image` leaves the image in buildah's storage too, for `buildah push`.
                  lambda: shutil.which("buildah") is None or buildah_has(tag))


def syft_path() -> Path:
    """Where `make tools` puts syft, whether or not it is built yet."""
    return Path(run(TOOLS_SCRIPT, "--path", "syft", capture=True).strip())


def ensure_sbom(archive: Path) -> Path:
    """syft's SPDX JSON document of archive, beside it; once per archive (an archive's name
    is keyed by its inputs)."""
    target = sbom_path(archive)
    if not target.exists():
        syft = syft_path()
        if not os.access(syft, os.X_OK):
            raise ImageBuildError(f"{syft} is not built: run `make tools TOOLS=syft`")
        start = time.monotonic()

        def scan(out: Path) -> None:
            # No network: syft does not look for its own updates.
            env = {**os.environ, "SYFT_CHECK_FOR_APP_UPDATE": "false"}
            run(syft, "scan", "--quiet", f"oci-archive:{archive}", "-o", f"spdx-json={out}",
                env=env)

        publish(scan, target)
        log(f"SBOM {target} in {time.monotonic() - start:.1f} s")
    return target


def ensure_pyproxy_image(tag: str = PYPROXY, sbom: bool = False) -> Path:
    """The archive of pyproxy's image named tag, built if its inputs changed, and its SBOM
    beside it with sbom."""
    with cache_lock():
        archive = ensure_image(pyproxy_recipe(tag)).path
    if sbom:
        ensure_sbom(archive)
    return archive


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m image.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=PYPROXY,
                        help=f"the image's name (default {PYPROXY})")
    parser.add_argument("--sbom", action="store_true",
                        help="write syft's SPDX JSON document beside the archive (ARCHIVE "
                        f"without .tar + {SBOM_SUFFIX}; `make tools` builds syft)")
    args = parser.parse_args(argv)
    try:
        archive = ensure_pyproxy_image(args.tag, sbom=args.sbom)
    except ImageBuildError as err:
        print(f"image: {err}", file=sys.stderr)
        return 1
    print(archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
