"""Upstream's own judgement: the `[sig-network] Services ... [Conformance]` tests of
k8s.io/kubernetes/test/e2e (the pinned release, e2e.test built by `make k8s`) against pyproxy on
the real cluster (testkit/cluster.py, testkit/conformance.py). The whole selection of
upstream's nftables job, with kube-proxy as the control, is `make conformance`."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from testkit.cluster import RealCluster
from testkit.conformance import (
    CONTROL_PLANE_NODE,
    LAB_LIMITS,
    MIRROR,
    NO_CONTROL_PLANE_NODE,
    NO_MIRROR,
    SERVICES_CONFORMANCE,
    SKIP,
    Case,
    Part,
    Run,
    Selection,
    failures,
    merged,
    read_part,
    report,
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


def test_a_report_of_several_selections_counts_each_test_once(tmp_path: Path) -> None:
    """Two selections' runs read back from their folders: each keeps its selection, and
    the table holds every test a selection ran, with the result of the part that ran it."""
    def junit(folder: Path, proxy: str, results: dict[str, str]) -> None:
        cases = "".join(
            f'<testcase name="{name}" status="{status}" time="2">'
            + ('<failure message="boom"/>' if status == "failed" else "") + "</testcase>"
            for name, status in results.items())
        (folder / f"junit-{proxy}.xml").write_text(
            f'<testsuites time="60"><testsuite>{cases}</testsuite></testsuites>')

    first, second = tmp_path / "net", tmp_path / "serial"
    for folder, results in ((first, {"[It] a": "passed", "[It] b": "skipped"}),
                            (second, {"[It] a": "skipped", "[It] b": "failed"})):
        folder.mkdir()
        Selection(f"focus of {folder.name}", "skip", 3, 2).save(folder)
        for proxy in ("kube-proxy", "pyproxy"):
            junit(folder, proxy, results)
    args = argparse.Namespace(focus="cli", skip="cli", procs=1, nodes=1)
    parts = [read_part(folder, ["kube-proxy", "pyproxy"], args) for folder in (first, second)]
    assert [p.selection.focus for p in parts] == ["focus of net", "focus of serial"]
    runs = merged(parts)
    assert {r.proxy: sorted((c.name, c.status) for c in r.cases) for r in runs} == {
        proxy: [("[It] a", "passed"), ("[It] b", "failed")]
        for proxy in ("kube-proxy", "pyproxy")}
    text = report(parts, 120.0, from_reports=True)
    assert "Selection 2: focus `focus of serial`" in text
    assert "- fails with both: [It] b — not explained yet" in text
    # The images built from other sources than upstream's are named with what they are.
    assert "- `registry.k8s.io/e2e-test-images/agnhost:2.55`: test/images/agnhost 2.66.1" in text


def test_the_report_says_how_the_control_plane_reached_services(tmp_path: Path) -> None:
    """A run on a cluster whose control plane is a node (the proxy's DaemonSet there) and
    has registry.k8s.io's mirror says so; a report folder from before either existed (its
    selection.json without them) says its control plane reached no ClusterIP."""
    def part(folder: Path, selection: Selection) -> Part:
        folder.mkdir()
        selection.save(folder)
        for proxy in ("kube-proxy", "pyproxy"):
            (folder / f"junit-{proxy}.xml").write_text(
                '<testsuites time="6"><testsuite><testcase name="[It] a" status="passed" '
                'time="1"/></testsuite></testsuites>')
        args = argparse.Namespace(focus="cli", skip="cli", procs=1, nodes=2)
        return read_part(folder, ["kube-proxy", "pyproxy"], args)

    new = part(tmp_path / "new", Selection("f", "s", 2, 2, control_plane_node=True,
                                           mirror=True))
    old_dir = tmp_path / "old"
    part(old_dir, Selection("f", "s", 2, 2))
    saved = json.loads((old_dir / "selection.json").read_text())
    del saved["control_plane_node"], saved["mirror"]
    (old_dir / "selection.json").write_text(json.dumps(saved))
    old = read_part(old_dir, ["kube-proxy", "pyproxy"], argparse.Namespace())
    assert (old.selection.control_plane_node, old.selection.mirror) == (False, False)

    text = report([new], 6.0, from_reports=True)
    assert CONTROL_PLANE_NODE in text and MIRROR in text
    assert NO_CONTROL_PLANE_NODE not in text and NO_MIRROR not in text
    assert NO_CONTROL_PLANE_NODE in report([old], 6.0, from_reports=True)
    both = report([new, old], 12.0, from_reports=True)
    assert f"{CONTROL_PLANE_NODE} (selection 1)" in both
    assert f"{NO_CONTROL_PLANE_NODE} (selection 2)" in both
    four = report([old, old, new, new], 24.0, from_reports=True)  # one line per kind
    assert f"{NO_CONTROL_PLANE_NODE} (selections 1 and 2)" in four
    assert f"{CONTROL_PLANE_NODE} (selections 3 and 4)" in four
    assert four.count(NO_CONTROL_PLANE_NODE) == 1


def test_the_lab_limits_no_longer_excuse_what_the_lab_now_does() -> None:
    """The webhook and aggregator tests (the control plane reaches Services through the
    proxy) and PodCertificate's mTLS test (e2e.test stamped, agnhost pulled from the mirror)
    pass here with both proxies: no lab limit may explain a failure of theirs away."""
    names = [
        "[It] [sig-api-machinery] AdmissionWebhook [Privileged:ClusterAdmin] should be able "
        "to deny pod and configmap creation [Conformance]",
        "[It] [sig-api-machinery] Aggregator Should be able to support the 1.17 Sample API "
        "Server using the current Aggregator [LinuxOnly] [Conformance]",
        "[It] [sig-api-machinery] CustomResourceConversionWebhook [Privileged:ClusterAdmin] "
        "should be able to convert from CR v1 to CR v2 [Conformance]",
        "[It] [sig-auth] Projected PodCertificate [FeatureGate:PodCertificateRequest] "
        "[FeatureGate:ClusterTrustBundle] [FeatureGate:ClusterTrustBundleProjection] should "
        "allow server and client pods to establish an mTLS connection "
        "[MinimumKubeletVersion:1.37] [Conformance]",
    ]
    for name in names:
        assert not [p for p, _ in LAB_LIMITS if re.search(p, name)], name
    image_volume = ("[It] [sig-node] ImageVolume should succeed with pod and pull policy of "
                    "Always [LinuxOnly] [MinimumKubeletVersion:1.35] [Conformance]")
    assert [why for p, why in LAB_LIMITS if re.search(p, image_volume)]
