"""pyproxy on real nodes: its image run by real kubelets from manifests/ (testkit/cluster.py).

A real cluster on this machine (control plane, kube-scheduler, two nodes each with a kubelet,
containerd and runc, CoreDNS): pyproxy's DaemonSet as shipped (only the image and the API
server's address filled in) goes Ready under the kubelet's probes, a pod on one node reaches a
Service by its DNS name with the endpoint on the other node, and a rolling update of the
DaemonSet to a new image tag loses no connection. The operations drills (migration, node
reboot, ...) are `make cluster-drills`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.cluster import OUTSIDE_NET, Prober, RealCluster, Target, netexec, service
from testkit.controlplane import wait_for
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns

pytestmark = [pytest.mark.netns, pytest.mark.k8s, pytest.mark.cluster, requires_netns]

NS = "smoke"
NODE_PORT = 30180


def apply(cluster: RealCluster, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def pods(cluster: RealCluster, namespace: str, selector: str) -> list[Any]:
    return list(cluster.kube.core.list_namespaced_pod(namespace,
                                                      label_selector=selector).items)


def http_get(netns: str, ip: str, port: int, path: str, timeout: float = 5.0) -> str:
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=timeout) as answer:
            return str(answer.read().decode())
    return call_in_netns(netns, get, timeout=timeout + 5)


def test_a_sigkilled_harness_leaves_no_process_behind(tmp_path: Path) -> None:
    """`make cluster`'s harness SIGKILLed, so no teardown of its own runs: the control plane,
    the kubelet and containerd (a parent-death signal) and the shims and containers (the
    node's holder kills what its cgroups hold) die with it; the next run sweeps the
    namespaces. They all used to live on. One node without pyproxy, first in this file so
    that it is the only cluster up (about a minute)."""
    import subprocess
    import sys

    from testkit.cluster import CGROUP_FS, _own_memory_cgroup, sweep_stale_cgroups
    from testkit.fixtures import require_cluster_binaries
    from testkit.netlab import _list_netns, _netns_pids, sweep_stale

    require_cluster_binaries()
    log = (tmp_path / "harness.log").open("w")
    harness = subprocess.Popen(
        [sys.executable, "-m", "testkit.cluster", "run", "--keep", "--nodes=1", "--no-pyproxy",
         "--prefix="], cwd=Path(__file__).resolve().parents[1], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=log, text=True)
    assert harness.stdout is not None
    timer = threading.Timer(400, harness.kill)  # bounded, whatever happens
    timer.start()
    prefix = f"ppx-{harness.pid}-"
    cgroups = CGROUP_FS / "pids" / _own_memory_cgroup().strip("/")

    def lab_pids() -> dict[int, str]:
        """Every process in the run's namespaces or below its nodes' cgroups, by name."""
        pids = {pid for ns in _list_netns() if ns.startswith(prefix)
                for pid in _netns_pids(ns)}
        for procs in cgroups.glob(f"{prefix}*/**/cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
        names = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        return names

    try:
        seen = []
        for line in harness.stdout:
            seen.append(line)
            if "Enter or Ctrl-C ends it." in line:
                break
        else:
            pytest.fail("the cluster did not come up:\n" + "".join(seen)
                        + (tmp_path / "harness.log").read_text()[-3000:])
        # CoreDNS's pod has a shim and containers once the kubelet has started it.
        wait_for(lambda: {"containerd-shim", "pause"} <= set(lab_pids().values()), 120,
                 "a pod's shim and sandbox")
        running = set(lab_pids().values())
        assert {"etcd", "kube-apiserver", "kubelet", "containerd", "pause"} <= running, running
        harness.kill()
        harness.wait(10)
        try:
            wait_for(lambda: not lab_pids(), 30, "every process of the cluster gone")
        except AssertionError as error:  # say which, and what state each is in
            left = {pid: (name, _proc_state(pid)) for pid, name in lab_pids().items()}
            raise AssertionError(f"{error}: {left}\n"
                                 + (tmp_path / "harness.log").read_text()[-2000:]) from None
        assert not list(cgroups.glob(f"{prefix}*"))  # the holder removed its node's cgroups
    finally:
        timer.cancel()
        if harness.poll() is None:
            harness.kill()
            harness.wait(10)
        log.close()
        sweep_stale()  # the namespaces and the workdir of a dead run
        sweep_stale_cgroups(_own_memory_cgroup())
    assert not [ns for ns in _list_netns() if ns.startswith(prefix)]


def _proc_state(pid: int) -> str:
    """A process's state line and command line, for a failure's message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        state = next(line for line in status.splitlines() if line.startswith("State:"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        return f"{state.split(':', 1)[1].strip()} {cmdline.decode(errors='replace')[:200]}"
    except (OSError, StopIteration):
        return "gone"


def test_pyproxy_runs_from_the_shipped_manifests_on_every_node(real_cluster: RealCluster) -> None:
    cluster = real_cluster
    running = pods(cluster, "kube-system", "app.kubernetes.io/name=pyproxy")
    assert sorted(p.spec.node_name for p in running) == ["node-a", "node-b"]
    for pod in running:
        assert all(c.ready for c in pod.status.container_statuses)  # /healthz answered 200
        container = pod.spec.containers[0]
        assert container.security_context.read_only_root_filesystem
        assert container.security_context.capabilities.add == ["NET_ADMIN", "NET_RAW"]
        assert container.liveness_probe.http_get.path == "/livez"
        assert container.image == cluster.pyproxy_image
    for node in cluster.nodes:  # the kubelet started it in the node's network namespace
        tables = node.run(["nft", "list", "tables"]).stdout
        assert "table ip pyproxy" in tables


def test_a_pod_reaches_a_service_by_dns_name_on_the_other_node(real_cluster: RealCluster) -> None:
    cluster = real_cluster
    cluster.kubectl("create", "namespace", NS, check=False)
    apply(cluster, netexec("web", NS, node="node-b"), netexec("client", NS, node="node-a"),
          service("web", NS, {"app": "web"}, kind="NodePort", node_port=NODE_PORT))
    cluster.rollout("deployment", "web", NS)
    cluster.rollout("deployment", "client", NS)
    cluster.rollout("deployment", "coredns", "kube-system")
    (web,) = pods(cluster, NS, "app=web")
    (client,) = pods(cluster, NS, "app=client")
    node_a = cluster.nodes[0]
    query = urllib.parse.urlencode({"host": f"web.{NS}.svc.cluster.local", "port": 80,
                                    "request": "hostname", "protocol": "http", "tries": 1})
    answers: list[Any] = []

    def dialled() -> bool:
        out = json.loads(http_get(node_a.ns.full, client.status.pod_ip, 8080, f"/dial?{query}"))
        answers[:] = out.get("responses") or []
        return answers == [web.metadata.name]

    wait_for(dialled, 60, f"{client.metadata.name} on node-a reaching web.{NS} on node-b")


def test_a_rolling_update_of_pyproxy_loses_no_connection(real_cluster: RealCluster) -> None:
    cluster = real_cluster
    svc = cluster.kube.core.read_namespaced_service("web", NS)
    targets = [Target(node.ns.full, svc.spec.cluster_ip, 80, f"{node.name} -> ClusterIP")
               for node in cluster.nodes]
    targets += [Target(cluster.outside.full, node.spec.ip, NODE_PORT,
                       f"outside {OUTSIDE_NET[1]} -> {node.name}:NodePort")
                for node in cluster.nodes]
    new_image = cluster.retag_pyproxy("rolled")
    before = {p.metadata.name for p in pods(cluster, "kube-system",
                                            "app.kubernetes.io/name=pyproxy")}
    with Prober(targets) as prober:
        cluster.kubectl("-n", "kube-system", "set", "image", "daemonset/pyproxy",
                        f"pyproxy={new_image}")
        cluster.rollout("daemonset", "pyproxy")
        # Connections on after the last new pod went Ready: its first syncs are seen too.
        prober.settle(5.0)
    report = prober.report
    after = pods(cluster, "kube-system", "app.kubernetes.io/name=pyproxy")
    assert {p.metadata.name for p in after}.isdisjoint(before)
    assert {p.spec.containers[0].image for p in after} == {new_image}
    print(f"rolling update: {report.line()}")
    assert report.total > 100
    assert report.failed == 0, report.line()


def hostnames(netns: str, ip: str, port: int, count: int) -> list[str]:
    return [http_get(netns, ip, port, "/hostname") for _ in range(count)]


def test_services_on_real_pods(real_cluster: RealCluster) -> None:
    """eTP=Local LoadBalancer with its health-check node port, session affinity, a readiness
    flip and a scale to zero, on pods a container runtime started."""
    cluster = real_cluster
    node_a, node_b = cluster.nodes
    lb_ip = "172.20.0.10"
    flip = netexec("flip", NS, replicas=2)
    probe = {"exec": {"command": ["/bin/sh", "-c", "test ! -e /tmp/unready"]},
             "periodSeconds": 1, "failureThreshold": 1}
    flip["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = probe
    apply(cluster, flip,
          service("flip-lb", NS, {"app": "flip"}, kind="LoadBalancer",
                  externalTrafficPolicy="Local"),
          service("flip-sticky", NS, {"app": "flip"}, sessionAffinity="ClientIP"))
    cluster.rollout("deployment", "flip", NS)
    backends = {p.spec.node_name: p for p in pods(cluster, NS, "app=flip")}
    assert set(backends) == {"node-a", "node-b"}
    # The load balancer's address, as a cloud controller would write it; the fabric sends it
    # to node-a (a cloud LB would pick any node its health checks pass).
    cluster.kube.core.patch_namespaced_service_status("flip-lb", NS, {"status": {
        "loadBalancer": {"ingress": [{"ip": lb_ip}]}}})
    cluster.lab.add_route(cluster.net, f"{lb_ip}/32", via=node_a.spec.ip)
    lb = cluster.kube.core.read_namespaced_service("flip-lb", NS)
    outside = cluster.outside.full

    def lb_answers() -> bool:
        return http_get(outside, lb_ip, 80, "/hostname", 2) == backends["node-a"].metadata.name
    wait_for(lb_answers, 30, "the LoadBalancer IP answered by node-a's local endpoint")
    client = http_get(outside, lb_ip, 80, "/clientip")
    assert client.rsplit(":", 1)[0] == OUTSIDE_NET[1]  # eTP=Local keeps the client's address
    hc = lb.spec.health_check_node_port

    def local_endpoints(node: Any) -> int:
        """What node's health-check node port says: 503 until its proxy has programmed the
        node's local endpoint (the LB check above waited for node-a only; node-b's pyproxy
        may still be a sync behind, seen once in ten runs)."""
        try:
            return int(json.loads(http_get(outside, node.spec.ip, hc, "/"))["localEndpoints"])
        except urllib.error.HTTPError as err:
            if err.code == 503:
                return 0
            raise

    wait_for(lambda: [local_endpoints(n) for n in cluster.nodes
                      if n.name in backends] == [1, 1], 30,
             "the health-check node port answering 200 on both nodes with a local endpoint")

    sticky = cluster.kube.core.read_namespaced_service("flip-sticky", NS).spec.cluster_ip
    wait_for(lambda: len(set(hostnames(node_a.ns.full, sticky, 80, 1))) == 1, 30,
             "the sticky Service answering")
    assert len(set(hostnames(node_a.ns.full, sticky, 80, 20))) == 1  # ClientIP affinity

    # Readiness flip: node-b's pod unready -> gone from every node's choice, then back.
    pod_b = backends["node-b"].metadata.name
    cluster.kubectl("-n", NS, "exec", pod_b, "--", "touch", "/tmp/unready")
    plain = service("flip", NS, {"app": "flip"})
    apply(cluster, plain)
    ip = cluster.kube.core.read_namespaced_service("flip", NS).spec.cluster_ip
    wait_for(lambda: set(hostnames(node_a.ns.full, ip, 80, 10))
             == {backends["node-a"].metadata.name}, 30, "the unready pod left out")
    cluster.kubectl("-n", NS, "exec", pod_b, "--", "rm", "/tmp/unready")
    wait_for(lambda: pod_b in set(hostnames(node_a.ns.full, ip, 80, 20)), 30,
             "the pod back once ready")

    # Scale to zero: no endpoints anywhere -> rejected at once (kube-proxy's semantics).
    cluster.kubectl("-n", NS, "scale", "deployment", "flip", "--replicas=0")
    from testkit.inproc import http_probe

    wait_for(lambda: http_probe(node_b.ns.full, ip, 80, 1, 2.0) == {"refused": 1}, 60,
             "connections refused once the service has no endpoints")


def test_a_dead_runs_node_cgroups_are_swept() -> None:
    """A run killed without teardown leaves its nodes' containers in their cgroups; the next
    cluster's start kills them and removes the cgroups (a live run's are left alone)."""
    import subprocess

    from testkit.cluster import Cgroup, _own_memory_cgroup, sweep_stale_cgroups

    dead = subprocess.Popen(["true"])
    dead.wait()
    base = _own_memory_cgroup()
    stale = Cgroup(f"{base}/ppx-{dead.pid}-0-node-x").create()
    alive = Cgroup(f"{base}/ppx-{os.getpid()}-99-node-x").create()
    orphan = subprocess.Popen(["sh", "-c", 'for p in $0; do echo $$ > "$p"; done; exec sleep 60',
                               " ".join(stale.procs_file_args())])
    try:
        wait_for(lambda: stale.pids() == {orphan.pid}, 10, "the orphan in the stale cgroup")
        reaper = threading.Thread(target=orphan.wait)  # as init would reap a real orphan
        reaper.start()
        assert f"ppx-{dead.pid}-0-node-x" in sweep_stale_cgroups(base)
        reaper.join(10)
        assert orphan.returncode == -9
        assert not stale.pids()
        assert not (Path("/sys/fs/cgroup/pids") / stale.path.strip("/")).exists()
        assert (Path("/sys/fs/cgroup/pids") / alive.path.strip("/")).exists()
    finally:
        orphan.kill()
        stale.remove()
        alive.remove()
