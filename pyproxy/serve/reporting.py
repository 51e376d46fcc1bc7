"""What every sync tells the served state: /healthz's freshness and the node's eligibility,
the sync metrics, and the health-check node ports' local endpoint counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyproxy.cluster.cache import Checkout
from pyproxy.core.model import ServiceKey
from pyproxy.core.plan import Cause
from pyproxy.serve.health import ProxyHealth, ServiceHealth, ServiceHealthServers
from pyproxy.serve.metrics import Metrics
from pyproxy.sync.node import NodeProxier, SyncedOnly, SyncRecord

if TYPE_CHECKING:
    from pyproxy.kernel.netlink import CleanupResult


@dataclass
class SyncReporting:
    """Health and metrics after each sync, and at each change queued or sync failed."""

    health: ProxyHealth
    metrics: Metrics
    _cleanup_failures: int = 0

    def queued(self, proxier: NodeProxier) -> None:
        self.health.queued()
        self.metrics.last_queued.set_to_current_time()
        services, endpoints = proxier.cache.pending()
        self.metrics.service_changes_pending.set(services)
        self.metrics.endpoint_changes_pending.set(endpoints)

    def failed(self, proxier: NodeProxier, record: SyncRecord) -> None:
        self._add_families(proxier)
        self.metrics.sync_failures.inc()
        # A failed sync leaves work pending (the kernel does not hold what it should): if
        # it keeps failing, /healthz turns 503 after 2 x syncPeriod even when nothing new
        # was queued.
        self.health.sync_failed(record.error or "")

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        self._add_families(proxier)
        self.health.updated()
        self.health.set_node(proxier.cache.node)
        m = self.metrics
        if record.cause is Cause.REPAIR:
            m.table_repairs.inc()
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

    def _add_families(self, proxier: NodeProxier) -> None:
        """A family the node gained an address of (the proxier made its table) is one
        /healthz answers for from the sync that made it."""
        for family in proxier.families:
            self.health.add_family(family)

    def conntrack_cleaned(self, result: CleanupResult) -> None:
        """One conntrack cleanup done (the worker's report)."""
        family = str(result.family)
        self.metrics.conntrack_duration.labels(ip_family=family).observe(result.duration)
        if result.deleted and result.departed:
            self.metrics.departed_deleted.labels(ip_family=family).inc(result.deleted)
        elif result.deleted:
            self.metrics.conntrack_deleted.labels(ip_family=family).inc(result.deleted)


@dataclass
class HealthCheckNodePorts(SyncedOnly):
    """After each sync, the health-check node port of every service that has one and its
    local READY endpoint count (distinct IPs, all ports and families); the servers follow,
    moved when the addresses NodePorts are served on change (`addresses`: those the servers
    were given, `NodeConfig.health_check_addresses`; None: they stay where they are)."""

    service_health: ServiceHealth
    servers: ServiceHealthServers | None = None
    addresses: tuple[str, ...] | None = None

    def synced(self, proxier: NodeProxier, record: SyncRecord, checkout: Checkout) -> None:
        state = proxier.cache.state()
        node = proxier.cache.node_name
        families = proxier.families
        ports: dict[ServiceKey, int] = {}
        counts: dict[ServiceKey, int] = {}
        for key, service_ports in state.ports_by_service.items():
            hcnp = next((p.health_check_node_port for p in service_ports
                         if p.health_check_node_port), 0)
            if not hcnp:
                continue
            ports[key] = hcnp
            ips = {ep.ip for p in service_ports for fam in families
                   for ep in state.endpoints(p.name, fam) if ep.ready and ep.is_local(node)}
            counts[key] = len(ips)
        self.service_health.update(ports, counts)
        if self.servers is not None:
            wanted = proxier.health_check_addresses
            if self.addresses is not None and wanted != self.addresses:
                self.addresses = wanted
                self.servers.set_addresses(wanted)
            self.servers.sync()

    def stop(self) -> None:
        if self.servers is not None:
            self.servers.stop()
