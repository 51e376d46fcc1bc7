"""The demo cluster: three nodes in two zones, one backend pod and one client pod per node,
and one Service per routing rule, written as the API server would serve them (the snapshot
file every `pyproxy run --snapshot` reads).

Addresses::

    node-a  zone-1  192.168.1.10  pods 10.244.1.0/24  pod-a1 10.244.1.10  client 10.244.1.100
    node-b  zone-1  192.168.2.10  pods 10.244.2.0/24  pod-b1 10.244.2.10  client 10.244.2.100
    node-c  zone-2  192.168.3.10  pods 10.244.3.0/24  pod-c1 10.244.3.10  client 10.244.3.100

Services are 10.96.0.10-14, port 80 -> the pods' port 8080.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

NAMESPACE = "demo"
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_PORT = 80
POD_PORT = 8080
ZONE_LABEL = "topology.kubernetes.io/zone"
HOST_LABEL = "kubernetes.io/hostname"
TOPOLOGY_KEYS = "service.pyproxy.io/topology-keys"


@dataclass(frozen=True)
class NodeSpec:
    name: str
    zone: str
    index: int  # the third octet of its addresses

    @property
    def letter(self) -> str:
        return self.name[-1]

    @property
    def ip(self) -> str:
        return f"192.168.{self.index}.10"

    @property
    def fabric_ip(self) -> str:  # the fabric router's end of the node's link
        return f"192.168.{self.index}.1"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index}.0/24"

    @property
    def pod_gateway(self) -> str:  # the node's end of every pod link
        return f"10.244.{self.index}.1"

    @property
    def client(self) -> str:
        return f"client-{self.letter}"

    @property
    def client_ip(self) -> str:
        return f"10.244.{self.index}.100"


@dataclass(frozen=True)
class PodSpec:
    name: str
    node: NodeSpec
    ip: str


NODES = (NodeSpec("node-a", "zone-1", 1), NodeSpec("node-b", "zone-1", 2),
         NodeSpec("node-c", "zone-2", 3))
PODS = tuple(PodSpec(f"pod-{n.letter}1", n, f"10.244.{n.index}.10") for n in NODES)
POD = {p.name: p for p in PODS}


@dataclass(frozen=True)
class Scenario:
    """One Service and the question it answers."""

    number: int
    service: str
    ip: str
    title: str
    pods: tuple[str, ...]  # its endpoints
    spec: dict[str, Any] = field(default_factory=dict)  # extra Service spec
    annotations: dict[str, str] = field(default_factory=dict)
    zone_hints: bool = False  # forZones hints, as the EndpointSlice controller writes them
    node_hints: bool = False  # forNodes hints
    expect: str = ""  # what to look at

    @property
    def key(self) -> str:
        return f"{NAMESPACE}/{self.service}"


SCENARIOS = (
    Scenario(1, "web", "10.96.0.10", "Cluster routing: no topology", ("pod-a1", "pod-b1", "pod-c1"),
             expect="every node spreads its connections over all three pods"),
    Scenario(2, "zonal", "10.96.0.11",
             "PreferSameZone: trafficDistribution PreferClose, forZones hints",
             ("pod-a1", "pod-b1", "pod-c1"), spec={"trafficDistribution": "PreferClose"},
             zone_hints=True,
             expect="zone-1 nodes use pod-a1 and pod-b1; node-c stays in zone-2 (pod-c1)"),
    Scenario(3, "same-node", "10.96.0.12",
             "PreferSameNode: trafficDistribution PreferSameNode, forNodes hints",
             ("pod-a1", "pod-b1", "pod-c1"), spec={"trafficDistribution": "PreferSameNode"},
             zone_hints=True, node_hints=True,
             expect="every node uses its own pod"),
    Scenario(4, "nearest", "10.96.0.13",
             "Topology keys: node, then zone, then anywhere (pods on node-b and node-c only)",
             ("pod-b1", "pod-c1"),
             annotations={TOPOLOGY_KEYS: f"{HOST_LABEL},{ZONE_LABEL},*"},
             expect="node-b and node-c match on the node key; node-a has no pod and "
                    "falls to its zone (pod-b1)"),
    Scenario(5, "local", "10.96.0.14",
             "internalTrafficPolicy: Local (pods on node-a and node-c only)",
             ("pod-a1", "pod-c1"), spec={"internalTrafficPolicy": "Local"},
             expect="each node uses its own pod only; node-b has none, so its clients' "
                    "connections are dropped"),
)
SCENARIO = {s.service: s for s in SCENARIOS}


def node_object(node: NodeSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node.name, "labels": {
            HOST_LABEL: node.name, ZONE_LABEL: node.zone,
            "topology.kubernetes.io/region": "region-1"}},
        "spec": {"podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": node.ip},
                                 {"type": "Hostname", "address": node.name}]},
    }


def service_object(s: Scenario) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": s.service, "namespace": NAMESPACE}
    if s.annotations:
        metadata["annotations"] = dict(s.annotations)
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata,
        "spec": {"type": "ClusterIP", "clusterIP": s.ip, "clusterIPs": [s.ip],
                 "selector": {"app": s.service},
                 "ports": [{"name": "http", "port": SERVICE_PORT, "protocol": "TCP",
                            "targetPort": POD_PORT}],
                 **s.spec},
    }


def slice_object(s: Scenario, not_ready: frozenset[str]) -> dict[str, Any]:
    endpoints = []
    for name in s.pods:
        pod = POD[name]
        ready = name not in not_ready
        ep: dict[str, Any] = {
            "addresses": [pod.ip],
            "conditions": {"ready": ready, "serving": ready, "terminating": False},
            "nodeName": pod.node.name, "zone": pod.node.zone,
            "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": name},
        }
        hints: dict[str, Any] = {}
        if s.zone_hints:
            hints["forZones"] = [{"name": pod.node.zone}]
        if s.node_hints:
            hints["forNodes"] = [{"name": pod.node.name}]
        if hints:
            ep["hints"] = hints
        endpoints.append(ep)
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{s.service}-abcde", "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": s.service,
                                "endpointslice.kubernetes.io/managed-by":
                                    "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def objects(not_ready: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    out = [node_object(n) for n in NODES]
    for s in SCENARIOS:
        out += [service_object(s), slice_object(s, not_ready)]
    return out


HEADER = """\
# The demo cluster as the API server would serve it (written by demo/run.py).
# Every node's `pyproxy run --snapshot` follows this file: edit it (write a copy, then
# rename it over this one) and the daemons sync within about a second.
"""


def write_snapshot(path: Path, not_ready: frozenset[str] = frozenset()) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(HEADER + yaml.safe_dump_all(objects(not_ready), sort_keys=False))
    os.replace(tmp, path)
