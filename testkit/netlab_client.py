#!/usr/bin/env python3
"""Batch client for the netlab test fixture (see testkit/netlab.py).

Run inside a network namespace, it makes COUNT attempts against ADDR:PORT (TCP, UDP or SCTP) and
prints one JSON object per attempt, in attempt order::

    {"ok": true, "reply": "NAME SRC_IP SRC_PORT", "local": ["10.0.0.2", 40000], "at": [T0, T1]}
    {"ok": false, "error": "refused", "local": [...], "at": [T0, T1]}

"at" is when the attempt started and ended (wall clock, seconds since the epoch: the same in
every namespace), so a failure can be placed against a fault's window.

error is one of:
- "refused":     TCP RST, or ICMP port-unreachable (TCP and connected UDP both see ECONNREFUSED).
                 This is what a plain nft ``reject`` (or ``reject with tcp reset``) produces.
- "unreachable": any other ICMP destination-unreachable (host/net unreachable, no route,
                 administratively prohibited), or no local route at all.
- "reset":       the connection was accepted and then reset/closed before the answer arrived.
- "timeout":     nothing came back within --timeout (packets dropped somewhere).
- "other:...":   anything else, with the errno name or exception text; e.g. "other:EPERM" when
                 the client's own namespace drops the packet in its output path.

--timeout bounds a whole attempt (connect plus answer). ICMP errors are reported as soon as they
arrive (IP_RECVERR, see stream_connect), so "timeout" really means silence.

One process handles the whole batch so that hundreds of attempts cost one interpreter start-up.
--parallel runs attempts concurrently (threads), which keeps batches against dropped traffic fast;
with a fixed --sport attempts are always sequential since they share one 5-tuple. Without one,
no two UDP attempts of a batch use the same source port: each is a flow of its own.

Only the standard library is used.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Any

# Not exported by Python's socket module; values fixed by the Linux ABI.
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
IPV6_RECVERR = getattr(socket, "IPV6_RECVERR", 25)

ERRNO_NAMES = {
    errno.ECONNREFUSED: "refused",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.EACCES: "unreachable",  # ICMPv6 administratively prohibited (IPv4's is EHOSTUNREACH)
    errno.ECONNRESET: "reset",
    errno.EPIPE: "reset",
    errno.ETIMEDOUT: "timeout",
}


def classify(exc: BaseException) -> str:
    """Map an exception from connect/send/recv onto the small error vocabulary above."""
    if isinstance(exc, TimeoutError) and getattr(exc, "errno", None) in (None, errno.ETIMEDOUT):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno in ERRNO_NAMES:
        return ERRNO_NAMES[exc.errno]
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"other:{errno.errorcode.get(exc.errno, str(exc.errno))}"
    return f"other:{type(exc).__name__}:{exc}"


def os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def family_of(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


class FreshPorts:
    """Source ports this batch's UDP attempts have used, so that none is used twice.

    An unbound UDP socket gets a random ephemeral port, and two attempts of one batch can draw
    the same one (40 attempts: about 3 %). The second then rides the first one's conntrack
    entry: not a new flow, and pinned to the first one's endpoint. A test counting new
    connections per endpoint saw 79 of 80 (CI at 83d0aec).
    """

    def __init__(self) -> None:
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def claim(self, port: int) -> bool:
        with self._lock:
            if port in self._used:
                return False
            self._used.add(port)
            return True


FRESH_PORTS = FreshPorts()


def bind_fresh_port(sock_factory: Any, address: str) -> socket.socket:
    """A socket bound to `address` on an ephemeral port no earlier attempt of the batch used
    (the sockets that drew a used one are closed unsent)."""
    for _ in range(1000):
        sock: socket.socket = sock_factory()
        sock.bind((address, 0))
        if FRESH_PORTS.claim(sock.getsockname()[1]):
            return sock
        sock.close()
    raise OSError(errno.EADDRNOTAVAIL, "no unused ephemeral port in 1000 draws")


def make_socket(args: argparse.Namespace) -> socket.socket:
    kind, number = {
        "tcp": (socket.SOCK_STREAM, 0),
        "udp": (socket.SOCK_DGRAM, 0),
        "sctp": (socket.SOCK_STREAM, socket.IPPROTO_SCTP),
    }[args.proto]
    family = family_of(args.addr)
    default_src = "::" if family == socket.AF_INET6 else "0.0.0.0"
    if args.proto == "udp" and args.sport is None:
        sock = bind_fresh_port(lambda: socket.socket(family, kind, number),
                               args.src or default_src)
    else:
        sock = socket.socket(family, kind, number)
    # RECVERR queues every ICMP error for the socket (see stream_connect) and makes UDP report
    # "soft" ones too (host/net unreachable), which Linux otherwise ignores on UDP sockets.
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVERR, 1)
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
    if args.sport is not None or (args.src is not None and args.proto != "udp"):
        # SO_REUSEADDR lets consecutive attempts reuse a fixed source port (the previous socket
        # of this batch may still be closing).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.src or default_src, args.sport or 0))
    return sock


def queued_icmp_errno(sock: socket.socket) -> int:
    """errno of an ICMP error waiting in the socket's error queue (RECVERR), or 0."""
    try:
        _data, ancdata, _flags, _addr = sock.recvmsg(1, 512, socket.MSG_ERRQUEUE)
    except (BlockingIOError, InterruptedError):
        return 0
    for _level, _kind, data in ancdata:
        if len(data) >= 4:  # struct sock_extended_err starts with u32 ee_errno
            return int(struct.unpack("I", data[:4])[0])
    return 0


def stream_connect(sock: socket.socket, addr: tuple[str, int], deadline: float) -> None:
    """Non-blocking connect that also notices ICMP errors which the kernel keeps "soft".

    An ICMP error arriving while connect() still holds the socket lock only becomes a soft
    error (counted as TcpExtLockDroppedIcmps) and connect() keeps waiting for the SYN
    retransmit. Between namespaces on one host the ICMP comes back that fast: measured on
    IPv6 a rejected TCP connect took ~1 s instead of a few ms. With RECVERR the error is still
    queued, and poll() reports POLLERR, so it is picked up at once.
    """
    sock.setblocking(False)
    code = sock.connect_ex(addr)
    if code not in (0, errno.EINPROGRESS):
        raise os_error(code)
    poller = select.poll()
    poller.register(sock, select.POLLOUT)  # POLLERR/POLLHUP are always reported
    # The socket is looked at once more when the deadline has passed (a poll of 0 ms) before
    # the attempt counts as silence: a thread of a parallel batch that got the CPU back only
    # after its deadline (a loaded 2-core machine, five threads on one GIL) used to report
    # "timeout" for a RST queued long before, without polling at all (a side-by-side flow
    # once saw ('refused', 'timeout') where every attempt was refused).
    while True:
        remaining = deadline - time.monotonic()
        events = sum(ev for _fd, ev in poller.poll(max(0.0, remaining) * 1000))
        if events:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or queued_icmp_errno(sock)
            if code:
                raise os_error(code)
            if events & select.POLLOUT:
                return
        if remaining <= 0:
            raise TimeoutError("connect timed out")


def read_reply(sock: socket.socket, deadline: float) -> str:
    """Read the backend's line and wait for its FIN (it closes right after answering).

    Reading to EOF makes the server do the active close: the client socket never enters
    TIME_WAIT, so a fixed --sport can be reused by the next attempt at once (otherwise connect()
    fails with EADDRNOTAVAIL now and then).
    """
    data = b""
    while len(data) < 4096:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            if b"\n" in data:
                break  # got the answer; a peer that does not close is fine too
            raise
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def exchange(sock: socket.socket, args: argparse.Namespace, deadline: float) -> str:
    """Connect, then get the backend's answer (UDP: send a datagram first)."""
    if args.proto == "udp":
        # A connected UDP socket is what makes ICMP errors show up on recv (ECONNREFUSED for
        # port-unreachable); an unconnected one never sees them.
        sock.settimeout(args.timeout)
        sock.connect((args.addr, args.port))
        sock.send(args.payload.encode())
        return sock.recv(4096).decode(errors="replace").strip()
    stream_connect(sock, (args.addr, args.port), deadline)
    return read_reply(sock, deadline)


def attempt(args: argparse.Namespace) -> dict[str, Any]:
    """One connection (stream) or one request/response exchange (UDP), within --timeout."""
    result: dict[str, Any] = {"ok": False}
    started = time.time()
    try:
        return _attempt(args, result)
    finally:
        result["at"] = [started, time.time()]


def _attempt(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + args.timeout
    try:
        with make_socket(args) as sock:
            try:
                reply = exchange(sock, args, deadline)
            finally:
                with contextlib.suppress(OSError):
                    result["local"] = list(sock.getsockname()[:2])
    except OSError as exc:  # includes TimeoutError
        result["error"] = classify(exc)
        return result
    if not reply:
        result["error"] = "reset"  # stream closed without an answer
        return result
    result.update(ok=True, reply=reply)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("addr")
    parser.add_argument("port", type=int)
    parser.add_argument("--proto", choices=("tcp", "udp", "sctp"), default="tcp")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds per attempt")
    parser.add_argument("--src", default=None, help="bind this source address")
    parser.add_argument("--sport", type=int, default=None, help="bind this source port")
    parser.add_argument("--parallel", type=int, default=1, help="attempts in flight")
    parser.add_argument("--payload", default="netlab\n", help="UDP datagram content")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    workers = 1 if args.sport else max(1, min(args.parallel, args.count))
    if workers == 1:
        for _ in range(args.count):
            print(json.dumps(attempt(args)), flush=True)
        return 0
    from concurrent.futures import ThreadPoolExecutor  # imported here: slow, rarely needed

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for res in pool.map(lambda _i: attempt(args), range(args.count)):
            print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
