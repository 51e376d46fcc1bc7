"""Kubernetes protobuf → the documents the JSON path makes, as far as the proxy reads them. Pure.

The API server speaks protobuf to any client that asks (`application/vnd.kubernetes.protobuf`,
kube-proxy's default contentType): a watch event of a 10-endpoint EndpointSlice is about
half its JSON (docs/fleet.md). The dependency list is fixed, so this is the wire format
read by hand, and only for the fields the conversion reads (`pyproxy/core/convert.py`); the
rest (managedFields, uid, targetRef, a Node's images…) is skipped by its length.

The shapes, from the .proto files of k8s.io/api and k8s.io/apimachinery v0.37.2:
- an object is the 4-byte magic `k8s\\x00` and a runtime.Unknown {1 typeMeta {1 apiVersion,
  2 kind}, 2 raw, 3 contentEncoding, 4 contentType} whose raw is the object's message;
- a watch stream is frames of a 4-byte big-endian length and a metav1.WatchEvent {1 type,
  2 object: RawExtension {1 raw}}, raw being again an enveloped object (a metav1.Status for
  an ERROR event).

proto2 as the Go types write it: a field that is a value in Go (a `string`, an `int32`) is
always on the wire, its zero value too, while its JSON has `omitempty` and leaves the zero
out; a pointer (`*string`, `*bool`) is on the wire only when set, zero or not, as in JSON.
So a value field's zero is dropped here and a pointer field's kept: `ready: false` stays
false, an empty `clusterIP` is absent, as in the JSON document. A field of the wrong wire
type is kept as what the wire holds (an int, or bytes), as JSON of the wrong type is, so
the conversion names the field; a message cut short raises `Malformed`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pyproxy.core.wire import SliceDoc

MAGIC = b"k8s\x00"
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"

# Wire types.
VARINT, I64, LEN, I32 = 0, 1, 2, 5


class Malformed(ValueError):
    """Bytes that are not the protobuf they should be (cut short, a bad varint, no magic)."""


# ---------------------------------------------------------------------------------------------
# The wire format


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at pos, and the position after it."""
    result, shift = 0, 0
    while True:
        try:
            byte = buf[pos]
        except IndexError:
            raise Malformed(f"varint cut short at byte {pos}") from None
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise Malformed(f"varint longer than 10 bytes at byte {pos}")


def _skip(buf: bytes, pos: int, end: int, wire: int) -> int:
    """The position after a field's value of this wire type (an unknown field)."""
    if wire == VARINT:
        return varint(buf, pos)[1]
    if wire == LEN:
        size, pos = varint(buf, pos)
        pos += size
    elif wire == I64:
        pos += 8
    elif wire == I32:
        pos += 4
    else:  # groups (3, 4): proto1, never written by Kubernetes
        raise Malformed(f"wire type {wire} at byte {pos}")
    if pos > end:
        raise Malformed(f"field cut short at byte {end}")
    return pos


# ---------------------------------------------------------------------------------------------
# Schemas: field number → how to read it


@dataclass(frozen=True, slots=True)
class Field:
    """One field the proxy reads. `read` makes the value: from (buf, start, end) for a
    length-delimited field, from the int for a varint. `keep_zero`: a Go pointer (set means
    present, whatever its value); otherwise the zero value is left out as JSON's omitempty.
    `repeated` fields are lists; `entry` ones are a map's entries (key 1, value 2)."""

    name: str
    wire: int
    read: Callable[..., Any]
    keep_zero: bool = False
    repeated: bool = False
    entry: bool = False
    text: bool = False
    """A string: read inline, `read` is not called."""
    schema: Schema | None = None
    """A message's fields (what `read` decodes)."""


Schema = Mapping[int, Field]


def _int32(value: int) -> int:
    # A negative int32 is written as the 10-byte varint of its 64-bit two's complement.
    return value - (1 << 64) if value >= 1 << 63 else value


def _bool(value: int) -> bool:
    return value != 0


def message(schema: Schema) -> Callable[[bytes, int, int], dict[str, Any]]:
    def read(buf: bytes, start: int, end: int) -> dict[str, Any]:
        return decode(buf, start, end, schema)
    return read


def decode(buf: bytes, pos: int, end: int, schema: Schema) -> dict[str, Any]:
    """The message in buf[pos:end] as a dict of the schema's fields (JSON names).
    Written for speed (a watch event's slice is ~150 fields): one-byte varints, nearly all
    keys and lengths, are read inline, and strings without a call."""
    out: dict[str, Any] = {}
    value: Any
    while pos < end:
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = varint(buf, pos)
        field = schema.get(key >> 3)
        wire = key & 7
        if field is None or wire != field.wire:
            start = pos
            pos = _skip(buf, pos, end, wire)
            if field is not None:  # a known field of the wrong type: kept as it came
                _misfit(out, field, varint(buf, start)[0] if wire == VARINT else buf[start:pos])
            continue
        if wire == LEN:
            size = buf[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = varint(buf, pos)
            stop = pos + size
            if stop > end:
                raise Malformed(f"field {field.name} cut short at byte {end}")
            if field.text:
                # Go's JSON encoder writes invalid UTF-8 as U+FFFD: the same string either way.
                value = buf[pos:stop].decode("utf-8", "replace")
            else:
                value = field.read(buf, pos, stop)
            pos = stop
        else:
            value = buf[pos]
            if value < 0x80:
                pos += 1
            else:
                value, pos = varint(buf, pos)
            value = field.read(value)
        if field.entry:
            out.setdefault(field.name, {})[value.get("key", "")] = value.get("value", "")
        elif field.repeated:
            values = out.setdefault(field.name, [])
            if isinstance(values, list):  # else a misfit came first: the conversion names it
                values.append(value)
        elif value or field.keep_zero:
            out[field.name] = value
    if pos != end:  # a varint ran past the message's end
        raise Malformed(f"message overruns its length by {pos - end} bytes")
    return out


def _misfit(out: dict[str, Any], field: Field, value: int | bytes) -> None:
    """A known field of another wire type: kept as the wire has it, as JSON of the wrong
    type would be (the conversion names it), in a list if the field is one. A map entry has
    nothing a conversion could name: the object is unreadable."""
    if field.entry:
        raise Malformed(f"{field.name}: an entry of the wrong wire type")
    if field.repeated:
        values = out.setdefault(field.name, [])
        if isinstance(values, list):
            values.append(value)
    else:
        out[field.name] = value


def _str(name: str, *, keep_zero: bool = False) -> Field:
    return Field(name, LEN, str, keep_zero=keep_zero, text=True)


def _strs(name: str) -> Field:
    return Field(name, LEN, str, repeated=True, text=True)


def _i32(name: str, *, keep_zero: bool = False) -> Field:
    return Field(name, VARINT, _int32, keep_zero=keep_zero)


def _msg(name: str, schema: Schema, *, repeated: bool = False) -> Field:
    # keep_zero: a struct is in the JSON document even when empty, a pointer when set
    return Field(name, LEN, message(schema), keep_zero=True, repeated=repeated, schema=schema)


_ENTRY = message({1: _str("key", keep_zero=True), 2: _str("value", keep_zero=True)})


def _map(name: str) -> Field:
    return Field(name, LEN, _ENTRY, entry=True)


def _time(buf: bytes, start: int, end: int) -> str:
    """metav1.Time {1 seconds, 2 nanos} as its JSON: RFC 3339, seconds precision."""
    seconds = decode(buf, start, end, _TIME).get("seconds", 0)
    try:
        when = datetime.datetime.fromtimestamp(_int32(int(seconds)), datetime.UTC)
    except (TypeError, ValueError, OverflowError, OSError) as err:
        raise Malformed(f"a time of {seconds!r} seconds: {err}") from None
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


_TIME: Schema = {1: Field("seconds", VARINT, int, keep_zero=True)}


def _int_or_string(buf: bytes, start: int, end: int) -> int | str:
    """intstr.IntOrString {1 type (0 int, 1 string), 2 intVal, 3 strVal}, as JSON has it."""
    value = decode(buf, start, end, _INT_OR_STRING)
    chosen: int | str = value.get("strVal", "") if value.get("type") == 1 \
        else value.get("intVal", 0)
    return chosen


_INT_OR_STRING: Schema = {1: Field("type", VARINT, int), 2: _i32("intVal"), 3: _str("strVal")}

OBJECT_META: Schema = {
    1: _str("name"),
    3: _str("namespace"),
    6: _str("resourceVersion"),
    9: Field("deletionTimestamp", LEN, _time, keep_zero=True),
    11: _map("labels"),
    12: _map("annotations"),
}
LIST_META: Schema = {2: _str("resourceVersion"), 3: _str("continue")}

SERVICE_PORT: Schema = {
    1: _str("name"),
    2: _str("protocol"),
    3: _i32("port", keep_zero=True),  # `json:"port"`: no omitempty
    4: Field("targetPort", LEN, _int_or_string, keep_zero=True),
    5: _i32("nodePort"),
}
_CLIENT_IP: Schema = {1: _i32("timeoutSeconds", keep_zero=True)}
SERVICE_SPEC: Schema = {
    1: _msg("ports", SERVICE_PORT, repeated=True),
    3: _str("clusterIP"),
    4: _str("type"),
    5: _strs("externalIPs"),
    7: _str("sessionAffinity"),
    9: _strs("loadBalancerSourceRanges"),
    11: _str("externalTrafficPolicy"),
    12: _i32("healthCheckNodePort"),
    14: _msg("sessionAffinityConfig", {1: _msg("clientIP", _CLIENT_IP)}),
    18: _strs("clusterIPs"),
    19: _strs("ipFamilies"),
    22: _str("internalTrafficPolicy", keep_zero=True),
    23: _str("trafficDistribution", keep_zero=True),
}
_INGRESS: Schema = {1: _str("ip"), 2: _str("hostname"), 3: _str("ipMode", keep_zero=True)}
SERVICE: Schema = {
    1: _msg("metadata", OBJECT_META),
    2: _msg("spec", SERVICE_SPEC),
    3: _msg("status", {1: _msg("loadBalancer", {1: _msg("ingress", _INGRESS, repeated=True)})}),
}

_NAME: Schema = {1: _str("name", keep_zero=True)}  # ForZone/ForNode: `json:"name"`
ENDPOINT: Schema = {
    1: _strs("addresses"),
    2: _msg("conditions", {1: Field("ready", VARINT, _bool, keep_zero=True),
                           2: Field("serving", VARINT, _bool, keep_zero=True),
                           3: Field("terminating", VARINT, _bool, keep_zero=True)}),
    5: _map("deprecatedTopology"),
    6: _str("nodeName", keep_zero=True),
    7: _str("zone", keep_zero=True),
    8: _msg("hints", {1: _msg("forZones", _NAME, repeated=True),
                      2: _msg("forNodes", _NAME, repeated=True)}),
}
ENDPOINT_PORT: Schema = {
    1: _str("name", keep_zero=True),
    2: _str("protocol", keep_zero=True),
    3: _i32("port", keep_zero=True),
}
ENDPOINT_SLICE: Schema = {
    1: _msg("metadata", OBJECT_META),
    2: _msg("endpoints", ENDPOINT, repeated=True),
    3: _msg("ports", ENDPOINT_PORT, repeated=True),
    4: _str("addressType", keep_zero=True),  # `json:"addressType"`: no omitempty
}

_TAINT: Schema = {1: _str("key", keep_zero=True), 2: _str("value"),
                  3: _str("effect", keep_zero=True)}
_NODE_ADDRESS: Schema = {1: _str("type", keep_zero=True), 2: _str("address", keep_zero=True)}
NODE: Schema = {
    1: _msg("metadata", OBJECT_META),
    2: _msg("spec", {1: _str("podCIDR"), 5: _msg("taints", _TAINT, repeated=True),
                     7: _strs("podCIDRs")}),
    3: _msg("status", {5: _msg("addresses", _NODE_ADDRESS, repeated=True)}),
}

SERVICE_CIDR: Schema = {
    1: _msg("metadata", OBJECT_META),
    2: _msg("spec", {1: _strs("cidrs")}),
}

STATUS: Schema = {
    1: _msg("metadata", LIST_META),
    2: _str("status"),
    3: _str("message"),
    4: _str("reason"),
    6: _i32("code"),
}

# runtime.Unknown, the envelope after the magic.
_TYPE_META: Schema = {1: _str("apiVersion"), 2: _str("kind")}
_UNKNOWN: Schema = {
    1: _msg("typeMeta", _TYPE_META),
    2: Field("raw", LEN, lambda buf, start, end: (start, end), keep_zero=True),
    3: _str("contentEncoding"),
}
_WATCH_EVENT: Schema = {
    1: _str("type"),
    2: _msg("object", {1: Field("raw", LEN, lambda buf, start, end: (start, end),
                                keep_zero=True)}),
}


# ---------------------------------------------------------------------------------------------
# Objects, lists, watch events


@dataclass(frozen=True, slots=True)
class Envelope:
    """An enveloped object: its type and where its message is in `data`."""

    api_version: str
    kind: str
    data: bytes
    start: int
    end: int


def unwrap(data: bytes) -> Envelope:
    """The runtime.Unknown after the magic. Refuses what a client cannot read: no magic, or
    a contentEncoding (the server never sets one; gzip is the HTTP layer's)."""
    if not data.startswith(MAGIC):
        raise Malformed("no k8s protobuf magic")
    unknown = decode(data, len(MAGIC), len(data), _UNKNOWN)
    if unknown.get("contentEncoding"):
        raise Malformed(f"contentEncoding {unknown['contentEncoding']!r}")
    type_meta, raw = unknown.get("typeMeta") or {}, unknown.get("raw") or (0, 0)
    if not isinstance(type_meta, dict) or not isinstance(raw, tuple):
        raise Malformed("an envelope of the wrong wire types")
    return Envelope(str(type_meta.get("apiVersion", "")), str(type_meta.get("kind", "")),
                    data, *raw)


def decode_object(envelope: Envelope, schema: Schema) -> dict[str, Any]:
    """The enveloped object as the JSON document's dict (the schema's fields); a Status
    whatever the schema (an ERROR event's), with its kind as JSON has it."""
    if envelope.kind == "Status":
        return {"kind": "Status", "apiVersion": envelope.api_version,
                **decode(envelope.data, envelope.start, envelope.end, STATUS)}
    return decode(envelope.data, envelope.start, envelope.end, schema)


def decode_list(data: bytes, item: Callable[[bytes, int, int], Any]
                ) -> tuple[dict[str, Any], list[Any]]:
    """A list response (an enveloped ServiceList, EndpointSliceList…): its metadata, and its
    items as `item` reads each. A Status instead (an error the client let through) has no
    items."""
    envelope = unwrap(data)
    if envelope.kind == "Status":
        return {}, []
    body = decode(envelope.data, envelope.start, envelope.end,
                  {1: _msg("metadata", LIST_META), 2: Field("items", LEN, item, repeated=True)})
    meta, items = body.get("metadata") or {}, body.get("items") or []
    if not isinstance(meta, dict) or not isinstance(items, list):
        raise Malformed("a list of the wrong wire types")
    return meta, items


def readable_metadata(buf: bytes, start: int, end: int) -> dict[str, Any]:
    """The metadata (field 1 of every object) of a message that does not decode whole, if it
    does; {} otherwise. Only names what is skipped."""
    try:
        key, pos = varint(buf, start)
        if key != (1 << 3 | LEN):
            return {}
        size, pos = varint(buf, pos)
        return decode(buf, pos, min(pos + size, end), OBJECT_META) if pos + size <= end else {}
    except Malformed:
        return {}


def watch_event(frame: bytes) -> tuple[str, Envelope]:
    """One frame of a watch stream (without its length): the event type and its object."""
    event = decode(frame, 0, len(frame), _WATCH_EVENT)
    obj = event.get("object") or {}
    raw = obj.get("raw") if isinstance(obj, dict) else None
    if not isinstance(raw, tuple):
        raise Malformed("a watch event without its object")
    return str(event.get("type", "")), unwrap(frame[raw[0]:raw[1]])


def slice_doc(obj: Mapping[str, Any]) -> SliceDoc | None:
    """An EndpointSlice's dict as the typed document msgspec makes of its JSON, or None
    where a field is of a type the document does not take (the dict then goes on as it
    came, as the JSON path does: the conversion names the field). msgspec's convert checks
    the types as its JSON decoder does, in C."""
    try:
        return msgspec.convert(obj, SliceDoc)
    except msgspec.ValidationError:
        return None
