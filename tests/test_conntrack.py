"""Conntrack cleanup planning, table-driven and without a kernel: which UDP entries are stale
for a given cluster state (upstream's reconciler, pkg/proxy/conntrack/cleanup.go), and which
entries a repair deletes (those to a service frontend that were never DNATed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.conntrack import (
    IPPROTO_SCTP,
    IPPROTO_TCP,
    IPPROTO_UDP,
    Allowed,
    ConntrackEntry,
    ServiceFrontends,
    UdpTarget,
    allowed_map,
    canonical_ip,
    claimants,
    needs_cleanup,
    not_dnated,
    service_frontends,
    stale,
    udp_targets,
    withdrawn,
)
from pyproxy.core.model import ClusterState, IPFamily, Protocol, ServicePortName
from pyproxy.sync.conntrack import ConntrackCleanup
from testkit.builders import ep, make_service, make_slice, terminating
from testkit.fakes import fake_node_proxier

NODE_IP = "192.168.50.1"
NODE_IP6 = "fd00:50::1"
CLIENT = "203.0.113.7"
CLIENT6 = "2001:db8::7"
DNS_VIP, DNS_VIP6 = "10.96.0.10", "fd00:96::a"
EXTERNAL_IP = "192.0.2.10"
LB_IP = "198.51.100.10"
NODEPORT = 30053
POD_A, POD_B, GONE = "10.244.1.2", "10.244.2.2", "10.244.9.9"
POD_A6, GONE6 = "fd00:244:0:1::2", "fd00:244:0:9::2"


def service(name: str, ip: str, *, ip6: str | None = None, proto: str = "UDP",
            **spec: Any) -> dict[str, Any]:
    svc = make_service("default", name, ip=ip)
    svc["spec"]["ports"] = [{"name": "p", "port": 53, "protocol": proto, "targetPort": 5353}]
    if ip6:
        svc["spec"]["clusterIPs"] = [ip, ip6]
        svc["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
        svc["spec"]["ipFamilyPolicy"] = "PreferDualStack"
    lb = spec.pop("lb", None)
    svc["spec"].update(spec)
    if lb:
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": lb}]}}
    return svc


def endpoints(name: str, eps: list[dict[str, Any]], family: str = "IPv4",
              proto: str = "UDP") -> dict[str, Any]:
    eps_obj = make_slice("default", name, eps, family=family)
    eps_obj["ports"] = [{"name": "p", "port": 5353, "protocol": proto}]
    return eps_obj


def cluster() -> ClusterState:
    """dns: UDP, dual-stack, ClusterIP + external IP + LB VIP + NodePort, eTP=Local (ignored by
    cleanup); web: TCP; empty: UDP without endpoints; draining: UDP whose only endpoints are
    terminating (one still serving); other-nodes: UDP iTP=Local with endpoints elsewhere."""
    objects = [
        service("dns", DNS_VIP, ip6=DNS_VIP6, type="LoadBalancer", externalIPs=[EXTERNAL_IP],
                externalTrafficPolicy="Local", lb=LB_IP,
                ports=[{"name": "p", "port": 53, "protocol": "UDP", "targetPort": 5353,
                        "nodePort": NODEPORT}]),
        endpoints("dns", [ep(POD_A, "node-a"), ep(POD_B, "node-b")]),
        endpoints("dns", [ep(POD_A6, "node-a")], family="IPv6"),
        service("web", "10.96.0.20", proto="TCP"),
        endpoints("web", [ep("10.244.1.3", "node-a")], proto="TCP"),
        service("empty", "10.96.0.30"),
        endpoints("empty", [ep("10.244.1.4", "node-a", ready=False, serving=False)]),
        service("draining", "10.96.0.40"),
        endpoints("draining", [terminating("10.244.3.2", "node-c"),
                               terminating("10.244.3.3", "node-c", serving=False)]),
        service("other-nodes", "10.96.0.50", internalTrafficPolicy="Local"),
        endpoints("other-nodes", [ep("10.244.2.5", "node-b")]),
    ]
    state = build_state(objects)
    assert not state.skipped, state.skipped
    return state


def entry(dst: str, reply_src: str, *, dport: int = 53, proto: int = IPPROTO_UDP,
          src: str = CLIENT, sport: int = 40000, reply_sport: int = 5353) -> ConntrackEntry:
    return ConntrackEntry(proto, src, dst, sport, dport, reply_src, reply_sport)


def at(*ips: str) -> frozenset[tuple[str, int]]:
    """Endpoints that answer from port 5353, the target port of the tests' services."""
    return frozenset((ip, 5353) for ip in ips)


@dataclass(frozen=True)
class Case:
    name: str
    entry: ConntrackEntry
    stale: bool


CASES = [
    Case("ClusterIP, answered by a removed endpoint", entry(DNS_VIP, GONE), True),
    Case("ClusterIP, answered by a current endpoint", entry(DNS_VIP, POD_A), False),
    Case("ClusterIP, answered from a current endpoint's old port (targetPort changed)",
         entry(DNS_VIP, POD_A, reply_sport=5300), True),
    Case("ClusterIP, endpoint on another node (policy/topology ignored)", entry(DNS_VIP, POD_B),
         False),
    Case("ClusterIP, never NATed (rejected while there were no endpoints)",
         entry(DNS_VIP, DNS_VIP), True),
    Case("ClusterIP, another port of the same IP", entry(DNS_VIP, GONE, dport=54), False),
    Case("TCP to a UDP service's IP:port", entry(DNS_VIP, GONE, proto=IPPROTO_TCP), False),
    Case("TCP service", entry("10.96.0.20", GONE, dport=53, proto=IPPROTO_TCP), False),
    Case("external IP, removed endpoint", entry(EXTERNAL_IP, GONE), True),
    Case("external IP, current endpoint", entry(EXTERNAL_IP, POD_B), False),
    Case("LoadBalancer VIP, removed endpoint", entry(LB_IP, GONE), True),
    Case("LoadBalancer VIP, current endpoint", entry(LB_IP, POD_A), False),
    Case("NodePort on the node IP, removed endpoint", entry(NODE_IP, GONE, dport=NODEPORT),
         True),
    Case("NodePort on the node IP, current endpoint", entry(NODE_IP, POD_A, dport=NODEPORT),
         False),
    Case("NodePort on the node IP, dropped (eTP=Local, not NATed)",
         entry(NODE_IP, NODE_IP, dport=NODEPORT), True),
    Case("NodePort number to a forwarded, non-local destination",
         entry("198.18.0.1", "198.18.0.1", dport=NODEPORT), False),
    # kubernetes#139628: scaled to zero, a one-way flow stayed DNATed to the deleted pod.
    Case("no serving endpoints: every entry goes", entry("10.96.0.30", GONE), True),
    Case("no serving endpoints, not NATed: goes too", entry("10.96.0.30", "10.96.0.30"), True),
    Case("terminating but serving endpoint kept", entry("10.96.0.40", "10.244.3.2"), False),
    Case("terminating, not serving endpoint", entry("10.96.0.40", "10.244.3.3"), True),
    Case("iTP=Local without local endpoints: flows elsewhere kept",
         entry("10.96.0.50", "10.244.2.5"), False),
    Case("unrelated UDP", entry("8.8.8.8", "8.8.8.8"), False),
    Case("IPv6 ClusterIP, removed endpoint", entry(DNS_VIP6, GONE6, src=CLIENT6), True),
    Case("IPv6 ClusterIP, current endpoint", entry(DNS_VIP6, POD_A6, src=CLIENT6), False),
    Case("IPv6, other spellings of the same addresses",
         entry("FD00:96:0:0::A", "fd00:244:0:1:0:0:0:2", src=CLIENT6), False),
    Case("IPv6 NodePort on the node IP, removed endpoint",
         entry(NODE_IP6, GONE6, src=CLIENT6, dport=NODEPORT), True),
]


@pytest.fixture(scope="module")
def allowed() -> Allowed:
    return allowed_map(udp_targets(cluster()).values(), node_ips=[NODE_IP, NODE_IP6])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stale(case: Case, allowed: Allowed) -> None:
    assert stale([case.entry], allowed) == ([case.entry] if case.stale else [])


def test_stale_keeps_order_and_picks_exactly_the_stale_ones(allowed: Allowed) -> None:
    entries = [c.entry for c in CASES]
    assert stale(entries, allowed) == [c.entry for c in CASES if c.stale]


def test_allowed_map_contents(allowed: Allowed) -> None:
    both = at(POD_A, POD_B)
    assert allowed.service_ips == {
        (DNS_VIP, 53): both,
        (EXTERNAL_IP, 53): both,
        (LB_IP, 53): both,
        (DNS_VIP6, 53): at(POD_A6),
        ("10.96.0.30", 53): frozenset(),
        ("10.96.0.40", 53): at("10.244.3.2"),
        ("10.96.0.50", 53): at("10.244.2.5"),
    }
    # One NodePort for both families: the IPv4 and IPv6 endpoints together.
    assert allowed.node_ports == {NODEPORT: both | at(POD_A6)}
    assert allowed.node_ips == frozenset({NODE_IP, NODE_IP6})


def test_nodeport_on_any_destination_without_node_ips() -> None:
    """Without node IPs the NodePort rule matches any destination, as upstream does."""
    loose = allowed_map(udp_targets(cluster()).values())
    forwarded = entry("198.18.0.1", "198.18.0.1", dport=NODEPORT)
    assert stale([forwarded], loose) == [forwarded]


def test_empty_allowed_is_falsy() -> None:
    assert not allowed_map([])
    assert stale([entry(DNS_VIP, GONE)], allowed_map([])) == []


def test_shared_destination_allows_the_union() -> None:
    a = UdpTarget(frozenset({(EXTERNAL_IP, 53)}), 0, at(POD_A))
    b = UdpTarget(frozenset({(EXTERNAL_IP, 53)}), 0, at(POD_B))
    merged = allowed_map([a, b])
    assert merged.service_ips[(EXTERNAL_IP, 53)] == at(POD_A, POD_B)
    assert stale([entry(EXTERNAL_IP, POD_B), entry(EXTERNAL_IP, GONE)], merged) == [
        entry(EXTERNAL_IP, GONE)]


def test_targets_per_family_and_only_udp() -> None:
    targets = udp_targets(cluster())
    names = {(key.name, fam) for key, fam in targets}
    assert names == {("dns", IPFamily.IPv4), ("dns", IPFamily.IPv6), ("draining", IPFamily.IPv4),
                     ("other-nodes", IPFamily.IPv4), ("empty", IPFamily.IPv4)}
    empty = targets[(ServicePortName("default", "empty", "p", Protocol.UDP), IPFamily.IPv4)]
    assert empty == UdpTarget(frozenset({("10.96.0.30", 53)}), 0, frozenset())
    dns6 = targets[(ServicePortName("default", "dns", "p", Protocol.UDP), IPFamily.IPv6)]
    assert dns6 == UdpTarget(frozenset({(DNS_VIP6, 53)}), NODEPORT, at(POD_A6))
    only4 = udp_targets(cluster(), families=(IPFamily.IPv4,))
    assert {fam for _key, fam in only4} == {IPFamily.IPv4}


def test_targets_of_some_services() -> None:
    state = cluster()
    some = udp_targets(state, services=[ServicePortName("default", "draining", "p",
                                                        Protocol.UDP).service])
    assert [key.name for key, _fam in some] == ["draining"]


# ---------------------------------------------------------------------------------------------
# needs_cleanup


def _targets(objects: list[dict[str, Any]]) -> dict[Any, UdpTarget]:
    return udp_targets(build_state(objects))


BASE = [service("dns", DNS_VIP), endpoints("dns", [ep(POD_A), ep(POD_B)]),
        service("web", "10.96.0.20", proto="TCP"),
        endpoints("web", [ep("10.244.1.3")], proto="TCP")]


def _change(index: int, obj: dict[str, Any]) -> list[dict[str, Any]]:
    out = list(BASE)
    out[index] = obj
    return out


NEEDS = [
    ("nothing changed", BASE, False),
    ("UDP endpoint removed", _change(1, endpoints("dns", [ep(POD_A)])), True),
    ("UDP endpoint added", _change(1, endpoints("dns", [ep(POD_A), ep(POD_B), ep(GONE)])),
     True),
    ("UDP endpoint became not ready (terminating, still serving)",
     _change(1, endpoints("dns", [ep(POD_A), terminating(POD_B)])), False),
    ("UDP service lost every endpoint", _change(1, endpoints("dns", [])), True),
    ("UDP service deleted", BASE[2:], True),
    ("UDP service lost its endpoints' slice", [BASE[0], *BASE[2:]], True),
    ("UDP service got an external IP", _change(0, service("dns", DNS_VIP,
                                                           externalIPs=[EXTERNAL_IP])), True),
    ("TCP endpoint removed", _change(3, endpoints("web", [], proto="TCP")), False),
    ("new UDP service", [*BASE, service("new", "10.96.0.60"), endpoints("new", [ep(GONE)])],
     True),
]


@pytest.mark.parametrize(("name", "objects", "expected"), NEEDS, ids=[n[0] for n in NEEDS])
def test_needs_cleanup(name: str, objects: list[dict[str, Any]], expected: bool) -> None:
    assert needs_cleanup(_targets(BASE), _targets(objects)) is expected


def test_needs_cleanup_first_sync() -> None:
    assert needs_cleanup(None, _targets(BASE)) is True
    assert needs_cleanup(None, {}) is False


def test_needs_cleanup_partial_current() -> None:
    """A partial sync passes only the changed services' targets."""
    before = _targets(BASE)
    after = _targets(_change(1, endpoints("dns", [ep(POD_A)])))
    assert needs_cleanup(before, {}, services=[]) is False
    assert needs_cleanup(before, after) is True
    assert needs_cleanup(before, {}) is True  # every service compared: dns is gone


def test_an_endpointless_nodeport_needs_the_node_ips() -> None:
    """Matched on the port alone, an endpoint-less NodePort would take every UDP flow to that
    port number, to any host: left out without node IPs (as kube-proxy always does)."""
    bare = UdpTarget(frozenset({(DNS_VIP, 53)}), NODEPORT, frozenset())
    assert allowed_map([bare]).node_ports == {}
    assert allowed_map([bare], node_ips=[NODE_IP]).node_ports == {NODEPORT: frozenset()}


# ---------------------------------------------------------------------------------------------
# withdrawn: frontends that went away (kubernetes#141371)

DNS = ServicePortName("default", "dns", "p", Protocol.UDP)
SHARED = [service("dns", DNS_VIP, type="NodePort", externalIPs=[EXTERNAL_IP],
                  ports=[{"name": "p", "port": 53, "protocol": "UDP", "targetPort": 5353,
                          "nodePort": NODEPORT}]),
          endpoints("dns", [ep(POD_A)]),
          service("dns2", "10.96.0.11", externalIPs=[EXTERNAL_IP]),
          endpoints("dns2", [ep(POD_B)])]


def _dns_with(**spec: Any) -> list[dict[str, Any]]:
    ports = [{"name": "p", "port": 53, "protocol": "UDP", "targetPort": 5353,
              "nodePort": spec.pop("nodePort", NODEPORT)}]
    return [service("dns", DNS_VIP, type="NodePort", ports=ports, **spec), *SHARED[1:]]


WITHDRAWN = [
    ("nothing changed", SHARED, set()),
    ("Service deleted: its ClusterIP, external IP and NodePort",
     SHARED[1:], {(DNS_VIP, 53), (EXTERNAL_IP, 53), ("node", NODEPORT)}),
    ("external IP taken off", _dns_with(), {(EXTERNAL_IP, 53)}),
    ("NodePort changed", _dns_with(externalIPs=[EXTERNAL_IP], nodePort=NODEPORT + 1),
     {("node", NODEPORT)}),
    ("endpoints gone, Service kept: not withdrawn (the target allows nobody)",
     [SHARED[0], *SHARED[2:]], set()),
]


@pytest.mark.parametrize(("name", "objects", "expected"), WITHDRAWN,
                         ids=[w[0] for w in WITHDRAWN])
def test_withdrawn(name: str, objects: list[dict[str, Any]], expected: set[Any]) -> None:
    gone = withdrawn(_targets(SHARED), _targets(objects))
    assert {k for k, _fam in gone} <= {DNS}
    found = {d for t in gone.values() for d in t.destinations}
    found |= {("node", t.node_port) for t in gone.values() if t.node_port}
    assert found == expected
    assert all(not t.endpoints for t in gone.values())


def test_withdrawn_compares_only_the_services_a_partial_sync_saw() -> None:
    """A partial sync's `current` holds only its services: the others are not gone."""
    before = _targets(SHARED)
    assert withdrawn(before, {}, services=[]) == {}
    assert set(withdrawn(before, {}, services=[DNS.service])) == {(DNS, IPFamily.IPv4)}


def test_a_shared_frontend_keeps_the_other_services_endpoints() -> None:
    """dns is deleted; dns2 still has the external IP: its flows stay, dns's go."""
    before = _targets(SHARED)
    after = _targets(SHARED[2:])
    gone = withdrawn(before, after, services=[DNS.service])
    work = [*claimants(after, gone).values(), *gone.values()]
    allowed = allowed_map(work, node_ips=[NODE_IP])
    assert allowed.service_ips == {(DNS_VIP, 53): frozenset(),
                                   (EXTERNAL_IP, 53): at(POD_B),
                                   ("10.96.0.11", 53): at(POD_B)}
    assert stale([entry(EXTERNAL_IP, POD_B), entry(EXTERNAL_IP, POD_A), entry(DNS_VIP, POD_A),
                  entry(NODE_IP, POD_A, dport=NODEPORT)], allowed) == [
        entry(EXTERNAL_IP, POD_A), entry(DNS_VIP, POD_A), entry(NODE_IP, POD_A, dport=NODEPORT)]


def test_canonical_ip() -> None:
    assert canonical_ip("FD00:0096:0::000A") == "fd00:96::a"
    assert canonical_ip("10.0.0.1") == "10.0.0.1"
    assert canonical_ip("not-an-ip:") == "not-an-ip:"
    assert entry(DNS_VIP6, POD_A6).family is IPFamily.IPv6


# --- after a repair: entries to a service frontend that no DNAT rewrote ----------------------


def unnated(dst: str, dport: int = 53, *, proto: int = IPPROTO_UDP, src: str = CLIENT,
            sport: int = 40000) -> ConntrackEntry:
    """An entry made while our rules were missing: answered from where the client sent to."""
    return ConntrackEntry(proto, src, dst, sport, dport, dst, dport)


NOT_DNATED_CASES = [
    Case("ClusterIP, not NATed", unnated(DNS_VIP), True),
    Case("ClusterIP, NATed to an endpoint", entry(DNS_VIP, POD_A), False),
    Case("ClusterIP, NATed to an endpoint long gone (the UDP cleanup's business)",
         entry(DNS_VIP, GONE), False),
    Case("ClusterIP, another port of the same IP", unnated(DNS_VIP, 54), False),
    Case("ClusterIP, another protocol on the same port", unnated(DNS_VIP, proto=IPPROTO_TCP),
         False),
    Case("TCP service's ClusterIP, not NATed (a SYN while the rules were gone)",
         unnated("10.96.0.20", proto=IPPROTO_TCP), True),
    Case("TCP service's ClusterIP, NATed",
         ConntrackEntry(IPPROTO_TCP, CLIENT, "10.96.0.20", 40000, 53, "10.244.1.3", 5353),
         False),
    Case("same address, port rewritten only (NATed)",
         ConntrackEntry(IPPROTO_UDP, CLIENT, DNS_VIP, 40000, 53, DNS_VIP, 5353), False),
    Case("service without endpoints, not NATed (traffic while the rules were gone)",
         unnated("10.96.0.30"), True),
    Case("external IP, not NATed", unnated(EXTERNAL_IP), True),
    Case("LoadBalancer VIP, not NATed", unnated(LB_IP), True),
    Case("NodePort on the node IP, not NATed", unnated(NODE_IP, NODEPORT), True),
    Case("NodePort on the node IP, NATed", entry(NODE_IP, POD_A, dport=NODEPORT), False),
    Case("NodePort number to a forwarded, non-local destination",
         unnated("198.18.0.1", NODEPORT), False),
    Case("the node's own port that is no NodePort (ssh)",
         unnated(NODE_IP, 22, proto=IPPROTO_TCP), False),
    Case("unrelated, not NATed", unnated("8.8.8.8"), False),
    Case("IPv6 ClusterIP, not NATed", unnated(DNS_VIP6, src=CLIENT6), True),
    Case("IPv6 ClusterIP, another spelling, not NATed",
         ConntrackEntry(IPPROTO_UDP, CLIENT6, "FD00:96:0:0::A", 40000, 53, "fd00:96::a", 53),
         True),
    Case("IPv6 ClusterIP, NATed", entry(DNS_VIP6, POD_A6, src=CLIENT6), False),
    Case("IPv6 NodePort on the node IP, not NATed", unnated(NODE_IP6, NODEPORT, src=CLIENT6),
         True),
]


@pytest.fixture(scope="module")
def frontends() -> dict[IPFamily, ServiceFrontends]:
    state = cluster()
    return {family: service_frontends(state, family, [NODE_IP, NODE_IP6])
            for family in (IPFamily.IPv4, IPFamily.IPv6)}


@pytest.mark.parametrize("case", NOT_DNATED_CASES, ids=[c.name for c in NOT_DNATED_CASES])
def test_not_dnated(case: Case, frontends: dict[IPFamily, ServiceFrontends]) -> None:
    assert not_dnated([case.entry], frontends[case.entry.family]) == (
        [case.entry] if case.stale else [])


def test_service_frontends_of_each_family() -> None:
    """Every address of every port (with endpoints or not), NodePorts on this node's IPs of
    the family; the protocols are those worth a dump."""
    state = cluster()
    v4 = service_frontends(state, IPFamily.IPv4, [NODE_IP, NODE_IP6])
    assert v4.addresses == {
        (IPPROTO_UDP, DNS_VIP, 53), (IPPROTO_UDP, EXTERNAL_IP, 53), (IPPROTO_UDP, LB_IP, 53),
        (IPPROTO_TCP, "10.96.0.20", 53), (IPPROTO_UDP, "10.96.0.30", 53),
        (IPPROTO_UDP, "10.96.0.40", 53), (IPPROTO_UDP, "10.96.0.50", 53)}
    assert (v4.node_ports, v4.node_ips) == ({(IPPROTO_UDP, NODEPORT)}, {NODE_IP})
    assert v4.protocols == {IPPROTO_UDP, IPPROTO_TCP}
    v6 = service_frontends(state, IPFamily.IPv6)
    assert v6.addresses == {(IPPROTO_UDP, DNS_VIP6, 53)} and v6.node_ips is None
    sctp = build_state([service("s", "10.96.0.60", proto="SCTP")])
    assert service_frontends(sctp, IPFamily.IPv4).protocols == {IPPROTO_SCTP}
    assert not service_frontends(build_state([]), IPFamily.IPv4)


# ---------------------------------------------------------------------------------------------
# Wired to syncs (sync/conntrack.py's ConntrackCleanup)


@dataclass
class RecordingSink:
    """The conntrack worker's seam: what a sync handed over, per family."""

    work: list[tuple[IPFamily, Allowed | ServiceFrontends]] = field(default_factory=list)

    def submit(self, family: IPFamily, work: Allowed | ServiceFrontends) -> None:
        self.work.append((family, work))


def test_a_deleted_udp_service_has_every_entry_to_its_frontends_deleted() -> None:
    """kubernetes#141371: the sync that removes a UDP Service's rules hands its ClusterIP,
    external IP and NodePort (on this node) over as allowing nobody; the same for a Service
    scaled to zero (#139629). A partial sync that changes nothing UDP hands nothing over."""
    sink = RecordingSink()
    proxier, _nft, _requests = fake_node_proxier(observers=[ConntrackCleanup(sink)])
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    for obj in SHARED:
        kind = "on_service" if obj["kind"] == "Service" else "on_slice"
        getattr(proxier, kind)(("default", obj["metadata"]["name"]), obj)
    proxier.sync()
    assert len(sink.work) == 1  # the first sync: everything
    proxier.on_slice(("default", "dns-ipv4"), endpoints("dns", []))
    proxier.sync()
    _family, scaled_to_zero = sink.work[-1]
    assert isinstance(scaled_to_zero, Allowed)
    assert scaled_to_zero.service_ips[(DNS_VIP, 53)] == frozenset()
    assert scaled_to_zero.node_ports == {NODEPORT: frozenset()}
    proxier.on_service(("default", "dns"), None)
    proxier.on_slice(("default", "dns-ipv4"), None)
    proxier.sync()
    family, deleted = sink.work[-1]
    assert family is IPFamily.IPv4 and isinstance(deleted, Allowed)
    assert deleted.service_ips == {(DNS_VIP, 53): frozenset(),
                                   (EXTERNAL_IP, 53): at(POD_B),  # dns2's too
                                   ("10.96.0.11", 53): at(POD_B)}
    assert deleted.node_ports == {NODEPORT: frozenset()}
    assert deleted.node_ips == frozenset({NODE_IP})
    submitted = len(sink.work)
    proxier.on_service(("default", "web"), make_service("default", "web", ip="10.96.0.20"))
    proxier.sync()
    assert len(sink.work) == submitted
