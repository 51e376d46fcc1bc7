"""The netlink shell (pyroute2): the node's addresses, and conntrack entries.

Every function takes `netns`, an `ip netns` name (or a path such as /proc/PID/ns/net): pyroute2
then opens its netlink socket inside that namespace (it forks a short-lived helper that enters
the namespace and passes the socket back), so tests never touch the root namespace and the
process itself never switches namespaces. None is the namespace of the calling process (no
fork). A missing namespace is an error: pyroute2's default (O_CREAT) would silently create an
empty one, so every socket here is opened with flags=0.

Choices are pure functions (`choose_primary`, `choose_local`, `conntrack.stale`); this module
only reads and writes the kernel. Measured with pyroute2 0.9.7 on kernel 6.18 (4000 UDP
entries in a namespace): `dump_udp` costs about 0.7 ms per entry, almost all of it pyroute2's
message decoding; `delete` about 1 ms per entry (one request and ack each). A cleanup over tens
of thousands of UDP entries therefore takes seconds: run it outside the sync lock.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from pyproxy.core.conntrack import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    IPS_DST_NAT,
    Allowed,
    ConntrackEntry,
    ServiceFrontends,
    not_dnated,
    stale,
)
from pyproxy.core.departed import Departures, narrowed, to_departed
from pyproxy.core.model import IPFamily, ip_family
from pyproxy.kernel.nlconntrack import FlowCounts, KernelFlows
from pyproxy.lazy import submodule

log = structlog.get_logger(__name__)

# include/uapi/linux/if_addr.h
IFA_F_SECONDARY = 0x01  # IPv4 secondary; for IPv6 the same bit is IFA_F_TEMPORARY (privacy)
IFA_F_DADFAILED = 0x08
IFA_F_DEPRECATED = 0x20
IFA_F_TENTATIVE = 0x40
# include/uapi/linux/rtnetlink.h
RT_SCOPE_UNIVERSE = 0
RT_TABLE_MAIN = 254
RTN_UNICAST = 1

_AF = {IPFamily.IPv4: socket.AF_INET, IPFamily.IPv6: socket.AF_INET6}
_FAMILIES = (IPFamily.IPv4, IPFamily.IPv6)
MAX_REPORTED_ERRORS = 10


class ConntrackError(RuntimeError):
    """Conntrack entries could not be read (no permission, namespace gone, no ctnetlink)."""


# ---------------------------------------------------------------------------------------------
# Addresses


@dataclass(frozen=True, slots=True)
class InterfaceAddress:
    """One address as the kernel lists it (RTM_GETADDR), in the kernel's order."""

    index: int  # interface index
    address: str
    prefixlen: int
    scope: int  # 0 global, 253 link, 254 host
    flags: int  # IFA_F_* (the full 32-bit IFA_FLAGS when the kernel sends it)

    @property
    def family(self) -> IPFamily:
        return ip_family(self.address)

    @property
    def secondary(self) -> bool:
        return bool(self.flags & IFA_F_SECONDARY)

    @property
    def usable(self) -> bool:
        """Not a failed duplicate address (IPv6 DAD)."""
        return not self.flags & IFA_F_DADFAILED

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    @property
    def link_local(self) -> bool:
        return ipaddress.ip_address(self.address).is_link_local


def choose_local(addresses: Iterable[InterfaceAddress]) -> tuple[str, ...]:
    """Every local unicast address (no loopback, no IPv6 link-local), IPv4 first, each family
    in kernel order, without duplicates. IPv4 link-local (169.254/16) stays: such addresses are
    ordinary node addresses on some clouds."""
    chosen = [
        a for a in addresses
        if a.usable and not a.loopback and not (a.family is IPFamily.IPv6 and a.link_local)
    ]
    return tuple(dict.fromkeys(
        a.address for family in _FAMILIES for a in chosen if a.family is family))


def choose_primary(
    addresses: Sequence[InterfaceAddress], default_oifs: Mapping[IPFamily, Sequence[int]]
) -> tuple[str, ...]:
    """The node's primary address of each family (IPv4 first): the first global, non-secondary
    address on the interface of the family's default route (`default_oifs`: interface indexes,
    best route first); without a default route (or no such address on its interface), the first
    global, non-loopback, non-link-local address, preferring non-secondary ones."""
    out: list[str] = []
    for family in _FAMILIES:
        candidates = [
            a for a in addresses
            if a.family is family and a.usable and a.scope == RT_SCOPE_UNIVERSE
            and not a.loopback and not a.link_local
        ]
        good = [a for a in candidates
                if not a.secondary and not a.flags & (IFA_F_TENTATIVE | IFA_F_DEPRECATED)]
        pick = next(
            (a for oif in default_oifs.get(family, ()) for a in good if a.index == oif), None
        )
        if pick is None:
            pick = next(iter(good), None) or next(iter(candidates), None)
        if pick is not None:
            out.append(pick.address)
    return tuple(out)


def interface_addresses(netns: str | None = None) -> list[InterfaceAddress]:
    """Every address of the namespace, both families, in kernel order."""
    with _iproute(netns) as ipr:
        return list(_addresses(ipr))


def default_route_interfaces(netns: str | None = None) -> dict[IPFamily, list[int]]:
    """Interface indexes of the main table's default routes per family, lowest metric first
    (every next hop of a multipath route, in its order)."""
    with _iproute(netns) as ipr:
        return _default_oifs(ipr)


def primary_addresses(netns: str | None = None) -> tuple[str, ...]:
    """The node's primary IPv4 and/or IPv6 address (see `choose_primary`)."""
    with _iproute(netns) as ipr:
        return choose_primary(list(_addresses(ipr)), _default_oifs(ipr))


def local_addresses(netns: str | None = None) -> tuple[str, ...]:
    """Every local unicast address (see `choose_local`): the candidates nodePortAddresses CIDRs
    are matched against, and the "this node" addresses for NodePort conntrack cleanup."""
    return choose_local(interface_addresses(netns))


def _iproute(netns: str | None) -> Any:
    # pyroute2's IPRoute without the rest of pyroute2 (lazy.py). flags=0: never create a
    # missing namespace (pyroute2's default is O_CREAT).
    return submodule("pyroute2.iproute.linux").IPRoute(netns=netns, flags=0)


def _without_all_of_pyroute2() -> None:
    """The from-imports of pyroute2's modules after this import those modules alone, not
    every module of pyroute2 (its package's `__init__` deferred: lazy.py)."""
    submodule("pyroute2.netlink")


def _addresses(ipr: Any) -> Iterator[InterfaceAddress]:
    for family in (socket.AF_INET, socket.AF_INET6):
        for msg in ipr.get_addr(family=family):
            # On point-to-point links IFA_ADDRESS is the peer and IFA_LOCAL the local end.
            address = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
            if not address:
                continue
            flags = msg.get_attr("IFA_FLAGS")
            yield InterfaceAddress(
                index=int(msg["index"]),
                address=str(address),
                prefixlen=int(msg["prefixlen"]),
                scope=int(msg["scope"]),
                flags=int(msg["flags"] if flags is None else flags),
            )


def _default_oifs(ipr: Any) -> dict[IPFamily, list[int]]:
    out: dict[IPFamily, list[int]] = {}
    for family in _FAMILIES:
        routes: list[tuple[int, list[int]]] = []
        for msg in ipr.get_default_routes(family=_AF[family]):
            table = msg.get_attr("RTA_TABLE") or msg["table"]
            if table != RT_TABLE_MAIN or msg["type"] != RTN_UNICAST or msg["dst_len"] != 0:
                continue
            oifs: list[int] = []
            oif = msg.get_attr("RTA_OIF")
            if oif:
                oifs.append(int(oif))
            for hop in msg.get_attr("RTA_MULTIPATH") or ():
                if hop.get("oif"):
                    oifs.append(int(hop["oif"]))
            if oifs:
                routes.append((int(msg.get_attr("RTA_PRIORITY") or 0), oifs))
        routes.sort(key=lambda route: route[0])  # stable: kernel order among equal metrics
        out[family] = list(dict.fromkeys(oif for _metric, oifs in routes for oif in oifs))
    return out


# ---------------------------------------------------------------------------------------------
# Conntrack


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int = 0
    missing: int = 0  # already gone (expired, or deleted by someone else): not an error
    failed: int = 0
    errors: tuple[str, ...] = ()  # the first few failures
    duration: float = 0.0


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """One family's cleanup, for logs and metrics
    (`kubeproxy_conntrack_reconciler_deleted_entries_total`, `..._sync_duration_seconds`)."""

    family: IPFamily
    dumped: int = 0  # entries read
    stale: int = 0  # entries chosen for deletion
    deleted: int = 0
    missing: int = 0
    failed: int = 0
    errors: tuple[str, ...] = ()
    duration: float = 0.0
    departed: bool = False  # fast failure's TCP entries (core/departed.py), not UDP's

    @property
    def ok(self) -> bool:
        return not self.errors


class ConntrackCleaner:
    """Reads and deletes UDP conntrack entries of one namespace through ctnetlink.

    `cleanup` is what the sync loop calls: it never raises. `dump_udp` raises ConntrackError
    (so an unreadable table is not mistaken for an empty one); `delete` never raises.
    """

    def __init__(self, netns: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 flows: Callable[[IPFamily], FlowCounts] | None = None) -> None:
        self.netns = netns
        self.clock = clock
        # The raw dump of DNATed TCP flows that narrows fast failure's dumps (`narrowed`):
        # this namespace's by default; in another namespace (tests) none unless given.
        self.flows = flows if flows is not None or netns is not None else KernelFlows().read

    def _socket(self, family: IPFamily) -> Any:
        _without_all_of_pyroute2()
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTSocket

        return NFCTSocket(nfgen_family=_AF[family], netns=self.netns, flags=0)

    def dump_udp(self, family: IPFamily) -> list[ConntrackEntry]:
        """Every UDP entry of the family."""
        return self.dump(family, (IPPROTO_UDP,))

    def dump(self, family: IPFamily, protocols: Iterable[int]) -> list[ConntrackEntry]:
        """Every entry of the family with one of these IP protocols, one dump per protocol.
        The kernel filters on the protocol (CTA_FILTER, Linux >= 5.8); an older kernel that
        refuses the filter gets an unfiltered dump, filtered here."""
        _without_all_of_pyroute2()
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

        af, wanted = _AF[family], frozenset(protocols)
        out: list[ConntrackEntry] = []
        try:
            try:
                with self._socket(family) as sock:
                    for proto in sorted(wanted):
                        flt = NFCTAttrTuple(family=af, proto=proto)
                        out += _convert(sock.dump(tuple_orig=flt), family, wanted)
                    return out
            except NetlinkError as err:
                if err.code not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                log.info("conntrack_filter_refused_dumping_all",
                         family=str(family), error=str(err))
                with self._socket(family) as sock:
                    return _convert(sock.dump(), family, wanted)
        except Exception as err:
            raise ConntrackError(f"conntrack dump ({family}) failed: {_describe(err)}") from err

    def dump_never_dnated(self, family: IPFamily,
                          protocols: Iterable[int]) -> list[ConntrackEntry]:
        """The entries of the family with one of these protocols that no DNAT rewrote. The
        kernel filters on the status bit (CTA_STATUS_MASK, Linux >= 5.15), which spares
        decoding every NATed entry: pyroute2 decodes ~60 us of CPU per entry, and in the
        daemon, beside its other threads on a busy machine, 2,023 entries took 0.5 s, half
        the time a SYN waits for its retransmission (the tamper drill's node). A kernel that
        refuses the filter (or ignores it) sends more, which the planner sorts out."""
        _without_all_of_pyroute2()
        from pyroute2.netlink.exceptions import NetlinkError

        wanted = frozenset(protocols)
        try:
            with self._socket(family) as sock:
                return _convert(sock.dump(status=0, status_mask=IPS_DST_NAT), family, wanted)
        except NetlinkError as err:
            if err.code not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise ConntrackError(
                    f"conntrack dump ({family}) failed: {_describe(err)}") from err
            log.info("conntrack_status_filter_refused", family=str(family), error=str(err))
            return self.dump(family, wanted)
        except Exception as err:
            raise ConntrackError(f"conntrack dump ({family}) failed: {_describe(err)}") from err

    def delete(self, entries: Iterable[ConntrackEntry]) -> DeleteResult:
        """Delete entries by their original tuple (and zone). Entries already gone count as
        `missing`; failures are counted and reported, never raised."""
        _without_all_of_pyroute2()
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

        start = self.clock()
        by_family: dict[IPFamily, list[ConntrackEntry]] = {}
        for entry in entries:
            by_family.setdefault(entry.family, []).append(entry)
        deleted = missing = failed = 0
        errors: list[str] = []

        def report(message: str) -> None:
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(message)

        for family, todo in by_family.items():
            af = _AF[family]
            handled = 0
            try:
                with self._socket(family) as sock:
                    for entry in todo:
                        orig = NFCTAttrTuple(
                            family=af, saddr=entry.orig_src, daddr=entry.orig_dst,
                            proto=entry.proto, sport=entry.orig_sport, dport=entry.orig_dport)
                        try:
                            sock.entry("del", tuple_orig=orig, zone=entry.zone or None)
                            deleted += 1
                        except NetlinkError as err:
                            if err.code == errno.ENOENT:
                                missing += 1
                            else:
                                failed += 1
                                report(f"delete {entry}: {_describe(err)}")
                        handled += 1
            except Exception as err:  # the socket itself: namespace gone, no permission, ...
                failed += len(todo) - handled
                report(f"conntrack delete ({family}) failed: {_describe(err)}")
        result = DeleteResult(deleted, missing, failed, tuple(errors), self.clock() - start)
        if result.errors:
            log.warning("conntrack_delete_failed", failed=failed, errors=list(result.errors))
        return result

    def cleanup(self, family: IPFamily, allowed: Allowed) -> CleanupResult:
        """Dump the family's UDP entries, delete the stale ones (`conntrack.stale`). Never
        raises: errors are logged and returned."""
        if not allowed:
            return CleanupResult(family)
        out = self._clean(family, lambda: self.dump_udp(family),
                          lambda entries: stale(entries, allowed))
        if out.stale:
            log.info("stale_udp_conntrack_deleted", **_figures(out))
        return out

    def clear_not_dnated(self, family: IPFamily, frontends: ServiceFrontends) -> CleanupResult:
        """After a repair: dump the family's entries of the frontends' protocols and delete
        those addressed to a service frontend that no DNAT rewrote (`conntrack.not_dnated`).
        Never raises: errors are logged and returned."""
        if not frontends:
            return CleanupResult(family)
        out = self._clean(family,
                          lambda: self.dump_never_dnated(family, frontends.protocols),
                          lambda entries: not_dnated(entries, frontends))
        if out.stale:
            log.info("not_dnated_conntrack_deleted", **_figures(out))
        return out

    def dump_tcp_to(self, family: IPFamily,
                    frontends: Iterable[tuple[str | None, int]]) -> list[ConntrackEntry]:
        """The family's TCP entries addressed to these frontends ((IP, port); IP None: the
        port on any address), one dump each, filtered by the kernel on the original tuple
        (CTA_FILTER, Linux >= 5.8): a busy node's other connections are never decoded. An
        older kernel that refuses the filter gets one dump of every TCP entry."""
        _without_all_of_pyroute2()
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

        af, wanted = _AF[family], frozenset((IPPROTO_TCP,))
        if family is IPFamily.IPv6:
            # Kernel 6.18 answers a dump filtered on an IPv6 address with nothing, not even
            # the entry the address names (measured: tests/test_departed.py); the port alone
            # works, and the planner picks the destinations.
            frontends = sorted({(None, port) for _ip, port in frontends},
                               key=lambda f: f[1])
        out: list[ConntrackEntry] = []
        try:
            with self._socket(family) as sock:
                for ip, port in frontends:
                    flt = NFCTAttrTuple(family=af, proto=IPPROTO_TCP, dport=port,
                                        **({"daddr": ip} if ip else {}))
                    out += _convert(sock.dump(tuple_orig=flt), family, wanted)
            return out
        except NetlinkError as err:
            if err.code not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise ConntrackError(
                    f"conntrack dump ({family}) failed: {_describe(err)}") from err
            return self.dump(family, wanted)
        except Exception as err:
            raise ConntrackError(f"conntrack dump ({family}) failed: {_describe(err)}") from err

    def clear_departed(self, family: IPFamily, departures: Departures) -> CleanupResult:
        """Fast failure: dump the TCP entries of the frontends endpoints left, delete those
        answered by a departed endpoint (core/departed.py). Never raises: errors are
        logged and returned."""
        if not departures:
            return CleanupResult(family, departed=True)
        if self.flows is not None:
            try:
                departures = narrowed(departures, self.flows(family).flows)
            except Exception as err:  # every frontend dumped, as without the raw dump
                log.debug("conntrack_flows_unread", family=str(family), error=str(err))
            if not departures:
                return CleanupResult(family, departed=True)
        out = self._clean(family, lambda: self.dump_tcp_to(family, departures.filters),
                          lambda entries: to_departed(entries, departures))
        if out.stale:
            log.info("departed_tcp_conntrack_deleted", **_figures(out))
        return replace(out, departed=True)

    def _clean(self, family: IPFamily, dump: Callable[[], list[ConntrackEntry]],
               plan: Callable[[list[ConntrackEntry]], list[ConntrackEntry]]) -> CleanupResult:
        start = self.clock()
        try:
            entries = dump()
            doomed = plan(entries)
        except Exception as err:
            log.warning("conntrack_cleanup_failed", family=str(family), error=str(err))
            return CleanupResult(family, errors=(str(err),), duration=self.clock() - start)
        result = self.delete(doomed) if doomed else DeleteResult()
        return CleanupResult(
            family, dumped=len(entries), stale=len(doomed), deleted=result.deleted,
            missing=result.missing, failed=result.failed, errors=result.errors,
            duration=self.clock() - start,
        )


def _figures(out: CleanupResult) -> dict[str, object]:
    return {"family": str(out.family), "dumped": out.dumped, "deleted": out.deleted,
            "missing": out.missing, "failed": out.failed, "seconds": round(out.duration, 3)}


def _convert(messages: Iterable[Any], family: IPFamily,
             protocols: frozenset[int] = frozenset((IPPROTO_UDP,))) -> list[ConntrackEntry]:
    src, dst = ("CTA_IP_V4_SRC", "CTA_IP_V4_DST") if family is IPFamily.IPv4 else (
        "CTA_IP_V6_SRC", "CTA_IP_V6_DST")
    out: list[ConntrackEntry] = []
    for msg in messages:
        orig, reply = msg.get_attr("CTA_TUPLE_ORIG"), msg.get_attr("CTA_TUPLE_REPLY")
        if orig is None or reply is None:
            continue
        orig_ip, orig_proto = orig.get_attr("CTA_TUPLE_IP"), orig.get_attr("CTA_TUPLE_PROTO")
        reply_ip = reply.get_attr("CTA_TUPLE_IP")
        reply_proto = reply.get_attr("CTA_TUPLE_PROTO")
        if None in (orig_ip, orig_proto, reply_ip, reply_proto):
            continue
        proto = orig_proto.get_attr("CTA_PROTO_NUM")
        if proto not in protocols:
            continue  # the kernel filter is only a pre-selection (or was refused)
        out.append(ConntrackEntry(
            proto=proto,
            orig_src=orig_ip.get_attr(src),
            orig_dst=orig_ip.get_attr(dst),
            orig_sport=int(orig_proto.get_attr("CTA_PROTO_SRC_PORT")),
            orig_dport=int(orig_proto.get_attr("CTA_PROTO_DST_PORT")),
            reply_src=reply_ip.get_attr(src),
            reply_sport=int(reply_proto.get_attr("CTA_PROTO_SRC_PORT")),
            zone=int(msg.get_attr("CTA_ZONE") or 0),
        ))
    return out


def _describe(err: BaseException) -> str:
    code = getattr(err, "code", None)
    if isinstance(code, int) and code in errno.errorcode:
        return f"{errno.errorcode[code]}: {err}"
    return f"{type(err).__name__}: {err}"
