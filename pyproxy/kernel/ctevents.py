"""Failed connection attempts per endpoint, from the kernel's conntrack events: what outlier
ejection (core/outliers.py) is fed with.

A TCP connection DNATed to an endpoint fails when the endpoint answers its SYN with a reset
(refused), or does not answer it at all (a wedged node, a partition, a firewall dropping
SYNs). Conntrack destroys an unanswered entry only when SYN_SENT times out, 120 s after the
SYN: far too late to spare clients with a 1 s connect timeout. So the attempts are followed
from their start: the NEW event (the SYN confirmed, DNATed to an endpoint) opens an attempt,
an UPDATE carrying the reply (status SEEN_REPLY) closes it — a success, or a reset when the
reply left the entry in state CLOSE — and an attempt still open `reply_timeout` after its
start failed (`ConnectAttempts.expire`, run by the reader every 100 ms). Detection is then
the reply timeout plus at most 0.1 s after the last of the N failures, and the next sync.

An attempt left unanswered is deleted from conntrack as soon as it counts as failed: its
SYN_SENT entry would otherwise live 120 s, DNATed to the failing endpoint, and take the
client's retransmitted SYN there again, or a new connection that happens to reuse its
source port (measured: a few attempts in a thousand while the endpoint was ejected). Deleted
by its original tuple and id, so a newer connection on the same tuple is left alone.

Why not the other ways: the DESTROY event of an unanswered SYN comes 120 s late; the client's
SYN retransmissions come 1 s, 3 s, 7 s after the SYN (none at all from a client that gave up
after 1 s); an nft rule can count SYNs and SYN-ACKs per endpoint but not pair them, and its
counters must be polled. The events cost one netlink message per conntrack change on the
node; a socket filter (classic BPF, as for the nftables events) drops every non-TCP one in
the kernel, and the reader looks only at entries DNATed to a watched endpoint (a set lookup).
Events are lost when the reader falls behind (ENOBUFS): the attempts then open are forgotten,
not counted as failures.

The attempt ledger is pure (core/attempts.py); here the events are read (`parse`, the
socket filter `filter_program`, `ConntrackEvents`: the thread around the socket) and the
unanswered entries deleted (`delete_message`).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from pyproxy.core.attempts import AF_INET, AF_INET6, ConnectAttempts, Event
from pyproxy.core.conntrack import IPPROTO_TCP
from pyproxy.core.outliers import endpoint_key
from pyproxy.kernel.nftevents import (
    BPF_JEQ_K,
    BPF_RET_K,
    Instruction,
    subscribed_socket,
)
from pyproxy.kernel.nlconntrack import (
    CTA_ID,
    CTA_IP_V4_SRC,
    CTA_IP_V6_SRC,
    CTA_PROTO_NUM,
    CTA_PROTO_SRC_PORT,
    CTA_PROTOINFO,
    CTA_PROTOINFO_TCP,
    CTA_PROTOINFO_TCP_STATE,
    CTA_STATUS,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_PROTO,
    CTA_TUPLE_REPLY,
    IPCTNL_MSG_CT_DELETE,
    NFNL_SUBSYS_CTNETLINK,
    NFNLGRP_CONNTRACK_DESTROY,
    NFNLGRP_CONNTRACK_NEW,
    NFNLGRP_CONNTRACK_UPDATE,
)
from pyproxy.kernel.nlelements import (
    HEADER,
    NETLINK_NETFILTER,
    NLM_F_REQUEST,
    attribute,
    attributes,
    nfnl_messages,
)

log = structlog.get_logger(__name__)

BPF_LD_B_ABS, BPF_JA = 0x30, 0x05
# Where a conntrack event's protocol number is: the nlmsghdr (16), nfgenmsg (4), then
# CTA_TUPLE_ORIG's header (4), CTA_TUPLE_IP's (4), the two addresses with their headers
# (8 + 8, or 20 + 20), CTA_TUPLE_PROTO's header (4), CTA_PROTO_NUM's (4): ctnetlink writes
# the original tuple first, always in this order (ctnetlink_conntrack_event).
PROTO_OFFSET = {AF_INET: 52, AF_INET6: 76}
_BE32 = struct.Struct(">I")
_BE16 = struct.Struct(">H")


def parse(data: bytes) -> Iterator[Event]:
    """The TCP conntrack events in one datagram (others, and truncated ones, are skipped)."""
    for offset, length, msg, flags, _portid in nfnl_messages(data, NFNL_SUBSYS_CTNETLINK):
        event = _event(data, offset, length, msg, flags)
        if event is not None:
            yield event


NLM_F_CREATE = 0x400


def _event(data: bytes, offset: int, length: int, msg: int, flags: int) -> Event | None:
    family = data[offset + HEADER.size]
    end = offset + length
    attrs = {kind: (begin, stop) for kind, begin, stop in
             attributes(data, offset + HEADER.size + 4, end) if stop <= end}
    if CTA_TUPLE_REPLY not in attrs or CTA_ID not in attrs:
        return None
    reply = _tuple(data, *attrs[CTA_TUPLE_REPLY], family)
    if reply is None or reply[2] != IPPROTO_TCP:
        return None
    status = _BE32.unpack_from(data, attrs[CTA_STATUS][0])[0] if CTA_STATUS in attrs else 0
    state = _tcp_state(data, *attrs[CTA_PROTOINFO]) if CTA_PROTOINFO in attrs else None
    kind = ("destroy" if msg == IPCTNL_MSG_CT_DELETE
            else "new" if flags & NLM_F_CREATE else "update")
    orig = b""
    if kind == "new" and CTA_TUPLE_ORIG in attrs:
        begin, stop = attrs[CTA_TUPLE_ORIG]
        orig = data[begin - 4:stop]
    return Event(kind, _BE32.unpack_from(data, attrs[CTA_ID][0])[0],
                 endpoint_key(reply[0], reply[1]), status, state, family, orig)


def delete_message(family: int, conn_id: int, orig: bytes, seq: int = 0) -> bytes:
    """IPCTNL_MSG_CT_DELETE of one entry by its original tuple, only if its id is still
    `conn_id` (a later connection reusing the tuple is left alone: the kernel answers
    ENOENT)."""
    payload = (struct.pack("=BBH", family, 0, 0) + orig
               + attribute(CTA_ID, _BE32.pack(conn_id)))
    return HEADER.pack(HEADER.size + len(payload), (NFNL_SUBSYS_CTNETLINK << 8)
                       | IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST, seq, 0) + payload


def _tuple(data: bytes, start: int, end: int, family: int) -> tuple[str, int, int] | None:
    """(source address, source port, protocol) of a CTA_TUPLE_* nest."""
    address, port, proto = None, 0, 0
    for kind, begin, stop in attributes(data, start, end):
        if kind == CTA_TUPLE_IP:
            for k, b, s in attributes(data, begin, stop):
                if k in (CTA_IP_V4_SRC, CTA_IP_V6_SRC):
                    af = socket.AF_INET if k == CTA_IP_V4_SRC else socket.AF_INET6
                    address = socket.inet_ntop(af, data[b:s])
        elif kind == CTA_TUPLE_PROTO:
            for k, b, _s in attributes(data, begin, stop):
                if k == CTA_PROTO_NUM:
                    proto = data[b]
                elif k == CTA_PROTO_SRC_PORT:
                    port = _BE16.unpack_from(data, b)[0]
    return None if address is None else (address, port, proto)


def _tcp_state(data: bytes, start: int, end: int) -> int | None:
    for kind, begin, stop in attributes(data, start, end):
        if kind == CTA_PROTOINFO_TCP:
            for k, b, _s in attributes(data, begin, stop):
                if k == CTA_PROTOINFO_TCP_STATE:
                    return data[b]
    return None


def filter_program() -> list[Instruction]:
    """Keep the TCP events, drop the rest in the kernel (UDP, ICMP: most of a node's
    entries are DNS lookups)."""
    return [
        (BPF_LD_B_ABS, 0, 0, HEADER.size),  # nfgenmsg's family
        (BPF_JEQ_K, 0, 2, AF_INET),
        (BPF_LD_B_ABS, 0, 0, PROTO_OFFSET[AF_INET]),
        (BPF_JA, 0, 0, 2),
        (BPF_JEQ_K, 0, 3, AF_INET6),
        (BPF_LD_B_ABS, 0, 0, PROTO_OFFSET[AF_INET6]),
        (BPF_JEQ_K, 0, 1, IPPROTO_TCP),
        (BPF_RET_K, 0, 0, 0xFFFFFFFF),
        (BPF_RET_K, 0, 0, 0),
    ]


# ---------------------------------------------------------------------------------------------
# The shell


def open_socket() -> socket.socket:
    """A socket subscribed to the conntrack event groups of this thread's network namespace,
    TCP events only."""
    return subscribed_socket(filter_program(), 8 << 20, (
        NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_UPDATE, NFNLGRP_CONNTRACK_DESTROY))


@dataclass
class ConntrackEvents:
    """Reads the events on a thread of its own into `attempts` (under `lock`, which the
    outcomes' receiver shares), expires its attempts every `tick_seconds`, and calls
    `tick(now)` after each read or timeout, without the lock (it may start a sync)."""

    attempts: ConnectAttempts
    tick: Callable[[float], None]
    lock: threading.Lock
    clock: Callable[[], float] = time.time
    open: Callable[[], socket.socket] = open_socket
    tick_seconds: float = 0.1
    lost: int = 0
    events: int = 0
    deleted: int = 0  # unanswered entries asked to be deleted
    _started: bool = False
    _deleter: socket.socket | None = None

    def start(self, stop: threading.Event) -> bool:
        """Subscribe (in the calling thread's namespace) and start reading. False when the
        kernel or the privileges do not allow it (outlier ejection then sees nothing)."""
        try:
            sock = self.open()
        except OSError as err:
            log.warning("conntrack_events_unavailable", error=str(err))
            return False
        sock.settimeout(self.tick_seconds)
        try:
            self._deleter = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            self._deleter.setblocking(False)
            self._deleter.bind((0, 0))
            self.attempts.on_stale = self._delete
        except OSError as err:  # attempts still judged; their entries left to time out
            log.warning("conntrack_delete_unavailable", error=str(err))
        threading.Thread(target=self._run, args=(sock, stop), name="conntrack-events",
                         daemon=True).start()
        self._started = True
        return True

    @property
    def running(self) -> bool:
        return self._started

    def _delete(self, family: int, conn_id: int, orig: bytes) -> None:
        """Ask the kernel to delete an unanswered entry; its answers (ENOENT when the client
        closed it meanwhile) are read and dropped (`_drain`)."""
        if self._deleter is None:
            return
        with contextlib.suppress(OSError):  # a full buffer: that entry times out instead
            self._deleter.send(delete_message(family, conn_id, orig))
            self.deleted += 1

    def _drain(self) -> None:
        while self._deleter is not None:
            try:
                self._deleter.recv(1 << 16)
            except OSError:  # nothing more to read (BlockingIOError), or closed
                return

    def _run(self, sock: socket.socket, stop: threading.Event) -> None:
        next_tick = self.clock()
        try:
            while not stop.is_set():
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    data = b""
                except OSError as err:
                    if err.errno != errno.ENOBUFS:
                        log.error("conntrack_events_stopped", error=str(err))
                        return
                    self.lost += 1
                    data = b""
                now = self.clock()
                if data:
                    with self.lock:
                        for event in parse(data):
                            self.events += 1
                            self.attempts.feed(event, now)
                if now >= next_tick:
                    next_tick = now + self.tick_seconds
                    with self.lock:
                        self.attempts.expire(now)
                    self._drain()
                self.tick(now)
        finally:
            self._started = False
            with contextlib.suppress(OSError):
                sock.close()
                if self._deleter is not None:
                    self._deleter.close()
