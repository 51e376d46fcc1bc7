"""Builders for API objects in tests: a sensible default plus a tweak callback, in the spirit of
upstream's makeTestService / makeTestEndpointSlice.

IP plan used across the tests (keep new tests inside it):
  nodes          node-a (zone-1), node-b (zone-1), node-c (zone-2); region region-1
  cluster CIDR   10.244.0.0/16, fd00:244::/48 (pods: 10.244.<node>.<n>)
  service CIDR   10.96.0.0/16, fd00:96::/108
  external IPs   192.0.2.0/24; LoadBalancer IPs 198.51.100.0/24; clients 203.0.113.0/24
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyproxy.core.model import ServicePort

Obj = dict[str, Any]


def make_service(
    namespace: str, name: str, tweak: Callable[[Obj], None] | None = None, ip: str = "10.96.0.10"
) -> Obj:
    svc: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }
    if tweak:
        tweak(svc)
    return svc


def annotated_port(annotations: dict[str, str], name: str = "web") -> ServicePort:
    """The first port of make_service's Service with these annotations, as pyproxy reads it
    (what a test of an annotation asks)."""
    from pyproxy.core.convert import convert_service
    from pyproxy.core.model import Skipped

    result = convert_service(make_service("ns", name, lambda s: s["metadata"].update(
        annotations=annotations)))
    assert not isinstance(result, Skipped), result
    return result[0]


def make_slice(
    namespace: str,
    service: str,
    endpoints: list[Obj],
    tweak: Callable[[Obj], None] | None = None,
    name: str | None = None,
    family: str = "IPv4",
) -> Obj:
    eps: Obj = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": namespace,
            "name": name or f"{service}-{family.lower()}",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }
    if tweak:
        tweak(eps)
    return eps


def ep(
    ip: str,
    node: str | None = None,
    zone: str | None = None,
    *,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    zones: list[str] | None = None,
    nodes: list[str] | None = None,
) -> Obj:
    out: Obj = {"addresses": [ip], "conditions": {}}
    for key, value in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if value is not None:
            out["conditions"][key] = value
    if node:
        out["nodeName"] = node
    if zone:
        out["zone"] = zone
    hints: Obj = {}
    if zones is not None:
        hints["forZones"] = [{"name": z} for z in zones]
    if nodes is not None:
        hints["forNodes"] = [{"name": n} for n in nodes]
    if hints:
        out["hints"] = hints
    return out


def make_node(name: str, zone: str | None = None, **labels: str) -> Obj:
    all_labels = {"kubernetes.io/hostname": name, **labels}
    if zone:
        all_labels["topology.kubernetes.io/zone"] = zone
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": all_labels}}


def terminating(ip: str, node: str | None = None, zone: str | None = None, serving: bool = True,
                **kw: Any) -> Obj:
    return ep(ip, node, zone, ready=False, serving=serving, terminating=True, **kw)


def make_service_cidr(name: str, *cidrs: str, tweak: Callable[[Obj], None] | None = None) -> Obj:
    obj: Obj = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": list(cidrs)},
    }
    if tweak:
        tweak(obj)
    return obj
