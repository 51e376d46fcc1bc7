"""From cluster state to per-family fragments: selection + rendering for one node."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pyproxy.core.balancing import keep_slots
from pyproxy.core.model import (
    Algorithm,
    ClusterState,
    Endpoint,
    IPFamily,
    ServiceKey,
    ServicePortName,
    ip_family,
)
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Scope, SyncPlan
from pyproxy.core.topology import PortSelection, Selection, select_all
from pyproxy.memory import gc_paused, trim_heap
from pyproxy.render.objects import Fragment, key_text
from pyproxy.render.ruleset import Change, DesiredState, full_commands
from pyproxy.render.services import render_service
from pyproxy.render.skeleton import render_config, skeleton

if TYPE_CHECKING:
    from pyproxy.kernel.nft import Kernel
    from pyproxy.sync.applier import SyncResult

SKELETON = "skeleton"

# Per service port whose slots are not in its selection's own order: the cluster and local
# lists in the order their slots were last rendered.
SlotOrders = MutableMapping[ServicePortName, tuple[tuple[Endpoint, ...] | None,
                                                   tuple[Endpoint, ...] | None]]
# What the daemon adds to a selection before it is rendered (outlier ejection's verdict).
Adjust = Callable[[PortSelection], PortSelection]


def node_families(state: ClusterState, config: NodeConfig) -> tuple[IPFamily, ...]:
    """Families to program: those of the node's addresses, or of the services when the node
    has none configured (offline rendering)."""
    if config.node_ips:
        return tuple(dict.fromkeys(ip_family(ip) for ip in config.node_ips))
    seen = {fam for port in state.ports for fam in port.families()}
    return tuple(f for f in (IPFamily.IPv4, IPFamily.IPv6) if f in seen) or (IPFamily.IPv4,)


def fragments(state: ClusterState, config: NodeConfig, family: IPFamily,
              services: Iterable[ServiceKey] | None = None) -> dict[Hashable, Fragment]:
    """The skeleton and every service port's fragment (or only those of `services`)."""
    return select_and_render(state, config, family, services)[0]


def select_and_render(
    state: ClusterState, config: NodeConfig, family: IPFamily,
    services: Iterable[ServiceKey] | None = None,
) -> tuple[dict[Hashable, Fragment], dict[ServicePortName, PortSelection]]:
    """Fragments, and the selections they were rendered from (kept for the live CLI and the
    metrics, so neither has to select again)."""
    selections: dict[ServicePortName, PortSelection] = {}
    out = dict(rendered(state, config, family, services, selections))
    return out, selections


def rendered(state: ClusterState, config: NodeConfig, family: IPFamily,
             services: Iterable[ServiceKey] | None,
             selections: dict[ServicePortName, PortSelection],
             spent: list[float] | None = None, orders: SlotOrders | None = None,
             previous: Mapping[ServicePortName, PortSelection] | None = None,
             adjust: Adjust | None = None,
             ) -> Iterator[tuple[Hashable, Fragment]]:
    """The skeleton's and each service port's fragment, one at a time, recording the
    selections they came from. A consumer that stores each fragment's items as it comes
    never holds the whole render at once (the daemon's peak and heap stay lower). `spent`
    receives the seconds spent selecting and those spent rendering (not in the consumer).
    `orders` and `previous` (the selections last rendered): the slot order each port was
    last rendered in, kept (`keep_slots`); `orders` is updated. `adjust`: applied to each
    selection first (it is what the selections record)."""
    cfg = render_config(config, family)
    clock = time.perf_counter
    selecting, rendering = 0.0, 0.0
    started = clock()
    fragment = skeleton(cfg, state.service_cidrs)
    rendering += clock() - started
    yield SKELETON, fragment
    pending = select_all(state, config.node_name, services)
    while True:
        # Only the time in here counts: between two items the consumer runs.
        started = clock()
        ps = next(pending, None)
        selected = clock()
        selecting += selected - started
        if ps is None:
            break
        if ps.family is not family:
            continue
        if adjust is not None:
            ps = adjust(ps)
        selections[ps.port.name] = ps
        selection = ps.selection if orders is None else _sticky(orders, previous or {}, ps)
        fragment = render_service(ps.port, selection, cfg)
        rendering += clock() - selected
        yield ps.port.name, fragment
    if spent is not None:
        spent += (selecting, rendering)


def _sticky(orders: SlotOrders, previous: Mapping[ServicePortName, PortSelection],
            ps: PortSelection) -> Selection:
    """The selection with its lists in the slot order last rendered (Maglev builds its own
    table from the endpoints: left as it is). Only an order that differs from the
    selection's is remembered: almost every service keeps its sorted one."""
    sel, name = ps.selection, ps.port.name
    if ps.port.balancing is Algorithm.MAGLEV:
        return sel
    before = orders.get(name)
    if before is None and (last := previous.get(name)) is not None:
        before = (last.selection.cluster, last.selection.local)
    cluster = keep_slots(before[0] if before else None, sel.cluster)
    local = keep_slots(before[1] if before else None, sel.local)
    if cluster is sel.cluster and local is sel.local:
        orders.pop(name, None)
        return sel
    orders[name] = (cluster, local)
    return replace(sel, cluster=cluster, local=local)


def desired_state(state: ClusterState, config: NodeConfig, family: IPFamily) -> DesiredState:
    """Everything one family's table should hold, as a slot store (offline tools)."""
    desired = DesiredState()
    for owner, fragment in fragments(state, config, family).items():
        desired.set(owner, fragment, Change())
    return desired


def conflicts(state: ClusterState, config: NodeConfig) -> list[dict[str, Any]]:
    """What service ports claim with different rules (one external IP and port, one NodePort)
    in the node's tables, and whose rules are used: the same answer explain, render, apply and
    trace give (offline: renders every family once more)."""
    return disputes_report(desired_states(state, config).items())


def disputes_report(tables: Iterable[tuple[IPFamily, DesiredState]],
                    service: ServiceKey | None = None) -> list[dict[str, Any]]:
    """The tables' disputed slots, one entry per family and set of claimants with every
    element they dispute (a frontend's map entries go together); with `service`, those it
    is among the claimants of."""
    found: dict[tuple[str, tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for family, desired in tables:
        for dispute in desired.disputes():
            if service is not None and not any(
                    isinstance(owner, ServicePortName) and owner.service == service
                    for owner in dispute.owners):
                continue
            _, container, key = dispute.slot
            claimants = tuple(sorted({str(owner) for owner in dispute.owners}))
            used = tuple(sorted({str(owner) for owner in dispute.used_by}))
            found.setdefault((str(family), claimants, used), []).append(
                f"{container} {{ {key_text(key) if isinstance(key, tuple) else key} }}")
    return [{"family": family, "elements": elements, "claimedBy": list(claimants),
             "used": list(used)}
            for (family, claimants, used), elements in found.items()]


def desired_states(state: ClusterState, config: NodeConfig) -> dict[IPFamily, DesiredState]:
    """Every family's desired table, rendered once for both the script and its report."""
    return {family: desired_state(state, config, family)
            for family in node_families(state, config)}


def script_of(tables: Mapping[IPFamily, DesiredState]) -> str:
    return "".join(full_commands(family.nft_family, desired).text()
                   for family, desired in tables.items())


class FamilyProxier:
    """One family's table kept in step with successive cluster states (the one-shot `apply`,
    tests, and the base the daemon's incremental sync builds on)."""

    def __init__(self, family: IPFamily, config: NodeConfig, nft: Kernel | None = None,
                 adjust: Adjust | None = None) -> None:
        # the I/O shell and its applier, imported where used
        from pyproxy.kernel.libnftables import LibNftables
        from pyproxy.sync.applier import Applier

        self.family = family
        self.config = config
        # The slot store: what this family's table must hold, rendered here, committed by
        # the applier, read by `trace`.
        self.desired = DesiredState()
        self.applier = Applier(family.nft_family, nft or LibNftables(), desired=self.desired)
        self._owners: dict[ServiceKey, set[ServicePortName]] = {}
        # The selection in force per service port (what the kernel was last asked to do).
        self.selections: dict[ServicePortName, PortSelection] = {}
        # Its lists in the order of their slots in the endpoints maps (see `keep_slots`).
        self.slot_orders: SlotOrders = {}
        self.adjust = adjust

    def sync(self, state: ClusterState, changed: Iterable[ServiceKey] | None = None,
             plan: SyncPlan | None = None) -> SyncResult:
        """Bring the table to `state` as `plan` says (None: the applier's own plan). A plan
        of the changed services renders `changed` again (None: every service)."""
        with gc_paused() as pause:
            plan = plan or self.applier.own_plan()
            result = self._sync(state, changed if plan.scope is Scope.CHANGED else None, plan)
            # The store and the selections live until the next full sync: frozen, the
            # cyclic GC does not walk them again and again (it was most of a 10k-service
            # sync), nor at its first collection after the pause (~0.1 s at 10k services).
            pause.keep = result.full
        if result.full:
            trim_heap()
        return result

    def _sync(self, state: ClusterState, changed: Iterable[ServiceKey] | None,
              plan: SyncPlan) -> SyncResult:
        """With `changed`, only those services are selected and rendered again; otherwise
        every service is."""
        if changed is None:
            services: set[ServiceKey] = set(self._owners) | set(state.ports_by_service)
        else:
            services = set(changed)
        removed: list[tuple[Hashable, Fragment]] = []
        for key in services:
            now = {p.name for p in state.ports_of(key)}
            for gone in self._owners.get(key, set()) - now:
                removed.append((gone, Fragment()))
                self.selections.pop(gone, None)
                self.slot_orders.pop(gone, None)
            if now:
                self._owners[key] = now
            else:
                self._owners.pop(key, None)
        selections: dict[ServicePortName, PortSelection] = {}
        spent: list[float] = []
        # Streamed: each fragment goes into the store as soon as it is rendered.
        updates = itertools.chain(
            rendered(state, self.config, self.family, None if changed is None else services,
                     selections, spent, self.slot_orders, self.selections, self.adjust),
            removed)
        result = self.applier.sync(updates, plan)
        self.selections.update(selections)
        select_seconds, rendering = spent
        render_seconds = select_seconds + rendering
        return replace(result, render_seconds=render_seconds, select_seconds=select_seconds,
                       diff_seconds=max(0.0, result.diff_seconds - render_seconds))
