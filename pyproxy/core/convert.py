"""Conversion of API objects (plain dicts as the API serves them, or the `kubernetes` client's
model objects) into the frozen model: Services and ServiceCIDRs here, EndpointSlices and
Nodes in core/convert_endpoints.py, the field readers both use in core/fields.py.

Everything that later ends up in nft text passes through these, so validation is strict: names
must be DNS labels, addresses must parse, ports must be in range. A bad object is returned as
a `Skipped` with a reason; nothing raises out of these functions.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from pyproxy.core.fields import (
    FAMILIES,
    MAX_ADDRESS_LIST,
    MAX_AFFINITY_TIMEOUT,
    MAX_SERVICE_PORTS,
    MAX_SOURCE_RANGES,
    MAX_TOPOLOGY_KEYS,
    SERVICE_TYPES,
    Invalid,
    NotProxied,
    cluster_scoped,
    guarded,
    is_label_key,
    prefixed,
    read_annotations,
    read_cidr,
    read_dns_label,
    read_int,
    read_ip,
    read_labels,
    read_list,
    read_mapping,
    read_policy,
    read_port_name,
    read_protocol,
    read_str,
)
from pyproxy.core.model import (
    ANNOTATION_BALANCING,
    ANNOTATION_ENDPOINT_WEIGHTS,
    ANNOTATION_HASH_SEED,
    ANNOTATION_OUTLIER_EJECTION,
    ANNOTATION_TOPOLOGY_AWARE_HINTS,
    ANNOTATION_TOPOLOGY_KEYS,
    ANNOTATION_TOPOLOGY_MIN_ENDPOINTS,
    ANNOTATION_TOPOLOGY_MODE,
    DEFAULT_AFFINITY_TIMEOUT,
    DEFAULT_HASH_SEED,
    LABEL_SERVICE_PROXY_NAME,
    MAX_WEIGHT,
    TOPOLOGY_KEY_ANY,
    Algorithm,
    LoadBalancerIngress,
    Protocol,
    ServicePort,
    ServicePortName,
    Skipped,
    TrafficPolicy,
    ip_family,
)
from pyproxy.core.topology import parse_min_endpoints

# ---------------------------------------------------------------------------------------------
# Services


def convert_service(obj: Any) -> tuple[ServicePort, ...] | Skipped:
    """A Service → its proxied ports, or why it is not proxied."""
    return guarded("Service", obj, _service_ports)


def _service_ports(data: Any) -> tuple[ServicePort, ...]:
    data = read_mapping(data, "Service")
    meta = read_mapping(data.get("metadata"), "metadata")
    namespace = read_dns_label(meta.get("namespace", "default"), "metadata.namespace")
    name = read_dns_label(meta.get("name"), "metadata.name")
    labels = read_labels(meta.get("labels"), "metadata.labels")
    annotations = read_annotations(meta.get("annotations"), "metadata.annotations")
    spec = read_mapping(data.get("spec"), "spec")
    status = read_mapping(data.get("status"), "status")

    if LABEL_SERVICE_PROXY_NAME in labels:
        raise NotProxied(
            f"labelled {LABEL_SERVICE_PROXY_NAME}={labels[LABEL_SERVICE_PROXY_NAME]!r}: "
            "another proxy handles it"
        )
    service_type = read_str(spec.get("type"), "spec.type", "ClusterIP")
    if service_type not in SERVICE_TYPES:
        raise Invalid(f"spec.type: unknown type {service_type!r}")
    if service_type == "ExternalName":
        raise NotProxied("type ExternalName: resolved by DNS, not proxied")
    cluster_ips = _cluster_ips(spec)
    external_ips = tuple(
        read_ip(v, f"spec.externalIPs[{i}]")
        for i, v in enumerate(read_list(spec.get("externalIPs"), "spec.externalIPs",
                                        MAX_ADDRESS_LIST))
    )
    ingress = _load_balancer_ingress(status) if service_type == "LoadBalancer" else ()
    source_ranges = tuple(
        read_cidr(v, f"spec.loadBalancerSourceRanges[{i}]")
        for i, v in enumerate(
            read_list(
                spec.get("loadBalancerSourceRanges"),
                "spec.loadBalancerSourceRanges",
                MAX_SOURCE_RANGES,
            )
        )
    )
    affinity, timeout = _session_affinity(spec)
    internal = read_policy(spec.get("internalTrafficPolicy"), "spec.internalTrafficPolicy")
    external = read_policy(spec.get("externalTrafficPolicy"), "spec.externalTrafficPolicy")
    # healthCheckNodePort matters only for LoadBalancer + eTP=Local (as upstream).
    hcnp = read_int(spec.get("healthCheckNodePort"), "spec.healthCheckNodePort", 0, 0, 65535)
    if not (service_type == "LoadBalancer" and external is TrafficPolicy.LOCAL):
        hcnp = 0
    distribution = spec.get("trafficDistribution")
    distribution = read_str(distribution, "spec.trafficDistribution") or None
    topology_mode = annotations.get(ANNOTATION_TOPOLOGY_MODE) or annotations.get(
        ANNOTATION_TOPOLOGY_AWARE_HINTS
    )
    topology_keys = _topology_keys(spec, annotations)
    min_endpoints, topology_note = parse_min_endpoints(
        annotations.get(ANNOTATION_TOPOLOGY_MIN_ENDPOINTS))
    balancing, seed, weights, balancing_note = _balancing(annotations)
    outlier_ejection, outlier_note = _outlier_ejection(annotations)
    balancing_note = "; ".join(n for n in (balancing_note, outlier_note) if n) or None

    raw_ports = read_list(spec.get("ports"), "spec.ports", MAX_SERVICE_PORTS)
    if not raw_ports:
        raise NotProxied("no ports")
    ports: list[ServicePort] = []
    seen: set[tuple[str, Protocol]] = set()
    for i, raw in enumerate(raw_ports):
        try:
            port_name, protocol, number, node_port = _service_port(raw, len(raw_ports) > 1)
        except Invalid as err:
            raise prefixed(f"spec.ports[{i}]", err) from None
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
                outlier_ejection=outlier_ejection,
            )
        )
    return tuple(ports)


def _service_port(raw: Any, several: bool) -> tuple[str, Protocol, int, int]:
    """Name, protocol, number and node port of one entry of spec.ports. The fields are
    named relative to the entry (`_at` prefixes them when one is invalid): formatting four
    field paths per port was a tenth of a Service's conversion."""
    raw = read_mapping(raw, "")
    port_name = read_port_name(raw.get("name"), "name")
    if not port_name and several:
        raise Invalid("name: required when a Service has several ports")
    protocol = read_protocol(raw.get("protocol"), "protocol")
    number = read_int(raw.get("port"), "port", 0, 1, 65535)
    if number == 0:
        raise Invalid("port: required")
    return port_name, protocol, number, read_int(raw.get("nodePort"), "nodePort", 0, 0, 65535)




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


def _outlier_ejection(annotations: Mapping[str, str]) -> tuple[bool | None, str | None]:
    """service.pyproxy.io/outlier-ejection: on or off for this Service whatever the node's
    setting says; anything but true/false is ignored (the setting decides) with a note."""
    if ANNOTATION_OUTLIER_EJECTION not in annotations:
        return None, None
    text = annotations[ANNOTATION_OUTLIER_EJECTION].strip().lower()
    if text in ("true", "false"):
        return text == "true", None
    return None, (f"{ANNOTATION_OUTLIER_EJECTION}={text[:40]!r} is not true or false: "
                  "the node's setting outlierEjection decides")


def _cluster_ips(spec: Mapping[str, Any]) -> tuple[str, ...]:
    primary = read_str(spec.get("clusterIP"), "spec.clusterIP")
    listed = read_list(spec.get("clusterIPs"), "spec.clusterIPs", 2)
    if primary == "None" or (listed and listed[0] == "None"):
        raise NotProxied("headless (clusterIP: None): no virtual IP to proxy")
    raw = listed or ([primary] if primary else [])
    if not raw:
        raise NotProxied("no cluster IP allocated")
    ips = tuple(read_ip(v, f"spec.clusterIPs[{i}]") for i, v in enumerate(raw))
    if len(ips) == 2 and ip_family(ips[0]) == ip_family(ips[1]):
        raise Invalid("spec.clusterIPs: two addresses of the same family")
    # written as clusterIPs[0] reads (the common case): the same address, not parsed again
    if primary and primary != ips[0] and primary != "None" and \
            read_ip(primary, "spec.clusterIP") != ips[0]:
        raise Invalid("spec.clusterIP: differs from spec.clusterIPs[0]")
    families = read_list(spec.get("ipFamilies"), "spec.ipFamilies", 2)
    for i, (fam, ip) in enumerate(zip(families, ips, strict=False)):
        if fam not in ("IPv4", "IPv6"):
            raise Invalid(f"spec.ipFamilies[{i}]: unknown family {fam!r}")
        if FAMILIES[fam] != ip_family(ip):
            raise Invalid(f"spec.ipFamilies[{i}]: {fam} does not match clusterIP {ip}")
    return ips


def _load_balancer_ingress(status: Mapping[str, Any]) -> tuple[LoadBalancerIngress, ...]:
    lb = read_mapping(status.get("loadBalancer"), "status.loadBalancer")
    out: list[LoadBalancerIngress] = []
    for i, raw in enumerate(read_list(lb.get("ingress"), "status.loadBalancer.ingress", 64)):
        field = f"status.loadBalancer.ingress[{i}]"
        raw = read_mapping(raw, field)
        if not raw.get("ip"):
            continue  # hostname-only ingress: nothing for the node to program
        mode = read_str(raw.get("ipMode"), f"{field}.ipMode", "VIP")
        if mode not in ("VIP", "Proxy"):
            raise Invalid(f"{field}.ipMode: unknown mode {mode!r}")
        out.append(LoadBalancerIngress(read_ip(raw.get("ip"), f"{field}.ip"), mode))
    return tuple(out)


def _session_affinity(spec: Mapping[str, Any]) -> tuple[bool, int]:
    kind = read_str(spec.get("sessionAffinity"), "spec.sessionAffinity", "None")
    if kind not in ("None", "ClientIP"):
        raise Invalid(f"spec.sessionAffinity: unknown value {kind!r}")
    if kind == "None":
        return False, DEFAULT_AFFINITY_TIMEOUT
    config = read_mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
    client_ip = read_mapping(config.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
    timeout = read_int(
        client_ip.get("timeoutSeconds"),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
        DEFAULT_AFFINITY_TIMEOUT,
        1,
        MAX_AFFINITY_TIMEOUT,
    )
    return True, timeout


def _topology_keys(spec: Mapping[str, Any], annotations: Mapping[str, str]) -> tuple[str, ...]:
    """Ordered topology keys from spec.topologyKeys (older clusters, snapshots) or, where the
    API no longer has the field, from pyproxy's annotation (comma-separated)."""
    if spec.get("topologyKeys") is not None:
        field = "spec.topologyKeys"
        raw = read_list(spec["topologyKeys"], field, 64)
        keys = [read_str(v, f"{field}[{i}]") for i, v in enumerate(raw)]
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
# ServiceCIDRs


def convert_service_cidr(obj: Any) -> tuple[str, ...] | Skipped:
    """A ServiceCIDR (networking.k8s.io/v1, cluster-scoped) → its CIDRs in canonical form, or
    why it is skipped. One being deleted (deletionTimestamp) still counts until it is gone:
    its ClusterIPs may still be in use, as kube-proxy, which reads every object, does."""
    return cluster_scoped("ServiceCIDR", obj, _service_cidrs)


def _service_cidrs(data: Mapping[str, Any], _meta: Mapping[str, Any],
                   _name: str) -> tuple[str, ...]:
    spec = read_mapping(data.get("spec"), "spec")
    # The API allows one CIDR per family.
    raw = read_list(spec.get("cidrs"), "spec.cidrs", 2)
    cidrs = tuple(read_cidr(value, f"spec.cidrs[{i}]") for i, value in enumerate(raw))
    for i, cidr in enumerate(cidrs):
        if cidr.endswith("/0"):
            # Every address of the family: the node would drop all forwarded traffic
            # that no service DNATs. No working cluster has it; refuse it as a typo.
            raise Invalid(f"spec.cidrs[{i}]: {cidr!r} covers every address")
    return cidrs
