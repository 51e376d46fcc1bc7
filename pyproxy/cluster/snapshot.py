"""A cluster snapshot: Nodes, Services, EndpointSlices and ServiceCIDRs as `kubectl get -o
yaml|json` prints them (a `kind: List`, several YAML documents, or single objects), turned
into the model by the daemon's `ClusterCache`: the offline commands and the daemon's --snapshot
read a file through the same items (`snapshot_items`) and the same cache.

Parsing is pure (text in, model out); only `load_snapshot` touches the file system.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyproxy import yamlfile
from pyproxy.cluster.cache import ClusterCache
from pyproxy.core.model import ClusterState, Skipped
from pyproxy.core.wire import SliceDoc, metadata
from pyproxy.memory import gc_paused


class SnapshotError(ValueError):
    """The snapshot as a whole cannot be read (not YAML/JSON, not objects, beyond the
    limits)."""


# The largest cluster Kubernetes supports (10,000 Services, 150,000 Pods, 5,000 Nodes) comes
# to ~200 MB as `kubectl get -o json` by our estimate (bench/synth.py's objects: 9 KB of JSON
# per Service with its 10 endpoints); read as YAML, a snapshot takes about 4 times its size
# in memory (make bench-yaml).
MAX_SNAPSHOT_BYTES = 512 << 20


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
        text = read_snapshot(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"cannot read {path}: {err}") from None
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}") from None
    try:
        return parse_snapshot(text)
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}") from None


def read_snapshot(path: str | Path) -> bytes:
    """A snapshot file's bytes; SnapshotError beyond MAX_SNAPSHOT_BYTES (naming the limit;
    the caller names the file), OSError when it cannot be read."""
    try:
        return yamlfile.read_limited(path, MAX_SNAPSHOT_BYTES, "a snapshot")
    except yamlfile.TooLargeError as err:
        raise SnapshotError(str(err)) from None


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
    """The state of a snapshot's objects (dicts, or EndpointSlices as the API's decoder makes
    them), built as the daemon builds its own: the snapshot's items fed to a `ClusterCache`."""
    with gc_paused():  # many small objects, no cycles: the cyclic GC would only slow it down
        cache = ClusterCache("")
        _feed(cache, snapshot_items(objects))
        return cache.state()


def _feed(cache: ClusterCache, items: SnapshotItems) -> None:
    """A snapshot's items into a fresh cache, one add event each (the daemon's snapshot
    source sends the same ones through its handler, and later only what changed)."""
    cache.set_snapshot_skipped(items.skipped)
    for (kind, namespace, name), obj in items.objects.items():
        if kind == "Service":
            cache.set_service((namespace, name), obj)
        elif kind == "EndpointSlice":
            cache.set_slice((namespace, name), obj)
        elif kind == "Node":
            cache.set_node(name, obj)
        else:
            cache.set_service_cidr(name, obj)


# The kinds the cache keeps, and the API one of per namespace/name: a snapshot holding two
# is two versions of one object (files concatenated, a resource listed twice).
_KINDS = ("Service", "EndpointSlice", "Node", "ServiceCIDR")
_CLUSTER_SCOPED = ("Node", "ServiceCIDR")

# (kind, namespace, name): "" the namespace of cluster-scoped kinds.
ObjectRef = tuple[str, str, str]


@dataclass(frozen=True)
class SnapshotItems:
    """A snapshot as a source feeds it to the cache: the objects of the kinds the proxy reads,
    one per kind and namespace/name (the last copy, as applying the file in order would
    leave it; in the order of those copies), and the items no event carries, with why."""

    objects: dict[ObjectRef, Any]
    skipped: tuple[Skipped, ...]


def snapshot_items(objects: Iterable[Any]) -> SnapshotItems:
    """Every command reading a snapshot (explain, render, apply, trace, the daemon's
    --snapshot) keeps and drops the same items for the same reasons."""
    objects = list(objects)
    keyed: list[tuple[int, ObjectRef | None]] = []
    skipped: list[Skipped] = []
    for index, obj in enumerate(objects, 1):
        kind = (obj.get("kind") if isinstance(obj, Mapping)
                else "EndpointSlice" if type(obj) is SliceDoc else None)
        if kind in _KINDS:
            ref = _ref(kind, obj)
            keyed.append((index, ref))
            if ref is None:
                skipped.append(Skipped(kind, "", "", f"item {index} has no metadata.name"))
        elif isinstance(kind, str) and kind:
            skipped.append(Skipped(kind, "", _name_of(obj), "kind not used by the proxy",
                                   invalid=False))
        else:
            skipped.append(Skipped(f"item {index}", "", "", _not_kubernetes(obj)))
    last = {ref: index for index, ref in keyed if ref is not None}
    duplicates = [Skipped(*ref, f"duplicate: item {index} is ignored, item {last[ref]} (the "
                          f"same {ref[0]}, later in the snapshot) is used")
                  for index, ref in keyed if ref is not None and last[ref] != index]
    used = {ref: objects[index - 1] for ref, index in sorted(last.items(), key=lambda i: i[1])}
    return SnapshotItems(used, (*duplicates, *skipped))


def _ref(kind: str, obj: Any) -> ObjectRef | None:
    """An object's kind and namespace/name as the API keys it; None without a name."""
    name = _name_of(obj)
    if not name:
        return None
    if kind in _CLUSTER_SCOPED:
        return kind, "", name
    namespace = metadata(obj).get("namespace")
    return kind, namespace if isinstance(namespace, str) and namespace else "default", name


def _not_kubernetes(obj: Any) -> str:
    if isinstance(obj, Mapping):
        name = _name_of(obj)
        return "not a Kubernetes object: it has no kind" + (f" (metadata.name {name})"
                                                             if name else "")
    names = {str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return f"not a Kubernetes object: {names.get(type(obj), type(obj).__name__)}"


def _name_of(obj: Any) -> str:
    name = metadata(obj).get("name")
    return name if isinstance(name, str) else ""


def _documents(text: str) -> list[Any]:
    """The documents of a snapshot; JSON (what `kubectl -o json` prints) by its own decoder,
    the rest through the YAML reader (libyaml)."""
    try:
        with gc_paused():  # a million small objects, no cycles
            if text.lstrip().startswith(("{", "[")):
                try:
                    return [yamlfile.load_json(text)]
                except json.JSONDecodeError:
                    pass  # YAML is a superset of JSON; let the YAML parser report the error
            return [doc for doc in yamlfile.load_all(text) if doc is not None]
    except yamlfile.DocumentError as err:
        raise SnapshotError(str(err)) from None


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
