"""Upstream parity (issue 12) with real packets, in throwaway network namespaces
(testkit/netlab.py): what kube-proxy accepts and programs, pyproxy programs too."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.nftns import NodeProxy
from testkit.waits import eventually

pytestmark = [pytest.mark.netns, requires_netns]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=2)


def cleanup_tables(cluster: Cluster) -> None:
    for family in ("ip", "ip6"):
        cluster.node.run(["nft", "delete", "table", family, "pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


def zero_padded(ip: str) -> str:
    """10.244.1.2 as a legacy object may hold it: 010.244.001.002."""
    return ".".join(f"{int(octet):03d}" for octet in ip.split("."))


def test_addresses_written_with_leading_zeros_carry_traffic(cluster: Cluster) -> None:
    """A Service and an EndpointSlice stored before the API refused leading zeros: kube-proxy
    reads them (decimal) and programs them; so must pyproxy."""
    config = NodeConfig("node-a", node_ips=(cluster.node_ip4,),
                        cluster_cidrs=(cluster.cluster_cidr4,))
    proxy = NodeProxy(cluster.node.full, config, families=(IPFamily.IPv4,))
    legacy_service = make_service("ns", "legacy", ip="10.96.0.010")
    legacy_slice = make_slice("ns", "legacy", [ep(zero_padded(pod.ip4), "node-b")
                                               for pod in cluster.pods.values()])
    try:
        proxy.apply([make_node("node-a"), legacy_service, legacy_slice])
        results = cluster.lab.connect(cluster.client, "10.96.0.10", 80, count=20, parallel=5)
        assert set(tally(results)) == {"pod-a", "pod-b"}, tally(results)
    finally:
        cleanup_tables(cluster)


# --- B: the node's IPs come from its Node object ---------------------------------------------

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
NODEPORT = 30080
SECOND_IP = "192.168.50.100"  # a secondary address of the node: never the interface's primary


def node_port_cluster(cluster: Cluster, internal_ip: str) -> list[dict[str, Any]]:
    node = make_node("node-a", "zone-1")
    node["status"] = {"addresses": [{"type": "Hostname", "address": "node-a"},
                                    {"type": "InternalIP", "address": internal_ip}]}

    def node_port(svc: dict[str, Any]) -> None:
        svc["spec"]["type"] = "NodePort"
        svc["spec"]["ports"][0]["nodePort"] = NODEPORT

    return [node, make_service("ns", "web", node_port),
            make_slice("ns", "web", [ep(pod.ip4, "node-b") for pod in cluster.pods.values()])]


def write_snapshot(path: Path, objects: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(objects))
    os.replace(tmp, path)


def node_port_answers(cluster: Cluster, address: str) -> set[str]:
    return set(tally(cluster.lab.connect(cluster.client, address, NODEPORT, count=6, parallel=3,
                                         timeout=1.0)))


def test_nodeports_listen_on_the_ip_the_node_object_names(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    """`pyproxy run` without --bind-address: the Node's InternalIP decides where NodePorts
    are served (nodePortAddresses [primary]), not the interface's primary address; when the
    Node reports another address the daemon follows it."""
    cluster.lab.add_addr(cluster.node, "eth0", f"{SECOND_IP}/24")
    snapshot = tmp_path / "cluster.yaml"
    write_snapshot(snapshot, node_port_cluster(cluster, SECOND_IP))
    daemon = cluster.lab.popen(cluster.node, [
        *DaemonArgs(snapshot=snapshot, cluster_cidr=cluster.cluster_cidr4).argv()],
        log_name="pyproxy-node-ip.log")
    backends = {"pod-a", "pod-b"}
    try:
        eventually(lambda: node_port_answers(cluster, SECOND_IP) <= backends,
                   "NodePort on the Node's InternalIP")
        # the interface's primary address is no NodePort address: nothing listens there
        assert node_port_answers(cluster, cluster.node_ip4) == {"refused"}

        write_snapshot(snapshot, node_port_cluster(cluster, cluster.node_ip4))
        eventually(lambda: node_port_answers(cluster, cluster.node_ip4) <= backends,
                   "NodePort on the Node's new InternalIP")
        assert node_port_answers(cluster, SECOND_IP) == {"refused"}
        assert daemon.poll() is None
    finally:
        cluster.lab.stop_process(daemon)
        cleanup_tables(cluster)


# --- C: conntrack sysctls and the OOM score, set by `pyproxy run` in its own namespace --------

NETFILTER = Path("/proc/sys/net/netfilter")
PER_NAMESPACE = {  # what the flags below ask for
    "nf_conntrack_tcp_timeout_established": 7200, "nf_conntrack_tcp_timeout_close_wait": 90,
    "nf_conntrack_tcp_be_liberal": 1, "nf_conntrack_udp_timeout": 45,
    "nf_conntrack_udp_timeout_stream": 150,
}


def sysctls_in(cluster: Cluster, ns: Any, names: list[str]) -> dict[str, int]:
    out = cluster.lab.run(ns, ["cat", *(str(NETFILTER / name) for name in names)]).stdout
    return dict(zip(names, map(int, out.split()), strict=True))


def test_conntrack_sysctls_are_written_in_the_daemons_namespace(cluster: Cluster,
                                                               tmp_path: Path) -> None:
    """The per-namespace conntrack sysctls take the configured values inside the daemon's
    namespace only; nf_conntrack_max (and the hash size) are global, read-only there: left
    alone and reported."""
    lab = cluster.lab
    ns = lab.add_ns("conntrack")
    names = [*PER_NAMESPACE, "nf_conntrack_max"]
    # Only read here: the root namespace's values must come out of this unchanged.
    root_before = {name: int((NETFILTER / name).read_text()) for name in names}
    assert sysctls_in(cluster, ns, list(PER_NAMESPACE)) != PER_NAMESPACE
    snapshot = tmp_path / "cluster.yaml"
    write_snapshot(snapshot, [make_node("node-a", "zone-1")])
    # The OOM score is raised: lowering it needs CAP_SYS_RESOURCE, which a test runner may lack.
    daemon = lab.popen(ns, [
        *DaemonArgs(snapshot=snapshot, min_sync_period=None, sync_period=None, healthz="",
                    metrics="", extra=(
                        "--conntrack-tcp-timeout-established", "2h",
                        "--conntrack-tcp-timeout-close-wait", "90s", "--conntrack-tcp-be-liberal",
                        "--conntrack-udp-timeout", "45s", "--conntrack-udp-timeout-stream",
                        "2m30s", "--conntrack-min", str(root_before["nf_conntrack_max"] + 4096),
                        "--oom-score-adj", "500")).argv()],
        log_name="pyproxy-conntrack.log")
    try:
        eventually(lambda: sysctls_in(cluster, ns, list(PER_NAMESPACE)) == PER_NAMESPACE,
                   "conntrack sysctls in the daemon's namespace")
        log = (lab.workdir / "pyproxy-conntrack.log").read_text()
        assert Path(f"/proc/{daemon.pid}/oom_score_adj").read_text().strip() == "500", log
        assert any("event=host_setting_skipped" in line and "setting=nf_conntrack_max" in line
                   for line in log.splitlines()), log
        assert daemon.poll() is None
    finally:
        lab.stop_process(daemon)
        lab.del_ns(ns)
    assert {name: int((NETFILTER / name).read_text()) for name in names} == root_before
