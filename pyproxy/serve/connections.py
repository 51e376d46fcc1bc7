"""New connections per endpoint, from the kernel's counters (pure; the I/O is injected).

The kernel counts (pyproxy.render, `count-new-connections`): the first packet of every DNATed
connection updates an element of a `new-connections-N` set, keyed by service address .
protocol . service port (the node port for a NodePort) . endpoint address . endpoint port,
whose counter counts that connection. The packet path creates the elements; no sync writes
them. Here:

- `Labels`: which series (service, port name, endpoint, scope) an element belongs to, from
  the selections in force. Several elements make one series (the ClusterIP's, an external
  IP's, the NodePort's). An element of no series (its endpoint left the service, or another
  table's DNAT) is not exported.
- `Ledger`: the exported totals never go backwards. An element deleted and created again
  starts from zero, so each element's last value is kept; when it disappears by our own
  garbage collection its value is banked in its series, and when it is found lower than
  before it was recreated meanwhile (someone deleted the table) and its old value is banked.
  An element missing from a read is not taken for gone (a dump can miss an element the
  kernel's hash table moved meanwhile): it keeps its last value, for at most `retention`.
- Garbage collection: an element of no series whose counter has not changed for `grace`
  seconds is deleted (through the injected deleter) and its value banked. Its endpoint gets
  no new connection from that service any more, so the value is final; if the endpoint comes
  back before, the element simply goes on counting.
- A series with no element left (its endpoints gone and collected) is still exported, with
  its banked total, for `retention` seconds, so an endpoint removed and added again within
  that time continues where it was; after that it is dropped (a later return starts a new
  series at zero, which Prometheus sees as a new series after its staleness gap).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog

from pyproxy.core.model import IPFamily, Node, ip_family
from pyproxy.core.topology import NodeLabels, PortSelection, endpoint_scope
from pyproxy.render.connection_keys import (
    PROTOCOL_NUMBERS,
    endpoint_part,
    node_port_part,
    service_part,
)

log = structlog.get_logger(__name__)

GRACE = 60.0  # seconds an element of no series stays unchanged before it is deleted
RETENTION = 3600.0  # seconds a series without elements (or a missing element) is kept
MIN_READ_INTERVAL = 1.0  # reads closer together than this share one (concurrent scrapes)
REFRESH_INTERVAL = 300.0  # the daemon reads at least this often (garbage collection)


class Series(NamedTuple):
    """The labels of one exported counter."""

    service: str  # namespace/name
    port: str  # the port's name ("" when unnamed)
    endpoint: str  # IP:port, IPv6 in brackets
    scope: str  # node | zone | cluster (topology.endpoint_scope)


# ---------------------------------------------------------------------------------------------
# Labels


@dataclass(frozen=True)
class CountingContext:
    """What labelling needs, copied under the sync lock: the selections in force and where
    this node is."""

    selections: Sequence[PortSelection]
    node: Node
    node_labels: NodeLabels


class Labels:
    """Element key → series, for the selections in force. An element is of a service port if
    its service part is one of the port's addresses (or its node port) and its endpoint is
    one this node may send that port's traffic to (`all_reachable`).

    Kept from one read to the next (a read at 10k services meets up to ~110k elements): a
    service port's entry is kept while its selection is the same object (a sync replaces the
    selections of the services it renders again, and only those) and this node's place (its
    zone, the other nodes' labels) is unchanged; its endpoints' series are built when one of
    its elements is first met."""

    def __init__(self, context: CountingContext | None = None) -> None:
        self._context: CountingContext | None = None
        self._ports: dict[int, _Port] = {}  # id(selection) → its entry
        self._by_address: dict[bytes, _Port] = {}
        self._by_node_port: dict[bytes, _Port] = {}
        if context is not None:
            self.update(context)

    def update(self, context: CountingContext) -> None:
        before, self._context = self._context, context
        if before is not None and _same(before.selections, context.selections) \
                and before.node == context.node and before.node_labels == context.node_labels:
            return
        if before is None or before.node != context.node \
                or before.node_labels != context.node_labels:
            self._ports = {}  # every scope may have changed
        ports = {}
        for ps in context.selections:
            entry = self._ports.get(id(ps))
            ports[id(ps)] = entry if entry is not None and entry.selection is ps else _Port(
                ps, context)
        self._ports = ports
        self._by_address, self._by_node_port = {}, {}
        for entry in ports.values():
            for address in entry.addresses:
                self._by_address.setdefault(address, entry)
            if entry.node_port:
                self._by_node_port.setdefault(entry.node_port, entry)

    def of(self, key: bytes) -> Series | None:
        split = 12 if len(key) == 20 else 24  # after the service address, protocol and port
        entry = self._by_address.get(key[:split])
        if entry is None:
            entry = self._by_node_port.get(key[split - 8:split] + bytes((split == 24,)))
            if entry is None:
                return None
        return (entry.series or entry.build()).get(key[split:])


class _Port:
    """One service port's keys, and (built when needed) its endpoints' series."""

    __slots__ = ("addresses", "context", "node_port", "selection", "series")

    def __init__(self, ps: PortSelection, context: CountingContext) -> None:
        port = ps.port
        protocol = PROTOCOL_NUMBERS[port.protocol]
        cluster_ip = port.cluster_ip(ps.family)
        self.selection, self.context = ps, context
        self.addresses = [] if cluster_ip is None else [
            service_part(address, protocol, port.port)
            for address in (cluster_ip, *port.external_ips_of(ps.family),
                            *port.load_balancer_vips(ps.family))]
        # node ports are per protocol on a node, whatever the family's address
        self.node_port = (node_port_part(protocol, port.node_port)
                          + bytes((ps.family is IPFamily.IPv6,))
                          if port.node_port and cluster_ip is not None else b"")
        self.series: dict[bytes, Series] | None = None

    def build(self) -> dict[bytes, Series]:
        ps, ctx = self.selection, self.context
        service, name = str(ps.port.name.service), ps.port.name.port
        self.series = {endpoint_part(ep.ip, ep.port): Series(
            service, name, ep.key, endpoint_scope(ep, ctx.node, ctx.node_labels))
            for ep in ps.selection.all_reachable}
        return self.series


def _same(a: Sequence[PortSelection], b: Sequence[PortSelection]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# The ledger


@dataclass(slots=True)
class _Tracked:
    series: Series
    base: int  # the element's value when it joined its series (0 for a new element)
    last: int  # its value at the last read that saw it
    seen: float  # when a read last saw it


@dataclass
class Ledger:
    """Totals per series that never go backwards, from successive reads of the elements."""

    grace: float = GRACE
    retention: float = RETENTION
    _elements: dict[bytes, _Tracked] = field(default_factory=dict)
    _banked: dict[Series, int] = field(default_factory=dict)
    _orphaned: dict[Series, float] = field(default_factory=dict)  # series → without elements since
    _stale: dict[bytes, tuple[int, float]] = field(default_factory=dict)  # no series: value, since

    def observe(self, counts: Mapping[bytes, int], labels: Callable[[bytes], Series | None],
                now: float) -> list[bytes]:
        """Take one read of every element in; returns the elements to garbage-collect."""
        collect = []
        elements = self._elements
        for key, value in counts.items():
            series = labels(key)
            tracked = elements.get(key)
            if tracked is not None and series is tracked.series and value >= tracked.last:
                # the common case: counting on in the same series (Labels keeps the object)
                tracked.last, tracked.seen = value, now
                continue
            self._track(key, value, series, now)
            if series is not None:
                self._stale.pop(key, None)
                continue
            before = self._stale.get(key)
            if before is None or before[0] != value:
                self._stale[key] = (value, now)
            elif now - before[1] >= self.grace:
                collect.append(key)
        for key in [k for k in self._stale if k not in counts]:
            del self._stale[key]
        self._expire(now)
        return collect

    def _track(self, key: bytes, value: int, series: Series | None, now: float) -> None:
        tracked = self._elements.get(key)
        if tracked is None:
            if series is not None:  # an element of no series is not exported
                self._elements[key] = _Tracked(series, 0, value, now)
                self._orphaned.pop(series, None)
            return
        if value < tracked.last:
            # recreated since the last read (not by us): its old count is final
            self._bank(tracked.series, tracked.last - tracked.base)
            tracked.base = 0
        if series is not None and series != tracked.series:
            # new labels (the endpoint's node changed zone): the old series keeps what it
            # counted, the new one counts from here
            self._bank(tracked.series, value - tracked.base)
            tracked.series, tracked.base = series, value
            self._orphaned.pop(series, None)
        tracked.last, tracked.seen = value, now

    def collected(self, keys: Iterable[bytes], now: float) -> None:
        """These elements were deleted: their last values are final."""
        gone = False
        for key in keys:
            self._stale.pop(key, None)
            tracked = self._elements.pop(key, None)
            if tracked is not None:
                self._bank(tracked.series, tracked.last - tracked.base)
                gone = True
        if gone:
            self._note_orphans(now)

    def _bank(self, series: Series, count: int) -> None:
        self._banked[series] = self._banked.get(series, 0) + count

    def _expire(self, now: float) -> None:
        missing = [k for k, t in self._elements.items() if now - t.seen >= self.retention]
        self.collected(missing, now)
        for series in [s for s, since in self._orphaned.items() if now - since >= self.retention]:
            del self._orphaned[series]
            self._banked.pop(series, None)

    def _note_orphans(self, now: float) -> None:
        live = {t.series for t in self._elements.values()}
        for series in self._banked:
            if series not in live:
                self._orphaned.setdefault(series, now)

    def totals(self) -> dict[Series, int]:
        out = dict(self._banked)
        for tracked in self._elements.values():
            out[tracked.series] = out.get(tracked.series, 0) + tracked.last - tracked.base
        return out


# ---------------------------------------------------------------------------------------------
# The counters of a node


class Kernel(NamedTuple):
    """The I/O the counters need (pyproxy.nlsets.KernelCounters, or a fake)."""

    read: Callable[[IPFamily], Mapping[bytes, int]]
    delete: Callable[[IPFamily, Sequence[bytes]], bool]


@dataclass
class ConnectionCounters:
    """Reads the kernel's counters on demand (a scrape, `pyproxy services -o wide`, the
    periodic refresh), at most once per `min_interval`, and keeps the ledger."""

    families: Sequence[IPFamily]
    context: Callable[[], CountingContext]
    kernel: Kernel
    clock: Callable[[], float] = time.monotonic
    ledger: Ledger = field(default_factory=Ledger)
    min_interval: float = MIN_READ_INTERVAL
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _labels: Labels = field(default_factory=Labels)
    _read_at: float = float("-inf")
    _totals: dict[Series, int] = field(default_factory=dict)
    last_read_seconds: float = 0.0
    last_elements: int = 0

    def totals(self) -> Mapping[Series, int]:
        with self._lock:
            now = self.clock()
            if now - self._read_at >= self.min_interval:
                self._refresh(now)
                self._read_at = self.clock()
            return self._totals

    def _refresh(self, now: float) -> None:
        started = time.perf_counter()
        labels = self._labels
        labels.update(self.context())
        counts: dict[bytes, int] = {}
        for family in self.families:
            counts.update(self.kernel.read(family))
        collect = self.ledger.observe(counts, labels.of, now)
        for family in self.families:
            mine = [key for key in collect if _family_of(key) is family]
            if mine and self.kernel.delete(family, mine):
                self.ledger.collected(mine, now)
        self._totals = self.ledger.totals()
        self.last_read_seconds = time.perf_counter() - started
        self.last_elements = len(counts)
        log.debug("connection_counters_read", elements=len(counts), collected=len(collect),
                  seconds=round(self.last_read_seconds, 3))

    def run_periodically(self, stop: threading.Event, interval: float) -> None:
        """Read now and then even when nobody asks: elements of departed endpoints are only
        collected by a read."""
        while not stop.wait(interval):
            try:
                self.totals()
            except Exception as err:  # a failed read must not end the thread
                log.warning("connection_counters_not_read", error=str(err))


def _family_of(key: bytes) -> IPFamily:
    return IPFamily.IPv4 if len(key) == 20 else IPFamily.IPv6


def endpoint_family(series: Series) -> IPFamily:
    return ip_family(series.endpoint.rpartition(":")[0].strip("[]"))
