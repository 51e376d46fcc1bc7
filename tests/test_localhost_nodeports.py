"""Localhost NodePorts as kube-proxy's nftables mode serves them behind
`KubeProxyNFTablesLocalhostNodePorts` (KEP-6032; kube-proxy v1.37.2's
pkg/proxy/localnodeportproxy and nftables/proxier.go): which family does what, the reject
map and its chains, the listeners' reconciliation and endpoint choice, and the real daemon
in a node namespace answering 127.0.0.1:NodePort and [::1]:NodePort.

The pinned kube-proxy (v1.37.2) has the feature as alpha, off by default; the KEP makes it
beta for 1.38, which no module proxy serves yet: these tests hold pyproxy to the KEP's text
and to the v1.37.2 code, not to a 1.38 binary."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pyproxy.cluster.snapshot import build_state
from pyproxy.config import ProxyConfig
from pyproxy.core.localhost import NodePortSpec, nodeport_specs
from pyproxy.core.model import IPFamily, Protocol, ServicePortName
from pyproxy.core.nodeconfig import LocalhostNodePorts, NodeConfig
from pyproxy.core.topology import select_all
from pyproxy.kernel.nlelements import netlink_socket
from pyproxy.kernel.nlsets import rule_packets
from pyproxy.render.objects import Kind
from pyproxy.render.skeleton import render_config, skeleton
from pyproxy.render.trace import trace
from pyproxy.serve.localhost import LocalhostListeners
from pyproxy.serve.metrics import RejectedPackets
from pyproxy.sync.proxier import FamilyProxier, desired_state
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.nftns import libnft_in, render_script
from testkit.waits import eventually

V4, V6 = IPFamily.IPv4, IPFamily.IPv6
NODE = NodeConfig("node-a", node_ips=("192.168.50.1", "fd00:50::1"))
LOOPBACK = ("127.0.0.0/8", "::1/128")


def node(*addresses: str, gate: bool = True) -> NodeConfig:
    return NodeConfig("node-a", node_ips=NODE.node_ips, nodeport_addresses=addresses,
                      localhost_nodeports_gate=gate)


# ---------------------------------------------------------------------------------------------
# What each family does (kube-proxy: localhostNodePortsEnabled, ContainsExplicitLoopback)


@pytest.mark.parametrize(("config", "v4", "v6"), [
    pytest.param(node("primary", gate=False), "off", "off", id="gate off"),
    pytest.param(node("primary"), "reject", "reject", id="gate on, primary (the default)"),
    pytest.param(node("primary", *LOOPBACK), "proxy", "proxy", id="primary,localhost"),
    pytest.param(node("primary", *LOOPBACK, gate=False), "off", "off",
                 id="localhost without the gate"),
    pytest.param(node("127.0.0.1/32"), "proxy", "reject", id="IPv4 loopback only"),
    # kube-proxy 1.38's ContainsExplicitLoopback: a CIDR holding 127.0.0.1 or ::1 other than
    # 0.0.0.0/0 and ::/0 (1.37 asked whether the CIDR's own address was loopback).
    pytest.param(node("127.0.0.2/32", "::/0"), "reject", "reject",
                 id="loopback without 127.0.0.1 (1.37: proxy)"),
    pytest.param(node("0.0.0.0/1", "::/1"), "proxy", "proxy",
                 id="a CIDR holding localhost (1.37: reject)"),
    pytest.param(node(), "reject", "reject", id="all: no explicit loopback"),
    pytest.param(node("0.0.0.0/0", "::/0", *LOOPBACK), "proxy", "proxy", id="all,localhost"),
])
def test_which_family_does_what(config: NodeConfig, v4: str, v6: str) -> None:
    assert (config.localhost_nodeports(V4), config.localhost_nodeports(V6)) == (
        LocalhostNodePorts(v4), LocalhostNodePorts(v6))


@pytest.mark.parametrize(("addresses", "v4", "v6"), [
    pytest.param(("primary", *LOOPBACK), ("192.168.50.1",), ("fd00:50::1",),
                 id="loopback adds no node address"),
    pytest.param(LOOPBACK, (), (), id="localhost only: NodePorts on loopback only"),
    pytest.param(("127.0.0.1/32",), (), None, id="a family without CIDRs: every address"),
    pytest.param(("127.0.0.2/32",), (), None, id="loopback without localhost: still no address"),
    pytest.param(("0.0.0.0/0", "::/0", *LOOPBACK), None, None, id="all,localhost"),
])
def test_loopback_is_never_a_nodeport_address(addresses: tuple[str, ...], v4: Any,
                                              v6: Any) -> None:
    """kube-proxy leaves loopback addresses out of `nodeport-ips` (they are the userspace
    proxy's); a family with only loopback CIDRs accepts NodePorts on no other address."""
    config = node(*addresses)
    assert (config.nodeport_ips(V4), config.nodeport_ips(V6)) == (v4, v6)


def test_the_settings_as_kube_proxy_spells_them() -> None:
    """`localhost` is kube-proxy's keyword for both loopback CIDRs, whatever the node has;
    the gate is on by default (KEP-6032's beta) and `false` turns it off."""
    config = ProxyConfig(nodeport_addresses=("primary", "localhost"))
    made = config.node_config("node-a", ["192.168.50.1"])
    assert made.nodeport_addresses == ("primary", *LOOPBACK)
    assert made.localhost_nodeports_gate
    assert made.localhost_nodeports(V4) is LocalhostNodePorts.PROXY
    off = ProxyConfig(feature_gates={"KubeProxyNFTablesLocalhostNodePorts": False})
    assert off.node_config("node-a", ["192.168.50.1"]).localhost_nodeports(V4) is (
        LocalhostNodePorts.OFF)
    both = ProxyConfig(nodeport_addresses=("all", "localhost")).node_config("n", ["10.0.0.1"])
    assert both.nodeport_ips(V4) is None and both.localhost_nodeports(V6) is (
        LocalhostNodePorts.PROXY)
    assert not ProxyConfig().unapplied  # the gate is one pyproxy applies


# ---------------------------------------------------------------------------------------------
# The ruleset


def nodeport_objects(**extra: Any) -> list[dict[str, Any]]:
    def web(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="NodePort", ports=[
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
             "nodePort": 30080}], **extra)

    def dns(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="NodePort", ports=[
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353,
             "nodePort": 30053}])

    return [make_node("node-a", "zone-1"),
            make_service("ns", "web", web), make_slice("ns", "web", [ep("10.244.1.2", "node-b")]),
            make_service("ns", "dns", dns, ip="10.96.0.11")]  # no endpoints: rejected anyway


@pytest.mark.parametrize(("config", "rejected"), [
    pytest.param(node("primary", gate=False), (), id="gate off: nothing"),
    pytest.param(node("primary"), ("tcp", "udp"), id="no proxy: every protocol"),
    pytest.param(node("primary", *LOOPBACK), ("udp",), id="proxy: what it cannot carry"),
])
def test_the_reject_map_holds_the_nodeports_nobody_serves(config: NodeConfig,
                                                          rejected: tuple[str, ...]) -> None:
    script = render_script(build_state(nodeport_objects()), config, (V4,))
    chains = {"tcp": "localhost-nodeport-reject-tcp", "udp": "localhost-nodeport-reject-udp"}
    for proto, port in (("tcp", 30080), ("udp", 30053)):
        element = f"{proto} . {port} : goto {chains[proto]}"
        assert (element in script) == (proto in rejected), proto
    check = ("ip daddr 127.0.0.0/8 meta l4proto . th dport vmap "
             "@localhost-nodeport-reject-ports")
    assert (check in script) == bool(rejected)
    six = skeleton(render_config(config, V6))
    assert any("ip6 daddr ::1 meta l4proto" in rule.text() for item in six.items
               if item.kind is Kind.CHAIN for rule in item.value) == bool(rejected)
    assert any(item.container == "localhost-nodeport-reject-sctp" for item in six.items) == bool(
        rejected)


# ---------------------------------------------------------------------------------------------
# What the listeners serve (kube-proxy: NodePortSpec from clusterEndpoints / localEndpoints)


def specs(**extra: Any) -> tuple[NodePortSpec, ...]:
    objects = nodeport_objects(**extra)
    objects.append(make_slice("ns", "web", [ep("10.244.0.9", "node-a")], name="web-local"))
    return nodeport_specs(select_all(build_state(objects), "node-a"))


def test_a_spec_per_tcp_nodeport_with_endpoints() -> None:
    (web,) = specs()
    assert web == NodePortSpec(name=ServicePortName("ns", "web", "http", Protocol.TCP),
                               node_port=30080,
                               endpoints=(("10.244.0.9", 8080), ("10.244.1.2", 8080)))


def test_external_traffic_policy_local_uses_the_local_endpoints_only() -> None:
    (web,) = specs(externalTrafficPolicy="Local")
    assert web.endpoints == (("10.244.0.9", 8080),)


def test_client_ip_affinity_carries_its_timeout() -> None:
    (web,) = specs(sessionAffinity="ClientIP",
                   sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})
    assert web.affinity_timeout == 60


# ---------------------------------------------------------------------------------------------
# The listeners (on the test's own loopback: bound to free ports, nothing else touched)


class Echo:
    """A TCP server answering each connection with its name."""

    def __init__(self, name: str) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.name = name.encode()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ask(port: int) -> bytes | str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            return conn.recv(100)
    except OSError as err:
        return type(err).__name__


@pytest.fixture
def echoes() -> Iterator[list[Echo]]:
    servers = [Echo("a"), Echo("b")]
    yield servers
    for server in servers:
        server.sock.close()


def spec(port: int, *servers: Echo, affinity: int = 0) -> NodePortSpec:
    return NodePortSpec(name=ServicePortName("ns", "web", "http", Protocol.TCP), node_port=port,
                        endpoints=tuple(("127.0.0.1", s.port) for s in servers),
                        affinity_timeout=affinity)


def test_listeners_follow_the_specs(echoes: list[Echo]) -> None:
    counts: list[int] = []
    failures: list[int] = []
    listeners = LocalhostListeners(V4, on_listeners=counts.append,
                                   on_failure=lambda: failures.append(1))
    port = free_port()
    try:
        listeners.sync([spec(port, *echoes)])
        assert {ask(port) for _ in range(30)} == {b"a", b"b"}
        listeners.sync([spec(port, echoes[1])])  # new endpoints, the same listener
        assert {ask(port) for _ in range(5)} == {b"b"}
        listeners.sync([spec(port)])  # no endpoint left: no listener, refused
        assert ask(port) == "ConnectionRefusedError"
        assert counts == [1, 1, 0] and not failures
    finally:
        listeners.shutdown()


def test_a_port_held_by_someone_else_is_counted_and_tried_again(echoes: list[Echo]) -> None:
    failures: list[int] = []
    listeners = LocalhostListeners(V4, on_failure=lambda: failures.append(1))
    held = echoes[0].port  # a host process owns it
    try:
        listeners.sync([spec(held, echoes[1])])
        listeners.sync([spec(held, echoes[1])])
        assert len(failures) == 2 and listeners.ports == []
        assert ask(held) == b"a"  # the host process still answers
    finally:
        listeners.shutdown()


def test_affinity_pins_every_connection_while_they_keep_coming(echoes: list[Echo]) -> None:
    """All of them come from loopback: one pin for all, renewed by each connection."""
    now = [0.0]
    listeners = LocalhostListeners(V4, clock=lambda: now[0], pick=lambda eps: eps[len(eps) - 1])
    port = free_port()
    try:
        listeners.sync([spec(port, *echoes, affinity=10)])
        assert ask(port) == b"b"
        listeners.active[port].pick = lambda eps: eps[0]
        for _ in range(3):
            now[0] += 9
            assert ask(port) == b"b"  # within 10 s of the last one
        now[0] += 11
        assert ask(port) == b"a"  # expired: picked afresh
    finally:
        listeners.shutdown()


def test_removing_a_listener_cuts_its_connections(echoes: list[Echo]) -> None:
    hold = socket.create_server(("127.0.0.1", 0))
    listeners = LocalhostListeners(V4)
    port = free_port()
    try:
        listeners.sync([NodePortSpec(name=spec(port).name, node_port=port,
                                     endpoints=(("127.0.0.1", hold.getsockname()[1]),))])
        client = socket.create_connection(("127.0.0.1", port), timeout=2)
        hold.accept()
        listeners.sync([])
        assert client.recv(10) == b""  # closed by the proxy
        client.close()
    finally:
        listeners.shutdown()
        hold.close()


def test_rejected_packets_never_go_backwards() -> None:
    """A full sync rewrites a reject chain and its counter starts from zero again."""
    readings = iter([{("IPv4", "UDP"): 5}, {("IPv4", "UDP"): 7}, {("IPv4", "UDP"): 2}])
    rejected = RejectedPackets(lambda: next(readings))
    assert [rejected()[("IPv4", "UDP")] for _ in range(3)] == [5, 7, 9]


# ---------------------------------------------------------------------------------------------
# The daemon in a node namespace, with real connections

PYPROXY = str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "pyproxy")


def cluster_objects(cluster: Cluster) -> list[dict[str, Any]]:
    pods = [cluster.pods[p] for p in ("pod-a", "pod-b")]

    def web(svc: dict[str, Any]) -> None:
        svc["spec"].update(
            type="NodePort", clusterIPs=["10.96.0.10", "fd00:96::a"],
            ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack",
            ports=[{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                    "nodePort": 30080}])

    def nodeport(port: int, proto: str = "TCP", **extra: Any) -> Any:
        def tweak(svc: dict[str, Any]) -> None:
            svc["spec"].update(type="NodePort", ports=[
                {"name": "p", "port": 80, "protocol": proto, "nodePort": port}], **extra)
        return tweak

    def ports(proto: str, number: int) -> Any:
        return lambda s: s.update(ports=[{"name": "p", "port": number, "protocol": proto}])

    return [
        make_node("node-a", "zone-1"),
        make_service("ns", "web", web),
        make_slice("ns", "web", [ep(p.ip4, "node-b") for p in pods]),
        make_slice("ns", "web", [ep(p.ip6, "node-b") for p in pods], family="IPv6"),
        make_service("ns", "dns", nodeport(30053, "UDP"), ip="10.96.0.11"),
        make_slice("ns", "dns", [ep(pods[0].ip4, "node-b")], ports("UDP", 5353)),
        make_service("ns", "local", nodeport(30081, externalTrafficPolicy="Local"),
                     ip="10.96.0.12"),
        make_slice("ns", "local", [ep(pods[0].ip4, "node-b")], ports("TCP", 8080)),
        make_service("ns", "busy", nodeport(30082), ip="10.96.0.13"),
        make_slice("ns", "busy", [ep(pods[0].ip4, "node-b")], ports("TCP", 8080)),
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=2)


def start(cluster: Cluster, tmp_path: Path, *extra: str) -> Any:
    snapshot = tmp_path / "cluster.yaml"
    snapshot.write_text(yaml.safe_dump_all(cluster_objects(cluster)))
    argv = DaemonArgs(snapshot=snapshot,
                      cluster_cidr=f"{cluster.cluster_cidr4},{cluster.cluster_cidr6}",
                      min_sync_period=None, sync_period=None, healthz="", extra=extra).argv()
    return cluster.lab.popen(cluster.node, argv, log_name="pyproxy-localhost.log")


def stop(cluster: Cluster, daemon: Any) -> None:
    cluster.lab.stop_process(daemon)
    for family in ("ip", "ip6"):
        cluster.node.run(["nft", "delete", "table", family, "pyproxy"], check=False)


def metrics(cluster: Cluster) -> dict[str, float]:
    text = cluster.lab.exec_python(cluster.node, (
        "import urllib.request;print(urllib.request.urlopen("
        "'http://127.0.0.1:10249/metrics').read().decode())")).stdout
    out = {}
    for line in text.splitlines():
        if line.startswith("kubeproxy_nftables_localhost"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@requires_netns
@pytest.mark.netns
def test_localhost_nodeports_from_the_node(cluster: Cluster, tmp_path: Path) -> None:
    """`nodePortAddresses: [primary, localhost]`: TCP NodePorts answer on 127.0.0.1 and ::1
    from the node's own namespace; UDP is rejected and counted; eTP=Local without a local
    endpoint is refused; a port a host process holds stays the host's and the failure is
    counted; the node IP still serves from outside."""
    lab = cluster.lab
    host = lab.serve_http(cluster.node, "127.0.0.1", 30082, "host")
    daemon = start(cluster, tmp_path, "--nodeport-addresses", "primary,localhost")
    try:
        eventually(lambda: lab.connect(cluster.node, "127.0.0.1", 30080)[0].ok,
                   what="the listener on 127.0.0.1:30080")
        assert set(tally(lab.connect(cluster.node, "127.0.0.1", 30080, count=20))) == {
            "pod-a", "pod-b"}
        # Both pods over IPv6 too (20 connections: all on one pod by chance is 2 in 10^6).
        assert set(tally(lab.connect(cluster.node, "::1", 30080, count=20))) == {
            "pod-a", "pod-b"}
        assert lab.connect(cluster.node, "127.0.0.1", 30053, "udp")[0].rejected
        assert lab.connect(cluster.node, "127.0.0.1", 30081)[0].error == "refused"
        assert lab.probe_http(cluster.node, "127.0.0.1", 30082, 3) == {"host": 3}
        assert set(tally(lab.connect(cluster.client, cluster.node_ip(), 30080, count=10))) <= {
            "pod-a", "pod-b"}
        seen = metrics(cluster)
        assert seen['kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv4"}'] == 1
        assert seen['kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv6"}'] == 1
        assert seen['kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total'
                    '{ip_family="IPv4"}'] >= 1
        assert seen['kubeproxy_nftables_localhost_nodeport_rejected_packets_total'
                    '{ip_family="IPv4",protocol="UDP"}'] >= 1
    finally:
        stop(cluster, daemon)
        host.stop()


@requires_netns
@pytest.mark.netns
def test_without_localhost_every_protocol_is_rejected_and_counted(cluster: Cluster,
                                                                  tmp_path: Path) -> None:
    """The gate on (the default) and `nodePortAddresses` without loopback: no listener, and
    a localhost NodePort of any protocol is rejected, TCP included. Gate off: no rule at all,
    the connection meets whatever listens there (nothing: refused by the kernel)."""
    lab = cluster.lab
    daemon = start(cluster, tmp_path)
    try:
        eventually(lambda: lab.connect(cluster.client, cluster.node_ip(), 30080)[0].ok,
                   what="the first sync")
        assert lab.connect(cluster.node, "127.0.0.1", 30080)[0].rejected
        seen = metrics(cluster)
        assert seen['kubeproxy_nftables_localhost_nodeport_rejected_packets_total'
                    '{ip_family="IPv4",protocol="TCP"}'] >= 1
        assert not any("listeners{" in name and value for name, value in seen.items())
    finally:
        stop(cluster, daemon)
    daemon = start(cluster, tmp_path, "--feature-gates",
                   "KubeProxyNFTablesLocalhostNodePorts=false")
    try:
        eventually(lambda: lab.connect(cluster.client, cluster.node_ip(), 30080)[0].ok,
                   what="the first sync")
        assert "localhost-nodeport" not in cluster.node.run(
            ["nft", "list", "table", "ip", "pyproxy"]).stdout
        assert not metrics(cluster)  # not registered, as kube-proxy
    finally:
        stop(cluster, daemon)


@requires_netns
@pytest.mark.netns
def test_a_restart_with_localhost_added_stops_rejecting_tcp(cluster: Cluster) -> None:
    """kubernetes#142183: kube-proxy restarted with loopback newly in nodePortAddresses kept
    the TCP element of its reject map, so the new listener was never reached. pyproxy's
    first sync after a start is a full one from the configuration: the element goes, and
    the TCP chain is flushed (deleted a sync later, as every chain that lost its users)."""
    lab = cluster.lab
    ns = lab.add_ns("restart")
    try:
        state = build_state(nodeport_objects())
        FamilyProxier(V4, node("primary"), libnft_in(ns.full)).sync(state)  # full: a start
        listed = ns.run(["nft", "list", "table", "ip", "pyproxy"]).stdout
        assert "tcp . 30080 : goto localhost-nodeport-reject-tcp" in listed
        proxier = FamilyProxier(V4, node("primary", *LOOPBACK), libnft_in(ns.full))
        proxier.sync(state)
        listed = ns.run(["nft", "list", "table", "ip", "pyproxy"]).stdout
        assert "tcp . 30080 : goto localhost-nodeport-reject-tcp" not in listed
        assert "chain localhost-nodeport-reject-tcp {\n\t}" in listed
        assert "udp . 30053 : goto localhost-nodeport-reject-udp" in listed
        # A counter moving with traffic is nobody's tampering (the structure is compared
        # without counter values).
        proxier.applier.adopt_structure()
        assert lab.connect(ns, "127.0.0.1", 30053, "udp")[0].rejected
        def sockets() -> socket.socket:
            return call_in_netns(ns.full, netlink_socket)
        assert rule_packets("ip", "localhost-nodeport-reject-udp", sockets) == 1
        # libnftables reads the same
        listed = ns.run(["nft", "list", "chain", "ip", "pyproxy",
                         "localhost-nodeport-reject-udp"]).stdout
        assert "counter packets 1 " in listed
        assert rule_packets("ip", "localhost-nodeport-reject-tcp", sockets) == 0  # flushed
        assert rule_packets("ip", "no-such-chain", sockets) is None
        assert rule_packets("ip6", "localhost-nodeport-reject-udp", sockets) is None
        assert proxier.applier.structure_intact()
    finally:
        lab.del_ns(ns)


@pytest.mark.parametrize(("config", "proto", "port", "verdict", "says"), [
    pytest.param(node("primary"), "tcp", 30080, "REJECT", "localhost NodePort tcp . 30080",
                 id="no proxy: TCP rejected"),
    pytest.param(node("primary", *LOOPBACK), "tcp", 30080, "NONE", "userspace proxy",
                 id="proxy: TCP to the listener"),
    pytest.param(node("primary", *LOOPBACK), "udp", 30053, "REJECT", "localhost NodePort udp",
                 id="proxy: UDP rejected"),
    pytest.param(node("primary", gate=False), "tcp", 30080, "NONE", "leaves this connection",
                 id="gate off: untouched"),
])
def test_trace_tells_what_a_localhost_nodeport_gets(config: NodeConfig, proto: str, port: int,
                                                   verdict: str, says: str) -> None:
    state = desired_state(build_state(nodeport_objects()), config, V4)
    answer = trace(state, render_config(config, V4), "127.0.0.1", "127.0.0.1", port, proto,
                   from_node=True)
    assert answer.verdict == verdict
    assert says in answer.steps[-1]
