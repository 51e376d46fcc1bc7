"""Reading API fields for the conversions (pyproxy/core/convert.py, convert_endpoints.py): each
reader takes a value as the API (or a snapshot) gave it and the field's name, and returns it
validated or raises Invalid naming the field; `guarded` runs one object's conversion and turns
every failure into a Skipped. Everything that later ends up in nft text passes through these,
so they are strict: names must be DNS labels, addresses must parse, ports must be in range."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import date, datetime
from typing import Any, TypeVar

import structlog

from pyproxy.core.goip import (
    parse_cidr_sloppy,
    parse_ip_sloppy,
)
from pyproxy.core.model import (
    IPFamily,
    Protocol,
    Skipped,
    TrafficPolicy,
)
from pyproxy.core.wire import Unreadable, metadata

# Bounds on list sizes. The API server enforces most of these (an EndpointSlice holds at most
# 1000 endpoints and 100 ports); a snapshot file or a broken server might not, and one huge
# object must not make the whole node's ruleset unloadable.
MAX_SERVICE_PORTS = 1000
MAX_SLICE_ENDPOINTS = 1000
MAX_SLICE_PORTS = 100
MAX_ADDRESS_LIST = 256
MAX_SOURCE_RANGES = 1024
MAX_TOPOLOGY_KEYS = 16
MAX_HINTS = 64
MAX_AFFINITY_TIMEOUT = 86400

# Matched with fullmatch: `$` alone also matches before a trailing newline.
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")


T = TypeVar("T")

log = structlog.get_logger(__name__)


class Invalid(ValueError):
    """A field failed validation; the message names the field."""


# ---------------------------------------------------------------------------------------------
# Client objects → API dicts


def api_dict(obj: Any) -> Any:
    """The API (camelCase JSON) form of an object from the `kubernetes` client, or the object
    itself when it already is plain data (returned as is: copying 10k objects' worth of
    dicts was half the cost of converting an initial list). The client's models carry
    `attribute_map` (python name → JSON name); walking it avoids importing the client."""
    if type(obj) is dict:
        return obj
    return _from_model(obj)


def _from_model(obj: Any) -> Any:
    attribute_map = getattr(obj, "attribute_map", None)
    if isinstance(attribute_map, Mapping):
        out: dict[str, Any] = {}
        for attr, json_name in attribute_map.items():
            value = getattr(obj, attr, None)
            if value is not None:
                out[json_name] = _from_model(value)
        return out
    if isinstance(obj, Mapping):
        return {k: _from_model(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_from_model(v) for v in obj]
    if isinstance(obj, datetime | date):
        return obj.isoformat()
    return obj


# ---------------------------------------------------------------------------------------------
# Field accessors: each raises Invalid naming the field.


def read_mapping(value: Any, field: str) -> Mapping[str, Any]:
    if type(value) is dict:  # the common case, without the (slow) ABC check
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Invalid(f"{field}: expected an object, got {type(value).__name__}")
    return value


def read_list(value: Any, field: str, limit: int) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise Invalid(f"{field}: expected a list, got {type(value).__name__}")
    if len(value) > limit:
        raise Invalid(f"{field}: {len(value)} entries, more than the limit of {limit}")
    return list(value)


def read_str(value: Any, field: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise Invalid(f"{field}: expected a string, got {type(value).__name__}")
    return value


def read_int(value: Any, field: str, default: int, lo: int, hi: int) -> int:
    if value is None:
        return default
    # bool is an int in Python; the API would never send one here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{field}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise Invalid(f"{field}: {value} is outside {lo}..{hi}")
    return value


def read_bool(value: Any, field: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Invalid(f"{field}: expected true or false, got {value!r}")
    return value


def read_ip(value: Any, field: str) -> str:
    """A valid address in its canonical form (the same address always renders the same nft
    text). inet_pton/inet_ntop: 100k endpoint addresses per initial list, and the C parser
    is ~5x faster than ipaddress. It refuses leading zeros; kube-proxy does not (see
    `parse_ip_sloppy`), so what it refuses gets a second, lenient reading."""
    text = value if type(value) is str else read_str(value, field)
    family = socket.AF_INET6 if ":" in text else socket.AF_INET
    try:
        return socket.inet_ntop(family, socket.inet_pton(family, text))
    except (OSError, ValueError):
        pass
    return _read_sloppily(field, text, parse_ip_sloppy, "an IP address")


def read_cidr(value: Any, field: str) -> str:
    text = read_str(value, field).strip()
    if "%" in text:  # Python accepts IPv6 zone indexes; the API and nft do not
        raise Invalid(f"{field}: {text!r} is not a CIDR")
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        pass
    return _read_sloppily(field, text, parse_cidr_sloppy, "a CIDR")


def _read_sloppily(field: str, text: str, parse: Callable[[str], str | None],
                   what: str) -> str:
    """What the strict reading refused, read as kube-proxy's Go 1.16 parsers do (leading
    zeros), and noted for the log; Invalid when even they refuse it."""
    canonical = parse(text)
    if canonical is None:
        raise Invalid(f"{field}: {text!r} is not {what}")
    read_leniently(field, text, canonical)
    return canonical


# ---------------------------------------------------------------------------------------------
# kube-proxy's lenient address parsing
# (field, as written, as read) of each address the object being converted needed the lenient
# reading for; `guarded` logs them once the object is known to be good.
lenient_reads: ContextVar[list[tuple[str, str, str]] | None] = ContextVar("lenient", default=None)
# What was already logged: the same object comes again on every update and relist.
LOGGED_LENIENT: dict[tuple[str, ...], None] = {}


def read_leniently(field: str, text: str, canonical: str) -> None:
    notes = lenient_reads.get()
    if notes is not None:
        notes.append((field, text, canonical))


def log_lenient(kind: str, namespace: str, name: str,
                 notes: list[tuple[str, str, str]]) -> None:
    for field, text, canonical in notes:
        key = (kind, namespace, name, field, text)
        if key in LOGGED_LENIENT:
            continue
        if len(LOGGED_LENIENT) > 10_000:  # bounded: objects come and go
            LOGGED_LENIENT.clear()
        LOGGED_LENIENT[key] = None
        log.warning("address_read_leniently",
                    object=f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}",
                    field=field, written=text, address=canonical)


def read_dns_label(value: Any, field: str, max_len: int = 63) -> str:
    text = read_str(value, field)
    if not text or len(text) > max_len or not DNS_LABEL.fullmatch(text):
        raise Invalid(f"{field}: {text!r} is not a valid DNS label")
    return text


def read_dns_subdomain(value: Any, field: str) -> str:
    text = read_str(value, field)
    if not text or len(text) > 253 or not DNS_SUBDOMAIN.fullmatch(text):
        raise Invalid(f"{field}: {text!r} is not a valid DNS subdomain name")
    return text


# The enums by their API spelling: a dict lookup where calling the enum class costs ~0.5 µs
# (twice per Service, once per port and slice, at 10k services a list).
PROTOCOLS = {p.value: p for p in Protocol}
POLICIES = {p.value: p for p in TrafficPolicy}
FAMILIES = {f.value: f for f in IPFamily}


def read_protocol(value: Any, field: str) -> Protocol:
    return read_choice(value, field, PROTOCOLS, "TCP", "protocol")


def read_policy(value: Any, field: str) -> TrafficPolicy:
    return read_choice(value, field, POLICIES, "Cluster", "policy")


def read_choice(value: Any, field: str, choices: Mapping[str, T], default: str,
                what: str) -> T:
    """One of `choices` by its API spelling, `default` when unset; an unknown one is Invalid,
    the error listing them."""
    found = choices.get(value) if type(value) is str else None
    if found is not None:
        return found
    text = read_str(value, field, default)
    if text not in choices:
        *first, last = choices
        raise Invalid(f"{field}: unknown {what} {text!r} ({', '.join(first)} or {last})")
    return choices[text]



def read_port_name(value: Any, field: str) -> str:
    # Service port names are DNS labels (IANA service names are a subset); "" is allowed for
    # a single unnamed port.
    text = read_str(value, field)
    if text and (len(text) > 63 or not DNS_LABEL.fullmatch(text)):
        raise Invalid(f"{field}: {text!r} is not a valid port name")
    return text


def is_label_key(key: str) -> bool:
    """A Kubernetes label key: optional DNS-subdomain prefix and '/', then a name ≤ 63."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(LABEL_NAME.fullmatch(name))


def read_labels(value: Any, field: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, val in read_mapping(value, field).items():
        if key not in VALID_LABEL_KEYS:
            if not isinstance(key, str) or not is_label_key(key):
                raise Invalid(f"{field}: {key!r} is not a valid label key")
            remember(VALID_LABEL_KEYS, key)
        text = val if type(val) is str else read_str(val, f"{field}[{key}]")
        if len(text) > 63 or not LABEL_VALUE.fullmatch(text):
            raise Invalid(f"{field}[{key}]: {text!r} is not a valid label value")
        out[key] = text
    return out


# The same few label keys (app, kubernetes.io/service-name, …) on every Service and slice:
# each distinct one is checked once. Bounded: keys are whatever users write.
VALID_LABEL_KEYS: dict[str, None] = {}


def remember(valid: dict[str, Any], key: str, value: Any = None) -> None:
    """Into a bounded cache of validated values (emptied when full)."""
    if len(valid) > 10_000:
        valid.clear()
    valid[key] = value


def read_annotations(value: Any, field: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, val in read_mapping(value, field).items():
        if isinstance(key, str) and isinstance(val, str):
            out[key] = val
    return out


# ---------------------------------------------------------------------------------------------
# One object's conversion, guarded


def guarded(kind: str, obj: Any, convert: Callable[[Any], T]) -> T | Skipped:
    """Run a conversion; every failure becomes a Skipped naming the object and the reason."""
    data = api_dict(obj)  # a SliceDoc as it is
    meta = metadata(data)
    namespace = safe_name(meta, "namespace") or "default"
    name = safe_name(meta, "name")
    lenient: list[tuple[str, str, str]] = []
    token = lenient_reads.set(lenient)
    try:
        readable(data)
        result = convert(data)
    except NotProxied as why:
        return Skipped(kind, namespace, name, str(why), invalid=False)
    except Invalid as why:
        return Skipped(kind, namespace, name, str(why))
    except Exception as why:  # a last safety net: bad input must never crash the proxy
        return Skipped(kind, namespace, name, f"unreadable object: {why!r}")
    finally:
        lenient_reads.reset(token)
    if lenient:
        log_lenient(kind, namespace, name, lenient)
    return result


def cluster_scoped(kind: str, obj: Any,
                   convert: Callable[[Mapping[str, Any], Mapping[str, Any], str], T],
                   ) -> T | Skipped:
    """Run the conversion of a cluster-scoped object (a Node, a ServiceCIDR) on its data,
    metadata and name, read and checked first; every failure becomes a Skipped naming it."""
    data = api_dict(obj)
    name = safe_name(metadata(data), "name")  # a dict's, or an Unreadable's as far as read
    try:
        readable(data)
        data = read_mapping(data, kind)
        meta = read_mapping(data.get("metadata"), "metadata")
        name = read_dns_subdomain(meta.get("name"), "metadata.name")
        return convert(data, meta, name)
    except Invalid as why:
        return Skipped(kind, "", name, str(why))
    except Exception as why:  # a last safety net: bad input must never crash the proxy
        return Skipped(kind, "", name, f"unreadable object: {why!r}")


def readable(data: Any) -> None:
    """Raise Invalid with the reason when the object could not be decoded at all."""
    if type(data) is Unreadable:
        raise Invalid(data.reason)


class NotProxied(Exception):
    """A valid object that pyproxy leaves alone."""


def safe_name(meta: Any, key: str) -> str:
    value = meta.get(key) if type(meta) is dict or isinstance(meta, Mapping) else None
    return value if isinstance(value, str) else ""


def prefixed(prefix: str, err: Invalid) -> Invalid:
    """`err`, whose field is named relative to `prefix`, with the full path."""
    text = str(err)
    return Invalid(f"{prefix}{'' if text.startswith(':') else '.'}{text}")
