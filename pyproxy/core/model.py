"""The internal model: what pyproxy knows about Services, endpoints and Nodes.

Everything here is frozen and hashable. The API's loose JSON is turned into these types once,
in `convert`, and nothing downstream (selection, rendering, diffing) has to defend itself
against missing fields or wrong types again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from itertools import pairwise
from typing import Any


class Protocol(StrEnum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"


class IPFamily(StrEnum):
    IPv4 = "IPv4"
    IPv6 = "IPv6"

    @property
    def nft_family(self) -> str:
        return "ip" if self is IPFamily.IPv4 else "ip6"


class TrafficPolicy(StrEnum):
    CLUSTER = "Cluster"
    LOCAL = "Local"


class Algorithm(StrEnum):
    """How a service spreads new connections (service.pyproxy.io/balancing; balancing.py)."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    SOURCE_HASH = "source-hash"
    MAGLEV = "maglev"
    # IPVS's least-connection schedulers, by feedback from conntrack (core/least.py)
    LEAST_CONNECTIONS = "lc"
    WEIGHTED_LEAST_CONNECTIONS = "wlc"
    SHORTEST_EXPECTED_DELAY = "sed"
    NEVER_QUEUE = "nq"


# Well-known label and annotation keys.
LABEL_ZONE = "topology.kubernetes.io/zone"
LABEL_REGION = "topology.kubernetes.io/region"
LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
ANNOTATION_TOPOLOGY_MODE = "service.kubernetes.io/topology-mode"
ANNOTATION_TOPOLOGY_AWARE_HINTS = "service.kubernetes.io/topology-aware-hints"
ANNOTATION_TOPOLOGY_KEYS = "service.pyproxy.io/topology-keys"
ANNOTATION_TOPOLOGY_MIN_ENDPOINTS = "service.pyproxy.io/topology-min-endpoints"
ANNOTATION_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
ANNOTATION_BALANCING = "service.pyproxy.io/balancing"
ANNOTATION_HASH_SEED = "service.pyproxy.io/hash-seed"
ANNOTATION_ENDPOINT_WEIGHTS = "service.pyproxy.io/endpoint-weights"
ANNOTATION_WEIGHT = "service.pyproxy.io/weight"
ANNOTATION_OUTLIER_EJECTION = "service.pyproxy.io/outlier-ejection"
TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"

TOPOLOGY_KEY_ANY = "*"
DEFAULT_AFFINITY_TIMEOUT = 10800  # API default for sessionAffinityConfig.clientIP.timeoutSeconds
# The hash seed every node uses unless a service sets its own: hashing agrees across nodes.
DEFAULT_HASH_SEED = 0x70797078  # "pypx"
MAX_WEIGHT = 1000
# topology-min-endpoints above this is taken for a typo, not a wish (an EndpointSlice holds at
# most 1000 endpoints; "use them all" is what an empty topology preference already says).
MAX_TOPOLOGY_MIN_ENDPOINTS = 1000


def ip_family(address: str) -> IPFamily:
    """The family of a (valid) IP address or CIDR."""
    return IPFamily.IPv6 if ":" in address else IPFamily.IPv4


def override_ips(preferred: Sequence[str], ips: Sequence[str]) -> tuple[str, ...]:
    """`ips` with every family `preferred` has addresses of taken from `preferred` instead, as
    kube-proxy overrides the node's IP per family (bindAddress over the Node's). The preferred
    addresses come first: the first one's family is the primary."""
    families = {ip_family(ip) for ip in preferred}
    return tuple(dict.fromkeys((*preferred, *(ip for ip in ips if ip_family(ip) not in families))))


@dataclass(frozen=True, slots=True, order=True)
class ServiceKey:
    """namespace/name of a Service."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    """One port of one Service: the unit that everything is programmed per (upstream's
    ServicePortName). Prints as `ns/name:port`, or `ns/name` for an unnamed port."""

    namespace: str
    name: str
    port: str
    protocol: Protocol

    @property
    def service(self) -> ServiceKey:
        return ServiceKey(self.namespace, self.name)

    def __str__(self) -> str:
        suffix = f":{self.port}" if self.port else ""
        return f"{self.namespace}/{self.name}{suffix}"


@dataclass(frozen=True, slots=True)
class LoadBalancerIngress:
    ip: str
    # "VIP" (default) means the node must handle the IP; "Proxy" means the load balancer
    # delivers traffic to the node itself and the IP must not be programmed.
    ip_mode: str = "VIP"

    @property
    def is_vip(self) -> bool:
        return self.ip_mode != "Proxy"


@dataclass(frozen=True, slots=True)
class ServicePort:
    """Everything pyproxy needs about one service port, both IP families included."""

    name: ServicePortName
    port: int
    cluster_ips: tuple[str, ...]
    service_type: str = "ClusterIP"
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ingress: tuple[LoadBalancerIngress, ...] = ()
    source_ranges: tuple[str, ...] = ()
    session_affinity: bool = False
    affinity_timeout: int = DEFAULT_AFFINITY_TIMEOUT
    internal_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    external_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    health_check_node_port: int = 0
    traffic_distribution: str | None = None
    topology_mode_annotation: str | None = None
    topology_keys: tuple[str, ...] = ()
    # service.pyproxy.io/topology-min-endpoints (0: not set): widen the preferred topology
    # level until this many ready endpoints are used (topology.py). An unusable value is
    # reported in `topology_note` and ignored.
    topology_min_endpoints: int = 0
    topology_note: str | None = None
    # pyproxy's balancing annotations (see balancing.py). An unusable value is reported in
    # `balancing_note` and the service falls back to random.
    balancing: Algorithm = Algorithm.RANDOM
    hash_seed: int = DEFAULT_HASH_SEED
    endpoint_weights: tuple[tuple[str, int], ...] = ()
    balancing_note: str | None = None
    # service.pyproxy.io/outlier-ejection ("true"/"false"; core/outliers.py): None when not
    # given, the node's setting outlierEjection decides. TCP ports only.
    outlier_ejection: bool | None = None

    @property
    def protocol(self) -> Protocol:
        return self.name.protocol

    def families(self) -> tuple[IPFamily, ...]:
        seen: list[IPFamily] = []
        for ip in self.cluster_ips:
            fam = ip_family(ip)
            if fam not in seen:
                seen.append(fam)
        return tuple(seen)

    def cluster_ip(self, family: IPFamily) -> str | None:
        return next((ip for ip in self.cluster_ips if ip_family(ip) == family), None)

    def external_ips_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(ip for ip in self.external_ips if ip_family(ip) == family)

    def load_balancer_vips(self, family: IPFamily) -> tuple[str, ...]:
        """LoadBalancer ingress IPs of the family that the node must handle (ipMode != Proxy)."""
        return tuple(
            ing.ip
            for ing in self.load_balancer_ingress
            if ing.is_vip and ip_family(ing.ip) == family
        )

    def source_ranges_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(cidr for cidr in self.source_ranges if ip_family(cidr) == family)

    def externally_accessible(self, family: IPFamily) -> bool:
        return (
            self.node_port != 0
            or bool(self.external_ips_of(family))
            or bool(self.load_balancer_vips(family))
        )

    def uses_cluster_endpoints(self, family: IPFamily) -> bool:
        # eTP=Local still needs the cluster list: pod and host traffic to an external
        # address is short-circuited to it.
        return self.internal_policy is TrafficPolicy.CLUSTER or self.externally_accessible(
            family
        )

    def uses_local_endpoints(self, family: IPFamily) -> bool:
        return self.internal_policy is TrafficPolicy.LOCAL or (
            self.external_policy is TrafficPolicy.LOCAL and self.externally_accessible(family)
        )


@dataclass(frozen=True, slots=True, init=False)
class Endpoint:
    """One backend address of one service port, as this node sees it."""

    ip: str
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str | None = None
    zone: str | None = None
    zone_hints: frozenset[str] = frozenset()
    node_hints: frozenset[str] = frozenset()
    # EndpointSlice `deprecatedTopology`: labels for endpoints whose Node is unknown.
    topology: tuple[tuple[str, str], ...] = ()
    # From the slice's `service.pyproxy.io/weight` annotation; None: not given.
    weight: int | None = None

    # Written out rather than generated: a frozen dataclass's own __init__ goes through
    # object.__setattr__ for each field (4 µs an endpoint, 100k to 250k of them per
    # initial list); the slots' own setters take a third of that.
    def __init__(self, ip: str, port: int, ready: bool = True, serving: bool = True,
                 terminating: bool = False, node_name: str | None = None,
                 zone: str | None = None, zone_hints: frozenset[str] = frozenset(),
                 node_hints: frozenset[str] = frozenset(),
                 topology: tuple[tuple[str, str], ...] = (), weight: int | None = None,
                 ) -> None:
        (set_ip, set_port, set_ready, set_serving, set_terminating, set_node_name, set_zone,
         set_zone_hints, set_node_hints, set_topology, set_weight) = _ENDPOINT_SETTERS
        set_ip(self, ip)
        set_port(self, port)
        set_ready(self, ready)
        set_serving(self, serving)
        set_terminating(self, terminating)
        set_node_name(self, node_name)
        set_zone(self, zone)
        set_zone_hints(self, zone_hints)
        set_node_hints(self, node_hints)
        set_topology(self, topology)
        set_weight(self, weight)
    @property
    def key(self) -> str:
        """`IP:port` (IPv6 in brackets): the identity of an endpoint within a service port.
        Computed when asked (merging several slices, explain), not stored: 100k endpoints
        would carry 6 MB of it, and the common one-slice path never asks."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"

    @property
    def family(self) -> IPFamily:
        return ip_family(self.ip)

    def is_local(self, node_name: str) -> bool:
        return self.node_name is not None and self.node_name == node_name


# The setters of Endpoint's slots, in field order (see Endpoint.__init__).
_ENDPOINT_SETTERS: tuple[Callable[[Endpoint, Any], None], ...] = tuple(
    getattr(Endpoint, f.name).__set__ for f in fields(Endpoint))


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    deleting: bool = False
    taints: tuple[str, ...] = ()
    # The node's IPs as kube-proxy picks them from status.addresses (GetNodeHostIPs): the
    # first InternalIP (else ExternalIP), then the first address of the other family.
    host_ips: tuple[str, ...] = ()
    # spec.podCIDRs (detect-local mode NodeCIDR).
    pod_cidrs: tuple[str, ...] = ()
    # The InternalIPs and ExternalIPs of status.addresses that do not parse, passed over as
    # kube-proxy does ("InternalIP '10.0.0.300'"): `unusable_address_warnings` says so.
    unusable_addresses: tuple[str, ...] = ()

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.labels.items())), self.deleting, self.taints,
                     self.host_ips, self.pod_cidrs, self.unusable_addresses))

    @property
    def zone(self) -> str:
        return self.labels.get(LABEL_ZONE, "")


@dataclass(frozen=True, slots=True)
class SliceEndpoints:
    """The part of one EndpointSlice that the proxy uses.

    `endpoints` is normalised on construction: sorted by address, one entry per address (a
    non-terminating copy wins over a terminating one), each carrying the number of the
    slice's first port. Almost every slice has one port, so its endpoints serve as the
    merged list of that service port as they are: no copy per sync, per port or per reader.
    """

    service: ServiceKey
    name: str
    family: IPFamily
    # (port name, protocol, port number) as the slice declares them.
    ports: tuple[tuple[str, Protocol, int], ...]
    endpoints: tuple[Endpoint, ...]
    trigger_time: str | None = None

    def __post_init__(self) -> None:
        normal = _normalised(self.endpoints, self.ports[0][2] if self.ports else 0)
        if normal is not None:
            object.__setattr__(self, "endpoints", normal)

    def numbers_for(self, port: ServicePortName) -> Iterator[int]:
        """The port numbers this slice declares for a service port (by name and protocol)."""
        for name, protocol, number in self.ports:
            if name == port.port and protocol is port.protocol:
                yield number

    def endpoints_numbered(self, number: int) -> tuple[Endpoint, ...]:
        """The endpoints with `number` as their port (the stored ones when it is theirs)."""
        if not self.endpoints or self.endpoints[0].port == number:
            return self.endpoints
        return tuple(_numbered(ep, number) for ep in self.endpoints)


def _numbered(ep: Endpoint, number: int) -> Endpoint:
    # positional: much cheaper than dataclasses.replace at 100k endpoints
    return Endpoint(ep.ip, number, ep.ready, ep.serving, ep.terminating, ep.node_name,
                    ep.zone, ep.zone_hints, ep.node_hints, ep.topology, ep.weight)


def _normalised(endpoints: tuple[Endpoint, ...], number: int) -> tuple[Endpoint, ...] | None:
    """`endpoints` sorted, unique and numbered `number`; None when they already are."""
    keys = [ep.key for ep in endpoints]
    if (all(ep.port == number for ep in endpoints)
            and all(a < b for a, b in pairwise(keys))):
        return None
    chosen: dict[str, Endpoint] = {}
    for ep in endpoints:
        if ep.port != number:
            ep = _numbered(ep, number)
        old = chosen.get(ep.ip)
        if old is None or (old.terminating and not ep.terminating):
            chosen[ep.ip] = ep
    return tuple(sorted(chosen.values(), key=lambda ep: ep.key))


@dataclass(frozen=True, slots=True)
class Skipped:
    """An API object pyproxy does not proxy, and why. `invalid` separates bad input (counted
    and logged) from objects that are simply not ours (headless, ExternalName, …)."""

    kind: str
    namespace: str
    name: str
    reason: str
    invalid: bool = True

    @property
    def object(self) -> str:
        if self.namespace:
            return f"{self.kind} {self.namespace}/{self.name}"
        return f"{self.kind} {self.name}" if self.name else self.kind




# ---------------------------------------------------------------------------------------------
# Keys and enums the whole flow shares

ObjectKey = tuple[str, str]  # (namespace, name) of an API object


class LocalMode(StrEnum):
    """kube-proxy's detect-local modes: how to tell pod traffic from other traffic."""

    NONE = "None"
    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    BRIDGE_INTERFACE = "BridgeInterface"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"


# ---------------------------------------------------------------------------------------------
# The cluster state: what the proxy knows, from the watches or a snapshot file


@dataclass(frozen=True)
class ClusterState:
    """What the proxy knows about the cluster. The daemon's cache hands out a view over its
    live dictionaries; a snapshot file gives a fixed one."""

    nodes: Mapping[str, Node] = field(default_factory=dict)
    ports_by_service: Mapping[ServiceKey, tuple[ServicePort, ...]] = field(default_factory=dict)
    slices: Mapping[ServiceKey, tuple[SliceEndpoints, ...]] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()
    # Every CIDR of every ServiceCIDR object (both families, sorted, each once): addresses in
    # them that are no ClusterIP are dropped. Empty: none known (or the API does not serve
    # them), and nothing is dropped.
    service_cidrs: tuple[str, ...] = ()

    @property
    def ports(self) -> tuple[ServicePort, ...]:
        """Every service port, ordered by service then by port."""
        return tuple(port for key in sorted(self.ports_by_service)
                     for port in self.ports_by_service[key])

    def node(self, name: str) -> Node:
        """This node's object; a node missing from the state has no labels."""
        return self.nodes.get(name) or Node(name)

    def ports_of(self, service: ServiceKey) -> tuple[ServicePort, ...]:
        return self.ports_by_service.get(service, ())

    def node_labels(self) -> dict[str, Mapping[str, str]]:
        return {name: node.labels for name, node in self.nodes.items()}

    def endpoints(self, port: ServicePortName, family: IPFamily) -> tuple[Endpoint, ...]:
        return merge_slices(self.slices.get(port.service, ()), port, family)


def merge_slices(
    slices: Iterable[SliceEndpoints], port: ServicePortName, family: IPFamily
) -> tuple[Endpoint, ...]:
    """The endpoints of one service port and family, from all of the Service's slices.

    Matching is by port name and protocol (the number comes from the slice: the target port is
    already resolved there). A duplicated `IP:port` counts once; when copies disagree a
    non-terminating one wins (a pod IP reused while the old pod terminates). The result is
    sorted by `IP:port` so that diffs and rule order are stable.
    """
    service = port.service
    lists = [piece.endpoints_numbered(number) for piece in slices
             if piece.family is family and piece.service == service
             for number in piece.numbers_for(port)]
    if len(lists) == 1:
        return lists[0]  # one slice declares the port: already sorted and unique
    chosen: dict[str, Endpoint] = {}
    get = chosen.get
    # Endpoint.key spelled out for the one family: a property call per endpoint was 40 % of
    # merging a 5,000-endpoint service's 50 slices (merged again at each of its changes).
    bracketed = family is IPFamily.IPv6
    for endpoints in lists:
        for ep in endpoints:
            key = f"[{ep.ip}]:{ep.port}" if bracketed else f"{ep.ip}:{ep.port}"
            old = get(key)
            if old is None or (old.terminating and not ep.terminating):
                chosen[key] = ep
    return tuple(map(chosen.__getitem__, sorted(chosen)))


def all_cidrs(cidrs: Iterable[str]) -> tuple[str, ...]:
    """The CIDRs of several ServiceCIDRs as ClusterState holds them: each once, in a stable
    order (the same objects always render the same set)."""
    return tuple(sorted(set(cidrs)))
