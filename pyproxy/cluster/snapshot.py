"""A cluster snapshot: Nodes, Services, EndpointSlices and ServiceCIDRs as `kubectl get -o
yaml|json` prints them (a `kind: List`, several YAML documents, or single objects), turned
into the model.

Parsing is pure (text in, model out); only `load_snapshot` touches the file system.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from pyproxy.core.convert import (
    convert_endpoint_slice,
    convert_node,
    convert_service,
    convert_service_cidr,
)
from pyproxy.core.model import (
    ClusterState,
    Node,
    ServiceKey,
    ServicePort,
    Skipped,
    SliceEndpoints,
    all_cidrs,
)
from pyproxy.core.wire import SliceDoc
from pyproxy.sync.gcutil import gc_paused


class SnapshotError(ValueError):
    """The snapshot as a whole cannot be read (not YAML/JSON, not objects)."""


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
        kind = (obj.get("kind") if isinstance(obj, Mapping)
                else "EndpointSlice" if type(obj) is SliceDoc  # as the API's decoder made it
                else type(obj).__name__[2:])
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
