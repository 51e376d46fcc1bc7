"""Protobuf from the real API server: the reflector's protobuf watches hand over the same
documents as the JSON path makes of the same objects, and so do protobuf lists; a 410 in
protobuf (an API server restarted) still relists. tests/test_protobuf.py tests the decoder's
edge cases."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pyproxy.cluster.codec import JSON
from pyproxy.cluster.resources import (
    JSON_MEDIA_TYPE,
    PROTOBUF_MEDIA_TYPE,
    SLICE_CODEC,
    Resource,
    endpoint_slices_resource,
    nodes_resource,
    services_resource,
)
from pyproxy.cluster.watch import Expired, Reflector
from pyproxy.core import protobuf
from pyproxy.core.convert import convert_service
from pyproxy.core.convert_endpoints import convert_endpoint_slice, convert_node
from pyproxy.core.wire import SliceDoc
from testkit.controlplane import ControlPlane, Kube, wait_for
from testkit.fixtures import requires_netns
from testkit.protoenc import project

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]

NS = "protobuf"
NODE = "node-protobuf"
LABELS = {"kubernetes.io/service-name": "web",
          "endpointslice.kubernetes.io/managed-by": "tests.pyproxy"}  # not the controller's


def services() -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": 80, "targetPort": "web"},
             {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353}]
    return [
        {"metadata": {"name": "cluster-ip", "labels": {"app": "a"}},
         "spec": {"ports": ports, "selector": {"app": "a"}}},
        {"metadata": {"name": "dual-node-port",
                      "annotations": {"service.kubernetes.io/topology-mode": "Auto"}},
         "spec": {"type": "NodePort", "ipFamilyPolicy": "RequireDualStack",
                  "ipFamilies": ["IPv6", "IPv4"], "ports": ports[:1],
                  "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                  "sessionAffinity": "ClientIP",
                  "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
                  "externalIPs": ["192.0.2.7"], "trafficDistribution": "PreferClose"}},
        {"metadata": {"name": "load-balancer"},
         "spec": {"type": "LoadBalancer", "ports": ports, "externalTrafficPolicy": "Local",
                  "loadBalancerSourceRanges": ["203.0.113.0/24"]}},
        {"metadata": {"name": "external-name"},
         "spec": {"type": "ExternalName", "externalName": "example.com"}},
    ]


def endpoint_slices() -> list[dict[str, Any]]:
    hints = {"forZones": [{"name": "zone-1"}], "forNodes": [{"name": NODE}]}
    return [
        {"metadata": {"name": "web-v4", "labels": LABELS,
                      "annotations": {"endpoints.kubernetes.io/last-change-trigger-time":
                                      "2026-11-27T10:00:00Z"}},
         "addressType": "IPv4",
         "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "none"}],
         "endpoints": [
             {"addresses": ["10.244.1.1"], "conditions": {"ready": True, "serving": True,
                                                          "terminating": False},
              "nodeName": NODE, "zone": "zone-1", "hints": hints,
              "targetRef": {"kind": "Pod", "namespace": NS, "name": "web-1"}},
             {"addresses": ["10.244.1.2"], "conditions": {"ready": False, "serving": True,
                                                          "terminating": True},
              "nodeName": "node-other", "zone": "zone-2"},
             {"addresses": ["10.244.1.3"]},
         ]},
        {"metadata": {"name": "web-v6", "labels": LABELS}, "addressType": "IPv6",
         "ports": [{"port": 8080}],
         "endpoints": [{"addresses": ["fd00:244::1"], "conditions": {"ready": True}}]},
        {"metadata": {"name": "web-empty", "labels": LABELS}, "addressType": "IPv4",
         "endpoints": []},
    ]


@dataclass
class Recorded:
    reflector: Reflector
    objects: dict[tuple[str, str], Any]


@contextlib.contextmanager
def reflecting(plane: ControlPlane, resource: Resource,
               content_type: str) -> Iterator[Recorded]:
    """A reflector of the resource (the daemon's) with this content type, running."""
    objects: dict[tuple[str, str], Any] = {}
    synced, stop = threading.Event(), threading.Event()

    def handle(key: tuple[str, str], obj: Any) -> None:
        if obj is None:
            objects.pop(key, None)
        else:
            objects[key] = obj

    reflector = Reflector(plane.admin_client(), resource, handle, synced.set, stop,
                          watch_timeout=60, content_type=content_type)
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    try:
        assert synced.wait(30)
        wait_for(lambda: reflector.status.watches >= 1, 30, f"the {resource.kind} watch")
        yield Recorded(reflector, objects)
    finally:
        reflector.close()
        thread.join(40)
        assert not thread.is_alive()


def get(plane: ControlPlane, path: str, accept: str) -> bytes:
    api = plane.admin_client()
    try:
        response = api.call_api("GET", f"{plane.url}{path}", header_params={"Accept": accept},
                                _request_timeout=30)
        return bytes(response.read())
    finally:
        api.close()


@pytest.fixture(scope="module")
def kube(control_plane: ControlPlane) -> Iterator[Kube]:
    kube = Kube(control_plane.admin_client())
    kube.namespace(NS)
    yield kube
    with contextlib.suppress(Exception):
        kube.core.delete_namespace(NS)
    with contextlib.suppress(Exception):
        kube.core.delete_node(NODE)


@pytest.fixture(scope="module")
def watched(control_plane: ControlPlane, kube: Kube) -> Iterator[dict[str, Recorded]]:
    """Reflectors in protobuf that were watching when the objects were made: every object
    reached them as a protobuf watch event."""
    with contextlib.ExitStack() as stack:
        recorded = {resource.kind: stack.enter_context(
            reflecting(control_plane, resource, PROTOBUF_MEDIA_TYPE))
            for resource in (services_resource(), endpoint_slices_resource(),
                             nodes_resource(NODE))}
        for body in services():
            kube.core.create_namespaced_service(NS, body)
        kube.core.patch_namespaced_service_status("load-balancer", NS, {"status": {
            "loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "Proxy"},
                                         {"hostname": "lb.example"}]}}})
        for body in endpoint_slices():
            kube.discovery.create_namespaced_endpoint_slice(NS, body)
        kube.node(NODE, ("192.168.7.2", "fd00:7::2"), zone="zone-1")
        kube.core.patch_node(NODE, {"spec": {
            "podCIDR": "10.244.7.0/24", "podCIDRs": ["10.244.7.0/24", "fd00:244:7::/64"],
            "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}})
        yield recorded


def settled(recorded: Recorded, key: tuple[str, str], version: str) -> Any:
    """The reflector's copy of the object once it has the version the JSON GET read."""
    def current() -> bool:
        obj = recorded.objects.get(key)
        meta = obj.metadata if isinstance(obj, SliceDoc) else (obj or {}).get("metadata")
        return bool(meta) and meta.get("resourceVersion") == version
    wait_for(current, 30, f"{key} at resourceVersion {version}")
    return recorded.objects[key]


@pytest.mark.parametrize("name", [s["metadata"]["name"] for s in services()])
def test_a_service_from_a_protobuf_watch_is_its_json_document(
        control_plane: ControlPlane, watched: dict[str, Recorded], name: str) -> None:
    recorded = watched["Service"]
    body = get(control_plane, f"/api/v1/namespaces/{NS}/services/{name}", JSON_MEDIA_TYPE)
    _, doc = JSON.event(b'{"type":"ADDED","object":' + body + b"}")
    obj = settled(recorded, (NS, name), doc["metadata"]["resourceVersion"])
    assert recorded.reflector.status.watch_encoding == "protobuf"
    assert obj == project(doc, protobuf.SERVICE)
    assert convert_service(obj) == convert_service(doc)


@pytest.mark.parametrize("name", [s["metadata"]["name"] for s in endpoint_slices()])
def test_a_slice_from_a_protobuf_watch_is_the_typed_document_of_its_json(
        control_plane: ControlPlane, watched: dict[str, Recorded], name: str) -> None:
    recorded = watched["EndpointSlice"]
    body = get(control_plane, f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/{name}",
               JSON_MEDIA_TYPE)
    _, doc = SLICE_CODEC.event(b'{"type":"ADDED","object":' + body + b"}")
    obj = settled(recorded, (NS, name), doc.metadata["resourceVersion"])
    assert recorded.reflector.status.watch_encoding == "protobuf"
    assert type(obj) is SliceDoc and type(doc) is SliceDoc
    assert (obj.address_type, obj.ports, obj.endpoints) == (
        doc.address_type, doc.ports, doc.endpoints)
    assert obj.metadata == project(doc.metadata, protobuf.OBJECT_META)
    assert convert_endpoint_slice(obj) == convert_endpoint_slice(doc)


def test_the_node_from_a_protobuf_watch_is_its_json_document(
        control_plane: ControlPlane, watched: dict[str, Recorded]) -> None:
    recorded = watched["Node"]
    doc = json.loads(get(control_plane, f"/api/v1/nodes/{NODE}", JSON_MEDIA_TYPE))
    obj = settled(recorded, ("", NODE), doc["metadata"]["resourceVersion"])
    assert obj == project(doc, protobuf.NODE)
    assert convert_node(obj) == convert_node(doc)
    assert obj["spec"]["taints"][0]["key"] == "ToBeDeletedByClusterAutoscaler"


@pytest.mark.parametrize(("path", "resource"), [
    (f"/api/v1/namespaces/{NS}/services", services_resource()),
    (f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", endpoint_slices_resource()),
    (f"/api/v1/nodes?fieldSelector=metadata.name%3D{NODE}", nodes_resource(NODE)),
], ids=["Service", "EndpointSlice", "Node"])
def test_a_protobuf_list_is_the_json_list(control_plane: ControlPlane,
                                          watched: dict[str, Recorded], path: str,
                                          resource: Resource) -> None:
    assert resource.protobuf is not None
    meta, items = resource.protobuf.page(get(control_plane, path, PROTOBUF_MEDIA_TYPE))
    _, json_items = resource.codec.page(get(control_plane, path, JSON_MEDIA_TYPE))
    assert meta["resourceVersion"] and len(items) == len(json_items) >= 1
    for obj, doc in zip(items, json_items, strict=True):
        if type(doc) is SliceDoc:
            assert (obj.metadata, obj.endpoints) == (
                project(doc.metadata, protobuf.OBJECT_META), doc.endpoints)
        else:
            assert obj == project(doc, resource.protobuf.schema)  # type: ignore[attr-defined]


def test_a_410_in_protobuf_relists(control_plane: ControlPlane,
                                   watched: dict[str, Recorded]) -> None:
    """kube-apiserver restarted: its watch cache starts after every position a watcher
    had, and a watch from one is answered with an ERROR event, a metav1.Status (410
    Expired) in protobuf: the reflector lists again. Last here: every watch of this module
    relists after it."""
    recorded = watched["Service"]
    position, lists = recorded.reflector.status.resource_version, recorded.reflector.status.lists
    assert recorded.reflector.status.watch_encoding == "protobuf"
    control_plane.kill_apiserver()
    control_plane.start_apiserver()
    reflector = Reflector(control_plane.admin_client(), services_resource(), lambda *_: None,
                          lambda: None, threading.Event(), content_type=PROTOBUF_MEDIA_TYPE)
    with pytest.raises(Expired, match="too old resource version"):
        reflector._watch(position)
    # an ERROR event in a protobuf stream, not a 410 answer to the request
    assert reflector.status.watch_encoding == "protobuf"
    wait_for(lambda: recorded.reflector.status.lists > lists, 60,
             "the running reflector's relist after the restart")
