"""Connections in flight per endpoint, from conntrack, with real packets in throwaway network
namespaces (testkit/netlab.py): connections held open through a Service against what the
count says, a terminating endpoint draining down to 0, a NodePort, IPv6, and what the dump
leaves out (connections nobody DNATed, UDP)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.inflight import InFlight
from pyproxy.core.model import IPFamily, Protocol, ServicePortName
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.kernel.nlconntrack import KernelFlows
from pyproxy.kernel.nlelements import netlink_socket
from pyproxy.sync.inflight import InFlightReader
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.held import HeldClients, HoldingServer
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, Lab
from testkit.nftns import NodeProxy
from testkit.waits import until

pytestmark = [pytest.mark.netns, requires_netns]

VIP, VIP6, NODEPORT, HELD = "10.96.0.20", "fd00:96::20", 30090, 9090
PODS = ("pod-a", "pod-b", "pod-c")
NAME = ServicePortName("ns", "held", "http", Protocol.TCP)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        c = lab.standard_topology(backends=3)
        servers = [HoldingServer(c.pods[p].ns.full, address, HELD, p)
                   for p in PODS for address in (c.pods[p].ip4, c.pods[p].ip6)]
        yield c
        for server in servers:
            server.close()


def held_service(**spec: Any) -> dict[str, Any]:
    def tweak(svc: dict[str, Any]) -> None:
        svc["spec"]["ports"] = [{"name": "http", "port": 80, "protocol": "TCP",
                                 "targetPort": HELD, "nodePort": NODEPORT}]
        svc["spec"].update(spec)

    return make_service("ns", "held", tweak, ip=VIP)


def held_slice(c: Cluster, terminating: tuple[str, ...] = (), v6: bool = False
               ) -> dict[str, Any]:
    def port(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": HELD, "protocol": "TCP"}]

    endpoints = [ep(c.pods[p].addr(v6), "node-a", ready=p not in terminating,
                    serving=True, terminating=p in terminating) for p in PODS]
    return make_slice("ns", "held", endpoints, port, family="IPv6" if v6 else "IPv4")


class Node:
    """pyproxy programming the node namespace, and a reader of its connections in flight."""

    def __init__(self, c: Cluster) -> None:
        self.cluster = c
        config = NodeConfig("node-a", node_ips=(c.node_ip4, c.node_ip6),
                            cluster_cidrs=(c.cluster_cidr4, c.cluster_cidr6))
        self.proxy = NodeProxy(c.node.full, config)
        self.objects: list[dict[str, Any]] = []
        netns = c.node.full
        self.reader = InFlightReader(
            [IPFamily.IPv4, IPFamily.IPv6],
            KernelFlows(lambda: call_in_netns(netns, netlink_socket)).read, self.ports,
            duty=1e9)  # every read a fresh one

    def apply(self, objects: list[dict[str, Any]]) -> None:
        self.objects = [make_node("node-a", "zone-1"), *objects]
        self.proxy.apply(self.objects)

    def ports(self) -> list[Any]:
        state = build_state(self.objects)
        return [(ps, state.endpoints(ps.port.name, ps.family))
                for p in self.proxy.proxiers for ps in p.selections.values()]

    def read(self) -> InFlight:
        return self.reader.current(0)

    def established(self, family: IPFamily = IPFamily.IPv4) -> dict[str, tuple[int, bool]]:
        """endpoint → (established, terminating) of ns/held."""
        port = self.read().of(NAME, family)
        assert port is not None
        return {e.endpoint: (e.load.established, e.terminating)
                for e in port.endpoints.values()}


@pytest.fixture
def node(cluster: Cluster) -> Iterator[Node]:
    yield Node(cluster)
    cluster.node.run(["nft", "delete table ip pyproxy"], check=False)
    cluster.node.run(["nft", "delete table ip6 pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


def key(c: Cluster, pod: str, v6: bool = False) -> str:
    return f"[{c.pods[pod].ip6}]:{HELD}" if v6 else f"{c.pods[pod].ip4}:{HELD}"


def test_held_connections_are_counted_per_endpoint_and_a_drain_goes_to_zero(
        cluster: Cluster, node: Node) -> None:
    node.apply([held_service(), held_slice(cluster)])
    clients = HeldClients(cluster.client.full, VIP, 80)
    try:
        landed = clients.open(30)
        assert sum(landed.values()) == 30 and set(landed) <= set(PODS), landed
        assert node.established() == {key(cluster, p): (landed.get(p, 0), False) for p in PODS}
        # pod-a terminates: still serving, no longer ready; its connections are what is left
        # to drain
        drained = max(PODS, key=lambda p: landed.get(p, 0))
        node.apply([held_service(), held_slice(cluster, terminating=(drained,))])
        port = node.read().of(NAME, IPFamily.IPv4)
        assert port is not None and port.draining == landed[drained]
        assert port.as_dict()["draining"] == landed[drained]
        clients.close(drained)  # the clients finish: FIN, the entries leave ESTABLISHED
        until(lambda: node.established()[key(cluster, drained)] == (0, True), 5,
              "the drain at 0")
        port = node.read().of(NAME, IPFamily.IPv4)
        assert port is not None and port.draining == 0
        assert port.established == sum(n for p, n in landed.items() if p != drained)
        # the closing connections are counted apart, not as established
        assert port.endpoints[key(cluster, drained)].load.other == landed[drained]
    finally:
        clients.close()


def test_node_port_ipv6_and_what_is_no_services(cluster: Cluster, node: Node) -> None:
    node.apply([held_service(type="NodePort", ipFamilies=["IPv4", "IPv6"],
                             clusterIPs=[VIP, VIP6]),
                held_slice(cluster), held_slice(cluster, v6=True)])
    via_node_port = HeldClients(cluster.client.full, cluster.node_ip4, NODEPORT)
    via_v6 = HeldClients(cluster.client.full, VIP6, 80)
    # straight to a pod, not through the Service: no DNAT, not the Service's
    direct = HeldClients(cluster.pod_client.ns.full, cluster.pods["pod-b"].ip4, HELD)
    try:
        four, six = via_node_port.open(12), via_v6.open(9)
        direct.open(5)
        assert node.established() == {key(cluster, p): (four.get(p, 0), False) for p in PODS}
        assert node.established(IPFamily.IPv6) == {
            key(cluster, p, v6=True): (six.get(p, 0), False) for p in PODS}
        assert node.read().entries == 21  # the direct ones are not DNATed: not even dumped
    finally:
        for clients in (via_node_port, via_v6, direct):
            clients.close()


def test_connections_of_an_endpoint_that_left_are_gone(cluster: Cluster, node: Node) -> None:
    node.apply([held_service(), held_slice(cluster)])
    clients = HeldClients(cluster.client.full, VIP, 80)
    try:
        landed = clients.open(12)
        left = max(PODS, key=lambda p: landed.get(p, 0))
        stay = [ep(cluster.pods[p].ip4, "node-a") for p in PODS if p != left]
        node.apply([held_service(), make_slice("ns", "held", stay, lambda s: s.update(
            ports=[{"name": "http", "port": HELD, "protocol": "TCP"}]))])
        port = node.read().of(NAME, IPFamily.IPv4)
        assert port is not None
        assert key(cluster, left) not in port.endpoints
        assert port.gone.established == landed[left]
    finally:
        clients.close()
