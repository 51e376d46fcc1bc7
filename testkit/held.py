"""Long-lived TCP connections on real packets: a server inside a namespace that accepts and
holds every connection (counting them per server), and clients that open connections from
another namespace and keep them open until closed. Threads and sockets of the test process
(testkit/inproc.py); nothing outlives `close()`."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.kernel.nlconntrack import KernelFlows
from pyproxy.kernel.nlelements import netlink_socket
from pyproxy.sync.inflight import InFlightReader
from pyproxy.sync.least import LeastConnections
from pyproxy.sync.proxier import FamilyProxier
from testkit.inproc import call_in_netns, listen_in
from testkit.netlab import Cluster
from testkit.nftns import libnft_in


class HoldingServer:
    """Accepts on ip:port inside `netns` and holds each connection open, answering each line
    received with its name (so a client knows where it landed), until `close()`; `delay`
    seconds before each answer (a slow endpoint)."""

    def __init__(self, netns: str, ip: str, port: int, name: str, delay: float = 0.0) -> None:
        self.name, self.delay = name, delay
        self.accepted = 0
        self.open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

        self._listener = listen_in(netns, ip, port, backlog=1024)
        threading.Thread(target=self._accept, daemon=True, name=f"hold-{name}").start()

    def _accept(self) -> None:
        with self._listener:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except (TimeoutError, BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                with self._lock:
                    self.accepted += 1
                    self.open.append(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        while not self._stop.is_set():
            try:
                data = conn.recv(256)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if self.delay:
                time.sleep(self.delay)
            with contextlib.suppress(OSError):
                conn.sendall(f"{self.name}\n".encode())

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for conn in self.open:
                with contextlib.suppress(OSError):
                    conn.close()
            self.open.clear()


@dataclass
class HeldClients:
    """Connections opened from `netns` to ip:port, each asked once where it landed."""

    netns: str
    ip: str
    port: int
    where: dict[str, list[socket.socket]] = field(default_factory=dict)

    def open(self, count: int, timeout: float = 5.0) -> dict[str, int]:
        """Open `count` more connections; returns how many landed on each server name."""
        family = socket.AF_INET6 if ":" in self.ip else socket.AF_INET

        def make() -> list[socket.socket]:
            return [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]

        landed: dict[str, int] = {}
        for sock in call_in_netns(self.netns, make):
            sock.settimeout(timeout)
            sock.connect((self.ip, self.port))
            sock.sendall(b"where\n")
            name = sock.recv(256).decode().strip()
            self.where.setdefault(name, []).append(sock)
            landed[name] = landed.get(name, 0) + 1
        return landed

    def counts(self) -> dict[str, int]:
        return {name: len(socks) for name, socks in self.where.items() if socks}

    def close(self, name: str | None = None) -> None:
        """Close the connections to one server (all: None)."""
        for key in [name] if name is not None else list(self.where):
            for sock in self.where.pop(key, []):
                with contextlib.suppress(OSError):
                    sock.close()


def least_feedback(c: Cluster, interval: float,
                   ) -> tuple[LeastConnections, FamilyProxier, InFlightReader]:
    """Least-connection balancing on `c`'s node in this process, IPv4: the feedback, the
    proxier it adjusts (writing to the node's kernel) and the conntrack reader it is fed
    from. `duty` is lifted: a test or bench reads whenever it steps."""
    config = NodeConfig("node-a", node_ips=(c.node_ip4,), cluster_cidrs=(c.cluster_cidr4,))
    least = LeastConnections(interval=interval)
    proxier = FamilyProxier(IPFamily.IPv4, config, libnft_in(c.node.full), least.adjust)
    netns = c.node.full
    reader = InFlightReader([IPFamily.IPv4],
                            KernelFlows(lambda: call_in_netns(netns, netlink_socket)).read,
                            lambda: [(ps, [*(ps.selection.cluster or ())])
                                     for ps in proxier.selections.values()], duty=1e9)
    return least, proxier, reader
