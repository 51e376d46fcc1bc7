"""Outlier ejection: an endpoint that fails the connection attempts this node sends it is
taken out of its Services' new connections for a while (Envoy's outlier detection, for an
L4 kernel proxy). Pure: the kernel's conntrack events (kernel/ctevents.py) are reduced to
`failure` and `success` calls with a time; this decides who is ejected, until when, and
what each service port's endpoints map does about it.

The rules, in order:

- an endpoint *wants* ejection after `failures` failed attempts in a row (no success
  between them) within `window` seconds: a busy endpoint failing one attempt in a thousand
  is not an outlier, and one that starts failing every attempt is one after its first
  `failures`, whatever it answered before;
- it is ejected for `base_ejection` seconds, doubled at each ejection in a row, at most
  `max_ejection`; each `base_ejection` it then spends without an ejection halves it back
  (the streak decays by one);
- back from an ejection, it is on probation for `window` seconds: one failure ejects it again
  at once, and it gets a small share of the new connections (`PROBATION_SHARE`), so the
  attempts that find it still failing are few;
- per service port, at most `max_ejected_percent` of the endpoints are ejected (rounded
  down), never the last one, and none when every endpoint fails (the fault is then not
  theirs: the node's network, a dependency they share): those endpoints are forgiven, their
  ejections and streaks undone.

An ejected endpoint keeps its existing connections (weight 0 in balancing.py: no slot for
new ones); it stays in the Service, in `explain`, in the health-check counts.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

# Of the new connections, what an endpoint back from an ejection gets relative to the
# others: 1 slot for every PROBATION_SHARE of each of them (a sixteenth of its share).
PROBATION_SHARE = 16


class Failure(StrEnum):
    """How a connection attempt failed, as conntrack saw it."""

    NO_REPLY = "no reply"  # the SYN was not answered within the reply timeout
    RESET = "reset"  # the endpoint answered the SYN with a reset (refused)


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """When an endpoint is ejected, and for how long (the settings `outlierEjection*`)."""

    failures: int = 5
    window: float = 10.0
    base_ejection: float = 30.0
    max_ejection: float = 300.0
    max_ejected_percent: int = 50
    reply_timeout: float = 1.0  # an attempt unanswered this long failed (kernel/ctevents.py)

    def ejection_seconds(self, streak: int) -> float:
        return float(min(self.base_ejection * 2.0 ** max(0, streak - 1), self.max_ejection))


@dataclass(frozen=True, slots=True)
class Ejection:
    """One endpoint out of new connections: why, since and until when (tracker clock), and
    its place in a streak (1: first; each one in a row doubles the time)."""

    reason: str
    since: float
    until: float
    streak: int


@lru_cache(maxsize=65536)
def endpoint_key(ip: str, port: int) -> str:
    """`IP:port` as `Endpoint.key` spells it, the address in one spelling (IPv6 compressed,
    as the kernel prints it), so conntrack's and the model's endpoints compare as strings."""
    if ":" in ip:
        with contextlib.suppress(ValueError):  # not an address: as it is
            ip = ipaddress.IPv6Address(ip).compressed
        return f"[{ip}]:{port}"
    return f"{ip}:{port}"


@dataclass(slots=True)
class _Record:
    """What the tracker remembers of one endpoint."""

    # The failed attempts since the last success, within the window.
    failures: deque[tuple[float, Failure]] = field(default_factory=deque)
    ejection: Ejection | None = None
    streak: int = 0
    # Since when the streak decays (the end of the last ejection, or the last decay step).
    calm_since: float = 0.0
    probation_until: float = float("-inf")

    def trim(self, now: float, window: float) -> None:
        start = now - window
        while self.failures and self.failures[0][0] < start:
            self.failures.popleft()

    def failing(self, policy: OutlierPolicy) -> bool:
        return len(self.failures) >= policy.failures

    def idle(self, now: float) -> bool:
        return (not self.failures and self.ejection is None
                and self.streak == 0 and self.probation_until <= now)


@dataclass(frozen=True, slots=True)
class PortOutliers:
    """What outlier ejection does to one service port's endpoints now: the ejected ones (by
    endpoint key), those on probation, and a note (held back by the limits, or none ejected
    because every endpoint fails)."""

    ejected: Mapping[str, Ejection] = field(default_factory=dict)
    probation: frozenset[str] = frozenset()
    note: str | None = None

    def __bool__(self) -> bool:
        return bool(self.ejected or self.probation)

    def adjust(self, keys: Sequence[str], weights: Sequence[int]) -> list[int]:
        """`weights` (one per endpoint of a slot list) with the ejected at 0 and those on
        probation at a PROBATION_SHARE-th of their share; as they were when that would leave
        the list without a slot (never the last one of a list: a Local list's only endpoint)."""
        if not self:
            return list(weights)
        pairs = list(zip(keys, weights, strict=True))
        if self.probation:  # the others' share multiplied, the probation's kept
            out = [0 if key in self.ejected else w if key in self.probation
                   else w * PROBATION_SHARE for key, w in pairs]
        else:
            out = [0 if key in self.ejected else w for key, w in pairs]
        return out if any(out) else list(weights)


NO_OUTLIERS = PortOutliers()


@dataclass
class OutlierTracker:
    """Failures in a row per endpoint (by key), the ejections they lead to, and per
    service port which of them apply. Not thread-safe: one caller at a time (the shell holds
    a lock). `ports` (set after each sync): the endpoint keys of every service port that has
    outlier ejection on, which the limits and the every-endpoint-fails rule are counted in."""

    policy: OutlierPolicy = field(default_factory=OutlierPolicy)
    _records: dict[str, _Record] = field(default_factory=dict)
    _ports: dict[object, tuple[str, ...]] = field(default_factory=dict)
    _ports_of: dict[str, list[object]] = field(default_factory=dict)
    # Ports whose every endpoint failed, and when that was last found (shown for a window).
    _all_failing: dict[object, float] = field(default_factory=dict)
    ejections_total: int = 0
    forgiven_total: int = 0

    # -- what the shell feeds in ---------------------------------------------------------------

    def set_ports(self, ports: Mapping[Any, Sequence[str]]) -> None:
        """Every port taking part, with its endpoint keys (after a full sync)."""
        self._ports, self._ports_of = {}, {}
        self.update_ports((), ports)

    def update_ports(self, gone: Iterable[Any], ports: Mapping[Any, Sequence[str]]) -> None:
        """Ports no longer taking part (`gone`), and those whose endpoints are now these
        (after a partial sync: the changed services' only, so its cost does not grow with
        the cluster)."""
        for name in (*gone, *ports):
            for key in self._ports.pop(name, ()):
                names = self._ports_of.get(key)
                if names is not None and name in names:
                    names.remove(name)
                    if not names:
                        del self._ports_of[key]
        for name, keys in ports.items():
            self._ports[name] = tuple(dict.fromkeys(keys))
            for key in self._ports[name]:
                self._ports_of.setdefault(key, []).append(name)

    @property
    def has_ports(self) -> bool:
        return bool(self._ports)

    def ports_of(self, key: str) -> tuple[Any, ...]:
        """The ports taking part that `key` is an endpoint of."""
        return tuple(self._ports_of.get(key, ()))

    def watched(self, key: str) -> bool:
        """An endpoint of a port with outlier ejection on (what the events are filtered by)."""
        return key in self._ports_of

    def success(self, key: str, now: float) -> None:
        """An answered attempt: the failures before it no longer count (in a row)."""
        record = self._records.get(key)
        if record is not None:
            record.failures.clear()

    def failure(self, key: str, now: float, how: Failure) -> set[str]:
        """One failed attempt; the endpoints whose ejection this changed (the ports they are
        in must be rendered again): the endpoint ejected, or a port's endpoints forgiven."""
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _Record()
        record.failures.append((now, how))
        record.trim(now, self.policy.window)
        record.calm_since = now
        if record.ejection is not None and record.ejection.until > now:
            return set()
        on_probation = record.probation_until > now
        if not (record.failing(self.policy) or on_probation):
            return set()
        forgiven = self._forgive_where_all_fail(key, now)
        if forgiven:
            return forgiven
        record.streak += 1
        until = now + self.policy.ejection_seconds(record.streak)
        record.ejection = Ejection(self._reason(record, on_probation), now, until, record.streak)
        record.probation_until = float("-inf")
        self.ejections_total += 1
        return {key}

    def tick(self, now: float) -> set[str]:
        """Time passing: ejections that ended (their endpoints back, on probation), probations
        that ended, streaks that decayed. The endpoints whose share of new connections changed."""
        changed: set[str] = set()
        for key, record in list(self._records.items()):
            record.trim(now, self.policy.window)
            if record.ejection is not None and record.ejection.until <= now:
                record.ejection = None
                record.probation_until = now + self.policy.window
                record.calm_since = now
                changed.add(key)
            elif record.ejection is None and record.probation_until != float("-inf") \
                    and record.probation_until <= now:
                record.probation_until = float("-inf")
                changed.add(key)
            while (record.ejection is None and record.streak
                   and now - record.calm_since >= self.policy.base_ejection):
                record.streak -= 1
                record.calm_since += self.policy.base_ejection
            if record.idle(now):
                del self._records[key]
        for name, when in list(self._all_failing.items()):
            if now - when > self.policy.window:
                del self._all_failing[name]
        return changed

    # -- what the render and explain read -----------------------------------------------------

    def port_outliers(self, name: object, keys: Iterable[str], now: float) -> PortOutliers:
        """The ejections that apply to one service port whose endpoints are `keys`: the
        wanted ones, oldest first, within the limits."""
        keys = tuple(dict.fromkeys(keys))
        wanted = sorted(((key, ej) for key in keys
                         if (ej := self._ejection(key, now)) is not None),
                        key=lambda item: (item[1].since, item[0]))
        probation = frozenset(key for key in keys if key not in dict(wanted)
                              and (r := self._records.get(key)) is not None
                              and r.probation_until > now)
        if name in self._all_failing:
            return PortOutliers(note="every endpoint failed its connection attempts: none "
                                     "ejected (the fault is not theirs)")
        if not wanted:
            return PortOutliers(probation=probation) if probation else NO_OUTLIERS
        allowed = min(len(keys) - 1, len(keys) * self.policy.max_ejected_percent // 100)
        held = wanted[allowed:]
        note = None
        if held:
            note = (f"{len(held)} more failing, not ejected: at most "
                    f"{self.policy.max_ejected_percent} % of the endpoints and never the last "
                    f"({', '.join(key for key, _ in held[:3])})")
        return PortOutliers(dict(wanted[:allowed]), probation, note)

    @property
    def remembered(self) -> int:
        """Endpoints with failures, an ejection or a streak remembered (bounded by
        the watched endpoints: the others are forgotten a window after their last event)."""
        return len(self._records)

    def ejected(self, now: float) -> dict[str, Ejection]:
        """Every endpoint wanting ejection now (before the per-port limits)."""
        return {key: ej for key in self._records
                if (ej := self._ejection(key, now)) is not None}

    def _ejection(self, key: str, now: float) -> Ejection | None:
        record = self._records.get(key)
        if record is None or record.ejection is None or record.ejection.until <= now:
            return None
        return record.ejection

    def _reason(self, record: _Record, on_probation: bool) -> str:
        if on_probation:
            return f"{record.failures[-1][1]} on probation, back from an ejection"
        counts = {how: sum(1 for _, h in record.failures if h is how) for how in Failure}
        parts = ", ".join(f"{n} {how}" for how, n in counts.items() if n)
        return (f"{len(record.failures)} connection attempts in a row failed within "
                f"{self.policy.window:g} s ({parts})")

    def _forgive_where_all_fail(self, key: str, now: float) -> set[str]:
        """`key` fails: every port of it whose other endpoints all fail or are ejected too
        is marked (no ejection in it for a window from now) and its endpoints forgiven: their
        ejections and the streaks they added undone, their failures forgotten. The
        endpoints forgiven (none: `key` may be ejected)."""
        forgiven: set[str] = set()
        for name in self._ports_of.get(key, ()):
            keys = self._ports[name]
            if len(keys) < 2 or not all(k == key or self._failing_or_ejected(k, now)
                                        for k in keys):
                continue
            self._all_failing[name] = now
            for k in keys:
                record = self._records.get(k)
                if record is None:
                    continue
                if record.ejection is not None:
                    record.ejection = None
                    record.streak = max(0, record.streak - 1)
                    self.forgiven_total += 1
                record.failures.clear()
                record.probation_until = float("-inf")
                forgiven.add(k)
        return forgiven

    def _failing_or_ejected(self, key: str, now: float) -> bool:
        record = self._records.get(key)
        return record is not None and (
            self._ejection(key, now) is not None or record.failing(self.policy))
