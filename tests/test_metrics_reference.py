"""The metrics reference (docs/metrics.md), the example ServiceMonitor and the alert rules
(manifests/monitoring/), checked against what the daemon exports (issue 27, point 8).

"What the daemon exports" is a scrape of a real `Metrics` (the daemon's, with its scrape-time
collectors), every labelled metric given a series, parsed back from the exposition format:
the names and labels Prometheus would store.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyproxy.cluster.snapshot import build_state
from pyproxy.cluster.watchstate import WatchStatus
from pyproxy.core.topology import PortSelection, select_all
from pyproxy.serve.connections import Series
from pyproxy.serve.metrics import RULES_FILE, SPECS, Metrics, reference_markdown
from testkit.builders import ep, make_node, make_service, make_slice

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
DOC = ROOT / "docs" / "metrics.md"
# Labels a series gets from the scrape rather than from pyproxy: Prometheus's own, the
# Prometheus Operator's target labels, and the ServiceMonitor's relabeling (node).
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint",
                 "node"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*(\()?")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset"}


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES_FILE.read_text())
    return [rule for group in document["spec"]["groups"] for rule in group["rules"]]


def selections() -> list[PortSelection]:
    """A PreferClose service on node-a: a topology mode in force, so that series exists."""
    service = make_service("demo", "web")
    service["spec"]["trafficDistribution"] = "PreferClose"
    state = build_state([make_node("node-a", "zone-1"), service, make_slice("demo", "web", [
        ep("10.244.0.2", "node-a", "zone-1", zones=["zone-1"])])])
    return list(select_all(state, "node-a"))


def scrape() -> dict[str, set[str]]:
    """Every sample name the daemon's registry exposes, with the labels its series carry."""
    metrics = Metrics()
    metrics.watch_selections(selections)
    metrics.watch_connections(lambda: {Series("demo/web", "http", "10.244.1.5:8080", "node"): 1})
    metrics.watch_localhost_nodeports(lambda: {("IPv4", "UDP"): 1})  # the gate's default: on
    metrics.watch_api(lambda: [WatchStatus("Service")])
    for attribute in vars(metrics).values():  # one series per labelled metric
        if isinstance(attribute, (Counter, Gauge, Histogram)):
            spec = next(s for s in SPECS if s.family == attribute.describe()[0].name)
            if spec.labels:
                attribute.labels(**dict.fromkeys(spec.labels, "x"))
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The series selectors of a PromQL expression: metric name and label matchers. Only the
    shapes the rules use (functions, aggregations with by, binary operators)."""
    text = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    text = GROUPING.sub(" ", text)
    found = []
    for name, matchers, call in SELECTOR.findall(text):
        if call or name in KEYWORDS:
            continue
        labels = dict(re.findall(r'(\w+)\s*!?=~?\s*"([^"]*)"', matchers))
        found.append((name, labels))
    return found


def test_reference_doc_matches_the_code() -> None:
    """docs/metrics.md is reference_markdown()'s output (regenerate with
    `python -m pyproxy.serve.metrics > docs/metrics.md`)."""
    assert reference_markdown(yaml.safe_load(RULES_FILE.read_text())) == DOC.read_text()


def test_the_reference_lists_exactly_what_the_daemon_exports() -> None:
    """Every metric family of a scrape is a row of SPECS, with its type, and every row is
    exported."""
    metrics = Metrics()
    metrics.watch_selections(list)
    metrics.watch_connections(dict)
    metrics.watch_localhost_nodeports(dict)  # as the daemon with the gate on, the default
    metrics.watch_api(list)  # as the daemon fed by the API server
    exported = {family.name: family.type for family in metrics.registry.collect()}
    assert exported == {spec.family: spec.type for spec in SPECS}


def test_labels_are_the_references() -> None:
    samples = scrape()
    for spec in SPECS:
        name = spec.name if spec.type != "histogram" else f"{spec.name}_count"
        assert samples[name] == set(spec.labels), spec.name


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_alert_selects_what_the_daemon_exports(rule: dict[str, Any]) -> None:
    """Each metric the expression selects is exported under that name, each label it matches
    or groups by is one its series carry or the scrape adds, rate/increase only over counters
    and histogram buckets, histogram_quantile only over buckets."""
    expr = rule["expr"]
    samples = scrape()
    found = selectors(expr)
    assert found, expr
    for name, matchers in found:
        assert name in samples, f"{rule['alert']}: {name} is not exported"
        assert set(matchers) <= samples[name] | TARGET_LABELS, (name, matchers)
        assert matchers.get("job") == "pyproxy-metrics", "scoped to pyproxy's scrape job"
    for _, grouping in GROUPING.findall(expr):
        labels = {label.strip() for label in grouping.split(",")}
        assert labels <= set.union(*(samples[n] for n, _ in found)) | TARGET_LABELS, grouping
    for function, name in re.findall(r"\b(rate|increase|irate)\(\s*([A-Za-z_:][\w:]*)", expr):
        assert name.endswith(("_total", "_bucket", "_count", "_sum")), (function, name)
    for name in re.findall(r"histogram_quantile\([^,]+,.*?([A-Za-z_:][\w:]*_bucket)", expr):
        assert name in samples
    assert rule["labels"]["severity"] in ("critical", "warning")
    assert {"summary", "description"} <= set(rule["annotations"])


def test_selector_parser() -> None:
    """The checker's own parser finds selectors and skips functions, keywords and groupings."""
    assert selectors('histogram_quantile(0.99, sum by (node, le) (rate(a_bucket{job="j"}'
                     '[5m]))) > 3 and b_total{code="503",job="j"} - c') == [
        ("a_bucket", {"job": "j"}), ("b_total", {"code": "503", "job": "j"}), ("c", {})]


def test_service_monitor_reaches_the_daemonsets_pods() -> None:
    """The Service selects the DaemonSet's pods on the metrics port, and the ServiceMonitor
    selects the Service and its port by name, in the same namespace."""
    service = yaml.safe_load((MONITORING / "service.yaml").read_text())
    monitor = yaml.safe_load((MONITORING / "servicemonitor.yaml").read_text())
    rule = yaml.safe_load(RULES_FILE.read_text())
    daemonset = yaml.safe_load((ROOT / "manifests" / "03-daemonset.yaml").read_text())
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", 10249, 10249)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [
        service["metadata"]["namespace"]]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1",
                                                        "ServiceMonitor")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    # The job label the alerts match is the Service's name (the Operator's default).
    assert service["metadata"]["name"] == "pyproxy-metrics"


class Instant:
    """One target's unlabelled series at one instant, for `evaluate`: a value, or None for an
    empty result (no series, or filtered out by a comparison)."""

    def __init__(self, value: float | None) -> None:
        self.value = value

    def _both(self, other: Instant | float) -> tuple[float | None, float | None]:
        return self.value, other.value if isinstance(other, Instant) else other

    def __sub__(self, other: Instant | float) -> Instant:
        a, b = self._both(other)
        return Instant(None if a is None or b is None else a - b)

    def __rsub__(self, other: float) -> Instant:
        return Instant(None if self.value is None else other - self.value)

    def _filter(self, other: Instant | float, keep: Callable[[float, float], bool]) -> Instant:
        a, b = self._both(other)
        return Instant(a if a is not None and b is not None and keep(a, b) else None)

    def __gt__(self, other: Instant | float) -> Instant:  # type: ignore[override]
        return self._filter(other, lambda a, b: a > b)

    def __eq__(self, other: object) -> Instant:  # type: ignore[override]
        assert isinstance(other, (Instant, int, float))
        return self._filter(other, lambda a, b: a == b)

    def __and__(self, other: Instant) -> Instant:
        return Instant(self.value if other.value is not None else None)

    def __or__(self, other: Instant) -> Instant:
        return self if self.value is not None else other


def evaluate(expr: str, series: Mapping[str, float], now: float) -> float | None:
    """An instant query over one target's unlabelled series (PromQL's `-`, `>`, `==`, `and`,
    `or`, `time()`), for the rules that use only those: each selector is the series' value,
    and `and`/`or` become Python's `&`/`|`, which bind tighter than PromQL's: the rule
    parenthesizes each side of them (asserted)."""
    for operator in (" and ", " or "):
        for side in expr.split(operator)[1:]:
            assert side.lstrip().startswith("("), f"parenthesize {side!r}"
    text = expr.replace("time()", f"Instant({now!r})")
    text = re.sub(r"([A-Za-z_:][\w:]*)\{[^}]*\}",
                  lambda m: f"Instant(series.get({m.group(1)!r}))", text)
    text = text.replace(" and ", " & ").replace(" or ", " | ")
    result = eval(text, {"Instant": Instant, "series": series})  # the rule file, ours
    return result.value if isinstance(result, Instant) else None


def stalled_rule() -> str:
    return next(rule["expr"] for rule in rules() if rule["alert"] == "PyproxySyncStalled")


def fresh_daemon_series() -> dict[str, float]:
    """What a daemon that has never listed exports: its Metrics as built, nothing observed."""
    registry = Metrics().registry
    names = ("kubeproxy_sync_proxy_rules_last_timestamp_seconds",
             "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
             "process_start_time_seconds")
    return {name: registry.get_sample_value(name) or 0.0 for name in names}


def test_the_stalled_sync_alert_fires_on_a_node_that_never_listed() -> None:
    """Both sync timestamps of a daemon that never listed are 0: their difference alone (the
    rule before) never fired, however long the API server refused it."""
    series = fresh_daemon_series()
    started = series["process_start_time_seconds"]
    assert started > 0 and series["kubeproxy_sync_proxy_rules_last_timestamp_seconds"] == 0
    assert evaluate(stalled_rule(), series, started + 300) == pytest.approx(300)
    assert evaluate(stalled_rule(), series, started + 30) is None  # starting: not yet


@pytest.mark.parametrize(("last_sync", "last_queued", "fires"), [
    pytest.param(990.0, 995.0, False, id="synced 10 s ago, a change queued since: well"),
    pytest.param(900.0, 980.0, True, id="a change waiting 80 s past the last sync"),
    pytest.param(100.0, 50.0, False, id="nothing queued since a sync long ago: well"),
])
def test_the_stalled_sync_alert_on_a_node_that_synced(last_sync: float, last_queued: float,
                                                      fires: bool) -> None:
    series = {"kubeproxy_sync_proxy_rules_last_timestamp_seconds": last_sync,
              "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": last_queued,
              "process_start_time_seconds": 10.0}
    assert (evaluate(stalled_rule(), series, 1000.0) is not None) == fires
