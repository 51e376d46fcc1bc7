#!/usr/bin/env python3
"""Echo-who-am-I backend for the netlab test fixture (see testkit/netlab.py).

Started inside a network namespace (``ip netns exec NS python netlab_backend.py ...``). It listens
on the given TCP, UDP and (if the kernel supports it) SCTP ports, IPv4 and IPv6, and answers every
connection or datagram with exactly one line::

    NAME SRC_IP SRC_PORT

where NAME is its own name and SRC_IP/SRC_PORT is the peer address *as this backend saw it*. Tests
use the name to see which endpoint was chosen, and the peer address to tell a masqueraded
connection (the node's address) from one that preserved the client IP.

Protocol with the parent (the Lab):
- After every socket is bound and listening it prints one line ``READY <json>`` on stdout, the JSON
  listing the ports actually served per protocol (SCTP ports are dropped, with a note on stderr,
  when the kernel has no SCTP). Nothing else is ever written to stdout.
- It exits when stdin reaches EOF (the parent closed the pipe or died), on SIGTERM, or on SIGINT.
  The stdin watch is what keeps a SIGKILLed test run from leaking backends.

Only the standard library is used so any python3 works.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import json
import os
import selectors
import signal
import socket
import struct
import sys
from collections.abc import Callable

# Python 3.11 does not export IP_PKTINFO on Linux; the value is fixed by the kernel ABI.
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
ANCILLARY_SPACE = 256

Handler = Callable[[socket.socket], None]


def peer_text(addr: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """'IP PORT' for a peer, with IPv4-mapped IPv6 addresses shown as plain IPv4."""
    ip = ipaddress.ip_address(addr[0].split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip} {addr[1]}"


def listen_sockets(family: int, kind: int, proto: int, port: int) -> socket.socket:
    """A socket bound to the wildcard address of one family.

    One socket per family (IPV6_V6ONLY=1 on the IPv6 one) keeps peer addresses free of
    ::ffff: prefixes and lets UDP use the per-family PKTINFO option below.
    """
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        sock.listen(512)
    else:
        # Ask for the destination address of each datagram, so the reply leaves from the very
        # address the client sent to. Otherwise a multi-address host (e.g. a node answering on
        # a NodePort) could reply from another address and the client's connected UDP socket
        # would silently discard the answer.
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
    sock.setblocking(False)
    return sock


def stream_handler(name: str) -> Handler:
    """Accept one connection, send the line, close (the server closes first: no client TIME_WAIT,
    so clients can reuse a fixed source port immediately)."""

    def handle(listener: socket.socket) -> None:
        try:
            conn, addr = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        with conn:
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                conn.sendall(f"{name} {peer_text(addr)}\n".encode())

    return handle


Ancillary = list[tuple[int, int, bytes]]


def reply_pktinfo(family: int, ancdata: Ancillary) -> Ancillary:
    """Turn the received PKTINFO into the ancillary data that pins the reply's source address."""
    v6_info = (socket.IPPROTO_IPV6, socket.IPV6_PKTINFO)
    for level, kind, data in ancdata:
        if family == socket.AF_INET6 and (level, kind) == v6_info:
            # struct in6_pktinfo { in6_addr addr; int ifindex; }: keep addr, let routing pick dev.
            return [(level, kind, data[:16] + struct.pack("i", 0))]
        if family == socket.AF_INET and (level, kind) == (socket.IPPROTO_IP, IP_PKTINFO):
            # struct in_pktinfo { int ifindex; in_addr spec_dst; in_addr addr; }: the source of
            # the reply is spec_dst; take the datagram's destination (addr) for it.
            dst = data[8:12]
            return [(level, kind, struct.pack("i", 0) + dst + dst)]
    return []


def datagram_handler(name: str) -> Handler:
    """Answer every datagram (whatever it contains) with the line."""

    def handle(sock: socket.socket) -> None:
        for _ in range(64):  # drain a burst, bounded so other sockets are served too
            try:
                _data, ancdata, _flags, addr = sock.recvmsg(2048, ANCILLARY_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. a queued ICMP error from an earlier reply: nothing to answer
            line = f"{name} {peer_text(addr)}\n".encode()
            with contextlib.suppress(OSError):
                sock.sendmsg([line], reply_pktinfo(sock.family, ancdata), 0, addr)

    return handle


def open_all(sel: selectors.BaseSelector, name: str, proto: str, ports: list[int]) -> list[int]:
    """Open IPv4+IPv6 listeners for each port; returns the ports served (SCTP may be absent)."""
    kinds = {
        "tcp": (socket.SOCK_STREAM, 0),
        "udp": (socket.SOCK_DGRAM, 0),
        "sctp": (socket.SOCK_STREAM, socket.IPPROTO_SCTP),
    }
    kind, number = kinds[proto]
    handler = datagram_handler(name) if kind == socket.SOCK_DGRAM else stream_handler(name)
    served: list[int] = []
    for port in ports:
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock = listen_sockets(family, kind, number, port)
            except OSError as exc:
                if proto == "sctp" and exc.errno in (errno.EPROTONOSUPPORT, errno.ESOCKTNOSUPPORT):
                    print(f"netlab_backend: SCTP unavailable ({exc}); skipping", file=sys.stderr)
                    return served
                raise
            sel.register(sock, selectors.EVENT_READ, handler)
        served.append(port)
    return served


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--name", required=True, help="name reported in every answer")
    parser.add_argument("--tcp", type=int, action="append", default=[], help="TCP port (repeat)")
    parser.add_argument("--udp", type=int, action="append", default=[], help="UDP port (repeat)")
    parser.add_argument("--sctp", type=int, action="append", default=[], help="SCTP port")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    stop = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    sel = selectors.DefaultSelector()
    served = {
        proto: open_all(sel, args.name, proto, getattr(args, proto))
        for proto in ("tcp", "udp", "sctp")
    }
    sel.register(sys.stdin, selectors.EVENT_READ, None)
    print("READY " + json.dumps(served), flush=True)

    while not stop:
        for key, _ in sel.select(timeout=0.5):
            if key.data is None:  # stdin: EOF means the parent is gone (or wants us gone)
                if not os.read(sys.stdin.fileno(), 4096):
                    stop = True
                continue
            key.data(key.fileobj)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
