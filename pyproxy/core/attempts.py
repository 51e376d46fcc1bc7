"""Connection attempts followed from their start to their answer, pure: what outlier
ejection (core/outliers.py) learns from the kernel's conntrack events (read by
kernel/ctevents.py, which explains why attempts are followed this way).

An attempt is a TCP conntrack entry DNATed to a watched endpoint: its NEW event opens it;
an event carrying the reply (status SEEN_REPLY) closes it, a success, unless the entry is
CLOSE (a reset answering the SYN); an attempt still open `reply_timeout` after its start
failed, and its entry is stale (`on_stale`: deleted by the shell).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pyproxy.core.conntrack import IPS_DST_NAT, IPS_SEEN_REPLY, TCP_CONNTRACK_CLOSE
from pyproxy.core.outliers import Failure

# include/uapi/linux/netfilter/nf_conntrack_common.h, nf_conntrack_tcp.h; the address families
AF_INET, AF_INET6 = 2, 10


@dataclass(frozen=True, slots=True)
class Event:
    """One conntrack event about a TCP entry: its id, who answers it (the DNAT target:
    the reply tuple's source), its status bits and TCP state (None: not in this event)."""

    kind: str  # "new", "update" or "destroy"
    id: int
    endpoint: str  # endpoint_key of the reply source
    status: int
    tcp_state: int | None
    family: int = AF_INET
    # The CTA_TUPLE_ORIG attribute as the kernel wrote it: what deletes the entry again.
    orig: bytes = b""

    @property
    def dnated(self) -> bool:
        return bool(self.status & IPS_DST_NAT)

    @property
    def answered(self) -> bool:
        return bool(self.status & IPS_SEEN_REPLY)


@dataclass
class ConnectAttempts:
    """The connection attempts to watched endpoints still waiting for their reply, by
    conntrack id, and what each event or the passing time makes of them. `on_failure(key,
    how, now)` and `on_success(key, now)` are told the outcomes; `watched(key)` says which
    endpoints matter (outlier ejection on for one of their service ports)."""

    watched: Callable[[str], bool]
    on_failure: Callable[[str, Failure, float], None]
    on_success: Callable[[str, float], None]
    reply_timeout: float = 1.0
    # Told each entry left unanswered (family, id, original tuple): it is deleted, so the
    # client's retransmitted SYN, or a new connection reusing its source port (the entry
    # would pin it to the failing endpoint for SYN_SENT's 120 s), is DNATed afresh.
    on_stale: Callable[[int, int, bytes], None] = lambda family, conn_id, orig: None
    limit: int = 65536  # attempts followed at once: beyond, new ones are not
    _open: dict[int, tuple[str, float, int, bytes]] = field(default_factory=dict)
    dropped: int = 0

    def feed(self, event: Event, now: float) -> None:
        if event.kind == "new":
            if event.dnated and not event.answered and self.watched(event.endpoint):
                if len(self._open) < self.limit:
                    self._open[event.id] = (event.endpoint, now, event.family, event.orig)
                else:
                    self.dropped += 1
            return
        started = self._open.pop(event.id, None)
        if started is None:
            return
        key = started[0]
        if event.tcp_state == TCP_CONNTRACK_CLOSE:
            # A reset answering the SYN: the entry closed (its DESTROY event may come without
            # SEEN_REPLY: the kernel kills it while handling that very reset).
            self.on_failure(key, Failure.RESET, now)
        elif event.answered:
            self.on_success(key, now)
        elif event.kind == "destroy":  # gone unanswered before the timeout (flushed, ICMP)
            self.on_failure(key, Failure.NO_REPLY, now)
        else:
            self._open[event.id] = started  # another change, still no reply

    def expire(self, now: float) -> None:
        """The attempts unanswered for `reply_timeout`: failed. (Oldest first: a dict keeps
        the order attempts opened in.)"""
        deadline = now - self.reply_timeout
        while self._open:
            conn_id, (key, started, family, orig) = next(iter(self._open.items()))
            if started > deadline:
                return
            del self._open[conn_id]
            self.on_failure(key, Failure.NO_REPLY, now)
            if orig:
                self.on_stale(family, conn_id, orig)

    @property
    def pending(self) -> int:
        return len(self._open)
