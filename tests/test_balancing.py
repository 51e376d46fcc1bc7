"""Balancing beyond random: round robin, source hashing, Maglev and weights — pure checks of
the slot tables, then real packets through the kernel (and `trace` agreeing with them)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pyproxy.core.balancing import (
    MAGLEV_TABLE_SIZE,
    effective_weights,
    maglev_table,
    slots,
    weighted_slots,
)
from pyproxy.core.model import Algorithm, Endpoint, IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.render.skeleton import render_config
from pyproxy.render.trace import trace
from testkit.builders import annotated_port, ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.nftns import NodeProxy

# --- pure ----------------------------------------------------------------------------------


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(f"10.244.{i}.2", 8080) for i in range(1, n + 1)]


def test_maglev_is_deterministic_balanced_and_minimally_disruptive() -> None:
    names = [e.key for e in eps(10)]
    table = maglev_table(names, [1] * 10, MAGLEV_TABLE_SIZE)
    assert table == maglev_table(names, [1] * 10, MAGLEV_TABLE_SIZE)  # same on every node
    shares = Counter(table)
    assert min(shares.values()) >= MAGLEV_TABLE_SIZE // 10 - 2
    assert max(shares.values()) <= MAGLEV_TABLE_SIZE // 10 + 2
    survivors = names[:4] + names[5:]
    after = maglev_table(survivors, [1] * 9, MAGLEV_TABLE_SIZE)
    moved = sum(1 for old, new in zip(table, after, strict=True)
                if old != 4 and names[old] != survivors[new])
    assert moved / MAGLEV_TABLE_SIZE < 0.03  # slots of the 9 survivors barely move


def test_weights() -> None:
    a, b, c = eps(3)
    assert Counter(weighted_slots([a, b, c], [2, 1, 1])) == {a: 2, b: 1, c: 1}
    assert weighted_slots([a, b], [2, 1]) == (a, b, a)  # interleaved for round robin
    assert b not in weighted_slots([a, b, c], [1, 0, 1])  # drained
    big = weighted_slots([a, b], [1000, 1])
    assert len(big) <= 256 and b in big  # bounded, nobody starved
    table = slots([a, b], [3, 1], Algorithm.MAGLEV)
    share = Counter(table)[a] / len(table)
    assert 0.72 < share < 0.78


def test_annotations() -> None:
    p = annotated_port({"service.pyproxy.io/balancing": "maglev",
              "service.pyproxy.io/endpoint-weights": "10.244.1.2=3, 10.244.2.2=0"})
    assert p.balancing is Algorithm.MAGLEV and p.balancing_note is None
    weights, _ = effective_weights(p, eps(3))
    assert weights == [3, 0, 1]
    bad = annotated_port({"service.pyproxy.io/balancing": "fastest",
                "service.pyproxy.io/endpoint-weights": "nonsense"})
    assert bad.balancing is Algorithm.RANDOM
    assert "fastest" in str(bad.balancing_note) and "IP=WEIGHT" in str(bad.balancing_note)
    _, note = effective_weights(annotated_port({"service.pyproxy.io/endpoint-weights":
                                      "10.244.1.2=0"}), eps(1))
    assert note and "weight 0" in note


# --- real packets --------------------------------------------------------------------------

VIP = "10.96.0.10"
PODS = [f"pod-{c}" for c in "abcdefghij"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=PODS)


@pytest.fixture
def proxy(cluster: Cluster) -> Iterator[NodeProxy]:
    config = NodeConfig("node-a", node_ips=(cluster.node_ip4,),
                        cluster_cidrs=(cluster.cluster_cidr4,))
    node = NodeProxy(cluster.node.full, config, families=(IPFamily.IPv4,))
    yield node
    cluster.node.run(["nft", "delete", "table", "ip", "pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


def apply(cluster: Cluster, proxy: NodeProxy, pods: list[str], balancing: str,
          weights: dict[str, int] | None = None,
          slice_tweak: Callable[[dict[str, Any]], None] | None = None) -> None:
    annotations = {"service.pyproxy.io/balancing": balancing}
    if weights:
        annotations["service.pyproxy.io/endpoint-weights"] = ",".join(
            f"{cluster.pods[p].ip4}={w}" for p, w in weights.items())

    def both(svc: dict[str, Any]) -> None:
        svc["metadata"]["annotations"] = annotations
        svc["spec"]["ports"] = [{"name": "http", "port": 80, "protocol": "TCP"},
                                {"name": "dns", "port": 53, "protocol": "UDP"}]

    def slice_ports(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": 8080, "protocol": "TCP"},
                      {"name": "dns", "port": 5353, "protocol": "UDP"}]
        if slice_tweak:
            slice_tweak(s)

    proxy.apply([make_node("node-a", "zone-1"), make_service("ns", "web", both, ip=VIP),
                 make_slice("ns", "web", [ep(cluster.pods[p].ip4, "node-b") for p in pods],
                            slice_ports)])


UDP_SPORTS = """
import json, socket, sys
out = {}
for sport in range(int(sys.argv[1]), int(sys.argv[2])):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", sport)); s.settimeout(1.0)
    s.sendto(b"x", (sys.argv[3], 53))
    try:
        out[sport] = s.recv(200).decode().split()[0]
    except OSError:
        out[sport] = "timeout"
    s.close()
print(json.dumps(out))
"""


def by_sport(cluster: Cluster, first: int, last: int) -> dict[int, str]:
    out = cluster.lab.exec_python(cluster.client, UDP_SPORTS, args=(str(first), str(last), VIP))
    return {int(k): v for k, v in json.loads(out.stdout).items()}


@pytest.mark.netns
@requires_netns
def test_round_robin_with_weights(cluster: Cluster, proxy: NodeProxy) -> None:
    apply(cluster, proxy, ["pod-a", "pod-b", "pod-c"], "round-robin",
          weights={"pod-a": 2})
    counts = tally(cluster.lab.connect(cluster.client, VIP, 80, count=40))
    assert counts == {"pod-a": 20, "pod-b": 10, "pod-c": 10}


@pytest.mark.netns
@requires_netns
def test_random_with_weights_and_drain(cluster: Cluster, proxy: NodeProxy) -> None:
    apply(cluster, proxy, ["pod-a", "pod-b", "pod-c"], "random",
          weights={"pod-a": 3, "pod-b": 1, "pod-c": 0})
    counts = tally(cluster.lab.connect(cluster.client, VIP, 80, count=200, parallel=10))
    assert set(counts) == {"pod-a", "pod-b"}, counts  # pod-c drained: no new connections
    assert 120 <= counts["pod-a"] <= 175, counts


@pytest.mark.netns
@requires_netns
def test_drain_keeps_existing_flows(cluster: Cluster, proxy: NodeProxy) -> None:
    apply(cluster, proxy, ["pod-a", "pod-b"], "source-hash")
    before = by_sport(cluster, 41000, 41001)[41000]
    drained = {before: 0}
    apply(cluster, proxy, ["pod-a", "pod-b"], "source-hash", weights=drained)
    assert by_sport(cluster, 41000, 41001)[41000] == before  # conntrack keeps the flow
    new = set(by_sport(cluster, 41001, 41011).values())
    assert before not in new  # new flows go elsewhere


@pytest.mark.netns
@requires_netns
def test_source_hash_is_stable_per_client_and_trace_names_it(cluster: Cluster,
                                                             proxy: NodeProxy) -> None:
    apply(cluster, proxy, PODS[:5], "source-hash")
    counts = tally(cluster.lab.connect(cluster.client, VIP, 80, count=20, parallel=5))
    assert len(counts) == 1, counts
    state = proxy.proxiers[0].desired
    cfg = render_config(proxy.proxiers[0].config, IPFamily.IPv4)
    answer = trace(state, cfg, cluster.client_ip4, VIP, 80, "tcp")
    (endpoint, probability), = answer.candidates
    assert probability == 1.0
    assert endpoint.startswith(cluster.pods[next(iter(counts))].ip4 + ":")


@pytest.mark.netns
@requires_netns
def test_maglev_moves_only_the_removed_endpoints_clients(cluster: Cluster,
                                                         proxy: NodeProxy) -> None:
    apply(cluster, proxy, PODS, "maglev")
    before = by_sport(cluster, 42000, 42300)
    assert "timeout" not in before.values() and len(set(before.values())) == 10
    # trace predicts each flow's endpoint from the client address and port
    state = proxy.proxiers[0].desired
    cfg = render_config(proxy.proxiers[0].config, IPFamily.IPv4)
    ip_of = {cluster.pods[p].ip4: p for p in PODS}
    for sport in list(before)[:20]:
        answer = trace(state, cfg, cluster.client_ip4, VIP, 53, "udp", sport=sport)
        assert ip_of[answer.candidates[0][0].split(":")[0]] == before[sport]
    cluster.lab.flush_conntrack(cluster.node)
    apply(cluster, proxy, [p for p in PODS if p != "pod-e"], "maglev")
    after = by_sport(cluster, 42000, 42300)
    stayed = [s for s in before if before[s] != "pod-e"]
    kept = sum(1 for s in stayed if after[s] == before[s])
    assert kept / len(stayed) >= 0.95, (kept, len(stayed))
    moved = sum(1 for s in before if after[s] != before[s])
    assert moved / len(before) <= 0.2, moved
