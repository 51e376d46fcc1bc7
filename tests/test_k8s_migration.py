"""From the real kube-proxy to pyproxy and back on one node, under traffic: the short version
of the migration drill (drills/migration.py; `make chaos` runs the long one). The procedure is
docs/deploying.md's: start the new proxy while the old one runs, wait for its first sync, stop
the old one, remove its tables (`pyproxy cleanup --kube-proxy`, or `pyproxy cleanup` going
back)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from drills import migration as m
from drills import scenarios as d
from testkit.controlplane import ControlPlane
from testkit.fixtures import requires_netns
from testkit.netlab import Lab

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]


@pytest.fixture
def env() -> Iterator[d.Env]:
    with Lab() as lab:
        yield d.Env(lab.standard_topology(backends=3))


def test_kube_proxy_to_pyproxy_and_back_without_a_failed_connection(
        env: d.Env, control_plane: ControlPlane) -> None:
    r = m.migration(env, control_plane, round_trips=1, hold_s=1.5, clients=6)
    print(r.summary())
    assert r.ok, r.summary()
    assert r.failed == 0 and r.attempted > 200
