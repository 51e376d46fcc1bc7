"""From kube-proxy in iptables mode to pyproxy on one node namespace, with real packets, on
both iptables backends (issue 35, point 3).

The node starts with kube-proxy v1.37's iptables-mode rules and the kubelet's own chains
(tests/data/kube-proxy-v1.37-iptables-mode.v4 and .v6, loaded with `iptables-nft-restore` or
`iptables-legacy-restore`) and `route_localnet=1`, as kube-proxy leaves a node: its NodePorts
answer on the node's address, on a second local address and on 127.0.0.1. pyproxy then runs
with kubeadm's configuration (`mode: iptables`, `nodePortAddresses` unset), `pyproxy cleanup
--kube-proxy` removes kube-proxy's chains and the jumps into them, and every one of those
NodePorts still answers: the second address through `fib daddr type local`, 127.0.0.1 through
the localhost proxy. The kubelet's chains (KUBE-FIREWALL with its jumps, KUBE-KUBELET-CANARY,
KUBE-IPTABLES-HINT) are left as they were. Everything happens in the lab's namespaces, which
go with it (iptables-legacy's tables and route_localnet are per network namespace too).

The fixture is the real kube-proxy's: the last test runs kube-proxy v1.37.2 in iptables mode
(iptables-nft) against the real control plane on the same namespace layout, checks its rules
against the fixture, and goes to pyproxy and back with the real kube-proxy (`-m k8s`)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.builders import ep, make_node, make_service, make_slice
from testkit.controlplane import PYPROXY, wait_for
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, Lab, Netns, tally
from testkit.waits import eventually

DATA = Path(__file__).parent / "data"
RULES = {"ip": DATA / "kube-proxy-v1.37-iptables-mode.v4",
         "ip6": DATA / "kube-proxy-v1.37-iptables-mode.v6"}
SECOND = "192.168.60.1"  # a second local address of the node (another network, on eth0)
NODEPORT, LOCAL_NODEPORT = 30080, 30081
# The kubelet's chains (and their rules) per iptables table, which must survive the cleanup.
KUBELET = {
    "mangle": ["-N KUBE-IPTABLES-HINT", "-N KUBE-KUBELET-CANARY"],
    "nat": ["-N KUBE-KUBELET-CANARY"],
    "filter": ["-N KUBE-FIREWALL", "-N KUBE-KUBELET-CANARY", "-A INPUT -j KUBE-FIREWALL",
               "-A OUTPUT -j KUBE-FIREWALL",
               '-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block '
               'incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT '
               "-j DROP"],
}
# kubeadm v1.37.2's config.conf as it matters here: mode iptables, nodePortAddresses unset.
CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: 10.244.0.0/16
nodePortAddresses: null
iptables: {localhostNodePorts: null, masqueradeBit: null, syncPeriod: 0s, minSyncPeriod: 0s}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
oomScoreAdj: 0
"""


def _argv(**source: Path) -> list[str]:
    """pyproxy on the configuration as it is (no periods of the lab's), servers off."""
    return DaemonArgs(**source, min_sync_period=None, sync_period=None, healthz="",
                      metrics="").argv()


def objects(cluster: Cluster) -> list[dict[str, Any]]:
    """The fixture's Services, as the API server would hand them to pyproxy."""
    pod_a, pod_b = (cluster.pods[p] for p in ("pod-a", "pod-b"))

    def web(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="NodePort", ports=[
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
             "nodePort": NODEPORT}])

    def lb(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local",
                           healthCheckNodePort=30500,
                           loadBalancerSourceRanges=["192.168.50.0/24"], ports=[
                               {"name": "http", "port": 80, "protocol": "TCP",
                                "targetPort": 8080, "nodePort": LOCAL_NODEPORT}])
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": "192.168.80.10"}]}}

    port = [{"name": "http", "port": 8080, "protocol": "TCP"}]
    return [
        make_node("node-a"),
        make_service("ns", "web", web, ip="10.96.0.10"),
        make_slice("ns", "web", [ep(pod_a.ip4, "node-b"), ep(pod_b.ip4, "node-b")],
                   lambda s: s.update(ports=port)),
        make_service("ns", "lb", lb, ip="10.96.0.11"),
        make_slice("ns", "lb", [ep(pod_a.ip4, "node-a")], lambda s: s.update(ports=port)),
    ]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=2)


def save(node: Netns, backend: str, family: str) -> dict[str, list[str]]:
    """`iptables -S` of every table of one backend and family: table → lines."""
    tool = f"{'ip6' if family == 'ip6' else 'ip'}tables-{backend}"
    return {table: node.run([tool, "-w", "-t", table, "-S"]).stdout.splitlines()
            for table in ("mangle", "nat", "filter")}


def kube_proxys(listing: dict[str, list[str]]) -> list[str]:
    """The lines naming a chain of kube-proxy's (not the kubelet's)."""
    pattern = re.compile(r"KUBE-(?!FIREWALL\b|KUBELET-CANARY\b|IPTABLES-HINT\b)[A-Z0-9-]+")
    return [line for lines in listing.values() for line in lines if pattern.search(line)]


def answers(cluster: Cluster, where: Netns, address: str, port: int,
            count: int = 20) -> set[str]:
    return set(tally(cluster.lab.connect(where, address, port, count=count)))


@requires_netns
@pytest.mark.netns
@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_from_kube_proxy_in_iptables_mode(cluster: Cluster, backend: str,
                                          tmp_path: Path) -> None:
    """kube-proxy's NodePorts on the node address, a second local address and 127.0.0.1
    answer before the switch, while both run, and after the cleanup, with pyproxy alone;
    nothing of kube-proxy's is left in that backend, and the kubelet's chains are."""
    lab, node, client = cluster.lab, cluster.node, cluster.client
    node.run(["ip", "address", "add", f"{SECOND}/24", "dev", "eth0"])
    lab.add_route(client, f"{SECOND}/32", via=cluster.node_ip4)
    node.run(["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"])  # kube-proxy's
    for family, path in RULES.items():
        tool = f"{'ip6' if family == 'ip6' else 'ip'}tables-{backend}-restore"
        node.run([tool, "-w", "10", str(path)])
    before = {family: save(node, backend, family) for family in RULES}
    assert kube_proxys(before["ip"]) and kube_proxys(before["ip6"])
    pods = {"pod-a", "pod-b"}
    wanted = [(client, cluster.node_ip4), (client, SECOND), (node, "127.0.0.1")]
    for where, address in wanted:  # kube-proxy's rules serve them all
        assert answers(cluster, where, address, NODEPORT) == pods, (address, "kube-proxy")

    config = tmp_path / "config.conf"
    config.write_text(CONFIG)
    snapshot = tmp_path / "cluster.yaml"
    snapshot.write_text(yaml.safe_dump_all(objects(cluster)))
    daemon = lab.popen(node, _argv(config=config, snapshot=snapshot),
                       log_name=f"pyproxy-iptables-{backend}.log")
    try:
        # The localhost proxy listens once the first sync is in.
        eventually(lambda: "127.0.0.1:30080" in node.run(["ss", "-Htln"]).stdout,
                   what="pyproxy's listener on 127.0.0.1:30080", timeout=60)
        for where, address in wanted:  # both proxies' rules: either serves
            assert answers(cluster, where, address, NODEPORT) == pods, (address, "both")

        done = node.run([PYPROXY, "cleanup", "--kube-proxy"])
        assert f"iptables-{backend}" in done.stdout or backend == "nft", done.stdout
        after = {family: save(node, backend, family) for family in RULES}
        assert kube_proxys(after["ip"]) == [] and kube_proxys(after["ip6"]) == []
        for table, lines in KUBELET.items():
            assert set(lines) <= set(after["ip"][table]), (table, after["ip"][table])
        assert "-N KUBE-IPTABLES-HINT" in after["ip6"]["mangle"]
        # IPv6's KUBE-FIREWALL is kube-proxy's empty copy of the kubelet's jump chains: kept,
        # as kube-proxy's own cleanup keeps it.
        assert "-A INPUT -j KUBE-FIREWALL" in after["ip6"]["filter"]

        for where, address in wanted:  # pyproxy alone
            assert answers(cluster, where, address, NODEPORT) == pods, (address, "pyproxy")
        # eTP=Local: the local endpoint, from outside on the second address too.
        assert answers(cluster, client, SECOND, LOCAL_NODEPORT) == {"pod-a"}
        # What still differs from iptables mode: UDP on 127.0.0.1 (no UDP Service here:
        # the rejection is shown by tests/test_localhost_nodeports.py), and the rest of
        # 127.0.0.0/8, which the proxy does not listen on.
        assert {r.error for r in lab.connect(node, "127.0.0.2", NODEPORT)} == {"refused"}
    finally:
        lab.stop_process(daemon)


# ---------------------------------------------------------------------------------------------
# The real kube-proxy v1.37.2 in iptables mode, on the real control plane


def kube_objects(kube: Any, cluster: Cluster) -> None:
    """The fixture's Services and pods in the API: ns/web's two pods on node-b, ns/lb's one
    on node-a (pod-a's address again, as a pod of this node)."""
    kube.namespace("ns")
    kube.node("node-a", (cluster.node_ip4,))
    kube.node("node-b", ("192.168.50.3",))
    http = {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}
    kube.core.create_namespaced_service("ns", {"metadata": {"name": "web"}, "spec": {
        "type": "NodePort", "clusterIP": "10.96.0.10", "selector": {"app": "web"},
        "ports": [{**http, "nodePort": NODEPORT}]}})
    kube.core.create_namespaced_service("ns", {"metadata": {"name": "lb"}, "spec": {
        "type": "LoadBalancer", "clusterIP": "10.96.0.11", "selector": {"app": "lb"},
        "externalTrafficPolicy": "Local", "healthCheckNodePort": 30500,
        "loadBalancerSourceRanges": ["192.168.50.0/24"],
        "ports": [{**http, "nodePort": LOCAL_NODEPORT}]}})
    kube.core.patch_namespaced_service_status("lb", "ns", {"status": {"loadBalancer": {
        "ingress": [{"ip": "192.168.80.10", "ipMode": "VIP"}]}}})
    for name in ("pod-a", "pod-b"):
        kube.pod("ns", name, "node-b", (cluster.pods[name].ip4,), {"app": "web"})
    kube.pod("ns", "local-pod-a", "node-a", (cluster.pods["pod-a"].ip4,), {"app": "lb"})


# What the fixture leaves out of the real kube-proxy's rules: the API server's own Service
# (default/kubernetes), and nfacct (kube-proxy's localhost NodePort counting rules and the
# counter of its INVALID drop, where it can create nfnetlink_acct counters: restoring them
# needs the counters made first).
NOT_IN_FIXTURE = re.compile(r"default/kubernetes|KUBE-SVC-NPX46M4PTMTKRN6Y|"
                            r"KUBE-SEP-XMPAT2JPN4T37LZX|localhost_nps_accepted_pkts")


def rules(text: str) -> dict[str, list[str]]:
    """An iptables-save listing as table → its chain and rule lines, counters and what the
    fixture leaves out removed."""
    out: dict[str, list[str]] = {}
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
            out[table] = []
        elif line.startswith((":", "-A")) and not NOT_IN_FIXTURE.search(line):
            line = re.sub(r" \[\d+:\d+\]$", "", line)
            out[table].append(re.sub(r" -m nfacct --nfacct-name\s+\S+", "", line))
    return out


@pytest.mark.k8s
@requires_netns
@pytest.mark.netns
def test_the_real_kube_proxy_in_iptables_mode_and_back(cluster: Cluster, control_plane: Any,
                                                        tmp_path: Path) -> None:
    """kube-proxy v1.37.2 in iptables mode (iptables-nft) programs the node as the fixture
    says (the same chains and rules, nfacct matches aside); pyproxy with kubeadm's `mode:
    iptables` configuration takes over with `pyproxy cleanup --kube-proxy`, and kube-proxy
    takes the node back with `pyproxy cleanup`: the NodePort answers on the node address, a
    second local address and 127.0.0.1, and the eTP=Local LoadBalancer answers, at every step."""
    from testkit.controlplane import (
        Kube,
        apply_manifests,
        kube_proxy_token,
        service_account_token,
    )

    plane, lab, node, client = control_plane, cluster.lab, cluster.node, cluster.client
    kube = Kube(plane.admin_client())
    plane.attach(node)
    apply_manifests(kube)
    node.run(["ip", "address", "add", f"{SECOND}/24", "dev", "eth0"])
    lab.add_route(client, f"{SECOND}/32", via=cluster.node_ip4)
    lab.add_route(client, "192.168.80.10/32", via=cluster.node_ip4)
    for tool in ("iptables", "ip6tables"):  # the kubelet's chains of both families
        for table, chain in (("mangle", "KUBE-IPTABLES-HINT"), ("mangle", "KUBE-KUBELET-CANARY"),
                             ("nat", "KUBE-KUBELET-CANARY"), ("filter", "KUBE-KUBELET-CANARY")):
            node.run([tool, "-w", "10", "-t", table, "-N", chain])
    kube_objects(kube, cluster)
    config = tmp_path / "kube-proxy.conf"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "hostnameOverride": "node-a", "clusterCIDR": "10.244.0.0/16",
        "clientConnection": {"kubeconfig": str(plane.node_kubeconfig(
            tmp_path / "kube-proxy.kubeconfig", kube_proxy_token(kube)))},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "iptables": {"minSyncPeriod": "200ms", "syncPeriod": "5s"}}))
    py_config = tmp_path / "config.conf"
    py_config.write_text(CONFIG)
    py_kubeconfig = plane.node_kubeconfig(tmp_path / "pyproxy.kubeconfig",
                                          service_account_token(kube))
    pods = {"pod-a", "pod-b"}
    wanted = [(client, cluster.node_ip4), (client, SECOND), (node, "127.0.0.1")]

    def all_answer(who: str) -> None:
        for where, address in wanted:
            assert answers(cluster, where, address, NODEPORT) == pods, (address, who)
        assert answers(cluster, client, "192.168.80.10", 80, 4) == {"pod-a"}, ("LB", who)

    def kube_proxy_synced() -> bool:
        listing = node.run(["iptables", "-w", "5", "-t", "nat", "-S"], check=False).stdout
        return "service nodeports" in listing and "10.244.2.2:8080" in listing

    def start_kube_proxy(name: str) -> Any:
        proc = lab.popen(node, [plane.bin / "kube-proxy", f"--config={config}", "-v=2"],
                         log_name=name)
        eventually(kube_proxy_synced, what="kube-proxy's rules", timeout=60)
        return proc

    kube_proxy = start_kube_proxy("kube-proxy-iptables-1.log")
    daemon = None
    try:
        assert node.run(["sysctl", "-n", "net.ipv4.conf.all.route_localnet"]).stdout.strip() \
            == "1"
        eventually(lambda: answers(cluster, client, cluster.node_ip4, NODEPORT) == pods,
                   what="kube-proxy serving")
        all_answer("kube-proxy")
        saved = {family: node.run([tool]).stdout for family, tool in
                 (("ip", "iptables-nft-save"), ("ip6", "ip6tables-nft-save"))}
        if os.environ.get("PYPROXY_SAVE_IPTABLES"):  # how the fixture was made
            for family, text in saved.items():
                Path(f"{os.environ['PYPROXY_SAVE_IPTABLES']}.{family}").write_text(text)
        for family, text in saved.items():
            real, fixture = rules(text), rules(RULES[family].read_text())
            for table in ("mangle", "filter", "nat"):  # kube-proxy's order is a map's
                assert sorted(real[table]) == sorted(fixture[table]), (family, table)

        daemon = lab.popen(node, _argv(config=py_config, kubeconfig=py_kubeconfig),
                           log_name="pyproxy-real.log")
        eventually(lambda: "127.0.0.1:30080" in node.run(["ss", "-Htln"]).stdout,
                   what="pyproxy's listener on 127.0.0.1:30080", timeout=60)
        all_answer("both")
        lab.stop_process(kube_proxy)
        all_answer("pyproxy, kube-proxy's rules left")
        node.run([PYPROXY, "cleanup", "--kube-proxy"])
        left = save(node, "nft", "ip")
        assert kube_proxys(left) == []
        assert {"-N KUBE-FIREWALL", "-A INPUT -j KUBE-FIREWALL"} <= set(left["filter"])
        all_answer("pyproxy")

        kube_proxy = start_kube_proxy("kube-proxy-iptables-2.log")  # back
        all_answer("both, going back")
        lab.stop_process(daemon)
        daemon = None
        node.run([PYPROXY, "cleanup"])
        assert "pyproxy" not in node.run(["nft", "list", "tables"]).stdout
        all_answer("kube-proxy again")
    finally:
        if daemon is not None:
            lab.stop_process(daemon)
        lab.stop_process(kube_proxy)
        # The control plane is the session's: the k8s tests after this one make their own
        # ns/web with ClusterIP 10.96.0.10, refused while this one's still holds it. A
        # namespace's Services go only when the namespace controller gets to them, so they
        # are deleted here, and waited for, before the namespace.
        with contextlib.suppress(Exception):
            for name in ("web", "lb"):
                kube.core.delete_namespaced_service(name, "ns")
            wait_for(lambda: not kube.core.list_namespaced_service("ns").items, 30,
                     "ns's Services gone")
            kube.core.delete_namespace("ns")
            for name in ("node-a", "node-b"):
                kube.core.delete_node(name)
