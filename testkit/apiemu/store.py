"""Object store, resourceVersions, bounded watch history and watcher fan-out.

Everything that touches state runs under one re-entrant lock. A write bumps the single global
resourceVersion (like etcd's revision), appends one `Event` to the history and offers it to
every watcher of that resource through the watcher's own bounded queue; the watcher's HTTP thread
does the selector translation and the writing, so a slow client never blocks a writer. Stored
objects are never mutated after commit: every write builds a new dict, so events and snapshots
can share them without copying.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import copy
import itertools
import json
import queue
import random
import socket
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .patch import PatchError, apply_json_patch, apply_merge_patch
from .resources import (
    SERVICES,
    Allocated,
    Allocator,
    Invalid,
    ResourceDef,
    field_values,
    next_generation,
    prepare,
    prepare_status_update,
)
from .selection import FieldSelector, LabelSelector, SelectorError, parse_field_selector
from .selection import parse_label_selector as _parse_labels

__all__ = ["ApiError", "Event", "Filter", "ListResult", "Store", "Watcher"]

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, "application/apply-patch+yaml", STRATEGIC_PATCH)


# --- errors ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error the server reports as a ``kind: Status`` body."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(res: ResourceDef, name: str) -> Obj:
    details: Obj = {"name": name}
    if res.group:
        details["group"] = res.group
    details["kind"] = res.plural
    return details


def not_found(res: ResourceDef, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.qualified} "{name}" not found', _details(res, name))


def already_exists(res: ResourceDef, name: str) -> ApiError:
    msg = f'{res.qualified} "{name}" already exists'
    return ApiError(409, "AlreadyExists", msg, _details(res, name))


def conflict(res: ResourceDef, name: str, why: str) -> ApiError:
    msg = f'Operation cannot be fulfilled on {res.qualified} "{name}": {why}'
    return ApiError(409, "Conflict", msg, _details(res, name))


STALE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(res: ResourceDef, name: str, field: str, message: str) -> ApiError:
    details = _details(res, name) | {
        "kind": res.kind,
        "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}],
    }
    msg = f'{res.kind} "{name}" is invalid: {field}: {message}'
    return ApiError(422, "Invalid", msg, details)


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def too_large_rv(requested: int, current: int) -> ApiError:
    details = {
        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        "retryAfterSeconds": 1,
    }
    msg = f"Too large resource version: {requested}, current: {current}"
    return ApiError(504, "Timeout", msg, details)


# --- filters, events, watchers ---------------------------------------------------------------


@dataclass(frozen=True)
class Filter:
    """What a list or watch selects: path namespace plus label and field selectors."""

    resource: ResourceDef
    namespace: str | None = None
    labels: LabelSelector = field(default_factory=LabelSelector)
    fields: FieldSelector = field(default_factory=FieldSelector)

    @classmethod
    def parse(
        cls, res: ResourceDef, namespace: str | None, labels: str | None, fields: str | None
    ) -> Filter:
        """Parse query selectors; bad input raises the 400 the real server would send."""
        try:
            label_sel = _parse_labels(labels)
            field_sel = parse_field_selector(fields)
        except SelectorError as exc:
            raise bad_request(str(exc)) from exc
        for name in sorted(field_sel.fields - res.field_labels):
            gv = f"{res.group}/{res.version}" if res.group else f"/{res.version}"
            raise bad_request(
                f'Unable to find "{gv}, Resource={res.plural}" that match label selector '
                f'"{labels or ""}", field selector "{fields}": field label not supported: {name}'
            )
        return cls(res, namespace, label_sel, field_sel)

    def matches(self, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace", "") != self.namespace:
            return False
        if not self.labels.matches(meta.get("labels")):
            return False
        return self.fields.empty or self.fields.matches(field_values(self.resource, obj))


@dataclass(frozen=True)
class Event:
    """One committed change. For DELETED, ``obj`` is the last state stamped with the delete's
    resourceVersion (what the real server sends) and ``prev`` the state before."""

    rv: int
    type: str
    resource: ResourceDef
    obj: Obj
    prev: Obj | None


def with_rv(obj: Obj, rv: int) -> Obj:
    """A shallow copy of ``obj`` whose metadata carries ``rv`` (stored dicts stay untouched)."""
    return {**obj, "metadata": {**obj.get("metadata", {}), "resourceVersion": str(rv)}}


class Watcher:
    """One open watch: its filter, its bounded event queue and its socket (for abrupt drops)."""

    def __init__(self, flt: Filter, queue_size: int, sock: socket.socket | None = None) -> None:
        self.filter = flt
        self.queue: queue.Queue[Event] = queue.Queue(maxsize=queue_size)
        self.sock = sock
        self.aborted = threading.Event()
        self.overflowed = threading.Event()

    @property
    def resource(self) -> ResourceDef:
        return self.filter.resource

    def offer(self, event: Event) -> None:
        """Called by writers under the store lock; never blocks."""
        if self.overflowed.is_set():
            return
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            # The real apiserver also terminates watchers that cannot keep up.
            self.overflowed.set()

    def translate(self, event: Event) -> tuple[str, Obj] | None:
        """Map a store event onto this watch, honouring selector transitions like the
        apiserver's watch cache: entering the selection is ADDED, leaving it is DELETED
        (carrying the previous content with the new resourceVersion)."""
        now = self.filter.matches(event.obj)
        if event.type != "MODIFIED" or event.prev is None:
            return (event.type, event.obj) if now else None
        before = self.filter.matches(event.prev)
        if now:
            return ("MODIFIED" if before else "ADDED", event.obj)
        return ("DELETED", with_rv(event.prev, event.rv)) if before else None

    def abort(self) -> None:
        """Cut the stream without the terminating chunk, as a crashed server would."""
        self.aborted.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True)
class ListResult:
    resource_version: str
    items: list[Obj]
    continue_token: str | None
    remaining: int | None


# --- the store -------------------------------------------------------------------------------


def _copy_json(obj: Any) -> Any:
    """Deep copy that also proves the value is plain JSON (as it would be on the wire)."""
    return json.loads(json.dumps(obj))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # upstream's generateName alphabet


class Store:
    def __init__(
        self,
        *,
        history_size: int = 1000,
        watch_queue_size: int = 10000,
        initial_resource_version: int = 1,
        service_cidr: str = "10.96.0.0/16",
    ) -> None:
        if history_size < 1 or watch_queue_size < 1 or initial_resource_version < 1:
            raise ValueError("history_size, watch_queue_size and the initial RV must be >= 1")
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._rv = initial_resource_version
        # Every event with rv > _floor is still in _history; older RVs get 410 Expired.
        self._floor = initial_resource_version
        self._history: deque[Event] = deque()
        self._history_size = history_size
        self._queue_size = watch_queue_size
        self._objects: dict[str, dict[Key, Obj]] = {}
        # Sorted keys per resource, valid while _rv (bumped by every write) is unchanged:
        # sorting 44k keys for every page of a paged list made listing quadratic.
        self._sorted: dict[str, tuple[int, list[Key]]] = {}
        self._watchers: set[Watcher] = set()
        self._allocator = Allocator(service_cidr)
        self._cluster_ips: set[str] = set()
        self._node_ports: set[int] = set()

    # --- introspection

    @property
    def resource_version(self) -> int:
        with self.lock:
            return self._rv

    @property
    def history_floor(self) -> int:
        with self.lock:
            return self._floor

    def watchers(self, res: ResourceDef | None = None) -> list[Watcher]:
        with self.lock:
            return [w for w in self._watchers if res is None or w.resource is res]

    def _table(self, res: ResourceDef) -> dict[Key, Obj]:
        return self._objects.setdefault(res.plural, {})

    @staticmethod
    def key(res: ResourceDef, namespace: str | None, name: str) -> Key:
        return ((namespace or "") if res.namespaced else "", name)

    # --- reads

    def get(self, res: ResourceDef, namespace: str | None, name: str) -> Obj:
        with self.lock:
            obj = self._table(res).get(self.key(res, namespace, name))
        if obj is None:
            raise not_found(res, name)
        return obj

    def list_objects(
        self, flt: Filter, *, limit: int | None = None, continue_token: str | None = None
    ) -> ListResult:
        with self.lock:
            rv, start = (self._rv, None)
            if continue_token:
                rv, start = self._parse_continue(continue_token)
            # Continuation pages come from the current state, not an MVCC snapshot at `rv`.
            # A page costs its own size (as an etcd range read), not the whole table's: a
            # 44k-object list read in pages would otherwise be quadratic here.
            table = self._table(flt.resource)
            keys = self._sorted_keys(flt.resource.plural, table)
            first = 0 if start is None else bisect.bisect_right(keys, start)
            matching = ((key, table[key]) for key in itertools.islice(keys, first, None)
                        if flt.matches(table[key]))
            if limit is None or limit <= 0:
                return ListResult(str(rv), [o for _, o in matching], None, None)
            page = list(itertools.islice(matching, limit + 1))
        if len(page) <= limit:
            return ListResult(str(rv), [o for _, o in page], None, None)
        page = page[:limit]
        token = self._make_continue(rv, page[-1][0])
        remaining = None
        if flt.labels.empty and flt.fields.empty:
            remaining = len(keys) - first - limit
        return ListResult(str(rv), [o for _, o in page], token, remaining)

    def _sorted_keys(self, plural: str, table: dict[Key, Obj]) -> list[Key]:
        """The table's keys in order, sorted again only after a write (every write bumps
        _rv): sorting 44k keys for every page made a paged list quadratic."""
        cached = self._sorted.get(plural)
        if cached is None or cached[0] != self._rv:
            cached = (self._rv, sorted(table))
            self._sorted[plural] = cached
        return cached[1]

    @staticmethod
    def _make_continue(rv: int, last: Key) -> str:
        token = {"v": "meta.k8s.io/v1", "rv": rv, "start": f"{last[0]}/{last[1]}\u0000"}
        return base64.urlsafe_b64encode(json.dumps(token).encode()).decode().rstrip("=")

    def _parse_continue(self, token: str) -> tuple[int, Key]:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw)
            rv = int(data["rv"])
            ns, _, name = str(data["start"]).rstrip("\u0000").partition("/")
        except (binascii.Error, ValueError, KeyError, TypeError) as exc:
            raise bad_request(f"continue key is not valid: {exc}") from exc
        if rv < self._floor:
            raise expired(
                "The provided continue parameter is too old to display a consistent list result. "
                "You can start a new list without the continue parameter, or use the continue "
                "value from the response to get a consistent list."
            )
        return rv, (ns, name)

    # --- writes

    def create(self, res: ResourceDef, namespace: str | None, body: Obj, *, http: bool) -> Obj:
        obj = self._incoming(res, namespace, body)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        with self.lock:
            return self._create_locked(res, obj, http=http)

    def _create_locked(self, res: ResourceDef, obj: Obj, *, http: bool) -> Obj:
        meta = obj["metadata"]
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                why = "Required value: name or generateName is required"
                raise invalid(res, "", "metadata.name", why)
            meta["name"] = prefix + "".join(random.choices(_NAME_CHARS, k=5))
        key = self.key(res, meta.get("namespace"), meta["name"])
        if key in self._table(res):
            raise already_exists(res, meta["name"])
        self._prepare(res, obj, None, keep_status=http)
        for server_owned in ("resourceVersion", "generation", "deletionTimestamp"):
            meta.pop(server_owned, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        generation = next_generation(res, obj, None)
        if generation is not None:
            meta["generation"] = generation
        return self._commit(res, key, obj)

    def replace(
        self,
        res: ResourceDef,
        namespace: str | None,
        name: str,
        body: Obj,
        *,
        http: bool,
        subresource: str | None = None,
    ) -> tuple[bool, Obj]:
        """PUT. Returns (created, object); only Services may be created this way."""
        obj = self._incoming(res, namespace, body)
        meta = obj["metadata"]
        if meta.setdefault("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL "
                f"({name})"
            )
        with self.lock:
            old = self._table(res).get(self.key(res, namespace, name))
            if old is None:
                if subresource or not res.allow_create_on_update:
                    raise not_found(res, name)
                meta.pop("resourceVersion", None)
                return True, self._create_locked(res, obj, http=http)
            wanted = meta.get("resourceVersion")
            if wanted and wanted != old["metadata"]["resourceVersion"]:
                raise conflict(res, name, STALE)
            return False, self._update_locked(res, obj, old, http=http, subresource=subresource)

    def patch(
        self,
        res: ResourceDef,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
    ) -> Obj:
        with self.lock:
            old = self.get(res, namespace, name)
            patched = self._apply_patch(res, name, old, content_type, patch)
            meta = patched.get("metadata")
            if not isinstance(meta, dict):
                raise invalid(res, name, "metadata", "Invalid value: must be an object")
            wanted = meta.get("resourceVersion")
            if wanted and wanted != old["metadata"]["resourceVersion"]:
                raise conflict(res, name, STALE)
            patched.pop("kind", None)
            patched.pop("apiVersion", None)
            return self._update_locked(res, patched, old, http=True, subresource=subresource)

    @staticmethod
    def _apply_patch(res: ResourceDef, name: str, old: Obj, content_type: str, patch: Any) -> Obj:
        current = res.typed(old)  # the real server patches the typed (kind-carrying) object
        try:
            if content_type == JSON_PATCH:
                patched = apply_json_patch(current, patch)
            elif content_type in (MERGE_PATCH, STRATEGIC_PATCH):
                if not isinstance(patch, dict):
                    raise PatchError("a merge patch for an object must be a JSON object")
                patched = apply_merge_patch(current, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types "
                    f"include: {', '.join(PATCH_TYPES)}",
                )
        except PatchError as exc:
            raise invalid(res, name, "patch", str(exc)) from exc
        if not isinstance(patched, dict):
            raise invalid(res, name, "patch", "the patched document is not an object")
        return patched

    def _update_locked(
        self, res: ResourceDef, new: Obj, old: Obj, *, http: bool, subresource: str | None
    ) -> Obj:
        # Strategies read (and may copy parts of) the old object: give them a private copy so
        # the stored one stays immutable.
        base = copy.deepcopy(old)
        if subresource == "status":
            prepare_status_update(new, base)
        else:
            self._prepare(res, new, base, keep_status=http)
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        # Identity and server-owned fields cannot be changed by a client.
        for owned in ("name", "namespace", "uid", "creationTimestamp", "generation"):
            if owned in old_meta:
                meta[owned] = old_meta[owned]
            else:
                meta.pop(owned, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        generation = next_generation(res, new, old)
        if generation is not None:
            meta["generation"] = generation
        if new == old:
            # Like etcd's GuaranteedUpdate: identical bytes -> no write, no RV bump, no event.
            return old
        return self._commit(res, self.key(res, meta.get("namespace"), meta["name"]), new)

    def delete(
        self, res: ResourceDef, namespace: str | None, name: str, preconditions: Obj | None = None
    ) -> Obj:
        """Delete now (finalizers are not modelled); returns the object stamped with the
        delete's resourceVersion, which is also what watchers receive."""
        with self.lock:
            old = self.get(res, namespace, name)
            self._check_preconditions(res, old, preconditions or {})
            return self._commit(res, self.key(res, namespace, name), None)

    @staticmethod
    def _check_preconditions(res: ResourceDef, old: Obj, pre: Obj) -> None:
        meta = old["metadata"]
        for key, label in (("resourceVersion", "ResourceVersion"), ("uid", "UID")):
            wanted = pre.get(key)
            if wanted and wanted != meta.get(key):
                raise conflict(
                    res,
                    meta["name"],
                    f"Precondition failed: {label} in precondition: {wanted}, "
                    f"{label} in object meta: {meta.get(key)}",
                )

    # --- write helpers

    def _incoming(self, res: ResourceDef, namespace: str | None, body: Any) -> Obj:
        """Validate the envelope of a request body and return a private deep copy."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        obj: Obj = _copy_json(body)
        for key, expected in (("kind", res.kind), ("apiVersion", res.api_version)):
            got = obj.pop(key, None)
            if got and got != expected:
                raise bad_request(
                    f"the {key} in the data ({got}) does not match the expected {key} ({expected})"
                )
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if not res.namespaced:
            meta.pop("namespace", None)
        elif namespace is not None:
            if meta.setdefault("namespace", namespace) != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request"
                )
        elif not meta.get("namespace"):
            meta["namespace"] = "default"
        return obj

    def _prepare(self, res: ResourceDef, new: Obj, old: Obj | None, *, keep_status: bool) -> None:
        if res is SERVICES:
            self._check_cluster_ip(new, old)
        alloc = Allocated(
            self._allocator, self._cluster_ips.__contains__, self._node_ports.__contains__
        )
        try:
            prepare(res, new, old, keep_status=keep_status, alloc=alloc)
        except Invalid as exc:
            name = new.get("metadata", {}).get("name", "")
            raise invalid(res, name, exc.field_path, str(exc).split(": ", 1)[1]) from exc

    def _check_cluster_ip(self, new: Obj, old: Obj | None) -> None:
        wanted = (new.get("spec") or {}).get("clusterIP")
        mine = (old or {}).get("spec", {}).get("clusterIP")
        if wanted and wanted != "None" and wanted != mine and wanted in self._cluster_ips:
            name = new.get("metadata", {}).get("name", "")
            why = f"failed to allocate IP {wanted}: provided IP is already allocated"
            raise invalid(SERVICES, name, "spec.clusterIPs", f'Invalid value: ["{wanted}"]: {why}')

    def _index_service(self, obj: Obj | None, add: bool) -> None:
        if obj is None:
            return
        spec = obj.get("spec", {})
        listed = spec.get("clusterIPs") or [spec.get("clusterIP")]
        ips = {ip for ip in listed if ip and ip != "None"}
        ports = {p["nodePort"] for p in spec.get("ports") or [] if p.get("nodePort")}
        if add:
            self._cluster_ips |= ips
            self._node_ports |= ports
        else:
            self._cluster_ips -= ips
            self._node_ports -= ports

    def _commit(self, res: ResourceDef, key: Key, new: Obj | None) -> Obj:
        """Store (or delete, when ``new`` is None) one object: the single place where the
        resourceVersion moves, history grows and watchers are fed."""
        table = self._table(res)
        old = table.get(key)
        self._rv += 1
        if new is None:
            assert old is not None
            del table[key]
            event = Event(self._rv, "DELETED", res, with_rv(old, self._rv), old)
        else:
            new["metadata"]["resourceVersion"] = str(self._rv)
            table[key] = new
            event = Event(self._rv, "MODIFIED" if old else "ADDED", res, new, old)
        if res is SERVICES:
            self._index_service(old, add=False)
            self._index_service(new, add=True)
        self._record(event)
        return event.obj

    def _record(self, event: Event) -> None:
        if len(self._history) >= self._history_size:
            self._floor = self._history.popleft().rv
        self._history.append(event)
        for watcher in self._watchers:
            if watcher.resource is event.resource:
                watcher.offer(event)
        self._changed.notify_all()

    # --- watch support

    def wait_for_rv(self, rv: int, timeout: float) -> bool:
        """Wait (bounded) until the store has reached ``rv``; upstream waits ~3 s too."""
        with self._changed:
            return self._changed.wait_for(lambda: self._rv >= rv, timeout)

    def start_watch(self, watcher: Watcher, since: int | None) -> tuple[list[tuple[str, Obj]], int]:
        """Register ``watcher`` and return its initial events and the RV they bring it to.

        ``since`` None means "current state as synthetic ADDED events"; otherwise replay the
        history after ``since`` (410 Expired when it has been compacted away). Both happen under
        the lock together with registration, so no event can fall in between.
        """
        with self.lock:
            if since is None:
                rows = sorted(self._table(watcher.resource).items())
                initial = [("ADDED", o) for _, o in rows if watcher.filter.matches(o)]
            else:
                if since < self._floor:
                    raise expired(f"too old resource version: {since} ({self._floor + 1})")
                initial = [
                    t
                    for ev in self._history
                    if ev.rv > since and ev.resource is watcher.resource
                    if (t := watcher.translate(ev)) is not None
                ]
            self._watchers.add(watcher)
            return initial, self._rv

    def stop_watch(self, watcher: Watcher) -> None:
        with self.lock:
            self._watchers.discard(watcher)

    def bookmark_rv(self, watcher: Watcher) -> int | None:
        """The RV a bookmark may claim: the current one, but only when the watcher has drained
        its queue (pushes happen under this lock, so an empty queue means it has seen every
        event up to now). None means "deliver pending events first"."""
        with self.lock:
            return self._rv if watcher.queue.empty() else None

    def compact(self) -> None:
        with self.lock:
            self._history.clear()
            self._floor = self._rv

    # --- helpers for tests

    def objects(self, res: ResourceDef) -> list[Obj]:
        with self.lock:
            return [copy.deepcopy(o) for _, o in sorted(self._table(res).items())]
