import os
import sys

import pytest

# tests/ holds helper modules (builders, netlab, nftns, apiemu) imported by the tests.
sys.path.insert(0, os.path.dirname(__file__))

from controlplane import control_plane_fixture  # noqa: F401
from netlab import NETNS_USABLE, cluster_fixture, lab_fixture  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The tests against the real control plane run first and those marked k8s_last at the very
    # end: the quiet-watch test needs its daemon to sit through minutes of a quiet API server,
    # which the rest of the suite provides instead of a sleep.
    items.sort(key=lambda i: (0 if i.get_closest_marker("k8s_last") is None
                              and i.get_closest_marker("k8s") else
                              2 if i.get_closest_marker("k8s_last") else 1))
    # CI runs as root: a kernel test that silently skips there would hide a broken data plane.
    if os.environ.get("CI") and not NETNS_USABLE and any(i.get_closest_marker("netns")
                                                         for i in items):
        raise pytest.UsageError("CI must run the network-namespace tests (needs root, ip netns)")
