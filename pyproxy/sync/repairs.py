"""Reports of someone else's changes to our tables, and how many of them a sync repaired."""

from __future__ import annotations

import threading

from pyproxy.core.plan import Cause


class Repairs:
    """Counts the changes reported and those a successful full sync has repaired; /healthz
    reads `damage()`. Its own lock, not the sync's: a sync holds that one for seconds at
    10k services, and a report must reach /healthz at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reported = 0
        self._repaired = 0
        self._what = ""  # the last change reported
        self._error = ""  # why the last repair failed

    def report(self, what: str) -> int:
        """Someone else changed our tables (`what`). Returns the count reported so far."""
        with self._lock:
            self._what, self._error = f"{Cause.REPAIR.value}: {what}", ""
            self._reported += 1
            return self._reported

    def reported(self) -> int:
        """The count reported so far: a sync that succeeds repaired up to it."""
        with self._lock:
            return self._reported

    def wanted(self, reported: int) -> bool:
        """Whether some of the first `reported` changes are not repaired yet."""
        with self._lock:
            return reported != self._repaired

    def repaired(self, reported: int) -> None:
        """A full sync succeeded: the first `reported` changes are repaired."""
        with self._lock:
            self._repaired = reported

    def failed(self, error: str) -> None:
        """A sync failed: if a repair is wanted, it failed (for `damage`)."""
        with self._lock:
            if self._reported != self._repaired:
                self._error = error

    def damage(self) -> str | None:
        """Why the kernel does not hold what was last committed (someone else changed our
        tables and the repair has not succeeded yet), or None."""
        with self._lock:
            if self._reported == self._repaired:
                return None
            failed = f"; the repair failed: {self._error}" if self._error else ""
            return self._what + failed
