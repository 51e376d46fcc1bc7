"""Conntrack cleanup, planned without a kernel: stale UDP flows after endpoint changes
(upstream's newest "reconciler", `pkg/proxy/conntrack/cleanup.go`), and, after a repair,
the entries our rules' absence left behind (`not_dnated`, at the end).

UDP is connectionless, so a conntrack entry keeps its NAT decision for as long as the client
keeps sending: after an endpoint goes away its flows stay pinned to the dead address, and a flow
that was rejected while the service had no endpoints stays un-NATed. After a sync that changed
a UDP service's endpoints, every UDP entry whose *original destination* is a service address
(ClusterIP, external IP, LoadBalancer VIP) or a NodePort on this node, but whose *reply source*
(who actually answers: the DNAT target) is not one of the service's serving endpoints, is
deleted; the next packet of the flow is then NATed afresh.

As upstream, the allowed endpoints are every *serving* endpoint (address and port: a flow
answered from the endpoint's old port, its targetPort changed, is stale too) of the service
port, whatever
the traffic policies, topology or terminating state say, so existing flows to an endpoint that
still serves keep working (like TCP connections do). A service port with no serving endpoint
allows none: every entry to it goes (kubernetes#139628/#139629, kube-proxy 1.37.0: a one-way
sender, statsd say, refreshes its entry with every datagram, so the reject rule never sees its
packets and they went to the deleted pod's address for as long as it kept sending). So do the
entries of a frontend that went away, a deleted Service's above all (kubernetes#141371, after
kube-proxy 1.37.2): `withdrawn` names them from the previous sync's targets.

The I/O half (dumping and deleting entries through netlink) is `pyproxy.netlink`.

Typical use after a sync (per family)::

    current = udp_targets(state, services=checkout.services)  # or the whole state
    if needs_cleanup(previous, current):
        allowed = allowed_map(all_targets.values(), node_ips=local_addresses())
        cleaner.cleanup(family, allowed)
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from pyproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    Protocol,
    ServiceKey,
    ServicePort,
    ServicePortName,
    ip_family,
)

IPPROTO_UDP = socket.IPPROTO_UDP
IPPROTO_TCP = socket.IPPROTO_TCP
IPPROTO_SCTP = 132  # not in every build's socket module
PROTOCOL_NUMBERS = {Protocol.TCP: IPPROTO_TCP, Protocol.UDP: IPPROTO_UDP,
                    Protocol.SCTP: IPPROTO_SCTP}
# An entry's status bits (include/uapi/linux/netfilter/nf_conntrack_common.h) and TCP states
# (nf_conntrack_tcp.h), as ctnetlink reports them: the one home of these numbers, for the
# planners here and the kernel's readers (kernel/nlconntrack.py, ctevents.py, netlink.py).
IPS_SEEN_REPLY, IPS_DST_NAT = 1 << 1, 1 << 5
TCP_CONNTRACK_ESTABLISHED, TCP_CONNTRACK_CLOSE = 3, 8


@dataclass(frozen=True, slots=True)
class ConntrackEntry:
    """The parts of one conntrack entry the planner needs (and that delete it again).

    `orig_*` is the tuple as the client sent it (before DNAT); `reply_src`/`reply_sport` is
    who answers, i.e. the DNAT target for a NATed flow, the original destination otherwise.
    `proto` is the IP protocol number (17 for UDP). `zone` is the conntrack zone (0 = none).
    """

    proto: int
    orig_src: str
    orig_dst: str
    orig_sport: int
    orig_dport: int
    reply_src: str
    reply_sport: int
    zone: int = 0

    @property
    def family(self) -> IPFamily:
        return ip_family(self.orig_dst)

    def __str__(self) -> str:
        return (f"proto={self.proto} src={self.orig_src} dst={self.orig_dst} "
                f"sport={self.orig_sport} dport={self.orig_dport} reply-src={self.reply_src}")


@dataclass(frozen=True, slots=True)
class UdpTarget:
    """What one UDP service port allows, for one IP family: the (IP, port) pairs clients send to
    (ClusterIP, external IPs, LoadBalancer VIPs), its NodePort (0: none) and the (IP, port)
    of its serving endpoints, who may answer (empty: nobody, every entry to it is stale)."""

    destinations: frozenset[tuple[str, int]]
    node_port: int
    endpoints: frozenset[Answerer]


TargetKey = tuple[ServicePortName, IPFamily]
Answerer = tuple[str, int]  # an endpoint's canonical IP and port


@dataclass(frozen=True)
class Allowed:
    """Who may answer what: `service_ips[(IP, port)]` and `node_ports[port]` are the serving
    endpoints (IP, port) of the UDP service behind that destination.

    `node_ips` restricts the NodePort rule to entries addressed to this node (its local
    addresses); None matches a NodePort on any destination, as upstream does. Without it, a
    forwarded flow that merely happens to use a NodePort number as its destination port would
    be deleted on every cleanup.
    """

    service_ips: Mapping[tuple[str, int], frozenset[Answerer]] = field(default_factory=dict)
    node_ports: Mapping[int, frozenset[Answerer]] = field(default_factory=dict)
    node_ips: frozenset[str] | None = None

    def __bool__(self) -> bool:
        return bool(self.service_ips or self.node_ports)


@functools.lru_cache(maxsize=65536)
def _canon6(address: str) -> str:
    try:
        return ipaddress.IPv6Address(address).compressed
    except ValueError:
        return address


def canonical_ip(address: str) -> str:
    """One spelling per address, so model IPs and kernel IPs compare as strings: IPv6 is
    compressed (RFC 5952, what inet_ntop prints); IPv4 is left as is."""
    return _canon6(address) if ":" in address else address


def _is_serving(ep: Endpoint) -> bool:
    # A ready endpoint is serving; `serving` also covers terminating endpoints still serving.
    return ep.serving or ep.ready


def udp_target(
    port: ServicePort, family: IPFamily, endpoints: Iterable[Endpoint]
) -> UdpTarget | None:
    """One service port's target for `family`, from all its endpoints of that family; None
    for non-UDP ports and ports without an address of the family."""
    if port.protocol is not Protocol.UDP:
        return None
    serving = frozenset(
        (canonical_ip(ep.ip), ep.port) for ep in endpoints
        if ep.family is family and _is_serving(ep)
    )
    cluster_ip = port.cluster_ip(family)
    addresses = [
        *([cluster_ip] if cluster_ip else []),
        *port.external_ips_of(family),
        *port.load_balancer_vips(family),
    ]
    if not addresses and not port.node_port:
        return None
    destinations = frozenset((canonical_ip(ip), port.port) for ip in addresses)
    return UdpTarget(destinations, port.node_port, serving)


def udp_targets(
    state: ClusterState,
    families: Collection[IPFamily] = (IPFamily.IPv4, IPFamily.IPv6),
    services: Iterable[ServiceKey] | None = None,
) -> dict[TargetKey, UdpTarget]:
    """Targets of every UDP service port (of `services` only, when given: a partial sync's
    changed services), per family. Cheap: non-UDP ports are skipped
    before their endpoints are merged."""
    if services is None:
        ports: Iterable[ServicePort] = state.ports
    else:
        ports = [port for key in sorted(set(services)) for port in state.ports_of(key)]
    out: dict[TargetKey, UdpTarget] = {}
    for port in ports:
        if port.protocol is not Protocol.UDP:
            continue
        for family in port.families():
            if family not in families:
                continue
            target = udp_target(port, family, state.endpoints(port.name, family))
            if target is not None:
                out[(port.name, family)] = target
    return out


def allowed_map(targets: Iterable[UdpTarget], node_ips: Iterable[str] | None = None) -> Allowed:
    """Merge targets into the lookup `stale` uses. Two ports sharing a destination (an external
    IP claimed by two services) allow the union of their endpoints: deleting a flow that is
    legitimately served is worse than keeping a stale one. Without `node_ips` the NodePort of
    a target without endpoints is left out: matched on the port alone, it would take every
    UDP flow to that port number, to any host (kube-proxy skips it for that reason)."""
    service_ips: dict[tuple[str, int], frozenset[Answerer]] = {}
    node_ports: dict[int, frozenset[Answerer]] = {}
    for target in targets:
        for dest in target.destinations:
            service_ips[dest] = service_ips.get(dest, frozenset()) | target.endpoints
        if target.node_port and (target.endpoints or node_ips is not None):
            port = target.node_port
            node_ports[port] = node_ports.get(port, frozenset()) | target.endpoints
    nodes = None if node_ips is None else frozenset(canonical_ip(ip) for ip in node_ips)
    return Allowed(service_ips, node_ports, nodes)


def allowed_endpoints(entry: ConntrackEntry, allowed: Allowed) -> frozenset[Answerer] | None:
    """The endpoint IPs that may answer this entry, or None when it is none of our business
    (not UDP, not to a service address or NodePort)."""
    if entry.proto != IPPROTO_UDP:
        return None
    dst = canonical_ip(entry.orig_dst)
    by_ip = allowed.service_ips.get((dst, entry.orig_dport))
    if by_ip is not None:
        return by_ip
    by_port = allowed.node_ports.get(entry.orig_dport)
    if by_port is not None and (allowed.node_ips is None or dst in allowed.node_ips):
        return by_port
    return None


def stale(entries: Iterable[ConntrackEntry], allowed: Allowed) -> list[ConntrackEntry]:
    """The UDP entries to delete: addressed to a service IP:port (or to a NodePort on this
    node) but answered from an address and port that are not one of that service's serving
    endpoints, i.e. pinned to a removed endpoint (or to its old port) or to the un-NATed "no
    endpoints" state."""
    out: list[ConntrackEntry] = []
    for entry in entries:
        permitted = allowed_endpoints(entry, allowed)
        if (permitted is not None
                and (canonical_ip(entry.reply_src), entry.reply_sport) not in permitted):
            out.append(entry)
    return out


def needs_cleanup(
    previous: Mapping[TargetKey, UdpTarget] | None, current: Mapping[TargetKey, UdpTarget],
    services: Collection[ServiceKey] | None = None,
) -> bool:
    """Whether a sync from `previous` to `current` can have made UDP entries stale: a UDP
    service port that is new, whose endpoints or addresses changed, or that is gone.
    `current` may cover only `services`, those a partial sync touched (None: all). No
    previous state (the first sync after a start) always needs one."""
    if previous is None:
        return bool(current)
    return (any(previous.get(key) != target for key, target in current.items())
            or bool(withdrawn(previous, current, services)))


def withdrawn(
    previous: Mapping[TargetKey, UdpTarget], current: Mapping[TargetKey, UdpTarget],
    services: Collection[ServiceKey] | None = None,
) -> dict[TargetKey, UdpTarget]:
    """The frontends that `previous` had and `current` has no more, as targets without
    endpoints: every entry to them is stale. A deleted Service's or service port's
    (kubernetes#141371: its rules go, and a one-way flow stays DNATed to an endpoint whose
    address may already be another pod's), an external IP or LoadBalancer VIP taken off a
    Service, a NodePort changed. Only the ports of `services` are compared (None: all),
    since a partial sync's `current` covers no others."""
    out: dict[TargetKey, UdpTarget] = {}
    for key, before in previous.items():
        if services is not None and key[0].service not in services:
            continue
        after = current.get(key)
        gone = before.destinations - (after.destinations if after else frozenset())
        node_port = before.node_port if before.node_port and (
            after is None or after.node_port != before.node_port) else 0
        if gone or node_port:
            out[key] = UdpTarget(gone, node_port, frozenset())
    return out


def claimants(targets: Mapping[TargetKey, UdpTarget],
              gone: Mapping[TargetKey, UdpTarget]) -> dict[TargetKey, UdpTarget]:
    """The targets that still claim a withdrawn frontend (an external IP another Service also
    has, a NodePort taken over at once): cleaned together, their endpoints keep their flows
    (`allowed_map`'s union)."""
    addresses = {dest for target in gone.values() for dest in target.destinations}
    ports = {target.node_port for target in gone.values() if target.node_port}
    return {key: target for key, target in targets.items()
            if target.destinations & addresses or target.node_port in ports}


# ---------------------------------------------------------------------------------------------
# After a repair: what the rules' absence left behind
#
# While someone else's change had taken our rules away (a deleted table, base chain or map),
# nothing DNATed new connections. Wherever anything else in the namespace uses conntrack (a
# host firewall's `ct state`, another NAT table: on any real node), such a connection's
# first packet got a conntrack entry all the same, *without* DNAT, and it was confirmed when
# the packet was routed on (towards the ServiceCIDR's route or the default route). NAT is
# decided once per entry, at its first packet: after the repair, the connection's next
# packets (a TCP SYN retransmitted 1 s later, a UDP flow's next datagrams) follow that entry,
# un-NATed, and our repaired `cluster-ips-check` rejects them. The entry lives 120 s
# (SYN_SENT) or as long as the UDP flow keeps sending. Measured in docs/drills.md.
#
# Such an entry is recognised by its two tuples: addressed to a service frontend (a
# ClusterIP, external IP or LoadBalancer VIP with the port's protocol and port, or a NodePort
# on this node), and answered from that very address and port, i.e. never DNATed. With our
# rules in place no such entry is ever confirmed: a frontend's traffic is DNATed, or
# rejected or dropped before confirmation (no endpoints, eTP=Local without local ones, a
# source range). Entries NATed by anyone (us before the damage, another proxy) answer from
# an endpoint and are left alone.


@dataclass(frozen=True, slots=True)
class ServiceFrontends:
    """Where clients reach the services of one IP family: (protocol number, address, port)
    of every ClusterIP, external IP and LoadBalancer VIP, and (protocol number, port) of
    every NodePort. `node_ips` restricts NodePorts to entries addressed to this node (None:
    any address), as for the UDP cleanup."""

    addresses: frozenset[tuple[int, str, int]] = frozenset()
    node_ports: frozenset[tuple[int, int]] = frozenset()
    node_ips: frozenset[str] | None = None

    def __bool__(self) -> bool:
        return bool(self.addresses or self.node_ports)

    @property
    def protocols(self) -> frozenset[int]:
        """The protocols worth dumping entries of."""
        return frozenset(p for p, _, _ in self.addresses) | {p for p, _ in self.node_ports}


def service_frontends(state: ClusterState, family: IPFamily,
                      node_ips: Iterable[str] | None = None) -> ServiceFrontends:
    """Every service port's frontends of `family`, endpoints or not (a frontend without
    endpoints is rejected before confirmation, so it never has a legitimate un-NATed entry
    either)."""
    addresses: set[tuple[int, str, int]] = set()
    node_ports: set[tuple[int, int]] = set()
    for port in state.ports:
        if family not in port.families():
            continue
        proto = PROTOCOL_NUMBERS[port.protocol]
        cluster_ip = port.cluster_ip(family)
        for ip in (*([cluster_ip] if cluster_ip else []), *port.external_ips_of(family),
                   *port.load_balancer_vips(family)):
            addresses.add((proto, canonical_ip(ip), port.port))
        if port.node_port:
            node_ports.add((proto, port.node_port))
    nodes = None if node_ips is None else frozenset(
        canonical_ip(ip) for ip in node_ips if ip_family(ip) is family)
    return ServiceFrontends(frozenset(addresses), frozenset(node_ports), nodes)


def never_dnated(entry: ConntrackEntry) -> bool:
    """Answered from the address and port the client sent to: no DNAT rewrote it."""
    return (canonical_ip(entry.reply_src) == canonical_ip(entry.orig_dst)
            and entry.reply_sport == entry.orig_dport)


def to_frontend(entry: ConntrackEntry, frontends: ServiceFrontends) -> bool:
    dst = canonical_ip(entry.orig_dst)
    if (entry.proto, dst, entry.orig_dport) in frontends.addresses:
        return True
    return ((entry.proto, entry.orig_dport) in frontends.node_ports
            and (frontends.node_ips is None or dst in frontends.node_ips))


def not_dnated(entries: Iterable[ConntrackEntry],
               frontends: ServiceFrontends) -> list[ConntrackEntry]:
    """The entries to delete after a repair: addressed to a service frontend and never
    DNATed (made while our rules were missing). Every other entry is left alone."""
    return [e for e in entries if never_dnated(e) and to_frontend(e, frontends)]
