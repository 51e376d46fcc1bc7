"""EndpointSlices and Nodes → the frozen model (pyproxy/core/convert.py has Services and
ServiceCIDRs; core/fields.py the field readers both use)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from pyproxy.core import fields
from pyproxy.core.model import (
    ANNOTATION_TRIGGER_TIME,
    ANNOTATION_WEIGHT,
    LABEL_HEADLESS,
    LABEL_SERVICE_NAME,
    MAX_WEIGHT,
    TAINT_TO_BE_DELETED,
    Endpoint,
    IPFamily,
    Node,
    Protocol,
    ServiceKey,
    Skipped,
    SliceEndpoints,
    ip_family,
)
from pyproxy.core.wire import NO_CONDITIONS, EndpointDoc, SliceDoc

# ---------------------------------------------------------------------------------------------
# EndpointSlices


def convert_endpoint_slice(obj: Any) -> SliceEndpoints | Skipped:
    """An EndpointSlice → the endpoints the proxy uses, or why it is not used."""
    return fields.guarded("EndpointSlice", obj, _slice)


def _slice(data: Any) -> SliceEndpoints:
    if type(data) is SliceDoc:  # decoded from the API by msgspec (pyproxy/core/wire.py)
        meta = fields.read_mapping(data.metadata, "metadata")
        address_type_value, ports_value = data.address_type, data.ports
        raw_endpoints: list[Any] = fields.read_list(data.endpoints, "endpoints",
                                                    fields.MAX_SLICE_ENDPOINTS)
    else:
        data = fields.read_mapping(data, "EndpointSlice")
        meta = fields.read_mapping(data.get("metadata"), "metadata")
        address_type_value, ports_value = data.get("addressType"), data.get("ports")
        raw_endpoints = fields.read_list(data.get("endpoints"), "endpoints",
                                         fields.MAX_SLICE_ENDPOINTS)
    namespace = fields.read_dns_label(meta.get("namespace", "default"), "metadata.namespace")
    name = fields.read_dns_subdomain(meta.get("name"), "metadata.name")
    labels = fields.read_labels(meta.get("labels"), "metadata.labels")
    annotations = fields.read_annotations(meta.get("annotations"), "metadata.annotations")
    if LABEL_HEADLESS in labels:
        raise fields.NotProxied("belongs to a headless service")
    if LABEL_SERVICE_NAME not in labels:
        raise fields.NotProxied(f"no {LABEL_SERVICE_NAME} label: not owned by a Service")
    service = fields.read_dns_label(labels[LABEL_SERVICE_NAME],
                                    f"metadata.labels[{LABEL_SERVICE_NAME}]")
    address_type = fields.read_str(address_type_value, "addressType")
    if address_type == "FQDN":
        raise fields.NotProxied("addressType FQDN: not proxied")
    if address_type not in ("IPv4", "IPv6"):
        raise fields.Invalid(f"addressType: unknown type {address_type!r}")
    family = fields.FAMILIES[address_type]
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
    for i, raw in enumerate(fields.read_list(value, "ports", fields.MAX_SLICE_PORTS)):
        try:
            port = _slice_port(raw)
        except fields.Invalid as err:
            raise fields.prefixed(f"ports[{i}]", err) from None
        if port is not None:
            out.append(port)
    return tuple(out)


def _slice_port(raw: Any) -> tuple[str, Protocol, int] | None:
    """One entry of a slice's ports, its fields named relative to it (as `_service_port`)."""
    raw = fields.read_mapping(raw, "")
    # A port without a number is skipped, as upstream does: it cannot be proxied.
    number = fields.read_int(raw.get("port"), "port", 0, 0, 65535)
    if number == 0:
        return None
    return (fields.read_port_name(raw.get("name"), "name"),
            fields.read_protocol(raw.get("protocol"), "protocol"), number)


def _slice_weight(annotations: Mapping[str, str]) -> int | None:
    if ANNOTATION_WEIGHT not in annotations:
        return None
    text = annotations[ANNOTATION_WEIGHT].strip()
    if not text.isdigit() or int(text) > MAX_WEIGHT:
        raise fields.Invalid(f"annotation {ANNOTATION_WEIGHT}: {text[:40]!r} is not a weight "
                      f"0..{MAX_WEIGHT}")
    return int(text)


def _slice_endpoints(raw_endpoints: list[Any], family: IPFamily, number: int,
                     weight: int | None) -> tuple[Endpoint, ...]:
    """A slice's endpoints. Their fields are named relative to the endpoint and get the
    `endpoints[i].` prefix only when one is invalid: 100k endpoints per initial list, and
    formatting a dozen field paths for each was a third of the conversion. The addresses
    read leniently get the prefix the same way."""
    notes = fields.lenient_reads.get()
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
    except fields.Invalid as err:
        raise fields.prefixed(f"endpoints[{index}]", err) from None
    return tuple(out)


def _endpoint_doc(raw: Any) -> EndpointDoc:
    """An endpoint given as plain data (a snapshot file, or a slice the typed decoder
    refused), typed as the API's decoder types it; what msgspec refuses (conditions that
    are not booleans) is named as the checks name it."""
    try:
        return msgspec.convert(raw if type(raw) is dict else dict(fields.read_mapping(raw, "")),
                               EndpointDoc)
    except msgspec.ValidationError as err:
        conditions = fields.read_mapping(fields.read_mapping(raw, "").get("conditions"),
                                         "conditions")
        for name, default in (("ready", True), ("serving", True), ("terminating", False)):
            fields.read_bool(conditions.get(name), f"conditions.{name}", default)
        raise fields.Invalid(f": {err}") from None


def _endpoint(doc: EndpointDoc, family: IPFamily, number: int,
              weight: int | None = None) -> Endpoint:
    # Written for speed (100k to 250k endpoints per initial list): the checks of the
    # helpers, inlined for the value every endpoint has.
    addresses = doc.addresses
    if type(addresses) is not list or not 0 < len(addresses) <= 100:
        addresses = fields.read_list(addresses, "addresses", 100)
        if not addresses:
            raise fields.Invalid("addresses: empty")
    # Only the first address is used, as upstream does (the API allows exactly one today).
    ip = fields.read_ip(addresses[0], "addresses[0]")
    if (":" in ip) is not (family is IPFamily.IPv6):
        raise fields.Invalid(f"addresses[0]: {ip} is not an {family} address")
    # API defaults: a missing ready/serving means true, a missing terminating false.
    conditions = doc.conditions or NO_CONDITIONS
    ready, serving, terminating = conditions.ready, conditions.serving, conditions.terminating
    node_name, zone, topology = doc.node_name, doc.zone, doc.deprecated_topology
    hints = doc.hints
    if hints is not None:
        hints = fields.read_mapping(hints, "hints")
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
        tuple(sorted(fields.read_labels(topology, "deprecatedTopology").items()))
        if topology else (),
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
    return _validated_once(value, _VALID_NODE_NAMES,
                           lambda v: fields.read_dns_subdomain(v, "nodeName"))


def _zone(value: Any) -> str:
    return _validated_once(value, _VALID_ZONES, lambda v: _label_value(v, "zone"))


def _validated_once(value: Any, valid: dict[str, str], validate: Callable[[Any], str]) -> str:
    known = valid.get(value) if type(value) is str else None
    if known is not None:
        return known
    checked = sys.intern(validate(value))
    fields.remember(valid, checked, checked)
    return checked


def _label_value(value: Any, field: str) -> str:
    text = fields.read_str(value, field)
    if len(text) > 63 or not fields.LABEL_VALUE.fullmatch(text):
        raise fields.Invalid(f"{field}: {text!r} is not a valid label value")
    return text


def _hint_names(value: Any, field: str) -> frozenset[str]:
    if not value:
        # Shared: frozenset(set()) would be a fresh 216-byte object, two per endpoint.
        return _NO_NAMES
    names: set[str] = set()
    for i, raw in enumerate(fields.read_list(value, field, fields.MAX_HINTS)):
        raw = fields.read_mapping(raw, f"{field}[{i}]")
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
    return fields.cluster_scoped("Node", obj, _node)


def _node(data: Mapping[str, Any], meta: Mapping[str, Any], name: str) -> Node:
    spec = fields.read_mapping(data.get("spec"), "spec")
    status = fields.read_mapping(data.get("status"), "status")
    taints = tuple(
        fields.read_str(fields.read_mapping(t, f"spec.taints[{i}]").get("key"),
                        f"spec.taints[{i}].key")
        for i, t in enumerate(fields.read_list(spec.get("taints"), "spec.taints", 256))
    )
    return Node(
        name=name,
        labels=fields.read_labels(meta.get("labels"), "metadata.labels"),
        deleting=meta.get("deletionTimestamp") is not None,
        taints=taints,
        host_ips=_host_ips(status),
        unusable_addresses=_unusable_addresses(status),
        pod_cidrs=_pod_cidrs(spec),
    )


_HOST_IP_TYPES = ("InternalIP", "ExternalIP")


def _host_ips(status: Mapping[str, Any]) -> tuple[str, ...]:
    """kube-proxy's GetNodeHostIPs: the InternalIPs, then the ExternalIPs, read leniently
    (ParseIPSloppy); one that does not parse is passed over, as upstream does, not a reason
    to lose the whole Node. The first of them, then the first of the other family."""
    addresses = [a for a in fields.read_list(status.get("addresses"), "status.addresses", 256)
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
    addresses = [a for a in fields.read_list(status.get("addresses"), "status.addresses", 256)
                 if isinstance(a, Mapping) and a.get("type") in _HOST_IP_TYPES]
    return tuple(f"{a['type']} {str(a.get('address'))[:64]!r}" for a in addresses
                 if _ip_or_none(a.get("address")) is None)


def _pod_cidrs(spec: Mapping[str, Any]) -> tuple[str, ...]:
    listed = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    cidrs = (_cidr_or_none(v) for v in fields.read_list(listed, "spec.podCIDRs", 2))
    return tuple(c for c in cidrs if c is not None)


def _ip_or_none(value: Any) -> str | None:
    try:
        return fields.read_ip(value, "")
    except fields.Invalid:
        return None


def _cidr_or_none(value: Any) -> str | None:
    try:
        return fields.read_cidr(value, "")
    except fields.Invalid:
        return None


def node_is_eligible(node: Node | None) -> bool:
    """Whether load balancers should send this node traffic (kube-proxy's /healthz rule)."""
    return node is not None and not node.deleting and TAINT_TO_BE_DELETED not in node.taints


