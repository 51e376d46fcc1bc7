"""How one watch is doing: client-go's backoff between its tries, and its state (connecting,
connected, disconnected, since when) for `pyproxy status` and the pyproxy_watch_state metric.
Pure but for the clocks they are given."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# client-go's reflector backoff (k8s.io/client-go tools/cache/reflector.go, v0.37.2):
# wait.Backoff{Duration: 800 ms, Cap: 30 s, Factor: 2, Jitter: 1.0}.DelayWithReset(2 min).
BACKOFF_INITIAL = 0.8
BACKOFF_CAP = 30.0
BACKOFF_FACTOR = 2.0
BACKOFF_JITTER = 1.0
BACKOFF_RESET = 120.0


@dataclass
class Backoff:
    """The pause before the next try, as client-go's reflector draws it (one per reflector,
    shared by every kind of retry): step n waits d·(1 + jitter·rand) with d = initial·2^n,
    d capped at `cap` (so a wait is in [d, 2d]: 0.8-1.6 s, 1.6-3.2, 3.2-6.4 … 30-60 s);
    the steps start again from `initial` only when `reset_after` seconds have passed since
    they last did (wait.backoffManager: not on a success). Both matter for a fleet: nodes
    whose API server went away together come back spread over a window that doubles with
    each refused try, and the relist after a 410 waits the next step, not a fixed pause,
    so the relists of a restart come in a second, wider wave (docs/fleet.md)."""

    initial: float = BACKOFF_INITIAL
    cap: float = BACKOFF_CAP
    factor: float = BACKOFF_FACTOR
    jitter: float = BACKOFF_JITTER
    reset_after: float = BACKOFF_RESET
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random
    _next: float = 0.0  # the next step's d (0: the first, initial)
    _since: float | None = None  # when the steps last started again (created: now)

    def __post_init__(self) -> None:
        self._since = self.clock()

    def next(self) -> float:
        now = self.clock()
        if self._since is None or now - self._since > self.reset_after:
            self._next, self._since = self.initial, now
        elif not self._next:
            self._next = self.initial
        current = self._next
        self._next = min(self.cap, current * self.factor)
        return current * (1.0 + self.jitter * self.rand())


# A watch's state (the metric pyproxy_watch_state, `pyproxy status`): no answer yet since
# start, an answer on the last try, or an error on it.
CONNECTING = "connecting"
CONNECTED = "connected"
DISCONNECTED = "disconnected"
WATCH_STATES = (CONNECTING, CONNECTED, DISCONNECTED)
# `pyproxy status` fails when a watch has been without an answer this long (docs/metrics.md):
# twice the longest pause between tries (client-go's backoff: 30 s jittered to 30-60 s), so
# an API server that is back has been tried again within it, and a watch that stays down
# (a 403, a CA that does not sign the server's certificate, no route) is reported.
DISCONNECTED_BOUND = 120.0


@dataclass
class WatchStatus:
    """What `pyproxy status` and the metrics show about one watch."""

    kind: str
    synced: bool = False
    connected: bool = False
    state: str = CONNECTING
    # Unix time the state began (for a watch that never connected: when it started).
    state_since: float = field(default_factory=time.time)
    resource_version: str = ""
    lists: int = 0
    watches: int = 0
    events: int = 0
    errors: int = 0
    last_error: str = ""
    # The last complete list: seconds in all, of those waiting for the server's pages
    # (request + transfer) and decoding the JSON; the rest is handing the objects over
    # (conversion and tracking).
    last_list_seconds: float = 0.0
    last_list_server_seconds: float = 0.0
    last_list_decode_seconds: float = 0.0
    # How the current watch's events come: "json", or "protobuf" (clientConnection.contentType
    # on a server that speaks it); a streamed list's stream read on as the watch is JSON.
    watch_encoding: str = ""

    def set_connected(self, connected: bool, now: float | None = None) -> None:
        """The last try was answered (connected) or failed: the state, and since when (a
        watch that never connected has been down since it started)."""
        state = CONNECTED if connected else DISCONNECTED
        self.connected = connected
        if connected != (self.state == CONNECTED):
            self.state_since = time.time() if now is None else now
        self.state = state

    def down_for(self, now: float) -> float:
        """Seconds without an answer (0 while connected)."""
        return 0.0 if self.state == CONNECTED else max(0.0, now - self.state_since)


def watch_problems(statuses: Iterable[WatchStatus], now: float,
                   bound: float | None = None) -> list[str]:
    """Why `pyproxy status` fails on the API side: each watch without an answer for longer
    than `bound` (DISCONNECTED_BOUND), with its last error."""
    bound = DISCONNECTED_BOUND if bound is None else bound
    problems = []
    for status in statuses:
        down = status.down_for(now)
        if down <= bound:
            continue
        never = ", never listed" if not status.synced else ""
        why = f": {status.last_error}" if status.last_error else ""
        problems.append(f"watch {status.kind} {status.state} for {down:.0f} s "
                        f"(more than {bound:.0f} s{never}){why}")
    return problems
