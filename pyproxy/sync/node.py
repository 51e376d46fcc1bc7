"""The sync core of `pyproxy run`: events in, one kernel transaction per family per sync out.

Event handlers (API watches or the snapshot file) only record into the cache and ask the
runner for a sync; the runner calls `NodeProxier.sync`, which checks the changes out, selects and
renders only the services that changed, and commits. Nothing is written before every source
has completed its initial list: a half-known cluster must never be programmed. The last list
to complete asks for the first sync, which runs at once (no minSyncPeriod before it: no sync
ran before).

Someone else changing our tables is reported by the nftables change events
(`table_changed`) or found by the periodic structure check; either makes the next sync a full
one, the repair, and until it has succeeded `damage()` says why the kernel does not hold what
was committed (/healthz answers 503 meanwhile).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import structlog

from pyproxy.cluster.cache import Checkout, ClusterCache
from pyproxy.core.model import IPFamily, Node, ObjectKey, ServiceKey, ServicePort, Skipped
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope, SyncFacts, SyncPeriods, SyncPlan, plan_sync
from pyproxy.core.topology import PortSelection
from pyproxy.core.wire import SliceDoc
from pyproxy.kernel.libnftables import NftError
from pyproxy.sync.applier import SyncResult
from pyproxy.sync.proxier import FamilyProxier
from pyproxy.sync.repairs import Repairs
from pyproxy.sync.settings import families_of

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SyncRecord:
    """One sync, for logs, metrics and `pyproxy history`."""

    started: float  # wall clock
    scope: Scope
    cause: Cause
    services_changed: int
    endpoints_changed: int
    render_seconds: float
    diff_seconds: float
    kernel_seconds: float
    commands: int
    error: str | None = None
    # (family, why) of each table this sync replaced whole (sync/applier.py: another layout's
    # table, or one a full sync could not patch)
    replaced: tuple[tuple[str, str], ...] = ()
    # Wall clock when the sync returned: its kernel work answered and its housekeeping done
    # (0: not known). `seconds` counts the three parts only; this ends everything.
    finished: float = 0.0

    @property
    def full(self) -> bool:
        return self.scope is Scope.FULL

    @property
    def seconds(self) -> float:
        return self.render_seconds + self.diff_seconds + self.kernel_seconds


class SyncObserver(Protocol):
    """Health, metrics, conntrack cleanup and the rest of the daemon hear about syncs through
    this, each told which proxier: an observer is built before the proxier it observes. All
    three are called under the sync lock."""

    def queued(self, proxier: NodeProxier) -> None:
        """A change was recorded that a sync has yet to program."""
        ...

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        """A sync succeeded: `checkout` is what it programmed."""
        ...

    def failed(self, proxier: NodeProxier, record: SyncRecord) -> None:
        """A sync failed (the runner retries it)."""
        ...


class SyncedOnly:
    """The base of an observer that hears successful syncs only (it overrides `synced`):
    changes queued and syncs failed are nothing to it."""

    def queued(self, proxier: NodeProxier) -> None:
        pass

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        pass

    def failed(self, proxier: NodeProxier, record: SyncRecord) -> None:
        pass


@dataclass(frozen=True)
class AfterSync(SyncedOnly):
    """`hook(proxier)` after every successful sync, under the sync lock."""

    hook: Callable[[NodeProxier], None]

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        self.hook(proxier)


@dataclass
class FirstSync(SyncedOnly):
    """`then()` once, after the first successful sync (systemd's READY=1)."""

    then: Callable[[], None]
    done: bool = False

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        if not self.done:
            self.done = True
            self.then()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _annotation_notes(ports: tuple[ServicePort, ...]) -> set[str]:
    return {note for port in ports[:1] for note in (port.topology_note, port.balancing_note)
            if note}


def _warn_ignored_annotations(before: tuple[ServicePort, ...],
                              after: tuple[ServicePort, ...]) -> None:
    """An unusable pyproxy annotation is ignored, not fatal (the service works without it).
    Warned once when it appears, not again on every relist or unrelated update."""
    for note in sorted(_annotation_notes(after) - _annotation_notes(before)):
        log.warning("service_annotation_ignored", service=str(after[0].name.service),
                    reason=note)


@dataclass
class NodeProxier:
    """The node's proxier: the cluster cache, one `FamilyProxier` per IP family, the sync
    history and the repair state. `FamilyProxier` keeps one family's table; this gathers
    what the next sync is planned from (`plan_sync`) and carries the plan out."""

    cache: ClusterCache
    proxiers: list[FamilyProxier]
    full_sync_period: float = 3600.0
    # How often the table's structure is checked against what we committed (tampering).
    verify_period: float = 30.0
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    observers: list[SyncObserver] = field(default_factory=list)
    request_sync: Callable[[], None] = lambda: None
    # Called first in every sync, under the lock: this node's own configuration (its IPs,
    # from its Node object) if it changed, else None. Every family renders with it from then
    # on (the sync is a full one), and a family the node newly has an address of gets its
    # table from `make_family`. None is dropped while running: its table stays programmed.
    reconfigure: Callable[[], NodeConfig | None] = lambda: None
    make_family: Callable[[IPFamily, NodeConfig], FamilyProxier] = FamilyProxier
    on_invalid: list[Callable[[Skipped], None]] = field(default_factory=list)
    # Told this node's Node object at every event about it, without waiting for a sync:
    # /healthz answers for the node's eligibility at once (a ToBeDeletedByClusterAutoscaler
    # taint, a deletion), as kube-proxy's node handler does. Through a sync it took up to
    # syncPeriod, when the change meant no new rules (25 s on the real cluster's LB drain).
    on_node_change: list[Callable[[Node | None], None]] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)
    history: deque[SyncRecord] = field(default_factory=lambda: deque(maxlen=100))
    skipped_total: dict[str, int] = field(default_factory=dict)
    repairs: Repairs = field(default_factory=Repairs)
    _sources: dict[str, bool] = field(default_factory=dict)
    _last_full: float | None = None  # None: no sync has succeeded yet
    _last_check: float = float("-inf")
    _check_asked: bool = False
    # Services to render again at the next sync though nothing of theirs changed in the API
    # (outlier ejection changed what their endpoints map must hold: `rerender`).
    _rerender: set[ServiceKey] = field(default_factory=set)

    # -- sources -----------------------------------------------------------------------------

    def expect(self, source: str) -> None:
        """A source whose initial list must complete before the first sync."""
        with self.lock:
            self._sources.setdefault(source, False)

    def source_synced(self, source: str) -> None:
        """An initial list is complete. Only the last one asks for a sync: one asked for
        earlier would find the cluster half-known and do nothing."""
        with self.lock:
            self._sources[source] = True
            complete = self.initialized
        log.info("initial_list_completed", source=source)
        if complete:
            self.request_sync()

    @property
    def initialized(self) -> bool:
        return bool(self._sources) and all(self._sources.values())

    def sources(self) -> dict[str, bool]:
        with self.lock:
            return dict(self._sources)

    # -- events ------------------------------------------------------------------------------

    def on_service(self, key: ObjectKey, obj: dict[str, Any] | None) -> None:
        with self.lock:
            before = self.cache.services().get(ServiceKey(*key), ())
            self._record(self.cache.set_service(key, obj))
            _warn_ignored_annotations(before, self.cache.services().get(ServiceKey(*key), ()))

    def on_slice(self, key: ObjectKey, obj: dict[str, Any] | SliceDoc | None) -> None:
        with self.lock:
            self._record(self.cache.set_slice(key, obj))

    def on_node(self, key: ObjectKey, obj: dict[str, Any] | None) -> None:
        with self.lock:
            self._record(self.cache.set_node(key[1], obj))
            node = self.cache.node
        for hook in self.on_node_change:
            hook(node)

    def on_service_cidr(self, key: ObjectKey, obj: dict[str, Any] | None) -> None:
        with self.lock:
            self._record(self.cache.set_service_cidr(key[1], obj))

    def snapshot_skipped(self, skipped: tuple[Skipped, ...],
                         fresh: tuple[Skipped, ...]) -> None:
        """A snapshot's items that never reach the cache as objects: listed in its state, and
        the invalid among those newly read counted and logged as an invalid update is (a
        Service without a name is bad input whichever way it came)."""
        with self.lock:
            self.cache.set_snapshot_skipped(skipped)
            for item in fresh:
                self._count_invalid(item)

    def _count_invalid(self, skipped: Skipped | None) -> None:
        if skipped is not None and skipped.invalid:
            self.skipped_total[skipped.kind] = self.skipped_total.get(skipped.kind, 0) + 1
            for hook in self.on_invalid:
                hook(skipped)
            log.warning("invalid_object_skipped", object=skipped.object, reason=skipped.reason)

    def _record(self, skipped: Skipped | None) -> None:
        self._count_invalid(skipped)
        if self.cache.has_pending():
            for observer in self.observers:
                observer.queued(self)
            if self.initialized:
                self.request_sync()

    # -- our tables, changed by someone else ---------------------------------------------------

    def table_changed(self, what: str) -> None:
        """Someone else changed one of our tables (an nftables change event): repair it with
        the next sync, which is asked for now. Before our first sync there is nothing of ours
        to repair (that sync rewrites everything anyway)."""
        if not self.synced:
            log.info("table_changed_before_first_sync", change=what)
            return
        log.warning("table_changed_by_someone_else_repairing", change=what)
        self.repairs.report(what)
        self.request_sync()

    def events_lost(self) -> None:
        """Change events were lost: whether someone changed our tables meanwhile is unknown,
        so the next sync compares their structure, and is asked for now."""
        self._check_asked = True
        self.request_sync()

    def rerender(self, services: Iterable[ServiceKey]) -> None:
        """Render these services again at the next sync, asked for now (something outside
        the API changed their endpoints' slots: an endpoint ejected or back)."""
        with self.lock:
            self._rerender.update(services)
            ready = self.initialized
        if ready:
            self.request_sync()

    def damage(self) -> str | None:
        """Why the kernel does not hold what was last committed (someone else changed our
        tables and the repair has not succeeded yet), or None."""
        return self.repairs.damage()

    # -- what it programs ----------------------------------------------------------------------

    @property
    def families(self) -> tuple[IPFamily, ...]:
        """The families programmed (one table each), in the order their tables were made."""
        return tuple(p.family for p in self.proxiers)

    @property
    def node_ips(self) -> tuple[str, ...]:
        """The node IPs its rules are rendered with (every family has the same configuration)."""
        return self.proxiers[0].config.node_ips if self.proxiers else ()

    @property
    def node_addresses(self) -> tuple[str, ...]:
        """The node's addresses NodePorts arrive on, as far as known (`NodeConfig.addresses`)."""
        return self.proxiers[0].config.addresses if self.proxiers else ()

    @property
    def health_check_addresses(self) -> tuple[str, ...]:
        """Where the health-check node ports listen (`NodeConfig.health_check_addresses`)."""
        return self.proxiers[0].config.health_check_addresses() if self.proxiers else (
            "0.0.0.0",)

    def current_selections(self) -> list[PortSelection]:
        """The selections in force, copied under the sync lock (for metrics and the live CLI)."""
        with self.lock:
            return [ps for family in self.proxiers for ps in family.selections.values()]

    def _reconfigure(self, new: NodeConfig) -> None:
        have = set(self.families)
        for family_proxier in self.proxiers:
            family_proxier.config = new
        for family in families_of(new.node_ips):
            if family not in have:
                self.proxiers.append(self.make_family(family, new))

    # -- syncing -----------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """A sync has succeeded (the first one is full: every sync since had a table)."""
        return self._last_full is not None

    def sync(self) -> bool:
        """One sync (the runner's function). Raises on failure so the runner retries; the
        next sync after a failure is a full one. False: nothing done, an initial list is
        still missing (the runner then starts no minSyncPeriod)."""
        with self.lock:
            if not self.initialized:
                log.debug("sync_skipped_waiting_for_initial_lists", sources=self._sources)
                return False
            now = self.clock()
            new_config = self.reconfigure()
            if new_config is not None:
                self._reconfigure(new_config)
            checkout = self.cache.checkout()
            if self._rerender:
                checkout = replace(checkout, services=checkout.services | self._rerender)
                self._rerender = set()
            reported = self.repairs.reported()
            facts = SyncFacts(
                synced=self.synced,
                in_step=all(p.applier.in_step for p in self.proxiers),
                repair_wanted=self.repairs.wanted(reported),
                reconfigured=new_config is not None,
                topology_changed=checkout.topology_changed,
                idle=not checkout.services,
                since_full=now - (self._last_full if self._last_full is not None else now),
                since_check=now - self._last_check,
                check_asked=self._check_asked)
            periods = SyncPeriods(self.full_sync_period, self.verify_period)
            plan = plan_sync(facts, periods)
            if plan.check_structure:
                self._last_check, self._check_asked = now, False
                if not all(p.applier.structure_intact() for p in self.proxiers):
                    log.warning("table_changed_by_someone_else_repairing",
                                change="found by the structure check")
                    reported = self.repairs.report("found by the structure check")
                    plan = plan_sync(replace(facts, repair_wanted=True), periods)
            self._carry_out(plan, checkout, now, reported)
            return True

    def _carry_out(self, plan: SyncPlan, checkout: Checkout, now: float,
                   reported: int) -> None:
        """Sync every family as planned; `reported`: the changes by someone else a full sync
        repairs."""
        started = self.wall_clock()
        results: list[SyncResult] = []
        changed = checkout.services if plan.scope is Scope.CHANGED else None
        try:
            state = self.cache.state()
            for proxier in self.proxiers:
                results.append(proxier.sync(state, changed, plan))
        except NftError as err:
            self.repairs.failed(_first_line(str(err)))
            record = self._record_sync(started, plan, checkout, results, str(err))
            for observer in self.observers:
                observer.failed(self, record)
            raise
        if plan.full:
            self._last_full = now
            if plan.cause is Cause.REPAIR:
                # Were the store's idea of the table's shape ever to differ from nft's
                # listing, the next check would otherwise "repair" again and again.
                for proxier in self.proxiers:
                    proxier.applier.adopt_structure()
            self.repairs.repaired(reported)
        record = self._record_sync(started, plan, checkout, results, None)
        for observer in self.observers:
            observer.synced(self, record, checkout)

    def _record_sync(self, started: float, plan: SyncPlan, checkout: Checkout,
                     results: list[SyncResult], error: str | None) -> SyncRecord:
        record = SyncRecord(
            started=started, scope=plan.scope, cause=plan.cause,
            services_changed=checkout.service_changes,
            endpoints_changed=checkout.endpoint_changes,
            render_seconds=sum(r.render_seconds for r in results),
            diff_seconds=sum(r.diff_seconds for r in results),
            kernel_seconds=sum(r.kernel_seconds for r in results),
            commands=sum(r.commands for r in results),
            error=error,
            replaced=tuple((str(proxier.family), r.replaced)
                           for proxier, r in zip(self.proxiers, results, strict=False)
                           if r.replaced),
            finished=self.wall_clock(),
        )
        self.history.append(record)
        reason = plan.cause.value
        if error:
            log.error("nft_sync_failed", full=plan.full, reason=reason, error=error)
        elif plan.full or record.commands:
            log.info("synced", full=plan.full, reason=reason,
                     services_changed=record.services_changed,
                     endpoints_changed=record.endpoints_changed, commands=record.commands,
                     duration_ms=round(record.seconds * 1000, 1),
                     render_ms=round(record.render_seconds * 1000, 1),
                     kernel_ms=round(record.kernel_seconds * 1000, 1))
        return record
