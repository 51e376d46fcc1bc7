"""The daemon's view of the cluster, and the changes waiting for the next sync. Pure. The
offline commands build their state here too, from a snapshot's items (`cluster.snapshot`).

Event handlers only record (as upstream's trackers do): each Service or EndpointSlice event
updates the cache and remembers, per Service, what it looked like before the first pending
change. A sync checks the changes out; a Service whose current form equals that first
"previous" (an add then a delete, an update and its revert) costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyproxy.core.convert import convert_service, convert_service_cidr
from pyproxy.core.convert_endpoints import convert_endpoint_slice, convert_node
from pyproxy.core.model import (
    ClusterState,
    Node,
    ObjectKey,
    ServiceKey,
    ServicePort,
    Skipped,
    SliceEndpoints,
    all_cidrs,
)


@dataclass(frozen=True)
class Checkout:
    """What changed since the last checkout."""

    services: frozenset[ServiceKey]
    # This node's labels changed (zone, …): every service must be selected again.
    topology_changed: bool
    service_changes: int
    endpoint_changes: int
    # `endpoints.kubernetes.io/last-change-trigger-time` of the slices that changed.
    trigger_times: tuple[str, ...] = ()
    # The ServiceCIDRs' CIDRs changed: only the skeleton is rendered again.
    service_cidrs_changed: bool = False


@dataclass
class ClusterCache:
    node_name: str
    _ports: dict[ServiceKey, tuple[ServicePort, ...]] = field(default_factory=dict)
    _slices: dict[ServiceKey, dict[str, SliceEndpoints]] = field(default_factory=dict)
    _slice_view: dict[ServiceKey, tuple[SliceEndpoints, ...]] = field(default_factory=dict)
    _slice_owner: dict[ObjectKey, ServiceKey] = field(default_factory=dict)
    _nodes: dict[str, Node] = field(default_factory=dict)
    _skipped: dict[tuple[str, str, str], Skipped] = field(default_factory=dict)
    _uses_node_labels: set[ServiceKey] = field(default_factory=set)
    # Services to select again because another node's labels changed: their ports and slices
    # are unchanged, so the before/after comparison in checkout cannot see it.
    _relabelled: set[ServiceKey] = field(default_factory=set)
    # First "previous" per service since the last checkout.
    _service_before: dict[ServiceKey, tuple[ServicePort, ...] | None] = field(default_factory=dict)
    _endpoints_before: dict[ServiceKey, tuple[SliceEndpoints, ...]] = field(default_factory=dict)
    _trigger_times: list[str] = field(default_factory=list)
    _topology_changed: bool = False
    # ServiceCIDR name → its CIDRs, and all of them as the state hands them out.
    _service_cidrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _all_service_cidrs: tuple[str, ...] = ()
    _service_cidrs_changed: bool = False
    # What the snapshot file last read holds that no event carries (earlier copies of an
    # object, items that are no Kubernetes objects, other kinds): none from the API.
    _snapshot_skipped: tuple[Skipped, ...] = ()

    # -- events ------------------------------------------------------------------------------

    def set_service(self, key: ObjectKey, obj: Any | None) -> Skipped | None:
        """A Service was added/updated (obj) or deleted (None). Returns why it was skipped,
        when it was. An invalid update keeps the last valid version in force: bad input must
        not take a working service away."""
        service = ServiceKey(*key)
        if obj is None:
            self._skipped.pop(("Service", *key), None)
            self._put_ports(service, None)
            return None
        result = convert_service(obj)
        if isinstance(result, Skipped):
            self._skipped[("Service", *key)] = result
            if not result.invalid:
                self._put_ports(service, None)  # e.g. became headless: no longer ours
            return result
        self._skipped.pop(("Service", *key), None)
        self._put_ports(service, result)
        return None

    def set_slice(self, key: ObjectKey, obj: Any | None) -> Skipped | None:
        """An EndpointSlice was added/updated (obj) or deleted (None)."""
        name = key[1]
        if obj is None:
            self._skipped.pop(("EndpointSlice", *key), None)
            self._remove_slice(key)
            return None
        piece = convert_endpoint_slice(obj)
        if isinstance(piece, Skipped):
            self._skipped[("EndpointSlice", *key)] = piece
            if not piece.invalid:
                self._remove_slice(key)
            return piece
        self._skipped.pop(("EndpointSlice", *key), None)
        owner = self._slice_owner.get(key)
        if owner is not None and owner != piece.service:
            self._remove_slice(key)  # its service-name label changed
        elif self._slices.get(piece.service, {}).get(name) == piece:
            return None  # nothing changed (a relist, a resync): no sync, no latency sample
        self._remember_endpoints(piece.service)
        self._slices.setdefault(piece.service, {})[name] = piece
        self._slice_owner[key] = piece.service
        self._refresh_slice_view(piece.service)
        if piece.trigger_time:
            self._trigger_times.append(piece.trigger_time)
        return None

    def set_node(self, name: str, obj: Any | None) -> Skipped | None:
        old = self._nodes.get(name)
        if obj is None:
            node = None
        else:
            converted = convert_node(obj)
            if isinstance(converted, Skipped):
                self._skipped[("Node", "", name)] = converted
                return converted
            self._skipped.pop(("Node", "", name), None)
            node = converted
        if node is None:
            self._nodes.pop(name, None)
        else:
            self._nodes[name] = node
        if name == self.node_name and _own_addresses(old) != _own_addresses(node):
            # This node's IPs or pod CIDRs: its configuration is derived again, and every
            # service rendered with it.
            self._topology_changed = True
        old_labels = dict(old.labels) if old else None
        new_labels = dict(node.labels) if node else None
        if old_labels != new_labels:
            if name == self.node_name:
                self._topology_changed = True
            else:
                # Other nodes' labels matter only to services with topology keys or spillover.
                self._relabelled.update(self._uses_node_labels)
        return None

    def set_service_cidr(self, name: str, obj: Any | None) -> Skipped | None:
        """A ServiceCIDR was added/updated (obj) or deleted (None). An invalid update keeps
        the last valid CIDRs in force, as for Services."""
        if obj is None:
            self._skipped.pop(("ServiceCIDR", "", name), None)
            self._service_cidrs.pop(name, None)
        else:
            cidrs = convert_service_cidr(obj)
            if isinstance(cidrs, Skipped):
                self._skipped[("ServiceCIDR", "", name)] = cidrs
                return cidrs
            self._skipped.pop(("ServiceCIDR", "", name), None)
            self._service_cidrs[name] = cidrs
        merged = all_cidrs(c for cidrs in self._service_cidrs.values() for c in cidrs)
        if merged != self._all_service_cidrs:
            self._all_service_cidrs = merged
            self._service_cidrs_changed = True
        return None

    def set_snapshot_skipped(self, skipped: tuple[Skipped, ...]) -> None:
        """The items of the snapshot last read that carry no event, and why (from
        `cluster.snapshot.snapshot_items`). They change no rules: nothing to sync."""
        self._snapshot_skipped = skipped

    # -- the state and the pending changes ---------------------------------------------------

    def state(self) -> ClusterState:
        """A view over the live cache (valid until the next event)."""
        return ClusterState(
            nodes=self._nodes, ports_by_service=self._ports, slices=self._slice_view,
            skipped=self._snapshot_skipped + tuple(self._skipped.values()),
            service_cidrs=self._all_service_cidrs,
        )

    @property
    def node(self) -> Node | None:
        return self._nodes.get(self.node_name)

    def pending(self) -> tuple[int, int]:
        """(service changes, endpoint changes) waiting for a sync."""
        return len(self._service_before), len(self._endpoints_before)

    def has_pending(self) -> bool:
        return bool(self._service_before or self._endpoints_before or self._topology_changed
                    or self._service_cidrs_changed or self._relabelled)

    def checkout(self) -> Checkout:
        services = {key for key, before in self._service_before.items()
                    if before != self._ports.get(key)}
        endpoints = {key for key, before in self._endpoints_before.items()
                     if before != self._slice_view.get(key, ())}
        relabelled = self._relabelled & self._ports.keys()
        result = Checkout(
            services=frozenset(services | endpoints | relabelled),
            topology_changed=self._topology_changed,
            service_changes=len(services),
            endpoint_changes=len(endpoints),
            trigger_times=tuple(self._trigger_times),
            service_cidrs_changed=self._service_cidrs_changed,
        )
        self._service_before.clear()
        self._endpoints_before.clear()
        self._trigger_times.clear()
        self._relabelled.clear()
        self._topology_changed = False
        self._service_cidrs_changed = False
        return result

    def services(self) -> Mapping[ServiceKey, tuple[ServicePort, ...]]:
        return self._ports

    # -- helpers -----------------------------------------------------------------------------

    def _remember_service(self, service: ServiceKey) -> None:
        if service not in self._service_before:
            self._service_before[service] = self._ports.get(service)

    def _remember_endpoints(self, service: ServiceKey) -> None:
        if service not in self._endpoints_before:
            self._endpoints_before[service] = self._slice_view.get(service, ())

    def _put_ports(self, service: ServiceKey, ports: tuple[ServicePort, ...] | None) -> None:
        if self._ports.get(service) == ports:
            return
        self._remember_service(service)
        if ports is None:
            self._ports.pop(service, None)
            self._uses_node_labels.discard(service)
            return
        self._ports[service] = ports
        # Spillover's region level reads other nodes' region labels (slices carry no region).
        if any(key not in ("*", "kubernetes.io/hostname")
               for port in ports for key in port.topology_keys) or any(
                port.topology_min_endpoints for port in ports):
            self._uses_node_labels.add(service)
        else:
            self._uses_node_labels.discard(service)

    def _remove_slice(self, key: ObjectKey) -> None:
        owner = self._slice_owner.pop(key, None)
        if owner is None:
            return
        self._remember_endpoints(owner)
        pieces = self._slices.get(owner, {})
        pieces.pop(key[1], None)
        if not pieces:
            self._slices.pop(owner, None)
        self._refresh_slice_view(owner)

    def _refresh_slice_view(self, service: ServiceKey) -> None:
        pieces = self._slices.get(service)
        if pieces:
            self._slice_view[service] = tuple(pieces[name] for name in sorted(pieces))
        else:
            self._slice_view.pop(service, None)

    def uses_node_labels(self) -> bool:
        """Whether any service needs other nodes' labels (topology keys beyond hostname, or
        topology-min-endpoints)."""
        return bool(self._uses_node_labels)


def _own_addresses(node: Node | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (node.host_ips, node.pod_cidrs) if node is not None else ((), ())
