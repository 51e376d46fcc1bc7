"""The metrics reference (docs/metrics.md), the example ServiceMonitor and the alert rules
(manifests/monitoring/), checked against what the daemon exports (issue 27, point 8).

"What the daemon exports" is a scrape of a real `Metrics` (the daemon's, with its scrape-time
collectors), every labelled metric given a series, parsed back from the exposition format:
the names and labels Prometheus would store.

The alert rules are Prometheus' to check: `promtool check rules` on them, and `promtool test
rules` with tests/monitoring/rules_test.yaml, a case per alert where it fires and one where it
stays quiet, on series checked here to be what the daemon exports (promtool: `make tools`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyproxy.cluster.snapshot import build_state
from pyproxy.cluster.watchstate import WatchStatus
from pyproxy.core.inflight import EndpointInFlight, InFlight, Load, PortInFlight
from pyproxy.core.model import IPFamily, Protocol, ServicePortName
from pyproxy.core.outliers import Ejection, PortOutliers
from pyproxy.core.topology import PortSelection, select_all
from pyproxy.serve.connections import Series
from pyproxy.serve.live import InFlightCollector
from pyproxy.serve.metrics import RULES_FILE, SPECS, Metrics, reference_markdown
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import require_tool

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
DOC = ROOT / "docs" / "metrics.md"
# Labels a series gets from the scrape rather than from pyproxy: Prometheus's own, the
# Prometheus Operator's target labels, and the ServiceMonitor's relabeling (node).
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint",
                 "node"}
# promtool's unit tests of every alert (`promtool test rules`), run on the PrometheusRule's
# groups written as a rule file beside them.
RULE_TESTS = ROOT / "tests" / "monitoring" / "rules_test.yaml"
# A series in promtool's notation: name{label="value",...}.
SERIES = re.compile(r'([A-Za-z_:][\w:]*)\{(.*)\}')


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES_FILE.read_text())
    return [rule for group in document["spec"]["groups"] for rule in group["rules"]]


def selections() -> list[PortSelection]:
    """A PreferClose service on node-a: a topology mode in force, and an endpoint ejected,
    so that those series exist."""
    service = make_service("demo", "web")
    service["spec"]["trafficDistribution"] = "PreferClose"
    state = build_state([make_node("node-a", "zone-1"), service, make_slice("demo", "web", [
        ep("10.244.0.2", "node-a", "zone-1", zones=["zone-1"])])])
    ejected = PortOutliers({"10.244.0.2:8080": Ejection("failing", 0.0, 30.0, 1)})
    return [replace(ps, selection=replace(ps.selection, outliers=ejected))
            for ps in select_all(state, "node-a")]


WEB = ServicePortName("demo", "web", "http", Protocol.TCP)


def scrape() -> dict[str, set[str]]:
    """Every sample name the daemon's registry exposes, with the labels its series carry."""
    metrics = Metrics()
    metrics.watch_selections(selections)
    metrics.watch_connections(lambda: {Series("demo/web", "http", "10.244.1.5:8080", "node"): 1})
    busy = PortInFlight({"10.244.1.5:8080": EndpointInFlight("10.244.1.5:8080", Load(1), False)})
    metrics.registry.register(InFlightCollector(lambda: InFlight({(WEB, IPFamily.IPv4): busy})))
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
    metrics.registry.register(InFlightCollector(lambda: None))
    metrics.watch_localhost_nodeports(dict)  # as the daemon with the gate on, the default
    metrics.watch_api(list)  # as the daemon fed by the API server
    exported = {family.name: family.type for family in metrics.registry.collect()}
    assert exported == {spec.family: spec.type for spec in SPECS}


def test_labels_are_the_references() -> None:
    samples = scrape()
    for spec in SPECS:
        name = spec.name if spec.type != "histogram" else f"{spec.name}_count"
        assert samples[name] == set(spec.labels), spec.name


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


def rule_tests() -> dict[str, Any]:
    return dict(yaml.safe_load(RULE_TESTS.read_text()))


def series_labels(series: str) -> tuple[str, dict[str, str]]:
    match = SERIES.fullmatch(series)
    assert match, series
    return match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))


@pytest.fixture(scope="module", name="promtool_dir")
def promtool_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PrometheusRule's groups as a Prometheus rule file, beside a copy of the unit tests
    that name it."""
    folder = tmp_path_factory.mktemp("promtool")
    groups = yaml.safe_load(RULES_FILE.read_text())["spec"]["groups"]
    (folder / "pyproxy.rules.yaml").write_text(yaml.safe_dump({"groups": groups},
                                                              sort_keys=False))
    shutil.copy(RULE_TESTS, folder / RULE_TESTS.name)
    return folder


def promtool(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(require_tool("promtool")), *args], cwd=folder,
                          capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules(promtool_dir: Path) -> None:
    """Prometheus' own checker: each expression parses, each template renders, no duplicate
    rule; `--lint=all` refuses what promtool's linter flags."""
    out = promtool(promtool_dir, "check", "rules", "--lint=all", "--lint-fatal",
                   "pyproxy.rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests_of_every_alert(promtool_dir: Path) -> None:
    """tests/monitoring/rules_test.yaml: each alert fires on the series it is for, with its
    labels and annotations rendered, and stays quiet when it should (incl. the sync-stalled
    alert on a daemon that never listed, and kube-proxy's series of the same names)."""
    out = promtool(promtool_dir, "test", "rules", RULE_TESTS.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_every_alert_has_a_case_that_fires_and_one_that_stays_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in rule_tests()["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in rules()}
    assert firing == alerts
    assert quiet == alerts


def test_the_unit_tests_series_are_what_the_daemon_exports() -> None:
    """Each series the unit tests feed promtool is one the daemon exports, by the name
    Prometheus stores, with the labels its series carry or the scrape adds: so an alert that
    fires there selects what a real scrape has."""
    samples = scrape()
    for case in rule_tests()["tests"]:
        for entry in case["input_series"]:
            name, labels = series_labels(entry["series"])
            assert name in samples, f"{case['name']}: {name} is not exported"
            assert set(labels) <= samples[name] | TARGET_LABELS, (case["name"], name, labels)
            assert {"job", "node"} <= set(labels), entry["series"]


def test_the_never_listed_case_is_a_fresh_daemons_series() -> None:
    """The stalled-sync case on a node that never listed feeds the values a daemon that has
    never synced exports: both sync timestamps 0 (process_start_time_seconds is the test
    clock's start, 0)."""
    registry = Metrics().registry
    [case] = [case for case in rule_tests()["tests"] if "never listed" in case["name"]]
    for entry in case["input_series"]:
        name, _ = series_labels(entry["series"])
        if name != "process_start_time_seconds":
            assert registry.get_sample_value(name) == 0.0, name
            assert entry["values"].split()[0].split("x")[0] == "0", entry
