"""What a sync covers and why, as a table: `plan_sync` decides from facts alone (no kernel,
no clock), and the applier carries a plan out (FakeNft: a kernel that keeps state)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pyproxy.core.plan import (
    Cause,
    Scope,
    SyncFacts,
    SyncPeriods,
    SyncPlan,
    plan_sync,
)
from pyproxy.kernel.libnftables import NftError
from pyproxy.render.objects import Fragment, Item, Kind, SetDecl
from pyproxy.sync.applier import Applier
from testkit.fakes import FakeNft

PERIODS = SyncPeriods(full_sync=3600.0, structure_check=30.0)
# A table in step, synced a second ago and checked a second ago, changes pending.
STEADY = SyncFacts(since_full=1.0, since_check=1.0)
IDLE = SyncFacts(since_full=1.0, since_check=1.0, idle=True)


def facts(base: SyncFacts = STEADY, **changed: Any) -> SyncFacts:
    return replace(base, **changed)


CASES = [
    # the causes of a full sync, in the order they are checked
    pytest.param(facts(synced=False), Scope.FULL, Cause.START, False,
                 id="nothing synced yet: a full sync, the start"),
    pytest.param(facts(synced=False, in_step=False, repair_wanted=True, reconfigured=True),
                 Scope.FULL, Cause.START, False,
                 id="the start stays the start whatever else holds"),
    pytest.param(facts(repair_wanted=True), Scope.FULL, Cause.REPAIR, False,
                 id="someone else changed our tables: a full sync repairs them"),
    pytest.param(facts(repair_wanted=True, in_step=False, reconfigured=True,
                       since_full=9999.0), Scope.FULL, Cause.REPAIR, False,
                 id="a repair is named a repair even when a full sync was due anyway"),
    pytest.param(facts(reconfigured=True), Scope.FULL, Cause.RECONFIGURED, False,
                 id="the node's configuration changed: a full sync"),
    pytest.param(facts(in_step=False, reconfigured=True), Scope.FULL, Cause.RECONFIGURED,
                 False, id="a new family's table not written yet is no failure: reconfigured"),
    pytest.param(facts(in_step=False), Scope.FULL, Cause.AFTER_FAILURE, False,
                 id="a table not in step (a sync failed): a full sync"),
    pytest.param(facts(in_step=False, since_full=9999.0), Scope.FULL, Cause.AFTER_FAILURE,
                 False, id="after a failure before periodic"),
    pytest.param(facts(reconfigured=True, since_full=9999.0, topology_changed=True),
                 Scope.FULL, Cause.RECONFIGURED, False,
                 id="reconfigured before periodic and topology"),
    pytest.param(facts(since_full=3600.0), Scope.FULL, Cause.PERIODIC, False,
                 id="fullSyncPeriod since the last full sync: a periodic full sync"),
    pytest.param(facts(IDLE, since_full=3600.0, since_check=9999.0, check_asked=True),
                 Scope.FULL, Cause.PERIODIC, False,
                 id="a full sync checks no structure: it rewrites it"),
    # partial syncs
    pytest.param(facts(since_full=3599.9), Scope.CHANGED, Cause.CHANGES, False,
                 id="just under fullSyncPeriod: the changes only"),
    pytest.param(facts(topology_changed=True), Scope.ALL_SERVICES, Cause.TOPOLOGY, False,
                 id="this node's labels changed: every service selected again, no full sync"),
    pytest.param(STEADY, Scope.CHANGED, Cause.CHANGES, False,
                 id="in step, nothing due: the changed services only"),
    # the structure check rides on partial syncs
    pytest.param(facts(IDLE, since_check=30.0), Scope.CHANGED, Cause.CHANGES, True,
                 id="idle and the check period passed: check the structure"),
    pytest.param(facts(IDLE, since_check=29.9), Scope.CHANGED, Cause.CHANGES, False,
                 id="idle but checked recently: no check"),
    pytest.param(facts(since_check=9999.0), Scope.CHANGED, Cause.CHANGES, False,
                 id="changes pending: the periodic check waits (changes are not held up)"),
    pytest.param(facts(check_asked=True), Scope.CHANGED, Cause.CHANGES, True,
                 id="change events were lost: checked even with changes pending"),
    pytest.param(facts(IDLE, topology_changed=True, since_check=9999.0), Scope.ALL_SERVICES,
                 Cause.TOPOLOGY, False, id="a topology change is not idle: no periodic check"),
    pytest.param(facts(topology_changed=True, check_asked=True), Scope.ALL_SERVICES,
                 Cause.TOPOLOGY, True, id="events lost and a topology change: both"),
]


@pytest.mark.parametrize(("given", "scope", "cause", "check"), CASES)
def test_plan_sync(given: SyncFacts, scope: Scope, cause: Cause, check: bool) -> None:
    assert plan_sync(given, PERIODS) == SyncPlan(scope, cause, check)


def test_default_facts_plan_the_changes_without_a_check() -> None:
    """A standalone applier's facts: nothing due, no period set."""
    assert plan_sync(SyncFacts()) == SyncPlan(Scope.CHANGED, Cause.CHANGES)


_DECLARED = Fragment((Item(Kind.SET, "cluster-ips", "", SetDecl(("ipv4_addr",))),))


def _elements(*ips: str) -> Fragment:
    return Fragment(tuple(Item(Kind.ELEMENT, "cluster-ips", (ip,), ()) for ip in ips))


class TestApplier:
    def test_its_own_plan_is_a_start_then_the_changes(self) -> None:
        """Unplanned, a new applier's sync is a full start; the next is partial."""
        applier = Applier("ip", FakeNft())
        first = applier.sync({"declared": _DECLARED, "a": _elements("10.96.0.1")})
        assert first.plan == SyncPlan(Scope.FULL, Cause.START) and applier.in_step
        second = applier.sync({"a": _elements("10.96.0.2")})
        assert second.plan == SyncPlan(Scope.CHANGED, Cause.CHANGES)

    def test_after_a_failure_its_own_plan_is_a_full_one(self) -> None:
        """A kernel refusal leaves the table out of step until a full sync succeeds."""
        nft = FakeNft()
        applier = Applier("ip", nft)
        applier.sync({"declared": _DECLARED})
        nft.fail_next = 1
        with pytest.raises(NftError):
            applier.sync({"a": _elements("10.96.0.1")})
        assert not applier.in_step
        assert applier.sync({}).plan == SyncPlan(Scope.FULL, Cause.AFTER_FAILURE)
        assert applier.in_step

    def test_a_partial_plan_for_a_table_out_of_step_is_refused(self) -> None:
        """Whoever plans reads `in_step`: a partial plan now is a planning bug."""
        applier = Applier("ip", FakeNft())
        with pytest.raises(ValueError, match="not in step"):
            applier.sync({}, SyncPlan(Scope.CHANGED, Cause.CHANGES))

    def test_a_declaration_changed_in_place_fails_the_sync(self) -> None:
        """No transaction can redeclare a set (nft: EEXIST, in a full sync too), and names
        are chosen so none is: one changed is a rendering bug, and said so."""
        applier = Applier("ip", FakeNft())
        applier.sync({"declared": _DECLARED})
        redeclared = Fragment((Item(Kind.SET, "cluster-ips", "",
                                    SetDecl(("ipv4_addr",), flags=("interval",))),))
        with pytest.raises(ValueError, match="cluster-ips: a set's declaration cannot change"):
            applier.sync({"declared": redeclared})
        assert not applier.in_step
