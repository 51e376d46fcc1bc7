"""Fast failure for removed endpoints, planned without a kernel: the TCP conntrack entries of
connections through a Service to an endpoint that has left it (the I/O, a filtered dump and
the deletes, is `ConntrackCleaner.clear_departed` in kernel/netlink.py).

When a pod is deleted its network namespace goes, and packets to its address get no answer.
A connection DNATed to it keeps its conntrack entry, so the client's next packet (an idle
keep-alive connection's next request) goes to the dead address again and again until TCP
gives up: minutes (tcp_retries2). kube-proxy flushes such entries for UDP only. Deleting the
entry makes that next packet a new flow for conntrack: with nf_conntrack_tcp_loose = 1 (the
kernel's default) a mid-stream packet is picked up as a new connection and DNATed afresh, so
another endpoint, which knows nothing of the connection, answers with a reset; with no
endpoint left the service's reject chain answers a non-SYN packet with a reset
(render/skeleton.py). Either way the client's request fails at once instead of hanging, and a
client that retries on a new connection succeeds elsewhere. (With tcp_loose = 0 the packet is
INVALID and no NAT applies: it hangs as before. pyproxy does not reset INVALID packets: an
out-of-window packet of a live connection is INVALID too, kubernetes#74839.)

What has left: an endpoint *address* that a TCP service port listed at the previous sync and
lists no more, in any condition. An endpoint still listed keeps its connections whatever its
conditions: a terminating one (serving or not) is draining them, which is what terminating
endpoints are for; one that is not ready may recover. An address still listed with another
port number (the targetPort changed) keeps them too: the pod is there and may still answer on
its old port. The service port's other ports are separate (`ns/svc:http` and `ns/svc:admin`
have their own frontends and lists), so an endpoint that left one port but stays in another
keeps the other's connections. A frontend another TCP service port also claims (an external
IP two Services share) keeps the connections of that port's listed addresses. A deleted
Service or service port is not a departure: its pods may still serve the connections.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pyproxy.core.conntrack import IPPROTO_TCP, ConntrackEntry, canonical_ip
from pyproxy.core.model import (
    IPFamily,
    Protocol,
    ServiceKey,
    ServicePort,
    SliceEndpoints,
    merge_slices,
)

Destination = tuple[str, int]  # a frontend's canonical IP and port
K = TypeVar("K", Destination, int)


@dataclass(frozen=True, slots=True)
class Listing:
    """One Service as a sync saw it: its ports and its EndpointSlices (the cache's own
    immutable tuples, held by reference: nothing is copied per sync)."""

    ports: tuple[ServicePort, ...]
    slices: tuple[SliceEndpoints, ...]


@dataclass(frozen=True, slots=True)
class Departed:
    """The endpoints that left one TCP service port of one family: where clients reach the
    port (ClusterIP, external IPs and LoadBalancer VIPs with the port; its NodePort, 0: none)
    and the endpoint addresses no longer listed."""

    port: ServicePort
    family: IPFamily
    destinations: frozenset[Destination]
    node_port: int
    addresses: frozenset[str]


def frontends(port: ServicePort, family: IPFamily) -> frozenset[Destination]:
    cluster_ip = port.cluster_ip(family)
    ips = (*([cluster_ip] if cluster_ip else []), *port.external_ips_of(family),
           *port.load_balancer_vips(family))
    return frozenset((canonical_ip(ip), port.port) for ip in ips)


def listed(port: ServicePort, family: IPFamily,
           slices: Sequence[SliceEndpoints]) -> frozenset[str]:
    """Every endpoint address the port lists for the family, whatever its conditions."""
    return frozenset(canonical_ip(ep.ip) for ep in merge_slices(slices, port.name, family))


def departed(before: Listing, after: Listing) -> list[Departed]:
    """What left each TCP port the Service has both before and after."""
    if before.slices is after.slices and before.ports is after.ports:
        return []
    previous = {port.name: port for port in before.ports}
    out: list[Departed] = []
    for port in after.ports:
        old = previous.get(port.name)
        if port.protocol is not Protocol.TCP or old is None:
            continue
        for family in port.families():
            gone = (listed(old, family, before.slices)
                    - listed(port, family, after.slices))
            if gone:
                out.append(Departed(port, family, frontends(port, family), port.node_port,
                                    gone))
    return out


def shared_frontends(departures: Iterable[Departed]) -> frozenset[Destination]:
    """The departures' external IP and LoadBalancer VIP frontends: the ones another Service
    may claim too (a ClusterIP is one Service's, a NodePort one port's)."""
    out: set[Destination] = set()
    for gone in departures:
        cluster_ip = gone.port.cluster_ip(gone.family)
        out.update(d for d in gone.destinations if d[0] != canonical_ip(cluster_ip or ""))
    return frozenset(out)


@dataclass(frozen=True)
class Departures:
    """One family's departed addresses, looked up as an entry is: by its original destination
    (`by_destination[(IP, port)]`) or, addressed to this node (`node_ips`; None: any
    address), by its NodePort (`by_node_port[port]`). `kept` lists, per frontend that other
    ports claim too, the addresses those still list."""

    by_destination: Mapping[Destination, frozenset[str]] = field(default_factory=dict)
    by_node_port: Mapping[int, frozenset[str]] = field(default_factory=dict)
    node_ips: frozenset[str] | None = None
    kept: Mapping[Destination, frozenset[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_destination or self.by_node_port)

    @property
    def filters(self) -> tuple[tuple[str | None, int], ...]:
        """What to dump (`(destination IP, port)`; IP None: a NodePort on any address),
        so that the kernel sends the entries of these frontends only."""
        return (*sorted(self.by_destination),
                *((None, port) for port in sorted(self.by_node_port)))


def departures_map(departures: Iterable[Departed],
                   claims: Mapping[Destination, frozenset[str]] | None = None,
                   node_ips: Iterable[str] | None = None) -> Departures:
    """Merge one family's departures into the lookup `to_departed` uses. `claims`: the
    addresses every other TCP port still lists behind a shared frontend (`still_listed`)."""
    by_destination: dict[Destination, frozenset[str]] = {}
    by_node_port: dict[int, frozenset[str]] = {}
    for gone in departures:
        for dest in gone.destinations:
            by_destination[dest] = by_destination.get(dest, frozenset()) | gone.addresses
        if gone.node_port:
            port = gone.node_port
            by_node_port[port] = by_node_port.get(port, frozenset()) | gone.addresses
    nodes = None if node_ips is None else frozenset(canonical_ip(ip) for ip in node_ips)
    return Departures(by_destination, by_node_port, nodes, dict(claims or {}))


def merged(departures: Sequence[Departures]) -> Departures:
    """Several syncs' departures of one family as one piece of work: each frontend's
    departed addresses united, and so are the addresses other ports were keeping behind a
    shared frontend (an address kept by any of them stays kept: never a listed endpoint's
    connection deleted); the node's addresses are the last's. What a worker that fell behind
    does with the syncs that queued up meanwhile: one dump per frontend, however many syncs
    named it, and the queue never holds more than one piece per family."""
    if len(departures) == 1:
        return departures[0]
    return Departures(_united([d.by_destination for d in departures]),
                      _united([d.by_node_port for d in departures]),
                      departures[-1].node_ips, _united([d.kept for d in departures]))


def _united(maps: Sequence[Mapping[K, frozenset[str]]]) -> dict[K, frozenset[str]]:
    out: dict[K, frozenset[str]] = {}
    for part in maps:
        for key, addresses in part.items():
            out[key] = out.get(key, frozenset()) | addresses
    return out


def still_listed(ports: Iterable[ServicePort], family: IPFamily,
                 slices_of: Mapping[ServiceKey, tuple[SliceEndpoints, ...]],
                 shared: frozenset[Destination]) -> dict[Destination, frozenset[str]]:
    """For each shared frontend, the addresses that the TCP ports claiming it list now."""
    out: dict[Destination, frozenset[str]] = {}
    if not shared:
        return out
    for port in ports:
        if port.protocol is not Protocol.TCP or family not in port.families():
            continue
        claimed = frontends(port, family) & shared
        if claimed:
            addresses = listed(port, family, slices_of.get(port.name.service, ()))
            for dest in claimed:
                out[dest] = out.get(dest, frozenset()) | addresses
    return out


def departed_addresses(entry: ConntrackEntry, departures: Departures) -> frozenset[str]:
    """The departed addresses behind this entry's frontend (empty: none of our business)."""
    if entry.proto != IPPROTO_TCP:
        return frozenset()
    dst = canonical_ip(entry.orig_dst)
    by_ip = departures.by_destination.get((dst, entry.orig_dport))
    if by_ip is not None:
        return by_ip - departures.kept.get((dst, entry.orig_dport), frozenset())
    by_port = departures.by_node_port.get(entry.orig_dport)
    if by_port is not None and (departures.node_ips is None or dst in departures.node_ips):
        return by_port
    return frozenset()


def narrowed(departures: Departures,
             flows: Iterable[tuple[str, int, str, int]]) -> Departures:
    """The departures cut down to the frontends that some DNATed TCP flow reaches through a
    departed endpoint: flows as kernel/nlconntrack.py's raw dump reads them (original
    destination and port, the answering endpoint and its port), at a few µs an entry. Only
    those frontends are worth a dump of their own (pyroute2's, ~6 ms of CPU each even when
    it finds nothing: at 100 changes/s half a core went to them); nothing when no flow is
    (the common case: most departed endpoints had no connection through this node)."""
    by_destination: dict[Destination, frozenset[str]] = {}
    by_node_port: dict[int, frozenset[str]] = {}
    nodes = departures.node_ips
    for dst, dport, src, _sport in flows:
        dst, src = canonical_ip(dst), canonical_ip(src)
        addresses = departures.by_destination.get((dst, dport))
        if addresses is not None:
            if src in addresses and src not in departures.kept.get((dst, dport), ()):
                by_destination[(dst, dport)] = addresses
            continue
        addresses = departures.by_node_port.get(dport)
        if addresses is not None and src in addresses and (nodes is None or dst in nodes):
            by_node_port[dport] = addresses
    return Departures(by_destination, by_node_port, nodes, departures.kept)


def to_departed(entries: Iterable[ConntrackEntry], departures: Departures) -> list[ConntrackEntry]:
    """The TCP entries to delete: addressed to the frontend of a port an endpoint left, and
    answered by that endpoint (the DNAT target: `reply_src`). Every other entry stays, the
    connections to the endpoints still listed above all."""
    return [e for e in entries
            if canonical_ip(e.reply_src) in departed_addresses(e, departures)]
