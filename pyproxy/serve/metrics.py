"""Prometheus metrics under kube-proxy's names, so existing dashboards and alerts keep
working, plus pyproxy's own (prefixed `pyproxy_`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.core.model import TrafficPolicy
from pyproxy.core.topology import TOPOLOGY_NONE, PortSelection
from pyproxy.serve.connections import Series

# Upstream's buckets for sync durations: exponential from 1 ms.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# Network programming latency, upstream's buckets: 0.25 s, 0.5 s, 1..59 s by 1 s, 60..115 s by
# 5 s, 120..300 s by 30 s.
_NPL_BUCKETS = (0.25, 0.5, *range(1, 60), *range(60, 120, 5), *range(120, 301, 30))
log = structlog.get_logger("pyproxy.metrics")

# What Go's time.Parse(time.RFC3339Nano, …) accepts; anything else is no trigger time.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 started: float | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        # process_resident_memory_bytes, process_cpu_seconds_total, …: kube-proxy exports
        # them too, and memory and CPU alerts on the proxy are written against them.
        ProcessCollector(registry=r)
        # Trigger times from before this (wall clock) are not ours to measure (see below).
        self.started = time.time() if started is None else started
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
        self.conntrack_duration = Histogram(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "conntrack reconciler sync duration in seconds", ["ip_family"],
            buckets=_SYNC_BUCKETS, registry=r)
        # pyproxy's own
        self.invalid_objects = Counter(
            "pyproxy_invalid_objects", "API objects skipped as invalid", ["kind"], registry=r)
        self.sync_phase = Histogram(
            "pyproxy_sync_phase_duration_seconds", "Time per sync phase",
            ["phase"], buckets=_SYNC_BUCKETS, registry=r)
        self.table_repairs = Counter(
            "pyproxy_table_repairs", "Changes to pyproxy's tables made by someone else, repaired",
            registry=r)
        # 1 while the API server is reached through a Service address (the bootstrap trap:
        # that address works only while some proxy's rules for it are in the kernel).
        self.api_server_via_service = Gauge(
            "pyproxy_api_server_via_service_address",
            "1 if the API server address pyproxy uses is a Service ClusterIP, or in a "
            "service CIDR, which a node without proxy rules cannot reach", registry=r)

    def watch_selections(self, selections: Callable[[], Iterable[PortSelection]]) -> None:
        """Metrics computed at scrape time from the selections in force (off the sync path)."""
        self.registry.register(_SelectionCollector(selections))

    def watch_connections(self, totals: Callable[[], Mapping[Series, int]]) -> None:
        """New connections per endpoint, read from the kernel at scrape time (at most once a
        second however many scrapers ask; pyproxy/serve/connections.py)."""
        self.registry.register(_ConnectionCollector(totals))

    def count_health(self, path: str, code: int) -> None:
        (self.healthz if path == "/healthz" else self.livez).labels(code=str(code)).inc()

    def observe_trigger_times(self, trigger_times: Iterable[str], now: float) -> None:
        """Network programming latency from each changed EndpointSlice's
        `endpoints.kubernetes.io/last-change-trigger-time` to now (the commit). As upstream,
        an unparsable time is ignored, and so is one from before the proxy started: the
        initial list brings every slice's old trigger time, which measures nothing we did."""
        for text in trigger_times:
            if not _RFC3339.fullmatch(text):
                continue
            try:
                when = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
            if self.started < when <= now:
                self.network_programming.observe(now - when)


class _SelectionCollector(Collector):
    def __init__(self, selections: Callable[[], Iterable[PortSelection]]) -> None:
        self.selections = selections

    def collect(self) -> Iterator[Metric]:
        no_local = GaugeMetricFamily(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            labels=["traffic_policy", "ip_family"])
        topology = GaugeMetricFamily(
            "pyproxy_service_topology_mode",
            "Topology mode in force per service port on this node (1 = in force)",
            labels=["service", "port", "ip_family", "mode"])
        # Per family (upstream's newest labels): a dual-stack service counts once in each.
        counts = {(policy, family): 0 for policy in ("internal", "external")
                  for family in ("IPv4", "IPv6")}
        for ps in self.selections():
            sel, port = ps.selection, ps.port
            if sel.has_any_endpoints and sel.local == ():
                if port.internal_policy is TrafficPolicy.LOCAL:
                    counts[("internal", str(ps.family))] += 1
                if (port.external_policy is TrafficPolicy.LOCAL
                        and port.externally_accessible(ps.family)):
                    counts[("external", str(ps.family))] += 1
            if sel.topology != TOPOLOGY_NONE:
                topology.add_metric([str(port.name.service), port.name.port, str(ps.family),
                                     sel.topology], 1)
        for (policy, family), count in counts.items():
            no_local.add_metric([policy, family], count)
        yield no_local
        yield topology


class _ConnectionCollector(Collector):
    def __init__(self, totals: Callable[[], Mapping[Series, int]]) -> None:
        self.totals = totals

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(
            "pyproxy_endpoint_new_connections",
            "New connections this node sent to each endpoint of a service port, counted by the "
            "kernel; scope: where the endpoint runs relative to this node (node, zone, cluster)",
            labels=list(Series._fields))

    def describe(self) -> Iterator[Metric]:
        # without it, registering would call collect(): a kernel read before the first sync
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        try:
            totals = self.totals()
        except Exception as err:  # the rest of /metrics must still answer
            log.warning("connection_counters_not_read", error=str(err))
            totals = {}
        for series, count in totals.items():
            family.add_metric(list(series), count)
        yield family
