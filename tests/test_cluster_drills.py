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
import yaml

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


# -- the iptables-mode migration --------------------------------------------------------------

# A kubectl whose kube-proxy pods answer as kube-proxy in the mode of $FAKE_MODE would, once
# synced ("none": nothing written yet; the image has nft and iptables either way).
FAKE_KUBE_PROXY_KUBECTL = """#!/bin/sh
case "$*" in
  *"get pod -l k8s-app=kube-proxy -o name"*) echo pod/kube-proxy-a; echo pod/kube-proxy-b ;;
  *"-- nft list table ip kube-proxy"*)
    [ "$FAKE_MODE" = nftables ] && { echo "table ip kube-proxy {"; exit 0; }
    echo "Error: No such file or directory" >&2; exit 1 ;;
  *"-- iptables -t nat -S KUBE-SERVICES"*)
    [ "$FAKE_MODE" = iptables ] || { echo "iptables: No chain/target/match by that name." >&2
                                     exit 1; }
    echo "-N KUBE-SERVICES"
    echo '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this' \
         'must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS' ;;
esac
"""


@pytest.mark.parametrize(("mode", "unsynced"), [("nftables", False), ("iptables", False),
                                                ("none", True)])
def test_the_way_back_waits_for_kube_proxy_in_either_mode(
        fake_cluster: Any, monkeypatch: pytest.MonkeyPatch, mode: str, unsynced: bool) -> None:
    """"Back to kube-proxy", step 1 as written: its check tells a synced kube-proxy in
    nftables mode (its table) and in iptables mode (KUBE-SERVICES ending with the NodePorts
    rule) from one that has written nothing, under bash -euo pipefail."""
    kubectl = fake_cluster.bin / "kubectl"
    kubectl.write_text(FAKE_KUBE_PROXY_KUBECTL)
    monkeypatch.setenv("FAKE_MODE", mode)
    out = ops.run_doc(fake_cluster, ops.doc_steps(ops.BACK_TO_KUBE_PROXY)[1])
    expected = ["pod/kube-proxy-a: not synced yet", "pod/kube-proxy-b: not synced yet"]
    assert out.stdout.splitlines() == (expected if unsynced else [])


def test_the_way_there_is_the_docs_numbered_steps() -> None:
    """Steps 4 and 5 of "From kube-proxy to pyproxy", which the iptables-mode drill runs as
    written: kube-proxy parked, then its leftovers removed from every pyproxy pod."""
    steps = ops.doc_steps(ops.TO_PYPROXY)
    assert "pyproxy.io/run-kube-proxy" in steps[4] and "patch ds kube-proxy" in steps[4]
    assert "pyproxy cleanup --kube-proxy" in steps[5]


def test_kube_proxy_in_iptables_mode_is_kubeadms_configuration() -> None:
    """The drill's kube-proxy in iptables mode: the harness's kubeadm-shaped ConfigMap with
    `mode: iptables` and the iptables section kubeadm writes; pyproxy reading it as it is
    (manifests/kubeadm/) serves NodePorts where that kube-proxy does and says, before the
    switch, what still differs."""
    from pyproxy.config import load_config
    from testkit.cluster import kube_proxy_manifest

    def config_conf(mode: str) -> str:
        docs = list(yaml.safe_load_all(kube_proxy_manifest(mode)))
        (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
        text: str = configmap["data"]["config.conf"]
        return text

    iptables, nftables = config_conf("iptables"), config_conf("nftables")
    assert yaml.safe_load(iptables)["mode"] == "iptables"
    assert yaml.safe_load(iptables)["iptables"]["localhostNodePorts"] is None
    assert "nftables" not in yaml.safe_load(iptables)
    loaded = load_config(iptables)
    assert loaded.nodeport_addresses == ("all", "127.0.0.0/8")
    assert loaded.kube_proxy_mode == "iptables" and len(loaded.changes) == 1
    assert load_config(nftables).nodeport_addresses == ("primary",)
    with pytest.raises(ValueError, match="ipvs"):
        kube_proxy_manifest("ipvs")


def test_the_kubeadm_variant_the_drill_deploys_is_shipped() -> None:
    for path in ("00-serviceaccount.yaml", "01-rbac.yaml", "kubeadm/03-daemonset.yaml"):
        assert (ROOT / "manifests" / path).is_file()


def test_only_kube_proxys_chains_count_as_left_over() -> None:
    chains = ["filter/KUBE-FIREWALL", "filter/KUBE-FORWARD", "filter/KUBE-KUBELET-CANARY",
              "mangle/KUBE-IPTABLES-HINT", "mangle/KUBE-PROXY-CANARY", "nat/KUBE-MARK-MASQ",
              "nat/KUBE-SEP-DT6VVTARLVVOS44S", "nat/KUBE-FIREWALL-X"]
    assert ops.kube_proxys_chains(chains) == [
        "filter/KUBE-FORWARD", "mangle/KUBE-PROXY-CANARY", "nat/KUBE-MARK-MASQ",
        "nat/KUBE-SEP-DT6VVTARLVVOS44S", "nat/KUBE-FIREWALL-X"]


def test_the_iptables_drill_is_one_of_the_operations() -> None:
    assert ("iptables-migration", ops.iptables_migration) in ops.OPERATIONS
