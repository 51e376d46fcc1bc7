"""The chart and the kubectl plugin on real nodes (testkit/cluster.py: the session's cluster,
kubelets and containerd running pyproxy's image; issue 39, points 1 and 4).

`helm install --take-ownership` takes over the DaemonSet the session deployed from manifests/,
`helm upgrade` rolls it to a new image tag, `helm uninstall` removes it, leaving each node's
tables in place (docs/deploying.md, "With Helm: upgrade, uninstall"), and manifests/ deployed
again adopts them: all of it while clients connect through a ClusterIP and NodePorts,
counting each failed connection (0). Then the session's cluster is as it was.
`kubectl pyproxy --node NODE ...` answers as pyproxy does on that node. The chart's offline
and API server checks: tests/test_helm.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.cluster import OUTSIDE_NET, Prober, RealCluster, Target, netexec, service
from testkit.controlplane import API_IP, wait_for
from testkit.fixtures import require_tool, requires_netns

pytestmark = [pytest.mark.netns, pytest.mark.k8s, pytest.mark.cluster, requires_netns]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pyproxy"
NS = "charted"
NODE_PORT = 30190
PYPROXY_LABEL = "app.kubernetes.io/name=pyproxy"
# This checkout's pyproxy and plugin, whatever the environment (on the node too).
PYPROXY = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
           "from pyproxy.cli import main; sys.exit(main())"]
PLUGIN = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
          "from pyproxy.cli.kubectl import main; sys.exit(main())"]


@pytest.fixture(scope="module", name="web")
def web_fixture(real_cluster: RealCluster) -> Iterator[dict[str, Any]]:
    """Two netexec pods, one per node, behind a NodePort Service; removed afterwards."""
    cluster = real_cluster
    cluster.kubectl("create", "namespace", NS)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
        netexec("web", NS, replicas=2),
        service("web", NS, {"app": "web"}, kind="NodePort", node_port=NODE_PORT)]))
    cluster.rollout("deployment", "web", NS)
    try:
        yield {"cluster_ip": cluster.kube.core.read_namespaced_service("web", NS).spec.cluster_ip}
    finally:
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def pyproxy_pods(cluster: RealCluster) -> list[Any]:
    return list(cluster.kube.core.list_namespaced_pod("kube-system",
                                                      label_selector=PYPROXY_LABEL).items)


def helm(cluster: RealCluster, home: Path, *args: str,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    """The real helm against the cluster, its state and kubectl's cache in HOME (never the
    user's)."""
    out = subprocess.run(
        [str(require_tool("helm")), f"--kubeconfig={cluster.admin_kubeconfig()}", *args],
        capture_output=True, text=True, timeout=400, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
             "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")})
    assert out.returncode == 0 or not check, f"helm {' '.join(args)}: {out.stderr}"
    return out


# -- kubectl pyproxy ---------------------------------------------------------------------------

NUMBERS = re.compile(r"\d+(\.\d+)?")


def test_kubectl_pyproxy_answers_as_pyproxy_on_the_node(real_cluster: RealCluster,
                                                        web: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """The plugin (the real kubectl: `get pods`, `exec`) against pyproxy run on the node itself
    (its namespaces, the debug socket the DaemonSet's hostPath shares): the same output and
    exit code, for `explain`, and for `status` but its numbers (its ages, its watches' counts
    and resourceVersions tick between the two)."""
    cluster = real_cluster
    # kubectl's discovery cache in the test's folder (HOME), never the user's.
    env = {"KUBECTL": str(cluster.bin / "kubectl"), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    for node in cluster.nodes:
        for command in (["explain", f"{NS}/web"], ["status"]):
            through = subprocess.run(
                [*PLUGIN, f"--kubeconfig={cluster.admin_kubeconfig()}", "--node", node.name,
                 *command], capture_output=True, text=True, timeout=120, check=False, env=env)
            on_node = node.run([*PYPROXY, *command], check=False)
            assert through.returncode == on_node.returncode, (through.stderr, on_node.stderr)
            assert on_node.stdout.strip(), on_node.stderr
            if command[0] == "explain":
                assert through.stdout == on_node.stdout
            else:
                assert NUMBERS.sub("N", through.stdout) == NUMBERS.sub("N", on_node.stdout)
        assert through.returncode == 0, through.stdout  # status: the node is healthy
    missing = subprocess.run([*PLUGIN, f"--kubeconfig={cluster.admin_kubeconfig()}", "--node",
                              "no-such-node", "status"], capture_output=True, text=True,
                             timeout=120, check=False, env=env)
    assert missing.returncode == 3
    assert "no running pyproxy pod on node no-such-node" in missing.stderr


# -- helm install, upgrade, uninstall -----------------------------------------------------------


def test_helm_installs_upgrades_and_uninstalls_pyproxy_without_a_failed_connection(
        real_cluster: RealCluster, web: dict[str, Any], tmp_path: Path) -> None:
    cluster = real_cluster
    repository, _, tag = cluster.pyproxy_image.rpartition(":")
    upgraded = cluster.retag_pyproxy("helm-upgraded")
    targets = [Target(node.ns.full, web["cluster_ip"], 80, f"{node.name} -> ClusterIP")
               for node in cluster.nodes]
    targets += [Target(cluster.outside.full, node.spec.ip, NODE_PORT,
                       f"outside {OUTSIDE_NET[1]} -> {node.name}:NodePort")
                for node in cluster.nodes]
    values = ["--set", f"apiServer.host={API_IP}", "--set", f"image.repository={repository}",
              "--set", f"image.tag={tag}"]
    release = ["pyproxy", str(CHART), "--namespace", "kube-system"]
    restored = False
    try:
        with Prober(targets) as prober:
            # Over the objects `kubectl apply -k` made (docs/deploying.md: an installation
            # from manifests/ moving to the chart), applied client-side: server-side, the
            # fields kubectl wrote stay kubectl's too, and the upgrade below would be refused
            # as a conflict. The pods roll, one node at a time.
            helm(cluster, tmp_path, "install", *release, *values, "--take-ownership",
                 "--server-side=false", "--wait", "--timeout=5m")
            cluster.rollout("daemonset", "pyproxy")
            ds = yaml.safe_load(cluster.kubectl("-n", "kube-system", "get", "ds", "pyproxy",
                                                "-o", "yaml").stdout)
            assert ds["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
            assert ds["metadata"]["annotations"]["meta.helm.sh/release-name"] == "pyproxy"
            assert {p.spec.containers[0].image for p in pyproxy_pods(cluster)} == {
                cluster.pyproxy_image}

            helm(cluster, tmp_path, "upgrade", *release, "--reuse-values", "--set",
                 "image.tag=helm-upgraded", "--wait", "--timeout=5m")
            cluster.rollout("daemonset", "pyproxy")
            assert {p.spec.containers[0].image for p in pyproxy_pods(cluster)} == {upgraded}
            history = yaml.safe_load(helm(cluster, tmp_path, "history", "pyproxy",
                                          "--namespace", "kube-system", "-o", "yaml").stdout)
            assert [(r["revision"], r["status"]) for r in history] == [
                (1, "superseded"), (2, "deployed")]
            prober.settle(3.0)

            helm(cluster, tmp_path, "uninstall", "pyproxy", "--namespace", "kube-system",
                 "--wait", "--timeout=5m")
            wait_for(lambda: not pyproxy_pods(cluster), 60, "every pyproxy pod gone")
            left = cluster.kubectl("-n", "kube-system", "get", "ds,cm,sa", "-l",
                                   PYPROXY_LABEL, "-o", "name").stdout
            assert left.strip() == ""
            assert cluster.kubectl("get", "clusterrole", "pyproxy", check=False).returncode
            # The pods stop and leave their rules in place: the nodes go on forwarding.
            for node in cluster.nodes:
                assert "table ip pyproxy" in node.run(["nft", "list", "tables"]).stdout
            prober.settle(3.0)

            # Back to the session's deployment: manifests/, whose pods adopt those tables.
            cluster.deploy_pyproxy(cluster.pyproxy_image)
            cluster.rollout("daemonset", "pyproxy")
            restored = True
            prober.settle(3.0)
    finally:
        if not restored:  # the session's cluster as the other tests expect it, whatever failed
            helm(cluster, tmp_path, "uninstall", "pyproxy", "--namespace", "kube-system",
                 "--wait", "--timeout=2m", check=False)
            cluster.deploy_pyproxy(cluster.pyproxy_image)
            cluster.rollout("daemonset", "pyproxy")
    report = prober.report
    print(f"helm install, upgrade, uninstall, manifests again: {report.line()}")
    assert report.total > 100
    assert report.failed == 0, report.line()
