"""The netlink shell against real kernels, in throwaway network namespaces (testkit/netlab.py):
node addresses (primary/local) and UDP conntrack cleanup, cross-checked with iproute2 and the
conntrack CLI. The root namespace is never touched: pyroute2 opens its sockets inside the lab's
namespaces. The pure address choices are tested without a kernel first."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterable

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.conntrack import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    ConntrackEntry,
    allowed_map,
    needs_cleanup,
    service_frontends,
    stale,
    udp_targets,
    withdrawn,
)
from pyproxy.core.model import IPFamily
from pyproxy.kernel.netlink import (
    IFA_F_DADFAILED,
    IFA_F_DEPRECATED,
    IFA_F_SECONDARY,
    IFA_F_TENTATIVE,
    ConntrackCleaner,
    ConntrackError,
    InterfaceAddress,
    choose_local,
    choose_primary,
    default_route_interfaces,
    interface_addresses,
    local_addresses,
    primary_addresses,
)
from testkit.builders import ep, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, ConnResult, Lab

V4, V6 = IPFamily.IPv4, IPFamily.IPv6


# ---------------------------------------------------------------------------------------------
# Pure address choices


def addr(index: int, address: str, flags: int = 0, scope: int = 0) -> InterfaceAddress:
    return InterfaceAddress(index, address, 24 if "." in address else 64, scope, flags)


LO = [addr(1, "127.0.0.1", scope=254), addr(1, "::1", scope=254)]


def test_primary_is_on_the_default_route_interface() -> None:
    addrs = [*LO, addr(2, "10.0.1.5"), addr(3, "10.0.2.5"), addr(3, "10.0.2.6", IFA_F_SECONDARY),
             addr(2, "fd00:1::5"), addr(2, "fe80::1", scope=253), addr(3, "fd00:2::5")]
    assert choose_primary(addrs, {V4: [3], V6: [3]}) == ("10.0.2.5", "fd00:2::5")
    assert choose_primary(addrs, {V4: [2], V6: []}) == ("10.0.1.5", "fd00:1::5")


def test_primary_skips_secondary_tentative_deprecated_and_failed() -> None:
    addrs = [addr(2, "10.0.1.6", IFA_F_SECONDARY), addr(2, "10.0.1.5"),
             addr(2, "fd00:1::1", IFA_F_TENTATIVE), addr(2, "fd00:1::2", IFA_F_DEPRECATED),
             addr(2, "fd00:1::3", IFA_F_DADFAILED), addr(2, "fd00:1::4", IFA_F_SECONDARY),
             addr(2, "fd00:1::5")]
    assert choose_primary(addrs, {V4: [2], V6: [2]}) == ("10.0.1.5", "fd00:1::5")


def test_primary_fallback_without_default_route() -> None:
    addrs = [*LO, addr(2, "169.254.1.1", scope=253), addr(3, "10.0.2.6", IFA_F_SECONDARY),
             addr(4, "10.0.3.5"), addr(2, "fe80::1", scope=253)]
    assert choose_primary(addrs, {}) == ("10.0.3.5",)
    # Only a secondary address: better than nothing.
    assert choose_primary([addr(3, "10.0.2.6", IFA_F_SECONDARY)], {}) == ("10.0.2.6",)
    # A default route whose interface has no usable address: fall back too.
    assert choose_primary([addr(4, "10.0.3.5")], {V4: [9]}) == ("10.0.3.5",)
    assert choose_primary(LO, {}) == ()


def test_local_addresses() -> None:
    addrs = [*LO, addr(2, "fd00:1::5"), addr(2, "10.0.1.5"), addr(2, "10.0.1.6", IFA_F_SECONDARY),
             addr(2, "fe80::1", scope=253), addr(3, "169.254.1.1", scope=253),
             addr(3, "fd00:1::9", IFA_F_DADFAILED), addr(4, "10.0.1.5"),
             addr(1, "10.255.0.1", scope=0)]  # an address on lo that is not loopback
    assert choose_local(addrs) == ("10.0.1.5", "10.0.1.6", "169.254.1.1", "10.255.0.1",
                                   "fd00:1::5")


# ---------------------------------------------------------------------------------------------
# Addresses of a real namespace


def _ip_addresses(lab: Lab, ns: str) -> list[tuple[str, str, bool]]:
    """iproute2's view, in its order, to cross-check pyroute2's: (interface, address, whether
    global and not secondary)."""
    out = json.loads(lab.ip(ns, "-j", "addr", "show").stdout)
    return [(link["ifname"], a["local"], a["scope"] == "global" and not a.get("secondary"))
            for link in out for a in link.get("addr_info", ())]


def _ip_first(lab: Lab, ns: str, ifname: str, v6: bool) -> str:
    return next(address for name, address, good in _ip_addresses(lab, ns)
                if name == ifname and good and (":" in address) == v6)


@requires_netns
@pytest.mark.netns
def test_addresses_of_a_namespace(lab: Lab) -> None:
    node = lab.add_ns("node")
    lab.add_ns("peer1")
    lab.add_ns("peer2")
    lab.link(node, "peer1", ["10.10.1.5/24", "fd00:10:1::5/64"], ["10.10.1.1/24"],
             if_a="eth0", if_b="eth0")
    lab.add_addr(node, "eth0", "10.10.1.6/24")  # same subnet: a secondary address
    lab.add_addr(node, "eth0", "fd00:10:1::6/64")
    lab.link(node, "peer2", ["10.10.2.5/24", "fd00:10:2::5/64"], ["10.10.2.1/24"],
             if_a="eth1", if_b="eth0")
    ns = node.full

    listed = interface_addresses(ns)
    for v6 in (False, True):  # same addresses, same order per family
        assert [a.address for a in listed if (":" in a.address) == v6] == [
            a for _name, a, _good in _ip_addresses(lab, "node") if (":" in a) == v6]
    by_address = {a.address: a for a in listed}
    assert by_address["10.10.1.6"].secondary and not by_address["10.10.1.5"].secondary
    assert by_address["127.0.0.1"].scope == 254
    local = local_addresses(ns)
    assert set(local) == {"10.10.1.5", "10.10.1.6", "10.10.2.5",
                          "fd00:10:1::5", "fd00:10:1::6", "fd00:10:2::5"}
    assert all("." in a for a in local[:3])  # IPv4 first

    # No default route: the first global address of each family, in kernel order. The kernel
    # (and `ip addr`) lists IPv6 addresses of an interface newest first.
    assert default_route_interfaces(ns) == {V4: [], V6: []}
    assert primary_addresses(ns) == ("10.10.1.5", "fd00:10:1::6")
    assert _ip_first(lab, "node", "eth0", v6=True) == "fd00:10:1::6"

    # Default routes through eth1, which is not the first interface.
    lab.add_route(node, "default", via="10.10.2.1")
    lab.add_route(node, "default", via="fd00:10:2::1")
    eth1 = next(a.index for a in listed if a.address == "10.10.2.5")
    assert default_route_interfaces(ns) == {V4: [eth1], V6: [eth1]}
    assert primary_addresses(ns) == ("10.10.2.5", "fd00:10:2::5")

    # The lowest metric wins; a route in another table does not count.
    lab.ip(node, "route", "del", "default")
    lab.ip(node, "route", "add", "default", "via", "10.10.2.1", "metric", "200")
    lab.ip(node, "route", "add", "default", "via", "10.10.1.1", "metric", "100")
    lab.ip(node, "route", "add", "default", "via", "10.10.2.1", "table", "100")
    assert primary_addresses(ns)[0] == "10.10.1.5"  # the primary, not the secondary .6

    # A multipath default route: its first next hop's interface.
    lab.ip(node, "-6", "route", "del", "default")
    lab.ip(node, "-6", "route", "add", "default", "nexthop", "via", "fd00:10:1::1", "dev", "eth0",
           "nexthop", "via", "fd00:10:2::1", "dev", "eth1")
    eth0 = next(a.index for a in listed if a.address == "10.10.1.5")
    assert default_route_interfaces(ns)[V6] == [eth0, eth1]
    assert primary_addresses(ns) == ("10.10.1.5", _ip_first(lab, "node", "eth0", v6=True))


@requires_netns
@pytest.mark.netns
def test_missing_namespace_is_an_error_and_not_created(lab: Lab) -> None:
    missing = lab.prefix + "missing"
    with pytest.raises(FileNotFoundError):
        primary_addresses(missing)
    cleaner = ConntrackCleaner(netns=missing)
    with pytest.raises(ConntrackError):
        cleaner.dump_udp(V4)
    allowed = allowed_map(udp_targets(build_state(dns_objects("10.244.1.2", "fd00::2"))).values())
    result = cleaner.cleanup(V4, allowed)  # never raises
    assert not result.ok and result.deleted == 0 and "FileNotFoundError" in result.errors[0]
    gone = ConntrackEntry(IPPROTO_UDP, "1.2.3.4", "10.96.0.10", 1, 53, "1.1.1.1", 53)
    deleted = cleaner.delete([gone, gone])
    assert (deleted.deleted, deleted.failed, len(deleted.errors)) == (0, 2, 1)
    assert lab.leftovers() == []  # pyroute2's default would have created it


# ---------------------------------------------------------------------------------------------
# Conntrack cleanup in the standard topology


DNS_VIP, DNS_VIP6, OTHER_VIP, NODEPORT = "10.96.0.10", "fd00:96::a", "10.96.0.11", 30053


def dns_objects(pod4: str, pod6: str) -> list[dict[str, object]]:
    """The cluster after the sync: dns (UDP, dual-stack, NodePort) is served by pod-a only
    (pod-b was removed), other (UDP) by pod-b, web (TCP) by pod-a."""
    dns = make_service("default", "dns", ip=DNS_VIP)
    dns["spec"].update(type="NodePort", clusterIPs=[DNS_VIP, DNS_VIP6],
                       ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="PreferDualStack",
                       ports=[{"name": "dns", "port": 53, "protocol": "UDP",
                               "targetPort": 5353, "nodePort": NODEPORT}])
    other = make_service("default", "other", ip=OTHER_VIP)
    other["spec"]["ports"] = [{"name": "dns", "port": 53, "protocol": "UDP"}]
    web = make_service("default", "web", ip=DNS_VIP)
    udp_port = [{"name": "dns", "port": 5353, "protocol": "UDP"}]

    def with_ports(obj: dict[str, object]) -> dict[str, object]:
        obj["ports"] = udp_port
        return obj

    return [
        dns, with_ports(make_slice("default", "dns", [ep(pod4)])),
        with_ports(make_slice("default", "dns", [ep(pod6)], family="IPv6")),
        other, with_ports(make_slice("default", "other", [ep("10.244.2.2")])),
        web, make_slice("default", "web", [ep("10.244.1.2")]),
    ]


def _ruleset(cluster: Cluster, v6: bool, both: bool) -> str:
    """A kube-proxy-like NAT table: dns round-robins over pod-a and pod-b (or pod-a only)."""
    fam, daddr = ("ip6", "ip6 daddr") if v6 else ("ip", "ip daddr")
    a, b = (cluster.pods[p].addr(v6) for p in ("pod-a", "pod-b"))
    a, b = (f"[{a}]", f"[{b}]") if v6 else (a, b)
    vip = DNS_VIP6 if v6 else DNS_VIP
    pick = "numgen inc mod 2 vmap { 0 : goto epa, 1 : goto epb }" if both else "goto epa"
    extra = "" if v6 else (
        f"        {daddr} {OTHER_VIP} udp dport 53 goto epb\n"
        f"        {daddr} {vip} tcp dport 8080 dnat to {b}:8080\n")
    return (
        f"table {fam} t {{\n"
        "    chain epa { meta l4proto udp dnat to " + a + ":5353; }\n"
        "    chain epb { meta l4proto udp dnat to " + b + ":5353; }\n"
        f"    chain svcdns {{ {pick}; }}\n"
        "    chain pre {\n"
        "        type nat hook prerouting priority -100;\n"
        f"        {daddr} {vip} udp dport 53 goto svcdns\n"
        f"        {daddr} {cluster.node_ip(v6)} udp dport {NODEPORT} goto svcdns\n"
        f"{extra}"
        "    }\n"
        "}\n"
    )


def _cli_udp(lab: Lab, cluster: Cluster, v6: bool) -> set[tuple[str, int]]:
    """(original destination, original source port) of the UDP entries the conntrack CLI
    lists in the node namespace."""
    argv = ["conntrack", "-L", "-p", "udp", "-f", "ipv6" if v6 else "ipv4"]
    out = lab.run(cluster.node, argv).stdout
    found = set()
    for line in out.splitlines():
        dst = re.search(r"\bdst=(\S+)", line)
        sport = re.search(r"\bsport=(\d+)", line)
        assert dst and sport, line
        found.add((dst.group(1), int(sport.group(1))))
    return found


def _sent(results: Iterable[ConnResult], dst: str) -> dict[tuple[str, int], str]:
    out = {}
    for res in results:
        assert res.ok, res
        assert res.name is not None and res.local_port is not None
        out[(dst, res.local_port)] = res.name
    return out


@requires_netns
@pytest.mark.netns
def test_conntrack_cleanup_removes_exactly_the_stale_entries(lab: Lab) -> None:
    cluster = lab.standard_topology(backends=2, tcp_ports=(8080,), udp_ports=(5353,))
    node, client = cluster.node, cluster.client
    lab.nft(node, _ruleset(cluster, v6=False, both=True) + _ruleset(cluster, v6=True, both=True))

    # Traffic while dns has both endpoints: two fixed source ports (one lands on each pod),
    # two random ones, the NodePort, the other service, a TCP flow; IPv6 too.
    sent4 = _sent(lab.connect(client, DNS_VIP, 53, "udp", sport=42000), DNS_VIP)
    sent4 |= _sent(lab.connect(client, DNS_VIP, 53, "udp", sport=42001), DNS_VIP)
    sent4 |= _sent(lab.connect(client, DNS_VIP, 53, "udp", count=2), DNS_VIP)
    node_ip = cluster.node_ip()
    sent4 |= _sent(lab.connect(client, node_ip, NODEPORT, "udp", count=2), node_ip)
    sent4 |= _sent(lab.connect(client, OTHER_VIP, 53, "udp"), OTHER_VIP)
    sent6 = _sent(lab.connect(client, DNS_VIP6, 53, "udp", count=2), DNS_VIP6)
    tcp = lab.connect(client, DNS_VIP, 8080, "tcp")
    assert tcp[0].name == "pod-b"
    assert {sent4[(DNS_VIP, 42000)], sent4[(DNS_VIP, 42001)]} == {"pod-a", "pod-b"}
    assert set(sent6.values()) == {"pod-a", "pod-b"}
    assert _cli_udp(lab, cluster, v6=False) == set(sent4)
    assert _cli_udp(lab, cluster, v6=True) == set(sent6)

    # The sync removes pod-b from dns. Its flows stay pinned to pod-b until cleaned up.
    for v6 in (False, True):
        fam = "ip6" if v6 else "ip"
        lab.nft(node, f"flush chain {fam} t svcdns\nadd rule {fam} t svcdns goto epa\n")
    pinned = 42000 if sent4[(DNS_VIP, 42000)] == "pod-b" else 42001
    again = lab.connect(client, DNS_VIP, 53, "udp", sport=pinned)
    assert again[0].name == "pod-b"

    state = build_state(dns_objects(cluster.pods["pod-a"].ip4, cluster.pods["pod-a"].ip6))
    allowed = allowed_map(udp_targets(state).values(), node_ips=local_addresses(node.full))
    assert allowed.node_ips is not None
    assert {cluster.node_ip(), cluster.node_ip(True)} <= allowed.node_ips
    cleaner = ConntrackCleaner(netns=node.full)

    # IPv4 step by step: dump, plan, delete; cross-checked with the CLI.
    entries = cleaner.dump_udp(V4)
    assert all(e.proto == IPPROTO_UDP for e in entries)  # the TCP flow is filtered out
    assert {(e.orig_dst, e.orig_sport) for e in entries} == set(sent4)
    pod_ips = {p.ip4: name for name, p in cluster.pods.items()}
    for e in entries:
        assert pod_ips[e.reply_src] == sent4[(e.orig_dst, e.orig_sport)]
        assert e.orig_src == cluster.client_ip() and e.reply_sport == 5353
    doomed = stale(entries, allowed)
    expected = {k for k, pod in sent4.items() if pod == "pod-b" and k[0] != OTHER_VIP}
    assert {(e.orig_dst, e.orig_sport) for e in doomed} == expected
    assert len(expected) == 3  # one or two per fixed/random pair, one NodePort
    result = cleaner.delete(doomed)
    assert (result.deleted, result.missing, result.failed) == (len(doomed), 0, 0)
    assert _cli_udp(lab, cluster, v6=False) == set(sent4) - expected
    assert "tcp" in lab.run(node, ["conntrack", "-L", "-p", "tcp"]).stdout  # TCP untouched

    # Deleting again: every entry is already gone, which is not an error.
    again_result = cleaner.delete(doomed)
    assert (again_result.deleted, again_result.missing, again_result.failed) == (0, len(doomed), 0)

    # IPv6 in one call, as the sync loop does it.
    summary = cleaner.cleanup(V6, allowed)
    stale6 = {k for k, pod in sent6.items() if pod == "pod-b"}
    assert (summary.dumped, summary.stale, summary.deleted, summary.ok) == (2, 1, 1, True)
    assert _cli_udp(lab, cluster, v6=True) == set(sent6) - stale6
    assert cleaner.cleanup(V4, allowed).stale == 0

    # The pinned flow is NATed afresh: to the remaining endpoint.
    assert lab.connect(client, DNS_VIP, 53, "udp", sport=pinned)[0].name == "pod-a"


@requires_netns
@pytest.mark.netns
def test_conntrack_entries_of_both_families_and_zones(lab: Lab) -> None:
    """Entries created through ctnetlink itself (no traffic): IPv6 spelling, a conntrack zone,
    and the kernel-side UDP filter leaving TCP out."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    ns = lab.add_ns("ct")
    # A new namespace only tracks connections once a rule needs conntrack.
    lab.nft(ns, "table inet t { chain o { type filter hook output priority 0; "
                "ct state new counter; }; }")

    def add(af: int, src: str, dst: str, proto: int, reply_src: str, zone: int = 0) -> None:
        orig = NFCTAttrTuple(family=af, saddr=src, daddr=dst, proto=proto, sport=1000,
                             dport=53)
        reply = NFCTAttrTuple(family=af, saddr=reply_src, daddr=src, proto=proto, sport=5353,
                              dport=1000)
        with Conntrack(netns=ns.full, nfgen_family=af, flags=0) as ct:
            ct.entry("add", timeout=120, tuple_orig=orig, tuple_reply=reply, zone=zone or None)

    add(socket.AF_INET, "203.0.113.1", DNS_VIP, socket.IPPROTO_UDP, "10.244.9.9")
    add(socket.AF_INET, "203.0.113.1", DNS_VIP, socket.IPPROTO_TCP, "10.244.9.9")
    add(socket.AF_INET, "203.0.113.2", DNS_VIP, socket.IPPROTO_UDP, "10.244.9.9", zone=7)
    add(socket.AF_INET6, "2001:db8::1", DNS_VIP6, socket.IPPROTO_UDP, "fd00:244:0:9::2")

    cleaner = ConntrackCleaner(netns=ns.full)
    v4 = cleaner.dump_udp(V4)
    assert sorted((e.orig_src, e.zone) for e in v4) == [("203.0.113.1", 0), ("203.0.113.2", 7)]
    assert cleaner.dump_udp(V6) == [ConntrackEntry(
        IPPROTO_UDP, "2001:db8::1", DNS_VIP6, 1000, 53, "fd00:244:0:9::2", 5353)]

    state = build_state(dns_objects("10.244.1.2", "fd00:244:0:1::2"))
    allowed = allowed_map(udp_targets(state).values(), node_ips=[])
    assert [cleaner.cleanup(f, allowed).deleted for f in (V4, V6)] == [2, 1]
    out = lab.run(ns, ["conntrack", "-L"]).stdout + lab.run(ns, ["conntrack", "-L", "-f",
                                                                 "ipv6"]).stdout
    assert [line.split()[0] for line in out.splitlines()] == ["tcp"]


@requires_netns
@pytest.mark.netns
def test_after_a_repair_only_entries_never_dnated_to_a_frontend_are_deleted(lab: Lab) -> None:
    """Entries made through ctnetlink (no traffic), TCP and UDP, both families: those to a
    service frontend answered from that frontend (no DNAT) go, everything else stays."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    ns = lab.add_ns("ct-repair")
    lab.nft(ns, "table inet t { chain o { type filter hook output priority 0; "
                "ct state new counter; }; }")

    def add(src: str, dst: str, dport: int, proto: int, reply_src: str,
            reply_sport: int) -> None:
        af = socket.AF_INET6 if ":" in src else socket.AF_INET
        orig = NFCTAttrTuple(family=af, saddr=src, daddr=dst, proto=proto, sport=1000,
                             dport=dport)
        reply = NFCTAttrTuple(family=af, saddr=reply_src, daddr=src, proto=proto,
                              sport=reply_sport, dport=1000)
        with Conntrack(netns=ns.full, nfgen_family=af, flags=0) as ct:
            ct.entry("add", timeout=120, tuple_orig=orig, tuple_reply=reply)

    add("203.0.113.1", DNS_VIP, 53, IPPROTO_UDP, DNS_VIP, 53)  # not NATed: goes
    add("203.0.113.2", DNS_VIP, 53, IPPROTO_UDP, "10.244.1.2", 5353)  # NATed: stays
    add("203.0.113.3", DNS_VIP, 80, IPPROTO_TCP, DNS_VIP, 80)  # web, not NATed: goes
    add("203.0.113.4", "192.0.2.1", 8080, IPPROTO_TCP, "192.0.2.1", 8080)  # no service: stays
    add("2001:db8::1", DNS_VIP6, 53, IPPROTO_UDP, DNS_VIP6, 53)  # not NATed: goes
    add("2001:db8::2", DNS_VIP6, 53, IPPROTO_UDP, "fd00:244:0:1::2", 5353)  # NATed: stays

    state = build_state(dns_objects("10.244.1.2", "fd00:244:0:1::2"))
    cleaner = ConntrackCleaner(netns=ns.full)
    results = [cleaner.clear_not_dnated(f, service_frontends(state, f)) for f in (V4, V6)]
    assert [(r.dumped, r.deleted, r.ok) for r in results] == [(4, 2, True), (2, 1, True)]
    left = {(e.orig_src, e.proto) for f in (V4, V6) for e in cleaner.dump(f, (6, 17))}
    assert left == {("203.0.113.2", IPPROTO_UDP), ("203.0.113.4", IPPROTO_TCP),
                    ("2001:db8::2", IPPROTO_UDP)}


@requires_netns
@pytest.mark.netns
def test_a_deleted_udp_services_flows_are_all_deleted(lab: Lab) -> None:
    """kubernetes#141371 with real flows: dns is deleted (its rules went with it), so every
    entry to its ClusterIP and its NodePort on this node goes, whichever pod answered it;
    the other Service's flow stays."""
    cluster = lab.standard_topology(backends=2, tcp_ports=(8080,), udp_ports=(5353,))
    node, client = cluster.node, cluster.client
    lab.nft(node, _ruleset(cluster, v6=False, both=True))
    node_ip = cluster.node_ip()
    sent = _sent(lab.connect(client, DNS_VIP, 53, "udp", count=4), DNS_VIP)
    sent |= _sent(lab.connect(client, node_ip, NODEPORT, "udp", count=2), node_ip)
    sent |= _sent(lab.connect(client, OTHER_VIP, 53, "udp"), OTHER_VIP)
    assert set(sent.values()) == {"pod-a", "pod-b"}
    assert _cli_udp(lab, cluster, v6=False) == set(sent)

    pod_a, pod_a6 = cluster.pods["pod-a"].ip4, cluster.pods["pod-a"].ip6
    before = udp_targets(build_state(dns_objects(pod_a, pod_a6)), (V4,))
    after = udp_targets(build_state(dns_objects(pod_a, pod_a6)[3:]), (V4,))
    gone = withdrawn(before, after)
    assert gone and needs_cleanup(before, after)
    allowed = allowed_map([*after.values(), *gone.values()],
                          node_ips=local_addresses(node.full))
    summary = ConntrackCleaner(netns=node.full).cleanup(V4, allowed)
    assert (summary.stale, summary.deleted, summary.ok) == (6, 6, True)
    assert _cli_udp(lab, cluster, v6=False) == {k for k in sent if k[0] == OTHER_VIP}
