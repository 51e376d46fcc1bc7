"""pyproxy against a real Kubernetes control plane (testkit/controlplane.py, `make k8s`).

Real kube-apiserver, etcd and kube-controller-manager: Services with selectors and Pods (bound
to nodes, status written by the test as a kubelet would) become EndpointSlices through the real
EndpointSlice controller; pyproxy runs in node namespaces with the identity the shipped
manifests give it and programs the kernel; real packets land on backends in pod namespaces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.controlplane import (
    Attachment,
    ControlPlane,
    Daemon,
    Kube,
    apply_manifests,
    service_account_token,
    start_pyproxy,
    wait_for,
)
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, ConnResult, Lab, tally

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]

NAMESPACE = "e2e"
APP = {"app": "web"}
VIP4, VIP6 = "10.96.0.10", "fd00:96::a"
LB_IP = "192.168.77.10"
NODE_PORT = 30080


# -- one node, the standard topology -----------------------------------------------------------


@dataclass
class Node:
    cluster: Cluster
    kube: Kube
    plane: ControlPlane
    attachment: Attachment
    daemon: Daemon
    kubeconfig: Path

    def connect(self, ip: str, port: int = 80, count: int = 30) -> set[str]:
        return set(tally(self.cluster.lab.connect(self.cluster.client, ip, port, count=count,
                                                  parallel=10, timeout=0.5)))

    def eventually_lands(self, ip: str, expected: set[str], port: int = 80,
                         timeout: float = 20.0, what: str = "") -> float:
        return wait_for(lambda: self.connect(ip, port) == expected, timeout,
                        what or f"{ip}:{port} lands on {sorted(expected)}", interval=0.2)

    def pod_ips(self, name: str) -> tuple[str, str]:
        pod = self.cluster.pods[name]
        return pod.ip4, pod.ip6


@pytest.fixture(scope="module")
def node(control_plane: ControlPlane) -> Iterator[Node]:
    kube = Kube(control_plane.admin_client())
    apply_manifests(kube)
    kube.namespace(NAMESPACE)
    with Lab() as lab:
        cluster = lab.standard_topology(backends=3)
        attachment = control_plane.attach(cluster.node)
        kube.node("node-a", (cluster.node_ip4, cluster.node_ip6), zone="zone-1")
        kube.node("node-b", ("192.168.50.3",), zone="zone-1")
        kubeconfig = control_plane.node_kubeconfig(lab.workdir / "pyproxy.kubeconfig",
                                                   service_account_token(kube))
        daemon = start_pyproxy(lab, cluster.node, kubeconfig, "node-a",
                               "--bind-address", cluster.node_ip4)
        try:
            yield Node(cluster, kube, control_plane, attachment, daemon, kubeconfig)
        finally:
            lab.stop_process(daemon.proc)
            clear_web(kube)
            for name in ("node-a", "node-b"):
                kube.core.delete_node(name)


def web_service(kind: str = "ClusterIP", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "web"},
        "spec": {"type": kind, "selector": APP, "ipFamilyPolicy": "PreferDualStack",
                 "clusterIP": VIP4, "clusterIPs": [VIP4, VIP6],
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                            "protocol": "TCP"}], **spec},
    }


def clear_web(kube: Kube) -> None:
    """No web Service and no pods, whatever an earlier test left behind."""
    from kubernetes.client.exceptions import ApiException

    for pod in kube.core.list_namespaced_pod(NAMESPACE).items:
        kube.delete_pod(NAMESPACE, pod.metadata.name)
    try:
        kube.core.delete_namespaced_service("web", NAMESPACE)
    except ApiException as err:
        if err.status != 404:
            raise
    wait_for(lambda: not kube.core.list_namespaced_pod(NAMESPACE).items, 20, "pods gone")


def fresh_web(node: Node) -> None:
    """The web Service and no pods."""
    clear_web(node.kube)
    node.kube.core.create_namespaced_service(NAMESPACE, web_service())


def test_pods_become_endpoints_and_traffic_follows_their_state(node: Node) -> None:
    kube, ns = node.kube, NAMESPACE
    fresh_web(node)
    # No pods yet: the service exists with no endpoints, so connections are refused.
    node.eventually_lands(VIP4, {"refused"}, what="a service without endpoints rejects")
    for name in ("pod-a", "pod-b"):
        kube.pod(ns, name, "node-b", node.pod_ips(name), APP)
    node.eventually_lands(VIP4, {"pod-a", "pod-b"}, what="ready pods reached")
    node.eventually_lands(VIP6, {"pod-a", "pod-b"}, what="ready pods reached over IPv6")

    # Readiness flips: the controller marks the endpoint not ready, pyproxy drops it.
    kube.set_ready(ns, "pod-b", False)
    node.eventually_lands(VIP4, {"pod-a"}, what="unready pod-b left out")
    kube.set_ready(ns, "pod-b", True)
    node.eventually_lands(VIP4, {"pod-a", "pod-b"}, what="pod-b ready again")

    # Graceful deletion: pod-a terminating but still serving. While a ready endpoint exists
    # it is not used; when none is left, the serving terminating one is (upstream's fallback).
    kube.delete_pod(ns, "pod-a", grace=300)
    wait_for(lambda: kube.endpoint_conditions(ns, "web").get(node.pod_ips("pod-a")[0])
             == (False, True, True), 20, "the controller marks pod-a terminating, serving")
    node.eventually_lands(VIP4, {"pod-b"}, what="terminating pod-a not used")
    kube.set_ready(ns, "pod-b", False)
    node.eventually_lands(VIP4, {"pod-a"}, what="fallback to the serving terminating pod-a")
    kube.set_ready(ns, "pod-b", True)
    node.eventually_lands(VIP4, {"pod-b"}, what="back to ready pod-b")

    # Scale to zero: the service has no endpoints at all → rejected again.
    for name in ("pod-a", "pod-b"):
        kube.delete_pod(ns, name)
    node.eventually_lands(VIP4, {"refused"}, what="scale to zero rejects")


def test_service_type_changes(node: Node) -> None:
    kube, ns = node.kube, NAMESPACE
    fresh_web(node)
    kube.pod(ns, "pod-c", "node-b", node.pod_ips("pod-c"), APP)
    node.eventually_lands(VIP4, {"pod-c"}, what="pod-c serves the ClusterIP")
    assert "pod-c" not in node.connect(node.cluster.node_ip4, NODE_PORT, count=3)

    patch = {"spec": {"type": "NodePort", "ports": [
        {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
         "nodePort": NODE_PORT}]}}
    kube.core.patch_namespaced_service("web", ns, patch)
    node.eventually_lands(node.cluster.node_ip4, {"pod-c"}, port=NODE_PORT,
                          what="NodePort on the node's IP")

    kube.core.patch_namespaced_service("web", ns, {"spec": {"type": "LoadBalancer"}})
    kube.core.patch_namespaced_service_status("web", ns, {"status": {"loadBalancer": {
        "ingress": [{"ip": LB_IP, "ipMode": "VIP"}]}}})
    node.eventually_lands(LB_IP, {"pod-c"}, what="the LoadBalancer IP the status names")
    node.eventually_lands(node.cluster.node_ip4, {"pod-c"}, port=NODE_PORT,
                          what="NodePort kept")

    # ExternalName: no proxying at all; every address of the service stops answering.
    kube.core.replace_namespaced_service("web", ns, {
        "metadata": {"name": "web", "resourceVersion":
                     kube.core.read_namespaced_service("web", ns).metadata.resource_version},
        "spec": {"type": "ExternalName", "externalName": "web.example.invalid",
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}})
    for ip, port in ((VIP4, 80), (LB_IP, 80), (node.cluster.node_ip4, NODE_PORT)):
        wait_for(lambda ip=ip, port=port: "pod-c" not in node.connect(ip, port, count=5), 20,
                 f"{ip}:{port} no longer proxied")
    ruleset = without_connection_counters(node.cluster.lab.nft_list(node.cluster.node))
    assert VIP4 not in ruleset and LB_IP not in ruleset
    kube.core.delete_namespaced_service("web", ns)
    kube.delete_pod(ns, "pod-c")


def without_connection_counters(ruleset: str) -> str:
    """The ruleset without the per-endpoint connection counters' dynamic sets: the kernel
    fills those, and keeps a gone endpoint's element until pyproxy has banked its count."""
    kept, skipping = [], False
    for line in ruleset.splitlines():
        if line.strip().startswith("set new-connections-"):
            skipping = True
        elif skipping and line.strip() == "}":
            skipping = False
            continue
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def test_runs_with_the_manifests_identity(node: Node) -> None:
    """The daemon above has run every test with the ServiceAccount token: nothing it did was
    forbidden, its start Event was recorded, and the token really is that narrow."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    def started() -> bool:
        events = client.EventsV1Api(node.kube.api).list_namespaced_event(
            "default", field_selector="regarding.name=node-a")
        return any(e.reason == "Starting" and e.reporting_controller == "pyproxy.io/pyproxy"
                   for e in events.items)

    wait_for(started, 20, "pyproxy's Starting event on node-a")
    log = node.daemon.log.read_text()
    # The client's errors read "ApiException: (403) Reason: Forbidden …".
    assert "Forbidden" not in log and "(403)" not in log, log[-2000:]
    assert "event_recorded" in log

    token = yaml.safe_load(node.kubeconfig.read_text())["users"][0]["user"]["token"]
    config = client.Configuration()
    config.host, config.ssl_ca_cert = node.plane.url, str(node.plane.pki.ca)
    config.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(config) as as_pyproxy:
        core = client.CoreV1Api(as_pyproxy)
        core.list_service_for_all_namespaces(limit=1)  # granted
        # An outlier ejection's Event, in the Service's namespace: valid, and granted.
        from pyproxy.cluster.events import ejection_event, record
        record(as_pyproxy, ejection_event(NAMESPACE, "web", "node-a", "10.244.1.5:8080",
                                          "3 of 3 connection attempts failed in 10 s"),
               threading.Event()).join(20)
        ejected = client.EventsV1Api(node.kube.api).list_namespaced_event(
            NAMESPACE, field_selector="regarding.name=web").items
        assert [(e.reason, e.type, e.regarding.kind) for e in ejected
                if e.reason == "EndpointEjected"] == [("EndpointEjected", "Warning", "Service")]
        for forbidden in (lambda: core.list_pod_for_all_namespaces(limit=1),
                          lambda: core.list_secret_for_all_namespaces(limit=1),
                          lambda: core.delete_namespaced_service("web", NAMESPACE)):
            with pytest.raises(ApiException) as err:
                forbidden()
            assert err.value.status == 403


class Probe:
    """Connections through the VIP, continuously, in the background."""

    def __init__(self, node: Node) -> None:
        self.node, self.results = node, list[ConnResult]()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.results += self.node.cluster.lab.connect(self.node.cluster.client, VIP4, 80,
                                                          count=20, timeout=1.0)

    def finish(self) -> list[ConnResult]:
        self.stop.set()
        self.thread.join(30)
        return self.results


def test_apiserver_killed_and_history_compacted(node: Node) -> None:
    """kube-apiserver SIGKILLed: traffic keeps flowing; etcd's history is compacted while it
    is down, so the daemon's watches resume into a real 410 Gone and list again; the change
    made after the restart arrives."""
    kube, ns, plane = node.kube, NAMESPACE, node.plane
    fresh_web(node)
    kube.pod(ns, "pod-a", "node-b", node.pod_ips("pod-a"), APP)
    node.eventually_lands(VIP4, {"pod-a"}, what="pod-a serves")
    before = node.daemon.watches()
    probe = Probe(node)
    time.sleep(0.5)
    # A write of a kind the daemon does not watch, last before the kill: a restarted API
    # server's watch cache begins at etcd's revision then, and serves a watch only from
    # there on (apiserver cacher GetIntervalLocked), so every watch's position is now behind
    # it and gets its 410. Without it, a watch whose last event or bookmark was etcd's newest
    # revision resumed (no relist at all: seen once in ten runs; docs/fleet.md, the restart).
    marker = f"history-{time.monotonic_ns()}"
    kube.core.create_namespaced_config_map(ns, {"metadata": {"name": marker}})
    plane.kill_apiserver()
    time.sleep(2.0)
    plane.compact()
    plane.start_apiserver()
    node.kube = kube = Kube(plane.admin_client())  # the old connections died with it
    kube.pod(ns, "pod-b", "node-b", node.pod_ips("pod-b"), APP)
    node.eventually_lands(VIP4, {"pod-a", "pod-b"}, timeout=60,
                          what="the change made after the restart arrives")
    results = probe.finish()
    assert len(results) >= 40
    assert set(tally(results)) <= {"pod-a", "pod-b"}, tally(results)
    after = node.daemon.watches()
    relisted = {kind for kind in after if after[kind]["lists"] > before[kind]["lists"]}
    assert relisted, (before, after)  # 410 Gone → a relist, and only that
    assert "watch_expired_listing_again" in node.daemon.log.read_text()
    kube.core.delete_namespaced_service("web", ns)
    kube.core.delete_namespaced_config_map(marker, ns)
    for name in ("pod-a", "pod-b"):
        kube.delete_pod(ns, name)


KUBEADM_CONFIGMAP = Path(__file__).parent / "data" / "kubeadm-kube-proxy-configmap.yaml"


def test_kubeadm_kube_proxy_configmap_as_is(control_plane: ControlPlane, tmp_path: Path) -> None:
    """kubeadm's kube-proxy ConfigMap, as kube-proxy's pod mounts it: config.conf names
    kubeconfig.conf, whose user is a token file. Only the paths a pod has (the server, the
    service account's CA and token) are moved to this test's; nothing else is edited. pyproxy
    lists, programs the node, and knows the API server's address is a real one."""
    from testkit.controlplane import API_IP, API_PORT

    kube = Kube(control_plane.admin_client())
    apply_manifests(kube)
    data = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())["data"]
    token = tmp_path / "token"
    token.write_text(service_account_token(kube))
    kubeconfig = tmp_path / "kubeconfig.conf"
    kubeconfig.write_text(data["kubeconfig.conf"]
                          .replace("https://192.0.2.10:6443", f"https://{API_IP}:{API_PORT}")
                          .replace("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                                   str(control_plane.pki.ca))
                          .replace("/var/run/secrets/kubernetes.io/serviceaccount/token",
                                   str(token)))
    config = tmp_path / "config.conf"
    config.write_text(data["config.conf"].replace("/var/lib/kube-proxy/kubeconfig.conf",
                                                  str(kubeconfig)))
    with Lab() as lab:
        ns = lab.add_ns("kubeadm")
        control_plane.attach(ns)
        kube.node("node-k", ("192.168.201.2",))
        sock = str(lab.workdir / "kubeadm.sock")
        try:
            # kubeadm's configuration as it is: only the node and the socket besides it.
            argv = DaemonArgs(config=config, node="node-k", min_sync_period=None,
                              sync_period=None, healthz=None, metrics=None,
                              debug_socket=sock).argv()
            proc = lab.popen(ns, argv, log_name="kubeadm.log")
            daemon = Daemon(proc, ns, sock, lab.workdir / "kubeadm.log")
            wait_for(lambda: bool(daemon.status().get("lastFullSync")), 30,
                     f"a first sync from kubeadm's configuration: {daemon.log.read_text()[-2000:]}")
            status = daemon.status()
            assert status["source"]["apiServer"] == {"host": API_IP, "problem": None}
            assert all(w["errors"] == 0 for w in status["source"]["api"]), status["source"]
            cluster_ips = lab.run(ns, ["nft", "list", "set", "ip", "pyproxy",
                                       "cluster-ips"]).stdout
            assert "10.96.0.1" in cluster_ips  # the kubernetes Service, from the API
        finally:
            kube.core.delete_node("node-k")
