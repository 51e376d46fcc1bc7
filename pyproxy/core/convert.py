"""Conversion of API objects (plain dicts as the API serves them, or the `kubernetes` client's
model objects) into the frozen model.

Everything that later ends up in nft text passes through here, so validation is strict: names
must be DNS labels, addresses must parse, ports must be in range. A bad object is returned as
a `Skipped` with a reason; nothing raises out of these functions.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import date, datetime
from typing import Any, TypeVar

import msgspec
import structlog

from pyproxy.core.model import (
    ANNOTATION_BALANCING,
    ANNOTATION_ENDPOINT_WEIGHTS,
    ANNOTATION_HASH_SEED,
    ANNOTATION_TOPOLOGY_AWARE_HINTS,
    ANNOTATION_TOPOLOGY_KEYS,
    ANNOTATION_TOPOLOGY_MIN_ENDPOINTS,
    ANNOTATION_TOPOLOGY_MODE,
    ANNOTATION_TRIGGER_TIME,
    ANNOTATION_WEIGHT,
    DEFAULT_AFFINITY_TIMEOUT,
    DEFAULT_HASH_SEED,
    LABEL_HEADLESS,
    LABEL_SERVICE_NAME,
    LABEL_SERVICE_PROXY_NAME,
    MAX_WEIGHT,
    TAINT_TO_BE_DELETED,
    TOPOLOGY_KEY_ANY,
    Algorithm,
    Endpoint,
    IPFamily,
    LoadBalancerIngress,
    Node,
    Protocol,
    ServiceKey,
    ServicePort,
    ServicePortName,
    Skipped,
    SliceEndpoints,
    TrafficPolicy,
    ip_family,
)
from pyproxy.core.topology import parse_min_endpoints
from pyproxy.core.wire import NO_CONDITIONS, EndpointDoc, SliceDoc, Unreadable, metadata

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
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")


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


def _mapping(value: Any, field: str) -> Mapping[str, Any]:
    if type(value) is dict:  # the common case, without the (slow) ABC check
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Invalid(f"{field}: expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, field: str, limit: int) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise Invalid(f"{field}: expected a list, got {type(value).__name__}")
    if len(value) > limit:
        raise Invalid(f"{field}: {len(value)} entries, more than the limit of {limit}")
    return list(value)


def _str(value: Any, field: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise Invalid(f"{field}: expected a string, got {type(value).__name__}")
    return value


def _int(value: Any, field: str, default: int, lo: int, hi: int) -> int:
    if value is None:
        return default
    # bool is an int in Python; the API would never send one here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{field}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise Invalid(f"{field}: {value} is outside {lo}..{hi}")
    return value


def _bool(value: Any, field: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Invalid(f"{field}: expected true or false, got {value!r}")
    return value


def _ip(value: Any, field: str) -> str:
    """A valid address in its canonical form (the same address always renders the same nft
    text). inet_pton/inet_ntop: 100k endpoint addresses per initial list, and the C parser
    is ~5x faster than ipaddress. It refuses leading zeros; kube-proxy does not (see
    `parse_ip_sloppy`), so what it refuses gets a second, lenient reading."""
    text = value if type(value) is str else _str(value, field)
    family = socket.AF_INET6 if ":" in text else socket.AF_INET
    try:
        return socket.inet_ntop(family, socket.inet_pton(family, text))
    except (OSError, ValueError):
        pass
    canonical = parse_ip_sloppy(text)
    if canonical is None:
        raise Invalid(f"{field}: {text!r} is not an IP address")
    _read_leniently(field, text, canonical)
    return canonical


def _cidr(value: Any, field: str) -> str:
    text = _str(value, field).strip()
    if "%" in text:  # Python accepts IPv6 zone indexes; the API and nft do not
        raise Invalid(f"{field}: {text!r} is not a CIDR")
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        pass
    canonical = parse_cidr_sloppy(text)
    if canonical is None:
        raise Invalid(f"{field}: {text!r} is not a CIDR")
    _read_leniently(field, text, canonical)
    return canonical


# ---------------------------------------------------------------------------------------------
# kube-proxy's lenient address parsing
#
# Go 1.17 began refusing IPv4 octets with leading zeros (other tools read `010` as octal 8).
# Objects stored before the API server refused them still exist, so Kubernetes kept Go 1.16's
# parser as netutils.ParseIPSloppy/ParseCIDRSloppy, and kube-proxy reads every Service and
# EndpointSlice address with it. The functions below are that parser, step for step: every
# octet decimal, any number of leading zeros, value <= 255; IPv6 groups likewise hex.

_GO_BIG = 0xFFFFFF  # Go's dtoi/xtoi give up at this value, however many digits are left
_DECIMAL = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")


def parse_ip_sloppy(text: str) -> str | None:
    """The canonical form of what kube-proxy's ParseIPSloppy reads in `text` (`10.96.0.010` is
    10.96.0.10, not octal), or None when it reads nothing. As Go's parser, the first '.' or
    ':' decides the family."""
    for char in text:
        if char == ".":
            v4 = _go_ipv4(text)
            return None if v4 is None else socket.inet_ntop(socket.AF_INET, v4)
        if char == ":":
            v6 = _go_ipv6(text)
            return None if v6 is None else socket.inet_ntop(socket.AF_INET6, v6)
    return None


def parse_cidr_sloppy(text: str) -> str | None:
    """The canonical network of what kube-proxy's ParseCIDRSloppy reads in `text` (address
    as `parse_ip_sloppy`, prefix length in decimal digits), or None."""
    address, slash, prefix = text.partition("/")
    if not slash:
        return None
    packed = _go_ipv4(address)
    if packed is None:
        packed = _go_ipv6(address)
    bits = _go_number(prefix, 0, 10, _DECIMAL)
    if packed is None or bits is None or bits[1] != len(prefix) or bits[0] > 8 * len(packed):
        return None
    return str(ipaddress.ip_network((packed, bits[0]), strict=False))


def _go_number(text: str, pos: int, base: int, digits: frozenset[str]) -> tuple[int, int] | None:
    """Go's dtoi/xtoi from `pos`: (value, end) of the run of digits there, or None when there
    is none or it reaches 0xFFFFFF."""
    value, end = 0, pos
    while end < len(text) and text[end] in digits:
        value = value * base + int(text[end], base)
        if value >= _GO_BIG:
            return None
        end += 1
    return (value, end) if end > pos else None


def _go_ipv4(text: str) -> bytes | None:
    octets = bytearray()
    pos = 0
    for i in range(4):
        if i:
            if text[pos:pos + 1] != ".":
                return None
            pos += 1
        number = _go_number(text, pos, 10, _DECIMAL)
        if number is None or number[0] > 0xFF:
            return None
        octets.append(number[0])
        pos = number[1]
    return bytes(octets) if pos == len(text) else None


def _go_ipv6(text: str) -> bytes | None:
    address = bytearray(16)
    ellipsis = -1  # where "::" stands, in bytes
    pos = 0
    if text.startswith("::"):
        ellipsis, pos = 0, 2
        if pos == len(text):
            return bytes(address)
    i = 0
    while i < 16:
        number = _go_number(text, pos, 16, _HEX)
        if number is None or number[0] > 0xFFFF:
            return None
        group, end = number
        if text[end:end + 1] == ".":  # an IPv4 address in the last 32 bits
            if (ellipsis < 0 and i != 12) or i + 4 > 16:
                return None
            v4 = _go_ipv4(text[pos:])
            if v4 is None:
                return None
            address[i:i + 4] = v4
            pos, i = len(text), i + 4
            break
        address[i:i + 2] = group.to_bytes(2, "big")
        i, pos = i + 2, end
        if pos == len(text):
            break
        if text[pos] != ":" or pos + 1 == len(text):
            return None
        pos += 1
        if text[pos] == ":":
            if ellipsis >= 0:
                return None
            ellipsis, pos = i, pos + 1
            if pos == len(text):
                break
    if pos != len(text):
        return None
    if i < 16:
        if ellipsis < 0:
            return None
        address[ellipsis:] = bytes(16 - i) + address[ellipsis:i]
    elif ellipsis >= 0:
        return None  # "::" must stand for at least one group
    return bytes(address)


# (field, as written, as read) of each address the object being converted needed the lenient
# reading for; `_guarded` logs them once the object is known to be good.
_lenient: ContextVar[list[tuple[str, str, str]] | None] = ContextVar("lenient", default=None)
# What was already logged: the same object comes again on every update and relist.
_LOGGED: dict[tuple[str, ...], None] = {}


def _read_leniently(field: str, text: str, canonical: str) -> None:
    notes = _lenient.get()
    if notes is not None:
        notes.append((field, text, canonical))


def _log_lenient(kind: str, namespace: str, name: str,
                 notes: list[tuple[str, str, str]]) -> None:
    for field, text, canonical in notes:
        key = (kind, namespace, name, field, text)
        if key in _LOGGED:
            continue
        if len(_LOGGED) > 10_000:  # bounded: objects come and go
            _LOGGED.clear()
        _LOGGED[key] = None
        log.warning("address_read_leniently",
                    object=f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}",
                    field=field, written=text, address=canonical)


def _dns_label(value: Any, field: str, max_len: int = 63) -> str:
    text = _str(value, field)
    if not text or len(text) > max_len or not _DNS_LABEL.fullmatch(text):
        raise Invalid(f"{field}: {text!r} is not a valid DNS label")
    return text


def _dns_subdomain(value: Any, field: str) -> str:
    text = _str(value, field)
    if not text or len(text) > 253 or not _DNS_SUBDOMAIN.fullmatch(text):
        raise Invalid(f"{field}: {text!r} is not a valid DNS subdomain name")
    return text


# The enums by their API spelling: a dict lookup where calling the enum class costs ~0.5 µs
# (twice per Service, once per port and slice, at 10k services a list).
_PROTOCOLS = {p.value: p for p in Protocol}
_POLICIES = {p.value: p for p in TrafficPolicy}
_FAMILIES = {f.value: f for f in IPFamily}


def _protocol(value: Any, field: str) -> Protocol:
    protocol = _PROTOCOLS.get(value) if type(value) is str else None
    if protocol is not None:
        return protocol
    text = _str(value, field, "TCP")
    if text not in _PROTOCOLS:
        raise Invalid(f"{field}: unknown protocol {text!r} (TCP, UDP or SCTP)")
    return _PROTOCOLS[text]


def _port_name(value: Any, field: str) -> str:
    # Service port names are DNS labels (IANA service names are a subset); "" is allowed for
    # a single unnamed port.
    text = _str(value, field)
    if text and (len(text) > 63 or not _DNS_LABEL.fullmatch(text)):
        raise Invalid(f"{field}: {text!r} is not a valid port name")
    return text


def is_label_key(key: str) -> bool:
    """A Kubernetes label key: optional DNS-subdomain prefix and '/', then a name ≤ 63."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def _labels(value: Any, field: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, val in _mapping(value, field).items():
        if key not in _VALID_LABEL_KEYS:
            if not isinstance(key, str) or not is_label_key(key):
                raise Invalid(f"{field}: {key!r} is not a valid label key")
            _remember(_VALID_LABEL_KEYS, key)
        text = val if type(val) is str else _str(val, f"{field}[{key}]")
        if len(text) > 63 or not _LABEL_VALUE.fullmatch(text):
            raise Invalid(f"{field}[{key}]: {text!r} is not a valid label value")
        out[key] = text
    return out


# The same few label keys (app, kubernetes.io/service-name, …) on every Service and slice:
# each distinct one is checked once. Bounded: keys are whatever users write.
_VALID_LABEL_KEYS: dict[str, None] = {}


def _remember(valid: dict[str, Any], key: str, value: Any = None) -> None:
    """Into a bounded cache of validated values (emptied when full)."""
    if len(valid) > 10_000:
        valid.clear()
    valid[key] = value


def _annotations(value: Any, field: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, val in _mapping(value, field).items():
        if isinstance(key, str) and isinstance(val, str):
            out[key] = val
    return out


# ---------------------------------------------------------------------------------------------
# Services


def convert_service(obj: Any) -> tuple[ServicePort, ...] | Skipped:
    """A Service → its proxied ports, or why it is not proxied."""
    return _guarded("Service", obj, _service_ports)


def _guarded(kind: str, obj: Any, convert: Callable[[Any], T]) -> T | Skipped:
    """Run a conversion; every failure becomes a Skipped naming the object and the reason."""
    data = api_dict(obj)  # a SliceDoc as it is
    meta = metadata(data)
    namespace = _safe_name(meta, "namespace") or "default"
    name = _safe_name(meta, "name")
    lenient: list[tuple[str, str, str]] = []
    token = _lenient.set(lenient)
    try:
        _readable(data)
        result = convert(data)
    except _NotProxied as why:
        return Skipped(kind, namespace, name, str(why), invalid=False)
    except Invalid as why:
        return Skipped(kind, namespace, name, str(why))
    except Exception as why:  # a last safety net: bad input must never crash the proxy
        return Skipped(kind, namespace, name, f"unreadable object: {why!r}")
    finally:
        _lenient.reset(token)
    if lenient:
        _log_lenient(kind, namespace, name, lenient)
    return result


def _readable(data: Any) -> None:
    """Raise Invalid with the reason when the object could not be decoded at all."""
    if type(data) is Unreadable:
        raise Invalid(data.reason)


class _NotProxied(Exception):
    """A valid object that pyproxy leaves alone."""


def _safe_name(meta: Any, key: str) -> str:
    value = meta.get(key) if type(meta) is dict or isinstance(meta, Mapping) else None
    return value if isinstance(value, str) else ""


def _service_ports(data: Any) -> tuple[ServicePort, ...]:
    data = _mapping(data, "Service")
    meta = _mapping(data.get("metadata"), "metadata")
    namespace = _dns_label(meta.get("namespace", "default"), "metadata.namespace")
    name = _dns_label(meta.get("name"), "metadata.name")
    labels = _labels(meta.get("labels"), "metadata.labels")
    annotations = _annotations(meta.get("annotations"), "metadata.annotations")
    spec = _mapping(data.get("spec"), "spec")
    status = _mapping(data.get("status"), "status")

    if LABEL_SERVICE_PROXY_NAME in labels:
        raise _NotProxied(
            f"labelled {LABEL_SERVICE_PROXY_NAME}={labels[LABEL_SERVICE_PROXY_NAME]!r}: "
            "another proxy handles it"
        )
    service_type = _str(spec.get("type"), "spec.type", "ClusterIP")
    if service_type not in _SERVICE_TYPES:
        raise Invalid(f"spec.type: unknown type {service_type!r}")
    if service_type == "ExternalName":
        raise _NotProxied("type ExternalName: resolved by DNS, not proxied")
    cluster_ips = _cluster_ips(spec)
    external_ips = tuple(
        _ip(v, f"spec.externalIPs[{i}]")
        for i, v in enumerate(_list(spec.get("externalIPs"), "spec.externalIPs", MAX_ADDRESS_LIST))
    )
    ingress = _load_balancer_ingress(status) if service_type == "LoadBalancer" else ()
    source_ranges = tuple(
        _cidr(v, f"spec.loadBalancerSourceRanges[{i}]")
        for i, v in enumerate(
            _list(
                spec.get("loadBalancerSourceRanges"),
                "spec.loadBalancerSourceRanges",
                MAX_SOURCE_RANGES,
            )
        )
    )
    affinity, timeout = _session_affinity(spec)
    internal = _policy(spec.get("internalTrafficPolicy"), "spec.internalTrafficPolicy")
    external = _policy(spec.get("externalTrafficPolicy"), "spec.externalTrafficPolicy")
    # healthCheckNodePort matters only for LoadBalancer + eTP=Local (as upstream).
    hcnp = _int(spec.get("healthCheckNodePort"), "spec.healthCheckNodePort", 0, 0, 65535)
    if not (service_type == "LoadBalancer" and external is TrafficPolicy.LOCAL):
        hcnp = 0
    distribution = spec.get("trafficDistribution")
    distribution = _str(distribution, "spec.trafficDistribution") or None
    topology_mode = annotations.get(ANNOTATION_TOPOLOGY_MODE) or annotations.get(
        ANNOTATION_TOPOLOGY_AWARE_HINTS
    )
    topology_keys = _topology_keys(spec, annotations)
    min_endpoints, topology_note = parse_min_endpoints(
        annotations.get(ANNOTATION_TOPOLOGY_MIN_ENDPOINTS))
    balancing, seed, weights, balancing_note = _balancing(annotations)

    raw_ports = _list(spec.get("ports"), "spec.ports", MAX_SERVICE_PORTS)
    if not raw_ports:
        raise _NotProxied("no ports")
    ports: list[ServicePort] = []
    seen: set[tuple[str, Protocol]] = set()
    for i, raw in enumerate(raw_ports):
        try:
            port_name, protocol, number, node_port = _service_port(raw, len(raw_ports) > 1)
        except Invalid as err:
            raise _at(f"spec.ports[{i}]", err) from None
        if (port_name, protocol) in seen:
            raise Invalid(f"spec.ports[{i}]: duplicate port name {port_name!r}/{protocol}")
        seen.add((port_name, protocol))
        if service_type == "ClusterIP":
            node_port = 0
        ports.append(
            ServicePort(
                name=ServicePortName(namespace, name, port_name, protocol),
                port=number,
                cluster_ips=cluster_ips,
                service_type=service_type,
                node_port=node_port,
                external_ips=external_ips,
                load_balancer_ingress=ingress,
                source_ranges=source_ranges,
                session_affinity=affinity,
                affinity_timeout=timeout,
                internal_policy=internal,
                external_policy=external,
                health_check_node_port=hcnp,
                traffic_distribution=distribution,
                topology_mode_annotation=topology_mode,
                topology_keys=topology_keys,
                topology_min_endpoints=min_endpoints,
                topology_note=topology_note,
                balancing=balancing,
                hash_seed=seed,
                endpoint_weights=weights,
                balancing_note=balancing_note,
            )
        )
    return tuple(ports)


def _service_port(raw: Any, several: bool) -> tuple[str, Protocol, int, int]:
    """Name, protocol, number and node port of one entry of spec.ports. The fields are
    named relative to the entry (`_at` prefixes them when one is invalid): formatting four
    field paths per port was a tenth of a Service's conversion."""
    raw = _mapping(raw, "")
    port_name = _port_name(raw.get("name"), "name")
    if not port_name and several:
        raise Invalid("name: required when a Service has several ports")
    protocol = _protocol(raw.get("protocol"), "protocol")
    number = _int(raw.get("port"), "port", 0, 1, 65535)
    if number == 0:
        raise Invalid("port: required")
    return port_name, protocol, number, _int(raw.get("nodePort"), "nodePort", 0, 0, 65535)


def _at(prefix: str, err: Invalid) -> Invalid:
    """`err`, whose field is named relative to `prefix`, with the full path."""
    text = str(err)
    return Invalid(f"{prefix}{'' if text.startswith(':') else '.'}{text}")


def _balancing(
    annotations: Mapping[str, str],
) -> tuple[Algorithm, int, tuple[tuple[str, int], ...], str | None]:
    """pyproxy's balancing annotations. Unlike other fields, a bad value here does not skip
    the service: it keeps working with kube-proxy's behaviour (random, equal weights) and
    the note says why."""
    notes: list[str] = []
    text = annotations.get(ANNOTATION_BALANCING, "").strip().lower()
    try:
        algorithm = Algorithm(text or Algorithm.RANDOM)
    except ValueError:
        notes.append(f"{ANNOTATION_BALANCING}={text[:40]!r} is not one of "
                     f"{', '.join(Algorithm)}: using random")
        algorithm = Algorithm.RANDOM
    seed = DEFAULT_HASH_SEED
    if ANNOTATION_HASH_SEED in annotations:
        try:
            seed = int(annotations[ANNOTATION_HASH_SEED].strip(), 0)
            if not 0 <= seed <= 0xFFFFFFFF:
                raise ValueError
        except ValueError:
            notes.append(f"{ANNOTATION_HASH_SEED} is not a 32-bit number: using the default")
            seed = DEFAULT_HASH_SEED
    weights: list[tuple[str, int]] = []
    for item in annotations.get(ANNOTATION_ENDPOINT_WEIGHTS, "").split(","):
        if not item.strip():
            continue
        address, _, value = item.partition("=")
        try:
            ip = str(ipaddress.ip_address(address.strip()))
            weight = int(value.strip())
            if not 0 <= weight <= MAX_WEIGHT:
                raise ValueError
        except ValueError:
            notes.append(f"{ANNOTATION_ENDPOINT_WEIGHTS}: {item.strip()[:60]!r} is not "
                         f"IP=WEIGHT (0..{MAX_WEIGHT}): weights from it ignored")
            weights = []
            break
        weights.append((ip, weight))
    return algorithm, seed, tuple(weights), "; ".join(notes) or None


def _cluster_ips(spec: Mapping[str, Any]) -> tuple[str, ...]:
    primary = _str(spec.get("clusterIP"), "spec.clusterIP")
    listed = _list(spec.get("clusterIPs"), "spec.clusterIPs", 2)
    if primary == "None" or (listed and listed[0] == "None"):
        raise _NotProxied("headless (clusterIP: None): no virtual IP to proxy")
    raw = listed or ([primary] if primary else [])
    if not raw:
        raise _NotProxied("no cluster IP allocated")
    ips = tuple(_ip(v, f"spec.clusterIPs[{i}]") for i, v in enumerate(raw))
    if len(ips) == 2 and ip_family(ips[0]) == ip_family(ips[1]):
        raise Invalid("spec.clusterIPs: two addresses of the same family")
    # written as clusterIPs[0] reads (the common case): the same address, not parsed again
    if primary and primary != ips[0] and primary != "None" and \
            _ip(primary, "spec.clusterIP") != ips[0]:
        raise Invalid("spec.clusterIP: differs from spec.clusterIPs[0]")
    families = _list(spec.get("ipFamilies"), "spec.ipFamilies", 2)
    for i, (fam, ip) in enumerate(zip(families, ips, strict=False)):
        if fam not in ("IPv4", "IPv6"):
            raise Invalid(f"spec.ipFamilies[{i}]: unknown family {fam!r}")
        if _FAMILIES[fam] != ip_family(ip):
            raise Invalid(f"spec.ipFamilies[{i}]: {fam} does not match clusterIP {ip}")
    return ips


def _load_balancer_ingress(status: Mapping[str, Any]) -> tuple[LoadBalancerIngress, ...]:
    lb = _mapping(status.get("loadBalancer"), "status.loadBalancer")
    out: list[LoadBalancerIngress] = []
    for i, raw in enumerate(_list(lb.get("ingress"), "status.loadBalancer.ingress", 64)):
        field = f"status.loadBalancer.ingress[{i}]"
        raw = _mapping(raw, field)
        if not raw.get("ip"):
            continue  # hostname-only ingress: nothing for the node to program
        mode = _str(raw.get("ipMode"), f"{field}.ipMode", "VIP")
        if mode not in ("VIP", "Proxy"):
            raise Invalid(f"{field}.ipMode: unknown mode {mode!r}")
        out.append(LoadBalancerIngress(_ip(raw.get("ip"), f"{field}.ip"), mode))
    return tuple(out)


def _session_affinity(spec: Mapping[str, Any]) -> tuple[bool, int]:
    kind = _str(spec.get("sessionAffinity"), "spec.sessionAffinity", "None")
    if kind not in ("None", "ClientIP"):
        raise Invalid(f"spec.sessionAffinity: unknown value {kind!r}")
    if kind == "None":
        return False, DEFAULT_AFFINITY_TIMEOUT
    config = _mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
    client_ip = _mapping(config.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
    timeout = _int(
        client_ip.get("timeoutSeconds"),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
        DEFAULT_AFFINITY_TIMEOUT,
        1,
        MAX_AFFINITY_TIMEOUT,
    )
    return True, timeout


def _policy(value: Any, field: str) -> TrafficPolicy:
    policy = _POLICIES.get(value) if type(value) is str else None
    if policy is not None:
        return policy
    text = _str(value, field, "Cluster")
    if text not in _POLICIES:
        raise Invalid(f"{field}: unknown policy {text!r} (Cluster or Local)")
    return _POLICIES[text]


def _topology_keys(spec: Mapping[str, Any], annotations: Mapping[str, str]) -> tuple[str, ...]:
    """Ordered topology keys from spec.topologyKeys (older clusters, snapshots) or, where the
    API no longer has the field, from pyproxy's annotation (comma-separated)."""
    if spec.get("topologyKeys") is not None:
        field = "spec.topologyKeys"
        raw = _list(spec["topologyKeys"], field, 64)
        keys = [_str(v, f"{field}[{i}]") for i, v in enumerate(raw)]
    elif ANNOTATION_TOPOLOGY_KEYS in annotations:
        field = f"annotation {ANNOTATION_TOPOLOGY_KEYS}"
        keys = [k.strip() for k in annotations[ANNOTATION_TOPOLOGY_KEYS].split(",") if k.strip()]
    else:
        return ()
    if len(keys) > MAX_TOPOLOGY_KEYS:
        raise Invalid(f"{field}: {len(keys)} keys, at most {MAX_TOPOLOGY_KEYS} allowed")
    for i, key in enumerate(keys):
        if key == TOPOLOGY_KEY_ANY:
            if i != len(keys) - 1:
                raise Invalid(f"{field}: \"*\" must be the last key")
        elif not is_label_key(key):
            raise Invalid(f"{field}[{i}]: {key!r} is not a valid label key")
    if len(set(keys)) != len(keys):
        raise Invalid(f"{field}: duplicate keys")
    return tuple(keys)


# ---------------------------------------------------------------------------------------------
# EndpointSlices


def convert_endpoint_slice(obj: Any) -> SliceEndpoints | Skipped:
    """An EndpointSlice → the endpoints the proxy uses, or why it is not used."""
    return _guarded("EndpointSlice", obj, _slice)


def _slice(data: Any) -> SliceEndpoints:
    if type(data) is SliceDoc:  # decoded from the API by msgspec (pyproxy/core/wire.py)
        meta = _mapping(data.metadata, "metadata")
        address_type_value, ports_value = data.address_type, data.ports
        raw_endpoints: list[Any] = _list(data.endpoints, "endpoints", MAX_SLICE_ENDPOINTS)
    else:
        data = _mapping(data, "EndpointSlice")
        meta = _mapping(data.get("metadata"), "metadata")
        address_type_value, ports_value = data.get("addressType"), data.get("ports")
        raw_endpoints = _list(data.get("endpoints"), "endpoints", MAX_SLICE_ENDPOINTS)
    namespace = _dns_label(meta.get("namespace", "default"), "metadata.namespace")
    name = _dns_subdomain(meta.get("name"), "metadata.name")
    labels = _labels(meta.get("labels"), "metadata.labels")
    annotations = _annotations(meta.get("annotations"), "metadata.annotations")
    if LABEL_HEADLESS in labels:
        raise _NotProxied("belongs to a headless service")
    if LABEL_SERVICE_NAME not in labels:
        raise _NotProxied(f"no {LABEL_SERVICE_NAME} label: not owned by a Service")
    service = _dns_label(labels[LABEL_SERVICE_NAME], f"metadata.labels[{LABEL_SERVICE_NAME}]")
    address_type = _str(address_type_value, "addressType")
    if address_type == "FQDN":
        raise _NotProxied("addressType FQDN: not proxied")
    if address_type not in ("IPv4", "IPv6"):
        raise Invalid(f"addressType: unknown type {address_type!r}")
    family = _FAMILIES[address_type]
    ports = _slice_ports(ports_value)
    weight = _slice_weight(annotations)
    # Numbered after the first port: SliceEndpoints keeps them that way (see there).
    number = ports[0][2] if ports else 0
    endpoints = _slice_endpoints(raw_endpoints, family, number, weight)
    return SliceEndpoints(
        service=ServiceKey(namespace, service),
        name=name,
        family=family,
        ports=ports,
        endpoints=endpoints,
        trigger_time=annotations.get(ANNOTATION_TRIGGER_TIME),
    )


def _slice_ports(value: Any) -> tuple[tuple[str, Protocol, int], ...]:
    out: list[tuple[str, Protocol, int]] = []
    for i, raw in enumerate(_list(value, "ports", MAX_SLICE_PORTS)):
        try:
            port = _slice_port(raw)
        except Invalid as err:
            raise _at(f"ports[{i}]", err) from None
        if port is not None:
            out.append(port)
    return tuple(out)


def _slice_port(raw: Any) -> tuple[str, Protocol, int] | None:
    """One entry of a slice's ports, its fields named relative to it (as `_service_port`)."""
    raw = _mapping(raw, "")
    # A port without a number is skipped, as upstream does: it cannot be proxied.
    number = _int(raw.get("port"), "port", 0, 0, 65535)
    if number == 0:
        return None
    return _port_name(raw.get("name"), "name"), _protocol(raw.get("protocol"), "protocol"), number


def _slice_weight(annotations: Mapping[str, str]) -> int | None:
    if ANNOTATION_WEIGHT not in annotations:
        return None
    text = annotations[ANNOTATION_WEIGHT].strip()
    if not text.isdigit() or int(text) > MAX_WEIGHT:
        raise Invalid(f"annotation {ANNOTATION_WEIGHT}: {text[:40]!r} is not a weight "
                      f"0..{MAX_WEIGHT}")
    return int(text)


def _slice_endpoints(raw_endpoints: list[Any], family: IPFamily, number: int,
                     weight: int | None) -> tuple[Endpoint, ...]:
    """A slice's endpoints. Their fields are named relative to the endpoint and get the
    `endpoints[i].` prefix only when one is invalid: 100k endpoints per initial list, and
    formatting a dozen field paths for each was a third of the conversion. The addresses
    read leniently get the prefix the same way."""
    notes = _lenient.get()
    noted = len(notes) if notes is not None else 0
    out: list[Endpoint] = []
    index = 0
    try:
        for index, raw in enumerate(raw_endpoints):
            out.append(_endpoint(raw if type(raw) is EndpointDoc else _endpoint_doc(raw),
                                 family, number, weight))
            if notes is not None and len(notes) > noted:
                notes[noted:] = [(f"endpoints[{index}].{field}", text, canonical)
                                 for field, text, canonical in notes[noted:]]
                noted = len(notes)
    except Invalid as err:
        raise _at(f"endpoints[{index}]", err) from None
    return tuple(out)


def _endpoint_doc(raw: Any) -> EndpointDoc:
    """An endpoint given as plain data (a snapshot file, or a slice the typed decoder
    refused), typed as the API's decoder types it; what msgspec refuses (conditions that
    are not booleans) is named as the checks name it."""
    try:
        return msgspec.convert(raw if type(raw) is dict else dict(_mapping(raw, "")),
                               EndpointDoc)
    except msgspec.ValidationError as err:
        conditions = _mapping(_mapping(raw, "").get("conditions"), "conditions")
        for name, default in (("ready", True), ("serving", True), ("terminating", False)):
            _bool(conditions.get(name), f"conditions.{name}", default)
        raise Invalid(f": {err}") from None


def _endpoint(doc: EndpointDoc, family: IPFamily, number: int,
              weight: int | None = None) -> Endpoint:
    # Written for speed (100k to 250k endpoints per initial list): the checks of the
    # helpers, inlined for the value every endpoint has.
    addresses = doc.addresses
    if type(addresses) is not list or not 0 < len(addresses) <= 100:
        addresses = _list(addresses, "addresses", 100)
        if not addresses:
            raise Invalid("addresses: empty")
    # Only the first address is used, as upstream does (the API allows exactly one today).
    ip = _ip(addresses[0], "addresses[0]")
    if (":" in ip) is not (family is IPFamily.IPv6):
        raise Invalid(f"addresses[0]: {ip} is not an {family} address")
    # API defaults: a missing ready/serving means true, a missing terminating false.
    conditions = doc.conditions or NO_CONDITIONS
    ready, serving, terminating = conditions.ready, conditions.serving, conditions.terminating
    node_name, zone, topology = doc.node_name, doc.zone, doc.deprecated_topology
    hints = doc.hints
    if hints is not None:
        hints = _mapping(hints, "hints")
    return Endpoint(
        ip,
        number,
        True if ready is None else ready,
        True if serving is None else serving,
        False if terminating is None else terminating,
        _known(node_name, _VALID_NODE_NAMES) or (_node_name(node_name) if node_name else None),
        _known(zone, _VALID_ZONES) or (_zone(zone) if zone else None),
        _hint_names(hints.get("forZones"), "hints.forZones") if hints else _NO_NAMES,
        _hint_names(hints.get("forNodes"), "hints.forNodes") if hints else _NO_NAMES,
        tuple(sorted(_labels(topology, "deprecatedTopology").items())) if topology else (),
        weight,
    )


# A handful of distinct node names and zones are shared by 100k endpoints: each distinct
# value is validated once and interned (one string object for all of them). Bounded, as
# node names can be as many as nodes.
_VALID_NODE_NAMES: dict[str, str] = {}
_VALID_ZONES: dict[str, str] = {}


def _known(value: Any, valid: dict[str, str]) -> str | None:
    """A value already validated (the interned copy), else None."""
    return valid.get(value) if type(value) is str else None


def _node_name(value: Any) -> str:
    return _validated_once(value, _VALID_NODE_NAMES, lambda v: _dns_subdomain(v, "nodeName"))


def _zone(value: Any) -> str:
    return _validated_once(value, _VALID_ZONES, lambda v: _label_value(v, "zone"))


def _validated_once(value: Any, valid: dict[str, str], validate: Callable[[Any], str]) -> str:
    known = valid.get(value) if type(value) is str else None
    if known is not None:
        return known
    checked = sys.intern(validate(value))
    _remember(valid, checked, checked)
    return checked


def _label_value(value: Any, field: str) -> str:
    text = _str(value, field)
    if len(text) > 63 or not _LABEL_VALUE.fullmatch(text):
        raise Invalid(f"{field}: {text!r} is not a valid label value")
    return text


def _hint_names(value: Any, field: str) -> frozenset[str]:
    if not value:
        # Shared: frozenset(set()) would be a fresh 216-byte object, two per endpoint.
        return _NO_NAMES
    names: set[str] = set()
    for i, raw in enumerate(_list(value, field, MAX_HINTS)):
        raw = _mapping(raw, f"{field}[{i}]")
        names.add(sys.intern(_label_value(raw.get("name"), f"{field}[{i}].name")))
    return _shared(frozenset(names))


_NO_NAMES: frozenset[str] = frozenset()
# Hint sets repeat across endpoints (a few zones, the nodes): one object per distinct set.
_SHARED_NAMES: dict[frozenset[str], frozenset[str]] = {}


def _shared(names: frozenset[str]) -> frozenset[str]:
    if len(_SHARED_NAMES) > 10_000:  # bounded: node hints can be as many as nodes
        _SHARED_NAMES.clear()
    return _SHARED_NAMES.setdefault(names, names)


# ---------------------------------------------------------------------------------------------
# Nodes


def convert_node(obj: Any) -> Node | Skipped:
    data = api_dict(obj)
    meta = metadata(data)  # a dict's, or an Unreadable's as far as it was read
    name = _safe_name(meta, "name")
    try:
        _readable(data)
        data = _mapping(data, "Node")
        meta = _mapping(data.get("metadata"), "metadata")
        name = _dns_subdomain(meta.get("name"), "metadata.name")
        spec = _mapping(data.get("spec"), "spec")
        taints = tuple(
            _str(_mapping(t, f"spec.taints[{i}]").get("key"), f"spec.taints[{i}].key")
            for i, t in enumerate(_list(spec.get("taints"), "spec.taints", 256))
        )
        return Node(
            name=name,
            labels=_labels(meta.get("labels"), "metadata.labels"),
            deleting=meta.get("deletionTimestamp") is not None,
            taints=taints,
            host_ips=_host_ips(_mapping(data.get("status"), "status")),
            unusable_addresses=_unusable_addresses(_mapping(data.get("status"), "status")),
            pod_cidrs=_pod_cidrs(spec),
        )
    except Invalid as why:
        return Skipped("Node", "", name, str(why))
    except Exception as why:  # a last safety net: bad input must never crash the proxy
        return Skipped("Node", "", name, f"unreadable object: {why!r}")


_HOST_IP_TYPES = ("InternalIP", "ExternalIP")


def _host_ips(status: Mapping[str, Any]) -> tuple[str, ...]:
    """kube-proxy's GetNodeHostIPs: the InternalIPs, then the ExternalIPs, read leniently
    (ParseIPSloppy); one that does not parse is passed over, as upstream does, not a reason
    to lose the whole Node. The first of them, then the first of the other family."""
    addresses = [a for a in _list(status.get("addresses"), "status.addresses", 256)
                 if isinstance(a, Mapping)]
    ips: list[str] = []
    for kind in _HOST_IP_TYPES:
        for address in addresses:
            if address.get("type") == kind:
                ip = _ip_or_none(address.get("address"))
                if ip is not None:
                    ips.append(ip)
    if not ips:
        return ()
    other = next((ip for ip in ips if ip_family(ip) is not ip_family(ips[0])), None)
    return (ips[0],) if other is None else (ips[0], other)


def _unusable_addresses(status: Mapping[str, Any]) -> tuple[str, ...]:
    """The addresses `_host_ips` passes over, as "InternalIP '10.0.0.300'"."""
    addresses = [a for a in _list(status.get("addresses"), "status.addresses", 256)
                 if isinstance(a, Mapping) and a.get("type") in _HOST_IP_TYPES]
    return tuple(f"{a['type']} {str(a.get('address'))[:64]!r}" for a in addresses
                 if _ip_or_none(a.get("address")) is None)


def _pod_cidrs(spec: Mapping[str, Any]) -> tuple[str, ...]:
    listed = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    cidrs = (_cidr_or_none(v) for v in _list(listed, "spec.podCIDRs", 2))
    return tuple(c for c in cidrs if c is not None)


def _ip_or_none(value: Any) -> str | None:
    try:
        return _ip(value, "")
    except Invalid:
        return None


def _cidr_or_none(value: Any) -> str | None:
    try:
        return _cidr(value, "")
    except Invalid:
        return None


def node_is_eligible(node: Node | None) -> bool:
    """Whether load balancers should send this node traffic (kube-proxy's /healthz rule)."""
    return node is not None and not node.deleting and TAINT_TO_BE_DELETED not in node.taints


# ---------------------------------------------------------------------------------------------
# ServiceCIDRs


def convert_service_cidr(obj: Any) -> tuple[str, ...] | Skipped:
    """A ServiceCIDR (networking.k8s.io/v1, cluster-scoped) → its CIDRs in canonical form, or
    why it is skipped. One being deleted (deletionTimestamp) still counts until it is gone:
    its ClusterIPs may still be in use, as kube-proxy, which reads every object, does."""
    data = api_dict(obj)
    meta = metadata(data)  # a dict's, or an Unreadable's as far as it was read
    name = _safe_name(meta, "name")
    try:
        _readable(data)
        data = _mapping(data, "ServiceCIDR")
        meta = _mapping(data.get("metadata"), "metadata")
        name = _dns_subdomain(meta.get("name"), "metadata.name")
        spec = _mapping(data.get("spec"), "spec")
        # The API allows one CIDR per family.
        raw = _list(spec.get("cidrs"), "spec.cidrs", 2)
        cidrs = tuple(_cidr(value, f"spec.cidrs[{i}]") for i, value in enumerate(raw))
        for i, cidr in enumerate(cidrs):
            if cidr.endswith("/0"):
                # Every address of the family: the node would drop all forwarded traffic
                # that no service DNATs. No working cluster has it; refuse it as a typo.
                raise Invalid(f"spec.cidrs[{i}]: {cidr!r} covers every address")
        return cidrs
    except Invalid as why:
        return Skipped("ServiceCIDR", "", name, str(why))
    except Exception as why:  # a last safety net: bad input must never crash the proxy
        return Skipped("ServiceCIDR", "", name, f"unreadable object: {why!r}")
