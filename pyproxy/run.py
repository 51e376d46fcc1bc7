"""`pyproxy run`: wiring the daemon together (the outermost shell).

sources (API watches | snapshot file) → NodeProxier (cache + tracking) → runner → nftables,
with health, metrics and conntrack cleanup listening to every sync.
"""

from __future__ import annotations

import os
import platform
import signal
import threading
from dataclasses import dataclass
from typing import Any

import structlog

from pyproxy.cluster import apiconnection
from pyproxy.cluster.apirequest import observe_requests
from pyproxy.cluster.apiserver import ApiAddressCheck, client_for, server_host
from pyproxy.cluster.cache import ClusterCache
from pyproxy.cluster.events import record_start
from pyproxy.cluster.sources import ApiSource, SnapshotSource
from pyproxy.config import ConfigError, ProxyConfig
from pyproxy.core.model import (
    NodeConfig,
)
from pyproxy.kernel.basechains import CoexistenceCheck
from pyproxy.kernel.host import apply_host_settings, log_outcome, warn_if_kernel_below_supported
from pyproxy.kernel.libnftables import OWN_SOCKETS
from pyproxy.kernel.nftevents import NftMonitor
from pyproxy.kernel.nlsets import KernelCounters
from pyproxy.kernel.privileges import require_privileges
from pyproxy.logs import setup_logging
from pyproxy.serve.connections import REFRESH_INTERVAL, ConnectionCounters, Kernel
from pyproxy.serve.health import ProxyHealth, ServiceHealth, ServiceHealthServers
from pyproxy.serve.live import counting_context
from pyproxy.serve.localhost import LocalhostProxies, rejected_reader
from pyproxy.serve.metrics import Metrics, RejectedPackets
from pyproxy.serve.reporting import HealthCheckNodePorts, SyncReporting, hcnp_addresses
from pyproxy.serve.servers import sd_notify, start_debug, start_servers
from pyproxy.sync.conntrack import ConntrackCleanup, ConntrackWorker
from pyproxy.sync.node import AfterSync, FirstSync, NodeProxier, SyncObserver
from pyproxy.sync.proxier import FamilyProxier
from pyproxy.sync.repairs import Repairs
from pyproxy.sync.runner import BoundedFrequencyRunner
from pyproxy.sync.settings import NodeTracker, families_of, sync_timing

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Daemon:
    """The daemon's object graph, finished: nothing in it is assigned or appended to after
    `build_daemon` returns. Nothing runs yet either (but the conntrack worker's thread)."""

    cache: ClusterCache
    proxier: NodeProxier
    runner: BoundedFrequencyRunner
    health: ProxyHealth
    metrics: Metrics
    health_check_node_ports: HealthCheckNodePorts
    localhost: LocalhostProxies
    connections: ConnectionCounters
    coexistence: CoexistenceCheck
    source: ApiSource | SnapshotSource
    address_check: ApiAddressCheck | None


def build_daemon(config: ProxyConfig, node_name: str, interface_ips: tuple[str, ...],
                 node_config: NodeConfig, api_client: Any, stop: threading.Event) -> Daemon:
    """Every part built once, each given what it needs when it is made; the observers of
    the proxier's syncs before it (each is told which proxier synced). One cycle is left,
    closed by a lambda over a part built further down: the proxier's syncs may start the
    API source's watch of every Node, and the source feeds the proxier."""
    families = families_of(node_config.node_ips)
    timing = sync_timing(config)
    metrics = Metrics()
    if api_client is not None:
        observe_requests(api_client, metrics)  # client-go's rest_client_* metrics
    service_health = ServiceHealth()
    cache = ClusterCache(node_name)
    # Someone else changing our tables: repaired at once, and /healthz fails until it is.
    repairs = Repairs()
    health = ProxyHealth(families, timeout=timing.health_timeout, damage=repairs.damage)
    localhost = LocalhostProxies(metrics)
    runner = BoundedFrequencyRunner("sync-proxy-rules", timing.min_interval,
                                    timing.retry_interval, timing.max_interval)
    address_check = None if config.snapshot else ApiAddressCheck(
        server_host(api_client), metrics.api_server_via_service.set,
        apiconnection.kubelet_cluster_ips(os.environ))
    reporting = SyncReporting(health, metrics)
    hcnp = HealthCheckNodePorts(service_health, ServiceHealthServers(
        service_health, health, hcnp_addresses(node_config.node_ips)), node_config.node_ips)
    conntrack = ConntrackWorker(reporting.conntrack_cleaned)
    conntrack.start()
    observers: list[SyncObserver] = [reporting, hcnp, ConntrackCleanup(conntrack),
                                     FirstSync(lambda: sd_notify("READY=1"))]
    if config.localhost_nodeports_gate:
        observers.append(localhost)
    if address_check is not None:
        check = address_check
        observers.append(AfterSync(lambda proxier: check(proxier.cache.state())))

    def watch_all_nodes(proxier: NodeProxier) -> None:
        if isinstance(source, ApiSource) and proxier.cache.uses_node_labels():
            source.watch_all_nodes()

    if not config.snapshot:
        observers.append(AfterSync(watch_all_nodes))
    proxier = NodeProxier(
        cache, [FamilyProxier(f, node_config) for f in families],
        full_sync_period=timing.full_sync_period, verify_period=timing.verify_period,
        reconfigure=NodeTracker(config, node_name, interface_ips, node_config,
                                lambda: cache.node),
        request_sync=runner.run, repairs=repairs, observers=observers,
        on_invalid=[lambda s: metrics.invalid_objects.labels(kind=s.kind).inc()],
        on_node_change=[health.set_node])
    if config.localhost_nodeports_gate:
        metrics.watch_localhost_nodeports(RejectedPackets(rejected_reader(proxier)))
    metrics.watch_selections(proxier.current_selections)
    counters = KernelCounters()
    connections = ConnectionCounters(families, lambda: counting_context(proxier),
                                     Kernel(counters.read, counters.delete))
    metrics.watch_connections(connections.totals)
    # Other tables' base chains that drop what we accept: checked at start and after every
    # change to another table's chains or rules.
    coexistence = CoexistenceCheck(
        tuple(families), lambda found: metrics.other_table_drops.set(len(found)))
    source: ApiSource | SnapshotSource = (
        SnapshotSource(config.snapshot, proxier, stop) if config.snapshot
        else ApiSource(api_client, proxier, node_name, stop,
                       service_cidrs=config.watches_service_cidrs,
                       content_type=config.content_type))
    if isinstance(source, ApiSource):
        metrics.watch_api(source.status)
    return Daemon(cache, proxier, runner, health, metrics, hcnp, localhost, connections,
                  coexistence, source, address_check)


def run_daemon(config: ProxyConfig, stop: threading.Event | None = None,
               api_client: Any = None, node_ips: tuple[str, ...] | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `stop`). The rules stay in place when it exits.

    Everything that can refuse to start comes first (the API connection and every file it
    names, the servers' ports under bindAddressHardFail) and raises ConfigError: nothing on
    the host (sysctls, oom_score_adj, rules) changes before the configuration is usable."""
    setup_logging(config.logging_format, config.verbosity)
    require_privileges()  # CAP_NET_ADMIN, or one clear error (kernel/privileges.py)
    if not config.snapshot and api_client is None:
        api_client = client_for(apiconnection.load(config), config)
    for warning in config.unapplied:
        log.warning("configuration", note=warning)
    stop = stop or threading.Event()
    node_name = config.node_name()
    if node_ips is None:
        from pyproxy.kernel.netlink import primary_addresses

        node_ips = primary_addresses()
    # Until the Node object is known (its initial list completes before the first sync), the
    # interfaces' addresses stand in for its IPs.
    node_config = config.node_config(node_name, node_ips)
    families = families_of(node_config.node_ips)
    for note in config.notes:
        log.info("configuration", note=note)
    log.info("starting", node=node_name, node_ips=list(node_config.node_ips),
             families=[str(f) for f in families],
             source="snapshot" if config.snapshot else "api")
    warn_if_kernel_below_supported(platform.release())

    daemon = build_daemon(config, node_name, tuple(node_ips), node_config, api_client, stop)
    proxier, runner, health, metrics = daemon.proxier, daemon.runner, daemon.health, daemon.metrics
    connections, coexistence, source = daemon.connections, daemon.coexistence, daemon.source
    address_check, localhost = daemon.address_check, daemon.localhost
    threading.Thread(target=connections.run_periodically, args=(stop, REFRESH_INTERVAL),
                     name="connection-counters", daemon=True).start()
    NftMonitor(OWN_SOCKETS, proxier.table_changed, proxier.events_lost,
               on_other_tables=coexistence.request).start(stop)
    coexistence.start(stop)

    try:
        servers = start_servers(config, health, metrics, stop)
    except OSError as err:
        raise ConfigError(f"bindAddressHardFail (--bind-address-hard-fail): {err}") from None
    # The checks are done: from here on pyproxy changes the host.
    for outcome in apply_host_settings(config):
        log_outcome(outcome)
    if address_check is not None:
        address_check(daemon.cache.state())  # what the environment tells, before any list
    source.start()
    if isinstance(source, ApiSource):
        record_start(source.api_client, node_name, stop)

    debug = start_debug(config, proxier, health, runner, source, connections, address_check,
                         coexistence)
    _install_signal_handlers(stop)
    runner.loop(proxier.sync, stop)
    log.info("stopping")
    sd_notify("STOPPING=1")
    for server in servers:
        server.stop()
    if debug is not None:
        debug.stop()
    daemon.health_check_node_ports.stop()
    localhost.shutdown()
    return 0


def _install_signal_handlers(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, frame: object) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
