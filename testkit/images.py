"""images: every container image the cluster runs, built on this machine as OCI archives.

No container registry is reachable from the machines this project runs on (package
registries only), so each image a kubelet runs is built here and imported into each node's
containerd with ``ctr -n k8s.io images import``. An archive is an OCI image layout in a tar
(``oci-layout``, ``index.json``, ``blobs/sha256/…``); its index names the image with the
``io.containerd.image.name`` annotation, which is the name containerd imports it under, so the
names below are exactly the ones Kubernetes asks for (the e2e manifest's, kubeadm's).

How each is made, and why:

- **pause, busybox, CoreDNS** have no distribution in them: a static binary or two,
  /etc/passwd, a shell. This module writes them directly (one layer tar, a config, a manifest
  and an index): deterministic (mtime 0, root-owned, sorted), no daemon or storage driver, a
  second or two. A builder would need a base image that cannot be pulled here.
  pause is ``build/pause/linux/pause.c`` of the k8s.io/kubernetes module (``gcc -static``);
  CoreDNS is its own Go module at the version kubeadm deploys; busybox's shell and tools are
  Debian's busybox-static.
- **agnhost** is ``test/images/agnhost`` built in a copy of e2e/k8s's module (same pins) on an
  mmdebstrap rootfs with the tools upstream's image has (netcat-openbsd, curl, dig, ip, iperf,
  bash): the e2e tests exec them in agnhost pods with flags busybox's applets do not take.
- **The other SIGs' ``[Conformance]`` tests' images** (agnhost's older tag, nautilus, kitten,
  nonewprivs, sample-apiserver, etcd) come from the same module's sources; where its
  ``test/images/<name>`` is newer than the tag the e2e manifest asks for, the newer source is
  built under the manifest's name (``E2E_SUBSTITUTES`` says which and why).
- **kube-proxy** needs nft, iptables and conntrack: an mmdebstrap rootfs with them is the
  first layer, the binary ``make k8s`` built the second.
- **pyproxy** is the product's own build (``make image``, image/build.py): the Containerfile
  by buildah; this takes its recipe. The archives' format, cache and keys are image/oci.py's.

Each archive's file name holds a hash of its inputs (sources, binaries, package versions and
this file), so a second run finds them and does nothing; the costly intermediates (Go
binaries, Debian rootfs, wheels) are cached the same way under ``build/``. Everything lives in
``${PYPROXY_K8S_CACHE:-~/.cache/pyproxy}/images``, outside the checkout.

    python -m testkit.images [NAME...]     # build what is missing; prints "NAME PATH" lines
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from image.build import PYPROXY, pyproxy_recipe
from image.oci import (
    ImageArchive,
    ImageBuildError,
    Recipe,
    cache_dir,
    cache_lock,
    deb_version,
    debian_rootfs,
    digest_of,
    ensure_image,
    image_config,
    log,
    need,
    publish,
    run,
    write_archive,
)

HERE = Path(__file__)
REPO = HERE.resolve().parent.parent
K8S_MODULE_DIR = REPO / "e2e" / "k8s"
BUILD_SCRIPT = K8S_MODULE_DIR / "build.sh"

# The release pinned in e2e/k8s/go.mod, and the names its manifests use: the e2e framework's
# (test/utils/image/manifest.go), kubeadm's (cmd/kubeadm/app/constants). tests/test_images.py
# checks them against the module's source.
RELEASE = "v1.37.2"
PAUSE = "registry.k8s.io/pause:3.10.2"
AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
BUSYBOX = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"
COREDNS = "registry.k8s.io/coredns/coredns:v1.14.6"
# The other images [sig-network]'s e2e tests run (test/utils/image/manifest.go's names).
GLIBC_DNS_TESTING = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
NGINX = "registry.k8s.io/e2e-test-images/nginx:1.27.0-2"
REGRESSION_ISSUE_74839 = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"
# The images the other SIGs' [Conformance] tests run besides those (upstream's nftables job's
# focus and skips, without Serial), and which of them run each image:
# - AgnhostPrev: Deployment's lifecycle and RecreateDeployment, Pods' lifecycle, the
#   StatefulSet tests (every StatefulSet made by test/e2e/framework/statefulset), kubectl diff;
AGNHOST_PREV = "registry.k8s.io/e2e-test-images/agnhost:2.55"
# - Nautilus: kubectl's Update Demo (both tests);
NAUTILUS = "registry.k8s.io/e2e-test-images/nautilus:1.8"
# - Kitten: ImageVolume "should succeed with pod and pull policy of Always";
KITTEN = "registry.k8s.io/e2e-test-images/kitten:1.8"
# - Nonewprivs: Security Context "should not allow privilege escalation when false";
NONEWPRIVS = "registry.k8s.io/e2e-test-images/nonewprivs:1.4"
# - APIServer and Etcd: Aggregator "Should be able to support the 1.17 Sample API Server".
SAMPLE_APISERVER = "registry.k8s.io/e2e-test-images/sample-apiserver:1.29.2"
ETCD = "registry.k8s.io/etcd:3.7.0-0"
# No [Conformance] test outside sig-network runs NonRoot (the runAsNonRoot tests are
# NodeConformance only), ResourceConsumer (the HPA tests), NginxNew, IpcUtils or
# VolumeNFSServer (common/util.go's pre-pull list, which e2e.test pulls only with
# --prepull-images), so they are not built.

# The e2e manifest's (test/utils/image/manifest.go) image IDs of the images built here.
E2E_MANIFEST_IDS = {
    "Agnhost": AGNHOST, "AgnhostPrev": AGNHOST_PREV, "APIServer": SAMPLE_APISERVER,
    "BusyBox": BUSYBOX, "Etcd": ETCD, "GlibcDnsTesting": GLIBC_DNS_TESTING, "Kitten": KITTEN,
    "Nautilus": NAUTILUS, "Nginx": NGINX, "Nonewprivs": NONEWPRIVS, "Pause": PAUSE,
    "RegressionIssue74839": REGRESSION_ISSUE_74839,
}

# The images built under the e2e manifest's name from another version or source than upstream's,
# and what they are (docs/conformance.md repeats this).
E2E_SUBSTITUTES = {
    AGNHOST_PREV: "test/images/agnhost 2.66.1 of the module (it holds only agnhost's newest "
    "source), with a config of its own: the tests run it as the image before an update, with "
    "commands 2.66.1 has",
    NAUTILUS: "test/images/nautilus 1.9.0 (the module's), on the agnhost built here",
    KITTEN: "test/images/kitten 1.9 (the module's), on the agnhost built here, which is "
    "Debian, not Alpine",
    SAMPLE_APISERVER: "k8s.io/sample-apiserver v0.37.2, the staging module the release "
    "requires (upstream built its image from an older tag: the module's "
    "test/images/sample-apiserver, 1.33.8, clones v0.33.7), on busybox",
    ETCD: "etcd 3.7.0's own main (etcdmain of go.etcd.io/etcd/server/v3 v3.7.0, the version "
    "e2e/k8s/go.mod requires) at /usr/local/bin/etcd, without upstream's etcdctl, etcdutl "
    "and migration script",
    NONEWPRIVS: "test/images/nonewprivs 1.4 (the module's nnp.go, setuid root) on Debian's "
    "static busybox in place of Alpine",
}

KUBE_PROXY = f"registry.k8s.io/kube-proxy:{RELEASE}"

# ---------------------------------------------------------------------------------------------
# Layers and archives


@dataclass
class _Entry:
    kind: bytes
    mode: int
    data: bytes | Path | None = None
    target: str = ""
    uid: int = 0
    gid: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)


class Tree:
    """The files of one layer, by absolute path in the image; parent folders are implied."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}

    def dir(self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        self.entries[path.strip("/")] = _Entry(tarfile.DIRTYPE, mode, uid=uid, gid=gid)

    def file(self, path: str, data: bytes | Path, mode: int = 0o644,
             xattrs: dict[str, bytes] | None = None) -> None:
        self.entries[path.strip("/")] = _Entry(tarfile.REGTYPE, mode, data, xattrs=xattrs or {})

    def symlink(self, path: str, target: str) -> None:
        self.entries[path.strip("/")] = _Entry(tarfile.SYMTYPE, 0o777, target=target)

    def write(self, dest: Path) -> None:
        """An uncompressed layer tar: sorted, mtime 0, no user or group names."""
        names = set(self.entries)
        for name in list(names):
            parts = name.split("/")
            names.update("/".join(parts[:i]) for i in range(1, len(parts)))
        with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(names):
                entry = self.entries.get(name) or _Entry(tarfile.DIRTYPE, 0o755)
                info = tarfile.TarInfo(name)
                info.type, info.mode, info.linkname = entry.kind, entry.mode, entry.target
                info.uid, info.gid, info.uname, info.gname = entry.uid, entry.gid, "", ""
                info.mtime = 0
                if entry.xattrs:
                    # Go's archive/tar (containerd) reads SCHILY.xattr.* records as raw bytes.
                    info.pax_headers = {
                        f"SCHILY.xattr.{key}": value.decode("utf-8", "surrogateescape")
                        for key, value in entry.xattrs.items()}
                if entry.kind == tarfile.REGTYPE:
                    data = entry.data.read_bytes() if isinstance(entry.data, Path) else entry.data
                    assert data is not None
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.addfile(info)


# ---------------------------------------------------------------------------------------------
# Inputs: tools, the k8s.io/kubernetes module, Debian packages


def go_env() -> dict[str, str]:
    return {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath"}


def go_version() -> str:
    return run(need("go", "golang (>= 1.26)"), "env", "GOVERSION", capture=True).strip()


def k8s_module() -> Path:
    """The k8s.io/kubernetes source of the pinned release, from Go's module cache (fetched
    through the module proxy when missing)."""
    out = run(need("go", "golang (>= 1.26)"), "mod", "download", "-json",
              f"k8s.io/kubernetes@{RELEASE}", cwd=K8S_MODULE_DIR, capture=True)
    return Path(json.loads(out)["Dir"])


def _passwd(*users: tuple[str, int, int, str, str]) -> bytes:
    lines = [f"{name}:x:{uid}:{gid}:{name}:{home}:{shell}" for name, uid, gid, home, shell in users]
    return ("\n".join(lines) + "\n").encode()


ROOT_USERS = (("root", 0, 0, "/root", "/bin/sh"),
              ("nobody", 65534, 65534, "/nonexistent", "/bin/false"))
ROOT_GROUPS = "root:x:0:\nnobody:x:65534:\n"


def busybox_tree(users: Sequence[tuple[str, int, int, str, str]] = ROOT_USERS,
                 groups: str = ROOT_GROUPS) -> Tree:
    """Debian's static busybox with a link per applet (sh, nc, wget, nslookup, ip…), the
    folders a shell expects, /etc/passwd and /etc/group."""
    busybox = Path(need("busybox", "busybox-static"))
    if b"GLIBC" in busybox.read_bytes()[:4096] or "statically linked" not in run(
            "file", "-L", busybox, capture=True):
        raise ImageBuildError(f"{busybox} is not static: install busybox-static")
    tree = Tree()
    tree.file("/bin/busybox", busybox, 0o755)
    for applet in run(busybox, "--list-full", capture=True).split():
        if applet != "bin/busybox":
            tree.symlink(applet, "/bin/busybox")
    tree.dir("/tmp", 0o1777)
    tree.dir("/root", 0o700)
    tree.dir("/var")
    tree.dir("/home")
    tree.file("/etc/passwd", _passwd(*users))
    tree.file("/etc/group", groups.encode())
    # Go's resolver (agnhost's dns tests) and busybox's read this; files, then DNS.
    tree.file("/etc/nsswitch.conf", b"hosts: files dns\n")
    return tree


# ---------------------------------------------------------------------------------------------
# The images


def _archive(out: Path, name: str, trees: Sequence[Tree | Path], config: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".layers-") as tmp:
        layers = []
        for i, tree in enumerate(trees):
            if isinstance(tree, Path):
                layers.append(tree)
            else:
                layers.append(Path(tmp) / f"{i}.tar")
                tree.write(layers[-1])
        write_archive(out, name, layers, config)


# pause ---------------------------------------------------------------------------------------


def _pause_source() -> Path:
    return k8s_module() / "build" / "pause" / "linux" / "pause.c"


def _build_pause(out: Path) -> None:
    tag = PAUSE.rpartition(":")[2]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        # The flags of build/pause/Makefile (CFLAGS), with the version it stamps.
        run(need("gcc", "gcc and libc6-dev"), "-Os", "-Wall", "-Werror", "-static",
            f"-DVERSION=v{tag}", "-o", binary, _pause_source())
        run("strip", binary)
        tree = Tree()
        tree.file("/pause", binary, 0o755)
        # build/pause/Dockerfile: USER 65535:65535, ENTRYPOINT ["/pause"].
        _archive(out, PAUSE, [tree], image_config(entrypoint=["/pause"], user="65535:65535",
                                                  env=()))


# busybox -------------------------------------------------------------------------------------


def _build_busybox(out: Path) -> None:
    # As the library busybox image the e2e tests use: a shell, no entrypoint. Its name is the
    # e2e manifest's (1.37.0-2) though Debian 12's busybox is 1.35: pods ask for the name, and
    # use the shell and applets, not the version.
    _archive(out, BUSYBOX, [busybox_tree()], image_config(cmd=["sh"]))


# agnhost -------------------------------------------------------------------------------------


def _e2e_image_binary(name: str) -> Path:
    """test/images/<name> of the k8s.io/kubernetes module, built by `module_binary`."""
    return module_binary(name, f"k8s.io/kubernetes/test/images/{name}")


def module_binary(name: str, package: str, main: str = "") -> Path:
    """package built in a copy of e2e/k8s's module (its requirements and replaces, so the
    same k8s.io/* and etcd versions as the control plane); the copy may add go.sum lines for
    the program's own dependencies (e.g. agnhost's sctp) without touching the checkout.
    main: the source of a main package to write into the copy and build instead (package is
    then its folder there), for a program whose module ships no main of its own."""
    default = package == f"k8s.io/kubernetes/test/images/{name}"
    # test/images/<name> keys by its name alone, as before any other package was built here.
    key = digest_of(*([name] if default else [name, package, main]), K8S_MODULE_DIR / "go.mod",
                    K8S_MODULE_DIR / "go.sum", go_version())[:16]
    build = cache_dir() / "build"
    target = build / f"{name}-{key}"
    if target.exists():
        return target
    module = build / "e2e-images-module"
    module.mkdir(parents=True, exist_ok=True)
    for file in ("go.mod", "go.sum"):
        shutil.copyfile(K8S_MODULE_DIR / file, module / file)
    if main:
        (module / package).mkdir(parents=True, exist_ok=True)
        (module / package / "main.go").write_text(main)
        package = f"./{package}"

    def compile_it(partial: Path) -> None:
        log(f"go build {package} (a few minutes when cold)")
        start = time.monotonic()
        run("go", "build", "-mod=mod", "-ldflags=-s -w", "-o", partial, package, cwd=module,
            env={**go_env(), "CGO_ENABLED": "0"})
        log(f"{name} built in {time.monotonic() - start:.0f} s")

    return publish(compile_it, target)


def _agnhost_binary() -> Path:
    return _e2e_image_binary("agnhost")


# What upstream's agnhost image adds to its base (Alpine's bind-tools, curl, netcat-openbsd,
# iproute2, iperf, bash, util-linux-misc, socat), from Debian: the e2e tests exec these in
# agnhost pods, with flags busybox's applets lack (`nc -v -t -w 2`, `curl -g -q -s`,
# `dig +short`).
AGNHOST_PACKAGES = ("bash", "ca-certificates", "curl", "dnsutils", "iperf", "iproute2",
                    "netcat-openbsd", "procps", "socat", "util-linux", "wget")


def _member(tar: Path, name: str) -> bytes:
    """One regular file of a rootfs tar."""
    with tarfile.open(tar) as archive:
        for candidate in (name, f"./{name}"):
            with contextlib.suppress(KeyError):
                member = archive.extractfile(candidate)
                if member is not None:
                    return member.read()
    raise ImageBuildError(f"{tar} has no {name}")


def _check_version(source: Path, image: str, built: str = "") -> None:
    """The VERSION of the image's source folder in the module is the image's tag, or built
    where the module holds a newer source than the tag the e2e manifest asks for (see
    E2E_SUBSTITUTES); else what is built is not what the name says."""
    version = (source / "VERSION").read_text().strip()
    expected = built or image.rpartition(":")[2]
    if version != expected:
        raise ImageBuildError(f"{source.name} is {version} in {source}, expected {expected} "
                              f"(built as {image})")


def _check_base(source: Path, image: str) -> None:
    """The image upstream's Dockerfile builds FROM (BASEIMAGE's linux/amd64 line) is image."""
    bases = dict(line.split("=", 1) for line in (source / "BASEIMAGE").read_text().split())
    wanted = image.rpartition("/")[2]
    if bases["linux/amd64"] != f"REGISTRY/{wanted}-linux-amd64":
        raise ImageBuildError(f"{source.name} is built on {bases['linux/amd64']}, not {wanted}")


def _agnhost_layers() -> list[Tree | Path]:
    """agnhost's two layers: the Debian rootfs with its tools, then agnhost and its files."""
    source = k8s_module() / "test" / "images" / "agnhost"
    _check_version(source, AGNHOST)
    rootfs = debian_rootfs(AGNHOST_PACKAGES)
    tree = Tree()
    # Upstream's Dockerfile: a user and a group the SupplementalGroups tests look for, beside
    # the distribution's own.
    tree.file("/etc/passwd", _member(rootfs, "etc/passwd") + _passwd(
        ("user-defined-in-image", 1000, 1000, "/home/user-defined-in-image", "/bin/sh")))
    tree.file("/etc/group", _member(rootfs, "etc/group")
              + b"user-defined-in-image:x:1000:\n"
              b"group-defined-in-image:x:50000:user-defined-in-image\n")
    tree.dir("/home/user-defined-in-image", uid=1000, gid=1000)
    tree.file("/agnhost", _agnhost_binary(), 0o755)
    # Upstream unpacks a CoreDNS release at /coredns: the DNS tests run it in agnhost pods
    # (`command: [/coredns]`, "should support configurable pod resolv.conf"). The cluster's.
    tree.file("/coredns", _coredns_binary(), 0o755)
    tree.symlink("/usr/local/bin/iperf", "/usr/bin/iperf")
    # entrypoint-tester tests override the entrypoint with agnhost-2.
    tree.symlink("/agnhost-2", "agnhost")
    tree.dir("/uploads")  # netexec's
    for name in ("localhost.crt", "localhost.key"):  # porter's
        tree.file(f"/{name}", source / "porter" / name)
    return [rootfs, tree]


def agnhost_config(cmd: Sequence[str] = ("pause",),
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
    """agnhost's Dockerfile's ENTRYPOINT, CMD and EXPOSE (CMD as the image built FROM it
    sets it)."""
    return image_config(entrypoint=["/agnhost"], cmd=cmd, labels=labels,
                        ports=["80/tcp", "8080/tcp", "8081/tcp", "9376/tcp", "5000/tcp"])


def _build_agnhost(out: Path) -> None:
    _archive(out, AGNHOST, _agnhost_layers(), agnhost_config())


# What an image built here from another source than its name says records it under (a label
# of its config).
BUILT_FROM_LABEL = "io.pyproxy.built-from"


def _build_agnhost_prev(out: Path) -> None:
    # The module holds agnhost's newest source only. The tests that run AgnhostPrev use it as
    # the image before an update (a Deployment's, a StatefulSet's, a Pod's, kubectl diff's),
    # running `pause`, `netexec` and `test-webserver`, which 2.66.1 has: they need a second
    # name, not 2.55's code. The label gives it a config, hence an image ID, of its own:
    # containerd reports a container's image as the first tag of its image ID, so with one ID
    # for both names agnhost:2.66.1's pods would say they run agnhost:2.55.
    _archive(out, AGNHOST_PREV, _agnhost_layers(), agnhost_config(
        labels={BUILT_FROM_LABEL: f"test/images/agnhost {AGNHOST.rpartition(':')[2]}"}))


# nautilus and kitten -------------------------------------------------------------------------

# The module's test/images folders hold a newer version of these than the e2e manifest names
# (its VERSION files): built under the manifest's names from these.
UPDATE_DEMO_SOURCES = {NAUTILUS: ("nautilus", "1.9.0"), KITTEN: ("kitten", "1.9")}


def _build_update_demo(out: Path, image: str) -> None:
    """test/images/nautilus or kitten: agnhost (their BASEIMAGE) serving a picture and a
    data.json naming it from / (agnhost's Dockerfile sets no WORKDIR), `test-webserver`."""
    name, version = UPDATE_DEMO_SOURCES[image]
    source = k8s_module() / "test" / "images" / name
    _check_version(source, image, built=version)
    _check_base(source, AGNHOST)
    tree = Tree()
    tree.file(f"/{name}.jpg", source / "html" / f"{name}.jpg")
    tree.file("/data.json", source / "html" / "data.json")
    _archive(out, image, [*_agnhost_layers(), tree], agnhost_config(
        cmd=["test-webserver"], labels={BUILT_FROM_LABEL: f"test/images/{name} {version}"}))


# nonewprivs ----------------------------------------------------------------------------------


def _build_nonewprivs(out: Path) -> None:
    source = k8s_module() / "test" / "images" / "nonewprivs"
    _check_version(source, NONEWPRIVS)
    tree = Tree()
    # `COPY nnp /usr/local/bin/nnp`, `RUN chmod +s`: setuid and setgid root, so that it runs
    # as uid 0 whoever starts it unless no_new_privs is set (AllowPrivilegeEscalation=false),
    # which is what the test reads from its output ("Effective uid: N").
    tree.file("/usr/local/bin/nnp", _e2e_image_binary("nonewprivs"), 0o6755)
    # Upstream's base is Alpine, busybox's userland on musl; nnp is static, so Debian's static
    # busybox (the busybox image's layer, shared with it) is the same for it.
    _archive(out, NONEWPRIVS, [busybox_tree(), tree], image_config(cmd=["nnp"]))


# sample-apiserver ----------------------------------------------------------------------------


def _build_sample_apiserver(out: Path) -> None:
    # test/images/sample-apiserver clones k8s.io/sample-apiserver at a tag and builds it (its
    # Makefile); here it is the staging module the release requires (e2e/k8s/go.mod replaces
    # it with v0.37.2, the control plane's version), static, on busybox as on Alpine upstream.
    binary = module_binary("sample-apiserver", "k8s.io/sample-apiserver")
    tree = Tree()
    tree.file("/sample-apiserver", binary, 0o755)
    _archive(out, SAMPLE_APISERVER, [busybox_tree(), tree],
             image_config(entrypoint=["/sample-apiserver"]))


# etcd ----------------------------------------------------------------------------------------

# etcd's own main (go.etcd.io/etcd/v3's main.go, what its release binary runs), over the server
# module e2e/k8s/go.mod requires. The control plane's etcd (e2e/k8s/cmd/etcd) is a smaller
# program of this project's: it wants --data-dir and knows no --advertise-client-urls, both of
# which the aggregator test's `/usr/local/bin/etcd --listen-client-urls URL
# --advertise-client-urls URL` relies on.
ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
\tetcdmain.Main(os.Args)
}
"""


def _etcd_binary() -> Path:
    version = ETCD.rpartition(":")[2].split("-")[0]
    go_mod = (K8S_MODULE_DIR / "go.mod").read_text()
    if not re.search(rf"^\s*go\.etcd\.io/etcd/server/v3 v{re.escape(version)}$", go_mod, re.M):
        raise ImageBuildError(f"{K8S_MODULE_DIR / 'go.mod'} does not require etcd {version}")
    return module_binary("etcd", "images-cmd/etcd", ETCD_MAIN)


def _build_etcd(out: Path) -> None:
    tree = Tree()
    # Where the test runs it. Upstream's image also has etcdctl, etcdutl and its migration
    # script, which no e2e test runs.
    tree.file("/usr/local/bin/etcd", _etcd_binary(), 0o755)
    tree.dir("/tmp", 0o1777)
    # No --data-dir in the test: etcd keeps default.etcd in the working folder, the writable
    # root of the container as upstream's (root, no WORKDIR).
    _archive(out, ETCD, [tree], image_config(cmd=["/usr/local/bin/etcd"],
                                             ports=["2379/tcp", "2380/tcp"]))


# glibc-dns-testing ---------------------------------------------------------------------------

# test/images/glibc-dns-testing: Debian bookworm-slim with dnsutils (the DNS tests' "jessie"
# probes run `dig` and glibc's `getent` in it) and a CoreDNS binary at /coredns.
GLIBC_DNS_TESTING_PACKAGES = ("dnsutils",)


def _build_glibc_dns_testing(out: Path) -> None:
    _check_version(k8s_module() / "test" / "images" / "glibc-dns-testing", GLIBC_DNS_TESTING)
    tree = Tree()
    # Upstream unpacks CoreDNS 1.5.0's release there; the one built here for the cluster
    # serves the same purpose (a DNS server some tests start in the pod).
    tree.file("/coredns", _coredns_binary(), 0o755)
    _archive(out, GLIBC_DNS_TESTING, [debian_rootfs(GLIBC_DNS_TESTING_PACKAGES), tree],
             image_config(cmd=["bash"]))


# nginx ---------------------------------------------------------------------------------------

# test/images/nginx is nginx:1.27-alpine under another name: a web server on port 80 serving
# /usr/share/nginx/html, logging to the container's output. Debian's nginx does the same here.
NGINX_PACKAGES = ("nginx",)
NGINX_SITE = b"""server {
    listen 80 default_server;
    listen [::]:80 default_server;
    root /usr/share/nginx/html;
    index index.html;
    location / { try_files $uri $uri/ =404; }
}
"""
NGINX_INDEX = b"<!DOCTYPE html>\n<html><head><title>Welcome to nginx!</title></head>" \
    b"<body><h1>Welcome to nginx!</h1></body></html>\n"


def _build_nginx(out: Path) -> None:
    _check_version(k8s_module() / "test" / "images" / "nginx", NGINX)
    tree = Tree()
    tree.file("/etc/nginx/sites-enabled/default", NGINX_SITE)
    tree.file("/usr/share/nginx/html/index.html", NGINX_INDEX)
    # As the official image: logs to the container's stdout/stderr.
    tree.symlink("/var/log/nginx/access.log", "/dev/stdout")
    tree.symlink("/var/log/nginx/error.log", "/dev/stderr")
    _archive(out, NGINX, [debian_rootfs(NGINX_PACKAGES), tree], image_config(
        cmd=["nginx", "-g", "daemon off;"], ports=["80/tcp"]))


# regression-issue-74839 ----------------------------------------------------------------------


def _build_regression_issue_74839(out: Path) -> None:
    name = "regression-issue-74839"
    _check_version(k8s_module() / "test" / "images" / name, REGRESSION_ISSUE_74839)
    tree = Tree()
    tree.file(f"/{name}", _e2e_image_binary(name), 0o755)
    # Upstream's base is debian-base (bookworm); the program is static and needs no more.
    _archive(out, REGRESSION_ISSUE_74839, [debian_rootfs(), tree],
             image_config(entrypoint=[f"/{name}"]))


# CoreDNS -------------------------------------------------------------------------------------

COREDNS_MODULE = "github.com/coredns/coredns"
# cap_net_bind_service=+ep, as upstream's Dockerfile `setcap`s it, so that the non-root
# server can bind port 53 (vfs_cap_data revision 2: magic|effective, permitted low/high,
# inheritable low/high; CAP_NET_BIND_SERVICE is bit 10).
NET_BIND_SERVICE_CAP = (0x02000001).to_bytes(4, "little") + (1 << 10).to_bytes(4, "little") \
    + bytes(12)


def _coredns_binary() -> Path:
    """CoreDNS from its own module at the version kubeadm deploys; `go install mod@version`
    builds with that module's go.mod and go.sum, as its release does."""
    version = COREDNS.rpartition(":")[2]
    key = digest_of(version, go_version())[:16]
    target = cache_dir() / "build" / f"coredns-{key}"
    if target.exists():
        return target

    def compile_it(partial: Path) -> None:
        log(f"go install {COREDNS_MODULE}@{version} (a few minutes when cold)")
        with tempfile.TemporaryDirectory() as gobin:
            run("go", "install", "-ldflags=-s -w", f"{COREDNS_MODULE}@{version}",
                cwd=Path(gobin), env={**go_env(), "GOBIN": gobin, "GOWORK": "off"})
            shutil.move(Path(gobin) / "coredns", partial)

    return publish(compile_it, target)


def _build_coredns(out: Path) -> None:
    tree = Tree()
    tree.file("/coredns", _coredns_binary(), 0o755,
              xattrs={"security.capability": NET_BIND_SERVICE_CAP})
    tree.dir("/tmp", 0o1777)
    tree.file("/etc/passwd", _passwd(*ROOT_USERS, ("nonroot", 65532, 65532, "/home/nonroot",
                                                   "/sbin/nologin")))
    tree.file("/etc/group", (ROOT_GROUPS + "nonroot:x:65532:\n").encode())
    tree.dir("/home/nonroot", 0o700, uid=65532, gid=65532)
    # Upstream: distroless static:nonroot, USER nonroot, ENTRYPOINT ["/coredns"]. No CA
    # bundle: in a cluster CoreDNS reads the API with its service account's CA.
    _archive(out, COREDNS, [tree], image_config(entrypoint=["/coredns"], user="65532:65532",
                                                ports=["53/tcp", "53/udp"]))


# kube-proxy ----------------------------------------------------------------------------------

KUBE_PROXY_PACKAGES = ("nftables", "iptables", "conntrack", "ca-certificates")


def _kube_proxy_binary() -> Path:
    """The kube-proxy `make k8s` builds (e2e/k8s/build.sh), built first if missing."""
    binary = Path(run(BUILD_SCRIPT, "--path", capture=True).strip()) / "kube-proxy"
    if not binary.exists():
        log("kube-proxy is not built yet: running e2e/k8s/build.sh (make k8s)")
        run(BUILD_SCRIPT)
    return binary


def _build_kube_proxy(out: Path) -> None:
    tree = Tree()
    # Where upstream's image and kubeadm's DaemonSet (`command: /usr/local/bin/kube-proxy`)
    # have it.
    tree.file("/usr/local/bin/kube-proxy", _kube_proxy_binary(), 0o755)
    _archive(out, KUBE_PROXY, [debian_rootfs(KUBE_PROXY_PACKAGES), tree],
             image_config(entrypoint=["/usr/local/bin/kube-proxy"]))


def _module_inputs() -> list[str | bytes | Path]:
    """What a program built in a copy of e2e/k8s's module depends on (module_binary)."""
    return [K8S_MODULE_DIR / "go.mod", K8S_MODULE_DIR / "go.sum", go_version()]


RECIPES: dict[str, Recipe] = {recipe.name: recipe for recipe in (
    Recipe(PAUSE, "pause", HERE, lambda: [_pause_source(), "gcc " + deb_version("gcc")],
           _build_pause),
    Recipe(BUSYBOX, "busybox", HERE, lambda: [deb_version("busybox-static")], _build_busybox),
    Recipe(AGNHOST, "agnhost", HERE,
           lambda: [K8S_MODULE_DIR / "go.mod", K8S_MODULE_DIR / "go.sum", go_version(),
                    *AGNHOST_PACKAGES], _build_agnhost),
    Recipe(COREDNS, "coredns", HERE, lambda: [go_version()], _build_coredns),
    Recipe(GLIBC_DNS_TESTING, "glibc-dns-testing", HERE,
           lambda: [go_version(), *GLIBC_DNS_TESTING_PACKAGES], _build_glibc_dns_testing),
    Recipe(NGINX, "nginx", HERE, lambda: [*NGINX_PACKAGES], _build_nginx),
    Recipe(REGRESSION_ISSUE_74839, "regression-issue-74839", HERE,
           lambda: [K8S_MODULE_DIR / "go.mod", K8S_MODULE_DIR / "go.sum", go_version()],
           _build_regression_issue_74839),
    Recipe(AGNHOST_PREV, "agnhost-prev", HERE, lambda: [*_module_inputs(), *AGNHOST_PACKAGES],
           _build_agnhost_prev),
    Recipe(NAUTILUS, "nautilus", HERE, lambda: [*_module_inputs(), *AGNHOST_PACKAGES],
           lambda out: _build_update_demo(out, NAUTILUS)),
    Recipe(KITTEN, "kitten", HERE, lambda: [*_module_inputs(), *AGNHOST_PACKAGES],
           lambda out: _build_update_demo(out, KITTEN)),
    Recipe(NONEWPRIVS, "nonewprivs", HERE,
           lambda: [*_module_inputs(), deb_version("busybox-static")], _build_nonewprivs),
    Recipe(SAMPLE_APISERVER, "sample-apiserver", HERE,
           lambda: [*_module_inputs(), deb_version("busybox-static")], _build_sample_apiserver),
    Recipe(ETCD, "etcd", HERE, lambda: [*_module_inputs(), ETCD_MAIN], _build_etcd),
    Recipe(KUBE_PROXY, "kube-proxy", HERE,
           lambda: [_kube_proxy_binary(), *KUBE_PROXY_PACKAGES], _build_kube_proxy),
    pyproxy_recipe(PYPROXY),
)}
# The short names the command line takes.
ALIASES = {recipe.slug: name for name, recipe in RECIPES.items()}


def ensure_images(names: Iterable[str] | None = None, pyproxy_tag: str = PYPROXY,
                  ) -> list[ImageArchive]:
    """The archives of the named images (all when None), in that order, each built only if
    missing or out of date. Names are the full image names (PAUSE, AGNHOST…) or slugs."""
    recipes = dict(RECIPES)
    if pyproxy_tag != PYPROXY:
        del recipes[PYPROXY]
        recipes[pyproxy_tag] = pyproxy_recipe(pyproxy_tag)
    aliases = {recipe.slug: name for name, recipe in recipes.items()}
    chosen = list(recipes) if names is None else [aliases.get(n, n) for n in names]
    unknown = [name for name in chosen if name not in recipes]
    if unknown:
        raise ImageBuildError(f"unknown image {', '.join(unknown)}; known: "
                              + ", ".join(sorted(aliases)))
    with cache_lock():
        return [ensure_image(recipes[name]) for name in chosen]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"images to build (default: all): {', '.join(ALIASES)} "
                        "or full names")
    parser.add_argument("--pyproxy-tag", default=PYPROXY,
                        help=f"the name of pyproxy's image (default {PYPROXY})")
    parser.add_argument("--path-only", action="store_true",
                        help="print only the archives' paths")
    args = parser.parse_args(argv)
    try:
        archives = ensure_images(args.names or None, pyproxy_tag=args.pyproxy_tag)
    except ImageBuildError as err:
        print(f"images: {err}", file=sys.stderr)
        return 1
    for archive in archives:
        print(archive.path if args.path_only else f"{archive.name} {archive.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
