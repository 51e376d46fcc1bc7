"""Outlier ejection in the daemon: the conntrack events' outcomes (kernel/ctevents.py) into
the tracker (core/outliers.py), the tracker's verdict into each selection before it is
rendered, and the services whose verdict changed rendered again at once.

Which service ports take part: TCP ones whose Service says so
(`service.pyproxy.io/outlier-ejection: "true"`), or every TCP one when the setting
`outlierEjection` is on, but for those whose Service says `"false"`. Their endpoints (every
endpoint a rule on this node may send to) are the watched ones, updated after each sync.

Locks: the tracker is read during a sync (under the proxier's lock, then ours) and fed by
the event thread (ours only); what the proxier must do about a change (`rerender`, an
Event, the log) is done after ours is released, so the two are never taken the other way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog

from pyproxy.cluster.cache import Checkout
from pyproxy.cluster.events import ejection_event, record
from pyproxy.core.attempts import ConnectAttempts
from pyproxy.core.model import IPFamily, Protocol, ServiceKey, ServicePort, ServicePortName
from pyproxy.core.outliers import Ejection, Failure, OutlierPolicy, OutlierTracker
from pyproxy.core.plan import Scope
from pyproxy.core.topology import PortSelection
from pyproxy.kernel.ctevents import ConntrackEvents
from pyproxy.sync.node import SyncedOnly, SyncRecord

if TYPE_CHECKING:
    from pyproxy.sync.node import NodeProxier

log = structlog.get_logger(__name__)

PortId = tuple[ServicePortName, IPFamily]
TICK_SECONDS = 0.1  # how often ejections that ended are noticed


@dataclass(frozen=True)
class Ejected:
    """One ejection decided (for the log, the Event and the metrics)."""

    endpoint: str
    ejection: Ejection
    services: tuple[ServiceKey, ...]


@dataclass
class OutlierEjection(SyncedOnly):
    """The daemon's outlier ejection: `adjust` for the family proxiers, `synced` as a sync
    observer, `failure`/`success` for the attempts, `tick` for the event thread."""

    policy: OutlierPolicy
    enabled: bool  # the setting outlierEjection: on for every TCP Service not opting out
    # Renders services again at the next sync: the node proxier's (`synced` learns it).
    rerender: Callable[[Iterable[ServiceKey]], None] = lambda services: None
    on_ejected: Callable[[Ejected], None] = lambda ejected: None
    on_failure: Callable[[Failure], None] = lambda how: None
    clock: Callable[[], float] = time.time
    # Set: the reader stops. It starts at the first sync that finds a port taking part.
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    tracker: OutlierTracker = field(init=False)
    reader: ConntrackEvents | None = None
    # The ports taking part per Service (a partial sync replaces the changed services').
    _port_ids: dict[ServiceKey, set[PortId]] = field(default_factory=dict)
    _changed: set[str] = field(default_factory=set)
    _ejected: list[str] = field(default_factory=list)
    _next_tick: float = 0.0

    def __post_init__(self) -> None:
        self.tracker = OutlierTracker(self.policy)

    @classmethod
    def of(cls, config: Any, api_client: Any, node_name: str, stop: threading.Event,
           metrics: Any) -> OutlierEjection:
        """The daemon's: `config` a ProxyConfig, `metrics` a serve.metrics.Metrics (named
        by their attributes: neither package is below this one)."""
        failed = metrics.outlier_failed_attempts
        return cls(config.outlier_ejection_policy, config.outlier_ejection, stop=stop,
                   on_ejected=ejection_recorder(api_client, node_name, stop,
                                                metrics.outlier_ejections.inc),
                   on_failure=lambda how: failed.labels(reason=how.name.lower()).inc())

    def on(self, port: ServicePort) -> bool:
        if port.protocol is not Protocol.TCP:
            return False
        return self.enabled if port.outlier_ejection is None else port.outlier_ejection

    # -- the sync's side -------------------------------------------------------------------

    def adjust(self, ps: PortSelection) -> PortSelection:
        """The selection with the tracker's verdict on its endpoints (ports taking part)."""
        if not self.on(ps.port):
            return ps
        keys = [ep.key for ep in ps.selection.all_reachable]
        with self.lock:
            verdict = self.tracker.port_outliers((ps.port.name, ps.family), keys, self.clock())
        return replace(ps, selection=replace(ps.selection, outliers=verdict))

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        """The watched endpoints follow the selections now in force: all of them after a
        full sync, the changed services' after a partial one."""
        self.rerender = proxier.rerender
        full = record.scope is not Scope.CHANGED
        wanted = None if full else checkout.services
        found: dict[PortId, tuple[str, ...]] = {}
        for family in proxier.proxiers:
            for name, ps in _selections_of(family.selections, wanted, proxier):
                if self.on(ps.port):
                    found[(name, ps.family)] = tuple(ep.key for ep in ps.selection.all_reachable)
        with self.lock:
            if full:
                self.tracker.set_ports(found)
                self._port_ids = {}
            else:
                gone = [p for key in checkout.services for p in self._port_ids.pop(key, ())]
                self.tracker.update_ports(gone, found)
            for port_id in found:
                self._port_ids.setdefault(port_id[0].service, set()).add(port_id)
            start = self.tracker.has_ports and self.reader is None
            if start:
                self.reader = self.events()
        if start and self.reader is not None:
            self.reader.start(self.stop)  # in the sync thread: the daemon's namespace

    # -- the event thread's side -----------------------------------------------------------

    def _services_of(self, key: str) -> set[ServiceKey]:
        return {name.service for name, _ in self.tracker.ports_of(key)}

    def watched(self, key: str) -> bool:
        return self.tracker.watched(key)  # called under the lock (ConnectAttempts.feed)

    def failure(self, key: str, how: Failure, now: float) -> None:
        changed = self.tracker.failure(key, now, how)
        self._changed |= changed
        if key in changed and self.tracker.ejected(now).get(key) is not None:
            self._ejected.append(key)
        self.on_failure(how)

    def success(self, key: str, now: float) -> None:
        self.tracker.success(key, now)

    def tick(self, now: float) -> None:
        """After each read: ejections that ended (every TICK_SECONDS), and the services of
        every endpoint whose share changed rendered again."""
        with self.lock:
            if now >= self._next_tick:
                self._next_tick = now + TICK_SECONDS
                self._changed |= self.tracker.tick(now)
            if not self._changed:
                return
            changed, self._changed = self._changed, set()
            services = {s for key in changed for s in self._services_of(key)}
            ejected = [Ejected(key, ej, tuple(sorted(self._services_of(key))))
                       for key in self._ejected
                       if (ej := self.tracker.ejected(now).get(key)) is not None]
            self._ejected = []
        for one in ejected:
            log.warning("endpoint_ejected", endpoint=one.endpoint, reason=one.ejection.reason,
                        seconds=round(one.ejection.until - one.ejection.since, 1),
                        services=[str(s) for s in one.services])
            self.on_ejected(one)
        if services:
            self.rerender(services)

    def events(self, tick_seconds: float = TICK_SECONDS) -> ConntrackEvents:
        """The conntrack event reader feeding this (started by the daemon)."""
        attempts = ConnectAttempts(self.watched, self.failure, self.success,
                                   self.policy.reply_timeout)
        return ConntrackEvents(attempts, self.tick, self.lock, self.clock,
                               tick_seconds=tick_seconds)


def ejection_recorder(api_client: Any, node_name: str, stop: threading.Event,
                      count: Callable[[], None]) -> Callable[[Ejected], None]:
    """What an ejection does beyond the selections: counted, and an Event per Service
    (`EndpointEjected`) when the daemon talks to an API server (`api_client`)."""
    def ejected(one: Ejected) -> None:
        count()
        if api_client is None:
            return
        seconds = one.ejection.until - one.ejection.since
        note = f"{one.ejection.reason}; for {seconds:g} s (ejection {one.ejection.streak} in a row)"
        for service in one.services:
            record(api_client, ejection_event(service.namespace, service.name, node_name,
                                              one.endpoint, note), stop)
    return ejected


def _selections_of(selections: dict[ServicePortName, PortSelection],
                   services: frozenset[ServiceKey] | None,
                   proxier: NodeProxier) -> Iterable[tuple[ServicePortName, PortSelection]]:
    if services is None:
        return list(selections.items())
    ports = proxier.cache.services()
    return [(port.name, ps) for key in services for port in ports.get(key, ())
            if (ps := selections.get(port.name)) is not None]
