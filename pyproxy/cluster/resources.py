"""The resources pyproxy lists and watches, and how the `kubernetes` client is called for each:
a raw GET of the collection path (pyproxy/cluster/apirequest.py says why not CoreV1Api), the
selectors kube-proxy's informers use, the codecs their objects decode with. The reflector
(cluster/watch.py) reads what these return."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog

from pyproxy.cluster.apirequest import request
from pyproxy.cluster.codec import JSON, Codec, ProtobufCodec, TypedCodec
from pyproxy.core import protobuf
from pyproxy.core.wire import SliceDoc

log = structlog.get_logger(__name__)

JSON_MEDIA_TYPE = "application/json"
PROTOBUF_MEDIA_TYPE = protobuf.MEDIA_TYPE


@dataclass(frozen=True)
class Resource:
    """One watched resource: how to call the client for it."""

    kind: str
    # (api_client) → a function taking list/watch options (limit, watch, resource_version…)
    # and returning the raw response
    list_function: Callable[[Any], Callable[..., Any]]
    label_selector: str | None = None
    field_selector: str | None = None
    codec: Codec = JSON
    # Its protobuf codec (None: JSON only).
    protobuf: Codec | None = None


def collection(path: str) -> Callable[[Any], Callable[..., Any]]:
    """The list function of a collection path, e.g. "/api/v1/services" (all namespaces):
    a GET through the client's ApiClient (pyproxy/cluster/apirequest.py says why not CoreV1Api)."""

    def bind(api_client: Any) -> Callable[..., Any]:
        def list_or_watch(_preload_content: bool = False, _request_timeout: Any = None,
                          _accept: str = JSON_MEDIA_TYPE, **options: Any) -> Any:
            return request(api_client, "GET", path, query=options, timeout=_request_timeout,
                           accept=_accept)
        return list_or_watch
    return bind


def services_resource() -> Resource:
    return Resource(
        "Service", collection("/api/v1/services"),
        # Services another proxy handles are not ours (as kube-proxy's informer).
        label_selector="!service.kubernetes.io/service-proxy-name",
        # Nor headless ones, which have no address to proxy: kube-proxy's informer leaves
        # them on the server too, so their changes are never sent to the nodes.
        field_selector="spec.clusterIP!=None",
        protobuf=ProtobufCodec(protobuf.SERVICE),
    )


def endpoint_slices_resource() -> Resource:
    return Resource(
        "EndpointSlice", collection("/apis/discovery.k8s.io/v1/endpointslices"),
        label_selector="!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name",
        codec=SLICE_CODEC, protobuf=ProtobufCodec(protobuf.ENDPOINT_SLICE, protobuf.slice_doc),
    )


# EndpointSlices are most of an initial list: decoded into typed documents (see codec.py).
SLICE_CODEC = TypedCodec(SliceDoc)


def nodes_resource(name: str | None = None) -> Resource:
    return Resource(
        "Node", collection("/api/v1/nodes"),
        field_selector=f"metadata.name={name}" if name else None,
        protobuf=ProtobufCodec(protobuf.NODE),
    )


def service_cidrs_resource() -> Resource:
    """ServiceCIDRs (networking.k8s.io/v1, cluster-scoped): the ranges ClusterIPs come from.
    An API server that does not serve them (before 1.33, or MultiCIDRServiceAllocator off)
    answers 404: that reads as "none known", an empty list and a watch that stays quiet,
    instead of an error retried forever. Each watch asks again (every 5 to 10 minutes), so
    an upgraded server's ServiceCIDRs arrive without a restart."""
    servicecidrs = collection("/apis/networking.k8s.io/v1/servicecidrs")
    return Resource(
        "ServiceCIDR", lambda api: _NotServedIsEmpty("ServiceCIDR", servicecidrs(api)),
        protobuf=ProtobufCodec(protobuf.SERVICE_CIDR))


@dataclass(frozen=True)
class _NotServedIsEmpty:
    """A list function whose 404 (resource not served) answers as an empty list, or as a
    silent watch lasting the watch's timeout. Only for resources whose absence means "none
    exist": a 404 for Services would be an error."""

    kind: str
    function: Callable[..., Any]

    def __call__(self, **kwargs: Any) -> Any:
        try:
            return self.function(**kwargs)
        except Exception as err:
            if getattr(err, "status", None) != 404:
                raise
        if not kwargs.get("watch"):
            log.info("resource_not_served_taken_as_none", kind=self.kind)
            return _Response(b'{"items": [], "metadata": {"resourceVersion": ""}}')
        if kwargs.get("send_initial_events"):  # a streamed list of nothing
            log.info("resource_not_served_taken_as_none", kind=self.kind)
            return _Response(_EMPTY_STREAMED_LIST)
        return _Response(b"", quiet_for=float(kwargs.get("timeout_seconds") or 300))


_EMPTY_STREAMED_LIST = json.dumps({"type": "BOOKMARK", "object": {"metadata": {
    "resourceVersion": "", "annotations": {"k8s.io/initial-events-end": "true"}}}}).encode()


@dataclass
class _Response:
    """What the reflector reads of a raw client response."""

    data: bytes
    quiet_for: float = 0.0

    def stream(self, amt: int = 0, decode_content: bool = True) -> Iterator[bytes]:
        if self.data:
            yield self.data + b"\n"
        # Empty chunks once a second: the reflector checks its stop event after each one.
        deadline = time.monotonic() + self.quiet_for
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            yield b""

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass
