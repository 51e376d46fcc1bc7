"""bench/bench_vs_kube_proxy.py's own arithmetic: pyproxy's start read back from its log."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.bench_vs_kube_proxy import start_timeline, trigger_time
from pyproxy.serve.metrics import Metrics


def test_the_start_timeline_is_the_measured_start_only(tmp_path: Path) -> None:
    """Lines of an earlier start (the alternated cold starts share the log) and lines that
    are not JSON are left out; the phases are seconds after the exec."""
    started = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC).timestamp()

    def line(offset: float, event: str, **fields: object) -> str:
        stamp = datetime.fromtimestamp(started + offset, UTC).isoformat()
        return json.dumps({"timestamp": stamp, "event": event, **fields})

    log = tmp_path / "pyproxy.log"
    log.write_text("\n".join([
        line(-5.0, "starting"), line(-4.0, "synced", render_ms=9, kernel_ms=9, duration_ms=9),
        "Traceback (most recent call last):",
        line(0.4, "starting"),
        line(0.9, "initial_list_completed", source="Service"),
        line(1.0, "initial_list_completed", source="EndpointSlice"),
        line(1.3, "synced", render_ms=120.0, kernel_ms=80.0, duration_ms=250.0),
        line(2.0, "synced", render_ms=1.0, kernel_ms=1.0, duration_ms=3.0),
    ]))
    timeline = start_timeline(log, started)
    assert {k: round(v, 3) for k, v in timeline.items()} == {
        "first_line": 0.4, "starting": 0.4, "listed Service": 0.9, "listed EndpointSlice": 1.0,
        "first_sync_end": 1.3, "first_sync_render": 0.12, "first_sync_kernel": 0.08,
        "first_sync_duration": 0.25}


def test_the_default_text_log_is_read_too(tmp_path: Path) -> None:
    log = tmp_path / "pyproxy.log"
    log.write_text(
        "timestamp=2026-11-27T14:05:08.055342Z level=info event=api_server server=https://x\n"
        'timestamp=2026-11-27T14:05:08.138220Z level=info event=starting node=node-a '
        'node_ips="[\'192.168.50.1\', \'fd00:50::1\']" source=api\n'
        "timestamp=2026-11-27T14:05:08.256045Z level=info event=initial_list_completed "
        "source=EndpointSlice\n"
        "timestamp=2026-11-27T14:05:08.484570Z level=info event=synced full=true "
        "reason=start duration_ms=195.2 render_ms=30.8 kernel_ms=151.3\n")
    started = datetime(2026, 11, 27, 14, 5, 8, tzinfo=UTC).timestamp()
    timeline = start_timeline(log, started)
    assert {k: round(v, 4) for k, v in timeline.items()} == {
        "first_line": 0.0553, "starting": 0.1382, "listed EndpointSlice": 0.256,
        "first_sync_end": 0.4846, "first_sync_render": 0.0308, "first_sync_kernel": 0.1513,
        "first_sync_duration": 0.1952}


def test_the_trigger_time_is_rfc3339_nano_in_utc() -> None:
    """As the EndpointSlice controller writes it (Go's time.RFC3339Nano, UTC: nanoseconds,
    trailing zeros dropped, no fraction at all on a whole second), and as pyproxy's metrics
    read it back."""
    second = int(datetime(2026, 11, 27, 19, 0, 0, tzinfo=UTC).timestamp())
    assert trigger_time(second * 10**9 + 123456789) == "2026-11-27T19:00:00.123456789Z"
    assert trigger_time(second * 10**9 + 120000000) == "2026-11-27T19:00:00.12Z"
    assert trigger_time(second * 10**9) == "2026-11-27T19:00:00Z"
    metrics = Metrics(CollectorRegistry(), started=second - 1.0)
    metrics.observe_trigger_times([trigger_time(second * 10**9 + 250_000_000)], second + 1.0)
    observed = {s.name: s.value for m in metrics.network_programming.collect()
                for s in m.samples}
    assert observed["kubeproxy_network_programming_duration_seconds_count"] == 1
    assert abs(observed["kubeproxy_network_programming_duration_seconds_sum"] - 0.75) < 1e-6


class _RecordingDiscovery:
    """Stands in for DiscoveryV1Api: records each EndpointSlice patch."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, str]] = []

    def patch_namespaced_endpoint_slice(self, name: str, namespace: str, body: object) -> None:
        self.patches.append((namespace, name))


def test_every_turn_of_the_churn_is_a_write() -> None:
    """The churn's count ("changes/s reached") is of writes: Services with no endpoints are
    passed over, not counted (they were ~2 % of the turns, counted with no write)."""
    from bench.bench_vs_kube_proxy import Churn
    from bench.synth import Cluster as Synth

    synth = Synth(1000, 10)
    assert any(synth.shape(i).no_endpoints for i in range(synth.services))
    churn = Churn.__new__(Churn)  # no API client: the writes go to the recorder
    churn.synth, churn.rate, churn.generation, churn._turn = synth, 20.0, 1, 0
    churn.discovery = _RecordingDiscovery()  # type: ignore[assignment]
    for n in range(500):
        churn._change(n)
    assert len(churn.discovery.patches) == 500  # type: ignore[attr-defined]
    changed = {int(name.split("-")[1]) for _, name in churn.discovery.patches}  # type: ignore[attr-defined]
    assert not [i for i in changed if synth.shape(i).no_endpoints]


def test_bench_npl_splits_a_change_at_the_first_sync_after_its_write() -> None:
    """bench/bench_npl.py: the write's start → the first sync that began after it (failed
    ones skipped), and that sync's duration; none began: no split."""
    from bench.bench_npl import report, sync_split

    history = [{"started": 9.0, "finished": 9.5},
               {"started": 10.02, "finished": 10.03, "error": "refused"},
               {"started": 10.03, "finished": 10.034},
               {"started": 12.0, "finished": 12.1}]
    split = sync_split(10.0, history)
    assert split is not None and [round(x, 4) for x in split] == [0.03, 0.004]
    assert sync_split(13.0, history) is None
    rounds = [{"pyproxy": [{"npl": 0.01, "write": 0.005}],
               "kube-proxy": [{"npl": 0.02, "write": 0.005}]}] * 3
    assert "pyproxy / kube-proxy, per round: 0.50, 0.50, 0.50; median 0.50" in report(rounds)


def test_the_one_service_changes_are_the_incremental_syncs_of_the_window(tmp_path: Path) -> None:
    """bench/vs_sizes.py: pyproxy's text log's `synced` lines inside the quiet flips'
    window, full syncs (the periodic resync) left out."""
    from bench.vs_sizes import pyproxy_changes

    def line(at: float, full: str, duration: float, kernel: float) -> str:
        stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
        return (f"timestamp={stamp} level=info event=synced full={full} reason=changes "
                f"duration_ms={duration} render_ms=0.5 kernel_ms={kernel}")

    log = tmp_path / "pyproxy.log"
    log.write_text("\n".join([line(99.0, "false", 50.0, 40.0), line(101.0, "false", 2.0, 1.0),
                              line(102.0, "true", 900.0, 800.0), line(103.0, "false", 4.0, 3.0),
                              line(111.0, "false", 70.0, 60.0)]))
    figures = pyproxy_changes(log, 100.0, 110.0)
    assert figures["duration_ms"] == {"n": 2, "p50": 3.0, "p99": 4.0, "max": 4.0}
    assert figures["kernel_ms"]["max"] == 3.0


def test_targets_hold_a_capped_kube_proxy_as_a_bound() -> None:
    """A kube-proxy stopped at its cap: the first-ruleset target is met only when pyproxy's
    start is within 1/20 of the cap (a bound), never from a figure kube-proxy never gave;
    the floor and the NPL targets are the ratios of the run."""
    from bench.vs_sizes import histogram_means, targets

    py = {"first_ruleset_s": 90.0, "npl_churn_20": {"p99": 0.3},
          "after_first_sync": {"rss_mib": 300.0}, "after_1000_more": {"hwm_mib": 400.0},
          "one_service_change": {"duration_ms": {"n": 3, "p50": 4.0, "p99": 9.0},
                                 "kernel_ms": {"p50": 2.0}}}
    result = {"services": 44000, "endpoints": 1, "kernel_floor": {"wall_s": 1.5},
              "runs": {"pyproxy": py, "kube-proxy": {"capped_at_s": 1200, "first_ruleset_s": None}}}
    met = {name: ok for name, ok, _ in targets(result)}
    assert met == {"first complete ruleset ≤ 1/20 of kube-proxy's": None,
                   "first complete ruleset ≤ 3 × the kernel floor": False,
                   "one-Service change ≤ 10 ms (the sync, p50)": True}
    py["first_ruleset_s"] = 4.0
    assert dict((n, ok) for n, ok, _ in targets(result))[
        "first complete ruleset ≤ 1/20 of kube-proxy's"] is True
    result["runs"]["kube-proxy"] = {"first_ruleset_s": 100.0, "npl_churn_20": {"p99": 1.2},
                                    "after_first_sync": {"rss_mib": 250.0},
                                    "after_1000_more": {"hwm_mib": 500.0}}
    met = {name: ok for name, ok, _ in targets(result)}
    assert met["first complete ruleset ≤ 1/20 of kube-proxy's"] is True
    assert met["RSS after the first sync ≤ kube-proxy's"] is False
    assert met["peak RSS at the end ≤ kube-proxy's"] is True
    assert met["NPL p99 at 20 changes/s ≤ 1/3 of kube-proxy's"] is True
    means = histogram_means({"x_count": 2.0, "x_sum": 1.0},
                            {"x_count": 6.0, "x_sum": 1.2, "y_count": 0.0})
    assert means == {"x": {"count": 4, "mean_s": 0.05}}


def test_how_far_a_capped_kube_proxy_got_survives_an_interrupted_listing() -> None:
    """bench/vs_sizes.table_progress: a listing the proxy's commit interrupted is tried
    again; kube-proxy's per-service and per-endpoint chains are counted by their prefixes."""
    import subprocess

    from bench.vs_sizes import table_progress

    listing = ("table ip kube-proxy {\n\tchain filter-input {\n\t}\n"
               "\tchain service-ULMVA6XW-ns1/svc1/tcp/p80 {\n\t}\n"
               "\tchain endpoint-6UVIXZI4-ns1/svc1/tcp/p80__10.0.0.1/80 {\n\t}\n}\n")
    answers = [subprocess.CompletedProcess([], 1, "", "Error: Interrupted system call"),
               subprocess.CompletedProcess([], 0, listing, "")]

    class Node:
        def run(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
            assert argv == ["nft", "list", "chains", "ip", "kube-proxy"]
            return answers.pop(0)

    assert table_progress(Node(), "kube-proxy", 7) == {  # type: ignore[arg-type]
        "chains": 3, "service_chains": 1, "endpoint_chains": 1, "service_ports_in_cluster": 7}
    answers[:] = [subprocess.CompletedProcess([], 1, "", "Error: Interrupted system call")] * 2
    assert table_progress(Node(), "kube-proxy", 7, attempts=2) == {  # type: ignore[arg-type]
        "error": "Error: Interrupted system call", "service_ports_in_cluster": 7}
