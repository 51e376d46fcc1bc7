"""The node's IPs come from its Node object (status.addresses, as kube-proxy picks them), flags
override them per family, and the daemon follows a change: conversion, the offline CLI, and
the daemon's sync core with a fake libnftables."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from pyproxy.cli import main
from pyproxy.config import ProxyConfig
from pyproxy.core.convert_endpoints import convert_node
from pyproxy.core.model import IPFamily, LocalMode, Node, Skipped
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause
from pyproxy.render.skeleton import render_config
from pyproxy.run import build_daemon
from pyproxy.sync.settings import LocalAddresses, node_config_for
from testkit.builders import make_node, make_service
from testkit.fakes import FakeClock, FakeNft

Obj = dict[str, Any]


def node_with(*addresses: tuple[str, str], pod_cidrs: list[str] | None = None,
              name: str = "node-a") -> Obj:
    obj = make_node(name, "zone-1")
    obj["status"] = {"addresses": [{"type": t, "address": a} for t, a in addresses]}
    if pod_cidrs is not None:
        obj["spec"] = {"podCIDRs": pod_cidrs}
    return obj


def converted(obj: Obj) -> Node:
    node = convert_node(obj)
    assert not isinstance(node, Skipped), node
    return node


# --- which addresses (kube-proxy's GetNodeHostIPs) -----------------------------------------


@pytest.mark.parametrize(("addresses", "expected"), [
    pytest.param([("InternalIP", "10.250.0.1"), ("InternalIP", "fd00:250::1")],
                 ("10.250.0.1", "fd00:250::1"), id="dual-stack"),
    pytest.param([("ExternalIP", "203.0.113.7"), ("InternalIP", "10.250.0.1")],
                 ("10.250.0.1",), id="InternalIP before ExternalIP"),
    pytest.param([("InternalIP", "fd00:250::1"), ("ExternalIP", "203.0.113.7")],
                 ("fd00:250::1", "203.0.113.7"), id="other family from an ExternalIP"),
    pytest.param([("InternalIP", "10.250.0.1"), ("InternalIP", "10.250.0.2"),
                  ("InternalIP", "fd00:250::1"), ("InternalIP", "fd00:250::2")],
                 ("10.250.0.1", "fd00:250::1"), id="the first of each family"),
    pytest.param([("Hostname", "node-a"), ("InternalDNS", "node-a.example"),
                  ("InternalIP", "not-an-ip"), ("InternalIP", "10.250.000.001")],
                 ("10.250.0.1",), id="others passed over, leading zeros read as decimal"),
    pytest.param([], (), id="none"),
])
def test_host_ips_as_kube_proxy_picks_them(addresses: list[tuple[str, str]],
                                           expected: tuple[str, ...]) -> None:
    assert converted(node_with(*addresses)).host_ips == expected


def test_pod_cidrs_and_the_old_single_field() -> None:
    assert converted(node_with(pod_cidrs=["10.244.3.0/24", "fd00:244:0:3::/64"])).pod_cidrs \
        == ("10.244.3.0/24", "fd00:244:0:3::/64")
    obj = make_node("node-a")
    obj["spec"] = {"podCIDR": "10.244.4.0/24"}
    assert converted(obj).pod_cidrs == ("10.244.4.0/24",)


@pytest.mark.parametrize(("bind", "host_ips", "interfaces", "expected"), [
    pytest.param("0.0.0.0", ("10.250.0.1",), ("192.168.50.1",), ("10.250.0.1",),
                 id="the Node's, not the interface's"),
    pytest.param("0.0.0.0", ("10.250.0.1",), ("192.168.50.1", "fd00:50::1"),
                 ("10.250.0.1", "fd00:50::1"), id="a family the Node lacks: the interface's"),
    pytest.param("0.0.0.0", (), ("192.168.50.1",), ("192.168.50.1",),
                 id="no Node addresses: the interface's"),
    pytest.param("10.0.0.9", ("10.250.0.1", "fd00:250::1"), (), ("10.0.0.9", "fd00:250::1"),
                 id="bindAddress overrides its own family only"),
])
def test_node_config_per_family(bind: str, host_ips: tuple[str, ...],
                                interfaces: tuple[str, ...], expected: tuple[str, ...]) -> None:
    node = Node("node-a", host_ips=host_ips)
    config = node_config_for(ProxyConfig(bind_address=bind), "node-a", node, interfaces)
    assert config.node_ips == expected


def test_node_cidr_mode_takes_the_nodes_pod_cidrs() -> None:
    node = Node("node-a", pod_cidrs=("10.244.3.0/24",))
    config = node_config_for(ProxyConfig(detect_local_mode=LocalMode.NODE_CIDR), "node-a", node,
                             ("192.168.50.1",))
    match = render_config(config, IPFamily.IPv4).local_match()
    assert match is not None and match.text() == "ip saddr 10.244.3.0/24"


# --- which addresses accept NodePorts (kube-proxy's NodePortAddresses.GetNodeIPs) ----------

TWO_NETWORKS = ("192.168.0.2", "192.168.1.2", "fd00:1::2", "fd00:2::2")


@pytest.mark.parametrize(("entries", "node_ips", "local_ips", "v4", "v6"), [
    pytest.param(("192.168.0.0/24", "192.168.1.0/24"), ("192.168.0.2",), TWO_NETWORKS,
                 ("192.168.0.2", "192.168.1.2"), None,
                 id="CIDRs of two networks: an address on each (upstream's multiple "
                    "nodeport-addresses)"),
    pytest.param(("192.168.0.0/16", "fd00:2::/64"), ("192.168.0.2",), TWO_NETWORKS,
                 ("192.168.0.2", "192.168.1.2"), ("fd00:2::2",),
                 id="one CIDR holding both, and one per family"),
    pytest.param(("primary",), ("192.168.0.2", "fd00:1::2"), TWO_NETWORKS,
                 ("192.168.0.2",), ("fd00:1::2",), id="primary: the node IPs only"),
    pytest.param(("primary",), ("10.250.0.1",), TWO_NETWORKS, (), None,
                 id="primary, the node IP on no interface: none (its /32 matched)"),
    pytest.param(("primary", "192.168.1.0/24"), ("192.168.0.2",), TWO_NETWORKS,
                 ("192.168.0.2", "192.168.1.2"), None, id="primary and a CIDR"),
    pytest.param(("10.0.0.0/8",), ("192.168.0.2",), TWO_NETWORKS, (), None,
                 id="a CIDR selecting no address: NodePorts on none"),
    pytest.param(("0.0.0.0/0", "192.168.1.0/24"), ("192.168.0.2",), TWO_NETWORKS, None, None,
                 id="0.0.0.0/0: every local address"),
    pytest.param((), ("192.168.0.2",), TWO_NETWORKS, None, None,
                 id="empty: every local address"),
    pytest.param(("127.0.0.0/8", "192.168.1.0/24"), ("192.168.0.2",),
                 ("127.0.0.1", *TWO_NETWORKS), ("192.168.1.2",), None,
                 id="loopback never, even when listed"),
    pytest.param(("192.168.0.0/16",), ("192.168.0.2",), ("192.168.1.2", "192.168.1.2"),
                 ("192.168.1.2",), None, id="each address once"),
])
def test_nodeport_addresses_select_local_addresses(
        entries: tuple[str, ...], node_ips: tuple[str, ...], local_ips: tuple[str, ...],
        v4: tuple[str, ...] | None, v6: tuple[str, ...] | None) -> None:
    """nodePortAddresses' CIDRs (`primary` being the node IP's /32 or /128) are matched
    against every address of the node's interfaces, as kube-proxy does; a family with no
    CIDR, or a catch-all one, is every local address (None)."""
    config = NodeConfig("node-a", node_ips=node_ips, nodeport_addresses=entries,
                        local_ips=local_ips)
    assert (config.nodeport_ips(IPFamily.IPv4), config.nodeport_ips(IPFamily.IPv6)) == (v4, v6)


def test_without_local_addresses_the_node_ips_stand_in() -> None:
    """Offline, not told the node's addresses, the node IPs are all it is known to have."""
    config = NodeConfig("node-a", node_ips=("192.168.0.2",),
                        nodeport_addresses=("192.168.0.0/16",))
    assert config.nodeport_ips(IPFamily.IPv4) == ("192.168.0.2",)


def test_node_config_keeps_only_the_nodeport_addresses() -> None:
    """An address no CIDR selects is not part of the node's configuration: its coming or
    going changes no rule, and must not make the daemon's next sync a full one. A family
    served on every local address keeps them all (a trace, conntrack cleanup)."""
    config = ProxyConfig(nodeport_addresses=("192.168.0.0/24", "192.168.1.0/24", "fd00::/8"))
    node = config.node_config("node-a", ("192.168.0.2",), (),
                              ("10.9.0.1", "192.168.0.2", "192.168.1.2", "fd00:1::2"))
    assert node.local_ips == ("192.168.0.2", "192.168.1.2", "fd00:1::2")
    assert node == config.node_config("node-a", ("192.168.0.2",), (),
                                      ("192.168.0.2", "172.17.0.1", "192.168.1.2", "fd00:1::2"))
    assert ProxyConfig().node_config("node-a", ("192.168.0.2",), (), TWO_NETWORKS).local_ips \
        == ("192.168.0.2", "fd00:1::2", "fd00:2::2")  # primary; IPv6: no node IP, every one
    assert ProxyConfig(nodeport_addresses=("all",)).node_config(
        "node-a", ("192.168.0.2",), (), ("127.0.0.1", *TWO_NETWORKS)).local_ips == TWO_NETWORKS


# --- offline: pyproxy render ---------------------------------------------------------------


def dual_stack_snapshot(tmp_path: Path) -> Path:
    def dual(svc: Obj) -> None:
        svc["spec"].update(type="NodePort", clusterIPs=["10.96.0.10", "fd00:96::a"],
                           ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack")
        svc["spec"]["ports"][0]["nodePort"] = 30080

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all([
        node_with(("InternalIP", "10.250.0.2"), ("InternalIP", "fd00:250::2")),
        make_service("ns", "web", dual)]))
    return path


def nodeport_ips(script: str, family: str) -> list[str]:
    prefix = f"add element {family} pyproxy nodeport-ips {{"
    return [line.removeprefix(prefix).rstrip("} ").strip() for line in script.splitlines()
            if line.startswith(prefix)]


def test_render_takes_both_families_from_the_node(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = str(dual_stack_snapshot(tmp_path))
    assert main(["render", "-f", snapshot, "--node", "node-a", "--node-ip", "10.250.0.1"]) == 0
    script = capsys.readouterr().out
    assert "add table ip6 pyproxy" in script
    # --node-ip replaced the Node's IPv4 address only; IPv6 is the Node's
    assert nodeport_ips(script, "ip") == ["10.250.0.1"]
    assert nodeport_ips(script, "ip6") == ["fd00:250::2"]
    assert main(["render", "-f", snapshot, "--node", "node-a"]) == 0
    script = capsys.readouterr().out
    assert nodeport_ips(script, "ip") == ["10.250.0.2"]
    assert nodeport_ips(script, "ip6") == ["fd00:250::2"]


def test_render_and_trace_take_the_nodes_other_addresses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--node-address states the node's other interface addresses: --nodeport-addresses
    CIDRs select among them and the node's IPs, as `run` does among the kernel's."""
    snapshot = str(dual_stack_snapshot(tmp_path))
    node = ["--node", "node-a", "--node-ip", "192.168.0.2",
            "--nodeport-addresses", "192.168.0.0/24,192.168.1.0/24"]
    assert main(["render", "-f", snapshot, *node, "--node-address", "192.168.1.2",
                 "--node-address", "10.9.0.1"]) == 0
    script = capsys.readouterr().out
    assert nodeport_ips(script, "ip") == ["192.168.0.2, 192.168.1.2"]
    assert main(["render", "-f", snapshot, *node]) == 0  # the node's IPs alone
    assert nodeport_ips(capsys.readouterr().out, "ip") == ["192.168.0.2"]

    trace = ["trace", "-f", snapshot, *node, "--src", "203.0.113.9",
             "--dst", "192.168.1.2:30080/tcp", "-o", "json"]
    assert main([*trace, "--node-address", "192.168.1.2"]) == 0
    answer = json.loads(capsys.readouterr().out)  # the NodePort (no endpoints: rejected)
    assert (answer["service"], answer["verdict"]) == ("ns/web:http", "REJECT")
    assert main(trace) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "NONE"  # not this node's

    assert main(["render", "-f", snapshot, "--node", "node-a",
                 "--node-address", "192.168.1.0/24"]) == 2
    assert "--node-address" in capsys.readouterr().err


# --- the daemon follows its Node -----------------------------------------------------------


class Daemon:
    """The daemon as `build_daemon` builds it (a snapshot source, not started), with fake
    libnftables instances that record each family's transactions and the proxier's requests
    for a sync counted."""

    def __init__(self, interface_ips: tuple[str, ...],
                 local_addresses: Callable[[], tuple[str, ...]] | None = None,
                 clock: FakeClock | None = None, **settings: Any) -> None:
        self.nfts: dict[IPFamily, FakeNft] = {}
        config = ProxyConfig(snapshot="unused.yaml", hostname_override="node-a",
                             min_sync_period=0.0, **settings)
        self.daemon = build_daemon(config, interface_ips=interface_ips, kernel=self.kernel,
                                   local_addresses=local_addresses,
                                   **({"clock": clock} if clock else {}))
        self.proxier = self.daemon.proxier
        self.health = self.daemon.health
        for source in ("Service", "EndpointSlice", "Node"):
            self.proxier.expect(source)

    @property
    def requested(self) -> bool:
        """The proxier has asked the runner for a sync that has not run yet."""
        return self.daemon.runner.schedule().requested

    def sync(self) -> None:
        """A sync as the runner runs it when asked (no minSyncPeriod here), else directly."""
        if not self.requested:
            self.proxier.sync()
            return
        stop = threading.Event()

        def once() -> bool:
            stop.set()
            return self.proxier.sync()

        self.daemon.runner.loop(once, stop)

    def kernel(self, family: IPFamily) -> FakeNft:
        self.nfts[family] = FakeNft()
        return self.nfts[family]


def test_daemon_takes_the_nodes_ip_before_the_first_sync_and_follows_a_change() -> None:
    daemon = Daemon(interface_ips=("192.168.50.1",))
    daemon.proxier.on_node(("", "node-a"), node_with(("InternalIP", "192.168.50.100")))
    daemon.proxier.on_service(("ns", "web"), make_service("ns", "web", lambda s: s["spec"].update(
        type="NodePort", ports=[{"name": "http", "port": 80, "nodePort": 30080}])))
    for source in ("Service", "EndpointSlice", "Node"):
        daemon.proxier.source_synced(source)
    assert daemon.requested
    daemon.sync()
    first = daemon.nfts[IPFamily.IPv4].last
    assert "nodeport-ips { 192.168.50.100 }" in first and "192.168.50.1 " not in first
    assert daemon.proxier.history[-1].cause is Cause.START

    # kubelet reports another address: the next sync is a full one with it
    assert not daemon.requested
    daemon.proxier.on_node(("", "node-a"), node_with(("InternalIP", "192.168.50.1")))
    assert daemon.requested
    daemon.sync()
    record = daemon.proxier.history[-1]
    assert record.full and record.cause is Cause.RECONFIGURED
    assert "nodeport-ips { 192.168.50.1 }" in daemon.nfts[IPFamily.IPv4].last
    assert daemon.proxier.node_ips == ("192.168.50.1",)
    # the health-check node ports follow the node's IPs
    servers = daemon.daemon.health_check_node_ports.servers
    assert servers is not None and servers.addresses == ("192.168.50.1",)

    # an unrelated Node update (a label) does not touch the configuration
    relabelled = node_with(("InternalIP", "192.168.50.1"))
    relabelled["metadata"]["labels"]["team"] = "a"
    daemon.proxier.on_node(("", "node-a"), relabelled)
    daemon.sync()
    assert daemon.proxier.history[-1].cause is not Cause.RECONFIGURED


def test_a_family_the_node_gains_gets_its_table() -> None:
    daemon = Daemon(interface_ips=("192.168.50.1",))
    daemon.proxier.on_node(("", "node-a"), node_with(("InternalIP", "192.168.50.1")))
    for source in ("Service", "EndpointSlice", "Node"):
        daemon.proxier.source_synced(source)
    daemon.sync()
    assert IPFamily.IPv6 not in daemon.nfts
    daemon.proxier.on_node(("", "node-a"), node_with(("InternalIP", "192.168.50.1"),
                                                     ("InternalIP", "fd00:50::1")))
    daemon.sync()
    assert [p.family for p in daemon.proxier.proxiers] == [IPFamily.IPv4, IPFamily.IPv6]
    assert daemon.proxier.history[-1].cause is Cause.RECONFIGURED  # not "after a failure"
    assert "add table ip6 pyproxy" in daemon.nfts[IPFamily.IPv6].last
    assert "nodeport-ips { fd00:50::1 }" in daemon.nfts[IPFamily.IPv6].last
    assert daemon.health.families == (IPFamily.IPv4, IPFamily.IPv6)
    assert daemon.proxier.families == (IPFamily.IPv4, IPFamily.IPv6)


# --- the daemon follows the node's local addresses -----------------------------------------


def test_local_addresses_are_read_again_after_the_interval() -> None:
    """Each read costs pyroute2 milliseconds: at most one per interval (syncPeriod); a read
    that fails keeps what was read before."""
    reads: list[tuple[str, ...] | Exception] = [("192.168.0.2",), ("192.168.0.2", "10.0.0.1"),
                                                OSError("netlink gone")]

    def read() -> tuple[str, ...]:
        item = reads.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    clock = FakeClock()
    addresses = LocalAddresses(read, 30.0, clock)
    assert addresses() == ("192.168.0.2",)
    clock.advance(29)
    assert addresses() == ("192.168.0.2",) and len(reads) == 2  # not read again yet
    clock.advance(1)
    assert addresses() == ("192.168.0.2", "10.0.0.1")
    clock.advance(30)
    assert addresses() == ("192.168.0.2", "10.0.0.1") and not reads


def test_daemon_serves_nodeports_on_a_local_address_that_comes_and_goes() -> None:
    """nodePortAddresses of two networks: an address of the second network on the node's
    interfaces gets NodePorts with the next read of the addresses (a full sync, as a change
    of the node's IPs makes), and so do the health-check node ports and the NodePort
    conntrack cleanup; an address no CIDR selects changes nothing."""
    local = ["192.168.0.2"]
    clock = FakeClock()
    daemon = Daemon(("192.168.0.2",), lambda: tuple(local), clock,
                    nodeport_addresses=("192.168.0.0/24", "192.168.1.0/24"))
    daemon.proxier.on_node(("", "node-a"), node_with(("InternalIP", "192.168.0.2")))
    for source in ("Service", "EndpointSlice", "Node"):
        daemon.proxier.source_synced(source)
    daemon.sync()
    assert "nodeport-ips { 192.168.0.2 }" in daemon.nfts[IPFamily.IPv4].last

    local.append("192.168.1.2")
    daemon.sync()  # within syncPeriod of the last read: not seen yet
    assert daemon.proxier.history[-1].cause is not Cause.RECONFIGURED
    clock.advance(30)
    daemon.sync()
    record = daemon.proxier.history[-1]
    assert record.full and record.cause is Cause.RECONFIGURED
    assert "nodeport-ips { 192.168.0.2, 192.168.1.2 }" in daemon.nfts[IPFamily.IPv4].last
    assert daemon.proxier.node_addresses == ("192.168.0.2", "192.168.1.2")  # conntrack's
    servers = daemon.daemon.health_check_node_ports.servers
    assert servers is not None and servers.addresses == ("192.168.0.2", "192.168.1.2")

    local.append("172.17.0.1")  # a bridge coming up: outside the CIDRs
    clock.advance(30)
    daemon.sync()
    assert daemon.proxier.history[-1].cause is not Cause.RECONFIGURED

    local.remove("192.168.1.2")
    clock.advance(30)
    daemon.sync()
    assert daemon.proxier.history[-1].cause is Cause.RECONFIGURED
    assert "nodeport-ips { 192.168.0.2 }" in daemon.nfts[IPFamily.IPv4].last


@pytest.mark.parametrize(("entries", "expected"), [
    pytest.param(("primary",), ("192.168.0.2", "fd00:1::2"), id="primary: the node IPs"),
    pytest.param(("192.168.0.0/16",), ("192.168.0.2", "192.168.1.2", "fd00:1::2"),
                 id="selected addresses; a family served everywhere: its node IP"),
    pytest.param(("all",), ("192.168.0.2", "fd00:1::2"), id="all: the node IPs"),
])
def test_health_check_node_ports_listen_where_nodeports_are_served(
        entries: tuple[str, ...], expected: tuple[str, ...]) -> None:
    """kube-proxy's service health server listens on the addresses nodePortAddresses
    selects."""
    node = ProxyConfig(nodeport_addresses=entries).node_config(
        "node-a", ("192.168.0.2", "fd00:1::2"), (), TWO_NETWORKS)
    assert node.health_check_addresses() == expected


# --- an address that does not parse: passed over, with a warning saying where NodePorts are --


def bad_internal_ip(*more: tuple[str, str]) -> Obj:
    return node_with(("InternalIP", "10.0.0.300"), *more)


def nodeport_snapshot(tmp_path: Path, node: Obj) -> str:
    service = make_service("ns", "web", lambda s: s["spec"].update(
        type="NodePort", ports=[{"name": "http", "port": 80, "nodePort": 30080}]))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all([node, service]))
    return str(path)


WARNING = ("Node node-a: InternalIP '10.0.0.300' is not an IP address: passed over, as "
           "kube-proxy does; NodePorts are served on {} instead")


class TestAnAddressThatDoesNotParse:
    def test_kept_beside_the_ones_used(self) -> None:
        """The Node keeps it (as written, cut at 64 characters) beside the IPs it uses."""
        node = converted(bad_internal_ip(("ExternalIP", "203.0.113.7"),
                                         ("InternalIP", "x" * 100), ("Hostname", "nope")))
        assert node.host_ips == ("203.0.113.7",)
        assert node.unusable_addresses == ("InternalIP '10.0.0.300'", f"InternalIP '{'x' * 64}'")

    @pytest.mark.parametrize(("more", "flags", "served"), [
        pytest.param([("ExternalIP", "203.0.113.7")], [], "203.0.113.7", id="the ExternalIP"),
        pytest.param([], ["--node-ip=192.0.2.5"], "192.0.2.5", id="--node-ip"),
        pytest.param([], [], "every local address", id="no other address"),
        pytest.param([("InternalIP", "fd00:250::1")], [], "fd00:250::1", id="the other family"),
    ])
    def test_offline_commands_warn(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   more: list[tuple[str, str]], flags: list[str],
                                   served: str) -> None:
        """render, apply and trace -f say on stderr which address the NodePorts are on
        instead (kube-proxy passes it over without a word)."""
        snapshot = nodeport_snapshot(tmp_path, bad_internal_ip(*more))
        assert main(["render", "-f", snapshot, "--node", "node-a", *flags]) == 0
        err = capsys.readouterr().err
        assert f"pyproxy: warning: {WARNING.format(served)}\n" == err

    def test_explain_warns(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """explain -f lists it with its warnings."""
        snapshot = nodeport_snapshot(tmp_path, bad_internal_ip(("ExternalIP", "203.0.113.7")))
        assert main(["explain", "-f", snapshot, "--node", "node-a"]) == 0
        assert f"warning: {WARNING.format('203.0.113.7')}" in capsys.readouterr().out

    def test_the_daemon_logs_it_when_it_changes(self) -> None:
        """The daemon logs node_address_passed_over with where NodePorts are served instead,
        once, not at every sync."""
        daemon = Daemon(interface_ips=("192.168.50.1",))
        daemon.proxier.on_node(("", "node-a"), bad_internal_ip())
        for source in ("Service", "EndpointSlice", "Node"):
            daemon.proxier.source_synced(source)
        with capture_logs() as logs:
            daemon.proxier.sync()
            daemon.proxier.sync()
        passed_over = [e for e in logs if e["event"] == "node_address_passed_over"]
        assert passed_over == [{
            "event": "node_address_passed_over", "log_level": "warning", "node": "node-a",
            "address": "InternalIP '10.0.0.300'", "nodeports_served": "192.168.50.1"}]
        daemon.proxier.on_node(("", "node-a"), node_with(("InternalIP", "192.168.50.1")))
        with capture_logs() as logs:
            daemon.proxier.sync()
        assert not [e for e in logs if e["event"] == "node_address_passed_over"]
