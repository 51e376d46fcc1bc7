"""TCP connections through DNAT, counted from a raw ctnetlink dump (I/O and its decoding).

What the connections in flight (pyproxy/core/inflight.py) and least-connection balancing
need from conntrack is, per (original destination, original destination port, reply source,
reply source port) — a service frontend and the endpoint answering for it — how many TCP
entries are ESTABLISHED and how many are in any other state. Nothing else of an entry.

Why not pyroute2 (kernel/netlink.py's cleanup): it builds an object tree per entry, ~60 µs of
CPU each, 6 s for 100k entries. Here the dump is asked with the kernel's filters (TCP only,
CTA_FILTER, Linux >= 5.8; DNATed only, CTA_STATUS_MASK, Linux >= 5.19: a kernel that refuses
them gets the unfiltered dump and the same decoding skips what does not match), and each
message is read with one `struct` call at the offsets the first message of its length had
(checked against the attribute headers found there), so a dump costs a few µs per entry
(docs/performance.md, "Connections in flight").
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pyproxy.core.conntrack import IPS_DST_NAT, TCP_CONNTRACK_ESTABLISHED
from pyproxy.core.model import IPFamily
from pyproxy.kernel.nlelements import (
    HEADER,
    NLA_F_NESTED,
    NLMSG_DONE,
    NLMSG_ERROR,
    attribute,
    attributes,
    netlink_socket,
)

# include/uapi/linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h: the one home of ctnetlink's
# numbers (kernel/ctevents.py reads its events with them too)
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_UPDATE, NFNLGRP_CONNTRACK_DESTROY = 1, 2, 3
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_PROTOINFO, CTA_ID = 1, 2, 3, 4, 12
CTA_FILTER, CTA_STATUS_MASK = 25, 26
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE = 1, 1
CTA_FILTER_ORIG_FLAGS, CTA_FILTER_REPLY_FLAGS = 1, 2
CTA_FILTER_FLAG_PROTO_NUM = 1 << 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLM_F_DUMP_INTR = 0x10
_AF = {IPFamily.IPv4: socket.AF_INET, IPFamily.IPv6: socket.AF_INET6}
_RECV_SIZE = 1 << 17
_U32 = struct.Struct(">I")

Flow = tuple[str, int, str, int]
"""(original destination, its port, reply source, its port): a frontend and who answers."""


class ConntrackDumpError(OSError):
    """The kernel refused the dump (no permission, no ctnetlink)."""


@dataclass
class FlowCounts:
    """One dump's TCP entries per flow: [established, in any other state]."""

    flows: dict[Flow, list[int]] = field(default_factory=dict)
    entries: int = 0  # TCP entries decoded (every one the kernel sent that was TCP)
    seconds: float = 0.0
    filtered: bool = True  # the kernel applied the filters (a kernel too old did not)


def dump_request(family: IPFamily, seq: int, filtered: bool = True) -> bytes:
    """A dump of the family's entries; `filtered`: only TCP ones that were DNATed."""
    body = struct.pack("=BBH", _AF[family], 0, 0)
    if filtered:
        proto = attribute(CTA_TUPLE_PROTO | NLA_F_NESTED,
                          attribute(CTA_PROTO_NUM, bytes((socket.IPPROTO_TCP,))))
        body += (attribute(CTA_TUPLE_ORIG | NLA_F_NESTED, proto)
                 + attribute(CTA_FILTER | NLA_F_NESTED,
                             attribute(CTA_FILTER_ORIG_FLAGS,
                                       struct.pack("=I", CTA_FILTER_FLAG_PROTO_NUM))
                             + attribute(CTA_FILTER_REPLY_FLAGS, struct.pack("=I", 0)))
                 + attribute(CTA_STATUS, _U32.pack(IPS_DST_NAT))
                 + attribute(CTA_STATUS_MASK, _U32.pack(IPS_DST_NAT)))
    kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET
    return HEADER.pack(HEADER.size + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


# ---------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True, slots=True)
class _Decoded:
    """Where one message's five values sit (offsets from the message's start), with the
    attribute header each one had; None where the message had no such attribute."""

    dst: int
    dport: int
    src: int
    sport: int
    state: int
    proto: int
    address_size: int


_ADDRESSES = ((CTA_TUPLE_ORIG, CTA_IP_V4_DST), (CTA_TUPLE_ORIG, CTA_IP_V6_DST),
              (CTA_TUPLE_REPLY, CTA_IP_V4_SRC), (CTA_TUPLE_REPLY, CTA_IP_V6_SRC))


def _nested(data: bytes, start: int, end: int, kind: int) -> tuple[int, int] | None:
    return next(((a, b) for k, a, b in attributes(data, start, end) if k == kind), None)


def _decode(data: bytes, start: int, end: int) -> _Decoded | None:
    """The generic decoding of one message (attributes from `start`): None for an entry
    that is not a complete TCP one."""
    found: dict[str, int] = {}
    size = 0
    for kind, a, b in attributes(data, start, end):
        if kind in (CTA_TUPLE_ORIG, CTA_TUPLE_REPLY):
            ip, proto = _nested(data, a, b, CTA_TUPLE_IP), _nested(data, a, b, CTA_TUPLE_PROTO)
            if ip is None or proto is None:
                return None
            for k, x, y in attributes(data, *ip):
                if (kind, k) in _ADDRESSES:
                    found["dst" if kind == CTA_TUPLE_ORIG else "src"], size = x, y - x
            for k, x, _ in attributes(data, *proto):
                if kind == CTA_TUPLE_ORIG and k == CTA_PROTO_NUM:
                    found["proto"] = x
                elif kind == CTA_TUPLE_ORIG and k == CTA_PROTO_DST_PORT:
                    found["dport"] = x
                elif kind == CTA_TUPLE_REPLY and k == CTA_PROTO_SRC_PORT:
                    found["sport"] = x
        elif kind == CTA_PROTOINFO:
            tcp = _nested(data, a, b, CTA_PROTOINFO_TCP)
            state = None if tcp is None else _nested(data, *tcp, CTA_PROTOINFO_TCP_STATE)
            if state is not None:
                found["state"] = state[0]
    if len(found) < 6 or data[found["proto"]] != socket.IPPROTO_TCP or size not in (4, 16):
        return None
    return _Decoded(found["dst"], found["dport"], found["src"], found["sport"],
                    found["state"], found["proto"], size)


class _Layout:
    """One `struct` read of a message laid out as the first message of its length was: each
    value preceded by its attribute header, which the read returns too and `matches`
    compares (a message of the same length laid out otherwise is decoded generically)."""

    __slots__ = ("heads", "reader")

    def __init__(self, data: bytes, start: int, decoded: _Decoded) -> None:
        widths = {decoded.proto: "B", decoded.dst: f"{decoded.address_size}s",
                  decoded.dport: "2s", decoded.src: f"{decoded.address_size}s",
                  decoded.sport: "2s", decoded.state: "B"}
        # the kernel's order (ctnetlink_fill_info): the original tuple's address, then its
        # protocol and ports, the reply tuple's, the protocol's state
        order = [decoded.dst, decoded.proto, decoded.dport, decoded.src, decoded.sport,
                 decoded.state]
        if order != sorted(order):
            raise ValueError("attributes out of the usual order")
        fmt, at = "=", start
        heads = []
        for offset in order:
            fmt += f"{offset - 4 - at}x4s{widths[offset]}"
            at = offset + struct.calcsize(widths[offset])
            heads.append(data[offset - 4:offset])
        self.reader = struct.Struct(fmt)
        self.heads = tuple(heads)


def _values(data: bytes, start: int, layout: _Layout) -> tuple[Any, ...] | None:
    v = layout.reader.unpack_from(data, start)
    if (v[0], v[2], v[4], v[6], v[8], v[10]) != layout.heads:
        return None
    return v


@dataclass
class DumpParser:
    """Decodes the datagrams of one conntrack dump into per-flow counts (pure)."""

    counts: FlowCounts = field(default_factory=FlowCounts)
    done: bool = False
    interrupted: bool = False
    _layouts: dict[int, _Layout] = field(default_factory=dict)
    _raw: dict[tuple[bytes, bytes, bytes, bytes], list[int]] = field(default_factory=dict)

    def feed(self, data: bytes) -> None:
        offset, size = 0, len(data)
        raw, layouts = self._raw, self._layouts
        unpack = HEADER.unpack_from
        entries = 0
        while offset + HEADER.size <= size and not self.done:
            length, kind, flags, _, _ = unpack(data, offset)
            if length < HEADER.size:
                raise ConntrackDumpError(errno.EPROTO, "truncated netlink message")
            if kind == NLMSG_DONE:
                self.done = True
                break
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, offset + HEADER.size)
                if code:
                    raise ConntrackDumpError(-code, f"conntrack dump: {errno.errorcode.get(-code)}")
                offset += (length + 3) & ~3
                continue
            if flags & NLM_F_DUMP_INTR:
                self.interrupted = True
            layout = layouts.get(length)
            v = _values(data, offset, layout) if layout is not None else None
            if v is None:
                v = self._slow(data, offset, length)
            # v: (head, value) × (orig dst, protocol, orig dport, reply src, reply sport, state)
            if v is not None and v[3] == 6:  # IPPROTO_TCP
                entries += 1
                key = (v[1], v[5], v[7], v[9])
                tally = raw.get(key)
                if tally is None:
                    tally = raw[key] = [0, 0]
                tally[v[11] != TCP_CONNTRACK_ESTABLISHED] += 1
            offset += (length + 3) & ~3
        self.counts.entries += entries

    def _slow(self, data: bytes, offset: int, length: int) -> tuple[Any, ...] | None:
        # nlmsghdr, then nfgenmsg (4 bytes), then the attributes
        decoded = _decode(data, offset + HEADER.size + 4, offset + length)
        if decoded is None:
            return None
        try:
            layout = _Layout(data, offset, decoded)
        except ValueError:
            return None
        self._layouts.setdefault(length, layout)
        return _values(data, offset, layout)

    def result(self) -> FlowCounts:
        flows = self.counts.flows
        for (dst, dport, src, sport), tally in self._raw.items():
            af = socket.AF_INET if len(dst) == 4 else socket.AF_INET6
            flow = (socket.inet_ntop(af, dst), int.from_bytes(dport, "big"),
                    socket.inet_ntop(af, src), int.from_bytes(sport, "big"))
            flows[flow] = tally
        return self.counts


def _datagrams(sock: socket.socket) -> Iterator[bytes]:
    while True:
        yield sock.recv(_RECV_SIZE)


_DUMP_ATTEMPTS = 3


def dump_flows(sock: socket.socket, family: IPFamily, seq: int = 1) -> FlowCounts:
    """The family's DNATed TCP entries, counted per flow. A dump the table's changes
    interrupted (NLM_F_DUMP_INTR: an entry moved between hash buckets meanwhile) is taken
    again, at most three times; the last is kept, off by the few entries that moved."""
    started = time.perf_counter()
    filtered = True
    parser = DumpParser()
    for attempt in range(_DUMP_ATTEMPTS):
        parser = DumpParser()
        sock.send(dump_request(family, seq + attempt, filtered))
        try:
            for data in _datagrams(sock):
                parser.feed(data)
                if parser.done:
                    break
        except ConntrackDumpError as err:
            if not filtered or err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            filtered = False  # a kernel before 5.19 refuses the status filter: dump all
            continue
        if not parser.interrupted:
            break
    counts = parser.result()
    counts.filtered = filtered
    counts.seconds = time.perf_counter() - started
    return counts


@dataclass
class KernelFlows:
    """The dump through a socket of its own per read (`sockets`: tests bind it to a network
    namespace)."""

    sockets: Callable[[], socket.socket] = netlink_socket

    def read(self, family: IPFamily) -> FlowCounts:
        with contextlib.closing(self.sockets()) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
            return dump_flows(sock, family)

