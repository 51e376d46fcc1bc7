import os
import sys

import pytest

# tests/ holds helper modules (builders, netlab, nftns, apiemu) imported by the tests.
sys.path.insert(0, os.path.dirname(__file__))

from netlab import NETNS_USABLE, cluster_fixture, lab_fixture  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # CI runs as root: a kernel test that silently skips there would hide a broken data plane.
    if os.environ.get("CI") and not NETNS_USABLE and any(i.get_closest_marker("netns")
                                                         for i in items):
        raise pytest.UsageError("CI must run the network-namespace tests (needs root, ip netns)")
