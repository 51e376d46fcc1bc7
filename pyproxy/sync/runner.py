"""The bounded-frequency runner in front of every kernel write (upstream
`pkg/proxy/runner.BoundedFrequencyRunner`, the 1.34+ version without token-bucket bursts).

Three guarantees, all measured on an injectable clock:

* **min_interval** (minSyncPeriod): a run starts only once `min_interval` has passed since the
  previous run *completed*; any number of `run()` calls made meanwhile become one run at the end
  of that cooldown. This is the batching window that turns an event storm into one sync.
* **max_interval**: a run happens at least once per `max_interval` after the previous one
  completed, even with no request (the nftables proxier passes one hour).
* **retry_interval** (syncPeriod): after a failed run another one happens `retry_interval` after
  it completed, unless something triggers one sooner; a successful run cancels the retry. The
  retry still waits for the cooldown.

A run whose function returns False did nothing (the daemon's sync before every initial list is
in): it starts no cooldown, so the first real run, requested when the last list completes,
starts at once instead of minSyncPeriod after an empty one (upstream calls its first sync
directly for the same reason).

The decisions live in `Schedule`, a frozen value with no threads and no clock, so they can be
tested by stepping it. `BoundedFrequencyRunner` is the thin threaded shell around it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

class Clock(Protocol):
    """Seconds on a monotonic scale, and waiting measured on it: a fake clock (tests) jumps
    to the end of a wait instead of sleeping."""

    def __call__(self) -> float: ...

    def wait(self, cond: threading.Condition, timeout: float | None) -> object:
        """Block on a held condition for at most `timeout` seconds (None: until notified)."""
        ...


class MonotonicClock:
    """The real `Clock`: `time.monotonic`, and `Condition.wait`, which releases the lock
    while it blocks."""

    def __call__(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, timeout: float | None) -> object:
        return cond.wait(timeout)


MONOTONIC = MonotonicClock()


@dataclass(frozen=True, slots=True, kw_only=True)
class Intervals:
    """The three knobs, in seconds. Checked once here, as upstream's constructor does."""

    min_interval: float
    """Cooldown from the end of one run to the start of the next (kube-proxy minSyncPeriod)."""
    retry_interval: float
    """Delay from the end of a failed run to its retry (kube-proxy syncPeriod)."""
    max_interval: float
    """Longest gap from the end of one run to the start of the next; `math.inf` for none."""

    def __post_init__(self) -> None:
        if min(self.min_interval, self.retry_interval) < 0:
            raise ValueError(f"intervals must not be negative: {self}")
        if self.max_interval < self.min_interval:
            raise ValueError(
                f"max_interval ({self.max_interval}) must be >= min_interval ({self.min_interval})"
            )


@dataclass(frozen=True, slots=True)
class RunnerStats:
    """A snapshot of the counters the daemon exports; times are on the runner's clock."""

    runs: int = 0
    """Runs started (completed ones plus the one in progress, if any)."""
    failures: int = 0
    """Runs whose function raised."""
    last_started: float | None = None
    last_finished: float | None = None
    last_ok: bool | None = None
    """Whether the last completed run succeeded; None before the first one completes."""
    retry_pending: bool = False
    running: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """When the next run may and must start. Pure: every method returns a new Schedule.

    The caller reports what happens (`request`, `started`, `finished`) and asks `next_run_at`;
    a run is due once the clock reaches that time.
    """

    intervals: Intervals
    requested: bool = False
    """A `run()` arrived that no started run has served yet."""
    running: bool = False
    cooldown_until: float = -math.inf
    """No run starts before this (end of the last run plus min_interval)."""
    periodic_at: float = math.inf
    """The max_interval deadline; set from the clock by `loop_started`."""
    retry_at: float | None = None
    """When a failed run is retried; None when the last run succeeded."""
    stats: RunnerStats = RunnerStats()

    def request(self) -> Schedule:
        """Ask for a run; requests coalesce until a run starts."""
        return dataclasses.replace(self, requested=True)

    def loop_started(self, now: float) -> Schedule:
        """Start the max_interval clock (upstream arms its timer when Loop starts)."""
        return dataclasses.replace(self, periodic_at=now + self.intervals.max_interval)

    def next_run_at(self) -> float:
        """When the next run starts: the earliest trigger, but not before the cooldown ends.

        `math.inf` while a run is in progress (runs never overlap) or when no trigger is set.
        """
        if self.running:
            return math.inf
        trigger = min(
            -math.inf if self.requested else math.inf,
            math.inf if self.retry_at is None else self.retry_at,
            self.periodic_at,
        )
        return max(trigger, self.cooldown_until)

    def due(self, now: float) -> bool:
        return self.next_run_at() <= now

    def started(self, now: float) -> Schedule:
        """A run started; it serves every request made so far."""
        if self.running:
            raise RuntimeError("a run started while another was in progress")
        stats = dataclasses.replace(
            self.stats, runs=self.stats.runs + 1, last_started=now, running=True
        )
        return dataclasses.replace(self, requested=False, running=True, stats=stats)

    def finished(self, now: float, *, ok: bool, worked: bool = True) -> Schedule:
        """A run completed. Cooldown, max_interval and retry are all counted from `now`, so a
        slow run never shortens the gap to the next one. A run that did nothing (`worked`
        False: it declined) leaves the cooldown where it was: nothing was written to
        space out."""
        retry_at = None if ok else now + self.intervals.retry_interval
        stats = dataclasses.replace(
            self.stats,
            failures=self.stats.failures + (0 if ok else 1),
            last_finished=now,
            last_ok=ok,
            retry_pending=retry_at is not None,
            running=False,
        )
        return dataclasses.replace(
            self,
            running=False,
            cooldown_until=now + self.intervals.min_interval if worked else self.cooldown_until,
            periodic_at=now + self.intervals.max_interval,
            retry_at=retry_at,
            stats=stats,
        )


class BoundedFrequencyRunner:
    """Runs the function given to `loop()` (one sync; raising means it failed, returning False
    that it declined and did nothing) at a bounded frequency.

    `run()` is safe from any thread and never waits for a sync. Requests made before `loop()`
    starts are kept and served as soon as it does (upstream drops them; keeping them is safer
    and costs nothing). The function is `loop()`'s, not the constructor's (upstream's), so
    that the runner can be built before the proxier that asks it for syncs: neither needs
    the other to exist first.
    """

    def __init__(
        self,
        name: str,
        min_interval: float,
        retry_interval: float,
        max_interval: float,
        *,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.name = name
        self._clock = clock
        intervals = Intervals(
            min_interval=min_interval, retry_interval=retry_interval, max_interval=max_interval
        )
        self._schedule = Schedule(intervals=intervals)
        self._looping = False
        # Re-entrant so that a clock's `wait` may call run() while the loop holds the lock (the
        # tests' fake clock delivers scripted requests from inside its wait).
        self._cond = threading.Condition(threading.RLock())

    def run(self) -> None:
        """Request a run as soon as the cooldown allows; coalesces with pending requests."""
        with self._cond:
            self._schedule = self._schedule.request()
            self._cond.notify_all()

    def stats(self) -> RunnerStats:
        with self._cond:
            return self._schedule.stats

    def schedule(self) -> Schedule:
        """The current scheduling state (for debugging output and tests)."""
        with self._cond:
            return self._schedule

    def loop(self, fn: Callable[[], bool | None], stop: threading.Event) -> None:
        """Run `fn` whenever it is due, in the calling thread, until `stop` is set.

        An exception from `fn` is logged and schedules a retry; it never ends the loop.
        Anything that is not an `Exception` (KeyboardInterrupt, SystemExit) does end it.
        """
        with self._cond:
            if self._looping:
                raise RuntimeError(f"runner {self.name}: loop() is already running")
            self._looping = True
            self._schedule = self._schedule.loop_started(self._clock())
        self._watch_stop(stop)
        log.debug("runner_started", runner=self.name)
        try:
            while self._wait_until_due(stop):
                self._run_once(fn)
        finally:
            with self._cond:
                self._looping = False
        log.debug("runner_stopped", runner=self.name)

    def _watch_stop(self, stop: threading.Event) -> None:
        # An Event cannot notify our condition, and polling it would mean waking up on a timer.
        # A helper thread turns stop.set() into a notify instead; it ends when stop is set.
        def wake_on_stop() -> None:
            stop.wait()
            with self._cond:
                self._cond.notify_all()

        threading.Thread(target=wake_on_stop, name=f"{self.name}-stop", daemon=True).start()

    def _wait_until_due(self, stop: threading.Event) -> bool:
        """Block until a run is due (and mark it started) or `stop` is set (return False)."""
        with self._cond:
            while not stop.is_set():
                now = self._clock()
                run_at = self._schedule.next_run_at()
                if run_at <= now:
                    self._schedule = self._schedule.started(now)
                    return True
                # Condition.wait rejects an infinite timeout; None means "until notified".
                self._clock.wait(self._cond, None if math.isinf(run_at) else run_at - now)
            return False

    def _run_once(self, fn: Callable[[], bool | None]) -> None:
        # fn runs without the lock, so run() from event handlers never waits for a sync.
        ok, worked = False, True
        try:
            worked = fn() is not False
            ok = True
        except Exception:
            log.error(
                "sync_failed",
                runner=self.name,
                retry_in_s=self._schedule.intervals.retry_interval,
                exc_info=True,
            )
        finally:
            with self._cond:
                self._schedule = self._schedule.finished(self._clock(), ok=ok, worked=worked)
