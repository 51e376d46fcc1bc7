"""The Containerfile built the way an operator builds it (issue 35, point 5): `buildah bud` of
a clean copy of the checkout (what `git ls-files` lists: no virtualenv, no caches, no .git),
no build argument, then `pyproxy version` in the image. `make image` (image/build.py) is
the other route, offline, tested with a fake buildah in test_shipping.py.

What the test prepares, none of it a build argument:
- the base, `debian:bookworm-slim`: this machine reaches no container registry, so it is made
  from Debian's packages into buildah's storage if missing (build.ensure_debian_base, as
  `make image` does); the build itself pulls nothing;
- pip's trust: the build's RUN steps reach Debian's archive (plain HTTP) and PyPI (HTTPS)
  through buildah's default isolated network, but this machine's egress proxy re-signs TLS
  with a CA of its own (in the host's bundle, not in Debian's), so pip in the build would
  refuse PyPI's certificate. The RUN steps get pip's site configuration folder
  (/etc/xdg/pip) mounted from the host, naming the host's bundle: nothing is copied into a
  layer, and on a machine without such a proxy the host's bundle trusts what Debian's does.

buildah's layer cache is used (`--layers`, which docker and podman do by default): the
Debian packages' and the pinned dependencies' layers are built once per Containerfile and
lock, later runs rebuild from the copy of pyproxy/ on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from image import build

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
TAG = "localhost/pyproxy-plain-build:test"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PIP_SITE_CONFIG = "/etc/xdg/pip"  # pip reads $XDG_CONFIG_DIRS/pip/pip.conf, /etc/xdg first
BUILD_TIMEOUT_S = 1800

# Needs root (buildah's storage, namespaces for the RUN steps): out of `make unit` with the
# other tests that need root and network namespaces.
pytestmark = [pytest.mark.netns, pytest.mark.image]


def _cannot_build() -> str | None:
    if os.geteuid() != 0:
        return "needs root (buildah's storage, namespaces for the RUN steps)"
    if shutil.which("buildah") is None:
        return "needs buildah (`make images` installs it)"
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return "needs a git checkout and git (the clean copy is what git tracks)"
    return None


@pytest.fixture(name="context", scope="module")
def context_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean copy of the checkout: the files git tracks or would track, as they are now."""
    why = _cannot_build()
    if why:
        # As tests/conftest.py has it for the namespace tests: CI must not skip these.
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    context = tmp_path_factory.mktemp("context")
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # tracked but deleted in the work tree: not there
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, context / name, follow_symlinks=False)
    build.ensure_debian_base()
    return context


@pytest.fixture(name="pip_trust", scope="module")
def pip_trust_fixture(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """buildah's volume flags that give the RUN steps' pip the host's CA bundle."""
    if not HOST_CA_BUNDLE.exists():
        return []
    folder = tmp_path_factory.mktemp("pip")
    shutil.copy2(HOST_CA_BUNDLE, folder / "host-ca.crt")
    (folder / "pip.conf").write_text(f"[global]\ncert = {PIP_SITE_CONFIG}/host-ca.crt\n")
    return ["--volume", f"{folder}:{PIP_SITE_CONFIG}:ro"]


def _bud(context: Path, tag: str, *flags: str) -> float:
    """`buildah bud` of context's Containerfile; the seconds it took."""
    start = time.monotonic()
    result = subprocess.run(["buildah", "bud", "--layers", *flags, "-t", tag, str(context)],
                            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                            check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return time.monotonic() - start


@pytest.fixture(name="in_image")
def in_image_fixture() -> Iterator[list[str]]:
    """The containers in_image's callers make from an image; removed after the test."""
    made: list[str] = []
    yield made
    for container in made:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


def _run(containers: list[str], tag: str, *argv: str) -> str:
    """argv's output in a container of tag, as `docker run --entrypoint` would run it."""
    container = subprocess.run(["buildah", "from", "--pull=never", tag], capture_output=True,
                               text=True, check=True).stdout.strip()
    containers.append(container)
    result = subprocess.run(["buildah", "run", container, "--", *argv], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_plain_build_gives_a_working_image(context: Path, pip_trust: list[str],
                                             in_image: list[str]) -> None:
    """No build argument: the image runs pyproxy, says the source's version, and says the
    commit is unknown (a build context need not be a checkout, and nothing passed one)."""
    seconds = _bud(context, TAG, *pip_trust)
    print(f"buildah bud, no build arguments: {seconds:.0f} s")
    out = _run(in_image, TAG, "pyproxy", "version", "-o", "json")
    reported = json.loads(out)
    assert (reported["version"], reported["commit"]) == (VERSION, "unknown")
    assert reported["python"].startswith("3.11.")  # Debian 12's, whose nftables binding it is
    # The image as the Containerfile leaves it: no sources, no offline pip configuration, and
    # the test's pip folder an empty mount point.
    left = _run(in_image, TAG, "sh", "-c",
                f"ls -d /src /opt/pyproxy/pip.conf 2>/dev/null; ls -A {PIP_SITE_CONFIG}")
    assert left == ""
    config = json.loads(subprocess.run(["buildah", "inspect", "--type=image", TAG],
                                       capture_output=True, text=True, check=True).stdout)
    assert config["OCIv1"]["config"]["Entrypoint"] == ["pyproxy"]


def test_the_revision_argument_is_the_commit_it_prints(context: Path, pip_trust: list[str],
                                                       in_image: list[str]) -> None:
    """`--build-arg REVISION=...` (what `make image` passes) is the commit `pyproxy
    --version` prints in the image: the package recorded it at build time."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    tag = TAG + "-revision"
    seconds = _bud(context, tag, *pip_trust, "--build-arg", f"REVISION={head}")
    print(f"buildah bud, REVISION: {seconds:.0f} s")
    assert _run(in_image, tag, "pyproxy", "--version") == f"pyproxy {VERSION} (commit {head})\n"
