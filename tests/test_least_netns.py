"""Least-connection balancing on real packets (testkit/netlab.py): an endpoint holding the
connections of a Service gets a falling share of the slots, and new connections go to the
idle one; only the moved slots are written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.least import slot_count
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.held import HeldClients, HoldingServer, least_feedback
from testkit.netlab import Cluster, Lab

pytestmark = [pytest.mark.netns, requires_netns]

VIP, HELD = "10.96.0.40", 9090


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        c = lab.standard_topology(backends=2)
        servers = [HoldingServer(c.pods[p].ns.full, c.pods[p].ip4, HELD, p) for p in c.pods]
        yield c
        for server in servers:
            server.close()


def objects(c: Cluster, pods: list[str]) -> list[dict[str, Any]]:
    def tweak(svc: dict[str, Any]) -> None:
        svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": "lc"}
        svc["spec"]["ports"][0]["targetPort"] = HELD

    def port(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": HELD, "protocol": "TCP"}]

    return [make_node("node-a", "zone-1"), make_service("ns", "lc", tweak, ip=VIP),
            make_slice("ns", "lc", [ep(c.pods[p].ip4, "node-a") for p in pods], port)]


def test_new_connections_go_to_the_endpoint_with_fewer_in_flight(cluster: Cluster) -> None:
    c = cluster
    least, proxier, reader = least_feedback(c, interval=0.0)
    clients = HeldClients(c.client.full, VIP, 80)
    try:
        proxier.sync(build_state(objects(c, ["pod-a"])))
        assert clients.open(20) == {"pod-a": 20}  # pod-a alone: it holds them all
        state = build_state(objects(c, ["pod-a", "pod-b"]))
        proxier.sync(state)  # pod-b joins: half the slots each before any feedback
        ports = list(proxier.selections.values())
        for _ in range(12):  # steps of the feedback, each rendered as the daemon does
            changed = least.update(ports, reader.current(0))
            if changed:
                assert changed == {ports[0].port.name.service}
                result = proxier.sync(state, changed=changed)
                # only the endpoints map's moved slots are written (and nothing else)
                assert 0 < result.commands <= slot_count(2)
                ports = list(proxier.selections.values())
        table = ports[0].selection.least.table  # type: ignore[union-attr]
        assert table.count(f"{c.pods['pod-b'].ip4}:{HELD}") >= 0.85 * len(table)
        landed = clients.open(20)
        assert landed.get("pod-b", 0) >= 14, landed  # random over the slots: ~18 of 20
    finally:
        clients.close()
        c.node.run(["nft", "delete table ip pyproxy"], check=False)
        c.lab.flush_conntrack(c.node)
