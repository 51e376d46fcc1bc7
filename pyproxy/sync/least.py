"""Least-connection balancing in the daemon: the connections in flight (sync/inflight.py)
turned into the slot tables of the service ports balanced by lc, wlc, sed or nq (the
arithmetic is core/least.py's), every leastConnectionsInterval, and the services whose table
changed rendered again (NodeProxier.rerender): their next sync writes only the endpoints
map elements whose endpoint changed.

Nothing runs while no Service asks for it: the thread starts at the first sync that finds
such a port, and a tick that finds none reads nothing. The conntrack read is the in-flight
view's (serve/live.py's connection_views gives this its reader): one dump serves a tick and a
scrape, and both together stay within the reader's duty cycle (5 % of a CPU: at 100k entries,
every 6 s at most). With the view off (inFlightInterval 0) a reader of its own is made.

Locks: a tick reads the selections under the proxier's lock, then computes under its own;
`adjust` (during a sync, under the proxier's lock) takes only its own: never both at once
the other way round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import structlog

from pyproxy.cluster.cache import Checkout
from pyproxy.core.balancing import effective_weights
from pyproxy.core.inflight import InFlight
from pyproxy.core.least import (
    LEAST,
    LeastSlots,
    fitted,
    initial_shares,
    moved_slots,
    slot_count,
    slot_targets,
    step,
)
from pyproxy.core.model import Endpoint, IPFamily, ServiceKey, ServicePortName
from pyproxy.core.topology import PortSelection
from pyproxy.sync.inflight import InFlightReader
from pyproxy.sync.node import SyncedOnly, SyncRecord

if TYPE_CHECKING:
    from pyproxy.kernel.nlconntrack import FlowCounts
    from pyproxy.sync.node import NodeProxier

log = structlog.get_logger(__name__)

PortId = tuple[ServicePortName, IPFamily]
LEAST_CONNECTIONS_INTERVAL = 2.0  # seconds: the setting's default
# A table whose every endpoint is within this many slots of its target is left as it is:
# noisy loads moved a slot or two back and forth, rewriting most of 1,000 Services every step
# (bench/bench_least.py).
SLOT_HYSTERESIS = 2


def candidates(ps: PortSelection) -> tuple[list[str], list[int]]:
    """The endpoints that may hold slots of the port (both lists), keys and weights (the
    annotations', then outlier ejection's)."""
    sel = ps.selection
    endpoints = list({ep.key: ep for ep in (*(sel.cluster or ()), *(sel.local or ()))}.values())
    weights, _ = effective_weights(ps.port, endpoints, sel.outliers)
    return [ep.key for ep in endpoints], weights


def next_slots(ps: PortSelection, last: LeastSlots | None, in_flight: InFlight) -> LeastSlots:
    """One step of the feedback for one port: its shares moved by the loads now, and the
    slot table moved as little as that allows."""
    keys, weights = candidates(ps)
    by_key = dict(zip(keys, weights, strict=True))
    algorithm = ps.port.balancing
    port = in_flight.of(ps.port.name, ps.family)
    loads = {} if port is None else {k: e.load for k, e in port.endpoints.items()}
    before = dict(last.shares) if last is not None else initial_shares(by_key, algorithm)
    table = last.table if last is not None else fitted(None, keys, weights, algorithm)
    shares = step(algorithm, before, loads, by_key)
    live = [k for k, w in by_key.items() if w > 0]
    targets = slot_targets(shares, slot_count(len(live)))
    held = {k: table.count(k) for k in live}
    if len(table) == sum(targets.values()) and set(table) <= set(live) and all(
            abs(targets[k] - held[k]) <= SLOT_HYSTERESIS for k in live):
        return LeastSlots(table, tuple(sorted(shares.items())))  # nothing worth writing
    return LeastSlots(moved_slots(table, targets), tuple(sorted(shares.items())))


@dataclass
class LeastConnections(SyncedOnly):
    """The feedback: `adjust` for the family proxiers (after `after`, outlier ejection's),
    `synced` as a sync observer (it starts the thread), `tick` once per interval."""

    interval: float = LEAST_CONNECTIONS_INTERVAL
    after: Callable[[PortSelection], PortSelection] = lambda ps: ps
    stop: threading.Event = field(default_factory=threading.Event)
    reader: InFlightReader | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    _slots: dict[PortId, LeastSlots] = field(default_factory=dict)
    _proxier: NodeProxier | None = None
    _thread: threading.Thread | None = None
    ticks: int = 0
    last_tick_seconds: float = 0.0

    def adjust(self, ps: PortSelection) -> PortSelection:
        ps = self.after(ps)
        if ps.port.balancing not in LEAST:
            return ps
        with self.lock:
            least = self._slots.get((ps.port.name, ps.family))
        return ps if least is None else replace(ps, selection=replace(ps.selection, least=least))

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        self._proxier = proxier
        if self._thread is None and any(
                ps.port.balancing in LEAST for p in proxier.proxiers
                for ps in p.selections.values()):
            if self.reader is None:
                self.reader = InFlightReader(proxier.families, _kernel_read(),
                                             lambda: self.ports_with_endpoints())
            self._thread = threading.Thread(target=self.run, name="least-connections",
                                            daemon=True)
            self._thread.start()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.tick()
            except Exception as err:  # a failed read must not end the feedback
                log.warning("least_connections_not_updated", error=str(err))

    def ports(self) -> list[PortSelection]:
        """The selections in force balanced by least connections."""
        proxier = self._proxier
        if proxier is None:
            return []
        with proxier.lock:
            return [ps for p in proxier.proxiers for ps in p.selections.values()
                    if ps.port.balancing in LEAST]

    def ports_with_endpoints(self) -> list[tuple[PortSelection, Sequence[Endpoint]]]:
        """What the reader counts: those ports, and the endpoints that may hold slots."""
        out: list[tuple[PortSelection, Sequence[Endpoint]]] = []
        for ps in self.ports():
            sel = ps.selection
            out.append((ps, list({ep.key: ep for ep in (*(sel.cluster or ()),
                                                        *(sel.local or ()))}.values())))
        return out

    def tick(self) -> set[ServiceKey]:
        """One step for every least-connection port; returns the services rendered again."""
        started = time.perf_counter()
        ports = self.ports()
        if not ports or self.reader is None:
            return set()
        in_flight = self.reader.current(self.interval)
        changed = self.update(ports, in_flight)
        if changed and self._proxier is not None:
            self._proxier.rerender(changed)
        self.ticks += 1
        self.last_tick_seconds = time.perf_counter() - started
        return changed

    def update(self, ports: Iterable[PortSelection], in_flight: InFlight) -> set[ServiceKey]:
        """The pure step for each port (kept under the lock); the services whose slot table
        changed."""
        changed: set[ServiceKey] = set()
        with self.lock:
            wanted = {}
            for ps in ports:
                port_id = (ps.port.name, ps.family)
                last = self._slots.get(port_id)
                now = next_slots(ps, last, in_flight)
                wanted[port_id] = now
                # before any feedback the port was rendered with the initial table
                rendered = last.table if last is not None else fitted(
                    None, *candidates(ps), ps.port.balancing)
                if now.table != rendered:
                    changed.add(ps.port.name.service)
            self._slots = wanted  # ports no longer balanced so are forgotten
        return changed


def _kernel_read() -> Callable[[IPFamily], FlowCounts]:
    from pyproxy.kernel.nlconntrack import KernelFlows

    return KernelFlows().read
