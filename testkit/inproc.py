"""Work inside a lab's namespace without a process: a thread enters the namespace (setns(2)
changes only the calling thread's), opens a socket there and leaves; the socket stays in that
namespace whoever uses it afterwards. So one process can serve every pod and drive every
client of a lab (the demo does), a libnftables context can talk to a namespace's kernel
(testkit/nftns.py), and nothing of that can outlive the process.

- `call_in_netns`: run a function on a thread inside a namespace;
- `HttpBackend`: answers each TCP connection with an HTTP response naming the backend (so
  `curl` works too), served by threads of this process (`Lab.serve_http`);
- `http_probe`: N concurrent HTTP requests from a namespace, counted by the name in the
  answer (`Lab.probe_http`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def call_in_netns(netns: str, fn: Callable[[], T], timeout: float = 30.0) -> T:
    """Run fn on a short-lived thread that entered the namespace: sockets it creates (a
    libnftables context, a listening server) stay in that namespace afterwards. Threads that
    fn starts inherit the namespace; the caller's own threads never leave theirs."""
    made: dict[str, Any] = {}

    def enter_and_call() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            made["result"] = fn()
        except BaseException as err:  # reported on the calling thread
            made["error"] = err

    thread = threading.Thread(target=enter_and_call, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" in made:
        raise made["error"]
    if "result" not in made:
        raise TimeoutError(f"call in namespace {netns} still running after {timeout}s")
    return made["result"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Backends


def listen_in(netns: str, ip: str, port: int, backlog: int) -> socket.socket:
    """A TCP listener on ip:port inside `netns`. Its accept times out every 0.2 s, so the
    thread serving it notices a stop."""

    def listen() -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(backlog)
        sock.settimeout(0.2)
        return sock

    return call_in_netns(netns, listen)


class HttpBackend:
    """Answers each TCP connection on ip:port inside a namespace with an HTTP response whose
    body starts with `answer`, until stop() (threads of this process; no child process)."""

    def __init__(self, netns: str, ip: str, port: int, answer: str) -> None:
        self.answer = answer
        self._stop = threading.Event()

        self._listener = listen_in(netns, ip, port, backlog=256)
        threading.Thread(target=self._accept_loop, name=f"backend-{netns}-{answer}",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _accept_loop(self) -> None:
        with self._listener:
            while not self._stop.is_set():
                try:
                    conn, peer = self._listener.accept()
                except (TimeoutError, BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError:
                    return
                threading.Thread(target=self._reply, args=(conn, peer), daemon=True).start()

    def _reply(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        with conn:
            conn.settimeout(2.0)
            request = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
            body = f"{self.answer} (client {peer[0]}:{peer[1]})\n".encode()
            head = (f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            with contextlib.suppress(OSError):
                conn.sendall(head + body)


# --------------------------------------------------------------------------------------------
# Clients

ERRORS = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable",
          errno.ENETUNREACH: "unreachable", errno.ECONNRESET: "reset", errno.EPIPE: "reset"}
REQUEST = b"GET / HTTP/1.0\r\nHost: testkit\r\n\r\n"


def http_probe(netns: str, ip: str, port: int, count: int,
               timeout: float = 1.0) -> Counter[str]:
    """`count` concurrent HTTP requests from namespace `netns` to ip:port, counted by the
    first word of the answer (an `HttpBackend`'s name); failures count as "no answer"
    (silently dropped), "refused", "unreachable", "reset", ..."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET

    def run() -> Counter[str]:
        sel = selectors.DefaultSelector()
        results: Counter[str] = Counter()
        pending: dict[socket.socket, bytearray] = {}
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((ip, port))
            if code not in (0, errno.EINPROGRESS):
                results[ERRORS.get(code, errno.errorcode.get(code, str(code)))] += 1
                sock.close()
                continue
            pending[sock] = bytearray()
            sel.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout
        # One look at the sockets after the deadline too (a select of 0 s): a thread that
        # gets the GIL back only after it (the backends' threads share it) must still count
        # what already came back, as testkit/netlab_client.py's stream_connect does.
        while pending:
            left = deadline - time.monotonic()
            for key, _ in sel.select(max(0.0, left)):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                outcome = _step(sel, conn, pending[conn])
                if outcome is not None:
                    results[outcome] += 1
                    sel.unregister(conn)
                    conn.close()
                    del pending[conn]
            if left <= 0:
                break
        for sock in pending:
            results["no answer"] += 1
            sock.close()
        sel.close()
        return results

    return call_in_netns(netns, run)


def _step(sel: selectors.BaseSelector, sock: socket.socket, buf: bytearray) -> str | None:
    """Advance one client connection; returns its outcome once known."""
    try:
        if sel.get_key(sock).events & selectors.EVENT_WRITE:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                return ERRORS.get(code, errno.errorcode.get(code, str(code)))
            sock.sendall(REQUEST)
            sel.modify(sock, selectors.EVENT_READ)
            return None
        chunk = sock.recv(4096)
    except OSError as exc:
        return ERRORS.get(exc.errno or 0, f"error {exc.errno}")
    if chunk:
        buf += chunk
        return None
    _head, _, body = bytes(buf).partition(b"\r\n\r\n")
    return body.split(maxsplit=1)[0].decode() if body.strip() else "empty answer"
