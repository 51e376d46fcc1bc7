"""drills/cluster_ops.py without a cluster: the migration drill's way back runs
docs/deploying.md's own "Back to kube-proxy" commands (here against a kubectl that records
what it is asked), and `make cluster-drills` records its figures where the benchmarks do."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from drills import cluster_ops as ops

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/pyproxy:rolled"

# A kubectl that logs its arguments and answers the two questions the way back asks.
FAKE_KUBECTL = """#!/bin/sh
echo "$*" >> "$KUBECTL_LOG"
case "$*" in
  *"get ds pyproxy -o jsonpath="*) printf '%s' "$FAKE_IMAGE" ;;
  debug*) node=${2#node/}
          echo "Creating debugging pod node-debugger-$node-x7k2p with container debugger" \
               "on node $node." ;;
esac
"""


def test_the_way_back_is_the_docs_numbered_steps() -> None:
    steps = ops.doc_steps(ops.BACK_TO_KUBE_PROXY)
    assert sorted(steps) == [1, 2, 3, 4]
    assert "pyproxy.io/run-kube-proxy" in steps[1] and "rollout status" in steps[1]
    assert "image=$(kubectl -n kube-system get ds pyproxy" in steps[2]
    assert "delete ds pyproxy" in steps[2]
    assert steps[3].split() == ["kubectl", "debug", "node/NODE", "-it", "--profile=netadmin",
                                '--image="$image"', "--", "pyproxy", "cleanup"]
    assert steps[4].split() == ["kubectl", "-n", "kube-system", "rollout", "restart",
                                "ds/kube-proxy"]


@pytest.fixture
def fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KUBECTL_LOG", str(tmp_path / "kubectl.log"))
    monkeypatch.setenv("FAKE_IMAGE", IMAGE)
    terminated = SimpleNamespace(exit_code=0)
    pod = SimpleNamespace(status=SimpleNamespace(container_statuses=[
        SimpleNamespace(state=SimpleNamespace(terminated=terminated))]))
    deleted: list[tuple[str, ...]] = []

    def kubectl(*args: str, **kwargs: Any) -> Any:
        deleted.append(args)
        return SimpleNamespace(stdout="cleanup: permission denied\n")
    return SimpleNamespace(
        bin=tmp_path, admin_kubeconfig=lambda: tmp_path / "admin.kubeconfig",
        kube=SimpleNamespace(core=SimpleNamespace(read_namespaced_pod=lambda name, ns: pod)),
        kubectl=kubectl, deleted=deleted,
        log=tmp_path / "kubectl.log", terminated=terminated)


def test_the_drill_removes_pyproxys_tables_with_the_image_its_daemonset_ran(
        fake_cluster: Any) -> None:
    """Step 2 keeps the image, step 3 runs `pyproxy cleanup` with it in a node debug pod
    (kubectl's stdin no terminal), the pod's exit code and the node's tables checked."""
    steps = ops.doc_steps(ops.BACK_TO_KUBE_PROXY)
    out = ops.run_doc(fake_cluster, steps[2] + '\nprintf "%s\\n" "$image"\n')
    assert out.stdout.splitlines()[-1] == IMAGE
    node = SimpleNamespace(name="node-b", run=lambda argv: SimpleNamespace(
        stdout="table ip kube-proxy\ntable ip6 kube-proxy\n"))
    ops.debug_cleanup(fake_cluster, node, steps[3], IMAGE)
    calls = fake_cluster.log.read_text().splitlines()
    assert calls == [
        "-n kube-system get ds pyproxy -o jsonpath={.spec.template.spec.containers[0].image}",
        "-n kube-system delete ds pyproxy",
        f"debug node/node-b -it --profile=netadmin --image={IMAGE} -- pyproxy cleanup"]
    assert fake_cluster.deleted == [("-n", "default", "delete", "pod",
                                     "node-debugger-node-b-x7k2p", "--wait=false")]


def test_a_cleanup_that_left_the_tables_is_a_failure(fake_cluster: Any) -> None:
    steps = ops.doc_steps(ops.BACK_TO_KUBE_PROXY)
    node = SimpleNamespace(name="node-a", run=lambda argv: SimpleNamespace(
        stdout="table ip kube-proxy\ntable ip pyproxy\n"))
    with pytest.raises(RuntimeError, match="pyproxy's tables still there"):
        ops.debug_cleanup(fake_cluster, node, steps[3], IMAGE)
    fake_cluster.terminated.exit_code = 1
    with pytest.raises(RuntimeError, match="pyproxy cleanup exited 1: cleanup: permission"):
        ops.debug_cleanup(fake_cluster, node, steps[3], IMAGE)


def test_a_failing_doc_command_stops_the_drill(fake_cluster: Any) -> None:
    with pytest.raises(RuntimeError, match="failed"):
        ops.run_doc(fake_cluster, "kubectl get nodes\nfalse\n")


def test_the_figures_go_to_bench_results_named_by_commit() -> None:
    results = ROOT / "bench" / "results"
    assert ops.results_path("4bdcc5d") == results / "cluster-drills-4bdcc5d.json"
    assert (ops.results_path("4bdcc5d", ["reboot", "lb drain"])
            == results / "cluster-drills-reboot-lb_drain-4bdcc5d.json")
    commit, _ = ops.git_commit()
    assert len(commit) >= 7 and commit != "unknown"
    assert os.path.isdir(results)
