"""Endpoint selection for this node, table-driven (upstream's TestCategorizeEndpoints, plus the
seed documents' examples for topology keys and trafficDistribution)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pyproxy.cli import main
from pyproxy.cluster.snapshot import build_state
from pyproxy.core.topology import Selection, parse_min_endpoints, select_all
from testkit.builders import ep, make_node, make_service, make_slice, terminating

NODES = [
    make_node("node-a", "zone-1", **{"topology.kubernetes.io/region": "region-1", "rack": "r1"}),
    make_node("node-b", "zone-1", **{"topology.kubernetes.io/region": "region-1", "rack": "r2"}),
    make_node("node-c", "zone-2", **{"topology.kubernetes.io/region": "region-1", "rack": "r1"}),
    make_node("node-d", "zone-3", **{"topology.kubernetes.io/region": "region-2"}),
    make_node("node-e", "zone-4"),  # no region label
    make_node("node-nozone"),
]

A1 = "10.244.1.1"  # node-a, zone-1
A2 = "10.244.1.2"
B1 = "10.244.2.1"  # node-b, zone-1
C1 = "10.244.3.1"  # node-c, zone-2
D1 = "10.244.4.1"  # node-d, zone-3, region-2
E1 = "10.244.5.1"  # node-e, zone-4, no region
N1 = "10.244.6.1"  # node-nozone
X1 = "10.244.7.1"  # node-x: no Node object


def on(ip: str, node: str, **kw: Any) -> dict[str, Any]:
    zone = {"node-a": "zone-1", "node-b": "zone-1", "node-c": "zone-2", "node-d": "zone-3",
            "node-e": "zone-4"}
    return ep(ip, node, zone.get(node), **kw)


def tweak(**spec: Any) -> Callable[[dict[str, Any]], None]:
    def apply(svc: dict[str, Any]) -> None:
        annotations = spec.pop("annotations", None)
        if annotations:
            svc["metadata"]["annotations"] = annotations
        svc["spec"].update(spec)

    return apply


NODEPORT = {"type": "NodePort", "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}


@dataclass
class Case:
    name: str
    endpoints: list[dict[str, Any]]
    cluster: set[str] | None
    local: set[str] | None
    node: str = "node-a"
    spec: dict[str, Any] = field(default_factory=dict)
    has_any: bool = True
    topology: str = "None"
    reachable: set[str] | None = None
    reason: str | None = None  # a substring expected in the decision trace
    levels: tuple[str, ...] | None = None  # Selection.levels, when given


def k(*ips: str) -> set[str]:
    return {f"{ip}:8080" for ip in ips}


CASES = [
    # --- plain cluster traffic --------------------------------------------------------------
    Case("all ready endpoints are used without hints",
         [on(A1, "node-a"), on(B1, "node-b"), on(C1, "node-c")], k(A1, B1, C1), None),
    Case("unready endpoints are not used while a ready one exists",
         [on(A1, "node-a", ready=False), on(B1, "node-b")], k(B1), None),
    Case("no endpoints at all: nothing used, rejected",
         [], set(), None, has_any=False, reason="rejected"),
    # --- terminating fallback ----------------------------------------------------------------
    Case("no ready endpoint: serving terminating endpoints are used",
         [terminating(A1, "node-a"), terminating(B1, "node-b"), on(C1, "node-c", ready=False)],
         k(A1, B1), None, reason="serving terminating"),
    Case("terminating but not serving endpoints are never used",
         [terminating(A1, "node-a", serving=False)], set(), None, has_any=False),
    Case("a ready endpoint wins over serving terminating ones",
         [terminating(A1, "node-a"), on(B1, "node-b")], k(B1), None),
    # --- hints: PreferSameZone -------------------------------------------------------------
    Case("zone hints for my zone: only those endpoints",
         [on(A1, "node-a", zones=["zone-1"]), on(B1, "node-b", zones=["zone-1"]),
          on(C1, "node-c", zones=["zone-2"])], k(A1, B1), None, topology="PreferSameZone"),
    Case("zone hints from another node of the zone-2",
         [on(A1, "node-a", zones=["zone-1"]), on(C1, "node-c", zones=["zone-2"])],
         k(C1), None, node="node-c", topology="PreferSameZone"),
    Case("an endpoint hinted for several zones serves each",
         [on(A1, "node-a", zones=["zone-1", "zone-2"]), on(B1, "node-b", zones=["zone-1"])],
         k(A1), None, node="node-c", topology="PreferSameZone"),
    Case("one ready endpoint without a zone hint: hints ignored",
         [on(A1, "node-a", zones=["zone-1"]), on(C1, "node-c")], k(A1, C1), None,
         reason="have no zone hint"),
    Case("no endpoint hinted for my zone: hints ignored",
         [on(A1, "node-a", zones=["zone-1"]), on(B1, "node-b", zones=["zone-1"])],
         k(A1, B1), None, node="node-c", reason="no endpoint is hinted for zone zone-2"),
    Case("node without a zone label: zone hints ignored",
         [on(A1, "node-a", zones=["zone-1"]), on(C1, "node-c", zones=["zone-2"])],
         k(A1, C1), None, node="node-nozone", reason="has no topology.kubernetes.io/zone label"),
    Case("only unready endpoints in my zone: hints ignored (should not filter)",
         [on(A1, "node-a", ready=False, zones=["zone-1"]), on(C1, "node-c", zones=["zone-2"])],
         k(C1), None, node="node-a", reason="no endpoint is hinted for zone zone-1"),
    Case("unready endpoints without hints do not disable hints",
         [on(A1, "node-a", zones=["zone-1"]), on(C1, "node-c", ready=False)],
         k(A1), None, topology="PreferSameZone"),
    Case("hints with no ready endpoint: terminating fallback ignores topology",
         [terminating(A1, "node-a", zones=["zone-1"]), terminating(C1, "node-c", zones=["zone-2"])],
         k(A1, C1), None),
    Case("trafficDistribution without hints in the slices: all endpoints, reason given",
         [on(A1, "node-a"), on(C1, "node-c")], k(A1, C1), None,
         spec={"trafficDistribution": "PreferClose"}, reason="carry no hints"),
    Case("topology-mode annotation without hints: all endpoints, reason given",
         [on(A1, "node-a"), on(C1, "node-c")], k(A1, C1), None,
         spec={"annotations": {"service.kubernetes.io/topology-mode": "Auto"}},
         reason="topology-mode annotation=Auto"),
    # --- hints: PreferSameNode --------------------------------------------------------------
    Case("node hints for my node: only that endpoint",
         [on(A1, "node-a", zones=["zone-1"], nodes=["node-a"]),
          on(B1, "node-b", zones=["zone-1"], nodes=["node-b"]),
          on(C1, "node-c", zones=["zone-2"], nodes=["node-c"])],
         k(A1), None, topology="PreferSameNode"),
    Case("no node hint for me but zone hints: PreferSameZone",
         [on(B1, "node-b", zones=["zone-1"], nodes=["node-b"]),
          on(C1, "node-c", zones=["zone-2"], nodes=["node-c"])],
         k(B1), None, topology="PreferSameZone", reason="no endpoint is hinted for node node-a"),
    Case("one endpoint without a node hint: falls to zone hints",
         [on(A1, "node-a", zones=["zone-1"], nodes=["node-a"]), on(B1, "node-b", zones=["zone-1"]),
          on(C1, "node-c", zones=["zone-2"], nodes=["node-c"])],
         k(A1, B1), None, topology="PreferSameZone", reason="have no node hint"),
    Case("node and zone hints both missing for me: all endpoints",
         [on(B1, "node-b", zones=["zone-1"], nodes=["node-b"])],
         k(B1), None, node="node-c"),
    # --- internalTrafficPolicy: Local -------------------------------------------------------
    Case("iTP Local: local ready endpoints only, cluster list not used",
         [on(A1, "node-a"), on(A2, "node-a"), on(B1, "node-b")], None, k(A1, A2),
         spec={"internalTrafficPolicy": "Local"}),
    Case("iTP Local without local endpoints: empty (dropped) but has endpoints",
         [on(B1, "node-b"), on(C1, "node-c")], None, set(),
         spec={"internalTrafficPolicy": "Local"}, reason="dropped"),
    Case("iTP Local ignores hints",
         [on(A1, "node-a", zones=["zone-2"]), on(C1, "node-c", zones=["zone-1"])], None, k(A1),
         spec={"internalTrafficPolicy": "Local"}),
    Case("iTP Local: local serving terminating fallback while remote ones are ready",
         [terminating(A1, "node-a"), on(B1, "node-b")], None, k(A1),
         spec={"internalTrafficPolicy": "Local"}, reason="falling back"),
    Case("iTP Local: local endpoint terminating and not serving: empty",
         [terminating(A1, "node-a", serving=False), on(B1, "node-b")], None, set(),
         spec={"internalTrafficPolicy": "Local"}),
    Case("iTP Local and no endpoints anywhere: rejected",
         [terminating(B1, "node-b", serving=False)], None, set(),
         spec={"internalTrafficPolicy": "Local"}, has_any=False),
    # --- externalTrafficPolicy: Local -------------------------------------------------------
    Case("eTP Local on a NodePort: cluster list for pods/host, local list for external",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1, B1), k(A1),
         spec={"externalTrafficPolicy": "Local", **NODEPORT}, reachable=k(A1, B1)),
    Case("eTP Local without local endpoints: local empty, cluster full",
         [on(B1, "node-b"), on(C1, "node-c")], k(B1, C1), set(),
         spec={"externalTrafficPolicy": "Local", **NODEPORT}),
    Case("eTP Local on a service nobody reaches from outside: no local list",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1, B1), None,
         spec={"externalTrafficPolicy": "Local"}),
    Case("eTP Local with an external IP counts as externally reachable",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1, B1), k(A1),
         spec={"externalTrafficPolicy": "Local", "externalIPs": ["192.0.2.10"]}),
    Case("eTP Local with a Proxy-mode LB IP only is not externally reachable",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1, B1), None,
         spec={"externalTrafficPolicy": "Local", "type": "LoadBalancer",
               "ports": [{"name": "http", "port": 80}]}),
    Case("eTP Local, local terminating and remote ready: both lists, union reachable",
         [terminating(A1, "node-a"), on(B1, "node-b")], k(B1), k(A1),
         spec={"externalTrafficPolicy": "Local", **NODEPORT}, reachable=k(A1, B1)),
    Case("eTP Local with zone hints: cluster list filtered, local list not",
         [on(A1, "node-a", zones=["zone-2"]), on(C1, "node-c", zones=["zone-1"])], k(C1), k(A1),
         spec={"externalTrafficPolicy": "Local", **NODEPORT}, topology="PreferSameZone",
         reachable=k(A1, C1)),
    Case("both policies Local: local list only",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1, B1), k(A1),
         spec={"externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local", **NODEPORT}),
    # --- topology keys (seed: service-topology-docs.md examples) ------------------------------
    Case("only node-local: endpoint on my node",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname"]},
         topology="TopologyKeys:kubernetes.io/hostname"),
    Case("only node-local, none on my node: no endpoints, connections fail",
         [on(B1, "node-b")], set(), None, spec={"topologyKeys": ["kubernetes.io/hostname"]},
         topology="TopologyKeys:", has_any=False, reason='no topology key matched'),
    Case("prefer node-local: falls back to any endpoint with *",
         [on(B1, "node-b"), on(C1, "node-c")], k(B1, C1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname", "*"]}, topology="TopologyKeys:*"),
    Case("zonal then regional: zone match wins",
         [on(B1, "node-b"), on(C1, "node-c"), on(D1, "node-d")], k(B1), None,
         spec={"topologyKeys": ["topology.kubernetes.io/zone", "topology.kubernetes.io/region"]},
         topology="TopologyKeys:topology.kubernetes.io/zone"),
    Case("zonal then regional: no zone endpoint, region match",
         [on(C1, "node-c"), on(D1, "node-d")], k(C1), None,
         spec={"topologyKeys": ["topology.kubernetes.io/zone", "topology.kubernetes.io/region"]},
         topology="TopologyKeys:topology.kubernetes.io/region"),
    Case("zonal then regional: nothing in my region, no *: fail",
         [on(D1, "node-d")], set(), None,
         spec={"topologyKeys": ["topology.kubernetes.io/zone", "topology.kubernetes.io/region"]},
         topology="TopologyKeys:", has_any=False),
    Case("node, zone, region, then anywhere",
         [on(D1, "node-d")], k(D1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname", "topology.kubernetes.io/zone",
                                "topology.kubernetes.io/region", "*"]},
         topology="TopologyKeys:*"),
    Case("node, zone, region, then anywhere: same zone preferred over region",
         [on(B1, "node-b"), on(C1, "node-c"), on(D1, "node-d")], k(B1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname", "topology.kubernetes.io/zone",
                                "topology.kubernetes.io/region", "*"]},
         topology="TopologyKeys:topology.kubernetes.io/zone"),
    Case("any node label works: same rack across zones",
         [on(B1, "node-b"), on(C1, "node-c")], k(C1), None,
         spec={"topologyKeys": ["rack", "*"]}, topology="TopologyKeys:rack"),
    Case("a key my node lacks is skipped",
         [on(B1, "node-b")], k(B1), None, node="node-d",
         spec={"topologyKeys": ["rack", "topology.kubernetes.io/zone", "*"]},
         topology="TopologyKeys:*", reason="has no such label"),
    Case("keys from the pyproxy annotation",
         [on(A1, "node-a"), on(C1, "node-c")], k(C1), None, node="node-c",
         spec={"annotations": {"service.pyproxy.io/topology-keys":
                               "kubernetes.io/hostname, topology.kubernetes.io/zone, *"}},
         topology="TopologyKeys:kubernetes.io/hostname"),
    Case("keys match only ready endpoints",
         [on(A1, "node-a", ready=False), on(B1, "node-b")], k(B1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]},
         topology="TopologyKeys:topology.kubernetes.io/zone"),
    Case("keys with no ready endpoint use serving terminating ones",
         [terminating(A1, "node-a"), terminating(C1, "node-c")], k(A1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname", "*"]},
         topology="TopologyKeys:kubernetes.io/hostname"),
    Case("keys are ignored with eTP Local",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1, B1), k(A1),
         spec={"topologyKeys": ["kubernetes.io/hostname"], "externalTrafficPolicy": "Local",
               **NODEPORT}, reason="topology keys ignored"),
    Case("keys win over hints",
         [on(A1, "node-a", zones=["zone-2"]), on(C1, "node-c", zones=["zone-1"])], k(A1), None,
         spec={"topologyKeys": ["kubernetes.io/hostname", "*"]},
         topology="TopologyKeys:kubernetes.io/hostname"),
    Case("endpoint labels from deprecatedTopology when its node is unknown",
         [{**on(A1, "node-x"), "deprecatedTopology": {"rack": "r1"}}, on(B1, "node-b")],
         k(A1), None, spec={"topologyKeys": ["rack"]}, topology="TopologyKeys:rack"),
    Case("endpoint zone field when its node is unknown",
         [{"addresses": [A1], "nodeName": "node-x", "zone": "zone-1"}, on(C1, "node-c")],
         k(A1), None, spec={"topologyKeys": ["topology.kubernetes.io/zone"]},
         topology="TopologyKeys:topology.kubernetes.io/zone"),
]


# --- spillover: service.pyproxy.io/topology-min-endpoints -----------------------------------

MIN = "service.pyproxy.io/topology-min-endpoints"
HOST, ZONE, REGION = ("kubernetes.io/hostname", "topology.kubernetes.io/zone",
                      "topology.kubernetes.io/region")


def spill(n: int | str, **spec: Any) -> dict[str, Any]:
    annotations = {MIN: str(n), **spec.pop("annotations", {})}
    return {"annotations": annotations, **spec}


def zoned(ip: str, node: str, **kw: Any) -> dict[str, Any]:
    """An endpoint hinted for its own zone (trafficDistribution PreferSameZone/PreferClose)."""
    return on(ip, node, zones=[on(ip, node)["zone"]], **kw)


def noded(ip: str, node: str, **kw: Any) -> dict[str, Any]:
    """An endpoint hinted for its own node and zone (trafficDistribution PreferSameNode)."""
    return on(ip, node, zones=[on(ip, node)["zone"]], nodes=[node], **kw)


ZONAL = [zoned(A1, "node-a"), zoned(C1, "node-c"), zoned(D1, "node-d")]
SAME_NODE = [noded(A1, "node-a"), noded(B1, "node-b"), noded(C1, "node-c"), noded(D1, "node-d")]

SPILL_CASES = [
    # --- PreferSameZone hints: zone → region → all ------------------------------------------
    Case("zone: enough in the zone, nothing added",
         [zoned(A1, "node-a"), zoned(B1, "node-b"), zoned(C1, "node-c")], k(A1, B1), None,
         spec=spill(2), topology="PreferSameZone", levels=("zone",),
         reason="topology-min-endpoints 2: zone zone-1 has 2 ready endpoint(s), enough"),
    Case("zone: without the annotation the zone's one endpoint is all",
         ZONAL, k(A1), None, topology="PreferSameZone", levels=("zone",)),
    Case("zone: one short, widened to the region",
         ZONAL, k(A1, C1), None, spec=spill(2), topology="PreferSameZone",
         levels=("zone", "region"),
         reason="zone zone-1 has 1 ready endpoint(s), fewer than topology-min-endpoints 2: "
                "widened to region region-1 (+1): 2 endpoint(s)"),
    Case("zone: region not enough either, widened to all",
         ZONAL, k(A1, C1, D1), None, spec=spill(3), topology="PreferSameZone",
         levels=("zone", "region", "all"), reason="widened to region region-1 (+1), all (+1)"),
    Case("zone: fewer ready endpoints than asked anywhere: all of them, said so",
         ZONAL, k(A1, C1, D1), None, spec=spill(5), topology="PreferSameZone",
         levels=("zone", "region", "all"),
         reason="3 endpoint(s), still fewer with every level used"),
    Case("zone: a node without a region label widens from zone to all",
         [zoned(E1, "node-e"), zoned(C1, "node-c"), zoned(D1, "node-d")], k(C1, D1, E1), None,
         node="node-e", spec=spill(2), topology="PreferSameZone", levels=("zone", "all"),
         reason="no region level: node node-e has no topology.kubernetes.io/region label"),
    Case("zone: an endpoint on an unknown Node has no region: only reached at all",
         [zoned(A1, "node-a"), ep(X1, "node-x", "zone-2", zones=["zone-2"]),
          zoned(C1, "node-c")], k(A1, C1), None, spec=spill(2), topology="PreferSameZone",
         levels=("zone", "region"), reason="1 more ready endpoint(s) of unknown region"),
    Case("zone: only ready endpoints count; terminating ones are not added to reach N",
         [zoned(A1, "node-a"), terminating(C1, "node-c", "zone-2", zones=["zone-2"]),
          zoned(D1, "node-d")], k(A1, D1), None, spec=spill(2), topology="PreferSameZone",
         levels=("zone", "region", "all"), reason="region region-1 (+0), all (+1)"),
    Case("zone: no ready endpoint: the terminating fallback ignores topology as before",
         [terminating(A1, "node-a", "zone-1", zones=["zone-1"]),
          terminating(C1, "node-c", "zone-2", zones=["zone-2"])], k(A1, C1), None,
         spec=spill(2), reason="serving terminating"),
    Case("trafficDistribution PreferClose with hints: widened the same way",
         ZONAL, k(A1, C1), None, spec=spill(2, trafficDistribution="PreferClose"),
         topology="PreferSameZone", levels=("zone", "region")),
    Case("topology-mode Auto with proportional hints: the hinted zone set is the start",
         [on(A1, "node-a", zones=["zone-1"]), on(B1, "node-b", zones=["zone-2"]),
          on(C1, "node-c", zones=["zone-2"]), on(D1, "node-d", zones=["zone-1"])],
         k(A1, B1, C1), None, node="node-c",
         spec=spill(3, annotations={"service.kubernetes.io/topology-mode": "Auto"}),
         topology="PreferSameZone", levels=("zone", "region")),
    # --- PreferSameNode hints: node → zone → region → all -----------------------------------
    Case("node: enough on the node", [noded(A1, "node-a"), noded(A2, "node-a"),
                                      noded(B1, "node-b")],
         k(A1, A2), None, spec=spill(2), topology="PreferSameNode", levels=("node",),
         reason="topology-min-endpoints 2: node node-a has 2 ready endpoint(s), enough"),
    Case("node: one short, widened to the zone",
         SAME_NODE, k(A1, B1), None, spec=spill(2), topology="PreferSameNode",
         levels=("node", "zone"),
         reason="node node-a has 1 ready endpoint(s), fewer than topology-min-endpoints 2: "
                "widened to zone zone-1 (+1)"),
    Case("node: zone and region",
         SAME_NODE, k(A1, B1, C1), None, spec=spill(3), topology="PreferSameNode",
         levels=("node", "zone", "region")),
    Case("node: zone, region and all",
         SAME_NODE, k(A1, B1, C1, D1), None, spec=spill(4), topology="PreferSameNode",
         levels=("node", "zone", "region", "all")),
    Case("node: the zone level goes by location when an endpoint has no zone hint",
         [on(A1, "node-a", nodes=["node-a"]), on(B1, "node-b", nodes=["node-b"]),
          on(C1, "node-c", nodes=["node-c"])], k(A1, B1), None, spec=spill(2),
         topology="PreferSameNode", levels=("node", "zone")),
    Case("node: a node without zone or region labels widens from node to all",
         [on(N1, "node-nozone", nodes=["node-nozone"]), noded(A1, "node-a")], k(A1, N1), None,
         node="node-nozone", spec=spill(2), topology="PreferSameNode", levels=("node", "all"),
         reason="no zone level: node node-nozone has no topology.kubernetes.io/zone label"),
    # --- no topology preference: nothing to widen ------------------------------------------
    Case("no hints: every ready endpoint is used already",
         [on(A1, "node-a"), on(C1, "node-c")], k(A1, C1), None, spec=spill(3),
         levels=(), reason="no topology preference in force"),
    # --- topology keys: accumulate successive keys -----------------------------------------
    Case("keys: the first key has enough",
         [on(A1, "node-a"), on(A2, "node-a"), on(B1, "node-b")], k(A1, A2), None,
         spec=spill(2, topologyKeys=[HOST, ZONE, "*"]),
         topology=f"TopologyKeys:{HOST}", levels=(HOST,),
         reason=f"topology-min-endpoints 2: {HOST}=node-a has 2 ready endpoint(s), enough"),
    Case("keys: hostname then zone",
         [on(A1, "node-a"), on(B1, "node-b"), on(C1, "node-c")], k(A1, B1), None,
         spec=spill(2, topologyKeys=[HOST, ZONE, "*"]),
         topology=f"TopologyKeys:{HOST}", levels=(HOST, ZONE),
         reason=f"{HOST}=node-a has 1 ready endpoint(s), fewer than topology-min-endpoints 2: "
                f"widened to {ZONE}=zone-1 (+1)"),
    Case("keys: hostname, zone, region; never beyond the last key",
         [on(A1, "node-a"), on(B1, "node-b"), on(C1, "node-c"), on(D1, "node-d")],
         k(A1, B1, C1), None, spec=spill(4, topologyKeys=[HOST, ZONE, REGION]),
         topology=f"TopologyKeys:{HOST}", levels=(HOST, ZONE, REGION),
         reason="3 endpoint(s), still fewer with every level used"),
    Case("keys: a single key short of the minimum has nothing to widen to",
         [on(A1, "node-a"), on(B1, "node-b")], k(A1), None, spec=spill(2, topologyKeys=[HOST]),
         topology=f"TopologyKeys:{HOST}", levels=(HOST,),
         reason="fewer than topology-min-endpoints 2: no wider level: using these"),
    Case("keys: a first key without endpoints is passed, then keys accumulate up to *",
         [on(B1, "node-b"), on(C1, "node-c"), on(D1, "node-d")], k(B1, C1, D1), None,
         spec=spill(2, topologyKeys=[HOST, ZONE, "*"]),
         topology=f"TopologyKeys:{ZONE}", levels=(ZONE, "*")),
    Case("keys from the annotation, with the minimum",
         [on(A1, "node-a"), on(C1, "node-c")], k(A1, C1), None, node="node-c",
         spec=spill(2, annotations={"service.pyproxy.io/topology-keys": f"{HOST},*"}),
         topology=f"TopologyKeys:{HOST}", levels=(HOST, "*")),
    Case("keys: with no ready endpoint the serving terminating ones are accumulated",
         [terminating(A1, "node-a"), terminating(C1, "node-c")], k(A1, C1), None,
         spec=spill(2, topologyKeys=[HOST, "*"]), topology=f"TopologyKeys:{HOST}",
         levels=(HOST, "*"), reason="1 serving terminating endpoint(s), fewer than"),
    # --- traffic policies: the node-local list never widens ---------------------------------
    Case("iTP Local: local list only, not widened",
         [on(B1, "node-b"), on(C1, "node-c")], None, set(),
         spec=spill(2, internalTrafficPolicy="Local"),
         reason="does not apply to the node-local list"),
    Case("eTP Local: the cluster list widens, the local list does not",
         [zoned(A1, "node-a"), zoned(C1, "node-c"), zoned(D1, "node-d")], k(A1, C1), k(A1),
         spec=spill(2, externalTrafficPolicy="Local", **NODEPORT), topology="PreferSameZone",
         levels=("zone", "region")),
]
INVALID = ["abc", "0", "-1", "1001", "99999999999999999999", "2.5", "0x2", "", " ", "١٢"]


@pytest.mark.parametrize("case", SPILL_CASES, ids=lambda c: c.name)
def test_spillover(case: Case) -> None:
    test_select_endpoints(case)


@pytest.mark.parametrize("value", INVALID)
def test_invalid_min_endpoints_is_reported_and_ignored(value: str) -> None:
    sel = select(Case("", ZONAL, None, None, spec=spill(value)))
    assert keys(sel.cluster) == k(A1) and sel.levels == ("zone",)  # as without the annotation
    assert any("topology-min-endpoints=" in r and "ignored" in r for r in sel.reasons)


def test_min_endpoints_value_is_trimmed_and_bounded() -> None:
    assert parse_min_endpoints(" 2 ") == (2, None)
    assert parse_min_endpoints("1000") == (1000, None)
    assert parse_min_endpoints(None) == (0, None)
    number, note = parse_min_endpoints("1001")
    assert number == 0 and note and "from 1 to 1000" in note


def select(case: Case) -> Selection:
    spec = dict(case.spec)
    state = build_state(
        [*NODES, make_service("ns", "svc", tweak(**spec)), make_slice("ns", "svc", case.endpoints)]
    )
    selections = list(select_all(state, case.node))
    assert len(selections) == 1, state.skipped
    return selections[0].selection


def keys(endpoints: tuple[Any, ...] | None) -> set[str] | None:
    return None if endpoints is None else {e.key for e in endpoints}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_select_endpoints(case: Case) -> None:
    sel = select(case)
    assert keys(sel.cluster) == case.cluster
    assert keys(sel.local) == case.local
    assert sel.has_any_endpoints == case.has_any
    assert sel.topology == case.topology
    if case.reachable is not None:
        assert keys(sel.all_reachable) == case.reachable
    else:
        assert keys(sel.all_reachable) == (case.cluster or set()) | (case.local or set())
    if case.reason:
        assert any(case.reason in r for r in sel.reasons), sel.reasons
    if case.levels is not None:
        assert sel.levels == case.levels


def test_dual_stack_selects_per_family() -> None:
    state = build_state([
        *NODES,
        make_service("ns", "svc", tweak(clusterIPs=["10.96.0.10", "fd00:96::10"],
                                        ipFamilies=["IPv4", "IPv6"])),
        make_slice("ns", "svc", [on(A1, "node-a"), on(B1, "node-b")]),
        make_slice("ns", "svc", [on("fd00:244:1::1", "node-a")], family="IPv6"),
    ])
    by_family = {str(ps.family): ps.selection for ps in select_all(state, "node-a")}
    assert keys(by_family["IPv4"].cluster) == k(A1, B1)
    assert keys(by_family["IPv6"].cluster) == {"[fd00:244:1::1]:8080"}


def test_ipv6_only_service_ignores_ipv4_slices() -> None:
    state = build_state([
        *NODES,
        make_service("ns", "svc", ip="fd00:96::10"),
        make_slice("ns", "svc", [on(A1, "node-a")]),
    ])
    (ps,) = select_all(state, "node-a")
    assert str(ps.family) == "IPv6"
    assert ps.selection.cluster == ()
    assert not ps.selection.has_any_endpoints


# --- explain says which levels were used and why ---------------------------------------------


def test_explain_reports_spillover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "cluster.yaml"
    snapshot.write_text(yaml.safe_dump_all([
        *NODES,
        make_service("ns", "spill", tweak(**spill(2)), ip="10.96.0.10"),
        make_slice("ns", "spill", ZONAL),
        make_service("ns", "typo", tweak(**spill("two")), ip="10.96.0.11"),
        make_slice("ns", "typo", ZONAL),
    ]))
    assert main(["explain", "-f", str(snapshot), "--node", "node-a", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    spilled, typo = report["services"]
    assert spilled["topology"] == "PreferSameZone"
    assert spilled["topologyLevels"] == ["zone", "region"]
    assert spilled["topologyMinEndpoints"] == 2
    assert spilled["clusterEndpoints"] == sorted(k(A1, C1))
    assert ("zone zone-1 has 1 ready endpoint(s), fewer than topology-min-endpoints 2: widened "
            "to region region-1 (+1): 2 endpoint(s)") in spilled["reasons"]
    assert typo["topologyLevels"] == ["zone"] and typo["topologyMinEndpoints"] is None
    assert typo["clusterEndpoints"] == sorted(k(A1))
    assert any("topology-min-endpoints='two'" in r for r in typo["reasons"])

    assert main(["explain", "-f", str(snapshot), "--node", "node-a"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("ns/spill"))
    assert row.split()[3] == "PreferSameZone+region"
    assert "  - zone zone-1 has 1 ready endpoint(s), fewer than topology-min-endpoints 2" in text
    assert "is not a whole number from 1 to 1000: ignored (no spillover)" in text
