"""The cyclic collector's pause around big batches (pyproxy/memory.py)."""

from __future__ import annotations

import gc

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.memory import gc_paused
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_service, make_slice
from testkit.fakes import FakeNft


def test_the_collector_comes_back_when_the_last_pause_ends() -> None:
    """Two initial lists converting in parallel threads: the first to finish must not turn
    the collector back on under the other."""
    assert gc.isenabled()
    services, slices = gc_paused(), gc_paused()
    services.__enter__()
    slices.__enter__()
    try:
        services.__exit__(None, None, None)
        assert not gc.isenabled()
    finally:
        slices.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_what_a_kept_pause_made_is_frozen_before_the_collector_comes_back() -> None:
    """A list's models live on in the cache: the first collection after the pause must not
    walk them all (it did, ~0.1 s at 10k services)."""
    frozen = gc.get_freeze_count()
    try:
        with gc_paused(keep=True):
            made = [[i] for i in range(1000)]  # containers: tracked by the collector
        after = gc.get_freeze_count()
        assert after >= frozen + len(made)
        with gc_paused():
            also = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == after, "a pause without keep froze something"
        assert len(also) == len(made)
    finally:
        gc.unfreeze()


def test_a_full_sync_leaves_nothing_for_the_collector_to_walk() -> None:
    """Its store is frozen before the collector is back: the first collection after the
    pause walked all of it (~0.1 s at 10k services, at the end of every full sync)."""
    objects = [make_service("ns", f"svc-{i}") for i in range(300)]
    objects += [make_slice("ns", f"svc-{i}", [ep(f"10.244.{i // 200}.{i % 200 + 1}")])
                for i in range(300)]
    proxier = FamilyProxier(IPFamily.IPv4, NodeConfig("node-a", ("192.168.50.1",)), FakeNft())
    state = build_state(objects)
    collections: list[int] = []

    def heard(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    frozen = gc.get_freeze_count()
    gc.callbacks.append(heard)
    try:
        assert proxier.sync(state).full
    finally:
        gc.callbacks.remove(heard)
    assert collections == []
    assert gc.get_freeze_count() > frozen
