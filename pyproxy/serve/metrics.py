"""Prometheus metrics under kube-proxy's names, so existing dashboards and alerts keep
working, plus pyproxy's own (prefixed `pyproxy_`)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyproxy.cluster.watchstate import WATCH_STATES, WatchStatus
from pyproxy.core.model import TrafficPolicy
from pyproxy.core.topology import TOPOLOGY_NONE, PortSelection
from pyproxy.serve.connections import Series

# Upstream's buckets for sync durations: exponential from 1 ms.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# Network programming latency, upstream's buckets: 0.25 s, 0.5 s, 1..59 s by 1 s, 60..115 s by
# 5 s, 120..300 s by 30 s.
_NPL_BUCKETS = (0.25, 0.5, *range(1, 60), *range(60, 120, 5), *range(120, 301, 30))
# client-go's request latency buckets (k8s.io/component-base metrics/prometheus/restclient).
_REST_CLIENT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
log = structlog.get_logger(__name__)

# What Go's time.Parse(time.RFC3339Nano, …) accepts; anything else is no trigger time.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric family: what Prometheus sees (name, type, labels, help) and what
    it tells an operator (`meaning`, for docs/metrics.md). Every metric pyproxy exports is a
    row of SPECS; `Metrics` and the collectors build theirs from the rows, and
    tests/test_metrics_reference.py checks the rows against a scrape."""

    name: str
    """As exposed, with a counter's `_total`."""
    type: str  # counter | gauge | histogram
    help: str
    meaning: str
    labels: tuple[str, ...] = ()
    source: str = "pyproxy"
    """Who defines it: pyproxy, client-go, or prometheus_client's process collector."""

    @property
    def family(self) -> str:
        """The name prometheus_client takes (a counter's without `_total`)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


_PROCESS = "prometheus_client's process collector (as kube-proxy's Go runtime exports them)"
_CLIENT_GO = "client-go's name (kube-proxy exports it too)"
SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("kubeproxy_sync_proxy_rules_duration_seconds", "histogram",
               "SyncProxyRules latency in seconds",
               "time per sync, full or partial (render, diff, kernel); kube-proxy's name"),
    MetricSpec("kubeproxy_sync_full_proxy_rules_duration_seconds", "histogram",
               "SyncProxyRules latency in seconds for full resyncs",
               "time per full sync (start, after a failure, a repair, a node configuration "
               "change, every --full-sync-period)"),
    MetricSpec("kubeproxy_sync_partial_proxy_rules_duration_seconds", "histogram",
               "SyncProxyRules latency in seconds for partial resyncs",
               "time per partial sync (only what changed)"),
    MetricSpec("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge",
               "The last time proxy rules were successfully synced",
               "Unix time of the last successful sync; a sync runs at least every syncPeriod, "
               "so an old value means syncs fail or stall"),
    MetricSpec("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "gauge",
               "The last time a sync of proxy rules was queued",
               "Unix time a change last asked for a sync; above last_timestamp: a change waits "
               "(/healthz fails when it waits more than 2 × syncPeriod)"),
    MetricSpec("kubeproxy_network_programming_duration_seconds", "histogram",
               "In Cluster Network Programming Latency in seconds",
               "from an EndpointSlice's last-change-trigger-time to the commit of its rules "
               "on this node (network programming latency, the Kubernetes SLI)"),
    MetricSpec("kubeproxy_sync_proxy_rules_endpoint_changes_pending", "gauge",
               "Pending proxy rules Endpoint changes",
               "EndpointSlice changes received, not yet synced"),
    MetricSpec("kubeproxy_sync_proxy_rules_endpoint_changes_total", "counter",
               "Cumulative proxy rules Endpoint changes", "EndpointSlice changes received"),
    MetricSpec("kubeproxy_sync_proxy_rules_service_changes_pending", "gauge",
               "Pending proxy rules Service changes", "Service changes received, not yet synced"),
    MetricSpec("kubeproxy_sync_proxy_rules_service_changes_total", "counter",
               "Cumulative proxy rules Service changes", "Service changes received"),
    MetricSpec("kubeproxy_sync_proxy_rules_nftables_sync_failures_total", "counter",
               "Cumulative proxy nftables sync failures",
               "syncs the kernel refused (each retried after syncPeriod with a full sync)"),
    MetricSpec("kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total", "counter",
               "Cumulative proxy nftables cleanup failures",
               "stale chains that could not be deleted"),
    MetricSpec("kubeproxy_proxy_healthz_total", "counter",
               "Cumulative proxy healthz HTTP status", "/healthz answers by HTTP status",
               labels=("code",)),
    MetricSpec("kubeproxy_proxy_livez_total", "counter",
               "Cumulative proxy livez HTTP status", "/livez answers by HTTP status",
               labels=("code",)),
    MetricSpec("kubeproxy_conntrack_reconciler_deleted_entries_total", "counter",
               "Cumulative conntrack flows deleted by conntrack reconciler",
               "stale conntrack entries deleted (UDP endpoints gone, repairs)",
               labels=("ip_family",)),
    MetricSpec("kubeproxy_conntrack_reconciler_sync_duration_seconds", "histogram",
               "conntrack reconciler sync duration in seconds",
               "time per conntrack clean-up", labels=("ip_family",)),
    MetricSpec("kubeproxy_sync_proxy_rules_no_local_endpoints_total", "gauge",
               "Number of services with a Local traffic policy and no endpoints",
               "service ports with internal/externalTrafficPolicy Local and no endpoint on "
               "this node (their traffic from that side is dropped); computed at scrape time",
               labels=("traffic_policy", "ip_family")),
    MetricSpec("rest_client_requests_total", "counter",
               "Number of HTTP requests, partitioned by status code, method, and host.",
               "requests to the API server (lists, watches, the start Event) by HTTP status, or "
               "`<error>` when none came (refused, TLS, timeout); client-go's name and labels, "
               "`host` the server's host:port", labels=("code", "method", "host"),
               source=_CLIENT_GO),
    MetricSpec("rest_client_request_duration_seconds", "histogram",
               "Request latency in seconds. Broken down by verb, and host.",
               "from asking (the qps/burst wait included) to the response's headers, for "
               "every request, watches too (client-go also reads a list's body within it, "
               "and leaves watches out); `verb` is the HTTP method, as client-go's",
               labels=("verb", "host"), source=_CLIENT_GO),
    MetricSpec("pyproxy_invalid_objects_total", "counter", "API objects skipped as invalid",
               "API objects skipped as invalid (the log and `pyproxy explain` say why)",
               labels=("kind",)),
    MetricSpec("pyproxy_departed_conntrack_entries_deleted_total", "counter",
               "TCP conntrack entries of endpoints that left their Service, deleted",
               "fast failure (--fast-failure): TCP conntrack entries through a Service to an "
               "endpoint that left it, deleted so that the client's next packet is answered "
               "with a reset at once instead of going to the gone address until TCP gives up",
               labels=("ip_family",)),
    MetricSpec("pyproxy_sync_phase_duration_seconds", "histogram", "Time per sync phase",
               "time per sync phase: render, diff, kernel", labels=("phase",)),
    MetricSpec("pyproxy_table_repairs_total", "counter",
               "Changes to pyproxy's tables made by someone else, repaired",
               "someone else changed pyproxy's tables (nft, a firewall reload) and pyproxy "
               "repaired them; while one is unrepaired /healthz answers 503"),
    MetricSpec("pyproxy_table_replacements_total", "counter",
               "pyproxy's tables replaced whole",
               "pyproxy's table deleted and written anew in one transaction (make before "
               "break), because it recorded another layout or a full sync could not patch "
               "it; the log's table_replaced says why", labels=("ip_family",)),
    MetricSpec("pyproxy_api_server_via_service_address", "gauge",
               "1 if the API server address pyproxy uses is a Service ClusterIP, or in a "
               "service CIDR, which a node without proxy rules cannot reach",
               "1: the API server is reached through a Service address, which a rebooted node "
               "cannot reach before pyproxy programs it (docs/deploying.md, step 2)"),
    MetricSpec("pyproxy_other_table_drop_chains", "gauge",
               "Base chains of other nftables tables, at hooks pyproxy's connections cross, "
               "that drop what their own rules do not accept",
               "base chains of other tables (a firewall, Docker, iptables-nft) that drop "
               "what pyproxy accepts: above 0, NodePorts or ClusterIPs may be broken whatever "
               "pyproxy does; the log (`other_table_drops`), `pyproxy status` and `explain` "
               "name them (docs/deploying.md, \"Other firewalls on the node\")"),
    MetricSpec("pyproxy_watch_state", "gauge",
               "State of each watch of the API server (1 = the state it is in)",
               "per watched resource (Service, EndpointSlice, Node, ServiceCIDR): `connecting` "
               "(no answer yet since start), `connected` (the last try was answered), "
               "`disconnected` (it failed: the log's `api_unavailable_retrying` and `pyproxy "
               "status` say why); computed at scrape time",
               labels=("resource", "state")),
    MetricSpec("pyproxy_service_topology_mode", "gauge",
               "Topology mode in force per service port on this node (1 = in force)",
               "the topology mode (PreferSameZone, PreferSameNode, topology keys…) in force per "
               "service port; computed at scrape time",
               labels=("service", "port", "ip_family", "mode")),
    MetricSpec("pyproxy_endpoint_new_connections_total", "counter",
               "New connections this node sent to each endpoint of a service port, counted by "
               "the kernel; scope: where the endpoint runs relative to this node (node, zone, "
               "cluster)",
               "new connections per endpoint, counted by the kernel, read at scrape time "
               "(docs/operating.md, \"New connections per endpoint\")",
               labels=Series._fields),
    MetricSpec("pyproxy_outlier_failed_attempts_total", "counter",
               "Failed connection attempts to endpoints under outlier ejection, seen in "
               "conntrack events; reason: no_reply or reset",
               "connection attempts to an endpoint of a service port with outlier ejection "
               "on that failed: `no_reply` (the SYN unanswered for replyTimeout), `reset` (the "
               "endpoint refused); docs/services.md, \"Outlier ejection\"",
               labels=("reason",)),
    MetricSpec("pyproxy_outlier_ejections_total", "counter",
               "Endpoints ejected from new connections by outlier ejection",
               "ejections decided (an endpoint failing its attempts; each Event "
               "`EndpointEjected` is one); stays 0 on a healthy cluster"),
    MetricSpec("pyproxy_outlier_ejected_endpoints", "gauge",
               "Endpoints of a service port ejected from new connections now",
               "endpoints out of a service port's new connections now (outlier ejection, "
               "within its limits); only service ports with one; computed at scrape time",
               labels=("service", "port", "ip_family")),
    MetricSpec("pyproxy_endpoint_connections_in_flight", "gauge",
               "Established TCP connections this node DNATed to each endpoint of a service "
               "port, from conntrack; terminating: the endpoint is terminating (draining)",
               "connections in flight per endpoint: conntrack's ESTABLISHED entries DNATed "
               "through the service port, read at scrape time at most every "
               "inFlightInterval; endpoints with connections and every terminating one (0 "
               "when its drain is over), at most 5,000 series (docs/operating.md, "
               "\"Connections in flight\")",
               labels=("service", "port", "endpoint", "terminating")),
    MetricSpec("pyproxy_connections_in_flight_omitted", "gauge",
               "Endpoints with connections in flight left out of "
               "pyproxy_endpoint_connections_in_flight by its cap on series",
               "endpoints left out of the in-flight gauge (above 5,000 series, the smallest "
               "counts go first); `pyproxy services -o json` has them all"),
    MetricSpec("pyproxy_connections_in_flight_read_seconds", "gauge",
               "Seconds the last read of conntrack for the connections in flight took",
               "what the last conntrack read for the connections in flight cost (dump and "
               "count, both families); reads are at most 5 % of a CPU whatever it is"),
    MetricSpec("pyproxy_connections_in_flight_entries", "gauge",
               "DNATed TCP conntrack entries the last read for the connections in flight found",
               "DNATed TCP conntrack entries on the node at the last read, to any service or "
               "not"),
    MetricSpec("kubeproxy_nftables_localhost_nodeport_listeners", "gauge",
               "Number of active localhost NodePort userspace proxy listeners.",
               "TCP NodePorts the userspace proxy listens for on 127.0.0.1 / ::1 (KEP-6032; "
               "only with featureGates KubeProxyNFTablesLocalhostNodePorts on, as all three)",
               labels=("ip_family",)),
    MetricSpec("kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total",
               "counter",
               "Number of localhost NodePort userspace proxy listener creation failures.",
               "a loopback NodePort the proxy could not bind (a host process holds it); "
               "tried again at every sync", labels=("ip_family",)),
    MetricSpec("kubeproxy_nftables_localhost_nodeport_rejected_packets_total", "counter",
               "Number of packets rejected on localhost NodePorts. UDP and SCTP are always "
               "rejected; TCP is rejected when the localhost NodePort proxy is not running",
               "packets to a NodePort on loopback that nothing serves, rejected by the "
               "ruleset; read from the kernel at scrape time", labels=("ip_family", "protocol")),
    MetricSpec("process_cpu_seconds_total", "counter", "Total user and system CPU time spent "
               "in seconds.", "CPU time of the daemon", source=_PROCESS),
    MetricSpec("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
               "virtual memory of the daemon", source=_PROCESS),
    MetricSpec("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
               "resident memory of the daemon (docs/deploying.md, Sizing)", source=_PROCESS),
    MetricSpec("process_start_time_seconds", "gauge",
               "Start time of the process since unix epoch in seconds.",
               "when the daemon started", source=_PROCESS),
    MetricSpec("process_open_fds", "gauge", "Number of open file descriptors.",
               "open file descriptors", source=_PROCESS),
    MetricSpec("process_max_fds", "gauge", "Maximum number of open file descriptors.",
               "the file descriptor limit", source=_PROCESS),
)
_BY_NAME = {spec.name: spec for spec in SPECS}


def _spec(name: str) -> MetricSpec:
    return _BY_NAME[name]


def _counter(registry: CollectorRegistry, name: str) -> Counter:
    spec = _spec(name)
    return Counter(spec.family, spec.help, spec.labels, registry=registry)


def _gauge(registry: CollectorRegistry, name: str) -> Gauge:
    spec = _spec(name)
    return Gauge(spec.family, spec.help, spec.labels, registry=registry)


def _histogram(registry: CollectorRegistry, name: str,
               buckets: tuple[float, ...] = _SYNC_BUCKETS) -> Histogram:
    spec = _spec(name)
    return Histogram(spec.family, spec.help, spec.labels, buckets=buckets, registry=registry)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 started: float | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        # process_resident_memory_bytes, process_cpu_seconds_total, …: kube-proxy exports
        # them too, and memory and CPU alerts on the proxy are written against them.
        ProcessCollector(registry=r)
        # Trigger times from before this (wall clock) are not ours to measure (see below).
        self.started = time.time() if started is None else started
        self.sync_duration = _histogram(r, "kubeproxy_sync_proxy_rules_duration_seconds")
        self.sync_full_duration = _histogram(
            r, "kubeproxy_sync_full_proxy_rules_duration_seconds")
        self.sync_partial_duration = _histogram(
            r, "kubeproxy_sync_partial_proxy_rules_duration_seconds")
        self.last_sync = _gauge(r, "kubeproxy_sync_proxy_rules_last_timestamp_seconds")
        self.last_queued = _gauge(r, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds")
        self.network_programming = _histogram(
            r, "kubeproxy_network_programming_duration_seconds", _NPL_BUCKETS)
        self.endpoint_changes_pending = _gauge(
            r, "kubeproxy_sync_proxy_rules_endpoint_changes_pending")
        self.endpoint_changes_total = _counter(
            r, "kubeproxy_sync_proxy_rules_endpoint_changes_total")
        self.service_changes_pending = _gauge(
            r, "kubeproxy_sync_proxy_rules_service_changes_pending")
        self.service_changes_total = _counter(
            r, "kubeproxy_sync_proxy_rules_service_changes_total")
        self.sync_failures = _counter(
            r, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total")
        self.cleanup_failures = _counter(
            r, "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total")
        self.healthz = _counter(r, "kubeproxy_proxy_healthz_total")
        self.livez = _counter(r, "kubeproxy_proxy_livez_total")
        self.conntrack_deleted = _counter(
            r, "kubeproxy_conntrack_reconciler_deleted_entries_total")
        self.conntrack_duration = _histogram(
            r, "kubeproxy_conntrack_reconciler_sync_duration_seconds")
        # pyproxy's own
        self.departed_deleted = _counter(r, "pyproxy_departed_conntrack_entries_deleted_total")
        self.invalid_objects = _counter(r, "pyproxy_invalid_objects_total")
        self.sync_phase = _histogram(r, "pyproxy_sync_phase_duration_seconds")
        self.table_repairs = _counter(r, "pyproxy_table_repairs_total")
        self.table_replacements = _counter(r, "pyproxy_table_replacements_total")
        # 1 while the API server is reached through a Service address (the bootstrap trap:
        # that address works only while some proxy's rules for it are in the kernel).
        self.api_server_via_service = _gauge(r, "pyproxy_api_server_via_service_address")
        # Other tables' base chains that can drop our connections (kernel/basechains.py).
        self.other_table_drops = _gauge(r, "pyproxy_other_table_drop_chains")
        # Outlier ejection (sync/outliers.py): attempts failed, ejections decided.
        self.outlier_failed_attempts = _counter(r, "pyproxy_outlier_failed_attempts_total")
        self.outlier_ejections = _counter(r, "pyproxy_outlier_ejections_total")
        # Every request to the API server, as client-go counts them (cluster/apirequest.py).
        self.rest_client_requests = _counter(r, "rest_client_requests_total")
        self.rest_client_duration = _histogram(r, "rest_client_request_duration_seconds",
                                               _REST_CLIENT_BUCKETS)

    def request_done(self, method: str, host: str, code: str, seconds: float) -> None:
        """One request to the API server (cluster/apirequest.py's RequestObserver)."""
        self.rest_client_requests.labels(code=code, method=method, host=host).inc()
        self.rest_client_duration.labels(verb=method, host=host).observe(seconds)

    def watch_api(self, statuses: Callable[[], Iterable[WatchStatus]]) -> None:
        """Each watch's state, read at scrape time."""
        self.registry.register(_WatchCollector(statuses))

    def watch_localhost_nodeports(self, rejected: Callable[[], Mapping[tuple[str, str], int]]
                                  ) -> None:
        """KEP-6032's metrics, registered only with its gate on, as kube-proxy does:
        listeners and failed binds per family (set by serve/localhost.py through the
        callbacks below) and the packets the ruleset rejected per family and protocol,
        `rejected()` read from the kernel at scrape time."""
        r = self.registry
        self.localhost_listeners = _gauge(r, "kubeproxy_nftables_localhost_nodeport_listeners")
        self.localhost_listener_failures = _counter(
            r, "kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total")
        r.register(_RejectedCollector(rejected))

    def localhost_listener_callbacks(self, family: str
                                     ) -> tuple[Callable[[int], None], Callable[[], None]]:
        """(on_listeners, on_failure) for one family's LocalhostListeners."""
        gauge = self.localhost_listeners.labels(ip_family=family)
        failures = self.localhost_listener_failures.labels(ip_family=family)
        return gauge.set, failures.inc

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


def gauge_family(name: str) -> GaugeMetricFamily:
    """The gauge family of a row of SPECS (for a collector)."""
    spec = _spec(name)
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


class _SelectionCollector(Collector):
    def __init__(self, selections: Callable[[], Iterable[PortSelection]]) -> None:
        self.selections = selections

    def collect(self) -> Iterator[Metric]:
        no_local = gauge_family("kubeproxy_sync_proxy_rules_no_local_endpoints_total")
        topology = gauge_family("pyproxy_service_topology_mode")
        ejected = gauge_family("pyproxy_outlier_ejected_endpoints")
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
            if sel.outliers is not None and sel.outliers.ejected:
                ejected.add_metric([str(port.name.service), port.name.port, str(ps.family)],
                                   len(sel.outliers.ejected))
        for (policy, family), count in counts.items():
            no_local.add_metric([policy, family], count)
        yield no_local
        yield topology
        yield ejected


class _WatchCollector(Collector):
    def __init__(self, statuses: Callable[[], Iterable[WatchStatus]]) -> None:
        self.statuses = statuses

    def describe(self) -> Iterator[Metric]:
        yield gauge_family("pyproxy_watch_state")

    def collect(self) -> Iterator[Metric]:
        family = gauge_family("pyproxy_watch_state")
        for status in list(self.statuses()):
            for state in WATCH_STATES:
                family.add_metric([status.kind, state], 1 if status.state == state else 0)
        yield family


class _ConnectionCollector(Collector):
    def __init__(self, totals: Callable[[], Mapping[Series, int]]) -> None:
        self.totals = totals

    def _family(self) -> CounterMetricFamily:
        spec = _spec("pyproxy_endpoint_new_connections_total")
        return CounterMetricFamily(spec.family, spec.help, labels=list(spec.labels))

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


class RejectedPackets:
    """The packets the localhost NodePort reject chains counted, per (family, protocol),
    never going backwards: a full sync rewrites a chain and its counter starts from zero
    (kube-proxy's named counters survive that; an anonymous rule counter does not), so a
    reading lower than the last one banks the last one. Packets counted between the last
    read and the rewrite are lost."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self.read = read
        self.last: dict[tuple[str, str], int] = {}
        self.banked: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    def __call__(self) -> dict[tuple[str, str], int]:
        with self.lock:
            for key, now in self.read().items():
                if now < self.last.get(key, 0):
                    self.banked[key] = self.banked.get(key, 0) + self.last[key]
                self.last[key] = now
            return {key: self.banked.get(key, 0) + value for key, value in self.last.items()}


class _RejectedCollector(Collector):
    def __init__(self, rejected: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self.rejected = rejected

    def _family(self) -> CounterMetricFamily:
        spec = _spec("kubeproxy_nftables_localhost_nodeport_rejected_packets_total")
        return CounterMetricFamily(spec.family, spec.help, labels=list(spec.labels))

    def describe(self) -> Iterator[Metric]:
        yield self._family()  # registering must not read the kernel

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        try:
            rejected = self.rejected()
        except Exception as err:  # the rest of /metrics must still answer
            log.warning("localhost_nodeport_counters_not_read", error=str(err))
            rejected = {}
        for (ip_family, protocol), packets in sorted(rejected.items()):
            family.add_metric([ip_family, protocol], packets)
        yield family


# ---------------------------------------------------------------------------------------------
# Reference documentation (docs/metrics.md is this function's output)

_DOC_INTRO = """\
# Metrics

<!-- Generated by pyproxy.serve.metrics.reference_markdown(); regenerate with
     `python -m pyproxy.serve.metrics > docs/metrics.md`. tests/test_metrics_reference.py
     checks it, and checks the table against what the daemon exports. -->

`pyproxy run` serves Prometheus metrics on `metricsBindAddress` (default `127.0.0.1:10249`,
`/metrics`): kube-proxy's names where kube-proxy has the metric, so its dashboards and alerts
keep working, and pyproxy's own under `pyproxy_`. Counters are exposed with `_total`,
histograms with `_bucket`, `_sum` and `_count`.

## Scraping with the Prometheus Operator

`manifests/monitoring/` (not applied by `kubectl apply -k manifests/`):

- `service.yaml`: a headless Service `pyproxy-metrics` over the pods' port 10249;
- `servicemonitor.yaml`: a ServiceMonitor scraping it every 30 s, with the node's name as the
  label `node`;
- `prometheusrule.yaml`: the alerts below.

The default `metricsBindAddress` is the node's loopback, which nothing off the node can
reach: set `metricsBindAddress: 0.0.0.0:10249` in the configuration (`02-configmap.yaml`, or
kubeadm's ConfigMap) to scrape it, knowing that the metrics describe the cluster's Services
(limit who reaches port 10249). Then `kubectl apply -k manifests/monitoring/`.

{alerts}

## The API connection

Every request to the API server is counted as client-go counts kube-proxy's
(`rest_client_requests_total`, `rest_client_request_duration_seconds`), and each watch's state
is `pyproxy_watch_state`. A watch that has had no answer for more than **2 minutes** (twice the
longest pause between tries, 30-60 s, so a server that is back has been tried again within it)
makes `pyproxy status` exit 1 with a line `api watches: FAILING: watch KIND disconnected for N
s …: REASON` (a 403's RBAC message, a TLS failure); the rules programmed before stay in place
meanwhile, so /healthz does not fail for it. The log says the same at each try
(`api_unavailable_retrying`, its `error` the reason whole, docs/logging.md).

Prometheus' `promtool` checks the rules (`promtool check rules`) and runs a unit test of each
alert (`promtool test rules`): tests/monitoring/rules_test.yaml has a case where it fires, with
its labels and annotations, and one where it stays quiet, on series that
tests/test_metrics_reference.py checks are what the daemon exports (names as Prometheus
stores them, labels those series carry or the scrape adds). To run them by hand, write the
PrometheusRule's `spec` as a rule file `pyproxy.rules.yaml` beside a copy of the test file,
then `promtool test rules rules_test.yaml` (`make tools` builds promtool).

## Every metric
"""


def reference_markdown(rules: Mapping[str, Any]) -> str:
    """docs/metrics.md: every metric pyproxy exports, with its type, labels and meaning, and
    the alerts of `rules` (manifests/monitoring/prometheusrule.yaml, a PrometheusRule)."""
    alerts = ["| alert | expression | for | severity |", "| --- | --- | --- | --- |"]
    for group in rules["spec"]["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"].replace("|", "\\|")
            alerts.append(f"| `{rule['alert']}` | `{expr}` | {rule.get('for', '—')} | "
                          f"{rule['labels']['severity']} |")
    lines = [_DOC_INTRO.format(alerts="\n".join(alerts)),
             "| metric | type | labels | meaning | from |", "| --- | --- | --- | --- | --- |"]
    for spec in SPECS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        source = ("kube-proxy's name" if spec.name.startswith("kubeproxy_")
                  else "pyproxy" if spec.source == "pyproxy" else spec.source)
        lines.append(f"| `{spec.name}` | {spec.type} | {labels} | {spec.meaning} | {source} |")
    return "\n".join(lines) + "\n"


RULES_FILE = Path(__file__).resolve().parents[2] / "manifests/monitoring/prometheusrule.yaml"

if __name__ == "__main__":
    print(reference_markdown(yaml.safe_load(RULES_FILE.read_text())), end="")
