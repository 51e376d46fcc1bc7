"""Starting what the daemon serves: /healthz and /livez, the metrics, the debug socket; and
telling systemd how the daemon is doing."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import structlog

from pyproxy.cluster.apiserver import ApiAddressCheck
from pyproxy.cluster.sources import ApiSource, SnapshotSource
from pyproxy.config import ConfigError, ProxyConfig
from pyproxy.kernel.basechains import CoexistenceCheck
from pyproxy.serve.debug import DebugServer
from pyproxy.serve.health import HealthServer, ProxyHealth
from pyproxy.serve.live import ConnectionViews, handlers
from pyproxy.serve.metrics import Metrics
from pyproxy.sync.node import NodeProxier
from pyproxy.sync.runner import BoundedFrequencyRunner

log = structlog.get_logger(__name__)

SERVER_RETRY_SECONDS = 5.0  # kube-proxy retries a health/metrics bind this often


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as err:
            log.warning("sd_notify_failed", error=str(err))


class MetricsServer:
    """Prometheus' exposition of `metrics` on `address`."""

    def __init__(self, address: str, metrics: Metrics) -> None:
        from prometheus_client import start_http_server

        from pyproxy.serve.health import parse_host_port

        host, port, _ = parse_host_port(address)
        self.server, self.thread = start_http_server(port, host, registry=metrics.registry)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (from the main thread only: elsewhere, nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, frame: object) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def start_servers(config: ProxyConfig, health: ProxyHealth, metrics: Metrics,
                  stop: threading.Event) -> list[HealthServer | MetricsServer]:
    """The healthz and metrics servers. A bind failure is fatal only with
    bindAddressHardFail (ConfigError); otherwise it is logged and retried every 5 s, as
    kube-proxy does."""
    servers: list[HealthServer | MetricsServer] = []

    def healthz() -> HealthServer:
        assert config.healthz_bind_address
        server = HealthServer(config.healthz_bind_address, health, metrics.count_health)
        server.start()
        return server

    def metrics_server() -> MetricsServer:
        assert config.metrics_bind_address
        return MetricsServer(config.metrics_bind_address, metrics)

    wanted: list[tuple[str, str | None, Callable[[], HealthServer | MetricsServer]]] = [
        ("healthz", config.healthz_bind_address, healthz),
        ("metrics", config.metrics_bind_address, metrics_server),
    ]
    for name, address, start in wanted:
        if not address:
            continue
        try:
            servers.append(start())
        except OSError as err:
            if config.bind_address_hard_fail:
                raise ConfigError(
                    f"bindAddressHardFail (--bind-address-hard-fail): {err}") from None
            log.error("server_not_started_retrying", server=name, address=address,
                      error=str(err))
            threading.Thread(target=_retry_server, args=(name, start, servers, stop),
                             name=f"retry-{name}", daemon=True).start()
    return servers


def _retry_server(name: str, start: Callable[[], HealthServer | MetricsServer],
                  servers: list[HealthServer | MetricsServer], stop: threading.Event) -> None:
    while not stop.wait(SERVER_RETRY_SECONDS):
        try:
            servers.append(start())
        except OSError:
            continue
        log.info("server_started", server=name)
        return


def start_debug(config: ProxyConfig, proxier: NodeProxier, health: ProxyHealth,
                runner: BoundedFrequencyRunner, source: ApiSource | SnapshotSource,
                connections: ConnectionViews | None = None,
                address_check: ApiAddressCheck | None = None,
                coexistence: CoexistenceCheck | None = None) -> DebugServer | None:
    """The debug socket (`pyproxy status`, `explain`, `trace` …), if configured; one that
    cannot be served is logged, not fatal."""
    if not config.debug_socket:
        return None

    def source_status() -> Any:
        if isinstance(source, SnapshotSource):
            return {"snapshot": source.path, "loads": source.loads, "errors": source.errors,
                    "lastError": source.last_error}
        status: dict[str, Any] = source.report()
        if address_check is not None:
            status["apiServer"] = {"host": address_check.host,
                                   "problem": address_check.problem}
        return status

    try:
        server = DebugServer(config.debug_socket,
                             handlers(proxier, health, runner, source_status, connections,
                                      (lambda: coexistence.findings) if coexistence
                                      else lambda: ()))
    except OSError as err:
        log.error("debug_socket_not_served", path=config.debug_socket, error=str(err))
        return None
    server.start()
    return server
