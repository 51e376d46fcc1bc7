"""The emulated resources: identity, field labels, and the server-side "strategy".

The strategy is the part of the real registry that pyproxy can observe: defaulting (Service
ports get ``protocol: TCP``, a ClusterIP is allocated, EndpointSlice ports get ``name: ""``),
status being ignored on main-resource writes, and ``metadata.generation`` for EndpointSlices.
Validation is deliberately thin: only what a client can trip over by mistake (missing name,
missing ``addressType``), so tests get the same 4xx a real server would give for those.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENDPOINTSLICES", "NODES", "RESOURCES", "SERVICECIDRS", "SERVICES", "Allocator",
           "ResourceDef"]

Obj = dict[str, Any]


@dataclass(frozen=True)
class ResourceDef:
    plural: str
    singular: str
    kind: str
    group: str  # "" for the core group
    version: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    # Field labels the real server accepts in fieldSelector (beyond these: 400 BadRequest).
    field_labels: frozenset[str] = frozenset({"metadata.name", "metadata.namespace"})
    # Services answer DELETE with the deleted object, the others with a Status (as upstream).
    returns_deleted_object: bool = False
    # Upstream lets PUT create a missing Service, not a missing Node or EndpointSlice.
    allow_create_on_update: bool = False
    has_status: bool = False
    # Kubelet registers a Node with its status in the create call; a Service's create clears it.
    create_keeps_status: bool = False
    tracks_generation: bool = False
    verbs: tuple[str, ...] = field(
        default=("create", "delete", "get", "list", "patch", "update", "watch")
    )

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def qualified(self) -> str:
        """``services`` / ``endpointslices.discovery.k8s.io``, as in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def typed(self, obj: Obj) -> Obj:
        """The object with ``kind``/``apiVersion`` first, as single-object responses carry."""
        return {"kind": self.kind, "apiVersion": self.api_version, **obj}


SERVICES = ResourceDef(
    plural="services",
    singular="service",
    kind="Service",
    group="",
    version="v1",
    namespaced=True,
    short_names=("svc",),
    field_labels=frozenset({"metadata.name", "metadata.namespace", "spec.clusterIP", "spec.type"}),
    returns_deleted_object=True,
    allow_create_on_update=True,
    has_status=True,
)
NODES = ResourceDef(
    plural="nodes",
    singular="node",
    kind="Node",
    group="",
    version="v1",
    namespaced=False,
    short_names=("no",),
    field_labels=frozenset({"metadata.name", "spec.unschedulable"}),
    has_status=True,
    create_keeps_status=True,
)
ENDPOINTSLICES = ResourceDef(
    plural="endpointslices",
    singular="endpointslice",
    kind="EndpointSlice",
    group="discovery.k8s.io",
    version="v1",
    namespaced=True,
    tracks_generation=True,
)
# Cluster-scoped, networking.k8s.io/v1 since Kubernetes 1.33. No strategy beyond the generic
# one: pyproxy reads spec.cidrs only (the real server validates them and keeps them immutable).
SERVICECIDRS = ResourceDef(
    plural="servicecidrs",
    singular="servicecidr",
    kind="ServiceCIDR",
    group="networking.k8s.io",
    version="v1",
    namespaced=False,
    has_status=True,
)
# Written, never read by pyproxy: it records one Event when it starts (as kube-proxy does).
# Accepted and stored so the daemon's start is the same against the emulator as against a
# real apiserver (without it: 405 and five logged retries).
EVENTS = ResourceDef(
    plural="events",
    singular="event",
    kind="Event",
    group="events.k8s.io",
    version="v1",
    namespaced=True,
    short_names=("ev",),
)
RESOURCES: dict[str, ResourceDef] = {
    r.plural: r for r in (SERVICES, NODES, ENDPOINTSLICES, SERVICECIDRS, EVENTS)}


def field_values(resource: ResourceDef, obj: Obj) -> dict[str, str]:
    """The field-label values of an object, as strings (like the server's GetAttrs)."""
    meta = obj.get("metadata", {})
    spec = obj.get("spec", {}) or {}
    values = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
    }
    if resource is SERVICES:
        values["spec.clusterIP"] = spec.get("clusterIP", "")
        values["spec.type"] = spec.get("type", "")
    elif resource is NODES:
        values["spec.unschedulable"] = "true" if spec.get("unschedulable") else "false"
    return values


class Allocator:
    """Hands out ClusterIPs and NodePorts the way a fresh cluster would (sequential, no reuse
    of addresses still held by a live Service)."""

    def __init__(self, service_cidr: str = "10.96.0.0/16", node_ports: range = range(30000, 32768)):
        self._ips: Iterator[ipaddress.IPv4Address | ipaddress.IPv6Address] = itertools.islice(
            ipaddress.ip_network(service_cidr).hosts(),
            1,
            None,  # .1 is the kubernetes Service
        )
        self._ports = iter(node_ports)
        self.cidr = service_cidr

    def cluster_ip(self, in_use: Callable[[str], bool]) -> str:
        for ip in self._ips:
            if not in_use(str(ip)):
                return str(ip)
        raise RuntimeError(f"service CIDR {self.cidr} exhausted")

    def node_port(self, in_use: Callable[[int], bool]) -> int:
        for port in self._ports:
            if not in_use(port):
                return port
        raise RuntimeError("node port range exhausted")

    @property
    def ip_family(self) -> str:
        return "IPv6" if ":" in self.cidr else "IPv4"


# --- strategies ------------------------------------------------------------------------------


class Invalid(ValueError):
    """Validation failure; the server answers 422 with ``reason: Invalid``."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path


@dataclass
class Allocated:
    """What Service defaulting needs from the store: allocators and "already used" lookups."""

    allocator: Allocator
    ip_in_use: Callable[[str], bool]
    port_in_use: Callable[[int], bool]


def prepare(
    resource: ResourceDef, new: Obj, old: Obj | None, *, keep_status: bool, alloc: Allocated
) -> None:
    """Apply the resource's strategy to ``new`` in place (before metadata is stamped).

    ``keep_status`` is set for writes to the main resource over HTTP: the real server ignores
    ``status`` there (it is written through ``/status``). In-process helpers pass False so tests
    can set any status directly.
    """
    if keep_status and resource.has_status:
        if old is not None:
            new["status"] = old.get("status", {})
        elif not resource.create_keeps_status:
            new.pop("status", None)
    if resource is SERVICES:
        _default_service(new, old, alloc)
    elif resource is ENDPOINTSLICES:
        _default_endpointslice(new)
    elif resource is NODES:
        new.setdefault("spec", {})
        new.setdefault("status", {})


def prepare_status_update(new: Obj, old: Obj) -> None:
    """``PUT/PATCH .../status``: only ``status`` changes, everything else is the stored object's."""
    status = new.get("status", {})
    new.clear()
    new.update({k: v for k, v in old.items() if k != "status"})
    new["status"] = status


def next_generation(resource: ResourceDef, new: Obj, old: Obj | None) -> int | None:
    """EndpointSlice upstream: 1 on create, +1 when anything but metadata (or labels) changed."""
    if not resource.tracks_generation:
        return None
    if old is None:
        return 1
    generation = int(old.get("metadata", {}).get("generation", 1))
    strip = ("metadata", "kind", "apiVersion")
    changed = {k: v for k, v in new.items() if k not in strip} != {
        k: v for k, v in old.items() if k not in strip
    }
    labels_changed = new.get("metadata", {}).get("labels") != old.get("metadata", {}).get("labels")
    return generation + 1 if changed or labels_changed else generation


def _default_service(svc: Obj, old: Obj | None, alloc: Allocated) -> None:
    spec = svc.setdefault("spec", {})
    status = svc.setdefault("status", {})
    status.setdefault("loadBalancer", {})
    svc_type = spec.setdefault("type", "ClusterIP")
    if svc_type == "ExternalName":
        if not spec.get("externalName"):
            raise Invalid("spec.externalName", "Required value")
        return
    spec.setdefault("sessionAffinity", "None")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    if not spec.get("ports") and spec.get("clusterIP") != "None":
        raise Invalid("spec.ports", "Required value")
    _default_cluster_ip(spec, (old or {}).get("spec", {}), alloc)
    spec.setdefault("ipFamilies", [alloc.allocator.ip_family])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    if svc_type in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
        _default_node_ports(spec, (old or {}).get("spec", {}), alloc)
    if svc_type == "LoadBalancer":
        spec.setdefault("allocateLoadBalancerNodePorts", True)


def _default_cluster_ip(spec: Obj, old_spec: Obj, alloc: Allocated) -> None:
    # An update that omits clusterIP keeps the allocated one (upstream "patchAllocatedValues").
    if not spec.get("clusterIP") and old_spec.get("clusterIP"):
        spec["clusterIP"] = old_spec["clusterIP"]
        spec.setdefault("clusterIPs", old_spec.get("clusterIPs", [old_spec["clusterIP"]]))
    if not spec.get("clusterIP"):
        spec["clusterIP"] = alloc.allocator.cluster_ip(alloc.ip_in_use)
    elif old_spec.get("clusterIP") and spec["clusterIP"] != old_spec["clusterIP"]:
        raise Invalid("spec.clusterIPs[0]", "Invalid value: field is immutable")
    spec.setdefault("clusterIPs", [spec["clusterIP"]])


def _default_node_ports(spec: Obj, old_spec: Obj, alloc: Allocated) -> None:
    old_ports = {(p.get("port"), p.get("protocol", "TCP")): p for p in old_spec.get("ports") or []}
    for port in spec.get("ports") or []:
        if port.get("nodePort"):
            continue
        previous = old_ports.get((port.get("port"), port.get("protocol")), {}).get("nodePort")
        port["nodePort"] = previous or alloc.allocator.node_port(alloc.port_in_use)


def _default_endpointslice(eps: Obj) -> None:
    if not eps.get("addressType"):
        raise Invalid("addressType", "Required value")
    # "endpoints" has no omitempty upstream: an empty slice is serialized as null.
    eps.setdefault("endpoints", None)
    for port in eps.get("ports") or []:
        port.setdefault("name", "")
        port.setdefault("protocol", "TCP")


# --- discovery documents ---------------------------------------------------------------------


def api_resource_list(group_version: str) -> Obj:
    resources: list[Obj] = []
    for res in RESOURCES.values():
        if res.api_version != group_version:
            continue
        resources.append(
            {
                "name": res.plural,
                "singularName": res.singular,
                "namespaced": res.namespaced,
                "kind": res.kind,
                "verbs": list(res.verbs),
                **({"shortNames": list(res.short_names)} if res.short_names else {}),
            }
        )
        if res.has_status:
            resources.append(
                {
                    "name": f"{res.plural}/status",
                    "singularName": "",
                    "namespaced": res.namespaced,
                    "kind": res.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }


def api_group(name: str) -> Obj:
    version = {"groupVersion": f"{name}/v1", "version": "v1"}
    return {"name": name, "versions": [version], "preferredVersion": version}


def group_names() -> list[str]:
    return sorted({r.group for r in RESOURCES.values() if r.group})
