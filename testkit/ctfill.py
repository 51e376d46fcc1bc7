"""Conntrack entries made without packets, for measuring what reading them costs: TCP entries
DNATed as a Service's rules would (CTA_NAT_DST, so the kernel sets the reply tuple and the
DST_NAT status itself), written over raw ctnetlink in batches, inside a test namespace."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import struct
from collections.abc import Iterable

from pyproxy.kernel.nlconntrack import (
    CTA_IP_V4_DST,
    CTA_IP_V4_SRC,
    CTA_IP_V6_DST,
    CTA_IP_V6_SRC,
    CTA_PROTO_DST_PORT,
    CTA_PROTO_NUM,
    CTA_PROTO_SRC_PORT,
    CTA_PROTOINFO,
    CTA_PROTOINFO_TCP,
    CTA_PROTOINFO_TCP_STATE,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_PROTO,
    CTA_TUPLE_REPLY,
    NFNL_SUBSYS_CTNETLINK,
)
from pyproxy.kernel.nlelements import HEADER, NLA_F_NESTED, NLMSG_ERROR, attribute, netlink_socket
from testkit.inproc import call_in_netns

IPCTNL_MSG_CT_NEW = 0
CTA_TIMEOUT, CTA_NAT_DST = 7, 13
CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP, CTA_NAT_PROTO = 1, 2, 3
CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP = 4, 5
CTA_PROTONAT_PORT_MIN, CTA_PROTONAT_PORT_MAX = 1, 2
NLM_F_REQUEST, NLM_F_CREATE, NLM_F_EXCL = 0x1, 0x400, 0x200
TCP_STATES = {"SYN_SENT": 1, "ESTABLISHED": 3, "FIN_WAIT": 4, "TIME_WAIT": 7}
BATCH = 200


def _nest(kind: int, payload: bytes) -> bytes:
    return attribute(kind | NLA_F_NESTED, payload)


def _tuple(kind: int, src: str, dst: str, sport: int, dport: int) -> bytes:
    v6 = ":" in src
    s_attr, d_attr = (CTA_IP_V6_SRC, CTA_IP_V6_DST) if v6 else (CTA_IP_V4_SRC, CTA_IP_V4_DST)
    ip = (attribute(s_attr, ipaddress.ip_address(src).packed)
          + attribute(d_attr, ipaddress.ip_address(dst).packed))
    proto = (attribute(CTA_PROTO_NUM, bytes((socket.IPPROTO_TCP,)))
             + attribute(CTA_PROTO_SRC_PORT, struct.pack(">H", sport))
             + attribute(CTA_PROTO_DST_PORT, struct.pack(">H", dport)))
    return _nest(kind, _nest(CTA_TUPLE_IP, ip) + _nest(CTA_TUPLE_PROTO, proto))


def entry_message(client: str, sport: int, frontend: str, port: int, endpoint: str,
                  endpoint_port: int, state: str = "ESTABLISHED", seq: int = 0,
                  dumped: bool = False) -> bytes:
    """One NEW message: client:sport → frontend:port, DNATed to endpoint:endpoint_port (the
    kernel sets the reply tuple from the NAT attribute). `dumped`: the entry as a dump
    sends it, its reply tuple from the endpoint, no NAT attribute."""
    v6 = ":" in client
    lo, hi = (CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP) if v6 else (CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP)
    packed = ipaddress.ip_address(endpoint).packed
    nat = _nest(CTA_NAT_DST, attribute(lo, packed) + attribute(hi, packed) + _nest(
        CTA_NAT_PROTO, attribute(CTA_PROTONAT_PORT_MIN, struct.pack(">H", endpoint_port))
        + attribute(CTA_PROTONAT_PORT_MAX, struct.pack(">H", endpoint_port))))
    body = (struct.pack("=BBH", socket.AF_INET6 if v6 else socket.AF_INET, 0, 0)
            + _tuple(CTA_TUPLE_ORIG, client, frontend, sport, port)
            + (_tuple(CTA_TUPLE_REPLY, endpoint, client, endpoint_port, sport) if dumped
               else _tuple(CTA_TUPLE_REPLY, frontend, client, port, sport) + nat)
            + attribute(CTA_TIMEOUT, struct.pack(">I", 3600))
            + _nest(CTA_PROTOINFO, _nest(CTA_PROTOINFO_TCP, attribute(
                CTA_PROTOINFO_TCP_STATE, bytes((TCP_STATES[state],))))))
    kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW
    flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL
    return HEADER.pack(HEADER.size + len(body), kind, flags, seq, 0) + body


Spec = tuple[str, int, str, int, str, int, str]  # client, sport, frontend, port, ep, ep port, state


def insert(netns: str, entries: Iterable[Spec]) -> int:
    """Write the entries into the namespace's conntrack table; returns how many the kernel
    took (an error per refused one comes back; the rest are silent)."""
    sock = call_in_netns(netns, netlink_socket)
    sent = refused = 0
    with contextlib.closing(sock):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        sock.settimeout(0.2)
        batch: list[bytes] = []
        for spec in entries:
            batch.append(entry_message(*spec, seq=sent))
            sent += 1
            if len(batch) == BATCH:
                sock.send(b"".join(batch))
                batch = []
                refused += _errors(sock)
        if batch:
            sock.send(b"".join(batch))
        refused += _errors(sock)
    return sent - refused


def _errors(sock: socket.socket) -> int:
    refused = 0
    sock.setblocking(False)
    try:
        while True:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return refused
            offset = 0
            while offset + HEADER.size <= len(data):
                length, kind, _, _, _ = HEADER.unpack_from(data, offset)
                if kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + HEADER.size)
                    if code and -code != errno.EEXIST:
                        raise OSError(-code, f"conntrack insert: {errno.errorcode.get(-code)}")
                    refused += bool(code)
                offset += (length + 3) & ~3
    finally:
        sock.settimeout(0.2)


def flows(count: int, frontends: list[tuple[str, int]], endpoints: int,
          state: str = "ESTABLISHED", client_base: str = "192.168.0.0") -> Iterable[Spec]:
    """`count` entries spread over the frontends, each frontend's over `endpoints`
    endpoints (10.244.F.E:8080), from distinct clients and ports."""
    base = int(ipaddress.ip_address(client_base))
    for i in range(count):
        frontend, port = frontends[i % len(frontends)]
        f = i % len(frontends)
        e = (i // len(frontends)) % endpoints
        client = str(ipaddress.ip_address(base + 1 + i // 50000))
        n = f * endpoints + e
        yield (client, 10000 + i % 50000, frontend, port, f"10.244.{n // 250}.{n % 250 + 2}",
               8080, state)
