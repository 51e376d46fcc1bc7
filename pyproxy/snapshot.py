"""A cluster snapshot: Nodes, Services, EndpointSlices and ServiceCIDRs as `kubectl get -o
yaml|json` prints them (a `kind: List`, several YAML documents, or single objects), turned
into the model.

Parsing is pure (text in, model out); only `load_snapshot` touches the file system.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pyproxy.convert import (
    convert_endpoint_slice,
    convert_node,
    convert_service,
    convert_service_cidr,
)
from pyproxy.endpoints import merge_slices
from pyproxy.gcutil import gc_paused
from pyproxy.model import (
    Endpoint,
    IPFamily,
    Node,
    ServiceKey,
    ServicePort,
    ServicePortName,
    Skipped,
    SliceEndpoints,
)


class SnapshotError(ValueError):
    """The snapshot as a whole cannot be read (not YAML/JSON, not objects)."""


@dataclass(frozen=True)
class ClusterState:
    """What the proxy knows about the cluster. The daemon's cache hands out a view over its
    live dictionaries; a snapshot file gives a fixed one."""

    nodes: Mapping[str, Node] = field(default_factory=dict)
    ports_by_service: Mapping[ServiceKey, tuple[ServicePort, ...]] = field(default_factory=dict)
    slices: Mapping[ServiceKey, tuple[SliceEndpoints, ...]] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()
    # Every CIDR of every ServiceCIDR object (both families, sorted, each once): addresses in
    # them that are no ClusterIP are dropped. Empty: none known (or the API does not serve
    # them), and nothing is dropped.
    service_cidrs: tuple[str, ...] = ()

    @property
    def ports(self) -> tuple[ServicePort, ...]:
        """Every service port, ordered by service then by port."""
        return tuple(port for key in sorted(self.ports_by_service)
                     for port in self.ports_by_service[key])

    def node(self, name: str) -> Node:
        """This node's object; a node missing from the state has no labels."""
        return self.nodes.get(name) or Node(name)

    def ports_of(self, service: ServiceKey) -> tuple[ServicePort, ...]:
        return self.ports_by_service.get(service, ())

    def node_labels(self) -> dict[str, Mapping[str, str]]:
        return {name: node.labels for name, node in self.nodes.items()}

    def endpoints(self, port: ServicePortName, family: IPFamily) -> tuple[Endpoint, ...]:
        return merge_slices(self.slices.get(port.service, ()), port, family)


def parse_snapshot(text: str) -> ClusterState:
    """Parse YAML or JSON text. Bad objects are skipped with a reason; only text that is not
    YAML/JSON at all raises SnapshotError."""
    return build_state(parse_objects(text))


def parse_objects(text: str) -> list[Any]:
    """The API objects of a snapshot, as plain data (Lists flattened)."""
    return list(_objects(_documents(text)))


def load_snapshot(path: str | Path) -> ClusterState:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"cannot read {path}: {err}") from None
    return parse_snapshot(text)


def build_state(objects: Iterable[Any]) -> ClusterState:
    """Model objects from API objects (dicts or client models), dispatched on `kind`."""
    with gc_paused():  # many small objects, no cycles: the cyclic GC would only slow it down
        return _build_state(objects)


def _build_state(objects: Iterable[Any]) -> ClusterState:
    nodes: dict[str, Node] = {}
    ports: list[ServicePort] = []
    slices: dict[ServiceKey, list[SliceEndpoints]] = {}
    skipped: list[Skipped] = []
    service_cidrs: list[str] = []
    for obj in objects:
        kind = obj.get("kind") if isinstance(obj, Mapping) else type(obj).__name__[2:]
        if kind == "Service":
            result = convert_service(obj)
            if isinstance(result, Skipped):
                skipped.append(result)
            else:
                ports.extend(result)
        elif kind == "EndpointSlice":
            piece = convert_endpoint_slice(obj)
            if isinstance(piece, Skipped):
                skipped.append(piece)
            else:
                slices.setdefault(piece.service, []).append(piece)
        elif kind == "Node":
            node = convert_node(obj)
            if isinstance(node, Skipped):
                skipped.append(node)
            else:
                nodes[node.name] = node
        elif kind == "ServiceCIDR":
            cidrs = convert_service_cidr(obj)
            if isinstance(cidrs, Skipped):
                skipped.append(cidrs)
            else:
                service_cidrs.extend(cidrs)
        else:
            skipped.append(Skipped(str(kind), "", _name_of(obj), "kind not used by the proxy",
                                   invalid=kind is None))
    ports.sort(key=lambda p: (p.name.namespace, p.name.name, p.name.port, p.name.protocol))
    by_service: dict[ServiceKey, list[ServicePort]] = {}
    for port in ports:
        by_service.setdefault(port.name.service, []).append(port)
    return ClusterState(
        ports_by_service={key: tuple(value) for key, value in by_service.items()},
        nodes=nodes,
        slices={key: tuple(value) for key, value in slices.items()},
        skipped=tuple(skipped),
        service_cidrs=all_cidrs(service_cidrs),
    )


def all_cidrs(cidrs: Iterable[str]) -> tuple[str, ...]:
    """The CIDRs of several ServiceCIDRs as ClusterState holds them: each once, in a stable
    order (the same objects always render the same set)."""
    return tuple(sorted(set(cidrs)))


def _name_of(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def _documents(text: str) -> list[Any]:
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            return [json.loads(text)]
        except json.JSONDecodeError:
            pass  # YAML is a superset of JSON; let the YAML parser report the error
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as err:
        raise SnapshotError(f"not valid YAML or JSON: {err}") from None


def _objects(documents: Iterable[Any]) -> Iterator[Any]:
    """Flatten `kind: List` (and `*List`) documents and plain lists into single objects."""
    for doc in documents:
        if isinstance(doc, list):
            yield from _objects(doc)
        elif isinstance(doc, Mapping) and isinstance(doc.get("items"), list):
            item_kind = str(doc.get("kind", ""))[:-4] if str(doc.get("kind", "")).endswith(
                "List"
            ) else ""
            for item in doc["items"]:
                # The API omits kind on the items of typed lists (ServiceList, …).
                if isinstance(item, Mapping) and "kind" not in item and item_kind:
                    item = {**item, "kind": item_kind}
                yield item
        elif isinstance(doc, Mapping):
            yield doc
        else:
            raise SnapshotError(f"a document is neither an object nor a list: {doc!r:.80}")
