"""What a sync covers and why: the decision as a value, made by one pure function.

A sync rewrites the whole table from a fresh render (full), selects and renders every
service again but commits only the difference (after this node's labels changed: every
selection may change, no rule needs rewriting), or renders only the services that changed.
`plan_sync` decides which from facts the node proxier gathers before rendering anything;
the applier executes the plan, and the sync history, the log, the metrics and /healthz
read its cause. The order of the causes is the order of `plan_sync`'s checks: the first
that holds names the sync.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Scope(enum.Enum):
    """How much of the table a sync renders and commits."""

    FULL = "full"  # every service rendered, the whole table rewritten from the store
    ALL_SERVICES = "all services"  # every service selected and rendered, the difference committed
    CHANGED = "changed"  # the services that changed, the difference committed


class Cause(enum.Enum):
    """Why a sync is made. The value is how `pyproxy history`, the log and the debug
    socket's JSON (`reason`) say it."""

    START = "start"  # no sync has succeeded yet: nothing of ours is known to be in the kernel
    # Someone else changed our tables (a change event, or the structure check found it).
    REPAIR = "table changed by someone else"
    # This node's configuration (its IPs, podCIDRs) changed: every rule may read differently.
    RECONFIGURED = "node configuration changed"
    # A sync failed since: the kernel may not hold what the store says, and only a full
    # sync makes them agree again.
    AFTER_FAILURE = "after a failure"
    PERIODIC = "periodic full sync"  # fullSyncPeriod since the last full sync
    TOPOLOGY = "node labels changed"  # this node's labels: every selection may change
    CHANGES = "changes"  # services and endpoints that changed, nothing else


@dataclass(frozen=True)
class SyncPlan:
    scope: Scope
    cause: Cause
    # Compare the table's structure with ours before syncing (the periodic tampering check:
    # only on a sync that is not a full one anyway). Found changed, the sync becomes a repair.
    check_structure: bool = False

    @property
    def full(self) -> bool:
        return self.scope is Scope.FULL


@dataclass(frozen=True)
class SyncFacts:
    """What a sync is planned from, all known before anything is rendered. The defaults
    describe a table in step with nothing to check: a sync of the changes."""

    synced: bool = True  # a sync has succeeded before
    in_step: bool = True  # every table holds what its store says (see `Cause.AFTER_FAILURE`)
    repair_wanted: bool = False  # someone else changed our tables and no sync repaired it yet
    reconfigured: bool = False
    topology_changed: bool = False
    idle: bool = False  # no service or endpoint changed: the structure check's turn
    since_full: float = 0.0  # seconds since the last full sync
    since_check: float = 0.0  # seconds since the last structure check
    check_asked: bool = False  # change events were lost: check the structure now


@dataclass(frozen=True)
class SyncPeriods:
    full_sync: float = float("inf")  # pyproxy's fullSyncPeriod
    structure_check: float = float("inf")  # how often an idle sync checks the structure


def plan_sync(facts: SyncFacts, periods: SyncPeriods = SyncPeriods()) -> SyncPlan:
    """The plan of the next sync. A full sync checks nothing first: it rewrites everything."""
    for holds, cause in (
        (not facts.synced, Cause.START),
        (facts.repair_wanted, Cause.REPAIR),
        # before AFTER_FAILURE: a family the node newly has an address of has a table not
        # written yet, and no failure
        (facts.reconfigured, Cause.RECONFIGURED),
        (not facts.in_step, Cause.AFTER_FAILURE),
        (facts.since_full >= periods.full_sync, Cause.PERIODIC),
    ):
        if holds:
            return SyncPlan(Scope.FULL, cause)
    check = facts.check_asked or (
        facts.idle and not facts.topology_changed
        and facts.since_check >= periods.structure_check)
    if facts.topology_changed:
        return SyncPlan(Scope.ALL_SERVICES, Cause.TOPOLOGY, check)
    return SyncPlan(Scope.CHANGED, Cause.CHANGES, check)

