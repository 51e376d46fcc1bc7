"""The bounded-frequency runner: the pure Schedule stepped by hand, the full loop driven by a fake
clock (exact run times, no sleeping), and one real-thread test for wake-ups.

All fake times are dyadic fractions (0.25, 2**-10, ...) so float arithmetic is exact and run
times can be compared with `==`.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field

import pytest
from structlog.testing import capture_logs

from pyproxy.sync.runner import BoundedFrequencyRunner, Intervals, RunnerStats, Schedule
from testkit.fakes import FakeClock


@dataclass(frozen=True)
class Run:
    started: float
    finished: float
    ok: bool
    worked: bool = True


@dataclass
class Harness:
    """A runner on a fake clock whose fn records each run and follows a script of outcomes."""

    min_interval: float = 1.0
    retry_interval: float = 5.0
    max_interval: float = 100.0
    duration: float = 0.0
    outcomes: tuple[bool, ...] = ()
    """Per run, in order: False makes fn raise. Runs past the end succeed."""
    declines: int = 0
    """The first N runs decline (fn returns False: nothing to do yet)."""
    clock: FakeClock = field(default_factory=FakeClock)
    runs: list[Run] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.runner = BoundedFrequencyRunner(
            "test",
            self.min_interval,
            self.retry_interval,
            self.max_interval,
            clock=self.clock,
        )

    def _sync(self) -> bool:
        started = self.clock.now
        ok = self.outcomes[len(self.runs)] if len(self.runs) < len(self.outcomes) else True
        worked = len(self.runs) >= self.declines
        self.clock.advance(self.duration)
        self.runs.append(Run(started, self.clock.now, ok, worked))
        if not ok:
            raise RuntimeError("apply failed")
        return worked

    def drive(self, requests: tuple[float, ...] = (), until: float = 20.0) -> tuple[float, ...]:
        """Run the loop from t=0 with run() called at each request time; stop at `until`.

        Returns the start times of the runs.
        """
        for when in requests:
            self.clock.at(when, self.runner.run)
        self.clock.at(until, self.stop.set)
        self.runner.loop(self._sync, self.stop)
        return tuple(r.started for r in self.runs)


def fails(n: int) -> tuple[bool, ...]:
    return (False,) * n


LOOP_CASES = [
    # -- requests and cooldown
    pytest.param({}, (0.5,), (0.5,), id="the first request runs immediately when idle"),
    pytest.param({}, (), (), id="no request and a far max_interval: no run"),
    pytest.param(
        {}, (0, 0.25, 0.5, 0.75), (0, 1.0),
        id="requests during the cooldown coalesce into one run at its end",
    ),
    pytest.param({}, (0, 2.5), (0, 2.5), id="a request after the cooldown runs immediately"),
    pytest.param(
        {"duration": 0.5}, (0, 0.25), (0, 1.5),
        id="a request during a run runs again a cooldown after that run completed",
    ),
    pytest.param(
        {"duration": 0.5}, (0, 1.25), (0, 1.5),
        id="the cooldown counts from the end of the run, not its start",
    ),
    pytest.param(
        {"min_interval": 0}, (0, 0.25, 0.25), (0, 0.25),
        id="min_interval 0: requests at the same instant still coalesce",
    ),
    # -- max_interval
    pytest.param(
        {"max_interval": 4}, (), (4, 8, 12, 16), id="no requests: a run every max_interval"
    ),
    pytest.param(
        {"max_interval": 4}, (1,), (1, 5, 9, 13, 17),
        id="max_interval counts from the last run, whatever triggered it",
    ),
    pytest.param(
        {"max_interval": 4, "duration": 0.5}, (), (4, 8.5, 13, 17.5),
        id="max_interval counts from the end of the last run",
    ),
    # -- failures and retries
    pytest.param(
        {"outcomes": fails(1), "retry_interval": 2}, (0,), (0, 2),
        id="a failure is retried after retry_interval",
    ),
    pytest.param(
        {"outcomes": fails(1), "retry_interval": 2, "duration": 0.5}, (0,), (0, 2.5),
        id="the retry counts from the end of the failed run",
    ),
    pytest.param(
        {"outcomes": fails(1), "retry_interval": 0.25}, (0,), (0, 1.0),
        id="a retry shorter than min_interval waits for the cooldown",
    ),
    pytest.param(
        {"outcomes": fails(1)}, (0, 1.5), (0, 1.5),
        id="an earlier request runs before the retry, and its success cancels the retry",
    ),
    pytest.param(
        {"outcomes": fails(1)}, (0, 0.5), (0, 1.0),
        id="a request before the retry still respects min_interval",
    ),
    pytest.param(
        {"outcomes": fails(2)}, (0, 1.5), (0, 1.5, 6.5),
        id="a failed early run reschedules the retry from its own end",
    ),
    pytest.param(
        {"outcomes": fails(99), "retry_interval": 2}, (0,), (0, 2, 4, 6, 8, 10, 12, 14, 16, 18),
        id="repeated failures keep retrying",
    ),
    pytest.param(
        {"outcomes": fails(1), "retry_interval": 10, "max_interval": 4}, (0,), (0, 4, 8, 12, 16),
        id="max_interval comes before a longer retry and its success cancels the retry",
    ),
    # -- runs that decline (the daemon before every initial list is in)
    pytest.param(
        {"declines": 1}, (0, 0.25, 0.5), (0, 0.25, 1.25),
        id="a declined run starts no cooldown: the next request runs at once",
    ),
    pytest.param(
        {"declines": 1, "max_interval": 4}, (4.5,), (4, 4.5, 8.5, 12.5, 16.5),
        id="declined periodic runs do not delay the first real one",
    ),
]


@pytest.mark.parametrize(("knobs", "requests", "expected"), LOOP_CASES)
def test_loop_run_times(
    knobs: dict[str, object], requests: tuple[float, ...], expected: tuple[float, ...]
) -> None:
    """The loop on a fake clock starts runs at exactly the expected times."""
    h = Harness(**knobs)  # type: ignore[arg-type]
    assert h.drive(requests) == expected
    assert_cooldowns_respected(h.runs, h.min_interval)


def assert_cooldowns_respected(runs: list[Run], min_interval: float) -> None:
    for before, after in itertools.pairwise(runs):
        if before.worked:
            assert after.started - before.finished >= min_interval, (before, after)


class TestBurst:
    @pytest.mark.parametrize("duration", [0, 0.125, 0.5])
    def test_a_thousand_requests_in_one_second_cause_two_runs(self, duration: float) -> None:
        """1,000 run() calls within one second: one run at once, one when the cooldown ends."""
        h = Harness(min_interval=1.0, duration=duration)
        requests = tuple(i * 2**-10 for i in range(1000))  # 0 .. 0.9756 s
        assert requests[-1] < 1
        starts = h.drive(requests, until=5)
        assert starts == (0, duration + 1.0)
        assert_cooldowns_respected(h.runs, 1.0)

    def test_a_steady_stream_runs_once_per_cooldown(self) -> None:
        """Requests every 1/16 s for 10 s: a run every min_interval, never closer."""
        h = Harness(min_interval=1.0, duration=0.25)
        requests = tuple(i / 16 for i in range(160))
        starts = h.drive(requests, until=20)
        assert starts == (0, 1.25, 2.5, 3.75, 5, 6.25, 7.5, 8.75, 10)
        assert_cooldowns_respected(h.runs, 1.0)


class TestLoop:
    def test_a_raising_fn_never_stops_the_loop_and_is_logged(self) -> None:
        """Every run raises; the loop keeps going and logs each failure with its traceback."""
        h = Harness(outcomes=fails(99), retry_interval=2)
        with capture_logs() as logs:
            starts = h.drive((0,), until=5)
        assert starts == (0, 2, 4)
        failures = [e for e in logs if e["event"] == "sync_failed"]
        assert len(failures) == 3
        assert failures[0]["runner"] == "test"
        assert failures[0]["log_level"] == "error"
        assert failures[0]["retry_in_s"] == 2
        assert failures[0]["exc_info"] is True

    def test_a_request_before_the_loop_starts_is_kept(self) -> None:
        """run() before loop() is served as soon as the loop starts (upstream would drop it)."""
        h = Harness()
        h.runner.run()
        assert h.drive(until=5) == (0,)

    def test_the_loop_stops_when_stop_is_set_inside_a_run(self) -> None:
        """stop set while fn runs: no further run starts, even one that is already due."""
        h = Harness(min_interval=0, duration=1.0)
        # The request at 0.25 makes a run due at 1.0, when the first run ends; stop comes first.
        assert h.drive((0, 0.25), until=0.5) == (0,)

    def test_a_base_exception_ends_the_loop_but_is_recorded(self) -> None:
        """KeyboardInterrupt is not a sync failure to retry: it propagates out of loop()."""
        clock = FakeClock()

        def interrupted() -> None:
            raise KeyboardInterrupt

        runner = BoundedFrequencyRunner("test", 1, 5, 100, clock=clock)
        runner.run()
        stop = threading.Event()
        with pytest.raises(KeyboardInterrupt):
            runner.loop(interrupted, stop)
        stop.set()  # ends the loop's stop-watcher thread
        stats = runner.stats()
        assert (stats.runs, stats.failures, stats.running) == (1, 1, False)

    def test_loop_twice_at_once_is_refused(self) -> None:
        """A second concurrent loop() would run fn concurrently; it raises instead."""
        clock = FakeClock()
        refusals: list[str] = []

        def nested_loop() -> None:
            with pytest.raises(RuntimeError) as refused:
                runner.loop(nested_loop, threading.Event())
            refusals.append(str(refused.value))

        runner = BoundedFrequencyRunner("test", 1, 5, 100, clock=clock)
        runner.run()
        stop = threading.Event()
        clock.at(5, stop.set)
        runner.loop(nested_loop, stop)
        assert refusals == ["runner test: loop() is already running"]
        assert runner.stats().last_ok is True

    def test_stats_track_runs_failures_and_the_pending_retry(self) -> None:
        """The counters the daemon exports, after a success then a failure."""
        h = Harness(outcomes=(True, False), duration=0.25, retry_interval=8)
        h.drive((0, 2), until=3)
        assert h.runner.stats() == RunnerStats(
            runs=2,
            failures=1,
            last_started=2,
            last_finished=2.25,
            last_ok=False,
            retry_pending=True,
            running=False,
        )
        assert h.runner.schedule().retry_at == 10.25


class TestSchedule:
    """The pure core, stepped by hand."""

    INTERVALS = Intervals(min_interval=1, retry_interval=5, max_interval=60)

    def idle(self) -> Schedule:
        return Schedule(intervals=self.INTERVALS).loop_started(100)

    def test_idle_waits_for_max_interval(self) -> None:
        """A fresh schedule is due only at loop start + max_interval."""
        s = self.idle()
        assert s.next_run_at() == 160
        assert not s.due(159)
        assert s.due(160)

    def test_a_request_is_due_immediately_when_idle(self) -> None:
        """No cooldown yet: a request makes a run due at once."""
        assert self.idle().request().next_run_at() == -math.inf
        assert self.idle().request().due(100)

    def test_nothing_is_due_while_running(self) -> None:
        """Runs never overlap, whatever is requested meanwhile."""
        s = self.idle().request().started(100).request()
        assert s.next_run_at() == math.inf
        with pytest.raises(RuntimeError):
            s.started(100)

    def test_started_serves_all_requests(self) -> None:
        """Requests coalesce: one start clears them all."""
        s = self.idle().request().request().started(100).finished(100, ok=True)
        assert not s.requested
        assert s.next_run_at() == 160

    def test_a_request_in_the_cooldown_waits_for_its_end(self) -> None:
        s = self.idle().request().started(100).finished(100.5, ok=True).request()
        assert s.next_run_at() == 101.5

    def test_failure_schedules_a_retry_and_success_cancels_it(self) -> None:
        failed = self.idle().request().started(100).finished(101, ok=False)
        assert (failed.retry_at, failed.next_run_at(), failed.stats.retry_pending) == (
            106, 106, True,
        )
        fixed = failed.request().started(102).finished(102, ok=True)
        assert (fixed.retry_at, fixed.next_run_at(), fixed.stats.retry_pending) == (
            None, 162, False,
        )

    def test_a_declined_run_leaves_the_cooldown_but_renews_max_interval(self) -> None:
        declined = self.idle().request().started(100).finished(100.5, ok=True, worked=False)
        assert declined.cooldown_until == -math.inf
        assert declined.request().next_run_at() == -math.inf  # due at once
        assert declined.next_run_at() == 160.5  # no busy loop on the periodic deadline
        worked = self.idle().request().started(100).finished(100.5, ok=True)
        assert worked.request().next_run_at() == 101.5

    def test_retry_is_clamped_to_the_cooldown(self) -> None:
        intervals = Intervals(min_interval=3, retry_interval=1, max_interval=60)
        s = Schedule(intervals=intervals).loop_started(0).request().started(0)
        assert s.finished(0, ok=False).next_run_at() == 3

    def test_infinite_max_interval_means_no_periodic_run(self) -> None:
        intervals = Intervals(min_interval=1, retry_interval=5, max_interval=math.inf)
        s = Schedule(intervals=intervals).loop_started(0)
        assert s.next_run_at() == math.inf
        assert s.request().started(0).finished(0, ok=True).next_run_at() == math.inf

    def test_stats_count_runs_and_failures(self) -> None:
        s = self.idle()
        for ok in (True, False, False, True):
            s = s.request().started(s.next_run_at()).finished(s.next_run_at() + 1, ok=ok)
        assert (s.stats.runs, s.stats.failures, s.stats.last_ok) == (4, 2, True)

    @pytest.mark.parametrize(
        ("min_interval", "retry_interval", "max_interval"),
        [
            pytest.param(2, 5, 1, id="max_interval below min_interval"),
            pytest.param(-1, 5, 60, id="negative min_interval"),
            pytest.param(1, -5, 60, id="negative retry_interval"),
        ],
    )
    def test_invalid_intervals_are_refused(
        self, min_interval: float, retry_interval: float, max_interval: float
    ) -> None:
        with pytest.raises(ValueError):
            Intervals(
                min_interval=min_interval,
                retry_interval=retry_interval,
                max_interval=max_interval,
            )


class TestRealThreads:
    """The real clock and Condition: wake-ups must come from notify, not from timeouts."""

    def test_run_from_another_thread_wakes_the_loop_and_stop_ends_it(self) -> None:
        """With max_interval an hour away, only run() and stop.set() can wake the loop."""
        synced = threading.Event()
        runner = BoundedFrequencyRunner("real", 0.0, 3600.0, 3600.0)
        stop = threading.Event()
        loop = threading.Thread(target=runner.loop, args=(synced.set, stop), daemon=True)
        loop.start()
        try:
            time.sleep(0.02)  # let the loop block on its hour-long wait
            assert not synced.is_set()
            threading.Thread(target=runner.run).start()
            assert synced.wait(2), "run() from another thread did not wake the loop"
        finally:
            began = time.monotonic()
            stop.set()
            loop.join(2)
        assert not loop.is_alive(), "the loop did not stop"
        assert time.monotonic() - began < 1
        assert runner.stats().runs == 1
