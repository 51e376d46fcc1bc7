"""A synthetic cluster for the benchmark, built directly as API dicts (what the API server's
list calls return), and the plan of one-service changes applied to it.

Everything is a pure function of (services, endpoints, seed), so that the pyproxy worker and
the baseline worker, in separate processes, see exactly the same cluster and the same changes.

The mix (fractions of services; "few %" realism, the bulk is plain ClusterIP/TCP):
  3 % NodePort, 2 % LoadBalancer (a quarter with loadBalancerSourceRanges), of those a third
  with externalTrafficPolicy: Local; 0.5 % externalIPs; 0.5 % ClientIP session affinity;
  0.5 % internalTrafficPolicy: Local; 3 % trafficDistribution: PreferClose with zone hints;
  4 % UDP-only, 2 % DNS-like (53/UDP + 53/TCP), 3 % two TCP ports (http + https);
  0.5 % without any endpoint.
Endpoints: `endpoints` per service (pod IPs from 10.128.0.0/9, the cluster CIDR), spread
round-robin over three nodes: node-a and node-b in zone-1, node-c in zone-2. The proxy runs
as node-a (192.168.0.10).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import ClusterState, LocalMode, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig

Obj = dict[str, Any]

NODES = (("node-a", "zone-1"), ("node-b", "zone-1"), ("node-c", "zone-2"))
THIS_NODE = "node-a"
NODE_IP = "192.168.0.10"
CLUSTER_CIDR = "10.128.0.0/9"
NODE_CONFIG = NodeConfig(node_name=THIS_NODE, node_ips=(NODE_IP,), cluster_cidrs=(CLUSTER_CIDR,),
                         local_mode=LocalMode.CLUSTER_CIDR)

VIP_BASE = (10 << 24) | (96 << 16)  # 10.96.0.0/12 service CIDR
POD_BASE = (10 << 24) | (128 << 16)  # initial pod IPs, 10.128.0.0 upwards
POD_NEW_BASE = (10 << 24) | (200 << 16)  # pod IPs created by the changes
LB_BASE = (172 << 24) | (16 << 16)  # 172.16.0.0/12 LoadBalancer ingress IPs
EXT_BASE = (192 << 24) | (0 << 16) | (2 << 8)  # 192.0.2.0/24.. external IPs
NODEPORT_FIRST, NODEPORT_LAST = 30000, 32767

OPS = ("endpoint added", "endpoint removed", "endpoints replaced", "service added",
       "service removed")


def ip4(n: int) -> str:
    return f"{(n >> 24) & 255}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


@dataclass(frozen=True)
class Shape:
    """How one service looks (drawn once per service index from the seeded generator)."""

    kind: str = "ClusterIP"  # ClusterIP | NodePort | LoadBalancer
    ports: tuple[tuple[str, int, str, int], ...] = (("http", 80, "TCP", 8080),)
    etp_local: bool = False
    itp_local: bool = False
    affinity: bool = False
    prefer_close: bool = False
    external_ip: bool = False
    source_ranges: bool = False
    no_endpoints: bool = False

    @property
    def plain(self) -> bool:
        """A single-port TCP ClusterIP with default policies: the bulk, and what changes use."""
        return self == Shape()


def health_checked(shape: Shape) -> bool:
    """Kubernetes allocates a healthCheckNodePort to type=LoadBalancer with eTP=Local only."""
    return shape.kind == "LoadBalancer" and shape.etp_local


@dataclass
class Cluster:
    services: int
    endpoints: int
    seed: int = 1
    shapes: list[Shape] = field(default_factory=list)
    node_ports: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        next_np = NODEPORT_FIRST
        for i in range(self.services):
            shape = _draw(rng)
            if shape.kind != "ClusterIP":
                # A LoadBalancer with eTP=Local also holds a healthCheckNodePort from the same
                # range (the last of its ports here): unique, as the API server allocates them.
                need = len(shape.ports) + (1 if health_checked(shape) else 0)
                if next_np + need - 1 > NODEPORT_LAST:
                    shape = dataclasses.replace(shape, kind="ClusterIP", etp_local=False,
                                                source_ranges=False)
                else:
                    self.node_ports[i] = list(range(next_np, next_np + need))
                    next_np += need
            self.shapes.append(shape)

    # -- objects ------------------------------------------------------------------------------

    def shape(self, i: int) -> Shape:
        return self.shapes[i] if i < len(self.shapes) else Shape()

    def key(self, i: int) -> ServiceKey:
        return ServiceKey(f"ns-{i % 64}", f"svc-{i}")

    def initial_endpoints(self, i: int) -> list[tuple[str, str]]:
        """(pod IP, node) of service i's endpoints in the initial cluster."""
        if self.shape(i).no_endpoints:
            return []
        base = POD_BASE + i * self.endpoints
        return [(ip4(base + j), NODES[(i + j) % 3][0]) for j in range(self.endpoints)]

    def service(self, i: int) -> Obj:
        s, key = self.shape(i), self.key(i)
        vip = ip4(VIP_BASE + 16 + i)
        ports = []
        for n, (name, port, proto, target) in enumerate(s.ports):
            p: Obj = {"name": name, "port": port, "protocol": proto, "targetPort": target}
            if i in self.node_ports:
                p["nodePort"] = self.node_ports[i][n]
            ports.append(p)
        spec: Obj = {
            "type": s.kind, "clusterIP": vip, "clusterIPs": [vip], "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack", "ports": ports, "selector": {"app": key.name},
            "sessionAffinity": "None",
            "internalTrafficPolicy": "Local" if s.itp_local else "Cluster",
        }
        status: Obj = {"loadBalancer": {}}
        if s.kind != "ClusterIP":
            spec["externalTrafficPolicy"] = "Local" if s.etp_local else "Cluster"
            if health_checked(s):
                spec["healthCheckNodePort"] = self.node_ports[i][-1]
        if s.kind == "LoadBalancer":
            status["loadBalancer"] = {"ingress": [{"ip": ip4(LB_BASE + i), "ipMode": "VIP"}]}
            if s.source_ranges:
                spec["loadBalancerSourceRanges"] = ["203.0.113.0/24", "198.51.100.0/24"]
        if s.external_ip:
            spec["externalIPs"] = [ip4(EXT_BASE + i)]
        if s.affinity:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 10800}}
        if s.prefer_close:
            spec["trafficDistribution"] = "PreferClose"
        return {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {
                "namespace": key.namespace, "name": key.name, "uid": _uid(i, 1),
                "resourceVersion": str(1000 + i), "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"app": key.name, "team": f"team-{i % 13}"},
            },
            "spec": spec, "status": status,
        }

    def endpoint_slice(self, i: int, eps: list[tuple[str, str]], generation: int = 0) -> Obj:
        s, key = self.shape(i), self.key(i)
        zone_of = dict(NODES)
        endpoints = []
        for n, (ip, node) in enumerate(eps):
            ep: Obj = {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": node, "zone": zone_of[node],
                "targetRef": {"kind": "Pod", "namespace": key.namespace,
                              "name": f"{key.name}-{generation}-{n}", "uid": _uid(i, 100 + n)},
            }
            if s.prefer_close:
                ep["hints"] = {"forZones": [{"name": zone_of[node]}]}
            endpoints.append(ep)
        return {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "namespace": key.namespace, "name": f"{key.name}-x{generation}k9",
                "uid": _uid(i, 2), "resourceVersion": str(5000 + i + generation),
                "labels": {"kubernetes.io/service-name": key.name,
                           "endpointslice.kubernetes.io/managed-by":
                               "endpointslice-controller.k8s.io"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time":
                                "2026-01-01T00:00:00Z"},
            },
            "addressType": "IPv4",
            "ports": [{"name": name, "port": target, "protocol": proto}
                      for name, _port, proto, target in s.ports],
            "endpoints": endpoints,
        }

    def objects(self) -> Iterator[Obj]:
        for name, zone in NODES:
            yield {"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": name, "labels": {
                       "kubernetes.io/hostname": name, "topology.kubernetes.io/zone": zone,
                       "topology.kubernetes.io/region": "region-1"}}}
        for i in range(self.services):
            yield self.service(i)
            if not self.shape(i).no_endpoints:
                yield self.endpoint_slice(i, self.initial_endpoints(i))


def _uid(i: int, salt: int) -> str:
    return f"{i:08x}-{salt:04x}-4000-8000-{(i * 7919 + salt):012x}"


def _draw(rng: random.Random) -> Shape:
    r = rng.random
    kind = "ClusterIP"
    x = r()
    if x < 0.03:
        kind = "NodePort"
    elif x < 0.05:
        kind = "LoadBalancer"
    y = r()
    if y < 0.04:
        ports: tuple[tuple[str, int, str, int], ...] = (("syslog", 514, "UDP", 5514),)
    elif y < 0.06:
        ports = (("dns", 53, "UDP", 5353), ("dns-tcp", 53, "TCP", 5353))
    elif y < 0.09:
        ports = (("http", 80, "TCP", 8080), ("https", 443, "TCP", 8443))
    else:
        ports = (("http", 80, "TCP", 8080),)
    external = kind != "ClusterIP"
    return Shape(
        kind=kind, ports=ports,
        etp_local=external and r() < 1 / 3,
        source_ranges=kind == "LoadBalancer" and r() < 0.25,
        external_ip=r() < 0.005,
        affinity=r() < 0.005,
        itp_local=r() < 0.005,
        prefer_close=r() < 0.03,
        no_endpoints=r() < 0.005,
    )


# ---------------------------------------------------------------------------------------------
# One-service changes


@dataclass(frozen=True)
class Change:
    op: str
    index: int  # service index
    key: ServiceKey
    service: Obj | None  # the Service after the change (None: removed)
    endpoint_slice: Obj | None
    endpoints_before: int
    endpoints_after: int


def plan_changes(cluster: Cluster, per_op: int, seed: int = 2) -> list[Change]:
    """`per_op` changes of each kind, interleaved (round r does one of each), each on a
    different service; only plain ClusterIP/TCP services are changed."""
    rng = random.Random(seed)
    plain = [i for i in range(cluster.services) if cluster.shape(i).plain]
    need = 4 * per_op
    if len(plain) < need:
        raise SystemExit(f"need {need} plain services for the changes, have {len(plain)}")
    picked = rng.sample(plain, need)
    groups = {op: picked[n * per_op:(n + 1) * per_op] for n, op in enumerate(
        ("endpoint added", "endpoint removed", "endpoints replaced", "service removed"))}
    new_pod = POD_NEW_BASE
    generation = 1
    out: list[Change] = []
    for r in range(per_op):
        for op in OPS:
            if op == "service added":
                i = cluster.services + r
                eps = [(ip4(new_pod + j), NODES[(i + j) % 3][0]) for j in range(cluster.endpoints)]
                new_pod += cluster.endpoints
                out.append(Change(op, i, cluster.key(i), cluster.service(i),
                                  cluster.endpoint_slice(i, eps, generation), 0, len(eps)))
                continue
            i = groups[op][r]
            before = cluster.initial_endpoints(i)
            if op == "service removed":
                out.append(Change(op, i, cluster.key(i), None, None, len(before), 0))
                continue
            if op == "endpoint added":
                eps = [*before, (ip4(new_pod), NODES[new_pod % 3][0])]
                new_pod += 1
            elif op == "endpoint removed":
                eps = [ep for n, ep in enumerate(before) if n != 3 % len(before)]
            else:  # endpoints replaced
                eps = [(ip4(new_pod + j), node) for j, (_ip, node) in enumerate(before)]
                new_pod += len(before)
            generation += 1
            out.append(Change(op, i, cluster.key(i), cluster.service(i),
                              cluster.endpoint_slice(i, eps, generation), len(before), len(eps)))
    return out


def apply_change(state: ClusterState, change: Change) -> ClusterState:
    """The state after `change`, built the way an incremental tracker would: only this
    service's entries are replaced (the dict copies are O(services), but this runs outside
    the timed region)."""
    key = change.key
    objects = [o for o in (change.service, change.endpoint_slice) if o is not None]
    sub = build_state(objects)
    assert not sub.skipped, sub.skipped
    new_ports = sub.ports_of(key)
    old_ports = state.ports_of(key)
    by_service = dict(state.ports_by_service)
    slices = dict(state.slices)
    if new_ports:
        by_service[key] = new_ports
    else:
        by_service.pop(key, None)
    if key in sub.slices:
        slices[key] = sub.slices[key]
    else:
        slices.pop(key, None)
    changes: dict[str, Any] = {"slices": slices, "ports_by_service": by_service}
    if "ports" in _STATE_FIELDS and new_ports != old_ports:
        # Older ClusterState kept a sorted tuple of every port besides ports_by_service.
        kept = [p for p in state.ports if p.name.service != key]
        changes["ports"] = tuple(sorted([*kept, *new_ports], key=lambda p: (
            p.name.namespace, p.name.name, p.name.port, p.name.protocol)))
    return dataclasses.replace(state, **changes)


_STATE_FIELDS = {f.name for f in dataclasses.fields(ClusterState)}


def big_service_objects(endpoints: int, generation: int = 0) -> list[Obj]:
    """One ClusterIP/TCP service with `endpoints` endpoints, in EndpointSlices of 100 (the
    EndpointSlice controller's default size; the API caps a slice at 1,000): kube-proxy's
    known weak case. Endpoint j is always the same pod, so two counts differ only at the
    end of the list."""
    key = ServiceKey("ns-big", "big")
    vip = "10.97.0.1"
    service: Obj = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": key.namespace, "name": key.name, "uid": _uid(0, 9000)},
        "spec": {"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip],
                 "ipFamilies": ["IPv4"], "ports": [{"name": "http", "port": 80,
                                                    "protocol": "TCP", "targetPort": 8080}]},
    }
    slices: list[Obj] = []
    for first in range(0, endpoints, 100):
        eps = [{"addresses": [ip4(POD_NEW_BASE + (50 << 16) + j)],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": NODES[j % 3][0], "zone": NODES[j % 3][1]}
               for j in range(first, min(endpoints, first + 100))]
        slices.append({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": key.namespace, "name": f"big-{first // 100}",
                         "uid": _uid(first, 9001), "resourceVersion": str(generation),
                         "labels": {"kubernetes.io/service-name": key.name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": eps,
        })
    return [service, *slices]
