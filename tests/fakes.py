"""Fakes for the I/O shells (no mocks): a libnftables stand-in that records transactions, and
a clock that moves only when the code under test waits."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable

from pyproxy.nft import NftError


class FakeNft:
    """Records every script; `fail_next` makes the next transaction fail like the kernel
    refusing it."""

    def __init__(self) -> None:
        self.scripts: list[str] = []
        self.fail_next = 0

    def run(self, script: str) -> str:
        if self.fail_next:
            self.fail_next -= 1
            raise NftError("Error: Could not process rule: Invalid argument (injected)")
        self.scripts.append(script)
        return ""

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        return [], []

    @property
    def last(self) -> str:
        return self.scripts[-1] if self.scripts else ""


class FakeClock:
    """Time that moves only when the code under test waits or a fake sync takes time.

    Like trio's autojump MockClock: `wait(cond, timeout)` jumps straight to the deadline, or to
    the next scripted instant if that comes first, fires its events and returns as a notify
    would.
    Events run inside the runner's wait (the runner's lock is re-entrant, so they may call
    `run()`).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def at(self, when: float, action: Callable[[], None]) -> None:
        bisect.insort(self._events, (when, len(self._events), action), key=lambda e: e[:2])

    def advance(self, seconds: float) -> None:
        """Let time pass (a sync that takes a while), firing the events that fall inside."""
        target = self.now + seconds
        while self._events and self._events[0][0] <= target:
            self._fire_next()
        self.now = target

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        deadline = math.inf if timeout is None else self.now + timeout
        if self._events and self._events[0][0] <= deadline:
            # Everything scheduled for the same instant happens before the runner looks again.
            first = self._events[0][0]
            while self._events and self._events[0][0] == first:
                self._fire_next()
            return
        assert deadline < math.inf, "the runner would block forever with nothing scripted"
        self.now = deadline

    def _fire_next(self) -> None:
        when, _, action = self._events.pop(0)
        self.now = max(self.now, when)
        action()
