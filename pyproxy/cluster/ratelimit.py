"""Client-side rate limiting of API requests (`clientConnection.qps` / `burst`), as client-go's.

The `kubernetes` Python client has no limiter of its own. client-go gives every client a token
bucket (golang.org/x/time/rate): `burst` requests at once, then `qps` per second; a request
that finds the bucket empty waits for its token. Every request waits its turn: list pages,
(re)starting a watch, events. qps 0 and burst 0 mean client-go's defaults, 5 and 10.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

DEFAULT_QPS = 5.0
DEFAULT_BURST = 10


class TokenBucket:
    """`burst` tokens, refilled at `qps` per second. A request takes one; when none is left
    it reserves the next (the bucket goes into debt) and sleeps until it is due, so waiting
    requests are spaced 1/qps apart in arrival order, as x/time/rate's Wait."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.qps = qps or DEFAULT_QPS
        self.burst = burst or DEFAULT_BURST
        self.clock = clock
        self.sleep = sleep
        self._tokens = float(self.burst)
        self._last = clock()
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds spent waiting in all (for status and tests)

    def take(self) -> float:
        """Take a token, waiting for it if need be; returns the seconds waited."""
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
            self.waited += wait
        if wait:
            self.sleep(wait)
        return wait


def limit_requests(api_client: Any, bucket: TokenBucket) -> Any:
    """Make every request of a `kubernetes.client.ApiClient` take a token first. All of the
    client's calls (list, watch, create) go through its `call_api`."""
    call_api = api_client.call_api

    def limited(*args: Any, **kwargs: Any) -> Any:
        bucket.take()
        return call_api(*args, **kwargs)

    api_client.call_api = limited
    api_client.rate_limiter = bucket
    return api_client
