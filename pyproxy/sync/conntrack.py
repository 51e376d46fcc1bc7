"""Conntrack cleanup after syncs (what to delete is `core/conntrack.py`'s and
`core/departed.py`'s; this decides when).

Three kinds of work, in order: the stale UDP flows of the services a sync changed (`Allowed`:
the diff of UDP targets between syncs), the TCP connections to endpoints that left a Service
(`Departures`, fast failure; off with --fast-failure=false), and after a repair the entries
made while our rules were missing (`ServiceFrontends`). The work is handed to a worker
thread: dumping and deleting entries can take seconds with many flows, and must not hold up
the next sync."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pyproxy.cluster.cache import Checkout
from pyproxy.core.conntrack import (
    Allowed,
    ServiceFrontends,
    UdpTarget,
    allowed_map,
    claimants,
    needs_cleanup,
    service_frontends,
    udp_targets,
    withdrawn,
)
from pyproxy.core.departed import (
    Departed,
    Departures,
    Listing,
    departed,
    departures_map,
    merged,
    shared_frontends,
    still_listed,
)
from pyproxy.core.model import ClusterState, IPFamily, ServiceKey, ServicePort
from pyproxy.core.plan import Cause
from pyproxy.sync.node import NodeProxier, SyncedOnly, SyncRecord

if TYPE_CHECKING:
    from pyproxy.kernel.netlink import CleanupResult


Work = Allowed | ServiceFrontends | Departures


class ConntrackSink(Protocol):
    """Where the cleanup hands conntrack work (ConntrackWorker; a recording fake in tests)."""

    def submit(self, family: IPFamily, work: Work) -> None: ...


def coalesced(batch: list[tuple[IPFamily, Work]]) -> list[tuple[IPFamily, Work]]:
    """What queued up while the worker was busy, as the work to do: the UDP and repair
    cleanups in order, then each family's departures merged into one (core/departed.py's
    `merged`). Under a churn that outpaced the cleanup (the soak's 100 changes/s), one
    Departures a sync queued up without bound (tracemalloc found 10,000 alive)."""
    departures: dict[IPFamily, list[Departures]] = {}
    out: list[tuple[IPFamily, Work]] = []
    for family, work in batch:
        if isinstance(work, Departures):
            departures.setdefault(family, []).append(work)
        else:
            out.append((family, work))
    return out + [(family, merged(pieces)) for family, pieces in departures.items()]


class ConntrackWorker:
    """Conntrack cleanup off the sync path, in one thread started by `start()`; each result
    (its duration and what it deleted) goes to `on_result` (the metrics). What was submitted
    while it worked is taken at once and `coalesced`."""

    def __init__(self, on_result: Callable[[CleanupResult], None],
                 cleaner: Callable[[], Any] | None = None) -> None:
        self.on_result = on_result
        self.pending: queue.Queue[tuple[IPFamily, Work]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="conntrack", daemon=True)
        self._cleaner = cleaner

    def start(self) -> None:
        self.thread.start()

    def submit(self, family: IPFamily, work: Work) -> None:
        self.pending.put((family, work))

    def _run(self) -> None:
        if self._cleaner is None:
            from pyproxy.kernel.netlink import ConntrackCleaner

            self._cleaner = ConntrackCleaner
        cleaner = self._cleaner()
        while True:
            batch = [self.pending.get()]
            while True:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            for family, work in coalesced(batch):
                if isinstance(work, ServiceFrontends):
                    self.on_result(cleaner.clear_not_dnated(family, work))
                elif isinstance(work, Departures):
                    self.on_result(cleaner.clear_departed(family, work))
                else:
                    self.on_result(cleaner.cleanup(family, work))


@dataclass
class ConntrackCleanup(SyncedOnly):
    """The sync observer that decides the cleanup: after each sync, the UDP targets of the
    services it changed against those of the last (every service after a full sync or a
    topology change); then, with `fast_failure`, the TCP endpoints that left the services it
    changed; after a repair, the frontends of every service."""

    sink: ConntrackSink
    fast_failure: bool = True
    _udp_targets: dict[Any, UdpTarget] | None = None
    # Each Service as the last sync saw it (the cache's tuples, by reference).
    _listings: dict[ServiceKey, Listing] = field(default_factory=dict)

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        state = proxier.cache.state()
        if record.cause is Cause.REPAIR:
            self._after_repair(proxier, state)
        changed = None if record.full or checkout.topology_changed else checkout.services
        self._udp(proxier, state, changed)
        if self.fast_failure:
            self._departed(proxier, state, changed)

    def _after_repair(self, proxier: NodeProxier, state: ClusterState) -> None:
        """Connections started while our rules were missing keep conntrack entries without
        DNAT, which their next packets follow (pyproxy/core/conntrack.py, end): deleted
        now, so that those packets are NATed afresh by the repaired rules."""
        for family in proxier.families:
            self.sink.submit(family, service_frontends(state, family, proxier.node_addresses))

    def _udp(self, proxier: NodeProxier, state: ClusterState,
             services: frozenset[ServiceKey] | None) -> None:
        families = proxier.families
        current = udp_targets(state, families, services)
        previous = self._udp_targets
        merged = dict(previous or {})
        if services is None:
            merged = dict(current)
        else:
            merged = {k: v for k, v in merged.items() if k[0].service not in services}
            merged.update(current)
        self._udp_targets = merged
        if previous is not None and not needs_cleanup(previous, current, services):
            return
        # A frontend that went away (a deleted Service) allows nobody; one another Service
        # still claims keeps that Service's endpoints.
        gone = withdrawn(previous or {}, current, services)
        work = {**claimants(merged, gone), **current}
        for family in families:
            targets = [t for (_name, fam), t in (*work.items(), *gone.items()) if fam is family]
            if targets:
                self.sink.submit(family, allowed_map(targets, proxier.node_addresses))

    def _departed(self, proxier: NodeProxier, state: ClusterState,
                  services: frozenset[ServiceKey] | None) -> None:
        """Fast failure: the TCP endpoints that left the services this sync changed (every
        service after a full sync) since the last, their connections' entries deleted. The
        first sync knows no previous listing: nothing has left yet."""
        keys = state.ports_by_service.keys() | self._listings.keys() if services is None \
            else services
        gone: list[Departed] = []
        listings, ports_of, slices = self._listings, state.ports_by_service, state.slices
        for key in keys:
            before = listings.get(key)
            ports, pieces = ports_of.get(key, ()), slices.get(key, ())
            if before is not None and before.ports is ports and before.slices is pieces:
                continue  # unchanged (a full sync's other services): nothing built
            after = Listing(ports, pieces)
            if after.ports:
                self._listings[key] = after
            else:
                self._listings.pop(key, None)
            if before is not None:
                gone += departed(before, after)
        for family in proxier.families:
            mine = [d for d in gone if d.family is family]
            if not mine:
                continue
            shared = shared_frontends(mine)
            claims = still_listed(_other_ports(state, mine), family, state.slices,
                                  shared) if shared else {}
            self.sink.submit(family, departures_map(mine, claims, proxier.node_addresses))


def _other_ports(state: ClusterState, departures: list[Departed]) -> list[ServicePort]:
    """Every port of the Services no departure is from: those that may share a frontend."""
    mine = {gone.port.name.service for gone in departures}
    return [port for port in state.ports if port.name.service not in mine]
