"""Least-connection balancing without a kernel: the costs, the feedback's step and why it
settles, the slot tables (moved, not reshuffled), the render, and the daemon's controller on
a fake read. tests/test_least_netns.py has it on real packets; bench/bench_least.py measures
the spread and the cost."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.config import ProxyConfig
from pyproxy.core.explain import explain_report
from pyproxy.core.inflight import FlowIndex, InFlight, count
from pyproxy.core.least import (
    LeastSlots,
    cost,
    fitted,
    moved_slots,
    slot_count,
    slot_targets,
    step,
)
from pyproxy.core.model import Algorithm, IPFamily, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.topology import select_all
from pyproxy.kernel.nlconntrack import FlowCounts
from pyproxy.run import build_daemon
from pyproxy.serve.live import connection_views
from pyproxy.serve.metrics import Metrics
from pyproxy.sync.inflight import InFlightReader
from pyproxy.sync.least import LeastConnections, next_slots
from pyproxy.sync.proxier import fragments
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fakes import FakeNft, fake_node_proxier

LC, WLC, SED, NQ = (Algorithm.LEAST_CONNECTIONS, Algorithm.WEIGHTED_LEAST_CONNECTIONS,
                    Algorithm.SHORTEST_EXPECTED_DELAY, Algorithm.NEVER_QUEUE)


def test_the_costs_are_ipvs_s_plus_one_connection() -> None:
    assert cost(LC, (3, 10), 5) == 256 * 3 + 10 + 256  # lc ignores the weight
    assert cost(WLC, (3, 10), 2) == (256 * 3 + 10 + 256) / 2
    assert cost(SED, (3, 10), 2) == cost(NQ, (3, 10), 2) == 2.0


def test_a_step_moves_shares_towards_the_less_loaded_half_way() -> None:
    shares = step(LC, {"a": 0.5, "b": 0.5}, {"a": (20, 0), "b": (0, 0)}, {"a": 1, "b": 1})
    assert shares["b"] > shares["a"] and sum(shares.values()) == pytest.approx(1)
    # the target is (1/cost)^3 normalised: b's almost 1; the share moves a fifth of the way
    assert shares["b"] == pytest.approx(0.5 + 0.2 * (1 / (1 + (1 / 21) ** 3) - 0.5))
    # within the deadband (10 %) nothing moves: no rewrite for noise
    assert step(LC, {"a": 0.5, "b": 0.5}, {"a": (100, 0), "b": (101, 0)},
                {"a": 1, "b": 1}) == {"a": 0.5, "b": 0.5}
    # weight 0: no share; a new endpoint starts at the mean share
    assert set(step(LC, {"a": 1.0}, {}, {"a": 1, "b": 1, "c": 0})) == {"a", "b"}


def test_nq_gives_an_idle_endpoint_the_largest_target_whatever_the_costs() -> None:
    loads = {"a": (1, 0), "b": (0, 0), "c": (3, 0)}
    weights = {"a": 1, "b": 1, "c": 8}  # c's sed cost (3+1)/8 is the lowest
    nq = step(NQ, {"a": 0.4, "b": 0.2, "c": 0.4}, loads, weights)
    sed = step(SED, {"a": 0.4, "b": 0.2, "c": 0.4}, loads, weights)
    # a fifth of the way from 0.2 and from 0.4 to the same target: the largest
    assert nq["b"] > sed["b"] and nq["b"] - 0.8 * 0.2 == pytest.approx(nq["c"] - 0.8 * 0.4)


def simulate(algorithm: Algorithm, lifetimes: dict[str, float], weights: dict[str, int],
             rounds: int = 400, arrivals: float = 10.0, moving: bool = True
             ) -> list[dict[str, float]]:
    """Held connections per endpoint over time, one step a second: `arrivals` new
    connections a second spread by the shares; each held its endpoint's lifetime exactly
    (`moving`: the count is a moving sum, as bench/bench_least.py's clients hold them) or
    ending at 1/lifetime a second (exponential lifetimes: a first-order response)."""
    active = {k: 0.0 for k in lifetimes}
    opened: dict[str, list[float]] = {k: [] for k in lifetimes}
    shares = {k: 1 / len(lifetimes) for k in lifetimes}
    history = []
    for _ in range(rounds):
        for k, life in lifetimes.items():
            if moving:
                opened[k] = [*opened[k], arrivals * shares[k]][-int(life):]
                active[k] = sum(opened[k])
            else:
                active[k] += arrivals * shares[k] - active[k] / life
        shares = step(algorithm, shares, {k: (round(v), 0) for k, v in active.items()}, weights)
        history.append(dict(active))
    return history


@pytest.mark.parametrize("moving", [True, False], ids=["held-exactly", "exponential"])
@pytest.mark.parametrize("slow,others", [(20, 2), (60, 6), (120, 2), (5, 1)])
@pytest.mark.parametrize("algorithm", [LC, WLC, SED, NQ])
def test_the_feedback_settles_and_stays_whatever_the_lifetimes(
        algorithm: Algorithm, slow: float, others: float, moving: bool) -> None:
    """One endpoint holds its connections far longer than the others (random: it holds
    slow/others times theirs). The held connections settle, within (slow/others)^(1/4)
    give or take a third, and stay there: no swing."""
    lifetimes = {"slow": slow, "a": others, "b": others}
    history = simulate(algorithm, lifetimes, {"slow": 1, "a": 1, "b": 1}, moving=moving)
    ratios = [h["slow"] / ((h["a"] + h["b"]) / 2) for h in history[-100:]]
    expected = (slow / others) ** (1 / 4)
    assert expected / 1.35 < min(ratios) and max(ratios) < expected * 1.35, (min(ratios),
                                                                          max(ratios))
    # settled: at most a ripple (a 60-times longer lifetime held exactly: a slow 21 % one)
    assert max(ratios) / min(ratios) < 1.25


def test_wlc_and_sed_give_the_heavier_more() -> None:
    for algorithm in (WLC, SED):
        last = simulate(algorithm, {"a": 5.0, "b": 5.0}, {"a": 1, "b": 3}, moving=False)[-1]
        assert 1.9 < last["b"] / last["a"] < 3.1, (algorithm, last)  # 3^(3/4) = 2.3


def test_slot_targets_round_and_keep_one_slot_each() -> None:
    assert slot_targets({"a": 0.5, "b": 0.5}, 64) == {"a": 32, "b": 32}
    assert slot_targets({"a": 0.999, "b": 0.001}, 64) == {"a": 63, "b": 1}
    assert sum(slot_targets({k: 1 / 7 for k in "abcdefg"}, 112).values()) == 112
    assert (slot_count(1), slot_count(5), slot_count(100)) == (64, 80, 256)


def test_slots_move_rather_than_reshuffle() -> None:
    before = moved_slots((), {"a": 32, "b": 32})
    assert before == ("a",) * 32 + ("b",) * 32
    after = moved_slots(before, {"a": 24, "b": 40})
    # a gives up its last 8 slots to b; every other slot keeps its endpoint
    assert sum(x != y for x, y in zip(before, after, strict=True)) == 8
    assert after.count("a") == 24 and after[:24] == ("a",) * 24
    # an endpoint gone: its slots go to the others, theirs stay
    gone = moved_slots(after, {"b": 40, "c": 24})
    assert [i for i, (x, y) in enumerate(zip(after, gone, strict=True)) if x != y] == list(
        range(24))


def test_fitted_follows_the_endpoints_in_force() -> None:
    least = LeastSlots(moved_slots((), {"a": 48, "b": 16}), (("a", 0.75), ("b", 0.25)))
    assert fitted(least, ["a", "b"], [1, 1], LC) == least.table
    # b leaves, c arrives at the mean share of those known (a's): half each, a keeps its
    # first slots
    table = fitted(least, ["a", "c"], [1, 1], LC)
    assert table.count("a") == table.count("c") == 32 and table[:32] == ("a",) * 32
    assert fitted(None, ["a", "b"], [1, 3], WLC).count("b") == 48  # by weight to start
    assert fitted(None, ["a", "b"], [1, 3], LC).count("b") == 32  # lc: weights unused
    assert fitted(least, ["a"], [0], LC) == ()


def objects(algorithm: str, **spec: Any) -> list[dict[str, Any]]:
    def tweak(svc: dict[str, Any]) -> None:
        svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": algorithm}
        svc["spec"].update(spec)

    return [make_node("node-a", "zone-1"), make_service("ns", "web", tweak),
            make_slice("ns", "web", [ep("10.244.1.2", "node-a"), ep("10.244.1.3", "node-a")])]


def endpoint_elements(state: Any) -> list[str]:
    config = NodeConfig("node-a", node_ips=("192.168.0.10",))
    return [str(item) for owner, fragment in fragments(state, config, state.ports[0].families()[0])
            .items() if owner != "skeleton" for item in fragment.items
            if "endpoints" in str(item) and "10.244.1." in str(item)]


def test_a_least_connection_service_renders_its_slots_and_explains_itself() -> None:
    state = build_state(objects("wlc"))
    assert state.ports[0].balancing is WLC
    assert len(endpoint_elements(state)) == slot_count(2)  # 64 slots, random picks over them
    reasons = explain_report(state, "node-a")["services"][0]["reasons"]
    assert any("weighted least connections (wlc), by feedback" in r
               and "no feedback yet" in r for r in reasons), reasons


def test_the_controller_moves_the_slots_of_least_connection_ports_only() -> None:
    state = build_state([*objects("lc"), make_service("ns", "other", ip="10.96.0.11"),
                         make_slice("ns", "other", [ep("10.244.2.2", "node-a")])])
    ports = list(select_all(state, "node-a"))
    least = LeastConnections()
    lc_ports = [ps for ps in ports if ps.port.balancing is LC]
    index = FlowIndex.of((ps, state.endpoints(ps.port.name, ps.family)) for ps in ports)
    busy = count({("10.96.0.10", 80, "10.244.1.2", 8080): [30, 0]}, index)
    assert least.update(lc_ports, busy) == {lc_ports[0].port.name.service}
    adjusted = least.adjust(lc_ports[0])
    assert adjusted.selection.least is not None
    table = adjusted.selection.least.table
    assert table.count("10.244.1.3:8080") > table.count("10.244.1.2:8080")
    other = next(ps for ps in ports if ps.port.balancing is Algorithm.RANDOM)
    assert least.adjust(other) is other
    # the same loads within the deadband of each other: nothing to render again
    even = count({("10.96.0.10", 80, "10.244.1.2", 8080): [10, 0],
                  ("10.96.0.10", 80, "10.244.1.3", 8080): [10, 0]}, index)
    for _ in range(20):
        least.update(lc_ports, even)
    assert least.update(lc_ports, even) == set()
    assert least.update([], InFlight()) == set()


def test_in_the_daemon_a_step_renders_the_service_again_with_its_moved_slots() -> None:
    """The daemon's path: the first sync with an lc port starts the feedback's thread; a tick
    reads, steps and asks the proxier to render the Service again, whose next (partial) sync
    writes the moved slots."""
    stop = threading.Event()
    least = LeastConnections(interval=3600.0, stop=stop)
    nft = FakeNft()
    proxier, nft, requests = fake_node_proxier(nft, observers=[least])
    proxier.proxiers[0].adjust = least.adjust
    loads = {"10.244.1.2": 40, "10.244.1.3": 0}
    least.reader = InFlightReader(
        [IPFamily.IPv4],
        lambda family: FlowCounts({("10.96.0.10", 80, ip, 8080): [n, 0]
                                   for ip, n in loads.items()}, sum(loads.values())),
        least.ports_with_endpoints, duty=1e9)
    try:
        load(proxier, objects("lc")[1:])
        assert least._thread is not None and least._thread.is_alive()
        before = len(requests)
        assert least.tick() == {ServiceKey("ns", "web")}
        assert len(requests) == before + 1  # the proxier asked for a sync
        scripts = len(nft.scripts)
        assert proxier.sync()
        assert not proxier.history[-1].full
        written = "".join(nft.scripts[scripts:])
        assert "10.244.1.3" in written and "flush" not in written  # elements moved, no rules
        table = next(iter(proxier.proxiers[0].selections.values())).selection.least
        assert table is not None and table.table.count("10.244.1.3:8080") > 32
    finally:
        stop.set()


def load(proxier: Any, objs: list[dict[str, Any]]) -> None:
    """The objects through the proxier's watch handlers, then its first sync."""
    for obj in objs:
        (proxier.on_service if obj["kind"] == "Service" else proxier.on_slice)(
            (obj["metadata"]["namespace"], obj["metadata"]["name"]), obj)
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.sync()


def test_one_conntrack_read_serves_the_feedback_and_the_in_flight_view() -> None:
    """The feedback reads through the in-flight view's reader: a tick's dump is what a scrape
    within inFlightInterval shows, and both share one duty cycle."""
    stop = threading.Event()
    least = LeastConnections(interval=3600.0, stop=stop)
    proxier, _nft, _requests = fake_node_proxier(FakeNft(), observers=[least])
    proxier.proxiers[0].adjust = least.adjust
    views = connection_views(proxier, Metrics(), 10.0, least)
    reader = views.in_flight
    assert reader is not None and least.reader is reader
    reads: list[IPFamily] = []

    def read(family: IPFamily) -> FlowCounts:
        reads.append(family)
        return FlowCounts({("10.96.0.10", 80, "10.244.1.2", 8080): [40, 0]}, 40)

    reader.families, reader.read, reader.clock = [IPFamily.IPv4], read, lambda: 0.0
    try:
        load(proxier, objects("lc")[1:])
        assert least.tick() == {ServiceKey("ns", "web")}
        shown = views.in_flight_now()
        assert reads == [IPFamily.IPv4]  # one dump for both
        assert shown is not None and [p.established for p in shown.ports.values()] == [40]
    finally:
        stop.set()


def test_the_daemon_shares_the_read_unless_the_in_flight_view_is_off() -> None:
    def least_of(config: ProxyConfig) -> tuple[LeastConnections, InFlightReader | None]:
        daemon = build_daemon(config, interface_ips=("10.0.0.1",),
                              kernel=lambda family: FakeNft())
        found = next(o for o in daemon.proxier.observers if isinstance(o, LeastConnections))
        return found, daemon.connections.in_flight

    config = ProxyConfig(snapshot="unused.yaml", hostname_override="node-a")
    least, view = least_of(config)
    assert view is not None and least.reader is view
    # inFlightInterval 0: no view; the feedback makes a reader of its own at its first sync
    least, view = least_of(replace(config, in_flight_interval=0.0))
    assert view is None and least.reader is None


def test_a_table_within_one_slot_of_its_targets_is_not_rewritten() -> None:
    state = build_state(objects("lc"))
    ps = next(iter(select_all(state, "node-a")))
    index = FlowIndex.of([(ps, state.endpoints(ps.port.name, ps.family))])
    a, b = "10.244.1.2:8080", "10.244.1.3:8080"
    # shares a hair from the table's 32/32: two slots off at most, the table stays
    last = LeastSlots(moved_slots((), {a: 32, b: 32}), ((a, 0.49), (b, 0.51)))
    even = count({("10.96.0.10", 80, "10.244.1.2", 8080): [10, 0],
                  ("10.96.0.10", 80, "10.244.1.3", 8080): [10, 0]}, index)
    assert next_slots(ps, last, even).table == last.table
    busy = count({("10.96.0.10", 80, "10.244.1.2", 8080): [40, 0]}, index)
    assert next_slots(ps, last, busy).table != last.table
