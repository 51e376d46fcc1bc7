"""New connections per endpoint without a kernel: element keys, labels (service, port, endpoint,
scope), the ledger that keeps totals from going backwards, garbage collection, the netlink
dump decoder, and what /metrics and `services -o wide` show."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from pyproxy.cli.formats import format_services
from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import Endpoint, IPFamily, Node
from pyproxy.core.topology import endpoint_scope, select_all
from pyproxy.kernel.nlsets import DumpParser, dump_request
from pyproxy.render.connection_keys import (
    element_text,
    endpoint_part,
    node_port_part,
    service_part,
    shard_of,
)
from pyproxy.render.objects import CONNECTION_SHARDS, connection_shard
from pyproxy.serve.connections import (
    ConnectionCounters,
    CountingContext,
    Kernel,
    Labels,
    Ledger,
    Series,
)
from pyproxy.serve.live import with_connections
from pyproxy.serve.metrics import Metrics
from testkit.builders import ep, make_node, make_service, make_slice

V4, V6 = IPFamily.IPv4, IPFamily.IPv6
A1, B1, C1 = "10.244.1.5", "10.244.2.6", "10.244.3.7"
A6 = "fd00:244:0:1::5"
NODES = [make_node("node-a", "zone-1"), make_node("node-b", "zone-1"),
         make_node("node-c", "zone-2")]


def key(service: str, proto: int, port: int, endpoint: str, endpoint_port: int) -> bytes:
    return service_part(service, proto, port) + endpoint_part(endpoint, endpoint_port)


def test_keys_are_the_kernels_layout_and_print_as_nft_does() -> None:
    k = key("10.96.0.10", 6, 80, A1, 8080)
    assert k == bytes([10, 96, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0, 10, 244, 1, 5, 0x1F, 0x90, 0, 0])
    assert element_text(k) == f"10.96.0.10 . tcp . 80 . {A1} . 8080"
    k6 = key("fd00:96::10", 17, 53, A6, 5353)
    assert len(k6) == 44 and element_text(k6) == f"fd00:96::10 . udp . 53 . {A6} . 5353"
    assert key("10.96.0.10", 6, 80, A1, 8080)[4:12] == node_port_part(6, 80)


def test_an_endpoints_shard_is_the_one_its_rule_tests() -> None:
    for address in (A1, B1, C1, A6, "10.0.0.255", "fd00::ff0f"):
        assert shard_of(key("10.96.0.10", 6, 80, address, 8080)) == connection_shard(address)
    assert {connection_shard(f"10.244.1.{i}") for i in range(16)} == set(range(CONNECTION_SHARDS))


# --- scope -------------------------------------------------------------------------------------


def test_scope_is_where_the_endpoint_runs() -> None:
    node = Node("node-a", {"topology.kubernetes.io/zone": "zone-1"})
    labels = {"node-b": {"topology.kubernetes.io/zone": "zone-1"},
              "node-c": {"topology.kubernetes.io/zone": "zone-2"}}
    assert endpoint_scope(Endpoint(A1, 80, node_name="node-a"), node, labels) == "node"
    assert endpoint_scope(Endpoint(B1, 80, node_name="node-b"), node, labels) == "zone"
    assert endpoint_scope(Endpoint(C1, 80, node_name="node-c"), node, labels) == "cluster"
    # the Node's label wins over what the slice says; an unknown Node: the slice's zone
    assert endpoint_scope(Endpoint(C1, 80, node_name="node-c", zone="zone-1"), node,
                          labels) == "cluster"
    assert endpoint_scope(Endpoint(C1, 80, node_name="node-x", zone="zone-1"), node,
                          labels) == "zone"
    assert endpoint_scope(Endpoint(C1, 80), node, labels) == "cluster"  # nowhere known
    # a hint lending another zone's endpoint to this one does not make it "zone"
    lent = Endpoint(C1, 80, node_name="node-c", zone_hints=frozenset({"zone-1"}))
    assert endpoint_scope(lent, node, labels) == "cluster"
    # this node without a zone: no endpoint is in its zone
    assert endpoint_scope(Endpoint(B1, 80, node_name="node-b"), Node("node-a"),
                          labels) == "cluster"


# --- labels ------------------------------------------------------------------------------------


def context(*objects: dict[str, Any]) -> CountingContext:
    state = build_state([*NODES, *objects])
    assert not state.skipped, state.skipped
    return CountingContext(tuple(select_all(state, "node-a")), state.node("node-a"),
                           state.node_labels())


def lb_service(svc: dict[str, Any]) -> None:
    svc["spec"].update(type="LoadBalancer", externalIPs=["192.0.2.1"],
                       ports=[{"name": "http", "port": 80, "nodePort": 30080,
                               "targetPort": 8080}])
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}


def test_every_address_of_a_service_port_counts_in_one_series() -> None:
    labels = Labels(context(
        make_service("ns", "web", lb_service),
        make_slice("ns", "web", [ep(A1, "node-a", "zone-1"), ep(C1, "node-c", "zone-2")])))
    a = Series("ns/web", "http", f"{A1}:8080", "node")
    c = Series("ns/web", "http", f"{C1}:8080", "cluster")
    for address in ("10.96.0.10", "192.0.2.1", "198.51.100.1", "192.168.50.1"):
        port = 30080 if address == "192.168.50.1" else 80  # a node address: the node port
        assert labels.of(key(address, 6, port, A1, 8080)) == a, address
        assert labels.of(key(address, 6, port, C1, 8080)) == c, address
    # not this service's: another port, protocol, endpoint or endpoint port
    for other in (key("10.96.0.10", 6, 81, A1, 8080), key("10.96.0.10", 17, 80, A1, 8080),
                  key("10.96.0.10", 6, 80, B1, 8080), key("10.96.0.10", 6, 80, A1, 8081),
                  key("192.168.50.1", 6, 30081, A1, 8080)):
        assert labels.of(other) is None


def test_ipv6_elements_are_labelled_per_family() -> None:
    def dual(svc: dict[str, Any]) -> None:
        svc["spec"].update(ipFamilies=["IPv4", "IPv6"], clusterIPs=["10.96.0.10", "fd00:96::10"])

    labels = Labels(context(
        make_service("ns", "web", dual),
        make_slice("ns", "web", [ep(A1, "node-a", "zone-1")]),
        make_slice("ns", "web", [ep(A6, "node-b", "zone-1")], family="IPv6")))
    assert labels.of(key("fd00:96::10", 6, 80, A6, 8080)) == Series(
        "ns/web", "http", f"[{A6}]:8080", "zone")
    assert labels.of(key("10.96.0.10", 6, 80, A1, 8080)) == Series(
        "ns/web", "http", f"{A1}:8080", "node")
    assert labels.of(key("fd00:96::10", 6, 80, "fd00:244:0:2::5", 8080)) is None


def test_labels_follow_the_selections_and_the_nodes_place() -> None:
    objects = [make_service("ns", "web"),
               make_slice("ns", "web", [ep(A1, "node-a", "zone-1"), ep(B1, "node-b")])]
    k_a, k_b = key("10.96.0.10", 6, 80, A1, 8080), key("10.96.0.10", 6, 80, B1, 8080)
    labels = Labels(context(*objects))
    assert labels.of(k_b) == Series("ns/web", "http", f"{B1}:8080", "zone")
    # node-b moves to zone-2 (its Node's labels win over the slice)
    moved = [make_node("node-a", "zone-1"), make_node("node-b", "zone-2")]
    state = build_state([*moved, *objects])
    labels.update(CountingContext(tuple(select_all(state, "node-a")), state.node("node-a"),
                                  state.node_labels()))
    assert labels.of(k_b) == Series("ns/web", "http", f"{B1}:8080", "cluster")
    # pod-a leaves the service: its elements belong to no series any more
    labels.update(context(make_service("ns", "web"),
                          make_slice("ns", "web", [ep(B1, "node-b", "zone-1")])))
    assert labels.of(k_a) is None and labels.of(k_b) is not None


# --- the ledger --------------------------------------------------------------------------------

S1 = Series("ns/web", "http", f"{A1}:8080", "node")
S2 = Series("ns/web", "http", f"{B1}:8080", "zone")
K1, K1B = key("10.96.0.10", 6, 80, A1, 8080), key("192.0.2.1", 6, 80, A1, 8080)
K2 = key("10.96.0.10", 6, 80, B1, 8080)


def test_several_elements_add_up_in_their_series() -> None:
    ledger = Ledger()
    ledger.observe({K1: 3, K1B: 4, K2: 5}, {K1: S1, K1B: S1, K2: S2}.get, now=0)
    assert ledger.totals() == {S1: 7, S2: 5}


def test_a_collected_element_is_banked_and_a_new_one_counts_on_top() -> None:
    ledger = Ledger(grace=60)
    assert ledger.observe({K1: 5}, {K1: S1}.get, now=0) == []
    # the endpoint leaves: the element is of no series, kept while it might still change
    assert ledger.observe({K1: 7}, {}.get, now=10) == []
    assert ledger.totals() == {S1: 7}
    assert ledger.observe({K1: 7}, {}.get, now=69) == []
    assert ledger.observe({K1: 7}, {}.get, now=70) == [K1]
    ledger.collected([K1], now=70)
    assert ledger.totals() == {S1: 7}
    # back again: a new element from zero
    ledger.observe({K1: 2}, {K1: S1}.get, now=80)
    assert ledger.totals() == {S1: 9}


def test_an_element_that_changes_is_not_collected() -> None:
    ledger = Ledger(grace=60)
    ledger.observe({K1: 1}, {}.get, now=0)
    ledger.observe({K1: 2}, {}.get, now=100)  # another table's DNAT still counting
    assert ledger.observe({K1: 2}, {}.get, now=159) == []
    assert ledger.observe({K1: 2}, {}.get, now=160) == [K1]
    assert ledger.totals() == {}  # never of a series: not exported


def test_an_element_recreated_behind_our_back_keeps_its_old_count() -> None:
    ledger = Ledger()
    ledger.observe({K1: 9}, {K1: S1}.get, now=0)
    ledger.observe({K1: 2}, {K1: S1}.get, now=10)  # the table was replaced meanwhile
    assert ledger.totals() == {S1: 11}


def test_a_missing_element_keeps_its_count_until_the_retention() -> None:
    ledger = Ledger(retention=3600)
    ledger.observe({K1: 9, K2: 1}, {K1: S1, K2: S2}.get, now=0)
    ledger.observe({K2: 1}, {K1: S1, K2: S2}.get, now=10)  # a dump that missed it
    assert ledger.totals() == {S1: 9, S2: 1}
    ledger.observe({K1: 10, K2: 1}, {K1: S1, K2: S2}.get, now=20)
    assert ledger.totals() == {S1: 10, S2: 1}
    ledger.observe({K2: 1}, {K2: S2}.get, now=3620)  # gone for good: banked, then dropped
    assert ledger.totals() == {S1: 10, S2: 1}
    ledger.observe({K2: 1}, {K2: S2}.get, now=7220)
    assert ledger.totals() == {S2: 1}


def test_new_labels_leave_the_old_series_its_count() -> None:
    moved = S1._replace(scope="zone")
    ledger = Ledger()
    ledger.observe({K1: 4}, {K1: S1}.get, now=0)
    ledger.observe({K1: 6}, {K1: moved}.get, now=10)
    assert ledger.totals() == {S1: 6, moved: 0}
    ledger.observe({K1: 9}, {K1: moved}.get, now=20)
    assert ledger.totals() == {S1: 6, moved: 3}


# One read: each element's counter (a kernel counter only grows, unless the element is
# deleted: then it is absent or, recreated, counts from zero) and the series it belongs to.
reads = st.lists(st.tuples(
    st.dictionaries(st.sampled_from([K1, K1B, K2]),
                    st.tuples(st.integers(0, 5), st.booleans(), st.sampled_from([S1, S2, None]))),
    st.integers(1, 100)), max_size=25)


@given(reads)
def test_totals_never_go_backwards(steps: list[tuple[dict[bytes, tuple[int, bool, Series | None]],
                                                     int]]) -> None:
    ledger = Ledger(grace=30, retention=10_000)
    kernel: dict[bytes, int] = {}
    now, before = 0, {}
    for read, elapsed in steps:
        now += elapsed
        for k, (grow, recreate, _) in read.items():
            kernel[k] = grow if recreate else kernel.get(k, 0) + grow
        labels = {k: series for k, (_, _, series) in read.items()}
        collect = ledger.observe(dict(kernel), labels.get, now)
        for k in collect:
            del kernel[k]
        ledger.collected(collect, now)
        totals = ledger.totals()
        assert all(totals.get(s, 0) >= n for s, n in before.items()), (before, totals)
        before = totals


# --- the counters of a node ------------------------------------------------------------------


class FakeKernel:
    """The counting sets: elements the test sets, deletions recorded (or refused)."""

    def __init__(self) -> None:
        self.elements: dict[IPFamily, dict[bytes, int]] = {V4: {}, V6: {}}
        self.deleted: list[bytes] = []
        self.refuse = False
        self.reads = 0

    def read(self, family: IPFamily) -> Mapping[bytes, int]:
        self.reads += 1
        return dict(self.elements[family])

    def delete(self, family: IPFamily, keys: Sequence[bytes]) -> bool:
        if self.refuse:
            return False
        for k in keys:
            del self.elements[family][k]
        self.deleted += keys
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def web(*endpoints: dict[str, Any]) -> list[dict[str, Any]]:
    return [make_service("ns", "web"), make_slice("ns", "web", list(endpoints))]


def test_departed_endpoints_are_collected_after_the_grace() -> None:
    fake, clock = FakeKernel(), Clock()
    objects = web(ep(A1, "node-a", "zone-1"), ep(B1, "node-b", "zone-1"))
    counters = ConnectionCounters([V4], lambda: context(*objects),
                                  Kernel(fake.read, fake.delete), clock=clock,
                                  ledger=Ledger(grace=60))
    fake.elements[V4] = {K1: 3, K2: 4}
    assert counters.totals() == {S1: 3, S2: 4}
    objects = web(ep(B1, "node-b", "zone-1"))
    clock.now = 30
    counters.totals()
    fake.refuse = True  # the deletion fails: tried again at the next read
    clock.now = 100
    assert counters.totals() == {S1: 3, S2: 4} and fake.elements[V4] == {K1: 3, K2: 4}
    fake.refuse = False
    clock.now = 101
    assert counters.totals() == {S1: 3, S2: 4}
    assert fake.deleted == [K1] and fake.elements[V4] == {K2: 4}


def test_reads_closer_than_the_interval_are_shared() -> None:
    fake, clock = FakeKernel(), Clock()
    counters = ConnectionCounters([V4, V6], lambda: context(), Kernel(fake.read, fake.delete),
                                  clock=clock, min_interval=1.0)
    counters.totals()
    clock.now = 0.5
    counters.totals()
    assert fake.reads == 2  # one per family, once
    clock.now = 1.5
    counters.totals()
    assert fake.reads == 4


# --- what people see ---------------------------------------------------------------------------


def test_the_metric_has_the_series_labels() -> None:
    metrics = Metrics()
    metrics.watch_connections(lambda: {S1: 3, S2: 4})
    text = generate_latest(metrics.registry).decode()
    assert ('pyproxy_endpoint_new_connections_total{endpoint="10.244.1.5:8080",port="http",'
            'scope="node",service="ns/web"} 3.0') in text
    assert 'endpoint="10.244.2.6:8080",port="http",scope="zone",service="ns/web"} 4.0' in text


def test_a_failed_read_leaves_the_rest_of_metrics() -> None:
    def broken() -> Mapping[Series, int]:
        raise PermissionError("netlink")

    metrics = Metrics()
    metrics.watch_connections(broken)
    text = generate_latest(metrics.registry).decode()
    assert "pyproxy_endpoint_new_connections" in text and "process_cpu_seconds_total" in text


def test_services_wide_shows_each_endpoints_count() -> None:
    entry = {"service": "ns/web", "port": "http", "protocol": "TCP", "ipFamily": "IPv4",
             "servicePort": 80, "type": "ClusterIP", "clusterIPs": ["10.96.0.10"],
             "nodePort": None, "topology": "None", "clusterEndpoints": [f"{A1}:8080"],
             "localEndpoints": None, "externalIPs": [], "loadBalancerIPs": [],
             "internalTrafficPolicy": "Cluster", "externalTrafficPolicy": "Cluster",
             "sessionAffinity": "None"}
    six = {**entry, "ipFamily": "IPv6"}
    out = with_connections([entry, six], {S1: 3, S2: 4,
                                          Series("ns/web", "http", f"[{A6}]:8080", "node"): 1,
                                          Series("ns/db", "http", f"{C1}:8080", "cluster"): 9})
    assert out[0]["newConnections"] == [
        {"endpoint": f"{A1}:8080", "scope": "node", "count": 3},
        {"endpoint": f"{B1}:8080", "scope": "zone", "count": 4}]
    assert out[1]["newConnections"] == [{"endpoint": f"[{A6}]:8080", "scope": "node", "count": 1}]
    table = format_services(out, wide=True)
    assert "NEW-CONNECTIONS" in table
    assert f"{A1}:8080=3(node),{B1}:8080=4(zone)" in table
    assert "NEW-CONNECTIONS" not in format_services(out)


# --- the netlink dump ------------------------------------------------------------------------


def nla(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def element(k: bytes, packets: int | None) -> bytes:
    body = nla(1, nla(1, k))
    if packets is not None:
        counter = nla(1, b"counter\0") + nla(2, nla(1, struct.pack(">Q", packets * 60))
                                              + nla(2, struct.pack(">Q", packets)))
        body += nla(7, counter)
    return nla(1, body)


def message(elements: bytes, flags: int = 0x2) -> bytes:
    body = struct.pack("=BBH", 2, 0, 0) + nla(1, b"pyproxy\0") + nla(2, b"s\0") + nla(3, elements)
    return struct.pack("=IHHII", 16 + len(body), 0xA0C, flags, 1, 0) + body


DONE = struct.pack("=IHHIIi", 20, 3, 0x2, 1, 0, 0)


def test_the_dump_decoder_reads_every_element() -> None:
    keys = [key("10.96.0.10", 6, 80, f"10.244.1.{i}", 8080) for i in range(5)]
    parser = DumpParser()
    parser.feed(message(element(keys[0], 7) + element(keys[1], 0)))
    # an element laid out differently (no counter) is decoded the slow way
    parser.feed(message(element(keys[2], None) + element(keys[3], 2 ** 40)))
    parser.feed(message(element(keys[4], 1), flags=0x2 | 0x10) + DONE)
    assert parser.counts == {keys[0]: 7, keys[1]: 0, keys[2]: 0, keys[3]: 2 ** 40, keys[4]: 1}
    assert parser.done and parser.interrupted and not parser.missing


def test_a_missing_set_is_no_elements() -> None:
    parser = DumpParser()
    parser.feed(struct.pack("=IHHIIi", 36, 2, 0, 1, 0, -2) + b"\0" * 16)
    assert parser.done and parser.missing and parser.counts == {}


def test_the_dump_request_names_table_and_set() -> None:
    request = dump_request(V6, "pyproxy", "new-connections-3", seq=7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", request)
    assert (length, kind, flags, seq) == (len(request), 0xA0D, 0x301, 7)
    assert request[16] == 10  # NFPROTO_IPV6
    assert b"pyproxy\0" in request and b"new-connections-3\0" in request
