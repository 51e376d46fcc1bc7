"""The reflector's retry pauses: client-go's backoff (tools/cache/reflector.go, v0.37.2:
wait.Backoff{Duration: 800 ms, Cap: 30 s, Factor: 2, Jitter: 1.0}.DelayWithReset(2 min)),
as a pure policy on an injected clock and random source."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pyproxy.cluster.watchstate import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps(backoff: Backoff, n: int) -> list[float]:
    return [round(backoff.next(), 6) for _ in range(n)]


def test_the_steps_double_from_0_8_s_to_the_30_s_cap() -> None:
    low = Backoff(clock=Clock(), rand=lambda: 0.0)
    assert steps(low, 8) == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]


def test_jitter_1_0_draws_each_wait_in_d_to_2d() -> None:
    """client-go's wait.Jitter(d, 1.0) = d + rand·d: a wait anywhere in [d, 2d], so nodes
    refused together spread over a window as wide as the step itself (the old ±20 % kept
    them within 0.4·d)."""
    high = Backoff(clock=Clock(), rand=lambda: 1.0)
    assert steps(high, 7) == [1.6, 3.2, 6.4, 12.8, 25.6, 51.2, 60.0]
    rng = random.Random(29)
    drawn = Backoff(clock=Clock(), rand=rng.random)
    waits = [drawn.next() for _ in range(200)]
    assert 0.8 <= waits[0] <= 1.6
    capped = waits[10:]
    assert all(30.0 <= w <= 60.0 for w in capped)
    assert max(capped) - min(capped) > 20  # spread over the whole window


def test_a_success_does_not_start_the_steps_again_only_two_minutes_do() -> None:
    """wait.backoffManager starts again from 0.8 s when more than 2 minutes have passed
    since it last did (or since it was made), not when a try succeeds: after a restart the
    relist that follows a 410 waits the next step of the tries the API server refused."""
    clock = Clock()
    backoff = Backoff(clock=clock, rand=lambda: 0.0)
    assert steps(backoff, 3) == [0.8, 1.6, 3.2]
    clock.now += 60  # a watch served for a minute: no reset
    assert steps(backoff, 1) == [6.4]
    clock.now += 61  # 121 s after the manager was made: the steps start again
    assert steps(backoff, 2) == [0.8, 1.6]
    clock.now += 119
    assert steps(backoff, 1) == [3.2]
    clock.now += 2  # 121 s after the last start again
    assert steps(backoff, 1) == [0.8]


def test_the_reset_interval_counts_from_the_backoffs_creation() -> None:
    """client-go's backoffManager sets lastStart when it is made: a first failure more than
    2 minutes later starts at 0.8 s and counts its 2 minutes from then."""
    clock = Clock()
    backoff = Backoff(clock=clock, rand=lambda: 0.0)
    clock.now += 30
    assert steps(backoff, 2) == [0.8, 1.6]
    clock.now += 91  # 121 s after creation, 91 s after the first failure
    assert steps(backoff, 1) == [0.8]


@pytest.mark.parametrize("downtime", [5.0, 6.0, 8.0])
def test_a_fleet_refused_together_comes_back_spread(downtime: float) -> None:
    """Nodes whose API server went away at once (t = 0) and answers again at `downtime`:
    each retries its watch after its draws until one lands after `downtime` (a 410), then
    lists after one more step. The busiest second holds under 40 % of the nodes' requests
    and they spread over more than 8 s; the policy before (0.5 s doubling, ±20 %, reset
    on every connection, a fixed 0.8-1.6 s before the relist) put ~75 % of them in one
    second, within ~3 s (docs/fleet.md: 400 requests of 50 nodes in 6 s, peak 147/s)."""
    rng = random.Random(7)
    nodes, times = 1000, []
    for _ in range(nodes):
        backoff = Backoff(clock=Clock(), rand=rng.random)
        t = 0.0
        while t < downtime:
            t += backoff.next()
        times += [t, t + backoff.next()]  # the watch (410), then the relist
    times.sort()
    busiest = max(Counter(int(t) for t in times).values())
    assert busiest / nodes < 0.4
    assert times[-len(times) // 20] - times[len(times) // 20] > 8.0
