"""Prometheus metrics under kube-proxy's names (reference §5.3), fed the way the daemon feeds
them: serve/reporting.py's SyncReporting hearing about syncs, and the scrape-time collector
reading the selections in force."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import generate_latest

from pyproxy.cluster.cache import Checkout, ClusterCache
from pyproxy.core.model import ANNOTATION_TRIGGER_TIME, IPFamily, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope
from pyproxy.core.topology import PortSelection
from pyproxy.kernel.libnftables import NftError
from pyproxy.serve.health import ProxyHealth
from pyproxy.serve.metrics import Metrics
from pyproxy.serve.reporting import SyncReporting
from pyproxy.sync.node import NodeProxier, SyncRecord
from pyproxy.sync.proxier import FamilyProxier, select_and_render
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fakes import FakeNft

V4, V6 = IPFamily.IPv4, IPFamily.IPv6
NODE = NodeConfig("node-a", node_ips=("192.168.50.1",))
WEB, DB = ServiceKey("ns", "web"), ServiceKey("ns", "db")
START = 1_700_000_000.0
Obj = dict[str, Any]


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def exposition(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def types(metrics: Metrics) -> dict[str, str]:
    """Metric name → type, as a Prometheus server scraping us reads them."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition(metrics), re.MULTILINE))


def value(metrics: Metrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def buckets(metrics: Metrics, name: str) -> list[float]:
    return [float(le) for le in re.findall(
        rf'^{name}_bucket{{le="([^"]+)"}}', exposition(metrics), re.MULTILINE)
        if le != "+Inf"]


def make_proxier(families: tuple[IPFamily, ...] = (V4,),
                 metrics: Metrics | None = None) -> tuple[NodeProxier, FakeNft]:
    """A proxier on a fake kernel; with `metrics`, reporting its syncs to them as the
    daemon's does (its first observer)."""
    nft = FakeNft()
    observers = [] if metrics is None else [SyncReporting(ProxyHealth(families), metrics)]
    proxier = NodeProxier(ClusterCache("node-a"), [FamilyProxier(f, NODE, nft) for f in families],
                          observers=observers)
    return proxier, nft


def initialized(proxier: NodeProxier) -> NodeProxier:
    for source in ("Service", "EndpointSlice"):
        proxier.expect(source)
        proxier.source_synced(source)
    return proxier


def record(full: bool, render: float = 0.0, diff: float = 0.0, kernel: float = 0.0,
           started: float = START, error: str | None = None) -> SyncRecord:
    return SyncRecord(started=started, scope=Scope.FULL if full else Scope.CHANGED,
                      cause=Cause.START if full else Cause.CHANGES,
                      services_changed=0, endpoints_changed=0, render_seconds=render,
                      diff_seconds=diff, kernel_seconds=kernel, commands=1, error=error)


def checkout(services: int = 0, endpoints: int = 0, trigger_times: tuple[str, ...] = ()
             ) -> Checkout:
    return Checkout(frozenset(), False, services, endpoints, trigger_times)


# ---------------------------------------------------------------------------------------------
# Names and types


KUBE_PROXY_METRICS = {
    "kubeproxy_sync_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_full_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": "gauge",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": "gauge",
    "kubeproxy_network_programming_duration_seconds": "histogram",
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": "gauge",
    "kubeproxy_sync_proxy_rules_endpoint_changes_total": "counter",
    "kubeproxy_sync_proxy_rules_service_changes_pending": "gauge",
    "kubeproxy_sync_proxy_rules_service_changes_total": "counter",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": "gauge",
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total": "counter",
    "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total": "counter",
    "kubeproxy_proxy_healthz_total": "counter",
    "kubeproxy_proxy_livez_total": "counter",
    "kubeproxy_conntrack_reconciler_deleted_entries_total": "counter",
}


def test_kube_proxy_names_and_types() -> None:
    metrics = Metrics()
    metrics.watch_selections(list)
    exported = types(metrics)
    for name, kind in KUBE_PROXY_METRICS.items():
        assert exported.get(name) == kind, name
    # The process's, under the standard names kube-proxy exports as well.
    assert exported["process_resident_memory_bytes"] == "gauge"
    assert exported["process_cpu_seconds_total"] == "counter"
    assert re.search(r"^process_resident_memory_bytes [1-9]", exposition(metrics), re.MULTILINE)
    # pyproxy's own are prefixed, never in kube-proxy's namespace (client-go's rest_client_*
    # are kube-proxy's too).
    own = {name for name in exported
           if not name.startswith(("kubeproxy_", "process_", "rest_client_"))}
    assert own and all(name.startswith("pyproxy_") for name in own)
    assert exported["pyproxy_service_topology_mode"] == "gauge"
    # iptables-only metrics would tell users something about rules we do not write.
    assert not any("iptables" in name for name in exported)


def test_histogram_buckets_are_upstreams() -> None:
    metrics = Metrics()
    sync = [0.001 * 2**i for i in range(15)]  # ExponentialBuckets(0.001, 2, 15)
    for name in ("kubeproxy_sync_proxy_rules_duration_seconds",
                 "kubeproxy_sync_full_proxy_rules_duration_seconds",
                 "kubeproxy_sync_partial_proxy_rules_duration_seconds"):
        assert buckets(metrics, name) == pytest.approx(sync)
    # client-go's (k8s.io/component-base metrics/prometheus/restclient)
    metrics.request_done("GET", "10.0.0.1:6443", "200", 0.01)
    client_go = re.findall(r'^rest_client_request_duration_seconds_bucket'
                           r'{host="10.0.0.1:6443",le="([^"]+)",verb="GET"}',
                           exposition(metrics), re.MULTILINE)
    assert [float(le) for le in client_go if le != "+Inf"] == pytest.approx(
        [0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0])
    # 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5, 120..300 s by 30 (pkg/proxy/metrics).
    npl = [0.25, 0.5, *range(1, 60), *range(60, 120, 5), *range(120, 301, 30)]
    assert buckets(metrics, "kubeproxy_network_programming_duration_seconds") == npl


# ---------------------------------------------------------------------------------------------
# What a sync records


def test_synced_records_durations_timestamps_and_changes() -> None:
    metrics = Metrics()
    proxier, _ = make_proxier(metrics=metrics)
    observer = proxier.observers[0]
    observer.synced(proxier, record(True, render=0.010, diff=0.002, kernel=0.020), checkout(2, 3))
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_sum") == \
        pytest.approx(0.032)
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket",
                 le="0.016") == 0
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket",
                 le="0.064") == 1
    assert value(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == \
        pytest.approx(START + 0.032)
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 3

    observer.synced(proxier, record(False, kernel=0.004, started=START + 10), checkout(0, 1))
    assert value(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds_sum") == \
        pytest.approx(0.004)
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 2
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == \
        pytest.approx(START + 10.004)
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 4
    for phase in ("render", "diff", "kernel"):
        assert value(metrics, "pyproxy_sync_phase_duration_seconds_count", phase=phase) == 2


def test_queued_changes_are_pending_until_a_sync() -> None:
    metrics = Metrics()
    proxier, _ = make_proxier(metrics=metrics)
    initialized(proxier)
    before = time.time()
    proxier.on_service(("ns", "web"), make_service("ns", "web"))
    proxier.on_service(("ns", "db"), make_service("ns", "db", ip="10.96.0.20"))
    proxier.on_slice(("ns", "web-1"), make_slice("ns", "web", [ep("10.244.1.1", "node-b")],
                                                 name="web-1"))
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 2
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 1
    queued = value(metrics, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds")
    assert before <= queued <= time.time()
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == 0
    proxier.sync()
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 1
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") >= before
    # The next change is a partial sync.
    proxier.on_slice(("ns", "web-1"), make_slice("ns", "web", [ep("10.244.1.2", "node-b")],
                                                 name="web-1"))
    proxier.sync()
    assert value(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 2


def test_failed_syncs_are_counted_and_are_not_a_sync() -> None:
    metrics = Metrics()
    proxier, nft = make_proxier(metrics=metrics)
    initialized(proxier)
    proxier.on_service(("ns", "web"), make_service("ns", "web"))
    nft.fail_next = 2  # the full sync, and the table replacement it then tries
    with pytest.raises(NftError):
        proxier.sync()
    assert value(metrics, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") == 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 0
    proxier.sync()  # the retry, a full sync
    assert value(metrics, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total") == 1
    assert value(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0


# ---------------------------------------------------------------------------------------------
# Network programming latency


def npl(metrics: Metrics) -> tuple[float, float]:
    name = "kubeproxy_network_programming_duration_seconds"
    return value(metrics, f"{name}_count"), value(metrics, f"{name}_sum")


def test_network_programming_latency_from_trigger_times() -> None:
    metrics = Metrics(started=START - 3600)
    proxier, _ = make_proxier(metrics=metrics)
    observer = proxier.observers[0]
    commit = START + 0.5  # started + seconds of the record below
    observer.synced(proxier, record(False, kernel=0.5), checkout(0, 2, (
        rfc3339(START - 2),  # 2.5 s
        "2023-11-14T22:13:19.000000001Z",  # RFC3339Nano from Go: 1.5 s (ns truncated)
        "2023-11-15T00:13:19+02:00",  # the same instant in another zone: 1.5 s
    )))
    count, total = npl(metrics)
    assert count == 3 and total == pytest.approx(3 * commit - (START - 2) - 2 * (START - 1),
                                                 abs=1e-5)
    assert value(metrics, "kubeproxy_network_programming_duration_seconds_bucket",
                 le="2.0") == 2
    assert value(metrics, "kubeproxy_network_programming_duration_seconds_bucket",
                 le="3.0") == 3


@pytest.mark.parametrize("text", [
    "garbage",
    "",
    "2023-11-14T22:13:19",  # no zone: Go's RFC 3339 parse rejects it (not "local time")
    "2023-11-14",
    "2023-11-14 22:13:19Z",  # not RFC 3339's T
    "20231114T221319Z",  # ISO 8601 basic format
    "2023-13-14T22:13:19Z",  # no 13th month
    "2023-11-14T22:13:25Z",  # after the commit (clock skew): no negative latency
    "2023-11-14T21:13:19Z",  # before the proxy started: the initial list, not our doing
])
def test_unusable_trigger_times_are_ignored(text: str) -> None:
    metrics = Metrics(started=START - 600)
    metrics.observe_trigger_times([text], START + 1)
    assert npl(metrics) == (0, 0)


def test_trigger_times_arrive_from_endpoint_slices() -> None:
    metrics = Metrics(started=time.time() - 60)
    proxier, _ = make_proxier(metrics=metrics)
    initialized(proxier)
    changed = time.time() - 2

    def annotated(when: str) -> Callable[[Obj], None]:
        return lambda s: s["metadata"].setdefault("annotations", {}).update(
            {ANNOTATION_TRIGGER_TIME: when})

    proxier.on_service(("ns", "web"), make_service("ns", "web"))
    proxier.on_slice(("ns", "web-1"), make_slice(
        "ns", "web", [ep("10.244.1.1", "node-b")], annotated(rfc3339(changed)), name="web-1"))
    proxier.on_slice(("ns", "web-2"), make_slice(
        "ns", "web", [ep("10.244.1.2", "node-b")], annotated("not a time"), name="web-2"))
    proxier.sync()
    count, total = npl(metrics)
    assert count == 1 and 2 <= total < 60


# ---------------------------------------------------------------------------------------------
# Computed at scrape time from the selections in force


def lb(policy: str = "Local", hcnp: int = 32000) -> Callable[[Obj], None]:
    def tweak(svc: Obj) -> None:
        svc["spec"].update(type="LoadBalancer", externalTrafficPolicy=policy,
                           ports=[{"name": "http", "port": 80, "targetPort": 8080,
                                   "nodePort": 30080}])
        if policy == "Local":
            svc["spec"]["healthCheckNodePort"] = hcnp
    return tweak


def itp_local(svc: Obj) -> None:
    svc["spec"]["internalTrafficPolicy"] = "Local"


def lb_cluster_itp_local(svc: Obj) -> None:
    lb("Cluster")(svc)
    itp_local(svc)


def prefer_close(svc: Obj) -> None:
    svc["spec"]["trafficDistribution"] = "PreferClose"


def cluster_objects() -> list[tuple[str, Obj]]:
    """Services whose selections on node-a (zone-1) the metrics describe."""
    remote = [ep("10.244.1.1", "node-b", "zone-1")]
    return [
        ("Node", make_node("node-a", "zone-1")),
        # iTP=Local, endpoints only elsewhere: cluster-IP traffic dropped here.
        ("Service", make_service("ns", "itp", itp_local, ip="10.96.0.11")),
        ("EndpointSlice", make_slice("ns", "itp", remote)),
        # eTP=Local, endpoints only elsewhere: external traffic dropped here.
        ("Service", make_service("ns", "etp", lb(), ip="10.96.0.12")),
        ("EndpointSlice", make_slice("ns", "etp", remote)),
        # eTP=Local with a local endpoint: fine.
        ("Service", make_service("ns", "etp-ok", lb(hcnp=32001), ip="10.96.0.13")),
        ("EndpointSlice", make_slice("ns", "etp-ok", [ep("10.244.0.1", "node-a", "zone-1")])),
        # No endpoints at all: rejected, which is not "no local endpoints".
        ("Service", make_service("ns", "empty", itp_local, ip="10.96.0.14")),
        # iTP=Local but eTP=Cluster LB with remote endpoints: internal only.
        ("Service", make_service("ns", "both", lb_cluster_itp_local, ip="10.96.0.15")),
        ("EndpointSlice", make_slice("ns", "both", remote)),
        # Topology-aware: every endpoint hinted for zone-1.
        ("Service", make_service("ns", "topo", prefer_close, ip="10.96.0.16")),
        ("EndpointSlice", make_slice("ns", "topo", [
            ep("10.244.0.2", "node-a", "zone-1", zones=["zone-1"]),
            ep("10.244.2.1", "node-c", "zone-2", zones=["zone-2"])])),
    ]


def load(cache: ClusterCache, objects: Iterable[tuple[str, Obj]]) -> None:
    for kind, obj in objects:
        meta = obj["metadata"]
        if kind == "Node":
            cache.set_node(meta["name"], obj)
        elif kind == "Service":
            cache.set_service((meta["namespace"], meta["name"]), obj)
        else:
            cache.set_slice((meta["namespace"], meta["name"]), obj)


def scrape(selections: Callable[[], Iterable[PortSelection]]) -> Metrics:
    metrics = Metrics()
    metrics.watch_selections(selections)
    return metrics


def no_local(metrics: Metrics, policy: str, family: str = "IPv4") -> float:
    found = metrics.registry.get_sample_value(
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        {"traffic_policy": policy, "ip_family": family})
    assert found is not None  # always exported, 0 included
    return found


def topology_modes(metrics: Metrics) -> dict[tuple[str, str, str], str]:
    out: dict[tuple[str, str, str], str] = {}
    for family in metrics.registry.collect():
        if family.name == "pyproxy_service_topology_mode":
            for sample in family.samples:
                labels = sample.labels
                assert sample.value == 1
                out[(labels["service"], labels["port"], labels["ip_family"])] = labels["mode"]
    return out


def test_no_local_endpoints_and_topology_from_selections() -> None:
    cache = ClusterCache("node-a")
    load(cache, cluster_objects())
    _, selections = select_and_render(cache.state(), NODE, V4)
    metrics = scrape(lambda: list(selections.values()))
    assert no_local(metrics, "internal") == 2  # itp, both
    assert no_local(metrics, "external") == 1  # etp
    assert topology_modes(metrics) == {("ns/topo", "http", "IPv4"): "PreferSameZone"}
    assert 'traffic_policy="internal"' in exposition(metrics)


def test_nothing_selected_exports_zeros() -> None:
    metrics = scrape(list)
    assert no_local(metrics, "internal") == 0 and no_local(metrics, "external") == 0
    assert topology_modes(metrics) == {}


def test_the_collector_follows_the_proxier_between_syncs() -> None:
    metrics = Metrics()
    proxier, _ = make_proxier(metrics=metrics)
    initialized(proxier)
    metrics.watch_selections(proxier.current_selections)
    for kind, obj in cluster_objects():
        meta = obj["metadata"]
        if kind == "Node":
            proxier.on_node(("", meta["name"]), obj)
        elif kind == "Service":
            proxier.on_service((meta["namespace"], meta["name"]), obj)
        else:
            proxier.on_slice((meta["namespace"], meta["name"]), obj)
    assert no_local(metrics, "internal") == 0  # nothing programmed yet
    proxier.sync()
    assert (no_local(metrics, "internal"), no_local(metrics, "external")) == (2, 1)
    assert topology_modes(metrics) == {("ns/topo", "http", "IPv4"): "PreferSameZone"}
    # A local endpoint appears for itp; etp goes away; topo loses its hints.
    proxier.on_slice(("ns", "itp-ipv4"), make_slice("ns", "itp", [
        ep("10.244.0.9", "node-a", "zone-1")]))
    proxier.on_service(("ns", "etp"), None)
    proxier.on_slice(("ns", "topo-ipv4"), make_slice("ns", "topo", [
        ep("10.244.0.2", "node-a", "zone-1"), ep("10.244.2.1", "node-c", "zone-2")]))
    assert (no_local(metrics, "internal"), no_local(metrics, "external")) == (2, 1)
    proxier.sync()
    assert (no_local(metrics, "internal"), no_local(metrics, "external")) == (1, 0)
    assert topology_modes(metrics) == {}


# ---------------------------------------------------------------------------------------------
# pyproxy's own


def test_invalid_objects_counter() -> None:
    """`pyproxy_invalid_objects_total{kind}`, fed through NodeProxier.on_invalid as run_daemon
    wires it."""
    proxier, _ = make_proxier()
    metrics = Metrics()
    proxier.on_invalid.append(lambda s: metrics.invalid_objects.labels(kind=s.kind).inc())
    assert types(metrics)["pyproxy_invalid_objects_total"] == "counter"
    bad_port = make_service("ns", "bad", lambda s: s["spec"].update(
        ports=[{"name": "http", "port": "eighty"}]))
    proxier.on_service(("ns", "bad"), bad_port)
    proxier.on_service(("ns", "bad"), bad_port)
    proxier.on_slice(("ns", "bad-1"), make_slice(
        "ns", "web", [ep("10.244.1.999", "node-b")], name="bad-1"))
    assert value(metrics, "pyproxy_invalid_objects_total", kind="Service") == 2
    assert value(metrics, "pyproxy_invalid_objects_total", kind="EndpointSlice") == 1
    assert proxier.skipped_total == {"Service": 2, "EndpointSlice": 1}


def test_health_answers_are_counted() -> None:
    metrics = Metrics()
    for path, code in (("/healthz", 200), ("/healthz", 503), ("/livez", 200), ("/healthz", 200)):
        metrics.count_health(path, code)
    assert value(metrics, "kubeproxy_proxy_healthz_total", code="200") == 2
    assert value(metrics, "kubeproxy_proxy_healthz_total", code="503") == 1
    assert value(metrics, "kubeproxy_proxy_livez_total", code="200") == 1
    assert value(metrics, "kubeproxy_proxy_livez_total", code="503") == 0
