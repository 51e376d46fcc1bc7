"""Upstream's own judgement: the `[sig-network] Services ... [Conformance]` tests of
k8s.io/kubernetes/test/e2e (the pinned release, e2e.test built by `make k8s`) against pyproxy on
the real cluster (testkit/cluster.py, testkit/conformance.py). The whole selection of
upstream's nftables job, with kube-proxy as the control, is `make conformance`."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.cluster import RealCluster
from testkit.conformance import SERVICES_CONFORMANCE, SKIP, run_suite
from testkit.fixtures import requires_netns

pytestmark = [pytest.mark.netns, pytest.mark.k8s, pytest.mark.cluster, requires_netns]


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
