"""`pyproxy run`: wiring the daemon together (the outermost shell).

sources (API watches | snapshot file) → NodeProxier (cache + tracking) → runner → nftables,
with health, metrics and conntrack cleanup listening to every sync.
"""

from __future__ import annotations

import os
import platform
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from pyproxy.cluster import apiconnection
from pyproxy.cluster.apirequest import observe_requests
from pyproxy.cluster.apiserver import ApiAddressCheck, client_for, server_host
from pyproxy.cluster.cache import Checkout, ClusterCache
from pyproxy.cluster.events import record_start
from pyproxy.cluster.sources import ApiSource, SnapshotSource
from pyproxy.config import ConfigError, ProxyConfig
from pyproxy.core.localhost import nodeport_specs
from pyproxy.core.model import (
    ClusterState,
    IPFamily,
    LocalhostNodePorts,
    Node,
    NodeConfig,
    ServiceKey,
    ip_family,
    override_ips,
)
from pyproxy.core.plan import Cause
from pyproxy.core.topology import PortSelection
from pyproxy.kernel.basechains import CoexistenceCheck
from pyproxy.kernel.conntrack import (
    Allowed,
    ServiceFrontends,
    UdpTarget,
    allowed_map,
    claimants,
    needs_cleanup,
    service_frontends,
    udp_targets,
    withdrawn,
)
from pyproxy.kernel.host import apply_host_settings, log_outcome, warn_if_kernel_below_supported
from pyproxy.kernel.libnftables import OWN_SOCKETS
from pyproxy.kernel.nftevents import NftMonitor
from pyproxy.kernel.nlsets import KernelCounters, rule_packets
from pyproxy.kernel.privileges import require_privileges
from pyproxy.logs import setup_logging
from pyproxy.render.objects import PROTOCOLS, localhost_nodeport_reject_chain
from pyproxy.serve.connections import REFRESH_INTERVAL, ConnectionCounters, Kernel
from pyproxy.serve.health import ProxyHealth, ServiceHealth, ServiceHealthServers
from pyproxy.serve.live import counting_context
from pyproxy.serve.localhost import LocalhostListeners
from pyproxy.serve.metrics import Metrics, RejectedPackets
from pyproxy.serve.servers import sd_notify, start_debug, start_servers
from pyproxy.sync.node import NodeProxier, SyncRecord
from pyproxy.sync.proxier import FamilyProxier
from pyproxy.sync.repairs import Repairs
from pyproxy.sync.runner import BoundedFrequencyRunner

log = structlog.get_logger(__name__)


class ConntrackSink(Protocol):
    """Where the observer hands conntrack work (ConntrackWorker; a recording fake in tests)."""

    def submit(self, family: IPFamily, work: Allowed | ServiceFrontends) -> None: ...


class ConntrackWorker:
    """Conntrack cleanup off the sync path: dumping and deleting entries can take seconds
    with many flows, and must not hold up the next sync. Two kinds of work, in order: the
    stale UDP flows of changed services (`Allowed`), and after a repair the entries made
    while our rules were missing (`ServiceFrontends`)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.pending: queue.Queue[tuple[IPFamily, Allowed | ServiceFrontends]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="conntrack", daemon=True)
        self.thread.start()

    def submit(self, family: IPFamily, work: Allowed | ServiceFrontends) -> None:
        self.pending.put((family, work))

    def _run(self) -> None:
        from pyproxy.kernel.netlink import ConntrackCleaner

        cleaner = ConntrackCleaner()
        while True:
            family, work = self.pending.get()
            if isinstance(work, ServiceFrontends):
                result = cleaner.clear_not_dnated(family, work)
            else:
                result = cleaner.cleanup(family, work)
            self.metrics.conntrack_duration.labels(ip_family=str(family)).observe(
                result.duration)
            if result.deleted:
                self.metrics.conntrack_deleted.labels(ip_family=str(family)).inc(result.deleted)


@dataclass
class DaemonObserver:
    """Health, metrics, health-check node ports and conntrack cleanup after each sync."""

    proxier_ref: Callable[[], NodeProxier]
    families: tuple[IPFamily, ...]
    node_ips: tuple[str, ...]
    health: ProxyHealth
    metrics: Metrics
    service_health: ServiceHealth
    hcnp_servers: ServiceHealthServers | None = None
    conntrack: ConntrackSink | None = None
    on_first_sync: Callable[[], None] = lambda: None
    after_sync: list[Callable[[], None]] = field(default_factory=list)
    _udp_targets: dict[Any, UdpTarget] | None = None
    _synced_once: bool = False
    _cleanup_failures: int = 0

    def queued(self) -> None:
        self.health.queued()
        self.metrics.last_queued.set_to_current_time()
        services, endpoints = self.proxier_ref().cache.pending()
        self.metrics.service_changes_pending.set(services)
        self.metrics.endpoint_changes_pending.set(endpoints)

    def failed(self, record: SyncRecord) -> None:
        self.metrics.sync_failures.inc()
        # A failed sync leaves work pending (the kernel does not hold what it should): if
        # it keeps failing, /healthz turns 503 after 2 x syncPeriod even when nothing new
        # was queued.
        self.health.sync_failed(record.error or "")

    def synced(self, record: SyncRecord, checkout: Checkout) -> None:
        proxier = self.proxier_ref()
        state = proxier.cache.state()
        self.health.updated()
        self.health.set_node(proxier.cache.node)
        m = self.metrics
        if record.cause is Cause.REPAIR:
            m.table_repairs.inc()
            self._after_repair(state)
        for family, why in record.replaced:
            m.table_replacements.labels(ip_family=family).inc()
            self.health.table_replaced(f"{family}: {why}")
        failures = sum(p.applier.cleanup_failures for p in proxier.proxiers)
        m.cleanup_failures.inc(failures - self._cleanup_failures)
        self._cleanup_failures = failures
        m.sync_duration.observe(record.seconds)
        (m.sync_full_duration if record.full else m.sync_partial_duration).observe(record.seconds)
        for phase, seconds in (("render", record.render_seconds), ("diff", record.diff_seconds),
                               ("kernel", record.kernel_seconds)):
            m.sync_phase.labels(phase=phase).observe(seconds)
        m.last_sync.set(record.started + record.seconds)
        m.service_changes_total.inc(checkout.service_changes)
        m.endpoint_changes_total.inc(checkout.endpoint_changes)
        m.service_changes_pending.set(0)
        m.endpoint_changes_pending.set(0)
        m.observe_trigger_times(checkout.trigger_times, record.started + record.seconds)
        self._service_health(state)
        self._conntrack(state, None if record.full or checkout.topology_changed
                        else checkout.services)
        if not self._synced_once:
            self._synced_once = True
            self.on_first_sync()
        for hook in self.after_sync:
            hook()

    def _service_health(self, state: ClusterState) -> None:
        """Ports and local READY endpoint counts (distinct IPs, all ports and families)."""
        node = self.proxier_ref().cache.node_name
        ports: dict[ServiceKey, int] = {}
        counts: dict[ServiceKey, int] = {}
        for key, service_ports in state.ports_by_service.items():
            hcnp = next((p.health_check_node_port for p in service_ports
                         if p.health_check_node_port), 0)
            if not hcnp:
                continue
            ports[key] = hcnp
            ips = {ep.ip for p in service_ports for fam in self.families
                   for ep in state.endpoints(p.name, fam) if ep.ready and ep.is_local(node)}
            counts[key] = len(ips)
        self.service_health.update(ports, counts)
        if self.hcnp_servers is not None:
            self.hcnp_servers.sync()

    def _after_repair(self, state: ClusterState) -> None:
        """Connections started while our rules were missing keep conntrack entries without
        DNAT, which their next packets follow (pyproxy/kernel/conntrack.py, end): deleted
        now, so that those packets are NATed afresh by the repaired rules."""
        if self.conntrack is None:
            return
        for family in self.families:
            self.conntrack.submit(family, service_frontends(state, family, self.node_ips))

    def _conntrack(self, state: ClusterState, services: frozenset[ServiceKey] | None) -> None:
        if self.conntrack is None:
            return
        current = udp_targets(state, self.families, services)
        previous = self._udp_targets
        merged = dict(previous or {})
        if services is None:
            merged = dict(current)
        else:
            merged = {k: v for k, v in merged.items() if k[0].service not in services}
            merged.update(current)
        self._udp_targets = merged
        if previous is not None and not needs_cleanup(previous, current, services):
            return
        # A frontend that went away (a deleted Service) allows nobody; one another Service
        # still claims keeps that Service's endpoints.
        gone = withdrawn(previous or {}, current, services)
        work = {**claimants(merged, gone), **current}
        for family in self.families:
            targets = [t for (_name, fam), t in (*work.items(), *gone.items()) if fam is family]
            if targets:
                self.conntrack.submit(family, allowed_map(targets, self.node_ips))


@dataclass
class LocalhostProxies:
    """Localhost NodePorts (KEP-6032): after every sync, under the sync lock, each family
    whose configuration turns the userspace proxy on gets listeners for the TCP NodePorts of
    the selections in force; a family that has it off has none."""

    metrics: Metrics
    listeners: dict[IPFamily, LocalhostListeners] = field(default_factory=dict)

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


def current_selections(proxier: NodeProxier) -> list[PortSelection]:
    """The selections in force, copied under the sync lock (for metrics and the live CLI)."""
    with proxier.lock:
        return [ps for family in proxier.proxiers for ps in family.selections.values()]


def _families(node_ips: tuple[str, ...]) -> tuple[IPFamily, ...]:
    found = tuple(dict.fromkeys(ip_family(ip) for ip in node_ips))
    return found or (IPFamily.IPv4,)


def node_config_for(config: ProxyConfig, node_name: str, node: Node | None,
                    interface_ips: Sequence[str]) -> NodeConfig:
    """This node's configuration, as kube-proxy derives it: per family the IP its Node object
    gives (status.addresses: InternalIP first, then ExternalIP), bindAddress replacing the one
    of its family; its podCIDRs for detect-local mode NodeCIDR. A family the Node has no
    address of takes the primary interface address (kube-proxy would assume loopback)."""
    host_ips = node.host_ips if node is not None else ()
    pod_cidrs = node.pod_cidrs if node is not None else ()
    return config.node_config(node_name, override_ips(host_ips, interface_ips), pod_cidrs)


@dataclass
class NodeTracker:
    """Keeps the node's configuration in step with its Node object. Called first in every
    sync (under the sync lock): the first sync comes only after the Node's initial list, so
    no rule is ever written with IPs the Node object contradicts. kube-proxy exits when its
    node's IPs change and is restarted; here the change is handed to `on_change` and the sync
    made a full one, which re-renders everything with the new IPs."""

    config: ProxyConfig
    node_name: str
    interface_ips: tuple[str, ...]
    current: NodeConfig
    node: Callable[[], Node | None]
    on_change: list[Callable[[NodeConfig], None]] = field(default_factory=list)

    def __call__(self) -> bool:
        """Whether the configuration changed."""
        wanted = node_config_for(self.config, self.node_name, self.node(), self.interface_ips)
        if wanted == self.current:
            return False
        log.info("node_config_from_node", node_ips=list(wanted.node_ips),
                 was=list(self.current.node_ips), pod_cidrs=list(wanted.node_cidrs))
        self.current = wanted
        for hook in self.on_change:
            hook(wanted)
        return True


def _hcnp_addresses(node_config: NodeConfig) -> list[str]:
    return list(node_config.node_ips) or ["0.0.0.0"]


def reconfigure(new: NodeConfig, proxier: NodeProxier, observer: DaemonObserver,
                health: ProxyHealth,
                make: Callable[[IPFamily, NodeConfig], FamilyProxier] = FamilyProxier) -> None:
    """Every family renders with `new` from now on; a family the node newly has an address
    of gets its table (`make`). None is dropped while running: its table stays programmed."""
    have = {p.family for p in proxier.proxiers}
    for family_proxier in proxier.proxiers:
        family_proxier.config = new
    for family in _families(new.node_ips):
        if family not in have:
            proxier.proxiers.append(make(family, new))
            health.add_family(family)
    observer.families = tuple(p.family for p in proxier.proxiers)
    observer.node_ips = new.node_ips
    if observer.hcnp_servers is not None:
        observer.hcnp_servers.set_addresses(_hcnp_addresses(new))


@dataclass(frozen=True)
class SyncTiming:
    """The daemon's clocks, from syncPeriod, minSyncPeriod and pyproxy's fullSyncPeriod."""

    min_interval: float  # shortest gap from the end of one sync to the next (batching)
    retry_interval: float  # after a failed sync
    max_interval: float  # a sync at least this often: it checks the table for tampering
    health_timeout: float  # a queued change older than this makes /healthz fail
    full_sync_period: float
    verify_period: float  # how often a sync compares the table's structure with ours


def sync_timing(config: ProxyConfig) -> SyncTiming:
    return SyncTiming(
        min_interval=config.min_sync_period, retry_interval=config.sync_period,
        max_interval=config.sync_period, health_timeout=2 * config.sync_period,
        full_sync_period=config.full_sync_period, verify_period=config.sync_period)


@dataclass(frozen=True)
class Daemon:
    """The daemon's object graph, finished: nothing in it is assigned or appended to after
    `build_daemon` returns. Nothing runs yet either (but the conntrack worker's thread)."""

    cache: ClusterCache
    proxier: NodeProxier
    runner: BoundedFrequencyRunner
    health: ProxyHealth
    metrics: Metrics
    observer: DaemonObserver
    localhost: LocalhostProxies
    connections: ConnectionCounters
    coexistence: CoexistenceCheck
    source: ApiSource | SnapshotSource
    address_check: ApiAddressCheck | None


def build_daemon(config: ProxyConfig, node_name: str, interface_ips: tuple[str, ...],
                 node_config: NodeConfig, api_client: Any, stop: threading.Event) -> Daemon:
    """Every part built once, each given what it needs when it is made. The graph has
    cycles (the runner runs the proxier's sync and the proxier asks the runner for the next;
    health reads the proxier's damage and the proxier's observer reports to health): each is
    closed by a lambda over a part built further down, called only once this has returned."""
    families = _families(node_config.node_ips)
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
    observer = DaemonObserver(
        lambda: proxier, families, node_config.node_ips, health, metrics, service_health,
        ServiceHealthServers(service_health, health, _hcnp_addresses(node_config)),
        ConntrackWorker(metrics), on_first_sync=lambda: sd_notify("READY=1"),
        after_sync=_after_sync(config, cache, localhost, lambda: proxier, address_check,
                               lambda: source))
    tracker = NodeTracker(config, node_name, interface_ips, node_config, lambda: cache.node,
                          on_change=[lambda new: reconfigure(new, proxier, observer, health)])
    proxier = NodeProxier(
        cache, [FamilyProxier(f, node_config) for f in families],
        full_sync_period=timing.full_sync_period, verify_period=timing.verify_period,
        reconfigure=tracker, request_sync=runner.run, repairs=repairs, observers=[observer],
        on_invalid=[lambda s: metrics.invalid_objects.labels(kind=s.kind).inc()],
        on_node_change=[health.set_node])
    if config.localhost_nodeports_gate:
        metrics.watch_localhost_nodeports(RejectedPackets(rejected_reader(proxier)))
    metrics.watch_selections(lambda: current_selections(proxier))
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
    return Daemon(cache, proxier, runner, health, metrics, observer, localhost, connections,
                  coexistence, source, address_check)


def _after_sync(config: ProxyConfig, cache: ClusterCache, localhost: LocalhostProxies,
                proxier: Callable[[], NodeProxier], address_check: ApiAddressCheck | None,
                source: Callable[[], ApiSource | SnapshotSource]) -> list[Callable[[], None]]:
    """What runs after every successful sync, beyond the observer's own: the localhost
    NodePort listeners, the API server address check, and the watch of every Node once a
    service uses topology keys beyond the hostname."""
    hooks: list[Callable[[], None]] = []
    if config.localhost_nodeports_gate:
        hooks.append(lambda: localhost.sync(proxier()))
    if address_check is not None:
        check = address_check
        hooks.append(lambda: check(cache.state()))

    def watch_all_nodes() -> None:
        api = source()
        if isinstance(api, ApiSource) and cache.uses_node_labels():
            api.watch_all_nodes()

    if not config.snapshot:
        hooks.append(watch_all_nodes)
    return hooks


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
    families = _families(node_config.node_ips)
    for note in config.notes:
        log.info("configuration", note=note)
    log.info("starting", node=node_name, node_ips=list(node_config.node_ips),
             families=[str(f) for f in families],
             source="snapshot" if config.snapshot else "api")
    warn_if_kernel_below_supported(platform.release())

    daemon = build_daemon(config, node_name, tuple(node_ips), node_config, api_client, stop)
    proxier, runner, health, metrics = daemon.proxier, daemon.runner, daemon.health, daemon.metrics
    connections, coexistence, source = daemon.connections, daemon.coexistence, daemon.source
    address_check, observer, localhost = daemon.address_check, daemon.observer, daemon.localhost
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
    if observer.hcnp_servers is not None:
        observer.hcnp_servers.stop()
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
