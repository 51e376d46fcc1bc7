"""Side by side with the real kube-proxy: the same cluster must give the same packet outcomes.

Two identical copies of node-a (testkit/netlab.py's standard topology, one Lab each), fed by the
same real API server: one programmed by upstream kube-proxy v1.37.2 in nftables mode (`make k8s`
builds it from the same release as the control plane), one by pyproxy with the same settings.
Every flow below runs through both; per flow the outcome is which backends answered, whether
the backend saw the client's own address or a masqueraded one, and refused versus dropped.
Where pyproxy deliberately does more, the flow is listed in DELIBERATE (and in
docs/kube-proxy-differences.md) with the reason; every other difference fails the test.

The localhost NodePort flows (KEP-6032) also run against kube-proxy of the next release
(v1.38.0-beta.0, `make kube-proxy-next`, e2e/k8s-next) on a third copy of node-a, with that
release's default feature gates: there `KubeProxyNFTablesLocalhostNodePorts` is beta and on by
default, where v1.37.2 needs it turned on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.controlplane import (
    ControlPlane,
    Kube,
    apply_manifests,
    kube_proxy_config,
    kube_proxy_token,
    next_kube_proxy,
    service_account_token,
    start_pyproxy,
    wait_for,
)
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, ConnResult, Lab

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]

NS = "diff"
NODE = "node-a"
LB_LOCAL, LB_ALLOWED, LB_DENIED, EXTERNAL = ("192.168.77.20", "192.168.77.21",
                                             "192.168.77.22", "192.168.77.30")
UNALLOCATED = "10.96.5.5"
# Two more addresses of node-a, there before either proxy starts (kube-proxy reads the
# interfaces' addresses at its full syncs): one inside the nodePortAddresses CIDR both proxies
# are given beside primary and localhost, which serves NodePorts, and one outside it.
NODEPORT_CIDR, NODEPORT_ADDRESS, OTHER_ADDRESS = ("192.168.51.0/24", "192.168.51.1",
                                                  "192.168.52.1")


@dataclass(frozen=True)
class Svc:
    """A Service and the pods (by backend) that back it."""

    name: str
    ip: str
    spec: dict[str, Any] = field(default_factory=dict)
    pods: tuple[tuple[str, str], ...] = ()  # (backend pod, node it is bound to)
    terminating: tuple[str, ...] = ()  # backends whose Pod is deleted gracefully
    meta: dict[str, Any] = field(default_factory=dict)


SERVICES = (
    Svc("plain", "10.96.2.1", {"ipFamilyPolicy": "PreferDualStack",
                               "clusterIPs": ["10.96.2.1", "fd00:96::2:1"]},
        (("pod-a", "node-b"), ("pod-b", "node-b"))),
    Svc("nodeport", "10.96.2.2", {"type": "NodePort"},
        (("pod-a", "node-b"), ("pod-b", "node-b"))),
    Svc("lb-local", "10.96.2.3", {"type": "LoadBalancer", "externalTrafficPolicy": "Local"},
        (("pod-c", NODE), ("pod-a", "node-b"))),
    Svc("lb-allowed", "10.96.2.4", {"type": "LoadBalancer",
                                    "loadBalancerSourceRanges": ["192.168.50.2/32"]},
        (("pod-b", "node-b"),)),
    Svc("lb-denied", "10.96.2.5", {"type": "LoadBalancer",
                                   "loadBalancerSourceRanges": ["10.0.0.0/8"]},
        (("pod-b", "node-b"),)),
    Svc("external", "10.96.2.6", {"externalIPs": [EXTERNAL]}, (("pod-c", "node-b"),)),
    Svc("itp-local", "10.96.2.7", {"internalTrafficPolicy": "Local"},
        (("pod-c", NODE), ("pod-a", "node-b"))),
    Svc("empty", "10.96.2.8", {"type": "NodePort"}),
    Svc("affinity", "10.96.2.9", {"sessionAffinity": "ClientIP"},
        (("pod-a", "node-b"), ("pod-b", "node-b"), ("pod-c", "node-b"))),
    Svc("zonal", "10.96.2.10", {"trafficDistribution": "PreferSameZone"},
        (("pod-a", "node-b"), ("pod-b", "node-z"))),
    Svc("terminating", "10.96.2.11", {}, (("pod-a", "node-b"),), terminating=("pod-a",)),
    Svc("local-only-remote", "10.96.2.12", {"type": "LoadBalancer",
                                            "externalTrafficPolicy": "Local"},
        (("pod-b", "node-b"),)),
    Svc("nodeport-dual", "10.96.2.13", {"type": "NodePort", "ipFamilyPolicy": "RequireDualStack",
                                        "clusterIPs": ["10.96.2.13", "fd00:96::2:13"]},
        (("pod-a", "node-b"), ("pod-b", "node-b"))),
)
LB_IPS = {"lb-local": LB_LOCAL, "lb-allowed": LB_ALLOWED, "lb-denied": LB_DENIED,
          "local-only-remote": "192.168.77.23"}


@dataclass(frozen=True)
class Flow:
    name: str
    source: str  # "client", "pod-client", "node" or a backend pod's name (hairpin)
    service: str | None  # its ClusterIP, or with `to` another address of it
    # cluster-ip | cluster-ip6 | node-port | node-port6 | node-port-at | localhost |
    # localhost6 | lb | external | raw
    to: str = "cluster-ip"
    port: int = 80
    proto: str = "tcp"
    count: int = 30
    address: str = ""  # for to == "raw" and "node-port-at" (another address of the node)
    expect: tuple[str, ...] | None = None  # the outcome both must give, where the flow says


FLOWS = (
    Flow("ClusterIP from outside", "client", "plain"),
    Flow("ClusterIP from a pod", "pod-client", "plain"),
    Flow("ClusterIP from the node", "node", "plain"),
    Flow("ClusterIP over IPv6", "client", "plain", to="cluster-ip6"),
    Flow("ClusterIP, UDP", "client", "plain", port=53, proto="udp", count=20),
    # pod-c is on this node for lb-local: kube-proxy masquerades hairpin traffic only for
    # local endpoints (a remote pod's packets never come through this node).
    Flow("hairpin: a local backend to its own service", "pod-c", "lb-local"),
    Flow("ClusterIP, unknown port", "client", "plain", port=81, count=5),
    Flow("unallocated address of the service CIDR", "client", None, to="raw",
         address=UNALLOCATED, count=5),
    Flow("NodePort from outside", "client", "nodeport", to="node-port"),
    Flow("NodePort over IPv6", "client", "nodeport", to="node-port6"),
    Flow("LB eTP=Local from outside", "client", "lb-local", to="lb"),
    Flow("LB eTP=Local NodePort from outside", "client", "lb-local", to="node-port"),
    Flow("LB eTP=Local from a pod", "pod-client", "lb-local", to="lb"),
    Flow("LB eTP=Local from the node", "node", "lb-local", to="lb"),
    Flow("LB eTP=Local, no local endpoint, from outside", "client", "local-only-remote",
         to="lb", count=5),
    Flow("LB eTP=Local, no local endpoint, from the node", "node", "local-only-remote",
         to="lb"),
    Flow("LB source range allows the client", "client", "lb-allowed", to="lb"),
    Flow("LB source range denies the client", "client", "lb-denied", to="lb", count=5),
    Flow("external IP from outside", "client", "external", to="external"),
    Flow("iTP=Local ClusterIP", "pod-client", "itp-local"),
    Flow("no endpoints: ClusterIP", "client", "empty", count=5),
    Flow("no endpoints: NodePort", "client", "empty", to="node-port", count=5),
    # nodePortAddresses [primary, localhost, 192.168.51.0/24]: the CIDR is matched against
    # every address of the node's interfaces (upstream's TestNodePorts, "multiple
    # nodeport-addresses"; issue 35).
    Flow("NodePort on another address nodePortAddresses selects", "client", "nodeport",
         to="node-port-at", address=NODEPORT_ADDRESS, expect=("pod-a/masq", "pod-b/masq")),
    Flow("NodePort on an address nodePortAddresses does not select", "client", "nodeport",
         to="node-port-at", address=OTHER_ADDRESS, count=5, expect=("refused",)),
    Flow("ClientIP affinity", "client", "affinity", count=20),
    Flow("PreferSameZone hints", "client", "zonal"),
    Flow("terminating, serving fallback", "client", "terminating"),
    # KEP-6032, both proxies with KubeProxyNFTablesLocalhostNodePorts on and
    # nodePortAddresses [primary, localhost]: kube-proxy v1.37.2's userspace proxy (alpha).
    # The backend sees the node's address: the proxy opens a connection of its own.
    Flow("NodePort on 127.0.0.1 from the node", "node", "nodeport", to="localhost",
         expect=("pod-a/masq", "pod-b/masq")),
    Flow("NodePort on ::1 from the node", "node", "nodeport-dual", to="localhost6",
         expect=("pod-a/masq", "pod-b/masq")),
    Flow("eTP=Local NodePort on 127.0.0.1 from the node", "node", "lb-local", to="localhost",
         expect=("pod-c/masq",)),
    Flow("eTP=Local NodePort on 127.0.0.1, no local endpoint", "node", "local-only-remote",
         to="localhost", count=5, expect=("refused",)),
    Flow("UDP NodePort on 127.0.0.1 from the node", "node", "nodeport", to="localhost",
         port=53, proto="udp", count=5, expect=("refused",)),
)
# Both proxies serve NodePorts on loopback too (KEP-6032; alpha and off by default in v1.37.2,
# on by default in pyproxy as the KEP's 1.38 beta).
LOCALHOST_NODEPORTS = {"featureGates": {"KubeProxyNFTablesLocalhostNodePorts": True},
                       "nodePortAddresses": ["primary", "localhost", NODEPORT_CIDR]}
# The same flows against kube-proxy of the next release with its default gates: the gate is
# not set, only the addresses.
LOCALHOST_FLOWS = tuple(f for f in FLOWS if f.to in ("localhost", "localhost6"))
NEXT_LOCALHOST_NODEPORTS = {"nodePortAddresses": ["primary", "localhost"]}
# Flows whose outcomes differ on purpose: name → why (docs/kube-proxy-differences.md).
DELIBERATE: dict[str, str] = {}


@dataclass
class Island:
    """One copy of node-a and its proxy."""

    lab: Lab
    cluster: Cluster

    def source_ns(self, source: str) -> Any:
        if source == "client":
            return self.cluster.client
        if source == "pod-client":
            return self.cluster.pod_client.ns
        if source == "node":
            return self.cluster.node
        return self.cluster.pods[source].ns


def outcome(results: list[ConnResult], sticky: bool) -> tuple[str, ...]:
    """What a flow did: each backend reached, with /masq when it saw another address than the
    client's own, and the failures by kind. For affinity only whether it stuck to one."""
    labels = set()
    for r in results:
        if r.ok:
            labels.add(f"{r.name}{'/masq' if r.seen_ip != r.local_ip else ''}")
        else:
            labels.add(str(r.error))
    if sticky:
        backends = {label for label in labels if label.startswith("pod-")}
        return ("one backend",) if len(backends) == 1 and len(labels) == 1 else tuple(
            sorted(labels))
    return tuple(sorted(labels))


def service_object(svc: Svc, node_ports: dict[str, int]) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"diff": svc.name}, "clusterIP": svc.ip,
                            "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                       "protocol": "TCP"},
                                      {"name": "dns", "port": 53, "targetPort": 5353,
                                       "protocol": "UDP"}]}
    spec.update(svc.spec)
    if svc.name in node_ports:
        spec["ports"][0]["nodePort"] = node_ports[svc.name]
    return {"metadata": {"name": svc.name, **svc.meta}, "spec": spec}


@dataclass
class SideBySide:
    kube: Kube
    kube_proxy: Island
    pyproxy: Island
    node_ports: dict[str, int]
    udp_node_ports: dict[str, int] = field(default_factory=dict)  # allocated by the API

    def address(self, flow: Flow, island: Island) -> tuple[str, int]:
        svc = next((s for s in SERVICES if s.name == flow.service), None)
        if flow.to == "raw":
            return flow.address, flow.port
        assert svc is not None
        if flow.to == "cluster-ip":
            return svc.ip, flow.port
        if flow.to == "cluster-ip6":
            return svc.spec["clusterIPs"][1], flow.port
        if flow.to == "node-port":
            return island.cluster.node_ip4, self.node_ports[svc.name]
        if flow.to == "node-port6":
            return island.cluster.node_ip6, self.node_ports[svc.name]
        if flow.to == "node-port-at":
            return flow.address, self.node_ports[svc.name]
        if flow.to in ("localhost", "localhost6"):
            ports = self.udp_node_ports if flow.proto == "udp" else self.node_ports
            return ("127.0.0.1" if flow.to == "localhost" else "::1"), ports[svc.name]
        if flow.to == "lb":
            return LB_IPS[svc.name], flow.port
        return EXTERNAL, flow.port

    def run(self, flow: Flow, island: Island) -> tuple[str, ...]:
        ip, port = self.address(flow, island)
        ns = island.source_ns(flow.source)
        sticky = flow.service == "affinity"
        results = island.lab.connect(ns, ip, port, flow.proto, count=flow.count,
                                     parallel=1 if sticky else 10, timeout=0.5)
        island.lab.flush_conntrack(island.cluster.node)
        return outcome(results, sticky)


def island(lab: Lab, plane: ControlPlane) -> Island:
    cluster = lab.standard_topology(backends=3, udp_ports=(5353,))
    # Rejects are ICMP errors, which the node rate-limits per destination (6, then 1/s):
    # the flows that expect "refused", run back to back from one client, would otherwise
    # see timeouts depending on timing. The node's namespace is this test's own.
    cluster.node.run(["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0",
                      "net.ipv6.icmp.ratelimit=0"])
    # What no proxy DNATs to the LoadBalancer/external range is dropped by the node's own
    # routing, as silently with either proxy. Without a route, the node answered "no route"
    # under a limit that is the root namespace's (net.ipv4.route.error_burst: 5, then 1/s per
    # client), so a batch of 5 got one "timeout" among the "unreachable" now and then.
    cluster.node.run(["ip", "route", "add", "blackhole", "192.168.77.0/24"])
    for address in (NODEPORT_ADDRESS, OTHER_ADDRESS):  # the client routes them via the node
        lab.add_addr(cluster.node, "eth0", f"{address}/24")
    plane.attach(cluster.node)
    return Island(lab, cluster)


def slices_settled(kube: Kube, svc: Svc, cluster: Cluster) -> bool:
    """svc's EndpointSlices hold exactly its pods' addresses, per family it has, and hints
    on every endpoint where it asks for a traffic distribution."""
    families = {"IPv4"}
    if svc.spec.get("ipFamilyPolicy") in ("PreferDualStack", "RequireDualStack"):
        families.add("IPv6")
    want = {"IPv4": {cluster.pods[b].ip4 for b, _ in svc.pods},
            "IPv6": {cluster.pods[b].ip6 for b, _ in svc.pods}}
    seen: dict[str, set[str]] = {family: set() for family in families}
    for piece in kube.slices(NS, svc.name):
        for endpoint in piece.endpoints or []:
            seen.setdefault(piece.address_type, set()).update(endpoint.addresses)
            if "trafficDistribution" in svc.spec and not endpoint.hints:
                return False
    return all(seen[family] == want[family] for family in families)


MARKER = "settle-marker"
MARKER_ENDPOINTS = {"IPv4": "10.244.250.250", "IPv6": "fd00:244:0:fa::fa"}


def add_settle_marker(kube: Kube) -> None:
    """A selectorless dual-stack Service with one hand-written EndpointSlice per family."""
    kube.core.create_namespaced_service(NS, {
        "metadata": {"name": MARKER},
        "spec": {"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv6"],
                 "ports": [{"port": 80, "protocol": "TCP"}]}})
    for family, address in MARKER_ENDPOINTS.items():
        kube.discovery.create_namespaced_endpoint_slice(NS, {
            "metadata": {"name": f"{MARKER}-{family.lower()}", "labels": {
                "kubernetes.io/service-name": MARKER,
                "endpointslice.kubernetes.io/managed-by": "tests.pyproxy.io"}},
            "addressType": family,
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"port": 80, "protocol": "TCP"}]})


def marker_programmed(island: Island) -> bool:
    """Both families' marker endpoints are in the island's ruleset."""
    ruleset = island.lab.nft_list(island.cluster.node)
    return all(address in ruleset for address in MARKER_ENDPOINTS.values())


def wait_until_programmed(both: SideBySide, each: Island) -> None:
    wait_for(lambda: marker_programmed(each), 60,
             f"{each.lab.prefix}'s proxy programmed the settle marker", interval=0.2)
    wait_for(lambda: both.run(FLOWS[0], each) == ("pod-a/masq", "pod-b/masq"),
             60, "the proxy programmed the cluster", interval=0.5)


@pytest.fixture(scope="module")
def side_by_side(control_plane: ControlPlane) -> Iterator[SideBySide]:
    kube = Kube(control_plane.admin_client())
    apply_manifests(kube)
    kube.namespace(NS)
    with Lab() as kp_lab, Lab() as py_lab:
        kp, py = island(kp_lab, control_plane), island(py_lab, control_plane)
        cluster = kp.cluster
        kube.node(NODE, (cluster.node_ip4, cluster.node_ip6), zone="zone-1")
        kube.node("node-b", ("192.168.50.3",), zone="zone-1")
        kube.node("node-z", ("192.168.50.4",), zone="zone-2")
        # In the static band of the NodePort range (30000–30085 for the default range): the
        # API server allocates other tests' NodePorts from above it first, so a fixed port
        # up there could already be taken (a 422 "provided port is already allocated").
        node_ports = {s.name: 30040 + i for i, s in enumerate(SERVICES)
                      if s.spec.get("type") in ("NodePort", "LoadBalancer")}
        assert max(node_ports.values(), default=0) < 30080  # test_k8s.py uses 30080
        for svc in SERVICES:
            kube.core.create_namespaced_service(NS, service_object(svc, node_ports))
            if svc.name in LB_IPS:
                kube.core.patch_namespaced_service_status(svc.name, NS, {"status": {
                    "loadBalancer": {"ingress": [{"ip": LB_IPS[svc.name], "ipMode": "VIP"}]}}})
            for backend, node in svc.pods:
                pod = cluster.pods[backend]
                name = f"{svc.name}-{backend}"
                kube.pod(NS, name, node, (pod.ip4, pod.ip6), {"diff": svc.name})
                if backend in svc.terminating:
                    kube.delete_pod(NS, name, grace=300)
        kp_kubeconfig = control_plane.node_kubeconfig(kp_lab.workdir / "kube-proxy.kubeconfig",
                                                      kube_proxy_token(kube))
        udp_node_ports = {name: kube.core.read_namespaced_service(name, NS).spec.ports[1].node_port
                          for name in node_ports}
        kp_config = kube_proxy_config(kp_lab.workdir / "kube-proxy.yaml", kp_kubeconfig,
                                      extra=LOCALHOST_NODEPORTS)
        kp_proc = kp_lab.popen(kp.cluster.node, [
            control_plane.bin / "kube-proxy", f"--config={kp_config}", "-v=1"],
            log_name="kube-proxy.log")
        py_kubeconfig = control_plane.node_kubeconfig(py_lab.workdir / "pyproxy.kubeconfig",
                                                      service_account_token(kube))
        daemon = start_pyproxy(py_lab, py.cluster.node, py_kubeconfig, NODE,
                               "--nodeport-addresses",
                               f"primary,localhost,{NODEPORT_CIDR}")
        both = SideBySide(kube, kp, py, node_ports, udp_node_ports)
        try:
            wait_for(lambda: kube.endpoint_conditions(NS, "terminating").get(
                cluster.pods["pod-a"].ip4) == (False, True, True), 30, "pod-a terminating")
            # Every flow must meet the final state in both proxies: first the API's (each
            # Service's slices hold all its pods, with hints where asked), then each proxy
            # programmed it (below). The slices of one Service arriving late made a flow
            # compare a proxy that had them with one that had not.
            for svc in SERVICES:
                wait_for(lambda s=svc: slices_settled(kube, s, cluster), 60,
                         f"the EndpointSlices of {svc.name}", interval=0.2)
            # Then a marker after that moment: a Service and one EndpointSlice per family
            # whose only endpoint appears in a proxy's ruleset once that family synced after
            # receiving it. The API sends EndpointSlices in one ordered stream, so a proxy
            # that programmed the marker had every earlier slice, and the sync took them all.
            # (A wait on the sync metrics failed: kube-proxy 1.37 in nftables mode syncs only
            # on a change, its syncPeriod being a retry interval, so a family with nothing
            # new after the settled moment never synced again.)
            add_settle_marker(kube)
            for each in (kp, py):
                wait_until_programmed(both, each)
            yield both
        finally:
            if os.environ.get("NETLAB_KEEP_LOGS"):  # both rulesets beside the logs
                for each in (kp, py):
                    Path(f"/tmp/pyproxy-rulesets-{each.lab.prefix}nft").write_text(
                        each.lab.nft_list(each.cluster.node))
            kp_lab.stop_process(kp_proc)
            py_lab.stop_process(daemon.proc)
            kube.core.delete_namespace(NS)
            for name in (NODE, "node-b", "node-z"):
                kube.core.delete_node(name)


@pytest.mark.parametrize("flow", FLOWS, ids=[f.name for f in FLOWS])
def test_same_outcome_as_kube_proxy(side_by_side: SideBySide, flow: Flow) -> None:
    theirs = side_by_side.run(flow, side_by_side.kube_proxy)
    ours = side_by_side.run(flow, side_by_side.pyproxy)
    if flow.name in DELIBERATE:
        assert ours != theirs, f"{flow.name} is listed as a deliberate difference but is not"
        return
    assert ours == theirs, f"kube-proxy: {theirs}\npyproxy:    {ours}"
    if flow.expect is not None:
        assert ours == flow.expect


@pytest.fixture(scope="module")
def next_kube_proxy_island(control_plane: ControlPlane,
                           side_by_side: SideBySide) -> Iterator[Island]:
    """A third copy of node-a programmed by kube-proxy of the next release, default gates, fed
    the same Services (side_by_side made them and their settle marker)."""
    release, binary = next_kube_proxy()
    if not os.access(binary, os.X_OK):
        message = (f"kube-proxy {release} is not built ({binary} missing): run "
                   "`make kube-proxy-next`")
        if os.environ.get("CI"):  # `make test` builds it first
            pytest.fail(message)
        pytest.skip(message)
    with Lab() as lab:
        nxt = island(lab, control_plane)
        kubeconfig = control_plane.node_kubeconfig(lab.workdir / "kube-proxy.kubeconfig",
                                                   kube_proxy_token(side_by_side.kube))
        config = kube_proxy_config(lab.workdir / "kube-proxy.yaml", kubeconfig,
                                   extra=NEXT_LOCALHOST_NODEPORTS)
        proc = lab.popen(nxt.cluster.node, [binary, f"--config={config}", "-v=1"],
                         log_name="kube-proxy.log")
        try:
            wait_until_programmed(side_by_side, nxt)
            yield nxt
        finally:
            if os.environ.get("NETLAB_KEEP_LOGS"):
                Path(f"/tmp/pyproxy-rulesets-{lab.prefix}nft").write_text(
                    lab.nft_list(nxt.cluster.node))
            lab.stop_process(proc)


@pytest.mark.parametrize("flow", LOCALHOST_FLOWS, ids=[f.name for f in LOCALHOST_FLOWS])
def test_localhost_nodeports_as_next_kube_proxy(side_by_side: SideBySide,
                                                next_kube_proxy_island: Island,
                                                flow: Flow) -> None:
    """KEP-6032 as kube-proxy v1.38 ships it (beta, on by default): the same outcomes."""
    theirs = side_by_side.run(flow, next_kube_proxy_island)
    ours = side_by_side.run(flow, side_by_side.pyproxy)
    assert ours == theirs, f"kube-proxy (next): {theirs}\npyproxy:           {ours}"
    assert ours == flow.expect
