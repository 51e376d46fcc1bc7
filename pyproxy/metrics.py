"""Prometheus metrics under kube-proxy's names, so existing dashboards and alerts keep
working, plus pyproxy's own (prefixed `pyproxy_`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.explain import PortSelection
from pyproxy.model import TrafficPolicy
from pyproxy.topology import TOPOLOGY_NONE

# Upstream's buckets for sync durations: exponential from 1 ms.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# Network programming latency: upstream uses linear then exponential buckets up to minutes.
_NPL_BUCKETS = (0.25, 0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39,
                40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
                60, 75, 90, 105, 120, 180, 240, 300, 420, 600, 900, 1200, 1800, 3600)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds", buckets=_SYNC_BUCKETS, registry=r)
        self.sync_full_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs", buckets=_SYNC_BUCKETS,
            registry=r)
        self.sync_partial_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs", buckets=_SYNC_BUCKETS,
            registry=r)
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced", registry=r)
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued", registry=r)
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds", buckets=_NPL_BUCKETS,
            registry=r)
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes", registry=r)
        self.endpoint_changes_total = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes", registry=r)
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes", registry=r)
        self.service_changes_total = Counter(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes", registry=r)
        self.sync_failures = Counter(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures", registry=r)
        self.cleanup_failures = Counter(
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "Cumulative proxy nftables cleanup failures", registry=r)
        self.healthz = Counter("kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status",
                               ["code"], registry=r)
        self.livez = Counter("kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status",
                             ["code"], registry=r)
        self.conntrack_deleted = Counter(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler", ["ip_family"],
            registry=r)
        # pyproxy's own
        self.invalid_objects = Counter(
            "pyproxy_invalid_objects", "API objects skipped as invalid", ["kind"], registry=r)
        self.sync_phase = Histogram(
            "pyproxy_sync_phase_duration_seconds", "Time per sync phase",
            ["phase"], buckets=_SYNC_BUCKETS, registry=r)
        self.table_repairs = Counter(
            "pyproxy_table_repairs", "Changes to pyproxy's tables made by someone else, repaired",
            registry=r)

    def watch_selections(self, selections: Callable[[], Iterable[PortSelection]]) -> None:
        """Metrics computed at scrape time from the selections in force (off the sync path)."""
        self.registry.register(_SelectionCollector(selections))

    def count_health(self, path: str, code: int) -> None:
        (self.healthz if path == "/healthz" else self.livez).labels(code=str(code)).inc()

    def observe_trigger_times(self, trigger_times: Iterable[str], now: float) -> None:
        """Network programming latency from each changed EndpointSlice's
        `endpoints.kubernetes.io/last-change-trigger-time` to now (the commit)."""
        for text in trigger_times:
            try:
                when = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
            if now >= when:
                self.network_programming.observe(now - when)


class _SelectionCollector(Collector):
    def __init__(self, selections: Callable[[], Iterable[PortSelection]]) -> None:
        self.selections = selections

    def collect(self) -> Iterator[Metric]:
        no_local = GaugeMetricFamily(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            labels=["traffic_policy"])
        topology = GaugeMetricFamily(
            "pyproxy_service_topology_mode",
            "Topology mode in force per service port on this node (1 = in force)",
            labels=["service", "port", "ip_family", "mode"])
        internal = external = 0
        for ps in self.selections():
            sel, port = ps.selection, ps.port
            if sel.has_any_endpoints and sel.local == ():
                if port.internal_policy is TrafficPolicy.LOCAL:
                    internal += 1
                if (port.external_policy is TrafficPolicy.LOCAL
                        and port.externally_accessible(ps.family)):
                    external += 1
            if sel.topology != TOPOLOGY_NONE:
                topology.add_metric([str(port.name.service), port.name.port, str(ps.family),
                                     sel.topology], 1)
        no_local.add_metric(["internal"], internal)
        no_local.add_metric(["external"], external)
        yield no_local
        yield topology
