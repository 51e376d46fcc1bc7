"""NodePorts on every address `nodePortAddresses` selects (issue 35, point 6), with real
packets in throwaway network namespaces (testkit/netlab.py): `pyproxy run` matches the CIDRs
against every address of the node's interfaces, as kube-proxy does, and follows an address
that comes or goes.

The node has two networks: the standard topology's (192.168.50.1/24, its Node's InternalIP,
the client 192.168.50.2) and a second one (192.168.51.1/24, a second client 192.168.51.2).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, Lab, Netns, tally
from testkit.waits import eventually

pytestmark = [pytest.mark.netns, requires_netns]

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
NODEPORT = 30080
SECOND_NODE_IP = "192.168.51.1"  # the node's address on the second network
SECOND_CLIENT_IP = "192.168.51.2"
BACKENDS = {"pod-a", "pod-b"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=2)


@pytest.fixture(scope="module")
def second_client(cluster: Cluster) -> Netns:
    """A client on the node's second network (its address there: SECOND_NODE_IP)."""
    client = cluster.lab.add_ns("client2")
    cluster.lab.link(client, cluster.node, [f"{SECOND_CLIENT_IP}/24"], [f"{SECOND_NODE_IP}/24"],
                     if_a="eth0", if_b="eth1")
    cluster.lab.add_route(client, "default", via=SECOND_NODE_IP)
    return client


def snapshot_objects(cluster: Cluster) -> list[dict[str, Any]]:
    node = make_node("node-a", "zone-1")
    node["status"] = {"addresses": [{"type": "InternalIP", "address": cluster.node_ip4}]}

    def node_port(svc: dict[str, Any]) -> None:
        svc["spec"]["type"] = "NodePort"
        svc["spec"]["ports"][0]["nodePort"] = NODEPORT

    return [node, make_service("ns", "web", node_port),
            make_slice("ns", "web", [ep(pod.ip4, "node-b") for pod in cluster.pods.values()])]


def answers(cluster: Cluster, client: Netns | str, address: str) -> set[str]:
    return set(tally(cluster.lab.connect(client, address, NODEPORT, count=6, parallel=3,
                                         timeout=1.0)))


def run_pyproxy(cluster: Cluster, tmp_path: Path, *flags: str) -> Any:
    snapshot = tmp_path / "cluster.yaml"
    snapshot.write_text(yaml.safe_dump_all(snapshot_objects(cluster)))
    argv = DaemonArgs(snapshot=snapshot, cluster_cidr=cluster.cluster_cidr4, sync_period="2s",
                      healthz="", metrics="", extra=flags).argv()
    return cluster.lab.popen(cluster.node, argv,
                             log_name=f"pyproxy-{os.path.basename(tmp_path)}.log")


def stop(cluster: Cluster, daemon: Any) -> None:
    cluster.lab.stop_process(daemon)
    for family in ("ip", "ip6"):
        cluster.node.run(["nft", "delete", "table", family, "pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


def test_nodeports_on_the_addresses_of_both_networks(cluster: Cluster, second_client: Netns,
                                                     tmp_path: Path) -> None:
    """The issue's node: CIDRs of both networks give NodePorts on the node's address in each
    (kube-proxy's "multiple nodeport-addresses"); an address the daemon finds later on an
    interface, inside a CIDR, gets them within syncPeriod, and loses them when removed; one
    outside every CIDR never does."""
    daemon = run_pyproxy(cluster, tmp_path, "--nodeport-addresses",
                         "192.168.50.0/24,192.168.51.0/24")
    added = "192.168.51.100"
    outside = "192.168.52.1"
    try:
        eventually(lambda: answers(cluster, second_client, SECOND_NODE_IP) <= BACKENDS,
                   "NodePort on the second network's address")
        assert answers(cluster, cluster.client, cluster.node_ip4) <= BACKENDS

        cluster.lab.add_addr(cluster.node, "eth1", f"{added}/24")
        cluster.lab.add_addr(cluster.node, "eth1", f"{outside}/24")
        eventually(lambda: answers(cluster, second_client, added) <= BACKENDS,
                   "NodePort on an address added while running")
        assert answers(cluster, second_client, outside) == {"refused"}

        cluster.lab.ip(cluster.node, "addr", "del", f"{added}/24", "dev", "eth1")
        cluster.lab.add_addr(cluster.node, "eth0", f"{added}/32")  # back, on eth0, as a /32
        eventually(lambda: answers(cluster, cluster.client, added) <= BACKENDS,
                   "NodePort on the address moved to another interface")
        cluster.lab.ip(cluster.node, "addr", "del", f"{added}/32", "dev", "eth0")
        assert daemon.poll() is None
    finally:
        for address, dev in ((f"{outside}/24", "eth1"), (f"{added}/24", "eth1"),
                             (f"{added}/32", "eth0")):
            cluster.node.run(["ip", "addr", "del", address, "dev", dev], check=False)
        stop(cluster, daemon)


def test_primary_serves_the_node_ip_only(cluster: Cluster, second_client: Netns,
                                         tmp_path: Path) -> None:
    """nodePortAddresses [primary] (the default): the Node's InternalIP only; the second
    network's address refuses the NodePort, as kube-proxy's."""
    daemon = run_pyproxy(cluster, tmp_path)
    try:
        eventually(lambda: answers(cluster, cluster.client, cluster.node_ip4) <= BACKENDS,
                   "NodePort on the Node's InternalIP")
        assert answers(cluster, second_client, SECOND_NODE_IP) == {"refused"}
        assert daemon.poll() is None
    finally:
        stop(cluster, daemon)
