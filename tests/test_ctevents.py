"""Conntrack events into connection attempts (kernel/ctevents.py, core/attempts.py), pure:
messages laid out as ctnetlink writes them (ctnetlink_conntrack_event), the socket filter
run on them, and what the attempt ledger makes of each sequence.
tests/test_outliers_netns.py reads real ones."""

from __future__ import annotations

import socket
import struct

from pyproxy.core.attempts import IPS_DST_NAT, IPS_SEEN_REPLY, ConnectAttempts, Event
from pyproxy.core.outliers import Failure
from pyproxy.kernel.ctevents import (
    BPF_JA,
    BPF_LD_B_ABS,
    NLM_F_CREATE,
    delete_message,
    filter_program,
    parse,
)
from pyproxy.kernel.nftevents import BPF_JEQ_K, BPF_RET_K, Instruction
from pyproxy.kernel.nlelements import HEADER, attribute

NESTED = 0x8000
CONFIRMED = 1 << 3
SYN_SENT, ESTABLISHED, CLOSE = 1, 3, 8


def nest(kind: int, *parts: bytes) -> bytes:
    return attribute(kind | NESTED, b"".join(parts))


def tuple_attr(kind: int, src: str, dst: str, sport: int, dport: int, proto: int) -> bytes:
    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    src_type, dst_type = (3, 4) if family == socket.AF_INET6 else (1, 2)
    return nest(kind,
                nest(1, attribute(src_type, socket.inet_pton(family, src)),
                     attribute(dst_type, socket.inet_pton(family, dst))),
                nest(2, attribute(1, bytes([proto])), attribute(2, struct.pack(">H", sport)),
                     attribute(3, struct.pack(">H", dport))))


def message(kind: str, conn_id: int, endpoint: tuple[str, int], status: int,
            state: int | None, proto: int = 6, client: str = "192.168.50.2") -> bytes:
    """One event as the kernel sends it: the original tuple first (client → VIP), the reply
    tuple (endpoint → client), the id, the status, and the TCP state when it changed."""
    six = ":" in endpoint[0]
    vip, client = ("fd00:96::10", "fd00:50::2") if six else ("10.96.0.10", client)
    body = (tuple_attr(1, client, vip, 40000, 80, proto)
            + tuple_attr(2, endpoint[0], client, endpoint[1], 40000, proto)
            + attribute(3, struct.pack(">I", status))
            + (nest(4, nest(1, attribute(1, bytes([state])))) if state is not None else b"")
            + attribute(12, struct.pack(">I", conn_id)))
    msg_type = (1 << 8) | (2 if kind == "destroy" else 0)
    flags = NLM_F_CREATE if kind == "new" else 0
    family = socket.AF_INET6 if six else socket.AF_INET
    payload = struct.pack("=BBH", family, 0, 0) + body
    return HEADER.pack(HEADER.size + len(payload), msg_type, flags, 0, 0) + payload


def run_filter(program: list[Instruction], packet: bytes) -> bool:
    """A classic BPF interpreter for the instructions the filter uses: kept or dropped."""
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == BPF_LD_B_ABS:
            acc, pc = packet[k], pc + 1
        elif code == BPF_JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == BPF_JA:
            pc += 1 + k
        elif code == BPF_RET_K:
            return k != 0
        else:
            raise AssertionError(f"unknown instruction {code:#x}")


EP, EP6 = ("10.244.1.5", 8080), ("fd00:244:1::5", 8080)
NATED = CONFIRMED | IPS_DST_NAT


def test_the_filter_keeps_tcp_events_of_both_families_and_drops_the_rest() -> None:
    program = filter_program()
    assert run_filter(program, message("new", 1, EP, NATED, SYN_SENT))
    assert run_filter(program, message("new", 1, EP6, NATED, SYN_SENT))
    assert not run_filter(program, message("new", 1, EP, NATED, None, proto=17))
    assert not run_filter(program, message("new", 1, EP6, NATED, None, proto=17))


def test_events_are_parsed_with_who_answers() -> None:
    data = (message("new", 7, EP, NATED, SYN_SENT)
            + message("update", 7, EP, NATED | IPS_SEEN_REPLY, ESTABLISHED)
            + message("destroy", 8, EP6, NATED, CLOSE)
            + message("new", 9, EP, NATED, None, proto=17))
    orig = tuple_attr(1, "192.168.50.2", "10.96.0.10", 40000, 80, 6)
    assert list(parse(data)) == [
        Event("new", 7, "10.244.1.5:8080", NATED, SYN_SENT, socket.AF_INET, orig),
        Event("update", 7, "10.244.1.5:8080", NATED | IPS_SEEN_REPLY, ESTABLISHED),
        Event("destroy", 8, "[fd00:244:1::5]:8080", NATED, CLOSE, socket.AF_INET6),
    ]
    assert list(parse(data[:-5])) == list(parse(data))[:3]  # a truncated message: skipped


class Outcomes:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, float]] = []

    def failure(self, key: str, how: Failure, now: float) -> None:
        self.seen.append((key, str(how), now))

    def success(self, key: str, now: float) -> None:
        self.seen.append((key, "ok", now))


def attempts(watched: set[str] | None = None) -> tuple[ConnectAttempts, Outcomes]:
    out = Outcomes()
    keys = {"10.244.1.5:8080"} if watched is None else watched
    return ConnectAttempts(keys.__contains__, out.failure, out.success, 1.0), out


def test_an_answered_attempt_succeeds_an_unanswered_one_fails_at_the_reply_timeout() -> None:
    ledger, out = attempts()
    ledger.feed(Event("new", 1, "10.244.1.5:8080", NATED, SYN_SENT), 10.0)
    ledger.feed(Event("new", 2, "10.244.1.5:8080", NATED, SYN_SENT), 10.2)
    ledger.feed(Event("update", 1, "10.244.1.5:8080", NATED | IPS_SEEN_REPLY, 2), 10.001)
    ledger.expire(11.1)
    assert out.seen == [("10.244.1.5:8080", "ok", 10.001)] and ledger.pending == 1
    ledger.expire(11.2)
    assert out.seen[-1] == ("10.244.1.5:8080", "no reply", 11.2) and ledger.pending == 0
    # The SYN_SENT entry's destroy, 120 s later, is nothing new.
    ledger.feed(Event("destroy", 2, "10.244.1.5:8080", NATED, SYN_SENT), 130.0)
    assert len(out.seen) == 2


def test_a_reset_answering_the_syn_fails_with_or_without_seen_reply() -> None:
    ledger, out = attempts()
    ledger.feed(Event("new", 1, "10.244.1.5:8080", NATED, SYN_SENT), 1.0)
    ledger.feed(Event("update", 1, "10.244.1.5:8080", NATED | IPS_SEEN_REPLY, CLOSE), 1.01)
    ledger.feed(Event("new", 2, "10.244.1.5:8080", NATED, SYN_SENT), 2.0)
    ledger.feed(Event("destroy", 2, "10.244.1.5:8080", NATED | 0x200, CLOSE), 2.01)
    assert [how for _, how, _ in out.seen] == ["reset", "reset"]


def test_only_dnated_attempts_to_watched_endpoints_are_followed() -> None:
    ledger, out = attempts()
    ledger.feed(Event("new", 1, "10.244.1.6:8080", NATED, SYN_SENT), 1.0)  # not watched
    ledger.feed(Event("new", 2, "10.244.1.5:8080", CONFIRMED, SYN_SENT), 1.0)  # not DNATed
    ledger.expire(5.0)
    assert out.seen == [] and ledger.pending == 0


def test_the_ledger_is_bounded() -> None:
    ledger, _ = attempts()
    ledger.limit = 2
    for conn_id in range(5):
        ledger.feed(Event("new", conn_id, "10.244.1.5:8080", NATED, SYN_SENT), 1.0)
    assert ledger.pending == 2 and ledger.dropped == 3


def test_an_unanswered_entry_is_deleted_by_its_tuple_and_id() -> None:
    stale: list[tuple[int, int, bytes]] = []
    ledger, out = attempts()
    ledger.on_stale = lambda family, conn_id, orig: stale.append((family, conn_id, orig))
    [new] = parse(message("new", 7, EP, NATED, SYN_SENT))
    ledger.feed(new, 1.0)
    ledger.expire(2.5)
    assert out.seen == [("10.244.1.5:8080", "no reply", 2.5)]
    assert stale == [(socket.AF_INET, 7, new.orig)]
    request = delete_message(socket.AF_INET, 7, new.orig)
    length, kind, flags, _, _ = HEADER.unpack_from(request)
    assert (length, kind, flags) == (len(request), (1 << 8) | 2, 1)  # CT_DELETE, a request
    # The same attributes the kernel keys an entry by: its original tuple, then its id.
    assert request[HEADER.size + 4:] == new.orig + attribute(12, struct.pack(">I", 7))
