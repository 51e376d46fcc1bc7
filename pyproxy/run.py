"""`pyproxy run`: the daemon built part by part, then started (the outermost shell). Only wiring
lives here, each part in its stage's package (docs/architecture.md); `build_daemon` takes the
kernel and the clock, so tests build the daemon `pyproxy run` builds."""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from pyproxy.cluster import apiconnection
from pyproxy.cluster.apirequest import observe_requests
from pyproxy.cluster.apiserver import ApiAddressCheck, client_for, server_host
from pyproxy.cluster.cache import ClusterCache
from pyproxy.cluster.events import record_start
from pyproxy.cluster.sources import ApiSource, SnapshotSource
from pyproxy.config import ProxyConfig
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.kernel.basechains import CoexistenceCheck
from pyproxy.kernel.host import apply_host_settings, log_outcome, warn_if_kernel_below_supported
from pyproxy.kernel.libnftables import OWN_SOCKETS
from pyproxy.kernel.netlink import local_addresses, primary_addresses
from pyproxy.kernel.nft import Kernel
from pyproxy.kernel.nftevents import NftMonitor
from pyproxy.kernel.privileges import require_privileges
from pyproxy.logs import setup_logging
from pyproxy.serve import connections as conns
from pyproxy.serve import servers as serving
from pyproxy.serve.debug import DebugServer
from pyproxy.serve.health import HealthServer, ProxyHealth, ServiceHealth, ServiceHealthServers
from pyproxy.serve.live import ConnectionViews, connection_views
from pyproxy.serve.localhost import LocalhostProxies, rejected_reader
from pyproxy.serve.metrics import Metrics, RejectedPackets
from pyproxy.serve.reporting import HealthCheckNodePorts, SyncReporting
from pyproxy.sync.conntrack import ConntrackCleanup, ConntrackWorker
from pyproxy.sync.least import LeastConnections
from pyproxy.sync.node import AfterSync, FirstSync, NodeProxier, SyncObserver
from pyproxy.sync.outliers import OutlierEjection
from pyproxy.sync.proxier import FamilyProxier
from pyproxy.sync.repairs import Repairs
from pyproxy.sync.runner import MONOTONIC, BoundedFrequencyRunner, Clock
from pyproxy.sync.settings import LocalAddresses, NodeTracker, families_of, sync_timing

log = structlog.get_logger(__name__)


@dataclass
class _Running:
    """What `Daemon.start()` started that `stop()` ends."""

    servers: list[HealthServer | serving.MetricsServer] = field(default_factory=list)
    debug: DebugServer | None = None
    loop: threading.Thread | None = None
    error: BaseException | None = None  # what ended the sync loop, if not `stopping`


@dataclass(frozen=True)
class Daemon:
    """The daemon's object graph, built whole by `build_daemon`: no part is assigned after.
    What grows while it runs is state, not wiring: the proxier makes a family's table when
    the node gains an address of that family. Nothing runs until `start()`."""

    config: ProxyConfig
    stopping: threading.Event
    cache: ClusterCache
    proxier: NodeProxier
    runner: BoundedFrequencyRunner
    health: ProxyHealth
    metrics: Metrics
    health_check_node_ports: HealthCheckNodePorts
    localhost: LocalhostProxies
    conntrack: ConntrackWorker
    connections: ConnectionViews
    coexistence: CoexistenceCheck
    source: ApiSource | SnapshotSource
    address_check: ApiAddressCheck | None
    _running: _Running = field(default_factory=lambda: _Running())

    def start(self) -> None:
        """Start every part's threads, then the sync loop. ConfigError (bindAddressHardFail)
        before anything on the host changes."""
        stop = self.stopping
        self.conntrack.start()
        threading.Thread(target=self.connections.new.run_periodically,
                         args=(stop, conns.REFRESH_INTERVAL), name="connection-counters",
                         daemon=True).start()
        NftMonitor(OWN_SOCKETS, self.proxier.table_changed, self.proxier.events_lost,
                   on_other_tables=self.coexistence.request).start(stop)
        self.coexistence.start(stop)
        self._running.servers = serving.start_servers(self.config, self.health, self.metrics, stop)
        # The checks are done: from here on pyproxy changes the host.
        for outcome in apply_host_settings(self.config):
            log_outcome(outcome)
        if self.address_check is not None:
            self.address_check(self.cache.state())  # what the environment tells, before any list
        if isinstance(self.source, ApiSource):
            self.source.start(self.proxier)
            record_start(self.source.api_client, self.cache.node_name, stop)
        else:
            self.source.start()
        self._running.debug = serving.start_debug(
            self.config, self.proxier, self.health, self.runner, self.source, self.connections,
            self.address_check, self.coexistence)
        loop = self._running.loop = threading.Thread(target=self._loop, name="sync-proxy-rules",
                                                     daemon=True)
        loop.start()

    def _loop(self) -> None:
        try:
            self.runner.loop(self.proxier.sync, self.stopping)
        except BaseException as err:  # not a failed sync (the runner retries those)
            self._running.error = err
        finally:
            self.stopping.set()

    def wait(self) -> None:
        """Until the sync loop has ended (`stopping` set); what ended it otherwise is raised."""
        self.stopping.wait()  # interrupted by signals, as a thread's join may not be
        if self._running.loop is not None:
            self._running.loop.join()
        if self._running.error is not None:
            raise self._running.error

    def stop(self) -> None:
        """End the sync loop and close what is served. The rules stay in place."""
        self.stopping.set()
        self.wait()
        log.info("stopping")
        serving.sd_notify("STOPPING=1")
        for server in self._running.servers:  # with those a retry started since
            server.stop()
        if self._running.debug is not None:
            self._running.debug.stop()
        self.health_check_node_ports.stop()
        self.localhost.shutdown()


def build_daemon(config: ProxyConfig, *, interface_ips: tuple[str, ...],
                 kernel: Callable[[IPFamily], Kernel] | None = None,
                 local_addresses: Callable[[], tuple[str, ...]] | None = None,
                 clock: Clock = MONOTONIC, api_client: Any = None,
                 stop: threading.Event | None = None) -> Daemon:
    """Every part built once, each before the parts that need it and given them when made.
    `interface_ips` stand in for the Node's IPs until its object is known; `kernel`: what
    each family's table is written to (libnftables when None); `local_addresses`: reads the
    node's interface addresses (see `LocalAddresses`); `clock`: what the syncs and health
    are timed by (a fake one jumps); `api_client`: None only with a snapshot."""
    node_name = config.node_name()
    local_ips = LocalAddresses(local_addresses, config.sync_period, clock)
    node_config = config.node_config(node_name, interface_ips, (), local_ips())
    families = families_of(node_config.node_ips)
    log.info("starting", node=node_name, node_ips=list(node_config.node_ips),
             local_ips=list(local_ips.current or ()),
             families=[str(f) for f in families], source="snapshot" if config.snapshot else "api")
    timing = sync_timing(config)
    stop = stop or threading.Event()

    metrics = Metrics()
    if api_client is not None:
        observe_requests(api_client, metrics)  # client-go's rest_client_* metrics
    cache = ClusterCache(node_name)
    # Someone else changing our tables: repaired at once, and /healthz fails until it is.
    repairs = Repairs()
    health = ProxyHealth(families, timeout=timing.health_timeout, clock=clock,
                         damage=repairs.damage)
    runner = BoundedFrequencyRunner("sync-proxy-rules", timing.min_interval,
                                    timing.retry_interval, timing.max_interval, clock=clock)
    reporting = SyncReporting(health, metrics)
    service_health = ServiceHealth()
    listeners = ServiceHealthServers(service_health, health, node_config.health_check_addresses())
    hcnp = HealthCheckNodePorts(service_health, listeners, listeners.addresses)
    conntrack = ConntrackWorker(reporting.conntrack_cleaned)
    localhost = LocalhostProxies(metrics)
    address_check = None if config.snapshot else ApiAddressCheck(
        server_host(api_client), metrics.api_server_via_service.set,
        apiconnection.kubelet_cluster_ips(os.environ))
    api_source = None if config.snapshot else ApiSource(
        api_client, node_name, stop, service_cidrs=config.watches_service_cidrs,
        content_type=config.content_type)
    outliers = OutlierEjection.of(config, api_client, node_name, stop, metrics)  # ejection
    least = LeastConnections(config.least_connections_interval, outliers.adjust, stop)
    observers: list[SyncObserver] = [reporting, hcnp, least,
                                     ConntrackCleanup(conntrack, config.fast_failure), outliers,
                                     FirstSync(lambda: serving.sd_notify("READY=1")),
                                     *([localhost] if config.localhost_nodeports_gate else [])]
    if address_check is not None:
        check = address_check
        observers.append(AfterSync(lambda proxier: check(proxier.cache.state())))
    if api_source is not None:  # its watches' states; every Node watched once labels matter
        api = api_source
        metrics.watch_api(api.status)
        observers.append(AfterSync(
            lambda proxier: api.watch_all_nodes() if proxier.cache.uses_node_labels() else None))

    def make_family(family: IPFamily, node: NodeConfig) -> FamilyProxier:
        return FamilyProxier(family, node, kernel(family) if kernel else None, least.adjust)

    proxier = NodeProxier(
        cache, [make_family(f, node_config) for f in families],
        full_sync_period=timing.full_sync_period, verify_period=timing.verify_period,
        clock=clock, observers=observers, request_sync=runner.run,
        reconfigure=NodeTracker(config, node_name, interface_ips, node_config,
                                lambda: cache.node, local_ips),
        make_family=make_family, repairs=repairs,
        on_invalid=[lambda s: metrics.invalid_objects.labels(kind=s.kind).inc()],
        on_node_change=[health.set_node])
    source = api_source or SnapshotSource(config.snapshot or "", proxier, stop)
    if config.localhost_nodeports_gate:
        metrics.watch_localhost_nodeports(RejectedPackets(rejected_reader(proxier)))
    metrics.watch_selections(proxier.current_selections)
    connections = connection_views(proxier, metrics, config.in_flight_interval, least)
    # Other tables' base chains dropping what we accept: checked at start and on their changes.
    coexistence = CoexistenceCheck(
        tuple(families), lambda found: metrics.other_table_drops.set(len(found)))
    return Daemon(config, stop, cache, proxier, runner, health, metrics, hcnp, localhost,
                  conntrack, connections, coexistence, source, address_check)


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
    for warning in (*config.unapplied, *config.changes):
        log.warning("configuration", note=warning)
    for note in config.notes:
        log.info("configuration", note=note)
    # Until the Node object is known (its initial list completes before the first sync), the
    # interfaces' addresses stand in for its IPs.
    ips = tuple(node_ips) if node_ips is not None else primary_addresses()
    daemon = build_daemon(config, api_client=api_client, interface_ips=ips,
                          local_addresses=local_addresses, stop=stop)
    warn_if_kernel_below_supported(platform.release())
    daemon.start()
    serving.stop_on_signals(daemon.stopping)
    daemon.wait()
    daemon.stop()
    return 0
