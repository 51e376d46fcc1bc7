"""Where the daemon learns about the cluster: the Kubernetes API, or a snapshot file. Both feed
the same handlers (a `ClusterHandler`: the sync layer's `NodeProxier`), so everything after
this point is the same code path."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from pyproxy.cluster.resources import (
    JSON_MEDIA_TYPE,
    endpoint_slices_resource,
    nodes_resource,
    service_cidrs_resource,
    services_resource,
)
from pyproxy.cluster.snapshot import SnapshotError, parse_objects, read_snapshot, snapshot_items
from pyproxy.cluster.watch import MIN_WATCH_TIMEOUT, Reflector
from pyproxy.cluster.watchstate import WatchStatus, watch_problems
from pyproxy.core.model import ObjectKey, Skipped
from pyproxy.core.wire import SliceDoc

log = structlog.get_logger(__name__)


class ClusterHandler(Protocol):
    """What a source feeds: the objects' events, the initial lists the first sync waits for,
    and a sync asked for. Declared here, below the sync layer that implements it
    (`sync.node.NodeProxier`), so that the sources do not import upwards."""

    def snapshot_skipped(self, skipped: tuple[Skipped, ...],
                         fresh: tuple[Skipped, ...]) -> None:
        """A snapshot's items that carry no event (earlier copies of an object, other kinds,
        objects without a name): all of them as now read, and those not skipped at the last
        reading. They change no rules, so ask for no sync."""
        ...

    def expect(self, source: str) -> None: ...

    def source_synced(self, source: str) -> None: ...

    def request_sync(self) -> None: ...

    def on_service(self, key: ObjectKey, obj: dict[str, Any] | None) -> None: ...

    def on_slice(self, key: ObjectKey, obj: dict[str, Any] | SliceDoc | None) -> None: ...

    def on_node(self, key: ObjectKey, obj: dict[str, Any] | None) -> None: ...

    def on_service_cidr(self, key: ObjectKey, obj: dict[str, Any] | None) -> None: ...



@dataclass
class SnapshotSource:
    """A YAML/JSON snapshot file (the format `pyproxy explain` reads), re-read when it
    changes. The differences between two readings become add/update/delete events."""

    path: str
    proxier: ClusterHandler
    stop: threading.Event
    poll_interval: float = 0.2
    _seen: dict[tuple[str, str, str], str] = field(default_factory=dict)
    _skipped: tuple[Skipped, ...] = ()
    _stamp: tuple[int, int] | None = None
    _digest: str = ""
    loads: int = 0
    errors: int = 0
    last_error: str = ""

    NAME = "snapshot"

    def start(self) -> threading.Thread:
        self.proxier.expect(self.NAME)
        thread = threading.Thread(target=self.run, name="snapshot", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(self.poll_interval)

    def poll(self) -> bool:
        """Read the file if it changed; returns whether events were produced."""
        try:
            info = os.stat(self.path)
        except OSError as err:
            self._fail(f"cannot read {self.path}: {err}")
            return False
        stamp = (info.st_mtime_ns, info.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            data = read_snapshot(self.path)
            digest = hashlib.sha256(data).hexdigest()
            if digest == self._digest:
                return False
            objects = parse_objects(data.decode("utf-8"))
        except (OSError, UnicodeDecodeError, SnapshotError) as err:
            # A half-written or broken file changes nothing: the rules stay as they are.
            self._fail(f"{self.path}: {err}")
            return False
        self._digest = digest
        self._apply(objects)
        self.loads += 1
        if self.loads == 1:
            self.proxier.source_synced(self.NAME)
        return True

    def _fail(self, message: str) -> None:
        self.errors += 1
        if message != self.last_error:
            log.warning("snapshot_not_loaded", error=message)
        self.last_error = message

    def _apply(self, objects: list[Any]) -> None:
        """The items as offline commands read them (`snapshot_items`); what changed since the
        last reading as events, the rest recorded in the cache."""
        items = snapshot_items(objects)
        before = set(self._skipped)  # a file of many broken items: no quadratic scan
        fresh = tuple(s for s in items.skipped if s not in before)
        self._skipped = items.skipped
        self.proxier.snapshot_skipped(items.skipped, fresh)
        handlers: dict[str, Callable[[ObjectKey, Any], None]] = {
            "Service": self.proxier.on_service,
            "EndpointSlice": self.proxier.on_slice,
            "Node": self.proxier.on_node,
            "ServiceCIDR": self.proxier.on_service_cidr,
        }
        fingerprints = {ref: repr(obj) for ref, obj in items.objects.items()}
        for kind, namespace, name in self._seen.keys() - fingerprints.keys():
            handlers[kind]((namespace, name), None)
        for ref, obj in items.objects.items():
            if self._seen.get(ref) != fingerprints[ref]:
                kind, namespace, name = ref
                handlers[kind]((namespace, name), obj)
        self._seen = fingerprints


@dataclass
class ApiSource:
    """Services, EndpointSlices and this Node from the API server, through reflectors; and
    ServiceCIDRs unless `service_cidrs` is off (featureGates MultiCIDRServiceAllocator=false,
    as kube-proxy starts that informer only with the gate on).

    Told whom it feeds when started (`start(proxier)`): it is built before the proxier, whose
    syncs may ask it to watch every Node (`watch_all_nodes`)."""

    api_client: Any
    node_name: str
    stop: threading.Event
    watch_timeout: int = MIN_WATCH_TIMEOUT
    read_timeout: float | None = None  # None: each watch's timeoutSeconds + a margin
    reflectors: list[Reflector] = field(default_factory=list)
    service_cidrs: bool = True
    # clientConnection.contentType (cluster/watch.py: protobuf on plain watches)
    content_type: str = JSON_MEDIA_TYPE
    _all_nodes: Reflector | None = None
    proxier: ClusterHandler = field(init=False, repr=False, compare=False)  # set by start()

    def start(self, proxier: ClusterHandler) -> list[threading.Thread]:
        self.proxier = proxier
        specs = [
            (services_resource(), self.proxier.on_service),
            (endpoint_slices_resource(), self.proxier.on_slice),
            (nodes_resource(self.node_name), self.proxier.on_node),
        ]
        threads = []
        for resource, handler in specs:
            self.proxier.expect(resource.kind)
            reflector = Reflector(
                self.api_client, resource, handler,
                on_synced=functools.partial(self.proxier.source_synced, resource.kind),
                stop=self.stop, watch_timeout=self.watch_timeout,
                read_timeout=self.read_timeout, content_type=self.content_type)
            self.reflectors.append(reflector)
            threads.append(self._spawn(reflector))
        if self.service_cidrs:
            threads.append(self._spawn(self._service_cidrs()))
        return threads

    def _service_cidrs(self) -> Reflector:
        """Not awaited before the first sync (kube-proxy does not wait for them either): a
        server that refuses them (RBAC not updated) must not keep the node from being
        programmed. Their drop rule follows in the sync after their list."""
        reflector = Reflector(
            self.api_client, service_cidrs_resource(), self.proxier.on_service_cidr,
            on_synced=lambda: log.info("initial_list_completed", source="ServiceCIDR"),
            stop=self.stop, watch_timeout=self.watch_timeout, read_timeout=self.read_timeout,
            content_type=self.content_type)
        self.reflectors.append(reflector)
        return reflector

    def watch_all_nodes(self) -> None:
        """Topology keys beyond the hostname need other nodes' labels: watch every Node (only
        started when some service uses such keys)."""
        if self._all_nodes is not None:
            return
        self._all_nodes = Reflector(
            self.api_client, nodes_resource(None), self._other_node,
            on_synced=lambda: self.proxier.request_sync(), stop=self.stop,
            watch_timeout=self.watch_timeout, read_timeout=self.read_timeout,
            content_type=self.content_type)
        self.reflectors.append(self._all_nodes)
        self._spawn(self._all_nodes)

    def _other_node(self, key: ObjectKey, obj: dict[str, Any] | None) -> None:
        if key[1] != self.node_name:  # this node comes from its own watch
            self.proxier.on_node(key, obj)

    def _spawn(self, reflector: Reflector) -> threading.Thread:
        thread = threading.Thread(target=reflector.run, name=f"watch-{reflector.resource.kind}",
                                  daemon=True)
        thread.start()
        return thread

    def status(self) -> list[WatchStatus]:
        return [r.status for r in self.reflectors]

    def report(self, now: float | None = None) -> dict[str, Any]:
        """For `pyproxy status`: each watch, and why the API side is not well (a watch
        without an answer for longer than watchstate.DISCONNECTED_BOUND)."""
        statuses = self.status()
        return {"api": [dataclasses.asdict(s) for s in statuses],
                "problems": watch_problems(statuses, time.time() if now is None else now)}
