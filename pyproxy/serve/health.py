"""/healthz and /livez with kube-proxy's semantics, and the per-service health-check node
ports of `externalTrafficPolicy: Local` LoadBalancers. Cloud load balancers act on these
answers, so they follow upstream to the letter (reference §5).

The state is pure (`ProxyHealth`, `ServiceHealth`); the HTTP servers are a thin shell.
"""

from __future__ import annotations

import json
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog

from pyproxy.core.convert_endpoints import node_is_eligible
from pyproxy.core.model import IPFamily, Node, ServiceKey

log = structlog.get_logger(__name__)


def _rfc3339(ts: float) -> str:
    """As Go marshals a time.Time (RFC 3339 with nanoseconds, trailing zeros trimmed)."""
    when = datetime.fromtimestamp(ts, UTC)
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    if when.microsecond:
        text += f".{when.microsecond:06d}".rstrip("0")
    return text + "Z"


@dataclass
class FamilyHealth:
    last_updated: float = 0.0  # wall clock
    oldest_queued: float | None = None  # monotonic


@dataclass
class ProxyHealth:
    """Per-family freshness of the programmed rules, whether the kernel holds what was
    committed, and whether this node should get traffic. A family is unhealthy when an update
    has been queued (or a sync has been failing) for longer than `timeout` (2 × syncPeriod)
    without being programmed; no pending update is healthy. The data plane is unhealthy
    while `damage` gives a reason (someone else changed our tables, not repaired yet): that
    fails /healthz and the health-check node ports, so that load balancers stop sending
    traffic to a node whose rules are broken, but not /livez, which is about the process.
    Unhealthy answers carry the reason in the JSON body (`reason`)."""

    families: tuple[IPFamily, ...]
    timeout: float = 60.0
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    node: Node | None = None
    node_known: bool = False
    damage: Callable[[], str | None] = lambda: None
    sync_error: str | None = None  # while syncs fail: the last one's error
    # The last time our table was replaced whole (wall clock) and why: a node that went
    # without rules for a while says so in both answers' bodies after it recovered.
    replaced: tuple[float, str] | None = None
    _state: dict[IPFamily, FamilyHealth] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        now = self.wall_clock()
        for family in self.families:
            self._state[family] = FamilyHealth(last_updated=now)

    def add_family(self, family: IPFamily) -> None:
        """A family programmed from now on (the Node object gained an address of it)."""
        with self._lock:
            if family not in self._state:
                self._state[family] = FamilyHealth(last_updated=self.wall_clock())
                self.families = (*self.families, family)

    def queued(self) -> None:
        now = self.clock()
        with self._lock:
            for state in self._state.values():
                if state.oldest_queued is None:
                    state.oldest_queued = now

    def sync_failed(self, error: str) -> None:
        """A sync failed: the kernel does not hold what should be programmed. That counts as
        a queued update, so /healthz fails after `timeout` of failures even when nothing new
        was queued (a repair of a damaged table that the kernel keeps refusing)."""
        self.queued()
        with self._lock:
            self.sync_error = error.strip().splitlines()[0] if error.strip() else error

    def table_replaced(self, reason: str) -> None:
        with self._lock:
            self.replaced = (self.wall_clock(), reason)

    def updated(self, families: Iterable[IPFamily] | None = None) -> None:
        now = self.wall_clock()
        with self._lock:
            for family in families or self._state:
                self._state[family] = FamilyHealth(last_updated=now)
            self.sync_error = None

    def set_node(self, node: Node | None) -> None:
        with self._lock:
            self.node = node
            self.node_known = True

    def family_healthy(self, family: IPFamily) -> bool:
        state = self._state[family]
        return state.oldest_queued is None or self.clock() - state.oldest_queued < self.timeout

    def healthy(self) -> bool:
        """Rules fresh and the kernel holding them (the health-check node ports' view)."""
        return self.problem() is None

    def problem(self, data_plane: bool = True) -> str | None:
        """Why the proxy is unhealthy, or None. `data_plane`: also when the kernel does not
        hold what was committed (not for /livez)."""
        damage = self.damage() if data_plane else None
        with self._lock:
            stale = self._stale()
            error = self.sync_error
        reasons = [damage] if damage else []
        if stale:
            failing = f"; the last sync failed: {error}" if error else ""
            reasons.append(f"rules not updated for {', '.join(stale)} (more than "
                           f"{self.timeout:g} s){failing}")
        return "; ".join(reasons) or None

    def _stale(self) -> list[str]:
        """The unhealthy families, with how long their oldest update has waited."""
        now = self.clock()
        return [f"{f} ({now - s.oldest_queued:.1f} s)"
                for f, s in sorted(self._state.items(), key=lambda item: str(item[0]))
                if s.oldest_queued is not None and not self.family_healthy(f)]

    def node_eligible(self) -> bool:
        with self._lock:
            return node_is_eligible(self.node)

    def response(self, with_node: bool) -> tuple[int, dict[str, Any]]:
        """(status code, body) for /healthz (with_node) or /livez (without the node and
        without the data plane: it is about the process)."""
        now = self.wall_clock()
        problem = self.problem(data_plane=with_node)
        with self._lock:
            # Go marshals the per-family map with its keys sorted.
            statuses = {str(f): (self.family_healthy(f), self._state[f].last_updated)
                        for f in sorted(self._state, key=str)}
            eligible = node_is_eligible(self.node)
            replaced = self.replaced
        healthy = problem is None
        ok = healthy and (eligible or not with_node)
        last = max((ts for _, ts in statuses.values()), default=now)
        body: dict[str, Any] = {
            # As upstream: a 200 answer reports "now" as lastUpdated (compatibility).
            "lastUpdated": _rfc3339(now if ok else last),
            "currentTime": _rfc3339(now),
        }
        if with_node:
            body["nodeEligible"] = eligible
        body["healthy"] = healthy
        body["status"] = {name: {"lastUpdated": _rfc3339(ts), "healthy": fam_ok}
                          for name, (fam_ok, ts) in statuses.items()}
        if problem is not None:
            body["reason"] = problem  # pyproxy's: not in kube-proxy's answer
        if replaced is not None:  # pyproxy's too
            body["tableReplaced"] = {"time": _rfc3339(replaced[0]), "reason": replaced[1]}
        return (200 if ok else 503), body


@dataclass
class ServiceHealth:
    """Local READY endpoint counts of the services that have a healthCheckNodePort."""

    ports: dict[ServiceKey, int] = field(default_factory=dict)  # service → port
    local_endpoints: dict[ServiceKey, int] = field(default_factory=dict)

    def update(self, ports: Mapping[ServiceKey, int], counts: Mapping[ServiceKey, int]) -> None:
        self.ports = dict(ports)
        self.local_endpoints = {key: counts.get(key, 0) for key in ports}

    def response(self, service: ServiceKey, proxy_healthy: bool,
                 reason: str | None = None) -> tuple[int, dict[str, Any]]:
        """`reason`: why the proxy is unhealthy (added to the body as `reason`)."""
        count = self.local_endpoints.get(service, 0)
        body: dict[str, Any] = {
            "service": {"namespace": service.namespace, "name": service.name},
            "localEndpoints": count,
            "serviceProxyHealthy": proxy_healthy,
        }
        if not proxy_healthy and reason:
            body["reason"] = reason
        # 200 only with a ready local endpoint AND a healthy proxy (kubernetes#115825).
        return (200 if count > 0 and proxy_healthy else 503), body


# ---------------------------------------------------------------------------------------------
# HTTP shells


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 family: int = socket.AF_INET, v6only: bool = False) -> None:
        self.address_family = family
        self.v6only = v6only
        # serve_forever() wakes on this at once: the stdlib loop polls every 0.5 s, so each
        # listener closed would hold up the sync closing it by up to half a second. (Made
        # first: a failed bind calls server_close(), which closes it.)
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._serving = False
        self._stopped = threading.Event()
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._serving = True
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake_r, selectors.EVENT_READ)
                while not self._stopping:
                    for key, _ in selector.select():
                        if key.fileobj is self and not self._stopping:
                            self._accept()
        finally:
            self._stopped.set()

    def _accept(self) -> None:
        # socketserver's _handle_request_noblock(), through the public hooks.
        try:
            request, client_address = self.get_request()
        except OSError:
            return
        if not self.verify_request(request, client_address):
            self.shutdown_request(request)
            return
        try:
            self.process_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
            self.shutdown_request(request)

    def shutdown(self) -> None:
        """Stop serve_forever() (running in another thread, or not started yet)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # already closed: nothing is serving
            return
        if self._serving:
            self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.v6only:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # Not HTTPServer.server_bind: its socket.getfqdn() is a reverse DNS lookup, which
        # would hold up the sync that opens a health-check node port.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    """Answers like Go's net/http: no Server header (no version disclosed), a plain-text
    "404 page not found", and no access log (probes come every few seconds)."""

    # A thread per connection: one that never sends its request must not keep it forever.
    timeout = 30.0

    def send_response(self, code: int, message: str | None = None) -> None:
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def not_found(self) -> None:
        data = b"404 page not found\n"
        self.send_response(404)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, fmt: str, *args: Any) -> None:
        pass


def _send(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any],
          extra: Mapping[str, str] | None = None, pretty: bool = False) -> None:
    # Compact as Go's json.Marshal; pretty: upstream's tab-indented service health body.
    data = (json.dumps(body, indent="\t") if pretty
            else json.dumps(body, separators=(",", ":"))).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("X-Content-Type-Options", "nosniff")
    for key, value in (extra or {}).items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


def parse_host_port(text: str) -> tuple[str, int, int]:
    """"0.0.0.0:10256", "[::]:10256" → (host, port, address family)."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return host, int(port), family


class HealthServer:
    """/healthz and /livez (default 0.0.0.0:10256). Counters are reported through `count`."""

    def __init__(self, address: str, health: ProxyHealth,
                 count: Callable[[str, int], None] = lambda path, code: None) -> None:
        host, port, family = parse_host_port(address)
        health_ref, count_ref = health, count

        class Handler(_Handler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/healthz", "/livez"):
                    # Only our two paths; nothing else is served or leaked.
                    self.not_found()
                    return
                code, body = health_ref.response(with_node=path == "/healthz")
                count_ref(path, code)
                _send(self, code, body)

            do_HEAD = do_GET

        self.server = _Server((host, port), Handler, family)
        self.thread = threading.Thread(target=self.server.serve_forever, name="healthz",
                                       daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ServiceHealthServers:
    """One listener per healthCheckNodePort, opened and closed as services come and go, on
    each of the given addresses (per family, so dual-stack nodes don't collide:
    kubernetes#114702). A port that cannot be bound is reported and retried, not fatal."""

    def __init__(self, health: ServiceHealth, proxy: ProxyHealth,
                 addresses: Iterable[str] = ("0.0.0.0",)) -> None:
        self.health = health
        self.proxy = proxy
        self.addresses = tuple(addresses)
        self.servers: dict[tuple[ServiceKey, int], list[_Server]] = {}
        self.failures: dict[ServiceKey, str] = {}

    def sync(self) -> None:
        wanted = {(key, port) for key, port in self.health.ports.items()}
        for gone in set(self.servers) - wanted:
            _close(self.servers.pop(gone))
        self.failures = {}
        for key, port in wanted - set(self.servers):
            opened: list[_Server] = []
            try:
                for addr in self.addresses:
                    opened.append(self._listen(key, addr, port))
            except OSError as err:
                # Close what did open, as upstream does, so that the retry at the next sync
                # does not trip over our own half-open listeners.
                _close(opened)
                self.failures[key] = f"cannot listen on {port}: {err.strerror}"
                log.warning("health_check_node_port_not_served", service=str(key), port=port,
                            error=err.strerror)
            else:
                self.servers[(key, port)] = opened

    def _listen(self, key: ServiceKey, address: str, port: int) -> _Server:
        health, proxy = self.health, self.proxy

        class Handler(_Handler):
            def do_GET(self) -> None:  # any path, as upstream
                problem = proxy.problem()
                code, body = health.response(key, problem is None, problem)
                _send(self, code, body, {
                    "X-Load-Balancing-Endpoint-Weight": str(body["localEndpoints"])},
                    pretty=True)

            do_HEAD = do_GET

        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        # v6only: the IPv4 listener has its own socket on the same port.
        server = _Server((address, port), Handler, family, v6only=True)
        threading.Thread(target=server.serve_forever, name=f"hcnp-{port}", daemon=True).start()
        return server

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Listen on other addresses (the node's IPs changed): every listener is closed and
        reopened there by the next `sync`."""
        addresses = tuple(addresses)
        if addresses != self.addresses:
            self.stop()
            self.addresses = addresses

    def stop(self) -> None:
        for servers in self.servers.values():
            _close(servers)
        self.servers.clear()


def _close(servers: Iterable[_Server]) -> None:
    for server in servers:
        server.shutdown()
        server.server_close()
