"""New connections per endpoint, counted by the kernel, with real packets in throwaway network
namespaces (testkit/netlab.py): what the counters say against where the connections landed.

node-a is the node; pod-a runs on it, pod-b on node-b (same zone), pod-c on node-c (zone-2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope, SyncPlan
from pyproxy.kernel.nlelements import netlink_socket
from pyproxy.kernel.nlsets import KernelCounters
from pyproxy.render.connection_keys import endpoint_part
from pyproxy.serve.connections import (
    ConnectionCounters,
    CountingContext,
    Kernel,
    Ledger,
    Series,
)
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.nftns import NodeProxy, libnft_in

pytestmark = [pytest.mark.netns, requires_netns]

VIP, VIP6, STICKY_VIP = "10.96.0.10", "fd00:96::10", "10.96.0.11"
NODEPORT = 30080
N = 40
NODES = [make_node("node-a", "zone-1"), make_node("node-b", "zone-1"),
         make_node("node-c", "zone-2")]
WHERE = {"pod-a": ("node-a", "zone-1"), "pod-b": ("node-b", "zone-1"),
         "pod-c": ("node-c", "zone-2")}
SCOPE = {"pod-a": "node", "pod-b": "zone", "pod-c": "cluster"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    """pyproxy programming the node namespace, and its connection counters."""

    cluster: Cluster
    proxy: NodeProxy
    clock: FakeClock = field(default_factory=FakeClock)
    objects: list[dict[str, Any]] = field(default_factory=list)
    counters: ConnectionCounters | None = None

    def apply(self, objects: list[dict[str, Any]]) -> None:
        self.objects = [*NODES, *objects]
        self.proxy.apply(self.objects)

    def context(self) -> CountingContext:
        state = build_state(self.objects)
        return CountingContext(
            tuple(ps for p in self.proxy.proxiers for ps in p.selections.values()),
            state.node("node-a"), state.node_labels())

    def totals(self) -> dict[Series, int]:
        if self.counters is None:
            netns = self.cluster.node.full
            kernel = KernelCounters(lambda: call_in_netns(netns, netlink_socket),
                                    libnft_in(netns))
            self.counters = ConnectionCounters(
                [p.family for p in self.proxy.proxiers], self.context,
                Kernel(kernel.read, kernel.delete), clock=self.clock,
                ledger=Ledger(grace=60, retention=3600), min_interval=0)
        return dict(self.counters.totals())

    def raw(self) -> dict[bytes, int]:
        netns = self.cluster.node.full
        kernel = KernelCounters(lambda: call_in_netns(netns, netlink_socket))
        return {**kernel.read(self.proxy.proxiers[0].family),
                **kernel.read(self.proxy.proxiers[1].family)}


@pytest.fixture
def node(cluster: Cluster) -> Iterator[Node]:
    config = NodeConfig(
        "node-a", node_ips=(cluster.node_ip4, cluster.node_ip6),
        cluster_cidrs=(cluster.cluster_cidr4, cluster.cluster_cidr6))
    yield Node(cluster, NodeProxy(cluster.node.full, config))
    cluster.node.run(["nft", "delete table ip pyproxy"], check=False)
    cluster.node.run(["nft", "delete table ip6 pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


def web(ip: str = VIP, name: str = "web", **spec: Any) -> dict[str, Any]:
    def tweak(svc: dict[str, Any]) -> None:
        svc["spec"]["ports"] = [
            {"name": "http", "port": 80, "protocol": "TCP", "nodePort": NODEPORT},
            {"name": "dns", "port": 53, "protocol": "UDP"}]
        svc["spec"].update(spec)

    return make_service("ns", name, tweak, ip=ip)


def pods(cluster: Cluster, names: list[str], v6: bool = False,
         name: str = "web") -> dict[str, Any]:
    def ports(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": 8080, "protocol": "TCP"},
                      {"name": "dns", "port": 5353, "protocol": "UDP"}]

    return make_slice("ns", name, [ep(cluster.pods[p].addr(v6), *WHERE[p]) for p in names],
                      ports, family="IPv6" if v6 else "IPv4")


def series(cluster: Cluster, pod: str, port: str = "http", service: str = "ns/web",
           v6: bool = False) -> Series:
    address = cluster.pods[pod].addr(v6)
    endpoint_port = 8080 if port == "http" else 5353
    endpoint = f"[{address}]:{endpoint_port}" if v6 else f"{address}:{endpoint_port}"
    return Series(service, port, endpoint, SCOPE[pod])


def landed(results: Any) -> dict[str, int]:
    counts = tally(results)
    assert set(counts) <= set(WHERE), counts  # every connection reached a backend
    return dict(counts)


def test_connections_add_up_and_split_as_they_landed(cluster: Cluster, node: Node) -> None:
    node.apply([web(), pods(cluster, ["pod-a", "pod-b"])])
    tcp = landed(cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8))
    udp = landed(cluster.lab.connect(cluster.pod_client.ns, VIP, 53, proto="udp", count=N,
                                     parallel=8))
    totals = node.totals()
    assert sum(totals.values()) == 2 * N
    assert {s.endpoint: n for s, n in totals.items() if s.port == "http"} == {
        series(cluster, pod).endpoint: n for pod, n in tcp.items()}
    assert {s: n for s, n in totals.items() if s.port == "dns"} == {
        series(cluster, pod, "dns"): n for pod, n in udp.items()}
    # scope is where the endpoint runs: pod-a on this node, pod-b in its zone
    assert {s.scope for s in totals} == {SCOPE[p] for p in (*tcp, *udp)}
    # a full sync (hourly, after a failure) keeps the kernel's counters
    counted = node.raw()
    assert sum(counted.values()) == 2 * N
    node.proxy.apply(node.objects, plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    assert node.raw() == counted


def test_node_port_hairpin_ipv6_and_affinity_are_counted(cluster: Cluster, node: Node) -> None:
    sticky_spec = {"sessionAffinity": "ClientIP"}
    node.apply([
        web(type="NodePort", ipFamilies=["IPv4", "IPv6"], clusterIPs=[VIP, VIP6]),
        pods(cluster, ["pod-a", "pod-c"]), pods(cluster, ["pod-a", "pod-c"], v6=True),
        web(STICKY_VIP, "sticky", **sticky_spec), pods(cluster, ["pod-a"], name="sticky")])
    expected: dict[Series, int] = {}

    def add(results: Any, service: str = "ns/web", v6: bool = False) -> None:
        for pod, n in landed(results).items():
            key = series(cluster, pod, service=service, v6=v6)
            expected[key] = expected.get(key, 0) + n

    add(cluster.lab.connect(cluster.client, cluster.node_ip4, NODEPORT, count=10, parallel=5))
    add(cluster.lab.connect(cluster.client, VIP6, 80, count=10, parallel=5), v6=True)
    # from a pod of this node back to itself through its own service (masqueraded), and
    # with affinity
    add(cluster.lab.connect(cluster.pods["pod-a"].ns, VIP, 80, count=4))
    add(cluster.lab.connect(cluster.pods["pod-a"].ns, STICKY_VIP, 80, count=5),
        service="ns/sticky")
    assert node.totals() == expected


def test_a_retransmitted_syn_is_one_connection(cluster: Cluster, node: Node) -> None:
    # pod-c drops every SYN: the client sends it again (after ~1 s) before giving up
    cluster.lab.nft(cluster.pods["pod-c"].ns,
                    "table ip lab { chain syns { type filter hook input priority 0; "
                    "tcp dport 8080 drop; }; }")
    try:
        node.apply([web(), pods(cluster, ["pod-c"])])
        results = cluster.lab.connect(cluster.client, VIP, 80, count=2, timeout=1.5,
                                      parallel=2)
        assert tally(results) == {"timeout": 2}
        assert node.totals() == {series(cluster, "pod-c"): 2}
    finally:
        cluster.pods["pod-c"].ns.run(["nft", "delete table ip lab"], check=False)


def test_an_endpoint_removed_and_added_again_never_goes_backwards(cluster: Cluster,
                                                                   node: Node) -> None:
    a, b = series(cluster, "pod-a"), series(cluster, "pod-b")
    node.apply([web(), pods(cluster, ["pod-a", "pod-b"])])
    first = landed(cluster.lab.connect(cluster.client, VIP, 80, count=20, parallel=8))
    before = node.totals()
    assert before[a] == first["pod-a"] and before[b] == first["pod-b"]

    # pod-a leaves: its element stays (and keeps its count) until unchanged for the grace
    node.apply([web(), pods(cluster, ["pod-b"])])
    assert node.totals()[a] == first["pod-a"]
    node.clock.now += 61
    assert node.totals()[a] == first["pod-a"]  # banked: the element was collected
    assert not [k for k in node.raw() if k.endswith(endpoint_part(cluster.pods["pod-a"].ip4, 8080))]

    # pod-a comes back: a new element counts from zero, on top of what was banked
    node.apply([web(), pods(cluster, ["pod-a", "pod-b"])])
    second = landed(cluster.lab.connect(cluster.client, VIP, 80, count=20, parallel=8))
    after = node.totals()
    assert after[a] == first["pod-a"] + second.get("pod-a", 0)
    assert after[b] == first["pod-b"] + second.get("pod-b", 0)
    assert all(after[s] >= n for s, n in before.items())

