"""Endpoints keep their slots in the endpoints maps across changes (balancing.keep_slots),
so that one endpoint more or less changes one or two map elements, not every slot after
it in sorted order."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyproxy.core.balancing import keep_slots
from pyproxy.core.model import Endpoint, IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from testkit.builders import ep, make_service, make_slice
from testkit.fakes import fake_node_proxier


def eps(*numbers: int) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(f"10.244.{n // 250}.{n % 250}", 8080) for n in numbers)


def ips(endpoints: tuple[Endpoint, ...] | None) -> list[str]:
    return [e.ip for e in endpoints or ()]


def test_a_new_endpoint_takes_a_free_slot_or_is_appended() -> None:
    before = eps(1, 2, 3)
    assert ips(keep_slots(before, eps(1, 2, 3, 4))) == ips(eps(1, 2, 3, 4))
    # sorted, 0 would come first and move every other endpoint one slot on
    assert ips(keep_slots(before, eps(0, 1, 2, 3))) == ips(eps(1, 2, 3, 0))
    # 2 left, 0 came: 0 takes 2's slot
    assert ips(keep_slots(before, eps(0, 1, 3))) == ips(eps(1, 0, 3))


def test_when_the_list_shrinks_the_last_endpoints_fill_the_holes() -> None:
    before = eps(1, 2, 3, 4, 5)
    assert ips(keep_slots(before, eps(1, 3, 4, 5))) == ips(eps(1, 5, 3, 4))
    assert ips(keep_slots(before, eps(3, 5))) == ips(eps(3, 5))  # both beyond the new end
    assert keep_slots(before, ()) == ()


def test_nothing_to_keep() -> None:
    current = eps(3, 1, 2)
    assert keep_slots(None, current) is current
    assert keep_slots(eps(1, 2, 3), None) is None
    same = eps(1, 2, 3)
    assert keep_slots(eps(1, 2, 3), same) is same  # no copy when nothing moves


def test_the_current_endpoint_objects_are_used() -> None:
    """A kept endpoint's other fields (ready, terminating…) are today's, not the old ones."""
    old = (Endpoint("10.0.0.1", 80, ready=True), Endpoint("10.0.0.2", 80))
    now = (Endpoint("10.0.0.1", 80, ready=False, terminating=True), Endpoint("10.0.0.2", 80))
    assert keep_slots(old, now) == now
    assert keep_slots(old, now)[0].terminating  # type: ignore[index]


@given(st.lists(st.integers(0, 60), unique=True), st.lists(st.integers(0, 60), unique=True))
def test_slots_hold_exactly_the_current_endpoints_and_stayers_stay(
        previous: list[int], current: list[int]) -> None:
    before, now = eps(*previous), eps(*current)
    kept = keep_slots(before, now)
    assert kept is not None
    assert sorted(ips(kept)) == sorted(ips(now))
    moved = sum(1 for i, e in enumerate(kept) if i >= len(before) or before[i].ip != e.ip)
    stayers = set(previous) & set(current)
    # every endpoint in a slot that changed is a new one or one moved from the cut tail
    assert moved <= len(current) - len(stayers) + max(0, len(previous) - len(current))


def test_one_endpoint_more_changes_one_element_of_a_big_service() -> None:
    """Through the proxier and the fake kernel: a 300-endpoint service gains an endpoint
    whose address sorts first; the transaction adds one endpoint slot (and its hairpin
    element), it does not rewrite the slots after it."""
    proxier, nft, _ = fake_node_proxier()
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    addresses = [f"10.244.{n // 200 + 1}.{n % 200 + 10}" for n in range(300)]
    random.Random(7).shuffle(addresses)
    proxier.on_service(("ns", "big"), make_service("ns", "big", ip="10.96.0.50"))

    def publish(ips_now: list[str]) -> None:
        proxier.on_slice(("ns", "big-1"), make_slice(
            "ns", "big", [ep(ip, "node-b") for ip in ips_now], name="big-1"))
        proxier.sync()

    publish(addresses)
    publish(["10.244.0.1", *addresses])  # sorts before every other address
    script = nft.last
    slots = re.findall(r"10\.96\.0\.50 \. 80 \. \d+ :", script)
    assert slots == ["10.96.0.50 . 80 . 300 :"], script
    assert not re.search(r"delete element ip pyproxy endpoints-tcp", script), script
    publish([*addresses[1:], "10.244.0.1"])  # the first one goes: the last one fills its slot
    assert len(re.findall(r"10\.96\.0\.50 \. 80 \. \d+", nft.last)) <= 3, nft.last


def test_trace_follows_a_big_service_into_its_own_map(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyproxy.cluster.snapshot import build_state
    from pyproxy.render import services
    from pyproxy.render.skeleton import render_config
    from pyproxy.render.trace import trace
    from pyproxy.sync.proxier import desired_state

    monkeypatch.setattr(services, "OWN_MAP_SLOTS", 3)
    config = NodeConfig("node-a", node_ips=("192.168.50.1",))
    state = desired_state(build_state([
        make_service("ns", "big", ip="10.96.0.50"),
        make_slice("ns", "big", [ep(f"10.244.1.{i}", "node-b") for i in range(1, 5)])]),
        config, IPFamily.IPv4)
    own = sorted({c for _, c, _ in state.containers() if c.startswith("endpoints-tcp-")})
    assert len(own) == 1
    answer = trace(state, render_config(config, IPFamily.IPv4), "192.168.50.2",
                   "10.96.0.50", 80, "tcp")
    assert answer.verdict == "DNAT", answer
    assert sorted(t for t, _ in answer.candidates) == [f"10.244.1.{i}:8080" for i in range(1, 5)]
    assert any(f"@{own[0]}" in step for step in answer.steps), answer.steps


def test_an_address_under_two_port_numbers_keeps_both_slots() -> None:
    """Slices disagreeing on a port's number give one address twice: matched by address
    and port, each copy keeps its own slot."""
    before = (Endpoint("10.0.0.1", 80), Endpoint("10.0.0.1", 81), Endpoint("10.0.0.2", 80))
    now = (Endpoint("10.0.0.0", 80), Endpoint("10.0.0.1", 80), Endpoint("10.0.0.1", 81))
    assert keep_slots(before, now) == (now[1], now[2], now[0])


def test_an_address_with_another_port_number_is_a_new_endpoint() -> None:
    before = (Endpoint("10.0.0.1", 80), Endpoint("10.0.0.2", 80))
    now = (Endpoint("10.0.0.1", 81), Endpoint("10.0.0.2", 80))
    kept = keep_slots(before, now)
    assert kept == now and kept is now  # 10.0.0.1:81 takes the hole 10.0.0.1:80 left


def _big_render(count: int) -> tuple[Any, Any, Any]:
    """A ClusterIP service with `count` endpoints (over OWN_MAP_SLOTS), selected for node-a."""
    from pyproxy.cluster.snapshot import build_state
    from pyproxy.core.topology import select_all
    from pyproxy.render.skeleton import render_config

    state = build_state([
        make_service("ns", "big", ip="10.96.0.50"),
        *(make_slice("ns", "big", [ep(f"10.244.{n // 200}.{n % 200 + 1}", "node-b")
                                   for n in range(first, min(count, first + 200))],
                     name=f"big-{first}")
          for first in range(0, count, 200))])
    (ps,) = select_all(state, "node-a", None)
    return ps.port, ps.selection, render_config(NodeConfig(node_name="node-a"), IPFamily.IPv4)


def test_a_big_lists_unchanged_slots_keep_their_rendered_elements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rendering a 1,200-endpoint service again after one endpoint changed formats only that
    endpoint's element: every other one is the very element rendered before (the same
    Endpoint object in the same slot), and the whole render equals a fresh one."""
    from pyproxy.render import services

    monkeypatch.setattr(services, "_BIG_LIST_ELEMENTS", {})
    port, sel, cfg = _big_render(1200)
    first = services.render_service(port, sel, cfg).items
    assert sel.cluster is not None
    changed = (*sel.cluster[:7], Endpoint("10.250.0.1", 8080), *sel.cluster[8:])
    again = services.render_service(port, replace(sel, cluster=changed), cfg).items
    monkeypatch.setattr(services, "_BIG_LIST_ELEMENTS", {})
    fresh = services.render_service(port, replace(sel, cluster=changed), cfg).items
    assert again == fresh
    slots = {item.key: item for item in first if item.key[:2] == ("10.96.0.50", 80)}
    reused = [item for item in again if slots.get(item.key) is item]
    assert len(reused) == 1199
    assert (("10.96.0.50", 80, 7), ("10.250.0.1", 8080)) in {
        (item.key, item.value) for item in again}


def test_the_kept_big_lists_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyproxy.render import services

    monkeypatch.setattr(services, "_BIG_LIST_ELEMENTS", {})
    monkeypatch.setattr(services, "BIG_LIST_ELEMENTS_KEPT", 2000)
    port, sel, cfg = _big_render(1200)
    services.render_service(port, sel, cfg)
    other = replace(port, cluster_ips=("10.96.0.51",))
    services.render_service(other, sel, cfg)  # 2,400 elements: the first list goes
    assert [key[1] for key in services._BIG_LIST_ELEMENTS] == [("10.96.0.51", 80)]
