"""When conntrack is read for the connections in flight, and with what (the counting is
core/inflight.py's, the dump kernel/nlconntrack.py's).

A read dumps every DNATed TCP entry of each family: ~3 µs of CPU per entry (0.3 s at 100k
entries, docs/performance.md), so it is made only when someone asks — a scrape, `pyproxy
services -o wide`, a live `explain`, least-connection balancing — and never more often than
the asker's `max_age` (the setting inFlightInterval for people and scrapers, 10 s by
default: concurrent scrapers share one read) nor than `duty` allows: the next read waits
at least the last read's duration divided by `duty` (5 %: a read of 0.3 s is followed by
none for 6 s), so however many ask and however big the table, reading takes at most that
share of one CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from pyproxy.core.inflight import FlowIndex, InFlight, count
from pyproxy.core.model import Endpoint, IPFamily, Protocol
from pyproxy.core.topology import PortSelection

if TYPE_CHECKING:
    from pyproxy.kernel.nlconntrack import FlowCounts
    from pyproxy.sync.node import NodeProxier

log = structlog.get_logger(__name__)

DUTY = 0.05  # the share of one CPU reads may take at most
IN_FLIGHT_INTERVAL = 10.0  # seconds: the default of inFlightInterval


def ports_in_force(proxier: NodeProxier) -> list[tuple[PortSelection, Sequence[Endpoint]]]:
    """Each TCP selection in force and its port's endpoints of that family, ready or
    terminating (a terminating endpoint is often in no selection, and its draining is what
    an operator waits for), copied under the sync lock."""
    with proxier.lock:
        state = proxier.cache.state()
        return [(ps, state.endpoints(ps.port.name, ps.family))
                for p in proxier.proxiers for ps in p.selections.values()
                if ps.port.protocol is Protocol.TCP]


@dataclass
class InFlightReader:
    """The last read of the connections in flight, and when to read again."""

    families: Sequence[IPFamily]
    read: Callable[[IPFamily], FlowCounts]
    ports: Callable[[], list[tuple[PortSelection, Sequence[Endpoint]]]]
    clock: Callable[[], float] = time.monotonic
    duty: float = DUTY
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last: InFlight | None = None
    reads: int = 0

    def current(self, max_age: float) -> InFlight:
        """The connections in flight, read again when the last read is older than `max_age`
        (and the duty cycle allows)."""
        with self._lock:
            last, now = self._last, self.clock()
            if last is not None and now - last.read_at < max(max_age, last.seconds / self.duty):
                return last
            self._last = self._read(now)
            return self._last

    def latest(self) -> InFlight | None:
        """The last read, whatever its age (None: none yet); never reads."""
        return self._last

    def _read(self, now: float) -> InFlight:
        started = time.perf_counter()
        flows: dict[tuple[str, int, str, int], list[int]] = {}
        entries = 0
        for family in self.families:
            counts = self.read(family)
            flows.update(counts.flows)
            entries += counts.entries
        result = count(flows, FlowIndex.of(self.ports()))
        result.read_at, result.entries = now, entries
        result.seconds = time.perf_counter() - started
        self.reads += 1
        log.debug("connections_in_flight_read", entries=entries, flows=len(flows),
                  seconds=round(result.seconds, 3))
        return result


def kernel_reader(proxier: NodeProxier) -> InFlightReader:
    """The daemon's reader: the proxier's families, dumped through ctnetlink."""
    from pyproxy.kernel.nlconntrack import KernelFlows

    return InFlightReader(proxier.families, KernelFlows().read, lambda: ports_in_force(proxier))
