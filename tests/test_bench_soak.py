"""`make soak` (bench/bench_soak.py): its reading of the samples (the RSS fit, flat
descriptors and threads, the convergence, the NPL drift, the plot) and of the kernel's table,
and one short real run on the real control plane: the sampling works, the table converges,
the table is kept across a kube-apiserver restart."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from types import SimpleNamespace
from typing import Any

import pytest

from bench import bench_soak
from bench import soak_analysis as analysis
from testkit.controlplane import binaries_dir, missing_binaries, running_control_plane
from testkit.fixtures import requires_netns


def samples(rss_per_hour: float, minutes: int = 60, fds: Any = lambda m: 21,
            start_rss: float = 60.0) -> list[dict[str, Any]]:
    return [{"t": 60.0 * m, "rss_mib": start_rss + rss_per_hour * m / 60, "fds": fds(m),
             "threads": 14, "converged": True, "converge_s": 0.5, "elements": 900,
             "expected": 900, "cpu_pct": 20.0} for m in range(1, minutes + 1)]


def test_the_slope_is_the_least_squares_fit() -> None:
    assert analysis.slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert analysis.slope([0, 1, 2], [5, 5, 5]) == 0.0
    assert analysis.slope([0, 1, 2, 3], [0, 1, 0, 1]) == pytest.approx(0.2)
    assert analysis.slope([1], [4]) == 0.0
    with pytest.raises(ValueError):
        analysis.slope([0, 1], [1])


def test_rss_growth_is_fitted_after_the_warm_up() -> None:
    flat = analysis.rss_verdict(samples(0.5))
    assert flat.met and flat.figure.startswith("+0.50 MiB/h")
    leaking = analysis.rss_verdict(samples(3.0))
    assert not leaking.met and leaking.figure.startswith("+3.00 MiB/h")
    # 20 MiB in the first 10 minutes (caches filling), flat after: met
    warming = [{**s, "rss_mib": s["rss_mib"] + (20 * s["t"] / 600 if s["t"] < 600 else 20)}
               for s in samples(0.0)]
    assert analysis.rss_verdict(warming).met
    assert not analysis.rss_verdict(warming, warmup=0).met


def test_descriptors_that_creep_up_are_not_flat() -> None:
    assert analysis.flat_verdict(samples(0), "fds", 2).met
    # one descriptor more every 5 minutes: +10 over the hour
    creeping = analysis.flat_verdict(samples(0, fds=lambda m: 21 + m // 5), "fds", 2)
    assert not creeping.met and "fit +11.95/h" in creeping.figure
    # a single spike (a restart's reconnect) does not move the thirds' medians
    spike = analysis.flat_verdict(samples(0, fds=lambda m: 40 if m == 30 else 21), "fds", 2)
    assert spike.met and "max 40" in spike.figure


def test_a_sample_off_the_expected_count_misses_the_convergence() -> None:
    ok = samples(0)
    assert analysis.convergence_verdict(ok).met
    bad = [*ok[:5], {**ok[5], "converged": False, "elements": 897, "converge_s": 60.2},
           *ok[6:]]
    verdict = analysis.convergence_verdict(bad)
    assert not verdict.met
    assert "59/60" in verdict.figure and "897 elements against 900" in verdict.figure
    assert "slowest in 60.2 s" in verdict.figure


def npl(values_ms: list[float], duration: float, write_ms: float = 10.0,
        ) -> list[dict[str, Any]]:
    step = duration / len(values_ms)
    return [{"t": step * i, "npl": v / 1000, "write": write_ms / 1000}
            for i, v in enumerate(values_ms)]


def test_npl_drift_compares_the_first_and_last_thirds_without_the_restarts() -> None:
    steady = npl(([100.0] * 49 + [300.0]) * 6, 3600)  # a slow change in every 50
    verdict = analysis.npl_verdict(steady, 3600)
    assert verdict.met and "(1.00×" in verdict.figure
    drifting = npl([100.0] * 150 + [400.0] * 150, 3600)
    verdict = analysis.npl_verdict(drifting, 3600)
    assert not verdict.met and "p99 100 ms first third, 400 ms last third" in verdict.figure
    # the outage's samples are left out: a restart in the last third is not drift
    restarted = [{**s, "near_restart": s["npl"] > 0.2} for s in drifting[:250]] + drifting[250:]
    parts = analysis.npl_thirds(restarted, 3600)
    assert parts["last"]["n"] == 50
    # a slow API server's answer to the bench's write is told apart from the daemon's part
    slow_writes = [{**s, "write": s["npl"] - 0.09} for s in drifting]
    verdict = analysis.npl_verdict(slow_writes, 3600)
    assert not verdict.met and verdict.figure.endswith("after the write: p99 90 → 90 ms")


def test_the_plot_is_svg_with_a_line_per_series() -> None:
    found = samples(0.5)
    text = analysis.svg("soak <a & b>", found, npl([100.0] * 600, 3600), [630.0, 1230.0])
    root = ET.fromstring(text)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 8  # rss, cpu, fds, threads, 2 counts, 2 NPL
    assert len(root.findall(f"{ns}line")) == 2 * 6  # each restart in every panel
    assert all(p.get("points") for p in root.findall(f"{ns}polyline"))
    assert len(text) < 40_000


def test_the_kernel_count_is_the_soak_services_elements() -> None:
    listing = {"nftables": [
        {"metainfo": {}},
        {"set": {"name": "cluster-ips", "elem": ["10.96.200.1", "10.96.0.1"]}},
        {"map": {"name": "service-ips", "elem": [
            [{"concat": ["10.96.201.4", "tcp", 80]}, {"goto": {"target": "cluster-tcp-2"}}],
            [{"concat": ["10.96.250.1", "tcp", 80]}, {"goto": {"target": "cluster-tcp-1"}}]]}},
        {"map": {"name": "endpoints-tcp", "elem": [
            [{"concat": ["10.96.201.4", 80, 0]}, {"concat": ["10.128.4.9", 8080]}],
            [{"concat": ["10.96.201.4", 80, 1]}, {"concat": ["10.128.4.10", 8080]}]]}},
        # counted in the total only: a set the kernel fills, keyed by a soak address
        {"set": {"name": "new-connections-0", "elem": [
            {"elem": {"val": {"concat": ["10.96.200.1", "tcp", 80, "10.1.1.1", 80]},
                      "counter": {"packets": 1}}}]}},
        {"set": {"name": "service-cidrs", "elem": [{"prefix": {"addr": "10.96.0.0",
                                                               "len": 16}}]}},
    ]}
    assert bench_soak.kernel_elements(listing) == (4, 8)


def test_the_expected_count_is_two_per_service_and_one_per_ready_endpoint() -> None:
    def service(name: str, ip: str) -> Any:
        return SimpleNamespace(metadata=SimpleNamespace(name=name),
                               spec=SimpleNamespace(cluster_ip=ip))

    def piece(owner: str, *ready: bool) -> Any:
        return SimpleNamespace(
            metadata=SimpleNamespace(labels={"kubernetes.io/service-name": owner}),
            endpoints=[SimpleNamespace(conditions=SimpleNamespace(ready=r)) for r in ready])

    services = [service("s000", "10.96.200.0"), service("s001", "10.96.200.1"),
                service("other", "10.96.0.20")]
    slices = [piece("s000", True, True, False), piece("s001"), piece("other", True),
              piece("gone", True)]
    assert bench_soak.expected_elements(services, slices) == 2 + 2 + 2


def test_durations_are_seconds_minutes_or_hours() -> None:
    assert [bench_soak.duration(x) for x in ("3600", "90s", "30m", "1h")] == [
        3600, 90, 1800, 3600]


@pytest.mark.netns
@pytest.mark.k8s
@requires_netns
def test_a_short_soak_samples_and_converges() -> None:
    """45 s at 20 changes/s on 20 Services, a kube-apiserver restart in it: every sample
    reads the daemon's process and reaches the expected count, the table is kept while the
    API server is away and the daemon's watches come back."""
    bin_dir = binaries_dir()
    if missing_binaries(bin_dir):
        if os.environ.get("CI"):
            pytest.fail("the control plane is not built: run `make k8s`")
        pytest.skip("the control plane is not built: run `make k8s`")
    args = bench_soak.parser().parse_args([
        "--duration", "45", "--rate", "20", "--workers", "2", "--services", "20",
        "--spare", "5", "--member-every", "5", "--restart-every", "20", "--downtime", "2",
        "--sample-every", "15", "--warmup", "0"])
    with running_control_plane(bin_dir) as plane:
        result = bench_soak.run(plane, args)
    found = result["samples"]
    assert len(found) >= 2  # the restart takes the middle one's turn
    for s in found:
        assert s["converged"] and s["elements"] == s["expected"] > 0, s
        assert s["rss_mib"] > 10 and s["fds"] > 3 and s["threads"] >= 2
    assert result["churn"]["writes"] > 300 and result["churn"]["member_ops"] > 30
    assert [n for n in result["npl"] if n.get("npl", 0) > 0]
    (restart,) = result["restarts"]
    assert restart["kept"], restart
    after = restart["watches_after"]
    assert all(after[kind]["lists"] + after[kind]["watches"] > seen["lists"] + seen["watches"]
               for kind, seen in restart["watches_before"].items()), restart
    assert [v["name"] for v in result["verdicts"]] == [
        "RSS growth", "fds flat", "threads flat", "table converges", "NPL p99 not drifting"]
