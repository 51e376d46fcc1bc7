"""The test kit's waits (tests, drills and the k8s tests use them): poll a condition until it
holds, bounded; and the daemon's own readiness, read from its debug socket instead of a
sleep that guesses how long a start takes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pyproxy.serve.debug import DebugError, ask


class NotReached(AssertionError):
    """A wait ran out of time."""


def until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.05,
          ignore: tuple[type[BaseException], ...] = (),
          error: type[AssertionError] = NotReached) -> float:
    """Poll check() until it is true; returns the seconds it took. A check raising one of
    `ignore` counts as not yet. Raises `error` after `timeout` seconds."""
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except ignore:
            pass
        if time.monotonic() - start > timeout:
            raise error(f"not reached within {timeout:g}s: {what}")
        time.sleep(interval)


def eventually(check: Callable[[], object], what: str = "", timeout: float = 15.0,
               interval: float = 0.1) -> float:
    """until() with the tests' usual bound: 15 s."""
    return until(check, timeout, what, interval)


def synced(socket_path: str, timeout: float = 30.0) -> dict[str, Any]:
    """The status of the daemon serving `socket_path`, once it has finished a sync without
    an error (its first, for a daemon just started)."""
    status: dict[str, Any] = {}

    def done() -> bool:
        status.update(ask(socket_path, "/status", timeout=5))
        last = status.get("lastSync")
        return isinstance(last, dict) and bool(last) and last.get("error") is None

    until(done, timeout, f"a sync of the daemon at {socket_path}", 0.1, ignore=(DebugError,))
    return status
