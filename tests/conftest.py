import os

import pytest
from hypothesis import HealthCheck, settings

# The kit (testkit/, at the repository root: pyproject.toml's `pythonpath`) holds the lab,
# builders, fakes, the API emulator and the control plane; its fixtures register here.
from testkit.fixtures import (  # noqa: F401
    cluster_fixture,
    control_plane_fixture,
    lab_fixture,
    real_cluster_fixture,
)
from testkit.netlab import NETNS_USABLE

# Hypothesis times each example (200 ms) and its data generation by default: absolute times,
# which a shared 2-core machine misses now and then (a property test of render/_block_difference
# failed so once under load). The properties are what the tests assert; time is for the benches.
settings.register_profile("pyproxy", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pyproxy")


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
