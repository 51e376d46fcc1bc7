"""A cluster snapshot: Nodes, Services, EndpointSlices and ServiceCIDRs as `kubectl get -o
yaml|json` prints them (a `kind: List`, several YAML documents, or single objects), turned
into the model.

Parsing is pure (text in, model out); only `load_snapshot` touches the file system.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
from pyproxy.memory import gc_paused


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
    """`parse_snapshot` of a file; errors name it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"cannot read {path}: {err}") from None
    try:
        return parse_snapshot(text)
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}") from None


def nothing_usable(state: ClusterState) -> str | None:
    """Why a snapshot gives a node no rules at all (None: something is usable). An empty file,
    YAML that is not Kubernetes objects, or objects that are all invalid or not proxied
    are most likely the wrong file: a real cluster has at least its `kubernetes` Service."""
    if state.ports_by_service or state.slices or state.nodes or state.service_cidrs:
        return None
    if not state.skipped:
        return "no objects"
    shown = "; ".join(f"{s.object}: {s.reason}" for s in state.skipped[:3])
    more = f"; and {len(state.skipped) - 3} more" if len(state.skipped) > 3 else ""
    return f"{len(state.skipped)} object(s), none usable: {shown}{more}"


def build_state(objects: Iterable[Any]) -> ClusterState:
    """Model objects from API objects (dicts or client models), dispatched on `kind`."""
    with gc_paused():  # many small objects, no cycles: the cyclic GC would only slow it down
        return _build_state(objects)


def _build_state(objects: Iterable[Any]) -> ClusterState:
    nodes: dict[str, Node] = {}
    ports: list[ServicePort] = []
    slices: dict[ServiceKey, list[SliceEndpoints]] = {}
    service_cidrs: list[str] = []
    objects = list(objects)
    replaced = _replaced(objects)
    skipped = list(replaced.values())
    for index, obj in enumerate(objects, 1):
        if index in replaced:
            continue
        kind = (obj.get("kind") if isinstance(obj, Mapping)
                else "EndpointSlice" if type(obj) is SliceDoc  # as the API's decoder made it
                else _model_kind(obj))
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
        elif isinstance(kind, str) and kind:
            skipped.append(Skipped(kind, "", _name_of(obj), "kind not used by the proxy",
                                   invalid=False))
        else:
            skipped.append(Skipped(f"item {index}", "", "", _not_kubernetes(obj)))
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


# Kinds that the API keeps one of per namespace/name: a snapshot holding two is two
# versions of one object (files concatenated, a resource listed twice).
_UNIQUE_KINDS = ("Service", "EndpointSlice", "Node", "ServiceCIDR")


def _replaced(objects: Sequence[Any]) -> dict[int, Skipped]:
    """The items (1-based) another item of the same kind and namespace/name comes after, and
    why they are ignored: the later one is used, as applying the file in order would leave
    it. Every command reading the snapshot (explain, render, apply, trace) drops the same."""
    last: dict[tuple[str, str, str], int] = {}
    for index, obj in enumerate(objects, 1):
        key = _identity(obj)
        if key is not None:
            last[key] = index
    replaced = {}
    for index, obj in enumerate(objects, 1):
        key = _identity(obj)
        if key is not None and last[key] != index:
            kind, namespace, name = key
            replaced[index] = Skipped(kind, namespace, name, f"duplicate: item {index} is "
                                      f"ignored, item {last[key]} (the same {kind}, later "
                                      f"in the snapshot) is used")
    return replaced


def _identity(obj: Any) -> tuple[str, str, str] | None:
    if not isinstance(obj, Mapping) or obj.get("kind") not in _UNIQUE_KINDS:
        return None
    name = _name_of(obj)
    if not name:
        return None
    cluster_scoped = obj["kind"] in ("Node", "ServiceCIDR")
    meta = obj.get("metadata")
    namespace = meta.get("namespace") if isinstance(meta, Mapping) else None
    return (obj["kind"], "" if cluster_scoped else
            namespace if isinstance(namespace, str) and namespace else "default", name)


# The kubernetes client's model classes: V1Service, V1EndpointSlice, V2HorizontalPod…
_MODEL_CLASS = re.compile(r"V\d+(?:alpha\d+|beta\d+)?([A-Z]\w*)")


def _model_kind(obj: Any) -> str | None:
    match = _MODEL_CLASS.fullmatch(type(obj).__name__)
    return match[1] if match else None


def _not_kubernetes(obj: Any) -> str:
    if isinstance(obj, Mapping):
        name = _name_of(obj)
        return "not a Kubernetes object: it has no kind" + (f" (metadata.name {name})"
                                                             if name else "")
    names = {str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return f"not a Kubernetes object: {names.get(type(obj), type(obj).__name__)}"


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
        raise SnapshotError(f"not valid YAML or JSON: {_yaml_problem(err)}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The parser's complaint and where, on one line (its own text names "<unicode string>")."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{context + ': ' if context else ''}{problem}{where}"


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
