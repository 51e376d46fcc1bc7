"""Upstream parity (issue 12) with real packets, in throwaway network namespaces
(tests/netlab.py): what kube-proxy accepts and programs, pyproxy programs too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from builders import ep, make_node, make_service, make_slice
from netlab import Cluster, Lab, requires_netns, tally
from nftns import NodeProxy

from pyproxy.model import IPFamily
from pyproxy.proxier import NodeConfig

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
