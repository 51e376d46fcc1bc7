"""The protobuf decoder against a tiny encoder (testkit/protoenc.py): the documents it makes
are the JSON documents' fields the proxy reads, converted the same; bad bytes are named.
tests/test_k8s_protobuf.py checks the same against the real API server's bytes."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyproxy.cluster.codec import JSON, ProtobufCodec
from pyproxy.cluster.resources import SLICE_CODEC, Resource, endpoint_slices_resource
from pyproxy.cluster.watch import Expired, Reflector, _frames
from pyproxy.core import protobuf
from pyproxy.core.convert import convert_service, convert_service_cidr
from pyproxy.core.convert_endpoints import convert_endpoint_slice, convert_node
from pyproxy.core.model import Skipped
from pyproxy.core.wire import SliceDoc, Unreadable
from testkit import protoenc
from testkit.protoenc import project

SERVICES = ProtobufCodec(protobuf.SERVICE)
SLICES = ProtobufCodec(protobuf.ENDPOINT_SLICE, protobuf.slice_doc)
NODES = ProtobufCodec(protobuf.NODE)
CIDRS = ProtobufCodec(protobuf.SERVICE_CIDR)


def meta(name: str, namespace: str | None = "ns", **extra: Any) -> dict[str, Any]:
    return {"name": name, **({"namespace": namespace} if namespace else {}),
            "resourceVersion": "42", "uid": "u-1", "creationTimestamp": "2026-11-27T10:00:00Z",
            "managedFields": [{"manager": "m"}], **extra}


def svc(name: str, spec: dict[str, Any], status: dict[str, Any] | None = None,
        **meta_extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, **meta_extra),
            "spec": spec, "status": status or {"loadBalancer": {}}}


PORTS = [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": "web"},
         {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 5353}]
SERVICE_DOCS = {
    "ClusterIP, a named targetPort": svc("a", {
        "type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
        "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "ports": PORTS,
        "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"}),
    "dual-stack NodePort, client affinity": svc("b", {
        "type": "NodePort", "clusterIP": "fd00:96::a", "clusterIPs": ["fd00:96::a", "10.96.0.11"],
        "ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "RequireDualStack",
        "ports": [{**PORTS[0], "nodePort": 30080}], "externalTrafficPolicy": "Local",
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
        "externalIPs": ["192.0.2.7"], "internalTrafficPolicy": "Local",
        "trafficDistribution": "PreferClose"}, labels={"app": "b"},
        annotations={"service.kubernetes.io/topology-mode": "Auto"}),
    "LoadBalancer, eTP Local, ingress with ipMode": svc("c", {
        "type": "LoadBalancer", "clusterIP": "10.96.0.12", "clusterIPs": ["10.96.0.12"],
        "ports": [{**PORTS[0], "nodePort": 30081}], "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 32000, "loadBalancerSourceRanges": ["203.0.113.0/24"],
        "allocateLoadBalancerNodePorts": True, "sessionAffinity": "None"},
        {"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "Proxy"},
                                      {"hostname": "lb.example"}]}}),
    "ExternalName": svc("d", {"type": "ExternalName", "externalName": "example.com",
                              "sessionAffinity": "None"}),
    "headless": svc("e", {"type": "ClusterIP", "clusterIP": "None", "clusterIPs": ["None"],
                          "ports": PORTS[:1]}),
    "being deleted, no ports": svc("f", {"type": "ClusterIP", "clusterIP": "10.96.0.13"},
                                   deletionTimestamp="2026-11-27T12:00:01Z"),
}


def endpoint(ip: str, **fields: Any) -> dict[str, Any]:
    return {"addresses": [ip], **fields}


SLICE_DOCS = {
    "hints, conditions, nodeName, zone": {
        "metadata": meta("web-abc", labels={"kubernetes.io/service-name": "web"}),
        "addressType": "IPv4", "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": [
            endpoint("10.0.0.1", conditions={"ready": True, "serving": True,
                                             "terminating": False},
                     nodeName="node-a", zone="zone-1",
                     hints={"forZones": [{"name": "zone-1"}], "forNodes": [{"name": "node-a"}]},
                     targetRef={"kind": "Pod", "namespace": "ns", "name": "web-1"}),
            endpoint("10.0.0.2", conditions={"ready": False, "serving": True,
                                             "terminating": True}, nodeName="node-b"),
            endpoint("10.0.0.3", conditions={}, deprecatedTopology={"a": "b"}),
        ]},
    "IPv6, unnamed port, an empty name and zone": {
        "metadata": meta("web-v6", labels={"kubernetes.io/service-name": "web"},
                         annotations={"endpoints.kubernetes.io/last-change-trigger-time":
                                      "2026-11-27T10:00:00Z"}),
        "addressType": "IPv6", "ports": [{"name": "", "port": 8080}],
        "endpoints": [endpoint("fd00::1", conditions={"ready": True}, nodeName="", zone="")]},
    "no endpoints, no ports": {
        "metadata": meta("empty", labels={"kubernetes.io/service-name": "web"}),
        "addressType": "IPv4", "ports": None, "endpoints": None},
    "FQDN": {"metadata": meta("fqdn", labels={"kubernetes.io/service-name": "web"}),
             "addressType": "FQDN", "endpoints": [endpoint("example.com", conditions={})]},
}

NODE_DOCS = {
    "dual-stack, tainted": {
        "metadata": meta("node-a", None, labels={"topology.kubernetes.io/zone": "zone-1"}),
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"],
                 "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"},
                                 {"type": "InternalIP", "address": "fd00::2"},
                                 {"type": "Hostname", "address": "node-a"}]}},
    "being deleted, nothing set": {
        "metadata": meta("node-b", None, deletionTimestamp="2026-11-27T12:00:00Z"),
        "spec": {}, "status": {}},
}


@pytest.mark.parametrize("doc", SERVICE_DOCS.values(), ids=SERVICE_DOCS.keys())
def test_a_service_decodes_to_its_json_documents_fields(doc: dict[str, Any]) -> None:
    kind, obj = SERVICES.event(protoenc.watch_frame("ADDED", protoenc.service(doc))[4:])
    assert kind == "ADDED"
    assert obj == project(doc, protobuf.SERVICE)
    assert convert_service(obj) == convert_service(doc)


@pytest.mark.parametrize("doc", SLICE_DOCS.values(), ids=SLICE_DOCS.keys())
def test_a_slice_decodes_to_the_typed_document_of_its_json(doc: dict[str, Any]) -> None:
    line = json.dumps({"type": "MODIFIED", "object": doc}).encode()
    kind, obj = SLICES.event(protoenc.watch_frame("MODIFIED", protoenc.endpoint_slice(doc))[4:])
    _, from_json = SLICE_CODEC.event(line)
    assert kind == "MODIFIED" and type(obj) is SliceDoc and type(from_json) is SliceDoc
    assert obj.endpoints == from_json.endpoints
    assert (obj.address_type, obj.ports) == (from_json.address_type, from_json.ports)
    assert obj.metadata == project(doc["metadata"], protobuf.OBJECT_META)
    assert convert_endpoint_slice(obj) == convert_endpoint_slice(from_json)


@pytest.mark.parametrize("doc", NODE_DOCS.values(), ids=NODE_DOCS.keys())
def test_a_node_decodes_to_its_json_documents_fields(doc: dict[str, Any]) -> None:
    _, obj = NODES.event(protoenc.watch_frame("ADDED", protoenc.node(doc))[4:])
    assert obj == project(doc, protobuf.NODE)
    assert convert_node(obj) == convert_node(doc)


def test_a_service_cidr_decodes_to_its_json_documents_fields() -> None:
    doc = {"metadata": meta("kubernetes", None), "spec": {"cidrs": ["10.96.0.0/16"]}}
    _, obj = CIDRS.event(protoenc.watch_frame("ADDED", protoenc.service_cidr(doc))[4:])
    assert obj == project(doc, protobuf.SERVICE_CIDR)
    assert convert_service_cidr(obj) == ("10.96.0.0/16",)


class TestZeroValues:
    def test_a_value_fields_zero_is_left_out_as_json_omitempty_does(self) -> None:
        """Go writes `clusterIP: ""` and `nodePort: 0` on the wire; JSON leaves them out,
        and the conversion reads an empty type as wrong, a missing one as ClusterIP."""
        doc = svc("z", {"clusterIP": "10.96.0.9", "ports": [{"port": 80}]})
        _, obj = SERVICES.event(protoenc.watch_frame("ADDED", protoenc.service(doc))[4:])
        assert obj["spec"] == {"clusterIP": "10.96.0.9",
                               "ports": [{"port": 80, "targetPort": 0}]}
        assert convert_service(obj) == convert_service(doc)

    def test_a_pointer_fields_zero_is_kept(self) -> None:
        """`ready: false` is an unready endpoint; an absent one is ready."""
        doc = SLICE_DOCS["hints, conditions, nodeName, zone"]
        _, obj = SLICES.event(protoenc.watch_frame("ADDED", protoenc.endpoint_slice(doc))[4:])
        assert [(e.conditions.ready, e.conditions.terminating) for e in obj.endpoints
                if e.conditions] == [(True, False), (False, True), (None, None)]

    def test_a_negative_int32_is_negative(self) -> None:
        doc = svc("n", {"clusterIP": "10.96.0.9", "ports": [{"port": -1}]})
        _, obj = SERVICES.event(protoenc.watch_frame("ADDED", protoenc.service(doc))[4:])
        assert obj["spec"]["ports"][0]["port"] == -1
        assert convert_service(obj) == convert_service(doc)
        assert isinstance(convert_service(obj), Skipped)


def test_unknown_fields_of_every_wire_type_are_skipped() -> None:
    raw = protoenc.encode([(1, [(1, "x"), (3, "ns"), (99, 5)]), (50, 1 << 40), (51, "text"),
                           (52, [(1, 2)])])
    raw += b"\x99\x03" + bytes(8) + b"\x9d\x03" + bytes(4)  # field 51 as I64, 51 as I32
    obj = protobuf.decode(raw, 0, len(raw), protobuf.SERVICE)
    assert obj == {"metadata": {"name": "x", "namespace": "ns"}}


def test_invalid_utf8_reads_as_go_json_writes_it() -> None:
    raw = protoenc.encode([(1, [(1, b"a\xffb")])])
    assert protobuf.decode(raw, 0, len(raw), protobuf.SERVICE)["metadata"]["name"] == "a\ufffdb"


class TestBadInput:
    def test_a_field_of_the_wrong_type_is_named_as_a_json_one_is(self) -> None:
        """spec as a number: kept as the wire has it, the conversion says what is wrong."""
        frame = protoenc.watch_frame("ADDED", protoenc.envelope("v1", "Service", protoenc.encode(
            [(1, [(1, "w"), (3, "ns")]), (2, 7)])))[4:]
        _, obj = SERVICES.event(frame)
        skipped = convert_service(obj)
        as_json = convert_service({"metadata": {"name": "w", "namespace": "ns"}, "spec": 7})
        assert isinstance(skipped, Skipped) and skipped == as_json

    def test_a_condition_of_the_wrong_type_goes_on_as_dicts(self) -> None:
        raw = protoenc.encode([(1, [(1, "s"), (3, "ns"), (11, [(1, "kubernetes.io/service-name"),
                                                             (2, "web")])]),
                               (2, [(1, "10.0.0.1"), (2, [(1, "yes")])]), (4, "IPv4")])
        frame = protoenc.watch_frame("ADDED", protoenc.envelope("discovery.k8s.io/v1",
                                                                "EndpointSlice", raw))[4:]
        _, obj = SLICES.event(frame)
        assert type(obj) is dict
        skipped = convert_endpoint_slice(obj)
        assert isinstance(skipped, Skipped)
        assert skipped.reason.startswith("endpoints[0].conditions.ready:")

    def test_an_object_cut_short_is_skipped_by_name_with_the_reason(self) -> None:
        whole = protoenc.endpoint_slice(SLICE_DOCS["hints, conditions, nodeName, zone"])
        envelope = protobuf.unwrap(whole)
        message = whole[envelope.start:envelope.end]
        cut = protoenc.envelope("discovery.k8s.io/v1", "EndpointSlice", message[:-20])
        kind, obj = SLICES.event(protoenc.watch_frame("MODIFIED", cut)[4:])
        assert kind == "MODIFIED" and type(obj) is Unreadable
        skipped = convert_endpoint_slice(obj)
        assert isinstance(skipped, Skipped) and skipped.invalid
        assert (skipped.namespace, skipped.name) == ("ns", "web-abc")
        assert skipped.reason.startswith("undecodable protobuf: ")

    @pytest.mark.parametrize("convert", [convert_node, convert_service_cidr, convert_service])
    def test_every_kind_skips_an_unreadable_object(self, convert: Callable[[Any], Any]) -> None:
        skipped = convert(Unreadable({"name": "n"}, "undecodable protobuf: cut short"))
        assert isinstance(skipped, Skipped)
        assert (skipped.name, skipped.reason) == ("n", "undecodable protobuf: cut short")

    def test_a_frame_that_is_not_an_enveloped_object_raises(self) -> None:
        event = protoenc.encode([(1, "ADDED"), (2, [(1, b'{"kind":"Service"}')])])
        with pytest.raises(protobuf.Malformed, match="magic"):
            SERVICES.event(event)
        with pytest.raises(protobuf.Malformed):
            SERVICES.event(b"\x0a\x05ADD")


def test_bookmarks_and_errors_read_as_the_json_path_reads_them() -> None:
    end = {"k8s.io/initial-events-end": "true"}
    kind, obj = SLICES.event(protoenc.watch_frame(
        "BOOKMARK", protoenc.bookmark("discovery.k8s.io/v1", "EndpointSlice", "77", end))[4:])
    assert (kind, obj) == JSON.event(json.dumps({"type": "BOOKMARK", "object": {
        "metadata": {"resourceVersion": "77", "annotations": end}}}).encode())
    kind, obj = SLICES.event(protoenc.watch_frame(
        "ERROR", protoenc.status(410, "Expired", "too old resource version: 1 (3)"))[4:])
    assert kind == "ERROR"
    assert obj == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "code": 410,
                   "reason": "Expired", "message": "too old resource version: 1 (3)"}


def test_a_list_decodes_its_items_and_names_one_that_does_not() -> None:
    docs = list(SERVICE_DOCS.values())[:3]
    items = [protobuf.unwrap(protoenc.service(d)) for d in docs]
    raws = [i.data[i.start:i.end] for i in items]
    data = protoenc.object_list("v1", "ServiceList", [*raws, raws[0][:-3]], "99", "next")
    meta, decoded = SERVICES.page(data)
    assert meta == {"resourceVersion": "99", "continue": "next"}
    assert decoded[:3] == [project(d, protobuf.SERVICE) for d in docs]
    assert type(decoded[3]) is Unreadable and decoded[3].metadata["name"] == "a"


FRAMES = [protoenc.watch_frame("ADDED", protoenc.service(d))[4:] for d in SERVICE_DOCS.values()]
FRAMES += [protoenc.watch_frame("MODIFIED", protoenc.endpoint_slice(d))[4:]
           for d in SLICE_DOCS.values()]


@given(st.sampled_from(FRAMES), st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)),
                                        max_size=4), st.integers(0, 4000))
def test_damaged_frames_raise_malformed_or_decode_into_something_the_conversion_judges(
        frame: bytes, changes: list[tuple[int, int]], cut: int) -> None:
    """Bytes flipped, the frame cut anywhere: never another exception (the watch would log
    it as an API failure and retry, which is right only for a frame that is not one)."""
    data = bytearray(frame[:max(1, cut)])
    for at, byte in changes:
        data[at % len(data)] = byte
    for codec, convert in ((SERVICES, convert_service), (SLICES, convert_endpoint_slice)):
        try:
            _, obj = codec.event(bytes(data))
        except protobuf.Malformed:
            continue
        convert(obj)  # returns a result or a Skipped, never raises


# ---- the watch stream ------------------------------------------------------------------------


class Response:
    """A protobuf watch response whose stream yields the given chunks."""

    headers: Mapping[str, str] = {"Content-Type": "application/vnd.kubernetes.protobuf;"
                                                  "stream=watch"}

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    def stream(self, amt: int = 0, decode_content: bool = True) -> Iterator[bytes]:
        yield from self.chunks

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        pass


@given(st.lists(st.binary(max_size=40), max_size=6), st.lists(st.integers(0, 400), max_size=6))
def test_watch_frames_survive_any_chunking(frames: list[bytes], cuts: list[int]) -> None:
    data = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points)]
    assert list(_frames(Response(chunks), threading.Event())) == frames


def test_a_stream_ending_inside_a_frame_is_an_error() -> None:
    with pytest.raises(protobuf.Malformed, match="inside a frame"):
        list(_frames(Response([b"\x00\x00\x00\x09abc"]), threading.Event()))


def reflector_on(response: Response, asked: list[str]) -> Reflector:
    def call(**kwargs: Any) -> Response:
        # No `_accept`: the list function's default, JSON (collection() in watch.py).
        asked.append(kwargs.get("_accept", "application/json"))
        return response
    resource = Resource("EndpointSlice", lambda _api: call,
                        codec=SLICE_CODEC, protobuf=endpoint_slices_resource().protobuf)
    handled: list[Any] = []
    return Reflector(None, resource, lambda key, obj: handled.append((key, obj)), lambda: None,
                     threading.Event(), content_type="application/vnd.kubernetes.protobuf")


def test_a_protobuf_watch_hands_slices_over_typed_and_moves_on() -> None:
    doc = SLICE_DOCS["hints, conditions, nodeName, zone"]
    frames = [protoenc.watch_frame("ADDED", protoenc.endpoint_slice(doc)),
              protoenc.watch_frame("BOOKMARK", protoenc.bookmark("discovery.k8s.io/v1",
                                                                 "EndpointSlice", "50"))]
    asked: list[str] = []
    refl = reflector_on(Response([b"".join(frames)]), asked)
    objects: list[Any] = []
    refl.handler = lambda key, obj: objects.append((key, obj))
    assert refl._watch("1") == "50"
    assert asked == ["application/vnd.kubernetes.protobuf;stream=watch, application/json"]
    assert [(key, type(obj)) for key, obj in objects] == [(("ns", "web-abc"), SliceDoc)]


def test_a_410_error_event_in_protobuf_relists() -> None:
    gone = Response([protoenc.watch_frame(
        "ERROR", protoenc.status(410, "Expired", "too old resource version: 1 (3)"))])
    refl = reflector_on(gone, [])
    with pytest.raises(Expired, match="too old resource version"):
        refl._watch("1")
    assert gone.closed


def test_json_keeps_the_json_watch() -> None:
    asked: list[str] = []
    refl = reflector_on(Response([]), asked)
    refl.protobuf_watch = False
    refl._watch("1")
    assert asked == ["application/json"]
