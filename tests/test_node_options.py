"""One meaning per flag (issue 27, point 3): `render`, `apply` and offline `trace` take `run`'s
node options, with the same names and values, and --config; what `run` refuses they refuse.

The node: node-a, dual-stack (192.168.1.2, fd00::2 in its status.addresses), podCIDRs
10.244.1.0/24 and fd00:244:1::/64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from pyproxy.cli import build_parser, main
from pyproxy.cli.common import node_config as _node_config
from pyproxy.cluster.snapshot import load_snapshot
from pyproxy.config import from_args
from pyproxy.core.model import LocalMode
from pyproxy.core.nodeconfig import NodeConfig
from testkit.builders import ep, make_node, make_service, make_slice

OFFLINE = ("render", "apply", "trace")
NODE_IPS = ("192.168.1.2", "fd00::2")
POD_CIDRS = ("10.244.1.0/24", "fd00:244:1::/64")


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    saved = structlog.get_config()
    yield None
    structlog.configure(**saved)


@pytest.fixture(name="snapshot")
def snapshot_fixture(tmp_path: Path) -> Path:
    node: dict[str, Any] = make_node("node-a", "zone-1")
    node["spec"] = {"podCIDRs": list(POD_CIDRS)}
    node["status"] = {"addresses": [{"type": "InternalIP", "address": ip} for ip in NODE_IPS]}
    service = make_service("demo", "web", ip="10.96.0.10")
    service["spec"].update(clusterIPs=["10.96.0.10", "fd00:96::10"],
                           ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all([
        node, service, make_slice("demo", "web", [ep("10.244.1.5", "node-a")])]))
    return path


def offline_argv(command: str, snapshot: Path, *flags: str) -> list[str]:
    extra = ["--src=10.244.1.9", "--dst=10.96.0.10:80/tcp"] if command == "trace" else []
    return [command, "-f", str(snapshot), *extra, *flags]


def offline_config(command: str, snapshot: Path, *flags: str) -> NodeConfig:
    args = build_parser().parse_args(offline_argv(command, snapshot, *flags))
    return _node_config(args, load_snapshot(str(snapshot)))


def run_config(*flags: str) -> NodeConfig:
    """What `pyproxy run` with these flags programs on node-a once its Node is known."""
    config = from_args(build_parser().parse_args(["run", *flags]))
    return config.node_config(config.node_name(), NODE_IPS, POD_CIDRS)


SAME_AS_RUN = [
    pytest.param(["--nodeport-addresses=all"], id="nodeport-addresses all"),
    pytest.param(["--nodeport-addresses=192.168.1.0/24,primary"], id="nodeport CIDR and primary"),
    pytest.param(["--cluster-cidr=10.244.0.0/16,fd00:244::/48"], id="cluster-cidr"),
    pytest.param(["--detect-local-mode=NodeCIDR"], id="NodeCIDR: the Node's podCIDRs"),
    pytest.param(["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"],
                 id="BridgeInterface"),
    pytest.param(["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=cali"],
                 id="InterfaceNamePrefix"),
    pytest.param(["--masquerade-all"], id="masquerade-all"),
    pytest.param(["--masquerade-all=false"], id="masquerade-all=false"),
    pytest.param(["--iptables-masquerade-bit=3"], id="masquerade bit"),
    pytest.param(["--bind-address=fd00::2"], id="bind-address makes its family primary"),
]


@pytest.mark.parametrize("command", OFFLINE)
@pytest.mark.parametrize("flags", SAME_AS_RUN)
def test_node_options_mean_what_they_mean_for_run(command: str, flags: list[str],
                                                  snapshot: Path) -> None:
    expected = run_config("--hostname-override=node-a", *flags)
    assert offline_config(command, snapshot, "--node=node-a", *flags) == expected
    assert offline_config(command, snapshot, "--hostname-override=node-a", *flags) == expected


@pytest.mark.parametrize("command", OFFLINE)
def test_config_file(command: str, snapshot: Path, tmp_path: Path) -> None:
    """--config: the node settings of a KubeProxyConfiguration, flags over it, as for run."""
    config = tmp_path / "config.conf"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
                      "kind: KubeProxyConfiguration\nmode: nftables\nhostnameOverride: node-a\n"
                      "clusterCIDR: 10.244.0.0/16\nnftables: {masqueradeBit: 5}\n"
                      "detectLocalMode: BridgeInterface\n"
                      "detectLocal: {bridgeInterface: cni0}\n")
    flags = (f"--config={config}", "--pod-bridge-interface=br0")
    got = offline_config(command, snapshot, *flags)
    assert got == run_config(*flags)
    assert (got.node_name, got.masquerade_bit, got.local_mode, got.local_interface) == \
        ("node-a", 5, LocalMode.BRIDGE_INTERFACE, "br0")


REFUSED = [
    pytest.param(["--detect-local-mode=BridgeInterface"], "detectLocalMode is BridgeInterface "
                 "but detectLocal.bridgeInterface (--pod-bridge-interface) is empty",
                 id="BridgeInterface without a bridge"),
    pytest.param(["--detect-local-mode=InterfaceNamePrefix"], "detectLocalMode is "
                 "InterfaceNamePrefix but detectLocal.interfaceNamePrefix "
                 "(--pod-interface-name-prefix) is empty", id="InterfaceNamePrefix without one"),
    pytest.param(["--nodeport-addresses=192.168.1.2"], "--nodeport-addresses: '192.168.1.2' is "
                 "neither a CIDR nor one of primary, localhost, all", id="a bare IP"),
    pytest.param(["--node-ip=192.168.1.9", "--node-ip=192.168.1.8"], "--node-ip: two IPv4 "
                 "addresses (192.168.1.9, 192.168.1.8): give at most one per family",
                 id="a second --node-ip of one family"),
    pytest.param(["--node-ip=node-a"], "--node-ip: 'node-a' is not an IP address",
                 id="--node-ip not an IP"),
]


@pytest.mark.parametrize("command", OFFLINE)
@pytest.mark.parametrize(("flags", "message"), REFUSED)
def test_refused_everywhere(command: str, flags: list[str], message: str, snapshot: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Exit code 2 and one line naming the setting or flag, in every command."""
    assert main(offline_argv(command, snapshot, "--node=node-a", *flags)) == 2
    assert capsys.readouterr().err == f"pyproxy: {message}\n"


@pytest.mark.parametrize("command", OFFLINE)
def test_a_node_is_needed(command: str, snapshot: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(offline_argv(command, snapshot)) == 2
    assert capsys.readouterr().err == (f"pyproxy: {command} needs --node (or "
                                       "--hostname-override, or hostnameOverride in --config)\n")


@pytest.mark.parametrize("command", OFFLINE)
def test_one_family_node_ip_keeps_the_nodes_other_family(command: str, snapshot: Path) -> None:
    """--node-ip of one family replaces the Node's address of that family only: both tables
    are still rendered."""
    got = offline_config(command, snapshot, "--node=node-a", "--node-ip=192.168.1.9")
    assert got.node_ips == ("192.168.1.9", "fd00::2")


def test_render_nodeport_addresses_all(snapshot: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`all`, as run takes it, renders NodePorts on every local address (`fib daddr type
    local`) instead of the primary IPs' set."""
    primary = "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"
    every = "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap " \
            "@service-nodeports"
    assert main(["render", "-f", str(snapshot), "--node=node-a"]) == 0
    assert primary in capsys.readouterr().out
    assert main(["render", "-f", str(snapshot), "--node=node-a",
                 "--nodeport-addresses=all"]) == 0
    script = capsys.readouterr().out
    assert every in script and primary not in script
