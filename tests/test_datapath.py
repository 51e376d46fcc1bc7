"""Real packets through the rules pyproxy programs, in throwaway network namespaces.

Topology (testkit/netlab.py): an external client and pods, each linked to the node namespace,
where pyproxy programs nftables. The node is `node-a`; endpoints "on node-a" are local.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from ipaddress import ip_address
from typing import Any

import pytest

from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.kernel.libnftables import NftError
from pyproxy.render.objects import Fragment, Item, Kind, rule
from testkit.builders import ep, make_node, make_service, make_service_cidr, make_slice
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.nftns import NodeProxy

pytestmark = [pytest.mark.netns, requires_netns]

VIP = "10.96.0.10"
VIP6 = "fd00:96::10"
EXTERNAL_IP = "192.0.2.10"
LB_IP = "198.51.100.10"
NODEPORT = 30080
N = 40  # connections per distribution check: P(a backend gets < 5 of 40) ≈ 1e-7


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=3)


@pytest.fixture
def proxy(cluster: Cluster) -> Iterator[NodeProxy]:
    config = NodeConfig(
        "node-a", node_ips=(cluster.node_ip4, cluster.node_ip6),
        cluster_cidrs=(cluster.cluster_cidr4, cluster.cluster_cidr6))
    node = NodeProxy(cluster.node.full, config)
    yield node
    cluster.node.run(["nft", "delete table ip pyproxy"], check=False)
    cluster.node.run(["nft", "delete table ip6 pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


NODES = [make_node("node-a", "zone-1"), make_node("node-b", "zone-1"),
         make_node("node-c", "zone-2")]
# pod-a runs on this node, pod-b on node-b (same zone), pod-c on node-c (other zone)
WHERE = {"pod-a": ("node-a", "zone-1"), "pod-b": ("node-b", "zone-1"),
         "pod-c": ("node-c", "zone-2")}


def pod_ep(cluster: Cluster, pod: str, v6: bool = False, **kw: Any) -> dict[str, Any]:
    node, zone = WHERE[pod]
    p = cluster.pods[pod]
    return ep(p.ip6 if v6 else p.ip4, node, zone, **kw)


def service(tweak: Callable[[dict[str, Any]], None] | None = None, name: str = "web",
            ip: str = VIP) -> dict[str, Any]:
    def both(svc: dict[str, Any]) -> None:
        svc["spec"]["ports"] = [
            {"name": "http", "port": 80, "protocol": "TCP", "nodePort": NODEPORT},
            {"name": "dns", "port": 53, "protocol": "UDP"}]
        if tweak:
            tweak(svc)

    return make_service("ns", name, both, ip=ip)


def endpoints(cluster: Cluster, pods: list[str], name: str = "web", v6: bool = False,
              **kw: Any) -> dict[str, Any]:
    def ports(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": 8080, "protocol": "TCP"},
                      {"name": "dns", "port": 5353, "protocol": "UDP"}]

    return make_slice("ns", name, [pod_ep(cluster, p, v6, **kw) for p in pods], ports,
                      family="IPv6" if v6 else "IPv4")


def spec(**kw: Any) -> Callable[[dict[str, Any]], None]:
    return lambda svc: svc["spec"].update(kw)


# --- ClusterIP ---------------------------------------------------------------------------------


def test_cluster_ip_spreads_and_masquerades_by_source(cluster: Cluster,
                                                      proxy: NodeProxy) -> None:
    proxy.apply([*NODES, service(), endpoints(cluster, ["pod-a", "pod-b", "pod-c"])])
    results = cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8)
    counts = tally(results)
    assert set(counts) == {"pod-a", "pod-b", "pod-c"} and min(counts.values()) >= 3, counts
    # the client is outside the cluster CIDR: masqueraded to the node's address on the pod link
    for r in results:
        assert r.seen_ip == cluster.pods[str(r.name)].gw4
    # a pod's traffic keeps its address
    results = cluster.lab.connect(cluster.pod_client.ns, VIP, 80, count=10, parallel=5)
    assert {r.seen_ip for r in results} == {cluster.pod_client.ip4}
    # the node itself (output hook) reaches the service too
    assert all(r.ok for r in cluster.lab.connect(cluster.node, VIP, 80, count=5))


def test_udp_and_target_ports(cluster: Cluster, proxy: NodeProxy) -> None:
    proxy.apply([*NODES, service(), endpoints(cluster, ["pod-a", "pod-b"])])
    results = cluster.lab.connect(cluster.pod_client.ns, VIP, 53, proto="udp", count=N,
                                  parallel=8)
    counts = tally(results)
    assert set(counts) == {"pod-a", "pod-b"} and min(counts.values()) >= 5, counts


def test_no_endpoints_rejects_and_unknown_port_rejects(cluster: Cluster,
                                                        proxy: NodeProxy) -> None:
    proxy.apply([*NODES, service(), endpoints(cluster, [])])
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=3)) == {"refused": 3}
    assert tally(cluster.lab.connect(cluster.node, VIP, 80, count=2)) == {"refused": 2}
    assert tally(cluster.lab.connect(cluster.client, VIP, 53, proto="udp", count=2)) == {
        "refused": 2}
    assert tally(cluster.lab.connect(cluster.client, VIP, 81, count=2)) == {"refused": 2}


def test_internal_local_policy(cluster: Cluster, proxy: NodeProxy) -> None:
    svc = service(spec(internalTrafficPolicy="Local"))
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-a", "pod-b"])])
    assert tally(cluster.lab.connect(cluster.pod_client.ns, VIP, 80, count=10,
                                     parallel=5)) == {"pod-a": 10}
    # endpoints only elsewhere: dropped (timeout), not rejected
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-b"])])
    assert tally(cluster.lab.connect(cluster.pod_client.ns, VIP, 80, count=2,
                                     timeout=0.5)) == {"timeout": 2}


def test_terminating_fallback_and_topology_hints(cluster: Cluster, proxy: NodeProxy) -> None:
    proxy.apply([*NODES, service(), endpoints(cluster, ["pod-b", "pod-c"], ready=False,
                                              serving=True, terminating=True)])
    assert set(tally(cluster.lab.connect(cluster.client, VIP, 80, count=20, parallel=5))) == {
        "pod-b", "pod-c"}
    hinted = make_slice("ns", "web", [
        pod_ep(cluster, "pod-a", zones=["zone-1"]), pod_ep(cluster, "pod-b", zones=["zone-1"]),
        pod_ep(cluster, "pod-c", zones=["zone-2"])],
        lambda s: s.update(ports=[{"name": "http", "port": 8080}]))
    proxy.apply([*NODES, service(), hinted])
    counts = tally(cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8))
    assert set(counts) == {"pod-a", "pod-b"}, counts


def test_session_affinity_keeps_the_client_on_one_endpoint(cluster: Cluster,
                                                            proxy: NodeProxy) -> None:
    svc = service(spec(sessionAffinity="ClientIP",
                       sessionAffinityConfig={"clientIP": {"timeoutSeconds": 30}}))
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-a", "pod-b", "pod-c"])])
    counts = tally(cluster.lab.connect(cluster.client, VIP, 80, count=20))
    assert len(counts) == 1 and sum(counts.values()) == 20, counts
    counts = tally(cluster.lab.connect(cluster.pod_client.ns, VIP, 80, count=20))
    assert len(counts) == 1, counts


def test_session_affinity_timeout_counts_from_the_clients_last_connection(
        cluster: Cluster, proxy: NodeProxy) -> None:
    """As kube-proxy (its endpoint chain's `update @affinity-…`), every connection of a
    returning client renews its affinity element, so the timeout is the idle time allowed
    (upstream's e2e "session affinity timeout" tests); renewed only when an endpoint was
    picked, a busy client would be moved once the timeout had passed since its first one."""
    svc = service(spec(sessionAffinity="ClientIP",
                       sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}))
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-a", "pod-b", "pod-c"])])

    def remaining() -> float:
        """The seconds left to the client's affinity element (its one element)."""
        ruleset = cluster.node.run(["nft", "list", "table", "ip", "pyproxy"]).stdout
        left = re.findall(r"expires (?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?", ruleset)
        assert len(left) == 1, ruleset
        minutes, seconds, millis = (int(x or 0) for x in left[0])
        return minutes * 60 + seconds + millis / 1000

    assert len(tally(cluster.lab.connect(cluster.client, VIP, 80, count=1))) == 1
    time.sleep(2.5)  # let the element age measurably (nft prints it to the millisecond)
    aged = remaining()
    assert aged < 58.5, aged
    assert len(tally(cluster.lab.connect(cluster.client, VIP, 80, count=1))) == 1
    assert remaining() > aged + 1.5  # renewed by the returning client's connection


def test_hairpin_endpoint_reaches_itself(cluster: Cluster, proxy: NodeProxy) -> None:
    proxy.apply([*NODES, service(), endpoints(cluster, ["pod-a"])])
    results = cluster.lab.connect(cluster.pods["pod-a"].ns, VIP, 80, count=3)
    assert tally(results) == {"pod-a": 3}
    assert {r.seen_ip for r in results} == {cluster.pods["pod-a"].gw4}  # masqueraded


# --- NodePort, ExternalIP, LoadBalancer ------------------------------------------------------


def test_node_port_cluster_policy(cluster: Cluster, proxy: NodeProxy) -> None:
    proxy.apply([*NODES, service(spec(type="NodePort")), endpoints(cluster, ["pod-a", "pod-b"])])
    results = cluster.lab.connect(cluster.client, cluster.node_ip4, NODEPORT, count=N,
                                  parallel=8)
    assert set(tally(results)) == {"pod-a", "pod-b"}
    assert all(r.seen_ip == cluster.pods[str(r.name)].gw4 for r in results)  # masqueraded


def test_node_port_local_policy_preserves_client_ip(cluster: Cluster,
                                                    proxy: NodeProxy) -> None:
    svc = service(spec(type="NodePort", externalTrafficPolicy="Local"))
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-a", "pod-b"])])
    results = cluster.lab.connect(cluster.client, cluster.node_ip4, NODEPORT, count=10,
                                  parallel=5)
    assert tally(results) == {"pod-a": 10}
    assert {r.seen_ip for r in results} == {cluster.client_ip4}
    # no local endpoint: external traffic dropped, pods short-circuit to the cluster list
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-b"])])
    assert tally(cluster.lab.connect(cluster.client, cluster.node_ip4, NODEPORT, count=2,
                                     timeout=0.5)) == {"timeout": 2}
    assert tally(cluster.lab.connect(cluster.pod_client.ns, cluster.node_ip4, NODEPORT,
                                     count=3)) == {"pod-b": 3}


def test_external_ip_and_load_balancer_source_ranges(cluster: Cluster,
                                                     proxy: NodeProxy) -> None:
    def lb(allowed: str) -> Callable[[dict[str, Any]], None]:
        def apply(svc: dict[str, Any]) -> None:
            svc["spec"].update(type="LoadBalancer", externalIPs=[EXTERNAL_IP],
                               loadBalancerSourceRanges=[allowed])
            svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
        return apply

    proxy.apply([*NODES, service(lb("192.168.50.0/24")), endpoints(cluster, ["pod-a", "pod-b"])])
    assert set(tally(cluster.lab.connect(cluster.client, EXTERNAL_IP, 80, count=20,
                                         parallel=5))) == {"pod-a", "pod-b"}
    assert set(tally(cluster.lab.connect(cluster.client, LB_IP, 80, count=20,
                                         parallel=5))) == {"pod-a", "pod-b"}
    # the client is outside the allowed range: dropped at the LB IP; external IPs unaffected
    proxy.apply([*NODES, service(lb("203.0.113.0/24")), endpoints(cluster, ["pod-a", "pod-b"])])
    assert tally(cluster.lab.connect(cluster.client, LB_IP, 80, count=2, timeout=0.5)) == {
        "timeout": 2}
    assert all(r.ok for r in cluster.lab.connect(cluster.client, EXTERNAL_IP, 80, count=2))


def test_the_node_reaches_a_local_policy_external_address_without_local_endpoints(
        cluster: Cluster, proxy: NodeProxy) -> None:
    # eTP=Local, endpoints only on other nodes: the node's own connections (and hostNetwork
    # pods') to the LB IP or external IP go to a cluster endpoint, masqueraded, as upstream;
    # the drop this node has for those addresses is for traffic from outside.
    def lb(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local",
                           externalIPs=[EXTERNAL_IP])
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}

    proxy.apply([*NODES, service(lb), endpoints(cluster, ["pod-b", "pod-c"])])
    # Both addresses routed to pod-a (no endpoint; it answers port 80 with a reset): connect()
    # needs a route, and traffic from outside that were not dropped would be refused there.
    with cluster.answering_at("pod-a", LB_IP), cluster.answering_at("pod-a", EXTERNAL_IP):
        for address in (LB_IP, EXTERNAL_IP):
            # from the node's address (the route via pod-a would pick one in the pod CIDR,
            # which counts as a pod's and is short-circuited unmasqueraded, as upstream)
            results = cluster.lab.connect(cluster.node, address, 80, count=20, parallel=5,
                                          src=cluster.node_ip4)
            assert set(tally(results)) == {"pod-b", "pod-c"}, (address, tally(results))
            assert all(r.seen_ip == cluster.pods[str(r.name)].gw4 for r in results)
            assert tally(cluster.lab.connect(cluster.client, address, 80, count=2,
                                             timeout=0.5)) == {"timeout": 2}, address
        # pods are short-circuited to the cluster list too (already so before)
        assert set(tally(cluster.lab.connect(cluster.pod_client.ns, LB_IP, 80, count=10,
                                             parallel=5))) <= {"pod-b", "pod-c"}


# --- ServiceCIDRs ----------------------------------------------------------------------------

# In the standard topology's service CIDRs, and no Service's.
UNALLOCATED = "10.96.0.99"
UNALLOCATED6 = "fd00:96::99"


def test_unallocated_addresses_of_a_service_cidr_are_dropped(cluster: Cluster,
                                                             proxy: NodeProxy) -> None:
    objs = [*NODES, service(), endpoints(cluster, ["pod-a"])]
    cidrs = make_service_cidr("kubernetes", cluster.service_cidr4, cluster.service_cidr6)
    # pod-c answers at the unallocated addresses: forwarded traffic gets an answer
    with cluster.answering_at("pod-c", UNALLOCATED), \
            cluster.answering_at("pod-c", UNALLOCATED6):
        proxy.apply(objs)  # no ServiceCIDR known (an API server without them): forwarded
        assert tally(cluster.lab.connect(cluster.client, UNALLOCATED, 8080, count=2)) == {
            "pod-c": 2}
        proxy.apply([*objs, cidrs])
        for client in (cluster.client, cluster.pod_client.ns):
            for address in (UNALLOCATED, UNALLOCATED6):
                assert tally(cluster.lab.connect(client, address, 8080, count=2,
                                                 timeout=0.5)) == {"timeout": 2}, address
        # the node's own: dropped in the output hook (TCP retries its SYN: a timeout)
        assert tally(cluster.lab.connect(cluster.node, UNALLOCATED, 8080, count=2,
                                         timeout=0.5)) == {"timeout": 2}
        # allocated ClusterIPs work on, and their other ports are still rejected
        assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=3)) == {"pod-a": 3}
        assert tally(cluster.lab.connect(cluster.client, VIP, 81, count=2)) == {"refused": 2}
        proxy.apply(objs)  # the ServiceCIDR is gone: forwarded again
        assert tally(cluster.lab.connect(cluster.client, UNALLOCATED6, 8080, count=2)) == {
            "pod-c": 2}


# --- IPv6 ------------------------------------------------------------------------------------


def test_ipv6_dual_stack_service(cluster: Cluster, proxy: NodeProxy) -> None:
    svc = service(spec(clusterIPs=[VIP, VIP6], ipFamilies=["IPv4", "IPv6"]))
    proxy.apply([*NODES, svc, endpoints(cluster, ["pod-a"]),
                 endpoints(cluster, ["pod-b", "pod-c"], v6=True)])
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=5)) == {"pod-a": 5}
    results = cluster.lab.connect(cluster.pod_client.ns, VIP6, 80, count=N, parallel=8)
    assert set(tally(results)) == {"pod-b", "pod-c"}
    assert {ip_address(str(r.seen_ip)) for r in results} == {ip_address(cluster.pod_client.ip6)}
    assert set(tally(cluster.lab.connect(cluster.client, VIP6, 53, proto="udp",
                                         count=20, parallel=5))) == {"pod-b", "pod-c"}


# --- incremental changes and failures --------------------------------------------------------


def test_incremental_changes_are_followed(cluster: Cluster, proxy: NodeProxy) -> None:
    other = service(name="other", ip="10.96.0.11")
    objs = [*NODES, service(), endpoints(cluster, ["pod-a", "pod-b"]), other,
            endpoints(cluster, ["pod-c"], name="other")]
    first = proxy.apply(objs)
    assert first[0].full
    objs[4] = endpoints(cluster, ["pod-b"])  # web: pod-a leaves
    result = proxy.apply(objs)[0]
    assert not result.full and result.commands <= 12, result  # two ports change
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=10, parallel=5)) == {
        "pod-b": 10}
    objs[4] = endpoints(cluster, ["pod-a", "pod-b", "pod-c"])
    proxy.apply(objs)
    assert set(tally(cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8))) == {
        "pod-a", "pod-b", "pod-c"}
    del objs[3:5]  # the service goes away: its ClusterIP no longer answers
    proxy.apply(objs)
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=2, timeout=0.5)) == {
        "timeout": 2}
    assert tally(cluster.lab.connect(cluster.client, "10.96.0.11", 80, count=3)) == {"pod-c": 3}


def test_a_big_service_gets_an_endpoints_map_of_its_own(
        cluster: Cluster, proxy: NodeProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """From OWN_MAP_SLOTS slots on (lowered to 3 here) a service port's slots live in a map
    and a pick chain of its own; packets follow it there and back across the threshold,
    and nothing of it is left behind."""
    from pyproxy.render import services

    monkeypatch.setattr(services, "OWN_MAP_SLOTS", 3)
    objs = [*NODES, service(spec(type="NodePort")), endpoints(cluster, ["pod-a", "pod-b"])]
    proxy.apply(objs)
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8)).keys() == {
        "pod-a", "pod-b"}
    objs[-1] = endpoints(cluster, ["pod-a", "pod-b", "pod-c"])
    result = proxy.apply(objs)[0]
    assert not result.full
    def listing() -> str:
        return cluster.node.run(["nft", "list", "table", "ip", "pyproxy"]).stdout

    own = [line for line in listing().splitlines() if "endpoints-tcp-" in line
           and line.strip().startswith("map ")]
    assert len(own) == 2, listing()  # the ClusterIP's and the NodePort's
    counts = tally(cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8))
    assert counts.keys() == {"pod-a", "pod-b", "pod-c"}, counts
    counts = tally(cluster.lab.connect(cluster.client, cluster.node_ip4, NODEPORT, count=N,
                                       parallel=8))
    assert counts.keys() == {"pod-a", "pod-b", "pod-c"}, counts
    objs[-1] = endpoints(cluster, ["pod-b", "pod-c"])
    proxy.apply(objs)
    assert "endpoints-tcp-" not in listing()
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=N, parallel=8)).keys() == {
        "pod-b", "pod-c"}
    assert tally(cluster.lab.connect(cluster.client, cluster.node_ip4, NODEPORT, count=N,
                                     parallel=8)).keys() == {"pod-b", "pod-c"}


def test_failed_transaction_leaves_rules_intact(cluster: Cluster, proxy: NodeProxy) -> None:
    objs = [*NODES, service(), endpoints(cluster, ["pod-a"])]
    proxy.apply(objs)
    applier = proxy.proxiers[0].applier
    broken = Fragment((Item(Kind.CHAIN, "broken", "", (rule("this is not nft"),)),))
    with pytest.raises(NftError):
        applier.sync({"bad": broken})
    assert not applier.in_step
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=3)) == {"pod-a": 3}
    applier.sync({"bad": Fragment()})  # the next (full) sync repairs everything
    assert applier.in_step
    assert tally(cluster.lab.connect(cluster.client, VIP, 80, count=3)) == {"pod-a": 3}
