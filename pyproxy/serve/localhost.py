"""The userspace proxy for localhost NodePorts (KEP-6032; what to listen for is
`pyproxy/core/localhost.py`): a TCP listener on 127.0.0.1 or ::1 per NodePort, reconciled
after every sync, that copies each accepted connection to a connection of its own to an
endpoint.

As kube-proxy's `localnodeportproxy`: an endpoint picked at random (ClientIP affinity: the
pinned one while connections keep coming within the timeout, a sliding window); 5 s to reach
it, else the client's connection is closed; a listener that cannot bind (a host process
holds the port) is logged and counted, the others work, and it is tried again at the next
sync; a listener removed (Service deleted, no endpoint left) closes its connections.

Threads, not an event loop: a listener's accept loop, and per connection one thread per
direction. Localhost NodePorts carry little (an image registry for the node's container
runtime is the use case the KEP names), and blocking copies keep this small.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from pyproxy.cluster.cache import Checkout
from pyproxy.core.localhost import NodePortSpec, nodeport_specs
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import LocalhostNodePorts
from pyproxy.kernel.nlsets import rule_packets
from pyproxy.render.objects import PROTOCOLS, localhost_nodeport_reject_chain
from pyproxy.serve.metrics import Metrics
from pyproxy.sync.node import NodeProxier, SyncedOnly, SyncRecord

log = structlog.get_logger(__name__)

DIAL_TIMEOUT = 5.0  # kube-proxy's dialTimeout
_CHUNK = 65536


@dataclass
class _Pin:
    endpoint: tuple[str, int] | None = None
    last_used: float = 0.0


@dataclass
class _Listener:
    """One NodePort's listening socket, its endpoints and its open connections."""

    spec: NodePortSpec
    sock: socket.socket
    clock: Callable[[], float]
    pick: Callable[[Sequence[tuple[str, int]]], tuple[str, int]]
    lock: threading.Lock = field(default_factory=threading.Lock)
    pin: _Pin = field(default_factory=_Pin)
    conns: set[socket.socket] = field(default_factory=set)
    closed: bool = False

    def update(self, spec: NodePortSpec) -> None:
        with self.lock:
            if spec.affinity_timeout != self.spec.affinity_timeout:
                self.pin = _Pin()  # the affinity changed: no stale pin
            self.spec = spec

    def choose(self) -> tuple[str, int]:
        """An endpoint; with affinity the pinned one while it is used within the timeout
        and still an endpoint (every connection comes from loopback: one pin for all)."""
        with self.lock:
            endpoints, timeout = self.spec.endpoints, self.spec.affinity_timeout
            now = self.clock()
            pinned = self.pin.endpoint
            if (timeout and pinned is not None and pinned in endpoints
                    and now - self.pin.last_used <= timeout):
                self.pin.last_used = now
                return pinned
            endpoint = self.pick(endpoints)
            if timeout:
                self.pin = _Pin(endpoint, now)
            return endpoint

    def track(self, conn: socket.socket) -> bool:
        with self.lock:
            if self.closed:
                return False
            self.conns.add(conn)
            return True

    def untrack(self, conn: socket.socket) -> None:
        with self.lock:
            self.conns.discard(conn)

    def close(self) -> None:
        """Stop accepting and cut every connection (their copies then end)."""
        with self.lock:
            self.closed = True
            conns, self.conns = list(self.conns), set()
        # shutdown() wakes an accept() blocked in another thread; close() alone does not.
        for sock in (self.sock, *conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class LocalhostListeners:
    """The listeners of one IP family. `sync` is called after every sync with the wanted
    specs; `on_listeners(count)` and `on_failure()` feed the metrics."""

    def __init__(self, family: IPFamily, *,
                 on_listeners: Callable[[int], None] = lambda _n: None,
                 on_failure: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 pick: Callable[[Sequence[tuple[str, int]]], tuple[str, int]] = random.choice,
                 dial_timeout: float = DIAL_TIMEOUT) -> None:
        self.family = family
        self.address = "127.0.0.1" if family is IPFamily.IPv4 else "::1"
        self.on_listeners, self.on_failure = on_listeners, on_failure
        self.clock, self.pick, self.dial_timeout = clock, pick, dial_timeout
        self.lock = threading.Lock()
        self.active: dict[int, _Listener] = {}

    @property
    def ports(self) -> list[int]:
        with self.lock:
            return sorted(self.active)

    def sync(self, specs: Sequence[NodePortSpec]) -> None:
        """Listeners for exactly these NodePorts: new ones opened, gone ones closed, the
        others given their new endpoints (open connections stay where they are)."""
        wanted = {spec.node_port: spec for spec in specs if spec.endpoints}
        with self.lock:
            for port in [p for p in self.active if p not in wanted]:
                log.info("localhost_nodeport_closed", ip_family=str(self.family), port=port)
                self.active.pop(port).close()
            for port, spec in wanted.items():
                if port in self.active:
                    self.active[port].update(spec)
                    continue
                listener = self._open(spec)
                if listener is not None:
                    self.active[port] = listener
            count = len(self.active)
        self.on_listeners(count)

    def shutdown(self) -> None:
        with self.lock:
            listeners, self.active = list(self.active.values()), {}
        for listener in listeners:
            listener.close()
        self.on_listeners(0)

    def _open(self, spec: NodePortSpec) -> _Listener | None:
        sock = socket.socket(socket.AF_INET if self.family is IPFamily.IPv4 else socket.AF_INET6,
                             socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's net.Listen
            sock.bind((self.address, spec.node_port))
            sock.listen(128)
        except OSError as err:
            sock.close()
            # Retried at the next sync, as kube-proxy does (it tries again for every spec
            # without a listener).
            log.error("localhost_nodeport_listen_failed", ip_family=str(self.family),
                      port=spec.node_port, service=str(spec.name), error=str(err))
            self.on_failure()
            return None
        listener = _Listener(spec, sock, self.clock, self.pick)
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name=f"localhost-nodeport-{spec.node_port}").start()
        log.info("localhost_nodeport_listening", ip_family=str(self.family),
                 port=spec.node_port, service=str(spec.name), endpoints=len(spec.endpoints))
        return listener

    def _accept(self, listener: _Listener) -> None:
        while True:
            try:
                conn, _ = listener.sock.accept()
            except OSError:
                if listener.closed:
                    return
                continue  # e.g. out of descriptors: kube-proxy retries at once too
            threading.Thread(target=self._serve, args=(listener, conn), daemon=True).start()

    def _serve(self, listener: _Listener, client: socket.socket) -> None:
        endpoint = listener.choose()
        try:
            backend = socket.create_connection(endpoint, timeout=self.dial_timeout)
        except OSError as err:
            log.debug("localhost_nodeport_dial_failed", port=listener.spec.node_port,
                      endpoint=f"{endpoint[0]}:{endpoint[1]}", error=str(err))
            client.close()
            return
        backend.settimeout(None)
        if not (listener.track(client) and listener.track(backend)):
            client.close()
            backend.close()
            return
        other = threading.Thread(target=_copy, args=(backend, client), daemon=True)
        other.start()
        _copy(client, backend)
        other.join()
        for sock in (client, backend):
            listener.untrack(sock)
            sock.close()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """src → dst until src ends, then end dst's sending side (half-close, as io.Copy and
    CloseWrite upstream)."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@dataclass
class LocalhostProxies(SyncedOnly):
    """Localhost NodePorts (KEP-6032): after every sync, under the sync lock, each family
    whose configuration turns the userspace proxy on gets listeners for the TCP NodePorts of
    the selections in force; a family that has it off has none."""

    metrics: Metrics
    listeners: dict[IPFamily, LocalhostListeners] = field(default_factory=dict)

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        self.sync(proxier)

    def sync(self, proxier: NodeProxier) -> None:
        for family_proxier in proxier.proxiers:
            family = family_proxier.family
            mode = family_proxier.config.localhost_nodeports(family)
            current = self.listeners.get(family)
            if mode is not LocalhostNodePorts.PROXY:
                if current is not None:
                    self.listeners.pop(family).shutdown()
                continue
            if current is None:
                on_listeners, on_failure = self.metrics.localhost_listener_callbacks(str(family))
                current = self.listeners[family] = LocalhostListeners(
                    family, on_listeners=on_listeners, on_failure=on_failure)
            current.sync(nodeport_specs(family_proxier.selections.values()))

    def shutdown(self) -> None:
        for listeners in self.listeners.values():
            listeners.shutdown()
        self.listeners.clear()


def rejected_reader(proxier: NodeProxier,
                    packets: Callable[[str, str], int | None] = rule_packets,
                    ) -> Callable[[], dict[tuple[str, str], int]]:
    """What the localhost NodePort reject chains of every family counted, per (family,
    protocol as kube-proxy spells it: TCP, UDP, SCTP)."""
    def read() -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for family_proxier in list(proxier.proxiers):
            family = family_proxier.family
            for proto in PROTOCOLS:
                found = packets(family.nft_family, localhost_nodeport_reject_chain(proto))
                if found is not None:
                    out[(str(family), proto.upper())] = found
        return out
    return read
