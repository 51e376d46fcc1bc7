"""The kit's pytest side: skip marks and fixtures (tests/conftest.py registers the fixtures
by importing them). The rest of the kit does not import pytest, so the demo, the drills and
the benches use it without a test runner."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.cluster import NODE_BINARIES, RealCluster, running_cluster
from testkit.controlplane import (
    BINARIES,
    ControlPlane,
    binaries_dir,
    missing_binaries,
    running_control_plane,
)
from testkit.netlab import NETNS_USABLE, Cluster, Lab
from testkit.tools import tool_path

requires_netns = pytest.mark.skipif(
    not NETNS_USABLE, reason="needs root and `ip netns` (network namespaces)"
)
requires_nft = pytest.mark.skipif(shutil.which("nft") is None, reason="needs the nft tool")


def _built(binary: Path, target: str) -> Path:
    if not os.access(binary, os.X_OK):
        message = f"{binary} is not built: run `make {target}`"
        if os.environ.get("CI"):  # CI builds it first: a skip there would hide the test
            pytest.fail(message)
        pytest.skip(message)
    return binary


def require_tool(name: str) -> Path:
    """NAME's binary (promtool, helm, syft: `make tools`); the test is skipped when it is not
    built, and fails in CI."""
    return _built(tool_path(name), "tools")


def require_kubectl() -> Path:
    """The control plane's kubectl (`make k8s`); the test is skipped when it is not built, and
    fails in CI."""
    return _built(binaries_dir() / "kubectl", "k8s")


@pytest.fixture(name="lab")
def lab_fixture() -> Iterator[Lab]:
    """A fresh Lab, closed after the test whatever happens (skips where netns are unusable)."""
    if not NETNS_USABLE:
        pytest.skip("needs root and `ip netns` (network namespaces)")
    with Lab() as the_lab:
        yield the_lab


@pytest.fixture(name="cluster")
def cluster_fixture(lab: Lab) -> Cluster:
    """The standard topology with two backend pods (pod-a, pod-b), TCP 8080 and UDP 5353."""
    return lab.standard_topology()


@pytest.fixture(scope="session", name="control_plane")
def control_plane_fixture() -> Iterator[ControlPlane]:
    """The control plane, started once per test session (about 4 s, ~400 MB)."""
    if not NETNS_USABLE:
        pytest.skip("needs root and `ip netns` (network namespaces)")
    bin_dir = binaries_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        message = (f"the control plane is not built ({', '.join(missing)} missing in "
                   f"{bin_dir}): run `make k8s`")
        if os.environ.get("CI"):  # CI builds it first: a skip there would hide the k8s tests
            pytest.fail(message)
        pytest.skip(message)
    with running_control_plane(bin_dir) as plane:
        yield plane


@pytest.fixture(scope="session", name="real_cluster")
def real_cluster_fixture() -> Iterator[RealCluster]:
    """The real two-node cluster with pyproxy deployed (testkit/cluster.py), once per test
    session: the smoke tests and upstream's Services conformance tests share it (about 90 s to
    bring up)."""
    require_cluster_binaries()
    with running_cluster(2) as cluster:
        yield cluster


def require_cluster_binaries() -> None:
    """Skip (fail under CI) unless netns work and `make k8s` has built the real nodes'
    binaries."""
    if not NETNS_USABLE:
        pytest.skip("needs root and `ip netns` (network namespaces)")
    bin_dir = binaries_dir()
    missing = [name for name in (*BINARIES, *NODE_BINARIES)
               if not os.access(bin_dir / name, os.X_OK)]
    if missing:
        message = f"make k8s has not built {', '.join(missing)} in {bin_dir}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
