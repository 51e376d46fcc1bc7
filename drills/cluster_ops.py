"""`make cluster-drills`: operations on the real cluster (testkit/cluster.py), each with clients
running and their failed connections counted (the goal is 0 for each).

    .venv/bin/python -m drills.cluster_ops                  # all of them (about 10 minutes)
    .venv/bin/python -m drills.cluster_ops --only reboot    # those whose name contains "reboot"
    .venv/bin/python -m drills.cluster_ops --json out.json   # else bench/results/, below

- rolling-update: pyproxy's DaemonSet to a new image tag;
- container-killed: pyproxy's container SIGKILLed on a node (the kubelet restarts it; the rules
  stay in the kernel meanwhile);
- apiserver-restart: kube-apiserver killed and started again; then a new Service must work on
  every node;
- node-reboot: a node's processes all killed, its ruleset and conntrack table wiped, /run
  emptied, containerd and the kubelet started again with no proxy rules: pyproxy's pod must
  come back and program the node by itself (it reaches the API server's real address). Clients
  through the other nodes count as failures; the rebooted node's time to serve again is
  reported;
- migration: kube-proxy's DaemonSet (kubeadm's, nftables mode) to pyproxy's following
  docs/deploying.md step by step, and back with the commands of its "Back to kube-proxy" run
  as written (bash, the cluster's kubectl): pyproxy's tables removed by `kubectl debug
  node/NODE --profile=netadmin` with the image pyproxy's DaemonSet ran, `pyproxy cleanup`;
- iptables-migration: the same from kubeadm's kube-proxy in `mode: iptables` (iptables-nft),
  pyproxy reading kube-proxy's ConfigMap as it is (manifests/kubeadm/), with clients also on
  the NodePort at 127.0.0.1 from every node and on an eTP=Local LoadBalancer; kube-proxy's
  chains left after the cleanup, or the kubelet's gone, break it down;
- lb-drain: a prober outside the nodes does what cloud load balancers do (health checks of
  every node's /healthz for an eTP=Cluster Service and of the health-check node port for an
  eTP=Local one, clients sent only to nodes it sees healthy) while a node is drained for
  deletion (the ToBeDeletedByClusterAutoscaler taint, the node stopped, its Node deleted) and
  while pyproxy's DaemonSet rolls.

The figures go to bench/results/cluster-drills-COMMIT.json (the commit checked out; a run of
a selection, `--only X`, to cluster-drills-X-COMMIT.json), as the benchmarks' do: docs/lab.md
cites that file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pyproxy.render.objects import TABLE_COMMENT
from testkit.cluster import (
    Prober,
    ProbeReport,
    RealCluster,
    Target,
    deploy_kube_proxy,
    is_failure,
    kube_proxy_synced,
    netexec,
    node_tables,
    running_cluster,
    service,
)
from testkit.controlplane import wait_for
from testkit.inproc import call_in_netns, http_probe
from testkit.netlab import NETNS_USABLE

NS = "ops"
REPO = Path(__file__).resolve().parent.parent
DEPLOYING = REPO / "docs" / "deploying.md"
NODE_PORT = 30280
LOCAL_NODE_PORT = 30281


@dataclass
class OpResult:
    name: str
    report: ProbeReport
    seconds: float
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.report.failed == 0

    def summary(self) -> str:
        extra = "; ".join(f"{k} {v:.1f}" for k, v in self.figures.items())
        head = f"{self.name}: {self.report.line()}" + (f"; {extra}" if extra else "")
        if self.error:
            head += f"; BROKE DOWN: {self.error}"
        return head + "".join(f"\n   - {note}" for note in self.notes)


def pyproxy_pods(cluster: RealCluster) -> list[Any]:
    return list(cluster.kube.core.list_namespaced_pod(
        "kube-system", label_selector="app.kubernetes.io/name=pyproxy").items)


def apply(cluster: RealCluster, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def workload(cluster: RealCluster) -> None:
    """Backends on every node behind an eTP=Cluster NodePort Service and an eTP=Local
    LoadBalancer Service (its health-check node port is what load balancers probe)."""
    cluster.kubectl("create", "namespace", NS, check=False)
    apply(cluster, netexec("web", NS, replicas=len(cluster.nodes)),
          service("web", NS, {"app": "web"}, kind="NodePort", node_port=NODE_PORT),
          service("web-local", NS, {"app": "web"}, kind="LoadBalancer",
                  node_port=LOCAL_NODE_PORT, externalTrafficPolicy="Local"))
    cluster.rollout("deployment", "web", NS)
    # Ready pods are not yet programmed rules (the EndpointSlice controller, then each proxy's
    # minSyncPeriod): the operations start once every client is answered.
    wait_for(lambda: all(_answers(t.netns, t.ip, t.port) for t in targets(cluster)), 60,
             "web answering every client")


def targets(cluster: RealCluster, nodes: Sequence[Any] | None = None) -> list[Target]:
    """From each node's namespace to the ClusterIP, from outside to each node's NodePort."""
    svc = cluster.kube.core.read_namespaced_service("web", NS)
    chosen = list(nodes if nodes is not None else cluster.nodes)
    return ([Target(n.ns.full, svc.spec.cluster_ip, 80, f"{n.name} -> ClusterIP")
             for n in chosen]
            + [Target(cluster.outside.full, n.spec.ip, NODE_PORT, f"outside -> {n.name}")
               for n in chosen])


def timed(name: str, body: Callable[[OpResult], None]) -> OpResult:
    result = OpResult(name, ProbeReport(), 0.0)
    started = time.monotonic()
    try:
        body(result)
    except Exception as err:  # a drill that breaks down is a result too
        result.error = f"{type(err).__name__}: {err}"[:1500]
    result.seconds = time.monotonic() - started
    return result


# -- the operations ---------------------------------------------------------------------------


def rolling_update(cluster: RealCluster, tag: str = "rolled") -> OpResult:
    def body(result: OpResult) -> None:
        image = cluster.retag_pyproxy(tag)
        with Prober(targets(cluster)) as prober:
            cluster.kubectl("-n", "kube-system", "set", "image", "daemonset/pyproxy",
                            f"pyproxy={image}")
            cluster.rollout("daemonset", "pyproxy")
            prober.settle(5.0)
        result.report = prober.report
        cluster.pyproxy_image = image
    return timed("rolling-update", body)


# The release the version drill rolls between this commit and: the last commit whose table
# lacks the localhost NodePort objects (beb887c added `localhost-nodeport-reject-ports` and its
# three chains) and records no layout (the table comment came with layout 2), so that each
# way the proxy meets a table written by another layout: upgrading, it replaces the table
# whole; downgrading, the older code patches it (its full sync deletes the objects it does
# not know).
OLDER_RELEASE = "7e27371"


def older_image(commit: str = OLDER_RELEASE) -> tuple[str, Path]:
    """(name, archive) of pyproxy's image at `commit`, built by that commit's own recipe
    (its testkit, its Containerfile) from a temporary worktree, cached like every image."""
    name = f"localhost/pyproxy:{commit}"
    with tempfile.TemporaryDirectory(prefix="pyproxy-older-") as tmp:
        tree = Path(tmp) / "src"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree),
                        commit], check=True, capture_output=True)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "testkit.images", "--pyproxy-tag", name, "pyproxy"],
                cwd=tree, check=True, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": str(tree)}).stdout
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(tree)], check=False, capture_output=True)
    path = next(line.split(None, 1)[1] for line in out.splitlines()
                if line.startswith(name + " "))
    return name, Path(path)


def version_roll(cluster: RealCluster) -> OpResult:
    """This commit → the older release → this commit → the older release → this commit, each
    a rolling update of the DaemonSet, with clients on every node and outside counting
    failures throughout. After each step every node's table is the one that release writes:
    this commit's records its layout and, where this commit's had them, the localhost
    NodePort objects are gone under the older release."""
    def body(result: OpResult) -> None:
        current = cluster.pyproxy_image
        localhost_objects = all(_localhost_objects(n) for n in cluster.nodes)
        older, archive = older_image()
        for node in cluster.nodes:
            node.import_images([archive])
        with Prober(targets(cluster)) as prober:
            for step, image in enumerate((older, current, older, current), 1):
                started = time.monotonic()
                cluster.kubectl("-n", "kube-system", "set", "image", "daemonset/pyproxy",
                                f"pyproxy={image}")
                cluster.rollout("daemonset", "pyproxy")
                up = image == current
                wait_for(lambda up=up: all(_written_by(n, up, localhost_objects)
                                           for n in cluster.nodes), 60,
                         f"every node's table as {image} writes it")
                result.figures[f"step {step} ({'up' if up else 'down'}) s"] = \
                    time.monotonic() - started
                prober.settle(3.0)
        result.report = prober.report
        cluster.pyproxy_image = current
    return timed("version-roll", body)


def _table(node: Any) -> str:
    return str(node.run(["nft", "list", "table", "ip", "pyproxy"], check=False).stdout)


def _localhost_objects(node: Any) -> bool:
    return "localhost-nodeport-reject-ports" in _table(node)


def _written_by(node: Any, current: bool, localhost_objects: bool) -> bool:
    """The node's table as this commit writes it (its layout recorded; `current`) or as the
    older release does (no localhost NodePort objects, when this commit's table had them;
    the comment stays: the older release cannot rewrite it)."""
    table = _table(node)
    if current:
        return TABLE_COMMENT in table and (
            "localhost-nodeport-reject-ports" in table) == localhost_objects
    return "localhost-nodeport-reject-ports" not in table


def container_killed(cluster: RealCluster) -> OpResult:
    def body(result: OpResult) -> None:
        node = cluster.nodes[0]
        (pod,) = [p for p in pyproxy_pods(cluster) if p.spec.node_name == node.name]
        restarts = pod.status.container_statuses[0].restart_count
        container = pod.status.container_statuses[0].container_id.split("://", 1)[1]
        with Prober(targets(cluster)) as prober:
            killed = time.monotonic()
            out = node.ctr("tasks", "kill", "--signal", "SIGKILL", container)
            if out.returncode != 0:
                raise RuntimeError(f"ctr tasks kill: {out.stderr.strip()}")

            def restarted() -> bool:
                now = cluster.kube.core.read_namespaced_pod(pod.metadata.name, "kube-system")
                status = now.status.container_statuses[0]
                return bool(status.restart_count > restarts and status.ready)
            wait_for(restarted, 120, "the kubelet restarting pyproxy's container")
            result.figures["back Ready after s"] = time.monotonic() - killed
            prober.settle(3.0)
        result.report = prober.report
    return timed("container-killed", body)


def apiserver_restart(cluster: RealCluster, down: float = 10.0) -> OpResult:
    def body(result: OpResult) -> None:
        with Prober(targets(cluster)) as prober:
            cluster.plane.kill_apiserver()
            prober.settle(down)
            cluster.plane.start_apiserver()
            answered = time.monotonic()
            result.figures["API server down s"] = down
            cluster.kubectl("-n", NS, "apply", "-f", "-", input=yaml.safe_dump(
                service("after-restart", NS, {"app": "web"})))
            svc = cluster.kube.core.read_namespaced_service("after-restart", NS)
            wait_for(lambda: any(e.conditions.ready for piece in cluster.kube.slices(
                NS, "after-restart") for e in piece.endpoints or []), 60,
                "the new Service's EndpointSlice")
            result.figures["its EndpointSlice after s"] = time.monotonic() - answered

            def everywhere() -> bool:
                return all(_answers(n.ns.full, svc.spec.cluster_ip, 80) for n in cluster.nodes)
            wait_for(everywhere, 60, "a Service made after the restart working on every node")
            result.figures["new Service on every node after s"] = time.monotonic() - answered
            prober.settle(2.0)
        result.report = prober.report
    return timed("apiserver-restart", body)


def node_reboot(cluster: RealCluster) -> OpResult:
    def body(result: OpResult) -> None:
        node, others = cluster.nodes[0], cluster.nodes[1:]
        svc = cluster.kube.core.read_namespaced_service("web", NS)
        # Backends only where nothing reboots: the clients through the other nodes must not
        # notice, whatever the rebooted node does.
        cluster.kubectl("-n", NS, "patch", "deployment", "web", "--type=merge", "-p", json.dumps(
            {"spec": {"template": {"spec": {"nodeSelector": {
                "kubernetes.io/hostname": others[0].name}, "topologySpreadConstraints": None}}}}))
        cluster.rollout("deployment", "web", NS)
        # The old pods gone too.
        wait_for(lambda: {p.spec.node_name for p in cluster.kube.core.list_namespaced_pod(
            NS, label_selector="app=web").items} == {others[0].name}, 60,
            f"web's pods on {others[0].name} only")
        time.sleep(2)
        with Prober(targets(cluster, others)) as prober:
            rebooted = time.monotonic()
            node.reboot()
            result.notes.append(f"{node.name}: ruleset {node_tables(node) or 'empty'} after "
                                "the reboot, before pyproxy")
            wait_for(lambda: _answers(node.ns.full, svc.spec.cluster_ip, 80), 180,
                     f"{node.name} serving the ClusterIP again")
            result.figures["rebooted node serving again after s"] = time.monotonic() - rebooted
            prober.settle(2.0)
        result.report = prober.report
        cluster.wait_nodes_ready()
        cluster.rollout("daemonset", "pyproxy")
        cluster.kubectl("-n", NS, "patch", "deployment", "web", "--type=json", "-p", json.dumps(
            [{"op": "remove", "path": "/spec/template/spec/nodeSelector"}]))
        cluster.rollout("deployment", "web", NS)
    return timed("node-reboot", body)


def _answers(netns: str, ip: str, port: int) -> bool:
    return not any(is_failure(o) for o in http_probe(netns, ip, port, 1, 2.0))


# -- kube-proxy and the migration -------------------------------------------------------------


def back_to_pyproxy_only(cluster: RealCluster) -> None:
    """The cluster as the other drills expect it after a migration drill: pyproxy from
    manifests/ synced on every node, kube-proxy's DaemonSet gone and its rules cleaned up."""
    cluster.deploy_pyproxy(cluster.pyproxy_image)
    cluster.rollout("daemonset", "pyproxy")
    wait_for(lambda: pyproxy_synced(cluster), 120, "pyproxy synced on every node")
    cluster.kubectl("-n", "kube-system", "delete", "ds", "kube-proxy")
    wait_for(lambda: not _pods(cluster, "k8s-app=kube-proxy"), 120, "kube-proxy gone")
    for pod in pyproxy_pods(cluster):
        cluster.kubectl("-n", "kube-system", "exec", pod.metadata.name, "--",
                        "pyproxy", "cleanup", "--kube-proxy")


def pyproxy_synced(cluster: RealCluster) -> bool:
    """docs/deploying.md step 3: ask every pyproxy pod whether it has synced."""
    for pod in pyproxy_pods(cluster):
        out = cluster.kubectl("-n", "kube-system", "exec", pod.metadata.name, "--",
                              "pyproxy", "status", "-o", "json", check=False)
        if out.returncode != 0 or json.loads(out.stdout).get("lastFullSync") is None:
            return False
    return True


def to_kube_proxy_only(cluster: RealCluster) -> None:
    """The starting point of a migration: kube-proxy's DaemonSet alone (pyproxy's removed and
    its tables deleted once kube-proxy has synced)."""
    deploy_kube_proxy(cluster)
    cluster.kubectl("-n", "kube-system", "delete", "ds", "pyproxy")
    wait_for(lambda: not pyproxy_pods(cluster), 120, "pyproxy's pods gone")
    for node in cluster.nodes:
        node.run(["nft", "delete", "table", "ip", "pyproxy"], check=False)
        node.run(["nft", "delete", "table", "ip6", "pyproxy"], check=False)


def migration(cluster: RealCluster) -> OpResult:
    """docs/deploying.md, "From kube-proxy to pyproxy" and "Back to kube-proxy", literally,
    from a cluster that runs kube-proxy only; pyproxy alone again at the end."""
    def body(result: OpResult) -> None:
        to_kube_proxy_only(cluster)
        with Prober(targets(cluster)) as prober:
            cluster.deploy_pyproxy(cluster.pyproxy_image)  # step 2
            cluster.rollout("daemonset", "pyproxy")
            wait_for(lambda: pyproxy_synced(cluster), 120, "pyproxy synced on every node")
            cluster.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "-p", json.dumps(
                {"spec": {"template": {"spec": {"nodeSelector": {
                    "pyproxy.io/run-kube-proxy": "true"}}}}}))  # step 4
            wait_for(lambda: not _pods(cluster, "k8s-app=kube-proxy"), 120,
                     "kube-proxy's pods gone")
            for pod in pyproxy_pods(cluster):  # step 5
                cluster.kubectl("-n", "kube-system", "exec", pod.metadata.name, "--",
                                "pyproxy", "cleanup", "--kube-proxy")
            prober.settle(5.0)
            forward = dataclasses.replace(prober.report,
                                          failures=dict(prober.report.failures))
            result.notes.append(f"to pyproxy: {forward.line()}; tables: "
                                + ", ".join(f"{n.name}: {node_tables(n)}" for n in cluster.nodes))
            # Back to kube-proxy, steps 1 to 4: docs/deploying.md's own commands, run by bash
            # with the cluster's kubectl; the drill waits where the reader would.
            back = doc_steps(BACK_TO_KUBE_PROXY)
            run_doc(cluster, back[1])  # kube-proxy back: unpark it, rollout status
            wait_for(lambda: all("kube-proxy" in node_tables(n) for n in cluster.nodes), 120,
                     "kube-proxy's table on every node")
            image = run_doc(cluster, back[2] + '\nprintf "%s\\n" "$image"\n'
                            ).stdout.splitlines()[-1]  # the image noted, the DaemonSet gone
            result.notes.append(f"back to kube-proxy: pyproxy's tables removed by {image}")
            wait_for(lambda: not pyproxy_pods(cluster), 120, "pyproxy's pods gone")
            for node in cluster.nodes:  # `kubectl debug node/NODE ... -- pyproxy cleanup`
                debug_cleanup(cluster, node, back[3], image)
            run_doc(cluster, back[4])  # kube-proxy restarted
            cluster.rollout("daemonset", "kube-proxy")
            prober.settle(5.0)
        result.report = prober.report
        result.notes.append("back to kube-proxy: tables: "
                            + ", ".join(f"{n.name}: {node_tables(n)}" for n in cluster.nodes))
        # Leave the cluster as it was: pyproxy in, kube-proxy out.
        back_to_pyproxy_only(cluster)
    return timed("migration", body)


BACK_TO_KUBE_PROXY = "### Back to kube-proxy"
TO_PYPROXY = "### From kube-proxy to pyproxy"
LB_IP = "172.20.0.30"  # the eTP=Local LoadBalancer's address, as a cloud controller writes it
# kube-proxy's chains in the iptables tables (iptables mode); the kubelet's have other names.
KUBE_PROXY_CHAIN = re.compile(
    r"-N (KUBE-(?!FIREWALL$|KUBELET-CANARY$|IPTABLES-HINT$)\S+)$")
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")


def iptables_chains(node: Any) -> list[str]:
    """`TABLE/CHAIN` of every KUBE-* chain in a node's iptables tables (iptables-nft), sorted."""
    found = []
    for table in ("mangle", "nat", "filter"):
        out = node.run(["iptables", "-w", "5", "-t", table, "-S"], check=False).stdout
        found += [f"{table}/{line.split()[1]}" for line in out.splitlines()
                  if line.startswith("-N KUBE-")]
    return sorted(found)


def kube_proxys_chains(chains: Sequence[str]) -> list[str]:
    """Those of `iptables_chains` that are kube-proxy's, not the kubelet's."""
    return [c for c in chains if KUBE_PROXY_CHAIN.match("-N " + c.split("/", 1)[1])]


def iptables_targets(cluster: RealCluster) -> list[Target]:
    """The migration drill's clients plus what iptables mode served that nftables mode does
    not: the NodePort on 127.0.0.1 from every node, and the eTP=Local LoadBalancer from
    outside (through the first node, whose fabric route the drill adds)."""
    return (targets(cluster)
            + [Target(n.ns.full, "127.0.0.1", NODE_PORT, f"{n.name} -> 127.0.0.1 NodePort")
               for n in cluster.nodes]
            + [Target(cluster.outside.full, LB_IP, 80, "outside -> eTP=Local LB")])


def deploy_pyproxy_kubeadm(cluster: RealCluster, image: str) -> None:
    """docs/deploying.md, "On a kubeadm cluster": `kubectl apply -f
    manifests/00-serviceaccount.yaml -f manifests/01-rbac.yaml -f manifests/kubeadm/`, kube-proxy's
    own ConfigMap read as it is, with the image filled in (a kustomize overlay, as
    RealCluster.deploy_pyproxy does for manifests/)."""
    cluster.deploy_manifests("pyproxy-kubeadm-overlay", image, [
        "base/00-serviceaccount.yaml", "base/01-rbac.yaml", "base/kubeadm/03-daemonset.yaml"])


def check_kubeadm_config(cluster: RealCluster) -> str:
    """docs/deploying.md, "On a kubeadm cluster", "Check it first": the ConfigMap's
    config.conf through `pyproxy config check` (this checkout's); its last line."""
    pyproxy = str(Path(sys.executable).parent / "pyproxy")
    with tempfile.TemporaryDirectory() as tmp:
        out = run_doc(cluster, "kubectl -n kube-system get cm kube-proxy -o "
                      "jsonpath='{.data.config\\.conf}' > config.conf\n"
                      f"{pyproxy} config check --config config.conf\n", cwd=tmp)
    lines = out.stdout.splitlines()
    return "; ".join([*(line for line in lines if line.startswith("change: ")), lines[-1]])


def iptables_migration(cluster: RealCluster) -> OpResult:
    """From kubeadm's kube-proxy DaemonSet and ConfigMap in `mode: iptables` (iptables-nft) to
    pyproxy reading that ConfigMap as it is (manifests/kubeadm/), following docs/deploying.md
    ("From kube-proxy to pyproxy" steps 3 to 5, step 4 and 5 as written), and back ("Back to
    kube-proxy" steps 1 to 4 as written), with clients on the ClusterIP from every node, the
    NodePort from outside on every node and on 127.0.0.1 from every node, and an eTP=Local
    LoadBalancer from outside."""
    def body(result: OpResult) -> None:
        cluster.kubectl("-n", "kube-system", "delete", "ds", "kube-proxy", "--ignore-not-found")
        wait_for(lambda: not _pods(cluster, "k8s-app=kube-proxy"), 120, "kube-proxy gone")
        deploy_kube_proxy(cluster, mode="iptables")
        cluster.kubectl("-n", "kube-system", "delete", "ds", "pyproxy")
        wait_for(lambda: not pyproxy_pods(cluster), 120, "pyproxy's pods gone")
        for node in cluster.nodes:
            node.run(["nft", "delete", "table", "ip", "pyproxy"], check=False)
            node.run(["nft", "delete", "table", "ip6", "pyproxy"], check=False)
        cluster.kube.core.patch_namespaced_service_status("web-local", NS, {"status": {
            "loadBalancer": {"ingress": [{"ip": LB_IP}]}}})
        cluster.lab.add_route(cluster.net, f"{LB_IP}/32", via=cluster.nodes[0].spec.ip)
        clients = iptables_targets(cluster)
        wait_for(lambda: all(_answers(t.netns, t.ip, t.port) for t in clients), 60,
                 "every client answered by kube-proxy in iptables mode")
        before = {n.name: iptables_chains(n) for n in cluster.nodes}
        result.notes.append("kube-proxy (iptables mode): " + ", ".join(
            f"{name}: {len(kube_proxys_chains(c))} chains of kube-proxy's"
            for name, c in before.items()))
        result.notes.append(f"config check: {check_kubeadm_config(cluster)}")
        steps = doc_steps(TO_PYPROXY)
        with Prober(clients) as prober:
            deploy_pyproxy_kubeadm(cluster, cluster.pyproxy_image)  # step 2, kubeadm's way
            cluster.rollout("daemonset", "pyproxy")
            wait_for(lambda: pyproxy_synced(cluster), 120, "pyproxy synced on every node")
            run_doc(cluster, steps[4])  # kube-proxy parked
            wait_for(lambda: not _pods(cluster, "k8s-app=kube-proxy"), 120,
                     "kube-proxy's pods gone")
            run_doc(cluster, steps[5])  # pyproxy cleanup --kube-proxy in every pyproxy pod
            prober.settle(5.0)
            forward = dataclasses.replace(prober.report, failures=dict(prober.report.failures))
            after = {n.name: iptables_chains(n) for n in cluster.nodes}
            left = {name: kube_proxys_chains(c) for name, c in after.items()}
            if any(left.values()):
                raise RuntimeError(f"kube-proxy's chains left after the cleanup: {left}")
            kept = {name: sorted({c.split("/", 1)[1] for c in before[name]}
                                 & set(KUBELET_CHAINS)) for name in before}
            gone = {name: [c for c in before[name] if c.split("/", 1)[1] in KUBELET_CHAINS
                           and c not in after[name]] for name in before}
            if any(gone.values()):
                raise RuntimeError(f"the kubelet's chains removed by the cleanup: {gone}")
            result.notes.append(f"to pyproxy: {forward.line()}; the kubelet's chains kept: "
                                + ", ".join(f"{n}: {' '.join(k) or 'none'}"
                                            for n, k in kept.items()))
            back = doc_steps(BACK_TO_KUBE_PROXY)
            run_doc(cluster, back[1])  # kube-proxy back: unpark it, rollout status, its rules
            wait_for(lambda: all(kube_proxy_synced(n, "iptables") for n in cluster.nodes),
                     120, "kube-proxy's rules on every node")
            image = run_doc(cluster, back[2] + '\nprintf "%s\\n" "$image"\n'
                            ).stdout.splitlines()[-1]
            wait_for(lambda: not pyproxy_pods(cluster), 120, "pyproxy's pods gone")
            for node in cluster.nodes:
                debug_cleanup(cluster, node, back[3], image)
            run_doc(cluster, back[4])  # kube-proxy restarted
            cluster.rollout("daemonset", "kube-proxy")
            prober.settle(5.0)
        result.report = prober.report
        result.figures["failed going to pyproxy"] = float(forward.failed)
        result.figures["failed going back"] = float(prober.report.failed - forward.failed)
        # Leave the cluster as the other drills expect it: pyproxy from manifests/, no
        # kube-proxy, no LoadBalancer address.
        back_to_pyproxy_only(cluster)
        cluster.kube.core.patch_namespaced_service_status("web-local", NS, {"status": {
            "loadBalancer": {"ingress": None}}})
    return timed("iptables-migration", body)


def doc_steps(heading: str, doc: Path = DEPLOYING) -> dict[int, str]:
    """A numbered procedure of docs/deploying.md: step number -> its first ```sh block."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    steps: dict[int, str] = {}
    step: int | None = None
    block: list[str] | None = None
    for line in lines[lines.index(heading) + 1:]:
        if block is not None:
            if line.strip() == "```":
                if step is not None:
                    steps.setdefault(step, textwrap.dedent("\n".join(block)) + "\n")
                block = None
            else:
                block.append(line)
        elif line.startswith("#"):
            break  # the next section
        elif match := re.match(r"(\d+)\. ", line):
            step = int(match.group(1))
        elif line.strip() == "```sh":
            block = []
    return steps


def run_doc(cluster: RealCluster, script: str, cwd: str | None = None, **variables: str,
            ) -> subprocess.CompletedProcess[str]:
    """A shell block of the docs, as an operator runs it: bash, the cluster's kubectl first on
    PATH, its admin kubeconfig; ``variables`` set before (a value an earlier step kept)."""
    env = {**os.environ, "PATH": f"{cluster.bin}:{os.environ.get('PATH', '')}",
           "KUBECONFIG": str(cluster.admin_kubeconfig()), **variables}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], input="", env=env,
                         capture_output=True, text=True, timeout=300, check=False, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"docs/deploying.md's\n{script}failed ({out.returncode}): "
                           f"{out.stderr.strip()[-1500:]}")
    return out


def debug_cleanup(cluster: RealCluster, node: Any, command: str, image: str) -> None:
    """"Back to kube-proxy", step 3 on one node: the docs' `kubectl debug node/NODE -it
    --profile=netadmin --image="$image" -- pyproxy cleanup` (stdin no terminal, so no TTY).
    kubectl does not pass the container's exit code on: the debug pod's status tells, and
    pyproxy's tables must be gone from the node. The pod is deleted after."""
    out = run_doc(cluster, command.replace("NODE", node.name), image=image)
    match = re.search(r"Creating debugging pod (\S+) with container", out.stdout)
    if match is None:
        raise RuntimeError(f"kubectl debug node/{node.name}: no debugging pod in "
                           f"{out.stdout.strip()!r} {out.stderr.strip()!r}")
    namespace = "default"  # the admin kubeconfig's
    pod = match.group(1)

    def terminated() -> Any:
        status = cluster.kube.core.read_namespaced_pod(pod, namespace).status
        states = [c.state.terminated for c in status.container_statuses or []]
        return states[0] if states and states[0] is not None else None
    wait_for(terminated, 120, f"{pod} finished")
    state = terminated()
    if state.exit_code != 0:
        logs = cluster.kubectl("-n", namespace, "logs", pod, check=False).stdout
        raise RuntimeError(f"{pod}: pyproxy cleanup exited {state.exit_code}: {logs[-1500:]}")
    if "pyproxy" in node_tables(node):
        raise RuntimeError(f"{node.name}: pyproxy's tables still there after {pod}: "
                           f"{node_tables(node)}")
    cluster.kubectl("-n", namespace, "delete", "pod", pod, "--wait=false")


def _pods(cluster: RealCluster, selector: str) -> list[Any]:
    return list(cluster.kube.core.list_namespaced_pod("kube-system",
                                                      label_selector=selector).items)


# -- a cloud load balancer's view -------------------------------------------------------------


@dataclass
class Backend:
    node: str
    ip: str
    healthy: bool = True
    passes: int = 0
    fails: int = 0


class LoadBalancer:
    """What a cloud load balancer does with a Service's nodes: a health check of each node
    every `interval` (HTTP, 1 s timeout; `threshold` results in a row flip the state, 2 like
    most clouds), client connections spread over the nodes it sees healthy only."""

    def __init__(self, cluster: RealCluster, health_port: int, path: str, traffic_port: int,
                 interval: float = 1.0, threshold: int = 2) -> None:
        self.cluster = cluster
        self.health_port, self.path, self.traffic_port = health_port, path, traffic_port
        self.interval, self.threshold = interval, threshold
        self.backends = [Backend(n.name, n.spec.ip) for n in cluster.nodes]
        self.report = ProbeReport()
        self.flips: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._check_loop, daemon=True),
                         threading.Thread(target=self._client_loop, daemon=True)]
        self._started = time.monotonic()

    def __enter__(self) -> LoadBalancer:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _healthy(self, backend: Backend) -> bool:
        def get() -> bool:
            try:
                url = f"http://{backend.ip}:{self.health_port}{self.path}"
                with urllib.request.urlopen(url, timeout=1.0) as answer:
                    return bool(answer.status == 200)
            except Exception:
                return False
        return call_in_netns(self.cluster.outside.full, get)

    def _check_loop(self) -> None:
        while not self._stop.is_set():
            for backend in self.backends:
                ok = self._healthy(backend)
                backend.passes, backend.fails = ((backend.passes + 1, 0) if ok
                                                 else (0, backend.fails + 1))
                if backend.healthy and backend.fails >= self.threshold:
                    backend.healthy = False
                    self.flips.append(f"{time.monotonic() - self._started:.1f}s "
                                      f"{backend.node} out")
                elif not backend.healthy and backend.passes >= self.threshold:
                    backend.healthy = True
                    self.flips.append(f"{time.monotonic() - self._started:.1f}s "
                                      f"{backend.node} in")
            self._stop.wait(self.interval)

    def _client_loop(self) -> None:
        while not self._stop.is_set():
            for backend in [b for b in self.backends if b.healthy]:
                counts = http_probe(self.cluster.outside.full, backend.ip, self.traffic_port,
                                    2, 3.0)
                for outcome, n in counts.items():
                    self.report.total += n
                    if is_failure(outcome):
                        self.report.failed += n
                        key = f"{backend.node}: {outcome}"
                        self.report.failures[key] = self.report.failures.get(key, 0) + n
            self._stop.wait(0.05)

    def wait_out(self, node: str, timeout: float = 60.0) -> float:
        (backend,) = [b for b in self.backends if b.node == node]
        return wait_for(lambda: not backend.healthy, timeout, f"the LB taking {node} out")


def lb_drain(cluster: RealCluster) -> OpResult:
    """A node drained for deletion, then pyproxy's DaemonSet rolled, under a load balancer's
    health checks for an eTP=Cluster Service (:10256/healthz) and an eTP=Local one."""
    def body(result: OpResult) -> None:
        local = cluster.kube.core.read_namespaced_service("web-local", NS)
        hc_port = local.spec.health_check_node_port
        victim = cluster.nodes[-1]
        with contextlib.ExitStack() as stack:
            cluster_lb = stack.enter_context(LoadBalancer(cluster, 10256, "/healthz", NODE_PORT))
            local_lb = stack.enter_context(
                LoadBalancer(cluster, hc_port, "/", LOCAL_NODE_PORT))
            time.sleep(4)
            cluster.kubectl("taint", "node", victim.name,
                            "ToBeDeletedByClusterAutoscaler=1:NoSchedule")
            result.figures["LB took the tainted node out after s"] = cluster_lb.wait_out(
                victim.name)
            cluster.kubectl("drain", victim.name, "--ignore-daemonsets", "--force",
                            "--delete-emptydir-data", "--timeout=120s", timeout=180)
            local_lb.wait_out(victim.name)
            victim.stop()  # the autoscaler deletes the machine...
            cluster.kubectl("delete", "node", victim.name)  # ...and its Node
            cluster.nodes.remove(victim)
            time.sleep(5)
            image = cluster.retag_pyproxy("lb-roll")
            cluster.kubectl("-n", "kube-system", "set", "image", "daemonset/pyproxy",
                            f"pyproxy={image}")
            cluster.rollout("daemonset", "pyproxy")
            cluster.pyproxy_image = image
            time.sleep(5)
        result.report = ProbeReport(
            cluster_lb.report.total + local_lb.report.total,
            cluster_lb.report.failed + local_lb.report.failed,
            {**{f"eTP=Cluster {k}": v for k, v in cluster_lb.report.failures.items()},
             **{f"eTP=Local {k}": v for k, v in local_lb.report.failures.items()}})
        result.notes.append("eTP=Cluster LB: " + ", ".join(cluster_lb.flips))
        result.notes.append("eTP=Local LB: " + ", ".join(local_lb.flips))
    return timed("lb-drain", body)


OPERATIONS: list[tuple[str, Callable[[RealCluster], OpResult]]] = [
    ("rolling-update", rolling_update),
    ("version-roll", version_roll),
    ("container-killed", container_killed),
    ("apiserver-restart", apiserver_restart),
    ("node-reboot", node_reboot),
    ("migration", migration),
    ("iptables-migration", iptables_migration),
    ("lb-drain", lb_drain),  # last: it removes a node
]


def markdown(results: Sequence[OpResult]) -> str:
    rows = ["| operation | connections | failed | figures | seconds |", "|---|---|---|---|---|"]
    for r in results:
        figures = "; ".join(f"{k} {v:.1f}" for k, v in r.figures.items()) or "-"
        failed = f"{r.report.failed}" + (" (broke down)" if r.error else "")
        rows.append(f"| {r.name} | {r.report.total} | {failed} | {figures} | {r.seconds:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--json", help="default: bench/results/cluster-drills-COMMIT.json "
                        "(cluster-drills-ONLY-COMMIT.json with --only)")
    args = parser.parse_args(argv)
    if not NETNS_USABLE:
        print("cluster drills: needs root and `ip netns`", file=sys.stderr)
        return 2
    selected = [(n, f) for n, f in OPERATIONS if not args.only or any(o in n for o in args.only)]
    results: list[OpResult] = []
    started = time.monotonic()
    with running_cluster(args.nodes) as cluster:
        print(f"cluster up in {cluster.up_seconds:.0f} s ({len(cluster.nodes)} nodes)",
              flush=True)
        workload(cluster)
        for name, run in selected:
            print(f"\n== {name}", flush=True)
            result = run(cluster)
            print(result.summary(), flush=True)
            results.append(result)
    print(f"\ncluster drills: {len(results)} in {time.monotonic() - started:.0f} s\n")
    print(markdown(results))
    commit, dirty = git_commit()
    out = Path(args.json) if args.json else results_path(commit, args.only)
    out.write_text(json.dumps({
        "commit": commit, "uncommitted_changes": dirty, "nodes": args.nodes,
        "seconds": round(time.monotonic() - started, 1),
        "operations": [dataclasses.asdict(r) for r in results]}, indent=2, default=str) + "\n")
    print(f"\nfigures: {out}")
    return 0 if all(r.ok for r in results) else 1


def git_commit() -> tuple[str, bool]:
    """This checkout's commit (short) and whether it has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              text=True, check=False).stdout.strip()
    return git("rev-parse", "--short", "HEAD") or "unknown", bool(git("status", "--porcelain"))


def results_path(commit: str, only: Sequence[str] = ()) -> Path:
    """Where `make cluster-drills` records its figures, as the benchmarks do theirs:
    bench/results/cluster-drills-COMMIT.json; a selection's run names it."""
    selection = "".join(re.sub(r"[^\w.]+", "_", o) + "-" for o in only)
    return REPO / "bench" / "results" / f"cluster-drills-{selection}{commit}.json"


if __name__ == "__main__":
    sys.exit(main())
