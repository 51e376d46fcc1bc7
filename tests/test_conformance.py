"""Upstream's own judgement: the `[sig-network] Services ... [Conformance]` tests of
k8s.io/kubernetes/test/e2e (the pinned release, e2e.test built by `make k8s`) against pyproxy on
the real cluster (testkit/cluster.py, testkit/conformance.py). The whole selection of
upstream's nftables job, with kube-proxy as the control, is `make conformance`."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.cluster import RealCluster
from testkit.conformance import (
    LAB_LIMITS,
    SERVICES_CONFORMANCE,
    SKIP,
    Case,
    Run,
    failures,
    run_suite,
)
from testkit.fixtures import requires_netns


@pytest.mark.netns
@pytest.mark.k8s
@pytest.mark.cluster
@requires_netns
def test_upstream_services_conformance_passes_with_pyproxy(real_cluster: RealCluster,
                                                           tmp_path: Path) -> None:
    run = run_suite(real_cluster, "pyproxy", SERVICES_CONFORMANCE, SKIP, tmp_path)
    log = (tmp_path / "e2e-pyproxy.log").read_text()[-3000:] if run.junit else ""
    assert run.cases, f"e2e.test reported nothing:\n{log}"
    failed = [f"{c.name}: {c.message}" for c in run.cases if c.status == "failed"]
    print(f"Services [Conformance]: {run.count('passed')} passed, {len(failed)} failed, "
          f"{run.count('skipped')} skipped in {run.seconds:.0f} s")
    assert not failed, "\n".join(failed)
    assert run.count("passed") >= 15  # v1.37's Services [Conformance] tests


def test_the_report_says_what_each_failure_means() -> None:
    """pyproxy-only failures are called out; one failing with both names the lab's limit
    that explains it, or says none does."""
    def run(proxy: str, *failed: str) -> Run:
        names = ("[It] a Service works", "[It] should run iperf2", "[It] something new",
                 "[It] kube-proxy's bad day")
        return Run(proxy, [Case(n, "failed" if n in failed else "passed", 1.0)
                           for n in names])

    lines = failures([run("kube-proxy", "[It] should run iperf2", "[It] something new",
                          "[It] kube-proxy's bad day"),
                      run("pyproxy", "[It] a Service works", "[It] should run iperf2",
                          "[It] something new")])
    assert lines[2:-1] == [
        "- **fails with pyproxy only**: [It] a Service works",
        "- fails with both: [It] should run iperf2 — " + dict(
            (p, w) for p, w in LAB_LIMITS)["should run iperf2"],
        "- fails with both: [It] something new — not explained yet",
        "- fails with kube-proxy only: [It] kube-proxy's bad day"]
    assert failures([run("kube-proxy"), run("pyproxy")]) == ["No test failed.", ""]
