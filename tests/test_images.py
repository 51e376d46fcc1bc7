"""The cluster's images (testkit/images.py, written as image/oci.py's archives): archive
layout, the names Kubernetes expects, the cache (pyproxy's own build steps, with a fake
buildah, are test_shipping.py's). Building the Go images (agnhost,
CoreDNS) and the Debian-based ones belongs to `make images`, not to the suite: these tests
build only pause and busybox (under a second), into a temporary cache."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from image import oci
from testkit import images
from testkit.fixtures import requires_netns
from testkit.waits import until

MODULE = Path.home() / "go" / "pkg" / "mod" / f"k8s.io/kubernetes@{images.RELEASE}"
needs_module = pytest.mark.skipif(not MODULE.is_dir(), reason=f"no {MODULE} (make k8s)")
needs_tools = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("gcc", "busybox", "go", "file")),
    reason="needs gcc, busybox-static, go and file (make images installs them)")


@pytest.fixture(name="cache")
def cache_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own, so the real one is neither used nor changed."""
    monkeypatch.setenv("PYPROXY_K8S_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "images"


def members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return {m.name: m for m in tar.getmembers()}


def layer_members(archive: Path, manifest: dict[str, object]) -> dict[str, tarfile.TarInfo]:
    layers = manifest["layers"]
    assert isinstance(layers, list)
    found: dict[str, tarfile.TarInfo] = {}
    with tarfile.open(archive) as outer:
        for layer in layers:
            blob = outer.extractfile("blobs/sha256/" + layer["digest"].removeprefix("sha256:"))
            assert blob is not None
            with tarfile.open(fileobj=blob, mode="r:gz") as inner:
                found.update({m.name: m for m in inner.getmembers()})
    return found


class TestArchive:
    def test_layout_names_the_image_and_checks_out(self, tmp_path: Path) -> None:
        """An archive is an OCI layout whose index names the image for containerd, and whose
        digests, sizes and diff IDs are those of the blobs it holds."""
        tree = images.Tree()
        tree.file("/bin/tool", b"#!/bin/sh\n", 0o755)
        tree.symlink("/bin/alias", "/bin/tool")
        tree.dir("/tmp", 0o1777)
        out = tmp_path / "a.tar"
        config = oci.image_config(entrypoint=["/bin/tool"], cmd=["run"], user="65535:65535",
                                     ports=["53/udp"])
        with_layer = tmp_path / "layer.tar"
        tree.write(with_layer)
        oci.write_archive(out, "registry.example/x/tool:1.2-3", [with_layer], config)

        assert {"oci-layout", "index.json"} <= set(members(out))
        index, manifest, image = oci.read_archive(out)
        (entry,) = index["manifests"]
        assert entry["annotations"] == {"io.containerd.image.name": "registry.example/x/tool:1.2-3",
                                        "org.opencontainers.image.ref.name": "1.2-3"}
        assert entry["mediaType"] == oci.MANIFEST_MEDIA
        assert image["config"] == {"Entrypoint": ["/bin/tool"], "Cmd": ["run"],
                                   "User": "65535:65535", "Env": [oci.PATH_ENV],
                                   "WorkingDir": "/", "ExposedPorts": {"53/udp": {}}}
        assert (image["os"], image["architecture"]) == ("linux", "amd64")
        with tarfile.open(out) as tar:
            def blob(digest: str) -> bytes:
                member = tar.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
                assert member is not None
                return member.read()

            for descriptor in (entry, manifest["config"], *manifest["layers"]):
                data = blob(descriptor["digest"])
                assert len(data) == descriptor["size"]
                assert "sha256:" + hashlib.sha256(data).hexdigest() == descriptor["digest"]
            (layer,) = manifest["layers"]
            raw = gzip.decompress(blob(layer["digest"]))
        assert image["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest()]
        files = layer_members(out, manifest)
        assert sorted(files) == ["bin", "bin/alias", "bin/tool", "tmp"]
        assert files["bin/alias"].issym() and files["bin/alias"].linkname == "/bin/tool"
        assert files["tmp"].mode == 0o1777 and files["bin/tool"].mode == 0o755
        assert {(m.mtime, m.uid, m.uname) for m in files.values()} == {(0, 0, "")}

    def test_the_same_inputs_give_the_same_bytes(self, tmp_path: Path) -> None:
        """Archives are deterministic: no timestamps, so a rebuild has the same digests."""
        tree = images.Tree()
        tree.file("/x", b"x" * 1000, xattrs={"security.capability":
                                             images.NET_BIND_SERVICE_CAP})
        outs = []
        for i in range(2):
            layer = tmp_path / f"{i}.layer"
            tree.write(layer)
            outs.append(tmp_path / f"{i}.tar")
            oci.write_archive(outs[-1], "x:1", [layer], oci.image_config())
        assert outs[0].read_bytes() == outs[1].read_bytes()
        with tarfile.open(tmp_path / "0.layer") as tar:
            # containerd applies SCHILY.xattr records: the file capability survives import.
            value = tar.getmember("x").pax_headers["SCHILY.xattr.security.capability"]
        assert value.encode("utf-8", "surrogateescape") == images.NET_BIND_SERVICE_CAP


@needs_module
def test_names_are_the_ones_the_release_uses() -> None:
    """The image names are the e2e manifest's and kubeadm's for the pinned release."""
    go_mod = (images.K8S_MODULE_DIR / "go.mod").read_text()
    assert re.search(rf"^\s*k8s\.io/kubernetes {re.escape(images.RELEASE)}\b", go_mod, re.M)
    manifest = (MODULE / "test/utils/image/manifest.go").read_text()
    registries = dict(re.findall(r'^\s*(\w+Registry):\s*"([^"]+)",', manifest, re.M))
    assert registries["PromoterE2eRegistry"] == "registry.k8s.io/e2e-test-images"
    assert images.E2E_MANIFEST_IDS["Agnhost"] == images.AGNHOST
    for key, name in images.E2E_MANIFEST_IDS.items():
        found = re.search(rf'configs\[{key}\] = Config\{{list\.(\w+), "([^"]+)", '
                          r'"([^"]+)"\}', manifest)
        assert found, key
        assert name == f"{registries[found[1]]}/{found[2]}:{found[3]}", key
        assert name in images.RECIPES, key
    constants = (MODULE / "cmd/kubeadm/app/constants/constants.go").read_text()
    coredns = re.search(r'CoreDNSVersion = "([^"]+)"', constants)
    pause = re.search(r'PauseVersion = "([^"]+)"', constants)
    assert coredns and f"registry.k8s.io/coredns/coredns:{coredns[1]}" == images.COREDNS
    assert pause and f"registry.k8s.io/pause:{pause[1]}" == images.PAUSE
    assert f"registry.k8s.io/kube-proxy:{images.RELEASE}" == images.KUBE_PROXY


# Upstream's nftables job's skip (testkit/conformance.py's SKIP), and Serial: the selection
# whose images are built here.
SELECTION_SKIP = re.compile(r"Alpha|Beta|LoadBalancer|Disruptive|Flaky|Networking-IPv6"
                            r"|IPv6DualStack|LocalhostNodePorts|Serial")
# Image IDs that the selected tests' files, the e2e framework or common/util.go name, though no
# selected [Conformance] test runs them: why each is not built.
NOT_RUN_BY_CONFORMANCE = {
    "AgnhostPrivate": "apps/rc.go, replica_set.go: their private-registry tests only",
    "AppArmorLoader": "framework/security: the AppArmor tests",
    "InvalidRegistryImage": "common/node/runtime.go: a pull meant to fail, NodeConformance",
    "IpcUtils": "common/util.go's pre-pull list (--prepull-images) only",
    "NginxNew": "common/util.go's pre-pull list and template values only",
    "NonRoot": "common/node/security_context.go: the runAsNonRoot tests, NodeConformance",
    "ResourceConsumer": "framework/autoscaling: the HPA tests",
    "VolumeNFSServer": "framework/volume and the pre-pull list: storage tests",
}


@needs_module
def test_every_image_the_conformance_selection_names_is_built() -> None:
    """Each image ID that the files of the [Conformance] tests selected (upstream's nftables
    job's focus and skip, without Serial), the e2e framework and common/util.go's templates
    name is built here, or is known to be run by none of those tests: a release that adds an
    image to them fails here."""
    import yaml

    tests = yaml.safe_load((MODULE / "test/conformance/testdata/conformance.yaml").read_text())
    files = {MODULE / t["file"] for t in tests if not SELECTION_SKIP.search(t["codename"])}
    files |= {p for p in (MODULE / "test/e2e/framework").rglob("*.go")
              if not p.name.endswith("_test.go")}
    files.add(MODULE / "test/e2e/common/util.go")
    manifest = (MODULE / "test/utils/image/manifest.go").read_text()
    ids = set(re.findall(r"^\s*configs\[(\w+)\] = Config", manifest, re.M))
    named = {m for f in files for m in re.findall(r"imageutils\.(\w+)\b", f.read_text())}
    assert named & ids - set(images.E2E_MANIFEST_IDS) - set(NOT_RUN_BY_CONFORMANCE) == set()
    assert set(NOT_RUN_BY_CONFORMANCE) <= named & ids


@needs_module
def test_the_images_are_what_the_tests_run() -> None:
    """What the new images' recipes take from upstream's sources still holds: where the
    aggregator test runs etcd and with which flags, the files nautilus and kitten add to
    agnhost (which sets no WORKDIR), nonewprivs' setuid nnp, sample-apiserver's entrypoint
    and the module version it is built from."""
    e2e, test_images = MODULE / "test/e2e", MODULE / "test/images"
    aggregator = (e2e / "apimachinery/aggregator.go").read_text()
    assert re.search(r'Image: etcdImage,\s*Command: \[\]string\{\s*"/usr/local/bin/etcd",\s*'
                     r'"--listen-client-urls",\s*etcdURL,\s*"--advertise-client-urls",',
                     aggregator)
    assert "WORKDIR" not in (test_images / "agnhost/Dockerfile").read_text()
    for name in ("nautilus", "kitten"):
        dockerfile = (test_images / name / "Dockerfile").read_text()
        assert f"COPY html/{name}.jpg {name}.jpg\nCOPY html/data.json data.json\n" \
            'CMD ["test-webserver"]' in dockerfile
        assert f"{name}.jpg" in (test_images / name / "html/data.json").read_text()
    nnp = (test_images / "nonewprivs/Dockerfile").read_text()
    assert "COPY nnp /usr/local/bin/nnp\nRUN chmod +s /usr/local/bin/nnp" in nnp
    assert 'CMD ["nnp"]' in nnp
    assert 'ENTRYPOINT ["/sample-apiserver"]' in (
        test_images / "sample-apiserver/Dockerfile").read_text()
    go_mod = (images.K8S_MODULE_DIR / "go.mod").read_text()
    assert re.search(rf"k8s\.io/sample-apiserver => k8s\.io/sample-apiserver "
                     rf"v0\.{images.RELEASE.split('.')[1]}\.", go_mod)


def test_a_version_or_base_other_than_expected_is_refused(tmp_path: Path) -> None:
    """A source folder whose VERSION or BASEIMAGE is not the one a recipe was written for
    stops the build (a release bump must be looked at, not built under an old name)."""
    source = tmp_path / "nautilus"
    source.mkdir()
    (source / "VERSION").write_text("1.9.0\n")
    (source / "BASEIMAGE").write_text("linux/amd64=REGISTRY/agnhost:2.66.1-linux-amd64\n"
                                      "linux/arm64=REGISTRY/agnhost:2.66.1-linux-arm64\n")
    images._check_version(source, images.NAUTILUS, built="1.9.0")
    images._check_base(source, images.AGNHOST)
    with pytest.raises(oci.ImageBuildError, match=re.escape("expected 1.8 ")):
        images._check_version(source, images.NAUTILUS)
    with pytest.raises(oci.ImageBuildError, match=re.escape("not agnhost:2.55")):
        images._check_base(source, images.AGNHOST_PREV)


@needs_module
@needs_tools
def test_pause_and_busybox_are_built_once(cache: Path) -> None:
    """pause and busybox build into the cache with upstream's entrypoint and user, and a
    second call finds them without building anything."""
    pause, busybox = images.ensure_images([images.PAUSE, "busybox"])
    assert (pause.name, busybox.name) == (images.PAUSE, images.BUSYBOX)
    assert pause.path.parent == busybox.path.parent == cache
    index, manifest, config = oci.read_archive(pause.path)
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == images.PAUSE
    assert config["config"]["Entrypoint"] == ["/pause"]
    assert config["config"]["User"] == "65535:65535"
    assert set(layer_members(pause.path, manifest)) == {"pause"}
    _, manifest, config = oci.read_archive(busybox.path)
    assert config["config"]["Cmd"] == ["sh"]
    files = layer_members(busybox.path, manifest)
    for applet in ("bin/sh", "usr/bin/nc", "usr/bin/wget", "usr/bin/nslookup"):
        assert files[applet].linkname == "/bin/busybox", applet
    stamps = {a.path: a.path.stat().st_mtime_ns for a in (pause, busybox)}
    again = images.ensure_images(["pause", "busybox"])
    assert [a.path for a in again] == [pause.path, busybox.path]
    assert {a.path: a.path.stat().st_mtime_ns for a in again} == stamps


def test_unknown_names_are_refused(cache: Path) -> None:
    with pytest.raises(oci.ImageBuildError, match="unknown image no-such-image"):
        images.ensure_images(["no-such-image"])
    assert images.main(["no-such-image"]) == 1


@requires_netns
@needs_module
@needs_tools
@pytest.mark.skipif(not (shutil.which("runc") and shutil.which("umoci")),
                    reason="needs runc and umoci")
def test_pause_runs_from_its_archive(cache: Path, tmp_path: Path) -> None:
    """The pause archive unpacks into an OCI bundle that runc starts: it runs as 65535 and
    exits on SIGTERM."""
    (pause,) = images.ensure_images([images.PAUSE])
    layout = tmp_path / "layout"
    layout.mkdir()
    with tarfile.open(pause.path) as tar:
        tar.extractall(layout, filter="data")
    bundle = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:3.10.2", str(bundle)], check=True,
                   capture_output=True)
    spec = json.loads((bundle / "config.json").read_text())
    assert spec["process"]["args"] == ["/pause"]
    assert spec["process"]["user"]["uid"] == 65535
    spec["process"]["terminal"] = False  # detached: no console socket to hand a tty to
    (bundle / "config.json").write_text(json.dumps(spec))
    name = f"pyproxy-test-pause-{os.getpid()}"
    root = tmp_path / "runc"
    runc = ["runc", "--root", str(root)]
    # No pipes: the container would hold them open, and run would wait for its end.
    subprocess.run([*runc, "run", "--detach", "--bundle", str(bundle), name], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=30)
    try:
        state = json.loads(subprocess.run([*runc, "state", name], check=True,
                                          capture_output=True, text=True).stdout)
        assert state["status"] == "running"
        status = Path(f"/proc/{state['pid']}/status").read_text()
        assert re.search(r"^Uid:\s+65535\b", status, re.M)
        subprocess.run([*runc, "kill", name, "TERM"], check=True, capture_output=True)
        until(lambda: json.loads(subprocess.run(
            [*runc, "state", name], check=True, capture_output=True, text=True,
        ).stdout)["status"] == "stopped", 10, "pause exits on SIGTERM")
    finally:
        subprocess.run([*runc, "delete", "--force", name], capture_output=True, check=False)


CONTAINERD_CONFIG = """version = 3
root = "{dir}/root"
state = "{dir}/state"
# An image store and a runtime only: no CRI, no sandboxes.
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime",
                    "io.containerd.cri.v1.images",
                    "io.containerd.podsandbox.controller.v1.podsandbox",
                    "io.containerd.sandbox.controller.v1.shim"]
[grpc]
  address = "{dir}/containerd.sock"
[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
"""


# The user's cache, before the `cache` fixture points the variable at a temporary one.
USER_CACHE = os.environ.get("PYPROXY_K8S_CACHE")


def k8s_bin() -> Path:
    """Where `make k8s` put the binaries (the real cache, not a test's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYPROXY_K8S_CACHE"}
    if USER_CACHE:
        env["PYPROXY_K8S_CACHE"] = USER_CACHE
    out = subprocess.run([str(images.BUILD_SCRIPT), "--path"], capture_output=True, text=True,
                         check=True, env=env)
    return Path(out.stdout.strip())


@requires_netns
@needs_module
@needs_tools
@pytest.mark.skipif(not shutil.which("runc"), reason="needs runc")
def test_containerd_imports_and_runs_the_archives(cache: Path, tmp_path: Path) -> None:
    """A containerd of its own (the nodes' build, `make k8s`; its own state, socket and
    snapshots in a temporary folder) imports the archives under their names, and runs a
    shell from busybox's."""
    bin_dir = k8s_bin()
    if not (bin_dir / "containerd").exists():
        pytest.skip(f"no containerd in {bin_dir} (make k8s)")
    archives = images.ensure_images([images.PAUSE, images.BUSYBOX])
    short = Path(tempfile.mkdtemp(prefix="ctr-", dir="/tmp"))  # a socket path must be short
    (short / "config.toml").write_text(CONTAINERD_CONFIG.format(dir=short))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with (tmp_path / "containerd.log").open("w") as log:
        daemon = subprocess.Popen([str(bin_dir / "containerd"), "--config",
                                   str(short / "config.toml")], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    ctr = [str(bin_dir / "ctr"), "--address", str(short / "containerd.sock"), "-n", "k8s.io"]

    def run_ctr(*args: str) -> str:
        return subprocess.run([*ctr, *args], env=env, capture_output=True, text=True,
                              check=True, timeout=60).stdout

    try:
        until(lambda: (short / "containerd.sock").exists(), 20, "containerd listens")
        for archive in archives:
            run_ctr("images", "import", str(archive.path))
        assert set(run_ctr("images", "ls", "-q").split()) == {images.PAUSE, images.BUSYBOX}
        out = run_ctr("run", "--rm", images.BUSYBOX, f"sh-{os.getpid()}", "sh", "-c",
                      "echo hello from $(readlink /bin/sh); id -u")
        assert out.split() == ["hello", "from", "/bin/busybox", "0"]
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        # The snapshots are overlay mounts under root/: unmount before removing.
        subprocess.run(["umount", "-R", str(short / "root")], capture_output=True, check=False)
        shutil.rmtree(short, ignore_errors=True)


def test_another_checkouts_recent_archive_is_kept(tmp_path: Path) -> None:
    """Two checkouts of different commits share the cache: the other's archive of the same
    image, built minutes ago, may be being imported into a cluster right now (a drill failed
    with "no such file" when a second checkout built its own). Only archives untouched for a
    day are removed, and never another tag's or another image's."""
    now = 1_000_000.0
    target = tmp_path / "pyproxy-0.1.0-aaaaaaaaaaaaaaaa.tar"

    def archive(name: str, age: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"")
        os.utime(path, (now - age, now - age))
        return path

    archive(target.name, 0)
    recent = archive("pyproxy-0.1.0-bbbbbbbbbbbbbbbb.tar", 600)
    old = archive("pyproxy-0.1.0-cccccccccccccccc.tar", oci.STALE_ARCHIVE_AGE + 1)
    other_tag = archive("pyproxy-dev-dddddddddddddddd.tar", oci.STALE_ARCHIVE_AGE + 1)
    gone = tmp_path / "pyproxy-0.1.0-eeeeeeeeeeeeeeee.tar"  # removed by another checkout
    candidates = [target, recent, old, other_tag, gone]
    assert oci.stale_archives(target, candidates, now) == [old]
