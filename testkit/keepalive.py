"""Keep-alive connections through a Service on real packets, and a pod that goes silent:
what fast failure is measured with (tests/test_fast_failure_netns.py,
bench/bench_fast_failure.py).

`KeepAliveServer` answers every line on a connection with its pod's name, connection after
connection, from threads of the calling process (its listening socket made inside the pod's
namespace). `Held` is a client's connection kept open between requests. `silence` makes a
pod's network drop everything, as when its namespace is torn down: no FIN, no reset, no
answer. (Deleting the node's end of the pod's link would not do: the kernel then deletes the
entries masqueraded out of that link itself, nf_nat_masquerade's device event, which a node
whose pods' links carry no masquerading address never sees.)"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time

from testkit.inproc import call_in_netns
from testkit.netlab import Lab, Netns, Pod

TARGET_PORT = 8080
SILENCE = "silenced"


class KeepAliveServer:
    """Answers every line on a connection with the pod's name, connection after connection,
    from threads of this process (the listening socket made inside the pod's namespace)."""

    def __init__(self, pod: Pod, port: int = TARGET_PORT, name: str | None = None) -> None:
        self.name = name or pod.name
        self.port = port
        self.sock = call_in_netns(pod.ns.full, self._listen)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", self.port))
        sock.listen(16)
        return sock

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(64):
                conn.sendall(f"{self.name}\n".encode())

    def close(self) -> None:
        for sock in (self.sock, *self.conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class Held:
    """A client's keep-alive connection to (ip, port), made in the client's namespace."""

    def __init__(self, client: Netns, ip: str, port: int) -> None:
        self.sock = call_in_netns(client.full,
                                  lambda: socket.create_connection((ip, port), timeout=5))

    def ask(self, timeout: float = 5.0) -> tuple[str, float]:
        """(who answered, or reset / closed / timeout; seconds from the request)."""
        start = time.monotonic()
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(b"?\n")
            answer = self.sock.recv(64).decode().strip()
        except TimeoutError:
            return "timeout", time.monotonic() - start
        except OSError as err:
            if err.errno in (errno.ECONNRESET, errno.EPIPE):
                return "reset", time.monotonic() - start
            return os.strerror(err.errno or 0), time.monotonic() - start
        return answer or "closed", time.monotonic() - start

    def close(self) -> None:
        self.sock.close()


def silence(lab: Lab, pod: Pod) -> None:
    """Everything that reaches the pod is dropped before its sockets see it."""
    lab.nft(pod.ns, f"table inet {SILENCE} {{ chain in {{ type filter hook prerouting "
            "priority -400; policy drop; }; }")


def unsilence(lab: Lab, pod: Pod) -> None:
    lab.nft(pod.ns, f"delete table inet {SILENCE}")
