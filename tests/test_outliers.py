"""Outlier ejection's decisions (core/outliers.py), pure: who is ejected after how many
failures, for how long, within which limits, and what a port's slot weights become."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.config.settings import setting_value
from pyproxy.config.values import ConfigError
from pyproxy.core.explain import port_entry
from pyproxy.core.model import ANNOTATION_OUTLIER_EJECTION, IPFamily, ServicePort
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.outliers import (
    PROBATION_SHARE,
    Ejection,
    Failure,
    OutlierPolicy,
    OutlierTracker,
    PortOutliers,
    endpoint_key,
)
from pyproxy.core.topology import PortSelection, Selection, select_all
from pyproxy.render.objects import ClientOf, DnatTo, Kind, Rule
from pyproxy.render.services import render_service
from pyproxy.render.skeleton import render_config
from pyproxy.sync.outliers import OutlierEjection
from testkit.builders import annotated_port, ep, make_node, make_service, make_slice
from testkit.fakes import fake_node_proxier

POLICY = OutlierPolicy(failures=3, window=10.0, base_ejection=30.0, max_ejection=100.0)
KEYS = ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80")
A, B, C, D = KEYS


def tracker(keys: tuple[str, ...] = KEYS, policy: OutlierPolicy = POLICY) -> OutlierTracker:
    t = OutlierTracker(policy)
    t.set_ports({"web": keys})
    return t


def fail(t: OutlierTracker, key: str, times: int, at: float,
         how: Failure = Failure.NO_REPLY) -> set[str]:
    changed: set[str] = set()
    for i in range(times):
        changed |= t.failure(key, at + i * 0.1, how)
    return changed


def ejected(t: OutlierTracker, now: float, keys: tuple[str, ...] = KEYS) -> list[str]:
    return sorted(t.port_outliers("web", keys, now).ejected)


def test_ejected_after_n_failures_in_the_window_not_before() -> None:
    t = tracker()
    assert fail(t, A, 2, at=0.0) == set()
    assert ejected(t, 1.0) == []
    assert fail(t, A, 1, at=1.0) == {A}
    assert ejected(t, 1.1) == [A]
    reason = t.port_outliers("web", KEYS, 1.1).ejected[A]
    assert reason.until == 31.0 and reason.streak == 1
    assert reason.reason == "3 connection attempts in a row failed within 10 s (3 no reply)"


def test_failures_older_than_the_window_do_not_count() -> None:
    t = tracker()
    fail(t, A, 2, at=0.0)
    assert fail(t, A, 1, at=20.0) == set()
    assert ejected(t, 20.0) == []


def test_a_success_between_failures_starts_the_count_again() -> None:
    t = tracker()
    for i in range(20):  # a busy endpoint failing now and then
        fail(t, A, 2, at=i * 0.5)
        t.success(A, i * 0.5 + 0.2)
    assert ejected(t, 10.5) == []
    # Answers before a fault do not delay its detection: 3 failures in a row eject.
    for i in range(100):
        t.success(B, i * 0.01)
    assert fail(t, B, 3, at=1.5) == {B}


def test_resets_count_and_the_reason_says_which() -> None:
    t = tracker()
    fail(t, A, 2, at=0.0, how=Failure.RESET)
    fail(t, A, 1, at=1.0)
    assert t.port_outliers("web", KEYS, 1.5).ejected[A].reason == (
        "3 connection attempts in a row failed within 10 s (1 no reply, 2 reset)")


def test_back_on_probation_with_a_small_share_then_re_ejected_for_twice_as_long() -> None:
    t = tracker()
    fail(t, A, 3, at=0.0)
    assert t.tick(29.0) == set()
    assert t.tick(31.0) == {A}  # back
    out = t.port_outliers("web", KEYS, 31.0)
    assert not out.ejected and out.probation == {A}
    assert out.adjust(KEYS, [1, 1, 1, 1]) == [1, PROBATION_SHARE, PROBATION_SHARE,
                                             PROBATION_SHARE]
    assert fail(t, A, 1, at=32.0) == {A}  # one failure on probation is enough
    again = t.port_outliers("web", KEYS, 32.0).ejected[A]
    assert (again.streak, again.until) == (2, 92.0)
    assert again.reason == "no reply on probation, back from an ejection"


def test_probation_ends_after_a_window_without_failure() -> None:
    t = tracker()
    fail(t, A, 3, at=0.0)
    t.tick(31.0)
    assert t.tick(40.0) == set()
    assert t.tick(41.5) == {A}
    assert not t.port_outliers("web", KEYS, 41.5)


def test_the_ejection_time_doubles_up_to_the_maximum_and_decays_back() -> None:
    t = tracker()
    now, times = 0.0, []
    for _ in range(4):
        fail(t, A, 3, at=now)
        ej = t.port_outliers("web", KEYS, now + 1).ejected[A]
        times.append(round(ej.until - ej.since, 6))
        now = ej.until + 0.5
        t.tick(now)
    assert times == [30.0, 60.0, 100.0, 100.0]
    # Calm: each base_ejection without an ejection takes one doubling back.
    t.tick(now + 30.0 * 3 + 1)
    fail(t, A, 3, at=now + 100)
    ej = t.port_outliers("web", KEYS, now + 101).ejected[A]
    assert ej.streak == 2 and round(ej.until - ej.since, 6) == 60.0


def test_at_most_half_of_the_endpoints_are_ejected_the_oldest_first() -> None:
    t = tracker()
    fail(t, C, 3, at=0.0)
    fail(t, A, 3, at=1.0)
    assert fail(t, B, 3, at=2.0) == {B}  # wanted, held back by the limit
    out = t.port_outliers("web", KEYS, 3.0)
    assert sorted(out.ejected) == [A, C]
    assert out.note == ("1 more failing, not ejected: at most 50 % of the endpoints and "
                        "never the last (10.0.0.2:80)")


def test_never_the_last_one() -> None:
    everything = OutlierPolicy(failures=3, max_ejected_percent=100)
    alone = tracker((A,), everything)
    fail(alone, A, 3, at=0.0)
    assert ejected(alone, 1.0, (A,)) == [] and alone.ejected(1.0).keys() == {A}
    pair = tracker((A, B), everything)
    fail(pair, A, 3, at=0.0)
    assert ejected(pair, 1.0, (A, B)) == [A]


def test_no_ejection_when_every_endpoint_fails_and_those_ejected_are_forgiven() -> None:
    t = tracker()
    fail(t, A, 3, at=0.0)
    fail(t, B, 3, at=0.5)
    fail(t, C, 3, at=1.0)
    assert ejected(t, 1.5) == [A, B]
    assert fail(t, D, 3, at=2.0) == set(KEYS)  # the last one fails too: nobody's fault
    out = t.port_outliers("web", KEYS, 2.5)
    assert not out.ejected
    assert out.note == ("every endpoint failed its connection attempts: none ejected (the "
                        "fault is not theirs)")
    assert t.forgiven_total == 3 and t.ejections_total == 3  # C's was held back
    # The fault over, nobody is ejected once the window has passed, and streaks are undone.
    t.tick(20.0)
    assert not t.port_outliers("web", KEYS, 20.0)
    fail(t, A, 3, at=21.0)
    assert t.port_outliers("web", KEYS, 21.5).ejected[A].streak == 1


def test_adjust_drains_the_ejected_and_never_empties_a_list() -> None:
    out = PortOutliers(ejected={A: object()}, probation=frozenset())  # type: ignore[dict-item]
    assert out.adjust((A, B), [3, 2]) == [0, 2]
    assert out.adjust((A,), [1]) == [1]  # a Local list with only the ejected one keeps it
    assert PortOutliers().adjust((A, B), [1, 2]) == [1, 2]


def test_unwatched_and_idle_endpoints_are_forgotten() -> None:
    t = tracker()
    assert t.watched(A) and not t.watched("10.9.9.9:80")
    t.success(A, 0.0)
    fail(t, B, 1, at=0.0)
    assert t.remembered == 1  # a success alone leaves nothing to remember
    t.tick(11.0)
    assert t.ejected(11.0) == {} and t.remembered == 0


def test_endpoint_keys_spell_addresses_as_the_model_does() -> None:
    assert endpoint_key("10.1.2.3", 80) == "10.1.2.3:80"
    assert endpoint_key("fd00:0:0::1", 8080) == "[fd00::1]:8080"


# --- the annotation, the slots and explain --------------------------------------------------


def test_the_annotation_turns_it_on_or_off_and_a_bad_value_leaves_it_to_the_setting() -> None:
    assert annotated_port({}).outlier_ejection is None
    assert annotated_port({ANNOTATION_OUTLIER_EJECTION: "true"}).outlier_ejection is True
    assert annotated_port({ANNOTATION_OUTLIER_EJECTION: " False"}).outlier_ejection is False
    bad = annotated_port({ANNOTATION_OUTLIER_EJECTION: "sometimes"})
    assert bad.outlier_ejection is None
    assert bad.balancing_note == (f"{ANNOTATION_OUTLIER_EJECTION}='sometimes' is not true or "
                                  "false: the node's setting outlierEjection decides")


def selection_with(outliers: PortOutliers,
                   affinity: bool = False) -> tuple[ServicePort, Selection]:
    service = make_service("ns", "web")
    if affinity:
        service["spec"]["sessionAffinity"] = "ClientIP"
    state = build_state([service, make_node("node-a"),
                         make_slice("ns", "web", [ep(f"10.0.0.{i}", "node-b")
                                                  for i in (1, 2, 3, 4)])])
    ps = next(select_all(state, "node-a"))
    return ps.port, dataclasses.replace(ps.selection, outliers=outliers)


def endpoint_elements(port: ServicePort, sel: Selection) -> list[str]:
    cfg = render_config(NodeConfig(node_name="node-a", node_ips=("192.168.0.1",)),
                        IPFamily.IPv4)
    return [str(item) for item in render_service(port, sel, cfg).items
            if "10.0.0." in str(item) and "dnat" not in str(item)]


def test_an_ejected_endpoint_gets_no_slot_and_explain_says_until_when() -> None:
    port, plain = selection_with(PortOutliers())
    assert sum("10.0.0.1" in e for e in endpoint_elements(port, plain)) == 1
    ejection = Ejection("5 connection attempts in a row failed within 10 s (5 no reply)", 0.0,
                        1_800_000_000.0, 1)
    port, sel = selection_with(PortOutliers({"10.0.0.1:8080": ejection}))
    elements = endpoint_elements(port, sel)
    assert not any("10.0.0.1" in e for e in elements)
    assert all(any(f"10.0.0.{i}" in e for e in elements) for i in (2, 3, 4))
    report = port_entry(PortSelection(port, IPFamily.IPv4, sel))
    assert report["outliers"]["ejected"] == [{
        "endpoint": "10.0.0.1:8080", "reason": ejection.reason,
        "until": "2027-01-15T08:00:00Z", "ejection": 1}]
    assert ("outlier ejection: 10.0.0.1:8080 ejected until 2027-01-15T08:00:00Z (5 "
            "connection attempts in a row failed within 10 s (5 no reply); ejection 1 in a "
            "row), no new connections") in report["reasons"]


def test_on_probation_an_endpoint_gets_a_sixteenth_of_a_share() -> None:
    port, sel = selection_with(PortOutliers(probation=frozenset({"10.0.0.1:8080"})))
    elements = endpoint_elements(port, sel)
    assert sum("10.0.0.1" in e for e in elements) == 1
    assert sum("10.0.0.2" in e for e in elements) == PROBATION_SHARE


def test_the_policy_setting_replaces_the_fields_given() -> None:
    policy = setting_value("outlier_ejection_policy", "failures=3, ejection=1m,replyTimeout=500ms",
                           "--outlier-ejection-policy")
    assert policy == OutlierPolicy(failures=3, base_ejection=60.0, reply_timeout=0.5)
    assert setting_value("outlier_ejection_policy", "", "x") == OutlierPolicy()
    for bad, says in (("failures=0", "failures: must be within 1..1000000, got 0"),
                      ("maxEjectedPercent=101", "must be within 1..100"),
                      ("window=ten", "window: invalid duration"),
                      ("ejection=10m", "maxEjection must not be shorter than ejection"),
                      ("retries=3", "unknown field 'retries'")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            setting_value("outlier_ejection_policy", bad, "--outlier-ejection-policy")


def test_with_session_affinity_an_ejected_endpoint_keeps_no_returning_client() -> None:
    ejection = Ejection("failing", 0.0, 1_800_000_000.0, 1)
    for outliers, returning in ((PortOutliers(), {1, 2, 3, 4}),
                                (PortOutliers({"10.0.0.1:8080": ejection}), {2, 3, 4})):
        port, sel = selection_with(outliers, affinity=True)
        cfg = render_config(NodeConfig(node_name="node-a", node_ips=("192.168.0.1",)),
                            IPFamily.IPv4)
        rules = [r for item in render_service(port, sel, cfg).items
                 if item.kind is Kind.CHAIN for r in item.value if isinstance(r, Rule)]
        # A returning client's rule: the client in the endpoint's set, then its DNAT.
        back = {int(d.text().rsplit(".", 1)[1].split(":")[0])
                for r in rules if any(isinstance(s, ClientOf) for s in r.statements)
                for d in r.statements if isinstance(d, DnatTo)}
        assert back == returning, rules


def test_the_ports_taking_part_follow_partial_updates() -> None:
    t = OutlierTracker(POLICY)
    t.set_ports({"web": (A, B), "api": (B,)})
    assert t.ports_of(B) == ("web", "api") and t.has_ports
    t.update_ports(["api"], {"web": (A, C)})  # api gone, web's endpoints changed
    assert (t.ports_of(A), t.ports_of(B), t.ports_of(C)) == (("web",), (), ("web",))
    assert t.watched(C) and not t.watched(B)
    t.set_ports({})
    assert not t.has_ports and not t.watched(A)


def test_the_daemon_follows_the_ports_taking_part_and_renders_an_ejection() -> None:
    now = [1000.0]
    outliers = OutlierEjection(OutlierPolicy(failures=2), enabled=False, clock=lambda: now[0])
    outliers.reader = outliers.events()  # as if started: no socket in this test
    proxier, _, _ = fake_node_proxier(observers=[outliers])
    proxier.proxiers[0].adjust = outliers.adjust
    on = make_service("ns", "web", lambda s: s["metadata"].update(
        annotations={ANNOTATION_OUTLIER_EJECTION: "true"}))
    off = make_service("ns", "api", ip="10.96.0.11")
    proxier.on_service(("ns", "web"), on)
    proxier.on_service(("ns", "api"), off)
    ips = [f"10.0.0.{i}" for i in (1, 2, 3, 4)]
    proxier.on_slice(("ns", "web"), make_slice("ns", "web", [ep(ip, "node-b") for ip in ips]))
    proxier.on_slice(("ns", "api"), make_slice("ns", "api", [ep("10.0.1.1", "node-b")]))
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.sync()
    assert all(outliers.watched(f"{ip}:8080") for ip in ips)
    assert not outliers.watched("10.0.1.1:8080")  # api did not opt in
    # Two failures in a row eject 10.0.0.1; the tick renders ns/web again.
    for _ in range(2):
        outliers.failure("10.0.0.1:8080", Failure.NO_REPLY, now[0])
    outliers.tick(now[0])
    proxier.sync()
    [web] = [ps for ps in proxier.current_selections() if ps.port.name.name == "web"]
    assert web.selection.outliers is not None
    assert list(web.selection.outliers.ejected) == ["10.0.0.1:8080"]
    # A partial sync: 10.0.0.4 leaves the Service, no longer watched; then the Service goes.
    proxier.on_slice(("ns", "web"), make_slice("ns", "web", [ep(ip, "node-b")
                                                             for ip in ips[:3]]))
    proxier.sync()
    assert outliers.watched("10.0.0.3:8080") and not outliers.watched("10.0.0.4:8080")
    proxier.on_service(("ns", "web"), None)
    proxier.sync()
    assert not outliers.watched("10.0.0.1:8080")
