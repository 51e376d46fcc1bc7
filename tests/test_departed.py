"""Fast failure planned without a kernel (core/departed.py): which endpoints left which TCP
service port, which conntrack entries that makes stale, and the sync observer that hands the
work over (sync/conntrack.py). Real packets: tests/test_fast_failure_netns.py."""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.conntrack import IPPROTO_TCP, IPPROTO_UDP, Allowed, ConntrackEntry
from pyproxy.core.departed import (
    Departures,
    Listing,
    departed,
    departures_map,
    merged,
    narrowed,
    shared_frontends,
    still_listed,
    to_departed,
)
from pyproxy.core.model import ClusterState, IPFamily
from pyproxy.kernel.netlink import ConntrackCleaner
from pyproxy.kernel.nlconntrack import FlowCounts
from pyproxy.sync.conntrack import ConntrackCleanup, ConntrackWorker, Work
from testkit.builders import ep, make_service, make_slice, terminating
from testkit.fakes import fake_node_proxier
from testkit.fixtures import requires_netns
from testkit.netlab import Lab
from testkit.waits import until

VIP, VIP6, EXTERNAL, NODE_IP, CLIENT = ("10.96.0.10", "fd00:96::a", "192.0.2.10",
                                        "192.168.50.1", "203.0.113.7")
POD_A, POD_B, POD_C = "10.244.1.2", "10.244.2.2", "10.244.3.2"
NODE_PORT = 30080


def web(ip: str = VIP, *, node_port: int = 0, external: str | None = None,
        admin: bool = False, name: str = "web") -> dict[str, Any]:
    def tweak(svc: dict[str, Any]) -> None:
        if node_port:
            svc["spec"]["type"] = "NodePort"
            svc["spec"]["ports"][0]["nodePort"] = node_port
        if external:
            svc["spec"]["externalIPs"] = [external]
        if admin:
            svc["spec"]["ports"].append({"name": "admin", "port": 81, "protocol": "TCP",
                                         "targetPort": 9090})
    return make_service("ns", name, tweak, ip=ip)


def slice_of(endpoints: list[dict[str, Any]], service: str = "web", *,
             ports: tuple[tuple[str, int], ...] = (("http", 8080),),
             name: str | None = None) -> dict[str, Any]:
    out = make_slice("ns", service, endpoints, name=name)
    out["ports"] = [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports]
    return out


def listing(state: ClusterState, service: str = "web") -> Listing:
    key = next(k for k in state.ports_by_service if k.name == service)
    return Listing(state.ports_of(key), state.slices.get(key, ()))


def gone_between(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """port name → departed addresses, for the IPv4 family."""
    out = departed(listing(build_state(before)), listing(build_state(after)))
    return {d.port.name.port: d.addresses for d in out if d.family is IPFamily.IPv4}


def test_an_endpoint_that_left_departs_and_one_still_listed_in_any_condition_stays() -> None:
    before = [web(), slice_of([ep(POD_A), ep(POD_B), ep(POD_C)])]
    after = [web(), slice_of([ep(POD_B, ready=False),
                              terminating(POD_C, serving=False)])]
    assert gone_between(before, after) == {"http": {POD_A}}
    # terminating (serving or not) and not ready: still listed, their connections kept
    assert gone_between(after, [web(), slice_of([ep(POD_B), terminating(POD_C)])]) == {}


def test_a_changed_target_port_keeps_the_address_and_the_other_ports_are_their_own() -> None:
    """The pod still answers on its old port: not a departure. An endpoint that leaves one
    port of a Service and stays in another departs the one only."""
    both = [web(admin=True), slice_of([ep(POD_A), ep(POD_B)],
                                      ports=(("http", 8080), ("admin", 9090)))]
    moved = [web(admin=True), slice_of([ep(POD_A), ep(POD_B)],
                                       ports=(("http", 8081), ("admin", 9090)))]
    assert gone_between(both, moved) == {}
    split = [web(admin=True),
             slice_of([ep(POD_B)], ports=(("http", 8080), ("admin", 9090)), name="web-1"),
             slice_of([ep(POD_A)], ports=(("admin", 9090),), name="web-2")]
    assert gone_between(both, split) == {"http": {POD_A}}


def test_a_deleted_service_or_port_and_udp_ports_are_no_departure() -> None:
    state = build_state([web(admin=True), slice_of([ep(POD_A)], ports=(("http", 8080),
                                                                       ("admin", 9090)))])
    fewer = build_state([web(), slice_of([ep(POD_A)])])
    assert departed(listing(state), listing(fewer)) == []  # admin went with its endpoints
    udp = web()
    udp["spec"]["ports"][0]["protocol"] = "UDP"
    udp_slice = slice_of([ep(POD_A)])
    udp_slice["ports"][0]["protocol"] = "UDP"
    assert gone_between([udp, udp_slice], [udp, slice_of([])]) == {}
    same = listing(state)
    assert departed(same, same) == []


def test_both_families_depart_on_their_own() -> None:
    svc = web()
    svc["spec"].update(clusterIPs=[VIP, VIP6], ipFamilies=["IPv4", "IPv6"],
                       ipFamilyPolicy="PreferDualStack")
    v6 = make_slice("ns", "web", [ep("fd00:244:0:1::2")], family="IPv6")
    before = build_state([svc, slice_of([ep(POD_A)]), v6])
    after = build_state([svc, slice_of([ep(POD_A)]), {**v6, "endpoints": []}])
    out = departed(listing(before), listing(after))
    assert [(d.family, d.addresses, d.destinations) for d in out] == [
        (IPFamily.IPv6, {"fd00:244:0:1::2"}, {(VIP6, 80)})]


def entry(dst: str, dport: int, answerer: str, sport: int = 8080,
          proto: int = IPPROTO_TCP) -> ConntrackEntry:
    return ConntrackEntry(proto, CLIENT, dst, 40000, dport, answerer, sport)


def departures_of(before: list[dict[str, Any]], after: list[dict[str, Any]],
                  node_ips: tuple[str, ...] | None = (NODE_IP,)) -> Departures:
    after_state = build_state(after)
    gone = departed(listing(build_state(before)), listing(after_state))
    return departures_map(gone, node_ips=node_ips)


def test_the_entries_answered_by_a_departed_endpoint_through_any_frontend_go() -> None:
    svc = web(node_port=NODE_PORT, external=EXTERNAL)
    departures = departures_of([svc, slice_of([ep(POD_A), ep(POD_B)])],
                               [svc, slice_of([ep(POD_B)])])
    doomed = [entry(VIP, 80, POD_A), entry(EXTERNAL, 80, POD_A),
              entry(NODE_IP, NODE_PORT, POD_A)]
    kept = [entry(VIP, 80, POD_B),  # an endpoint still listed
            entry(VIP, 81, POD_A),  # another port
            entry(VIP, 80, POD_A, proto=IPPROTO_UDP),  # UDP is the reconciler's
            entry("192.168.60.1", NODE_PORT, POD_A),  # a NodePort not to this node
            entry(POD_A, 8080, POD_A)]  # straight to the pod, no Service
    assert to_departed([*doomed, *kept], departures) == doomed
    assert departures.filters == ((VIP, 80), (EXTERNAL, 80), (None, NODE_PORT))
    anywhere = departures_of([svc, slice_of([ep(POD_A), ep(POD_B)])],
                             [svc, slice_of([ep(POD_B)])], node_ips=None)
    assert to_departed([entry("192.168.60.1", NODE_PORT, POD_A)], anywhere)


def test_a_shared_external_ip_keeps_what_the_other_service_still_lists() -> None:
    """Two Services claim one external IP and port: an address that left one but is
    listed by the other may be serving the other's connections there."""
    objects = [web(external=EXTERNAL), slice_of([ep(POD_A), ep(POD_B)]),
               web("10.96.0.11", external=EXTERNAL, name="other"),
               slice_of([ep(POD_A)], "other")]
    after_objects = [web(external=EXTERNAL), slice_of([ep(POD_B)]), *objects[2:]]
    before, after = build_state(objects), build_state(after_objects)
    gone = departed(listing(before), listing(after))
    shared = shared_frontends(gone)
    assert shared == {(EXTERNAL, 80)}
    claims = still_listed([p for p in after.ports if p.name.name == "other"],
                          IPFamily.IPv4, after.slices, shared)
    departures = departures_map(gone, claims, (NODE_IP,))
    assert to_departed([entry(EXTERNAL, 80, POD_A), entry(VIP, 80, POD_A)],
                       departures) == [entry(VIP, 80, POD_A)]


@dataclass
class RecordingSink:
    work: list[tuple[IPFamily, Work]] = field(default_factory=list)

    def submit(self, family: IPFamily, work: Work) -> None:
        self.work.append((family, work))

    def departures(self) -> list[Departures]:
        return [w for _f, w in self.work if isinstance(w, Departures)]


def synced_proxier(fast_failure: bool) -> tuple[Any, RecordingSink]:
    sink = RecordingSink()
    proxier, _nft, _requests = fake_node_proxier(
        observers=[ConntrackCleanup(sink, fast_failure)])
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.on_service(("ns", "web"), web(node_port=NODE_PORT))
    proxier.on_slice(("ns", "web-ipv4"), slice_of([ep(POD_A), ep(POD_B)]))
    proxier.sync()
    return proxier, sink


def test_each_sync_hands_over_what_left_and_nothing_when_turned_off() -> None:
    proxier, sink = synced_proxier(True)
    assert sink.departures() == []  # the first sync: nothing known to have left
    proxier.on_slice(("ns", "web-ipv4"), slice_of([ep(POD_B), terminating(POD_C)]))
    proxier.sync()
    [handed] = sink.departures()
    assert handed.by_destination == {(VIP, 80): {POD_A}}
    assert handed.by_node_port == {NODE_PORT: {POD_A}}
    assert handed.node_ips == {NODE_IP}
    proxier.on_slice(("ns", "web-ipv4"), slice_of([ep(POD_B)]))  # POD_C terminated
    proxier.on_service(("ns", "other"), web("10.96.0.11", name="other"))
    proxier.sync()
    assert sink.departures()[-1].by_destination == {(VIP, 80): {POD_C}}
    proxier.on_service(("ns", "web"), None)  # deleted: its pods may still serve
    proxier.sync()
    assert len(sink.departures()) == 2
    off_proxier, off = synced_proxier(False)
    off_proxier.on_slice(("ns", "web-ipv4"), slice_of([ep(POD_B)]))
    off_proxier.sync()
    assert off.departures() == []


def test_the_flows_narrow_the_departures_to_frontends_a_departed_endpoint_answers() -> None:
    departures = Departures({(VIP, 80): frozenset({POD_A}), (EXTERNAL, 80): frozenset({POD_A}),
                             (VIP6, 80): frozenset({"fd00:244::1:2"})},
                            {NODE_PORT: frozenset({POD_A})}, frozenset({NODE_IP}),
                            {(EXTERNAL, 80): frozenset({POD_A})})
    assert not narrowed(departures, [(VIP, 80, POD_B, 8080), (VIP, 81, POD_A, 8080)])
    assert not narrowed(departures, [(EXTERNAL, 80, POD_A, 8080)])  # another Service lists it
    assert not narrowed(departures, [("192.168.60.1", NODE_PORT, POD_A, 8080)])  # not ours
    found = narrowed(departures, [(VIP, 80, POD_A, 8080), (NODE_IP, NODE_PORT, POD_A, 8080),
                                  ("fd00:96:0::a", 80, "fd00:244:0::1:2", 8080)])
    assert found.by_destination == {(VIP, 80): {POD_A}, (VIP6, 80): {"fd00:244::1:2"}}
    assert found.by_node_port == {NODE_PORT: {POD_A}}
    assert (found.node_ips, found.kept) == (departures.node_ips, departures.kept)


def test_departures_of_several_syncs_merge_keeping_whatever_any_kept() -> None:
    first = Departures({(VIP, 80): frozenset({POD_A}), (EXTERNAL, 80): frozenset({POD_A})},
                       {NODE_PORT: frozenset({POD_A})}, frozenset({NODE_IP}),
                       {(EXTERNAL, 80): frozenset({POD_C})})
    second = Departures({(VIP, 80): frozenset({POD_B})}, {}, frozenset({NODE_IP, CLIENT}),
                        {(EXTERNAL, 80): frozenset({POD_B})})
    both = merged([first, second])
    assert both.by_destination == {(VIP, 80): {POD_A, POD_B}, (EXTERNAL, 80): {POD_A}}
    assert both.by_node_port == {NODE_PORT: {POD_A}}
    assert both.node_ips == {NODE_IP, CLIENT}  # the last sync's
    assert both.kept == {(EXTERNAL, 80): {POD_B, POD_C}}
    assert merged([first]) is first


class SlowCleaner:
    """A cleaner that holds its first piece of work until released, recording every piece."""

    def __init__(self) -> None:
        self.busy, self.release = threading.Event(), threading.Event()
        self.seen: list[Work] = []

    def clear_departed(self, family: IPFamily, work: Departures) -> Any:
        self.busy.set()
        self.release.wait(10)
        self.seen.append(work)
        return family

    def cleanup(self, family: IPFamily, work: Any) -> Any:
        self.seen.append(work)
        return family

    clear_not_dnated = cleanup


def test_a_worker_that_fell_behind_takes_what_queued_up_as_one_piece() -> None:
    """Under a churn faster than the cleanup, one Departures a sync queued up without bound
    (the soak's RSS grew 33 MiB an hour): what waits is taken at once and merged."""
    cleaner, results = SlowCleaner(), list[Any]()
    worker = ConntrackWorker(results.append, cleaner=lambda: cleaner)
    worker.start()
    worker.submit(IPFamily.IPv4, departures_map([]))  # the piece it is busy with
    assert cleaner.busy.wait(5)
    for i in range(500):
        worker.submit(IPFamily.IPv4, Departures({(VIP, 80): frozenset({f"10.244.9.{i % 250}"})}))
    worker.submit(IPFamily.IPv4, Allowed({}))
    cleaner.release.set()
    until(lambda: len(results) == 3, 5, "three pieces done")
    assert worker.pending.empty()
    _first, udp, rest = cleaner.seen
    assert isinstance(udp, Allowed) and isinstance(rest, Departures)
    assert len(rest.by_destination[(VIP, 80)]) == 250


@requires_netns
@pytest.mark.netns
def test_the_kernel_sends_the_frontends_entries_and_the_departed_ones_go(lab: Lab) -> None:
    """Entries made through ctnetlink (no traffic) in a namespace of the test's: the dump is
    filtered by the kernel to the frontends of the departures (TCP, to the ClusterIP's port
    or the NodePort), and of those only the departed endpoint's entries to this node go."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    ns = lab.add_ns("ct")
    # A new namespace only tracks connections once a rule needs conntrack.
    lab.nft(ns, "table inet t { chain o { type filter hook output priority 0; "
                "ct state new counter; }; }")

    def add(dst: str, dport: int, answerer: str, proto: int = IPPROTO_TCP,
            sport: int = 40000) -> None:
        orig = NFCTAttrTuple(family=socket.AF_INET, saddr=CLIENT, daddr=dst, proto=proto,
                             sport=sport, dport=dport)
        reply = NFCTAttrTuple(family=socket.AF_INET, saddr=answerer, daddr=CLIENT,
                              proto=proto, sport=8080, dport=sport)
        with Conntrack(netns=ns.full, nfgen_family=socket.AF_INET, flags=0) as ct:
            ct.entry("add", timeout=120, tuple_orig=orig, tuple_reply=reply)

    add(VIP, 80, POD_A, sport=40001)  # departed: goes
    add(VIP, 80, POD_B, sport=40002)  # still listed
    add(NODE_IP, NODE_PORT, POD_A, sport=40003)  # departed through the NodePort: goes
    add("192.168.60.1", NODE_PORT, POD_A, sport=40004)  # not addressed to this node
    add(VIP, 81, POD_A, sport=40005)  # another frontend: not even sent
    add(VIP, 80, POD_A, IPPROTO_UDP, sport=40006)  # UDP: not sent
    svc = web(node_port=NODE_PORT)
    departures = departures_of([svc, slice_of([ep(POD_A), ep(POD_B)])],
                               [svc, slice_of([ep(POD_B)])])
    # The raw dump of DNATed flows found none through a departed endpoint: no dump at all.
    untouched = ConntrackCleaner(netns=ns.full, flows=lambda family: FlowCounts(
        {(VIP, 80, POD_B, 8080): [1, 0]})).clear_departed(IPFamily.IPv4, departures)
    assert (untouched.dumped, untouched.deleted, untouched.departed) == (0, 0, True)
    # One through the ClusterIP: that frontend alone is dumped (the NodePort's entry stays).
    narrow = ConntrackCleaner(netns=ns.full, flows=lambda family: FlowCounts(
        {(VIP, 80, POD_A, 8080): [1, 0]})).clear_departed(IPFamily.IPv4, departures)
    assert (narrow.dumped, narrow.stale, narrow.deleted) == (2, 1, 1)
    add(VIP, 80, POD_A, sport=40001)
    result = ConntrackCleaner(netns=ns.full).clear_departed(IPFamily.IPv4, departures)
    assert (result.dumped, result.stale, result.deleted, result.ok, result.departed) == (
        4, 2, 2, True, True)
    out = lab.run(ns, ["conntrack", "-L"]).stdout
    assert sorted(int(m) for m in re.findall(r"sport=(4000\d)", out)) == [
        40002, 40004, 40005, 40006]


@requires_netns
@pytest.mark.netns
def test_the_same_over_ipv6(lab: Lab) -> None:
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    ns = lab.add_ns("ct6")
    lab.nft(ns, "table inet t { chain o { type filter hook output priority 0; "
                "ct state new counter; }; }")
    client, node, pod_a, pod_b = ("2001:db8::7", "fd00:50::1", "fd00:244:0:1::2",
                                  "fd00:244:0:2::2")

    def add(dst: str, dport: int, answerer: str, sport: int) -> None:
        orig = NFCTAttrTuple(family=socket.AF_INET6, saddr=client, daddr=dst,
                             proto=IPPROTO_TCP, sport=sport, dport=dport)
        reply = NFCTAttrTuple(family=socket.AF_INET6, saddr=answerer, daddr=client,
                              proto=IPPROTO_TCP, sport=8080, dport=sport)
        with Conntrack(netns=ns.full, nfgen_family=socket.AF_INET6, flags=0) as ct:
            ct.entry("add", timeout=120, tuple_orig=orig, tuple_reply=reply)

    add(VIP6, 80, pod_a, 40001)
    add(VIP6, 80, pod_b, 40002)
    add(node, NODE_PORT, pod_a, 40003)
    svc = web(node_port=NODE_PORT)
    svc["spec"].update(clusterIPs=[VIP, VIP6], ipFamilies=["IPv4", "IPv6"],
                       ipFamilyPolicy="PreferDualStack")
    v6 = make_slice("ns", "web", [ep(pod_a), ep(pod_b)], family="IPv6")
    gone = departed(listing(build_state([svc, v6])),
                    listing(build_state([svc, {**v6, "endpoints": [ep(pod_b)]}])))
    departures = departures_map(gone, node_ips=(node,))
    result = ConntrackCleaner(netns=ns.full).clear_departed(IPFamily.IPv6, departures)
    assert (result.dumped, result.deleted, result.ok) == (3, 2, True)
    out = lab.run(ns, ["conntrack", "-L", "-f", "ipv6"]).stdout
    assert re.findall(r"sport=(4000\d)", out) == ["40002"]
