"""Topology spillover with real packets: `pyproxy run` in the node namespace of the standard
topology, fed by a snapshot file the test rewrites. Every pod hangs off the one node
namespace, so the zones are labels only: the test cluster says which node (and so which zone
and region) each pod is on, and the daemon is node-a in zone-1.

While the preferred level has fewer than topology-min-endpoints ready endpoints, connections
spill to the next level; when it grows back they return."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.waits import eventually

pytestmark = [pytest.mark.netns, requires_netns]

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
ZONAL_VIP = "10.96.0.10"  # trafficDistribution: PreferClose (zone hints), min 2
NEAREST_VIP = "10.96.0.11"  # topology keys hostname, zone, *, min 2
REGION = {"topology.kubernetes.io/region": "region-1"}
ZONE_OF = {"node-a": "zone-1", "node-b": "zone-1", "node-c": "zone-2"}
# Where each pod runs: pod-a and pod-d on this node, pod-b elsewhere in zone-1, pod-c in zone-2.
NODE_OF = {"pod-a": "node-a", "pod-b": "node-b", "pod-c": "node-c", "pod-d": "node-a"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=list(NODE_OF))


def endpoint(cluster: Cluster, pod: str, ready: bool, hinted: bool) -> dict[str, Any]:
    node = NODE_OF[pod]
    zone = ZONE_OF[node]
    return ep(cluster.pods[pod].ip4, node, zone, ready=ready,
              zones=[zone] if hinted else None)


def service(name: str, vip: str, **extra: str) -> dict[str, Any]:
    def tweak(svc: dict[str, Any]) -> None:
        svc["metadata"]["annotations"] = {
            "service.pyproxy.io/topology-min-endpoints": "2", **extra}
        if name == "zonal":
            svc["spec"]["trafficDistribution"] = "PreferClose"

    return make_service("ns", name, tweak, ip=vip)


def objects(cluster: Cluster, zonal_down: str = "", nearest_down: str = "") -> list[dict[str, Any]]:
    """The cluster, with one pod not ready in either service's slice when named. The zone hints
    are what the EndpointSlice controller writes for PreferClose: each endpoint for its own
    zone."""
    return [
        *(make_node(name, zone, **REGION) for name, zone in ZONE_OF.items()),
        service("zonal", ZONAL_VIP),
        make_slice("ns", "zonal", [endpoint(cluster, p, p != zonal_down, hinted=True)
                                   for p in ("pod-a", "pod-b", "pod-c")]),
        service("nearest", NEAREST_VIP, **{
            "service.pyproxy.io/topology-keys":
                "kubernetes.io/hostname,topology.kubernetes.io/zone,*"}),
        make_slice("ns", "nearest", [endpoint(cluster, p, p != nearest_down, hinted=False)
                                     for p in ("pod-a", "pod-b", "pod-c", "pod-d")]),
    ]


def write_atomically(path: Path, docs: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    os.replace(tmp, path)


def start_daemon(cluster: Cluster, snapshot: Path) -> subprocess.Popen[str]:
    argv = DaemonArgs(snapshot=snapshot, bind_address=cluster.node_ip4,
                      cluster_cidr=cluster.cluster_cidr4).argv()
    return cluster.lab.popen(cluster.node, argv, log_name="pyproxy-spillover.log")


def landed(cluster: Cluster, vip: str) -> set[str]:
    """The pods 30 new connections from outside reached (each of two endpoints is missed by
    chance with probability 2^-29)."""
    results = cluster.lab.connect(cluster.client, vip, 80, count=30, parallel=10, timeout=0.5)
    return set(tally(results))


def test_connections_spill_over_while_a_level_is_short_and_return(
    cluster: Cluster, tmp_path: Path
) -> None:
    snapshot = tmp_path / "cluster.yaml"
    write_atomically(snapshot, objects(cluster))
    daemon = start_daemon(cluster, snapshot)
    try:
        # Enough in the preferred level: zone-1 for the zonal service, this node for the
        # topology keys one; nothing else is used.
        eventually(lambda: landed(cluster, ZONAL_VIP) == {"pod-a", "pod-b"}, "zone-1 only")
        eventually(lambda: landed(cluster, NEAREST_VIP) == {"pod-a", "pod-d"}, "node-a only")

        # zone-1 and node-a shrink to one ready endpoint each: fewer than 2, so the next
        # level's endpoints are added (the region's pod-c; the zone key's pod-b).
        write_atomically(snapshot, objects(cluster, zonal_down="pod-b", nearest_down="pod-d"))
        eventually(lambda: landed(cluster, ZONAL_VIP) == {"pod-a", "pod-c"},
                   "zonal service spilled to region-1")
        eventually(lambda: landed(cluster, NEAREST_VIP) == {"pod-a", "pod-b"},
                   "keys service spilled to the zone key")

        # Grown back to 2: the wider levels are dropped again.
        write_atomically(snapshot, objects(cluster))
        eventually(lambda: landed(cluster, ZONAL_VIP) == {"pod-a", "pod-b"}, "back to zone-1")
        eventually(lambda: landed(cluster, NEAREST_VIP) == {"pod-a", "pod-d"}, "back to node-a")
        assert daemon.poll() is None
    finally:
        cluster.lab.stop_process(daemon)
        cluster.node.run(["nft", "delete", "table", "ip", "pyproxy"], check=False)
        cluster.lab.flush_conntrack(cluster.node)
