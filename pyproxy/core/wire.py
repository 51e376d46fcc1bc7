"""EndpointSlices as msgspec decodes them: the hot part of an initial list, typed in C. Pure.

Endpoints are most of what a node reads from the API (100k to 250k in an initial list).
Decoded by `json.loads` into dicts and walked field by field in Python, an endpoint cost ~12 µs;
msgspec decodes the JSON straight into these structs, checks the types of the fields every
endpoint has (its conditions) in C, and skips what the proxy never reads (targetRef, uid,
managedFields…). Every other field is plain data (`Any`): metadata, ports, addresses, hints
and topology are read and validated by the same code as a dict from a snapshot file
(`pyproxy/core/convert.py`), so both ways in give the same model and the same errors.

A document that does not fit these types (a boolean condition written as a string, say) is
not an error here: the reader reads it as plain dicts instead (`pyproxy/cluster/codec.py`),
and the conversion names the field that is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


class Conditions(msgspec.Struct, frozen=True, gc=False):
    """An endpoint's conditions; None where the API left one out (the defaults are the
    conversion's: ready and serving true, terminating false)."""

    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


NO_CONDITIONS = Conditions()


class EndpointDoc(msgspec.Struct, frozen=True, gc=False,
                  rename={"node_name": "nodeName", "deprecated_topology": "deprecatedTopology"}):
    """One entry of an EndpointSlice's `endpoints`, as far as the proxy reads it."""

    addresses: Any = None
    conditions: Conditions | None = None
    node_name: Any = None
    zone: Any = None
    hints: Any = None
    deprecated_topology: Any = None


class SliceDoc(msgspec.Struct, frozen=True, gc=False, rename={"address_type": "addressType"}):
    """An EndpointSlice, as far as the proxy reads it: only `endpoints` is typed."""

    metadata: Any = None
    address_type: Any = None
    ports: Any = None
    endpoints: list[EndpointDoc] | None = None


def metadata(obj: Any) -> Mapping[str, Any]:
    """An object's metadata, whichever way it was decoded: a dict's, a document's, or {}
    when it has none that is a mapping."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else getattr(obj, "metadata", None)
    return meta if isinstance(meta, Mapping) else {}


class Unreadable(msgspec.Struct, frozen=True):
    """An object the API server sent that could not be decoded (protobuf cut short or
    otherwise broken: `pyproxy/core/protobuf.py`): its metadata as far as it was read, so
    that the object is named, and why. The conversion skips it with that reason, as it
    skips a JSON object of the wrong shape: logged, counted, the watch goes on."""

    metadata: Any
    reason: str
