"""A tiny Kubernetes protobuf encoder for tests: the bytes the API server writes, made from
the API's JSON documents as Go's generated Marshal writes them (a value field always, its
zero too; a pointer field only when set). Written from the .proto files apart from the
decoder (`pyproxy/core/protobuf.py`), so that a field number or a zero-value rule wrong in
one is caught by the other. Only the fields of the kinds pyproxy watches, plus the
managedFields and uid a real object carries (the decoder must skip them)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from pyproxy.core import protobuf

MAGIC = b"k8s\x00"

# A message: (field number, value) pairs; a value is an int/bool (varint), str/bytes
# (length-delimited) or a message (a list of pairs, length-delimited).
Message = list[tuple[int, Any]]


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # Go writes a negative int32 as its 64-bit two's complement
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(message: Message) -> bytes:
    out = bytearray()
    for number, value in message:
        if isinstance(value, bool | int):
            out += varint(number << 3) + varint(int(value))
            continue
        if isinstance(value, str):
            value = value.encode()
        elif isinstance(value, list):
            value = encode(value)
        out += varint(number << 3 | 2) + varint(len(value)) + value
    return bytes(out)


def envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    """runtime.Unknown after the magic, as the API server's protobuf serializer writes it."""
    return MAGIC + encode([(1, [(1, api_version), (2, kind)]), (2, raw), (3, ""), (4, "")])


def watch_frame(event_type: str, obj: bytes) -> bytes:
    """One frame of a protobuf watch stream: length, then WatchEvent {type, object.raw}."""
    event = encode([(1, event_type), (2, [(1, obj)])])
    return len(event).to_bytes(4, "big") + event


def object_list(api_version: str, kind: str, items: list[bytes], version: str = "",
                token: str = "") -> bytes:
    """A list response: ListMeta {selfLink, resourceVersion, continue}, the items."""
    meta = [(1, ""), (2, version), (3, token)]
    return envelope(api_version, kind, encode([(1, meta)] + [(2, item) for item in items]))


def _s(value: Any) -> str:
    return "" if value is None else str(value)


def _time(text: str) -> Message:
    when = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    return [(1, int(when.timestamp())), (2, 0)]


def _map(number: int, values: Mapping[str, str] | None) -> Message:
    return [(number, [(1, k), (2, v)]) for k, v in (values or {}).items()]


def object_meta(meta: Mapping[str, Any]) -> Message:
    out: Message = [(1, _s(meta.get("name"))), (2, ""), (3, _s(meta.get("namespace"))),
                    (4, ""), (5, "7a1f0c52-0000-4000-8000-000000000000"),
                    (6, _s(meta.get("resourceVersion"))), (7, 0),
                    (8, _time("2026-11-27T10:00:00Z"))]
    if meta.get("deletionTimestamp"):
        out.append((9, _time(meta["deletionTimestamp"])))
    out += _map(11, meta.get("labels")) + _map(12, meta.get("annotations"))
    # a managedFields entry: manager, operation, apiVersion, fieldsType, fieldsV1 {raw}
    out.append((17, [(1, "kube-controller-manager"), (2, "Update"), (3, "v1"),
                     (6, "FieldsV1"), (7, [(1, b'{"f:metadata":{}}')])]))
    return out


def _int_or_string(value: Any) -> Message:
    if isinstance(value, str):
        return [(1, 1), (2, 0), (3, value)]
    return [(1, 0), (2, int(value or 0)), (3, "")]


def service(doc: Mapping[str, Any]) -> bytes:
    """A Service as the API server writes it (core/v1 generated.proto)."""
    spec, status = doc.get("spec") or {}, doc.get("status") or {}
    ports: Message = [
        (1, [(1, _s(p.get("name"))), (2, _s(p.get("protocol"))), (3, int(p.get("port", 0))),
             (4, _int_or_string(p.get("targetPort", 0))), (5, int(p.get("nodePort", 0))),
             *([(6, p["appProtocol"])] if "appProtocol" in p else [])])
        for p in spec.get("ports") or []]
    affinity = spec.get("sessionAffinityConfig")
    out: Message = ports + _map(2, spec.get("selector")) + [
        (3, _s(spec.get("clusterIP"))), (4, _s(spec.get("type"))),
        *[(5, ip) for ip in spec.get("externalIPs") or []],
        (7, _s(spec.get("sessionAffinity"))), (8, ""),
        *[(9, r) for r in spec.get("loadBalancerSourceRanges") or []],
        (10, ""), (11, _s(spec.get("externalTrafficPolicy"))),
        (12, int(spec.get("healthCheckNodePort", 0))), (13, False)]
    if affinity is not None:
        client_ip = affinity.get("clientIP")
        out.append((14, [] if client_ip is None else [(1, [
            *([(1, client_ip["timeoutSeconds"])] if "timeoutSeconds" in client_ip else [])])]))
    if "ipFamilyPolicy" in spec:
        out.append((17, spec["ipFamilyPolicy"]))
    out += [(18, ip) for ip in spec.get("clusterIPs") or []]
    out += [(19, f) for f in spec.get("ipFamilies") or []]
    for number, name in ((22, "internalTrafficPolicy"), (23, "trafficDistribution")):
        if name in spec:
            out.append((number, spec[name]))
    ingress = [(1, [(1, _s(i.get("ip"))), (2, _s(i.get("hostname"))),
                    *([(3, i["ipMode"])] if "ipMode" in i else [])])
               for i in (status.get("loadBalancer") or {}).get("ingress") or []]
    return envelope("v1", "Service", encode([
        (1, object_meta(doc.get("metadata") or {})), (2, out), (3, [(1, ingress)])]))


def _endpoint(raw: Mapping[str, Any]) -> Message:
    out: Message = [(1, a) for a in raw.get("addresses") or []]
    conditions = raw.get("conditions") or {}
    out.append((2, [(number, conditions[name]) for number, name in
                    ((1, "ready"), (2, "serving"), (3, "terminating")) if name in conditions]))
    if "targetRef" in raw:
        ref = raw["targetRef"]
        out.append((4, [(1, _s(ref.get("kind"))), (2, _s(ref.get("namespace"))),
                        (3, _s(ref.get("name"))), (4, "uid-of-the-pod"), (5, ""), (6, "")]))
    out += _map(5, raw.get("deprecatedTopology"))
    for number, name in ((6, "nodeName"), (7, "zone")):
        if name in raw:
            out.append((number, raw[name]))
    if "hints" in raw:
        hints = raw["hints"] or {}
        out.append((8, [(1, [(1, z["name"])]) for z in hints.get("forZones") or []]
                    + [(2, [(1, n["name"])]) for n in hints.get("forNodes") or []]))
    return out


def endpoint_slice(doc: Mapping[str, Any]) -> bytes:
    """An EndpointSlice as the API server writes it (discovery/v1 generated.proto)."""
    out: Message = [(1, object_meta(doc.get("metadata") or {}))]
    out += [(2, _endpoint(e)) for e in doc.get("endpoints") or []]
    out += [(3, [(number, p[name]) for number, name in
                 ((1, "name"), (2, "protocol"), (3, "port"), (4, "appProtocol")) if name in p])
            for p in doc.get("ports") or []]
    out.append((4, _s(doc.get("addressType"))))
    return envelope("discovery.k8s.io/v1", "EndpointSlice", encode(out))


def node(doc: Mapping[str, Any]) -> bytes:
    """A Node as the API server writes it (core/v1), with some of what pyproxy skips."""
    spec, status = doc.get("spec") or {}, doc.get("status") or {}
    taints = [(5, [(1, _s(t.get("key"))), (2, _s(t.get("value"))), (3, _s(t.get("effect")))])
              for t in spec.get("taints") or []]
    out_spec: Message = [(1, _s(spec.get("podCIDR"))), (2, ""), (3, ""), (4, False), *taints,
                         *[(7, c) for c in spec.get("podCIDRs") or []]]
    capacity = [(1, [(1, "cpu"), (2, [(1, "4")])])]
    addresses = [(5, [(1, _s(a.get("type"))), (2, _s(a.get("address")))])
                 for a in status.get("addresses") or []]
    out_status: Message = [*capacity, (3, ""), *addresses,
                           (7, [(1, "machine-id"), (2, "system-uuid")])]
    return envelope("v1", "Node", encode([
        (1, object_meta(doc.get("metadata") or {})), (2, out_spec), (3, out_status)]))


def service_cidr(doc: Mapping[str, Any]) -> bytes:
    spec = doc.get("spec") or {}
    return envelope("networking.k8s.io/v1", "ServiceCIDR", encode([
        (1, object_meta(doc.get("metadata") or {})),
        (2, [(1, c) for c in spec.get("cidrs") or []]), (3, [])]))


def status(code: int, reason: str, message: str) -> bytes:
    """A metav1.Status (an ERROR event's object)."""
    return envelope("v1", "Status", encode([
        (1, [(1, ""), (2, ""), (3, "")]), (2, "Failure"), (3, message), (4, reason),
        (6, code)]))


def bookmark(api_version: str, kind: str, version: str,
             annotations: Mapping[str, str] | None = None) -> bytes:
    """A BOOKMARK event's object: an empty object of the kind with its resourceVersion."""
    meta: Message = [(6, version), *_map(12, annotations)]
    return envelope(api_version, kind, encode([(1, meta)]))


ENCODERS = {"Service": service, "EndpointSlice": endpoint_slice, "Node": node,
            "ServiceCIDR": service_cidr}


def event_frame(event: Mapping[str, Any], api_version: str, kind: str) -> bytes:
    """A JSON watch event ({type, object}) of the kind as the frame of a protobuf watch."""
    obj = event.get("object") or {}
    if event["type"] == "ERROR":
        raw = status(int(obj.get("code", 0)), str(obj.get("reason", "")),
                     str(obj.get("message", "")))
    elif event["type"] == "BOOKMARK":
        meta = obj.get("metadata") or {}
        raw = bookmark(api_version, kind, str(meta.get("resourceVersion", "")),
                       meta.get("annotations"))
    else:
        raw = ENCODERS[kind](obj)
    return watch_frame(str(event["type"]), raw)


def project(doc: Any, schema: protobuf.Schema) -> Any:
    """The JSON document's fields the schema reads (null and a JSON-only zero left out as
    the decoder leaves them: what the conversion reads the same either way)."""
    out: dict[str, Any] = {}
    for field in schema.values():
        value = doc.get(field.name)
        if value is None:
            continue
        if field.schema is not None:
            value = [project(v, field.schema) for v in value] if field.repeated \
                else project(value, field.schema)
        out[field.name] = value
    return out
