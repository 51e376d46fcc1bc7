"""The API server's bytes → what a reflector hands over: watch events and list pages.

Every resource is read into plain dicts (`JsonCodec`), except those with a typed document
(EndpointSlices: `pyproxy/core/wire.py`), which msgspec decodes straight into it: at 10k
services the slices' decoding and conversion were a third of the time from start to the
first ruleset. Bookmarks, errors, and anything that does not fit the document's types are
read as dicts, so the conversion sees the object as the API sent it and names what is
wrong with it.

A watch asked for in protobuf (`clientConnection.contentType`, cluster/watch.py says where)
is read by `ProtobufCodec` into the same documents, as far as the proxy reads them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec

from pyproxy.core import protobuf
from pyproxy.core.wire import Unreadable

# The events that carry an object of the watched kind.
OBJECT_EVENTS = frozenset({"ADDED", "MODIFIED", "DELETED"})


class Codec(Protocol):
    def event(self, line: bytes) -> tuple[Any, Any]:
        """One line of a watch stream → (event type, object)."""
        ...

    def page(self, data: bytes) -> tuple[Mapping[str, Any], list[Any]]:
        """One list response → (its metadata, its items)."""
        ...


class JsonCodec:
    """Plain dicts, as the API sent them. msgspec's untyped decoder builds the same dicts
    and lists as `json.loads`, 2 to 4 times faster (10k Services: 0.10-0.22 s against
    0.04-0.05 s); what it refuses and `json.loads` reads (NaN, a number beyond a double, a
    lone surrogate escape: nothing a Go encoder writes) is read by `json.loads`."""

    def __init__(self) -> None:
        self._decode = msgspec.json.Decoder().decode

    def loads(self, data: bytes) -> Any:
        try:
            return self._decode(data)
        except msgspec.DecodeError:
            return json.loads(data)

    def event(self, line: bytes) -> tuple[Any, Any]:
        event = self.loads(line)
        return event.get("type"), event.get("object") or {}

    def page(self, data: bytes) -> tuple[Mapping[str, Any], list[Any]]:
        body = self.loads(data)
        return body.get("metadata") or {}, body.get("items") or []


JSON = JsonCodec()


class TypedCodec:
    """Objects decoded into `document` (a msgspec Struct with a `metadata` field), the rest
    as JsonCodec. A list page with one object that does not fit is read as dicts whole: the
    conversion then skips that object with its reason and takes the others as always."""

    def __init__(self, document: type[msgspec.Struct]) -> None:
        event = msgspec.defstruct(f"{document.__name__}Event", [("type", str),
                                                                ("object", document)])
        items: Any = list[document] | None  # type: ignore[valid-type]
        page = msgspec.defstruct(f"{document.__name__}Page",
                                 [("metadata", Any, None), ("items", items, None)])
        # Any: defstruct's types are made here, unknown to the type checker
        self._events: msgspec.json.Decoder[Any] = msgspec.json.Decoder(event)
        self._pages: msgspec.json.Decoder[Any] = msgspec.json.Decoder(page)

    def event(self, line: bytes) -> tuple[Any, Any]:
        try:
            event = self._events.decode(line)
        except msgspec.DecodeError:  # also what does not fit the types
            return JSON.event(line)
        if event.type not in OBJECT_EVENTS:  # a bookmark or an error: read as dicts
            return JSON.event(line)
        return event.type, event.object

    def page(self, data: bytes) -> tuple[Mapping[str, Any], list[Any]]:
        try:
            page = self._pages.decode(data)
        except msgspec.DecodeError:
            return JSON.page(data)
        meta = page.metadata
        return meta if isinstance(meta, dict) else {}, page.items or []


class ProtobufCodec:
    """Kubernetes protobuf (`pyproxy/core/protobuf.py`): a watch frame (without its length)
    or a list response → the dicts the JSON path makes, as far as the proxy reads them, or
    the typed document `typed` makes of one (None: it does not fit, the dict goes on).
    What does not decode as a whole (a frame that is not a WatchEvent, a list that is not
    a list) raises, as a line that is not JSON does; one object that does not decode in a
    frame or list that does is an `Unreadable`, skipped by the conversion with the reason."""

    def __init__(self, schema: protobuf.Schema,
                 typed: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.schema = schema
        self.typed = typed

    def event(self, frame: bytes) -> tuple[Any, Any]:
        kind, envelope = protobuf.watch_event(frame)
        if kind not in OBJECT_EVENTS:  # a bookmark (metadata only) or an ERROR (a Status)
            return kind, protobuf.decode_object(envelope, self.schema)
        return kind, self._object(envelope.data, envelope.start, envelope.end)

    def page(self, data: bytes) -> tuple[Mapping[str, Any], list[Any]]:
        return protobuf.decode_list(data, self._object)

    def _object(self, buf: bytes, start: int, end: int) -> Any:
        try:
            obj = protobuf.decode(buf, start, end, self.schema)
        except protobuf.Malformed as err:
            return Unreadable(protobuf.readable_metadata(buf, start, end),
                              f"undecodable protobuf: {err}")
        if self.typed is not None:
            return self.typed(obj) or obj
        return obj
