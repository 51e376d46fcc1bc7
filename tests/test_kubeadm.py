"""kubeadm's kube-proxy addon, run for real against the real control plane (docs/deploying.md,
"What is supported": a new kubeadm cluster without kube-proxy, and `kubeadm upgrade apply`
bringing kube-proxy back).

kubeadm v1.37.2 is built from the module the control plane comes from (`make k8s`). It runs
in a namespace attached to the control plane, chrooted (`--rootfs`) into a directory holding
only what a control-plane node would have for these commands: /etc/kubernetes/admin.conf,
/etc/kubernetes/kubelet.conf (whose client certificate names the node) and the kubeadm
configuration. The node-local phases (certificates, static Pods, the kubelet) are skipped;
what runs is kubeadm's own code for the cluster-wide parts: `kubeadm init` uploads its
configuration and installs the kube-proxy addon (`--skip-phases` as an operator uses it), and
`kubeadm upgrade apply` reads the configuration back from the cluster and runs its
`addon/kube-proxy` phase. The API server's mirror Pod, which a kubelet would post for its
static Pod, is written by the test (kubeadm reads the node's API endpoint and version there).

There are no kubelets, so "kube-proxy runs on a node" is asserted on the API objects: the
DaemonSet's nodeSelector and required node affinity against the Nodes' labels (its toleration
`operator: Exists` tolerates every taint).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.controlplane import (
    API_IP,
    API_PORT,
    ControlPlane,
    Kube,
    binaries_dir,
    issue_client,
    kubeconfig,
    write_kubeconfig,
)
from testkit.fixtures import requires_netns
from testkit.netlab import Lab, Netns

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "kubeadm-kube-proxy-configmap.yaml"
PYPROXY = str(Path(sys.executable).parent / "pyproxy")
VERSION = "v1.37.2"
CONTROL_PLANE_NODE = "kadm-cp"
WORKERS = ("kadm-w1", "kadm-w2")
NODES = {CONTROL_PLANE_NODE, *WORKERS}
ENDPOINT = "192.0.2.10:6443"  # the fixture's controlPlaneEndpoint

KUBEADM_CONFIG = f"""\
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint: {{advertiseAddress: {API_IP}, bindPort: {API_PORT}}}
nodeRegistration:
  name: {CONTROL_PLANE_NODE}
  criSocket: unix:///run/containerd/containerd.sock
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: {VERSION}
controlPlaneEndpoint: "{ENDPOINT}"
networking: {{podSubnet: 10.244.0.0/16, serviceSubnet: 10.96.0.0/16}}
"""
# The phases of `kubeadm init` that act on the machine itself, not through the API server.
INIT_NODE_LOCAL = ("preflight", "certs", "kubeconfig", "etcd", "control-plane", "kubelet-start",
                   "wait-control-plane", "upload-certs", "mark-control-plane", "bootstrap-token",
                   "kubelet-finalize", "show-join-command")
# Every phase of `kubeadm upgrade apply` but addon/kube-proxy (`kubeadm upgrade apply phase`).
UPGRADE_OTHERS = ("preflight", "control-plane", "upload-config", "kubeconfig", "kubelet-config",
                  "bootstrap-token", "addon/coredns", "post-upgrade")

# docs/deploying.md's commands, as an operator types them.
PARK = ('{"spec":{"template":{"spec":{"nodeSelector":'
        '{"pyproxy.io/run-kube-proxy":"true"}}}}}')
CANARY = ('{"spec":{"template":{"spec":{"affinity":{"nodeAffinity":'
          '{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":'
          '[{"matchExpressions":[{"key":"pyproxy.io/run-kube-proxy","operator":"NotIn",'
          '"values":["false"]}]}]}}}}}}}')
CANARY_PATCH = """\
spec:
  template:
    spec:
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions:
              - {key: pyproxy.io/run-kube-proxy, operator: NotIn, values: ["false"]}
"""


@dataclass
class Kubeadm:
    plane: ControlPlane
    kube: Kube
    ns: Netns
    root: Path
    binary: Path
    kubectl_config: Path

    def run(self, *args: str) -> str:
        """kubeadm, chrooted into the node's files; its output (stdout and stderr)."""
        done = self.ns.lab.run(self.ns, [str(self.binary), "--rootfs", str(self.root), *args],
                               check=False, timeout=180)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"kubeadm {' '.join(args)}: {out}"
        return out

    def init(self, *skip: str) -> str:
        return self.run("init", "--config=/kubeadm.yaml",
                        f"--skip-phases={','.join((*INIT_NODE_LOCAL, *skip))}")

    def upgrade(self, *args: str, skip: tuple[str, ...] = ()) -> str:
        """`kubeadm upgrade apply` to the same version: only its addon/kube-proxy phase runs
        (unless skipped too)."""
        return self.run("upgrade", "apply", VERSION, "--yes",
                        f"--skip-phases={','.join((*UPGRADE_OTHERS, *skip))}", *args)

    def kubectl(self, *args: str) -> str:
        binary = binaries_dir() / "kubectl"
        done = subprocess.run([str(binary), f"--kubeconfig={self.kubectl_config}", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        done = subprocess.run([str(binaries_dir() / "kubectl"),
                               f"--kubeconfig={self.kubectl_config}", "-n", "kube-system",
                               "get", kind, name, "-o", "json"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            assert "NotFound" in done.stderr, done.stderr
            return None
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def daemonset(self) -> dict[str, Any]:
        ds = self.get("daemonset", "kube-proxy")
        assert ds is not None, "no kube-proxy DaemonSet"
        return ds

    def runs_on(self) -> set[str]:
        """The Nodes kube-proxy's DaemonSet would run on (none when it does not exist)."""
        ds = self.get("daemonset", "kube-proxy")
        if ds is None:
            return set()
        nodes = {n.metadata.name: n.metadata.labels or {}
                 for n in self.kube.core.list_node().items if n.metadata.name in NODES}
        return {name for name, labels in nodes.items() if schedulable(ds, labels)}

    def cluster_configuration(self) -> dict[str, Any]:
        cm = self.get("configmap", "kubeadm-config")
        assert cm is not None
        result: dict[str, Any] = yaml.safe_load(cm["data"]["ClusterConfiguration"])
        return result

    def reset(self) -> None:
        """No kube-proxy addon and no kubeadm configuration in the cluster."""
        for kind, name in (("daemonset", "kube-proxy"), ("configmap", "kube-proxy"),
                           ("configmap", "kubeadm-config"), ("configmap", "kubelet-config")):
            self.kubectl("-n", "kube-system", "delete", kind, name, "--ignore-not-found")
        for name in WORKERS:
            self.kubectl("label", "node", name, "pyproxy.io/run-kube-proxy-")


def schedulable(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether the DaemonSet's Pod may run on a Node with these labels (nodeSelector and
    required node affinity; every taint is tolerated)."""
    pod = ds["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"operator": "Exists"}], pod["tolerations"]
    if any(labels.get(key) != value for key, value in (pod.get("nodeSelector") or {}).items()):
        return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    return any(all(_matches(e, labels) for e in term.get("matchExpressions", []))
               for term in required["nodeSelectorTerms"])


def _matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    values = expression.get("values", [])
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    assert operator == "DoesNotExist", expression
    return key not in labels


def _embedded(server: str, ca: Path, cert: Path, key: Path) -> dict[str, Any]:
    """A kubeconfig with its files inlined (kubeadm reads it inside the chroot)."""
    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "default",
        "clusters": [{"name": "default", "cluster": {
            "server": server, "certificate-authority-data": b64(ca)}}],
        "users": [{"name": "default", "user": {
            "client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
        "contexts": [{"name": "default", "context": {"cluster": "default", "user": "default"}}],
    }


@pytest.fixture(scope="module")
def kubeadm(control_plane: ControlPlane) -> Iterator[Kubeadm]:
    binary = binaries_dir() / "kubeadm"
    if not os.access(binary, os.X_OK):
        message = f"{binary} is not built (make k8s)"
        if os.environ.get("CI"):  # CI builds it first: a skip there would hide these tests
            pytest.fail(message)
        pytest.skip(message)
    kube = Kube(control_plane.admin_client())
    pki = control_plane.pki
    with Lab() as lab:
        ns = lab.add_ns("kubeadm")
        control_plane.attach(ns)
        root = lab.workdir / "rootfs"
        (root / "etc" / "kubernetes").mkdir(parents=True)
        server = f"https://{API_IP}:{API_PORT}"
        write_kubeconfig(root / "etc" / "kubernetes" / "admin.conf",
                         _embedded(server, pki.ca, pki.admin, pki.admin_key))
        # kubeadm names the node from its kubelet's client certificate, as on a real node.
        node_cert, node_key = issue_client(pki, "kadm-kubelet",
                                           f"/O=system:nodes/CN=system:node:{CONTROL_PLANE_NODE}")
        write_kubeconfig(root / "etc" / "kubernetes" / "kubelet.conf",
                         _embedded(server, pki.ca, node_cert, node_key))
        (root / "kubeadm.yaml").write_text(KUBEADM_CONFIG)
        kubectl_config = write_kubeconfig(
            lab.workdir / "admin.kubeconfig",
            kubeconfig(control_plane.url, pki.ca, cert=pki.admin, key=pki.admin_key))
        for name in NODES:
            kube.core.create_node({"metadata": {"name": name, "labels": {
                "kubernetes.io/os": "linux", "kubernetes.io/hostname": name}}})
        # The API server's mirror Pod, as the kubelet posts it for kubeadm's static Pod.
        mirror = f"kube-apiserver-{CONTROL_PLANE_NODE}"
        kube.core.create_namespaced_pod("kube-system", {
            "metadata": {"name": mirror,
                         "labels": {"component": "kube-apiserver", "tier": "control-plane"},
                         "annotations": {"kubeadm.kubernetes.io/kube-apiserver."
                                         "advertise-address.endpoint": f"{API_IP}:{API_PORT}"}},
            "spec": {"nodeName": CONTROL_PLANE_NODE, "automountServiceAccountToken": False,
                     "containers": [{"name": "kube-apiserver",
                                     "image": f"registry.k8s.io/kube-apiserver:{VERSION}"}]}})
        tool = Kubeadm(control_plane, kube, ns, root, binary, kubectl_config)
        try:
            yield tool
        finally:
            tool.reset()
            # What kubeadm created besides, so the session's control plane is as it was (the
            # kube-proxy ServiceAccount stays: other tests create it too).
            for kind, name in (("role", "kube-proxy"), ("rolebinding", "kube-proxy"),
                               ("role", "kubeadm:nodes-kubeadm-config"),
                               ("rolebinding", "kubeadm:nodes-kubeadm-config"),
                               ("role", "kubeadm:kubelet-config"),
                               ("rolebinding", "kubeadm:kubelet-config")):
                tool.kubectl("-n", "kube-system", "delete", kind, name, "--ignore-not-found")
            for name in ("kubeadm:node-proxier", "kubeadm:cluster-admins"):
                tool.kubectl("delete", "clusterrolebinding", name, "--ignore-not-found")
            kube.delete_pod("kube-system", mirror)
            for name in NODES:
                kube.core.delete_node(name)


@pytest.fixture
def fresh(kubeadm: Kubeadm) -> Kubeadm:
    kubeadm.reset()
    return kubeadm


def test_init_installs_kube_proxy_with_the_configmap_pyproxy_reads(fresh: Kubeadm,
                                                                    tmp_path: Path) -> None:
    """`kubeadm init` creates kube-proxy's DaemonSet, on every node, and its ConfigMap, which
    is tests/data/kubeadm-kube-proxy-configmap.yaml's data exactly; pyproxy's kubeadm variant
    (`pyproxy run --config=/var/lib/kube-proxy/config.conf`) takes that config.conf."""
    out = fresh.init("addon/coredns")
    assert "Applied essential addon: kube-proxy" in out
    assert fresh.cluster_configuration().get("proxy") in ({}, None)
    assert fresh.runs_on() == NODES
    live = fresh.get("configmap", "kube-proxy")
    assert live is not None
    fixture = yaml.safe_load(FIXTURE.read_text())
    assert live["data"] == fixture["data"]
    # What the kubeadm variant runs, with the live file.
    conf = tmp_path / "config.conf"
    conf.write_text(live["data"]["config.conf"])
    variant = yaml.safe_load((Path(__file__).parent.parent / "manifests" / "kubeadm" /
                              "03-daemonset.yaml").read_text())
    args = [a.replace("$(NODE_NAME)", "node-a").replace("/var/lib/kube-proxy/config.conf",
                                                        str(conf))
            for a in variant["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert args[0] == "run", args
    args = args[1:]  # the same options, to `pyproxy config check` and `view`
    check = subprocess.run([PYPROXY, "config", "check", *args], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    view = subprocess.run([PYPROXY, "config", "view", *args], capture_output=True, text=True,
                          timeout=60, check=True)
    effective = yaml.safe_load(view.stdout)
    assert effective["clientConnection"]["kubeconfig"] == "/var/lib/kube-proxy/kubeconfig.conf"
    assert effective["clusterCIDR"] == "10.244.0.0/16"


@pytest.mark.parametrize("how", ["--skip-phases", "config"])
def test_init_without_kube_proxy_stays_without_it(fresh: Kubeadm, how: str) -> None:
    """`kubeadm init --skip-phases=addon/kube-proxy`, or `proxy: {disabled: true}` in its
    ClusterConfiguration, creates neither, records `proxy: {disabled: true}` in kubeadm-config,
    and `kubeadm upgrade apply` then skips the addon."""
    if how == "config":
        (fresh.root / "no-proxy.yaml").write_text(
            KUBEADM_CONFIG.replace("networking:", "proxy: {disabled: true}\nnetworking:"))
        out = fresh.run("init", "--config=/no-proxy.yaml",
                        f"--skip-phases={','.join((*INIT_NODE_LOCAL, 'addon/coredns'))}")
    else:
        out = fresh.init("addon/coredns", "addon/kube-proxy")
    assert "kube-proxy" not in out
    assert fresh.cluster_configuration()["proxy"] == {"disabled": True}
    assert fresh.get("daemonset", "kube-proxy") is None
    assert fresh.get("configmap", "kube-proxy") is None
    out = fresh.upgrade()
    assert "Skipping the addon/kube-proxy phase. The addon is disabled." in out
    assert fresh.get("daemonset", "kube-proxy") is None
    assert fresh.get("configmap", "kube-proxy") is None


def test_upgrade_apply_brings_kube_proxy_back(fresh: Kubeadm) -> None:
    """`kubeadm upgrade apply` replaces kube-proxy's DaemonSet with kubeadm's template: the
    park's nodeSelector and the canary's affinity are gone, a deleted one is created again.
    It keeps what was edited in the ConfigMap's config.conf."""
    fresh.init("addon/coredns")
    fresh.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "-p", PARK)
    assert fresh.runs_on() == set()
    fresh.upgrade()
    assert fresh.runs_on() == NODES
    pod = fresh.daemonset()["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    # The canary: kube-proxy off one labelled node.
    fresh.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "-p", CANARY)
    fresh.kubectl("label", "node", WORKERS[0], "pyproxy.io/run-kube-proxy=false")
    assert fresh.runs_on() == NODES - {WORKERS[0]}
    fresh.upgrade()
    assert "affinity" not in fresh.daemonset()["spec"]["template"]["spec"]
    assert fresh.runs_on() == NODES
    # Deleted, with its ConfigMap.
    fresh.kubectl("-n", "kube-system", "delete", "ds,cm", "kube-proxy")
    fresh.upgrade()
    assert fresh.runs_on() == NODES
    cm = fresh.get("configmap", "kube-proxy")
    assert cm is not None
    assert cm["data"] == yaml.safe_load(FIXTURE.read_text())["data"]
    # An edited config.conf is written back, whole, with the edits (kubeadm takes a ConfigMap
    # whose checksum annotation no longer matches as the user's).
    edited = (cm["data"]["config.conf"].replace("oomScoreAdj: null", "oomScoreAdj: -997")
              .replace('portRange: ""\n', ""))
    fresh.kubectl("-n", "kube-system", "patch", "cm", "kube-proxy", "--type=merge", "-p",
                  json.dumps({"data": {"config.conf": edited}}))
    fresh.upgrade()
    cm = fresh.get("configmap", "kube-proxy")
    assert cm is not None
    written = yaml.safe_load(cm["data"]["config.conf"])
    assert written["oomScoreAdj"] == -997
    assert written["portRange"] == ""  # every field spelled out again


def test_what_the_doc_says_keeps_kube_proxy_off(fresh: Kubeadm, tmp_path: Path) -> None:
    """Each way docs/deploying.md gives, with kube-proxy parked, through `kubeadm upgrade
    apply`: `--skip-phases=addon/kube-proxy`, `apply.skipPhases` in an UpgradeConfiguration,
    `proxy: {disabled: true}` in kubeadm-config, parking again afterwards; and, during a
    canary, a `--patches` directory that keeps the canary's affinity."""
    fresh.init("addon/coredns")
    fresh.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "-p", PARK)
    generation = fresh.daemonset()["metadata"]["generation"]

    fresh.upgrade(skip=("addon/kube-proxy",))
    assert fresh.daemonset()["metadata"]["generation"] == generation
    assert fresh.runs_on() == set()

    skip = ", ".join((*UPGRADE_OTHERS, "addon/kube-proxy"))
    (fresh.root / "upgrade.yaml").write_text(
        f"apiVersion: kubeadm.k8s.io/v1beta4\nkind: UpgradeConfiguration\n"
        f"apply:\n  kubernetesVersion: {VERSION}\n  skipPhases: [{skip}]\n")
    fresh.run("upgrade", "apply", "--yes", "--config=/upgrade.yaml")
    assert fresh.daemonset()["metadata"]["generation"] == generation
    assert fresh.runs_on() == set()

    cm = fresh.get("configmap", "kubeadm-config")
    assert cm is not None
    cluster = yaml.safe_load(cm["data"]["ClusterConfiguration"])
    cluster["proxy"] = {"disabled": True}
    fresh.kubectl("-n", "kube-system", "patch", "cm", "kubeadm-config", "--type=merge", "-p",
                  json.dumps({"data": {"ClusterConfiguration": yaml.safe_dump(cluster)}}))
    before = fresh.get("configmap", "kube-proxy")
    out = fresh.upgrade()
    assert "Skipping the addon/kube-proxy phase. The addon is disabled." in out
    assert fresh.daemonset()["metadata"]["generation"] == generation
    assert fresh.runs_on() == set()
    assert fresh.get("configmap", "kube-proxy") == before  # left as it is
    cluster["proxy"] = {}
    fresh.kubectl("-n", "kube-system", "patch", "cm", "kubeadm-config", "--type=merge", "-p",
                  json.dumps({"data": {"ClusterConfiguration": yaml.safe_dump(cluster)}}))

    fresh.upgrade()
    assert fresh.runs_on() == NODES
    fresh.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "-p", PARK)
    assert fresh.runs_on() == set()

    # A canary in progress: kube-proxy off WORKERS[0], and kubeadm's patch keeps it so.
    fresh.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "--type=json", "-p",
                  '[{"op":"remove","path":"/spec/template/spec/nodeSelector/'
                  'pyproxy.io~1run-kube-proxy"}]')
    fresh.kubectl("-n", "kube-system", "patch", "ds", "kube-proxy", "-p", CANARY)
    fresh.kubectl("label", "node", WORKERS[0], "pyproxy.io/run-kube-proxy=false")
    assert fresh.runs_on() == NODES - {WORKERS[0]}
    patches = fresh.root / "patches"
    patches.mkdir()
    (patches / "kubeproxydaemonset+strategic.yaml").write_text(CANARY_PATCH)
    out = fresh.upgrade("--patches=/patches")
    assert 'Applied patch of type "application/strategic-merge-patch+json" to target ' \
           '"kubeproxydaemonset"' in out
    assert fresh.daemonset()["metadata"]["generation"] > generation
    assert fresh.runs_on() == NODES - {WORKERS[0]}


def test_upgrade_apply_has_the_skip_phases_the_doc_names(kubeadm: Kubeadm) -> None:
    """`kubeadm upgrade apply --skip-phases` exists in v1.37, and its phase is named
    addon/kube-proxy."""
    assert "--skip-phases strings" in kubeadm.run("upgrade", "apply", "--help")
    addon = kubeadm.run("upgrade", "apply", "phase", "addon", "--help")
    assert "kube-proxy" in addon and "coredns" in addon
