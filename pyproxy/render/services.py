"""Rendering: selected endpoints in, desired nftables objects out. Pure; no kernel access.

The layout ("data maps", chosen by measurement: docs/nft-layout.md) keeps the number of chains
small and independent of the number of services. libnftables 1.0.6 reads every chain of the
table from the kernel before each transaction, so the chain count sets the floor of every
sync; with ~30 chains a one-service change costs about a millisecond, against ~115 ms with a
chain per service at 10k services.

How a new connection to a service is handled (table `ip pyproxy` / `ip6 pyproxy`):
- `services` (nat prerouting/output) looks the destination up in `service-ips`
  (addr . proto . port → goto a *pick chain*) or, for node addresses, `service-nodeports`.
- A pick chain is shared by every service with the same shape, e.g. `cluster-tcp-3`
  (a ClusterIP with 3 endpoints): it applies the masquerade rule of its kind, then
  `dnat ip to ip daddr . tcp dport . numgen random mod 3 map @endpoints-tcp`, where
  `endpoints-tcp` maps (service addr . port . index) → (endpoint addr . port).
- External traffic under `externalTrafficPolicy: Local` uses `external-local-tcp-L-C`: indexes
  0..L-1 hold the local endpoints, L..L+C-1 the cluster list (for the pod and host
  short-circuits, drawn with `numgen … offset L`).
- Services with ClientIP session affinity (rare) get per-service chains in upstream's shape
  (`service-`/`local-`/`external-` + hash + ns/name/proto/port) and per-endpoint affinity sets.
- The filter side (reject/drop for missing endpoints, LoadBalancer source ranges, invalid
  ClusterIP ports, unallocated addresses of the ServiceCIDRs) follows upstream kube-proxy's
  hooks and priorities; on the output hook the endpoints check runs after DNAT, as upstream's
  does since kubernetes#132456.
- New connections are counted per (service address . protocol . port . endpoint . port) in
  dynamic sets the kernel fills itself (`new-connections-N`): the filter chains that run after
  DNAT send the first packet of each DNATed connection to `count-new-connections`, whose
  `update` creates the element on the first connection and counts every one. No element is
  written by a sync (pyproxy/serve/connections.py reads and garbage-collects them).
"""

from __future__ import annotations

import base64
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from ipaddress import collapse_addresses, ip_address, ip_network
from typing import Any

from pyproxy.core.balancing import Balancing, balancing_of, effective_weights, slots, weighted_slots
from pyproxy.core.model import (
    Algorithm,
    Endpoint,
    IPFamily,
    LocalMode,
    ServicePort,
    TrafficPolicy,
    ip_family,
)
from pyproxy.core.nodeconfig import LocalhostNodePorts, NodeConfig
from pyproxy.core.topology import Selection
from pyproxy.render.objects import (
    CLUSTER_IPS_CHECK,
    CLUSTER_IPS_SET,
    CONNECTION_SHARD_SIZE,
    CONNECTION_SHARDS,
    COUNT_CONNECTIONS_CHAIN,
    FIREWALL_ALLOW_SET,
    FIREWALL_CHECK,
    FIREWALL_IPS_SET,
    HAIRPIN_SET,
    LOCALHOST_NODEPORT_REJECT_MAP,
    MASQUERADING_CHAIN,
    NO_ENDPOINT_NODEPORTS_MAP,
    NO_ENDPOINT_SERVICES_MAP,
    NODEPORT_ENDPOINTS_CHECK,
    NODEPORT_IPS_SET,
    PROTOCOLS,
    REJECT_CHAIN,
    SERVICE_CIDRS_SET,
    SERVICE_ENDPOINTS_CHECK,
    SERVICE_IPS_MAP,
    SERVICE_NODEPORTS_MAP,
    SERVICES_CHAIN,
    VERDICT,
    ElementValue,
    Fragment,
    Item,
    Key,
    Kind,
    SetDecl,
    Verdict,
    connections_set,
    element_comment,
    endpoints_map,
    localhost_nodeport_reject_chain,
    nodeport_endpoints_map,
)


@dataclass(frozen=True)
class RenderConfig:
    """Per-family settings that shape the rules."""

    family: IPFamily
    local_mode: LocalMode = LocalMode.NONE
    # CIDR (ClusterCIDR/NodeCIDR modes) or interface name / prefix (the interface modes).
    local_value: str = ""
    # Node addresses that accept NodePorts; None means every local address.
    nodeport_ips: tuple[str, ...] | None = None
    # The addresses NodePorts are served on, as far as they are known (with nodeport_ips
    # None, the node's known local addresses): what a trace takes for "this node".
    nodeport_addresses: tuple[str, ...] = ()
    # This node's addresses (for LoadBalancer source ranges that include the node).
    node_ips: tuple[str, ...] = ()
    masquerade_bit: int = 14
    masquerade_all: bool = False
    # Count new connections per endpoint in the kernel (the `new-connections-N` sets).
    count_connections: bool = True
    # This node's name: only its own endpoints can reach themselves through it (hairpin).
    # None (offline tools without a node): every endpoint is treated as local there.
    node_name: str | None = None
    # NodePorts on loopback (KEP-6032): which protocols are rejected there, and counted.
    localhost_nodeports: LocalhostNodePorts = LocalhostNodePorts.OFF

    @property
    def localhost_rejected(self) -> tuple[str, ...]:
        """The protocols whose localhost NodePorts are rejected (and counted): all of them
        with the gate on and no userspace proxy, those it cannot carry with it (TCP only,
        KEP-6032's non-goal), none with the gate off."""
        if self.localhost_nodeports is LocalhostNodePorts.OFF:
            return ()
        if self.localhost_nodeports is LocalhostNodePorts.PROXY:
            return tuple(p for p in PROTOCOLS if p != "tcp")
        return PROTOCOLS

    @property
    def mark(self) -> str:
        return f"0x{1 << self.masquerade_bit:08x}"

    @property
    def ip(self) -> str:
        return self.family.nft_family

    @property
    def addr_type(self) -> str:
        return "ipv4_addr" if self.family is IPFamily.IPv4 else "ipv6_addr"

    @property
    def loopback(self) -> str:
        return "127.0.0.0/8" if self.family is IPFamily.IPv4 else "::1"

    def local_match(self, negate: bool = False) -> str | None:
        """The nft match for "comes from a local pod" (or its negation), or None when no
        detector is configured. Interface modes use iifname: `iif` resolves names at load
        time and fails for absent interfaces and wildcards (kubernetes#134024)."""
        op = "!= " if negate else ""
        if self.local_mode in (LocalMode.CLUSTER_CIDR, LocalMode.NODE_CIDR) and self.local_value:
            return f"{self.ip} saddr {op}{self.local_value}"
        if self.local_mode is LocalMode.BRIDGE_INTERFACE and self.local_value:
            return f'iifname {op}"{self.local_value}"'
        if self.local_mode is LocalMode.INTERFACE_NAME_PREFIX and self.local_value:
            return f'iifname {op}"{self.local_value}*"'
        return None


def render_config(node: NodeConfig, family: IPFamily) -> RenderConfig:
    """What rendering needs of this node's configuration, for one family."""
    return RenderConfig(
        family=family,
        local_mode=node.local_mode_for(family),
        local_value=node.local_value(family),
        nodeport_ips=node.nodeport_ips(family),
        nodeport_addresses=node.nodeport_addresses_of(family),
        node_ips=tuple(ip for ip in node.node_ips if ip_family(ip) is family),
        masquerade_bit=node.masquerade_bit,
        masquerade_all=node.masquerade_all,
        count_connections=node.count_connections,
        node_name=node.node_name,
        localhost_nodeports=node.localhost_nodeports(family),
    )


def _endpoints_map_decl(ip: str, proto: str) -> SetDecl:
    return SetDecl((f"{ip} daddr", f"{proto} dport", "numgen random mod 1"),
                   (f"{ip} daddr", f"{proto} dport"), typeof=True)


def _nodeport_endpoints_map_decl(ip: str, proto: str) -> SetDecl:
    return SetDecl((f"{proto} dport", "numgen random mod 1"), (f"{ip} daddr", f"{proto} dport"),
                   typeof=True)


# A service port with at least this many slots keeps them in an endpoints map of its own.
# libnftables (1.0.6) reads every element of the map a new rule refers to before it takes
# the rule, and every endpoint count of such a service is a new pick chain: with the shared
# map of 100k elements that read was 7 ms of the 8 ms a new chain cost (1.7 ms with a small
# map), 35-40 ms with 250k elements.
OWN_MAP_SLOTS = 1000


# ---------------------------------------------------------------------------------------------
# Item constructors (the types: objects.py)


def _set(name: str, declaration: SetDecl) -> Item:
    return Item(Kind.SET, name, "", declaration)


def _chain(name: str, rules: Sequence[str]) -> Item:
    return Item(Kind.CHAIN, name, "", tuple(rules))


# Item(...) goes through the NamedTuple's Python-level __new__; building the tuple directly
# halves the cost, which counts at a few hundred thousand elements per full render.
_new_tuple: Callable[[type[Item], tuple[Kind, str, Key, ElementValue]], Item] = (
    tuple.__new__)
_ELEMENT = Kind.ELEMENT
# The same for a verdict: one per service port and address.
_new_verdict: Callable[[type[Verdict], tuple[str, str, str]], Verdict] = tuple.__new__


def _elem(container: str, key: Key, value: ElementValue = ()) -> Item:
    return _new_tuple(Item, (_ELEMENT, container, key, value))


def skeleton(cfg: RenderConfig, service_cidrs: Sequence[str] = ()) -> Fragment:
    """The static part: sets and maps, and the chains every ruleset has. `service_cidrs`
    (of any family; from the ServiceCIDR objects) fill `service-cidrs`."""
    ip, addr = cfg.ip, cfg.addr_type
    destination = (addr, "inet_proto", "inet_service")  # the type of `destination()`
    node_port = ("inet_proto", "inet_service")
    items = [
        _set(CLUSTER_IPS_SET, SetDecl((addr,), comment="Active ClusterIPs")),
        _set(HAIRPIN_SET, SetDecl((addr, addr), comment="endpoint . itself, for hairpin")),
        _set(SERVICE_CIDRS_SET, SetDecl((addr,), flags=("interval",), comment="ServiceCIDRs")),
        _set(FIREWALL_IPS_SET, SetDecl(destination, comment="destinations with source ranges")),
        _set(FIREWALL_ALLOW_SET, SetDecl((*destination, addr), flags=("interval",),
                                         comment="allowed sources per destination")),
        _set(SERVICE_IPS_MAP, SetDecl(destination, VERDICT, comment="ClusterIP, ExternalIP and "
                                      "LoadBalancer IP traffic")),
        _set(SERVICE_NODEPORTS_MAP, SetDecl(node_port, VERDICT, comment="NodePort traffic")),
        _set(NO_ENDPOINT_SERVICES_MAP, SetDecl(destination, VERDICT, comment="services without "
                                               "usable endpoints: reject or drop")),
        _set(NO_ENDPOINT_NODEPORTS_MAP, SetDecl(node_port, VERDICT, comment="nodeports without "
                                                "usable endpoints: reject or drop")),
    ]
    for proto in PROTOCOLS:
        items.append(_set(endpoints_map(proto), _endpoints_map_decl(ip, proto)))
        items.append(_set(nodeport_endpoints_map(proto), _nodeport_endpoints_map_decl(ip, proto)))
    items.extend(_elem(SERVICE_CIDRS_SET, (cidr,))
                 for cidr in _collapsed([c for c in service_cidrs if ip_family(c) is cfg.family]))
    if cfg.nodeport_ips is not None:
        items.append(_set(NODEPORT_IPS_SET, SetDecl((addr,),
                                                    comment="IPs that accept NodePort traffic")))
        items.extend(_elem(NODEPORT_IPS_SET, (ip_,)) for ip_ in cfg.nodeport_ips)
        nodeport_match = f"{ip} daddr @{NODEPORT_IPS_SET}"
    else:
        nodeport_match = f"fib daddr type local {ip} daddr != {cfg.loopback}"
    items += [
        _chain(SERVICES_CHAIN, (
            f"{ip} daddr . meta l4proto . th dport vmap @{SERVICE_IPS_MAP}",
            f"{nodeport_match} meta l4proto . th dport vmap @{SERVICE_NODEPORTS_MAP}",
        )),
        _chain(SERVICE_ENDPOINTS_CHECK, (
            f"{ip} daddr . meta l4proto . th dport vmap @{NO_ENDPOINT_SERVICES_MAP}",)),
        _chain(NODEPORT_ENDPOINTS_CHECK, (
            f"{nodeport_match} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS_MAP}",
            *_localhost_nodeport_check(cfg))),
        _chain(FIREWALL_CHECK, (
            f"{ip} daddr . meta l4proto . th dport @{FIREWALL_IPS_SET} "
            f"{ip} daddr . meta l4proto . th dport . {ip} saddr != @{FIREWALL_ALLOW_SET} drop",)),
        # Only traffic that no service DNATed gets here (forward, and output after nat).
        _chain(CLUSTER_IPS_CHECK, (
            f'{ip} daddr @{CLUSTER_IPS_SET} reject comment "invalid port of a ClusterIP"',
            # An address of a ServiceCIDR that is no ClusterIP would otherwise be routed on
            # (often out of the default route). Empty set (no ServiceCIDR known): no match.
            f'{ip} daddr @{SERVICE_CIDRS_SET} drop comment "unallocated ClusterIP"',
        )),
        _chain(REJECT_CHAIN, ("reject",)),
        _chain(MASQUERADING_CHAIN, (
            # Hairpin: an endpoint reaching itself through its service must be masqueraded,
            # or it would answer itself directly and the connection would not match.
            f"ct status dnat {ip} saddr . {ip} daddr @{HAIRPIN_SET} "
            f"meta mark set meta mark | {cfg.mark}",
            f"meta mark & {cfg.mark} == 0 return",
            # Clear the bit so it does not leak into later processing.
            f"meta mark set meta mark ^ {cfg.mark}",
            "masquerade fully-random",
        )),
        *_connection_counting(cfg),
        *_localhost_nodeport_rejects(cfg),
    ]
    return Fragment(tuple(items))


def _localhost_nodeport_check(cfg: RenderConfig) -> tuple[str, ...]:
    """In nodeport-endpoints-check (filter input: a connection from this node to itself
    passes there, DNATed by nobody since loopback is never a NodePort address): a localhost
    NodePort of a rejected protocol goes to that protocol's reject chain."""
    if not cfg.localhost_rejected:
        return ()
    return (f"{cfg.ip} daddr {cfg.loopback} meta l4proto . th dport "
            f"vmap @{LOCALHOST_NODEPORT_REJECT_MAP}",)


def _localhost_nodeport_rejects(cfg: RenderConfig) -> tuple[Item, ...]:
    """The map, and a chain per rejected protocol whose rule counts and rejects. kube-proxy
    counts in named counters; an anonymous counter in the chain's rule does the same here
    (a full sync rewrites the chain and starts it from zero: metrics.py banks it)."""
    if not cfg.localhost_rejected:
        return ()
    return (
        _set(LOCALHOST_NODEPORT_REJECT_MAP, SetDecl(("inet_proto", "inet_service"), VERDICT,
                                                    comment="localhost NodePorts rejected by "
                                                    "pyproxy")),
        *(_chain(localhost_nodeport_reject_chain(proto), ("counter reject",))
          for proto in cfg.localhost_rejected),
    )


@functools.lru_cache(maxsize=8)
def _connection_counting(cfg: RenderConfig) -> tuple[Item, ...]:
    """The counting chain and its sets (built once: every sync renders the skeleton). The
    chain exists without the feature too (empty): the base chains jump to it whatever the
    configuration."""
    if not cfg.count_connections:
        return (_chain(COUNT_CONNECTIONS_CHAIN, ()),)
    ip, addr = cfg.ip, cfg.addr_type
    # Element keys: service address . protocol . service port (the node port for NodePorts)
    # . endpoint address . endpoint port. `dynamic`: filled by the packet path, never by a
    # sync, and never flushed by a full sync (which would reset the counters).
    declaration = SetDecl((addr, "inet_proto", "inet_service", addr, "inet_service"),
                          flags=("dynamic",), size=CONNECTION_SHARD_SIZE,
                          comment="new connections per service address and endpoint")
    items = [_set(connections_set(shard), declaration) for shard in range(CONNECTION_SHARDS)]
    mask = "0.0.0.{}" if cfg.family is IPFamily.IPv4 else "::{:x}"
    key = (f"ct original {ip} daddr . meta l4proto . ct original proto-dst . {ip} daddr . "
           "th dport")
    # nft 1.0.6 types `ct original proto-dst` only when the rule names the protocol: one
    # rule per protocol and shard.
    rules = [f"meta l4proto {proto} {ip} daddr & {mask.format(CONNECTION_SHARDS - 1)} == "
             f"{mask.format(shard)} update @{connections_set(shard)} {{ {key} counter }}"
             for proto in PROTOCOLS for shard in range(CONNECTION_SHARDS)]
    return (*items, _chain(COUNT_CONNECTIONS_CHAIN, rules))


# ---------------------------------------------------------------------------------------------
# Per service port


def render_service(port: ServicePort, sel: Selection, cfg: RenderConfig) -> Fragment:
    """The objects one service port needs on this node for one family."""
    cip = port.cluster_ip(cfg.family)
    if cip is None:
        return Fragment()
    r = _ServiceRender(port, sel, cfg, cip)
    return Fragment(tuple(r.items()))


class _ServiceRender:
    """One service port's render. The strings every element of it repeats are built once."""

    def __init__(self, port: ServicePort, sel: Selection, cfg: RenderConfig, cip: str) -> None:
        self.port, self.sel, self.cfg, self.cip = port, sel, cfg, cip
        self.proto = port.protocol.lower()
        # Names are validated DNS labels, so the comment cannot break out of its quotes.
        self._comment = element_comment(str(port.name))
        self._picker: _Picker | None = None

    def goto(self, chain: str) -> Verdict:
        """A dispatch element's value: to `chain`, commented with the service's name."""
        return _new_verdict(Verdict, ("goto", chain, self._comment))

    def drop(self) -> Verdict:
        return _new_verdict(Verdict, ("drop", "", self._comment))

    def destination(self, addr: str) -> Key:
        """The key of a destination (address . protocol . port) in the service-ips,
        no-endpoint-services and firewall sets."""
        return (addr, self.proto, self.port.port)

    def node_port_key(self) -> Key:
        """The key of the node port (protocol . port) in the node port maps."""
        return (self.proto, self.port.node_port)

    def externals(self) -> tuple[str, ...]:
        return self.port.external_ips_of(self.cfg.family) + self.port.load_balancer_vips(
            self.cfg.family
        )

    def items(self) -> list[Item]:
        # One list, extended: nested generators cost a resumption per item and level, and
        # this runs for every element of a full render.
        out = [_elem(CLUSTER_IPS_SET, (self.cip,)), *self.localhost_node_port()]
        if self.port.source_ranges:
            out += self.firewall()
        if not self.sel.has_any_endpoints:
            out += self.no_endpoints(self.goto(REJECT_CHAIN), self.all_entries())
            return out
        # Only this node's endpoints, as kube-proxy's hairpin-connections set: a pod reaches
        # its own service through the node it runs on, never through another one. At 100
        # nodes that is 1 % of the elements the set would hold with every endpoint.
        node = self.cfg.node_name
        out += [_new_tuple(Item, (_ELEMENT, HAIRPIN_SET, (ep.ip, ep.ip), ()))
                for ep in self.sel.all_reachable if node is None or ep.node_name == node]
        if self.port.session_affinity:
            out += _AffinityRender(self).items()
            return out
        out += self.cluster_ip()
        if self.port.external_ips or self.port.load_balancer_ingress:
            out += self.external()
        if self.port.node_port:
            out += self.node_port()
        return out

    def localhost_node_port(self) -> list[Item]:
        """A NodePort of a protocol rejected on loopback, with or without endpoints."""
        if not self.port.node_port or self.proto not in self.cfg.localhost_rejected:
            return []
        return [_elem(LOCALHOST_NODEPORT_REJECT_MAP, self.node_port_key(),
                      Verdict("goto", localhost_nodeport_reject_chain(self.proto)))]

    def all_entries(self) -> Iterator[tuple[str, Key]]:
        yield NO_ENDPOINT_SERVICES_MAP, self.destination(self.cip)
        for addr in self.externals():
            yield NO_ENDPOINT_SERVICES_MAP, self.destination(addr)
        if self.port.node_port:
            yield NO_ENDPOINT_NODEPORTS_MAP, self.node_port_key()

    def no_endpoints(self, verdict: Verdict, entries: Iterator[tuple[str, Key]],
                     ) -> Iterator[Item]:
        for container, key in entries:
            yield _elem(container, key, verdict)

    def internal_list(self) -> tuple[Endpoint, ...]:
        if self.port.internal_policy is TrafficPolicy.LOCAL:
            return self.sel.local or ()
        return self.sel.cluster or ()

    def external_is_local(self) -> bool:
        return self.sel.local is not None and self.port.external_policy is TrafficPolicy.LOCAL

    def picker(self) -> _Picker:
        if self._picker is None:
            self._picker = _Picker(self.cfg, self.proto, balancing_of(self.port), self.port)
        return self._picker

    def weighted(self, endpoints: Sequence[Endpoint]) -> tuple[Endpoint, ...]:
        """The endpoints map's slots for a list: weights and the algorithm decide how often
        each endpoint appears (Maglev: its consistent-hashing table)."""
        if (self.port.balancing is not Algorithm.MAGLEV and not self.port.endpoint_weights
                and all(ep.weight is None for ep in endpoints)):
            return tuple(endpoints)  # the common case: one slot per endpoint
        weights, _ = effective_weights(self.port, endpoints)
        return slots(endpoints, weights, self.port.balancing)

    def cluster_ip(self) -> list[Item]:
        endpoints = self.weighted(self.internal_list())
        if not endpoints:
            # iTP=Local without a local endpoint while others exist elsewhere: drop.
            return [_elem(NO_ENDPOINT_SERVICES_MAP, self.destination(self.cip), self.drop())]
        suffix, declared = self.own_map(len(endpoints), nodeport=False)
        if suffix:
            chain = _build_cluster_pick_chain(self.picker(), len(endpoints), suffix)
        else:
            chain = _cluster_pick_chain(self.picker(), len(endpoints))
        return [*declared, chain,
                _elem(SERVICE_IPS_MAP, self.destination(self.cip), self.goto(chain.container)),
                *self.slot_elements(_own_name(endpoints_map(self.proto), suffix),
                                    (self.cip, self.port.port), endpoints)]

    def own_map(self, slot_count: int, nodeport: bool) -> tuple[str, list[Item]]:
        """For a service port with OWN_MAP_SLOTS slots or more: the suffix of its own
        endpoints map (and pick chains), and the map's declaration (the ClusterIP and the
        external paths may both declare it: a Fragment keeps an item once). ("", []) for
        every other one: the shared maps."""
        if slot_count < OWN_MAP_SLOTS:
            return "", []
        suffix = _hash8(str(self.port.name))
        ip, proto = self.cfg.ip, self.proto
        if nodeport:
            name = _own_name(nodeport_endpoints_map(proto), suffix)
            declaration = _nodeport_endpoints_map_decl(ip, proto)
        else:
            name = _own_name(endpoints_map(proto), suffix)
            declaration = _endpoints_map_decl(ip, proto)
        return suffix, [_set(name, declaration)]

    def slot_elements(self, container: str, prefix: Key, slots: Sequence[Endpoint],
                      offset: int = 0) -> Sequence[Item]:
        """The endpoints map's element of each slot, from index `offset` on: key `prefix`
        and the index."""
        # the bulk of a full render: one element per slot
        if len(slots) >= OWN_MAP_SLOTS:
            return _big_list_elements(container, prefix, slots, offset)
        # prefix + (i,): half the cost of (*prefix, i), once per slot
        return [_new_tuple(Item, (_ELEMENT, container, prefix + (i,),  # noqa: RUF005
                                  (ep.ip, ep.port)))
                for i, ep in enumerate(slots, offset)]

    def external(self) -> Iterator[Item]:
        for addr in self.externals():
            yield from self.external_entry(
                SERVICE_IPS_MAP, self.destination(addr), NO_ENDPOINT_SERVICES_MAP,
                endpoints_map(self.proto), (addr, self.port.port), nodeport=False)

    def node_port(self) -> Iterator[Item]:
        if self.port.node_port:
            yield from self.external_entry(
                SERVICE_NODEPORTS_MAP, self.node_port_key(), NO_ENDPOINT_NODEPORTS_MAP,
                nodeport_endpoints_map(self.proto), (self.port.node_port,), nodeport=True)

    def external_entry(self, dispatch: str, key: Key, no_endpoints: str, container: str,
                       prefix: Key, nodeport: bool) -> Iterator[Item]:
        """`container`: the shared endpoints map the slots go in (or the service's own)."""
        cluster = self.weighted(self.sel.cluster or ())
        if not self.external_is_local():
            if not cluster:
                # Endpoints exist, but none for this node's cluster traffic (topology keys
                # matched none while iTP=Local keeps the service alive): reject, as when a
                # service has no endpoints.
                yield _elem(no_endpoints, key, self.goto(REJECT_CHAIN))
                return
            suffix, declared = self.own_map(len(cluster), nodeport)
            yield from declared
            chain = _external_pick_chain(self.picker(), len(cluster), 0, False, nodeport,
                                         suffix)
            yield chain
            yield _elem(dispatch, key, self.goto(chain.container))
            yield from self.slot_elements(_own_name(container, suffix), prefix, cluster)
            return
        local = self.weighted(self.sel.local or ())
        if not cluster and not local:
            yield _elem(no_endpoints, key, self.drop())
            return
        suffix, declared = self.own_map(len(cluster) + len(local), nodeport)
        yield from declared
        container = _own_name(container, suffix)
        chain = _external_pick_chain(self.picker(), len(cluster), len(local), True, nodeport,
                                     suffix)
        yield chain
        yield _elem(dispatch, key, self.goto(chain.container))
        yield from self.slot_elements(container, prefix, local)
        yield from self.slot_elements(container, prefix, cluster, offset=len(local))
        if not local:
            # Traffic from outside falls through the chain un-DNATed and is dropped here;
            # pod and host traffic was short-circuited to the cluster list before.
            yield _elem(no_endpoints, key, self.drop())

    def firewall(self) -> Iterator[Item]:
        # Overlapping ranges would be conflicting intervals in the set: collapse them. A
        # range covering everything is no firewall at all.
        ranges = _collapsed(self.port.source_ranges_of(self.cfg.family))
        vips = self.port.load_balancer_vips(self.cfg.family)
        if not ranges or not vips or any(r.endswith("/0") for r in ranges):
            return
        # If a range holds this node's address, the node may send from the VIP itself
        # (it is bound locally), so the VIPs are allowed too, as upstream does.
        allowed = list(ranges)
        nets = [ip_network(r) for r in ranges]
        if any(ip_address(n) in net for n in self.cfg.node_ips for net in nets
               if ip_address(n).version == net.version):
            # collapsed again: a VIP inside a range (VIPs from the node subnet) would be
            # an overlapping interval the kernel refuses
            allowed = list(_collapsed([*ranges, *vips]))
        for vip in vips:
            yield _elem(FIREWALL_IPS_SET, self.destination(vip))
            for source in allowed:
                yield _elem(FIREWALL_ALLOW_SET, (*self.destination(vip), source))


# The slot elements last rendered for each big list (OWN_MAP_SLOTS or more), by (container,
# prefix, offset): the list's slots and their elements. A change of one endpoint of a
# 5,000-endpoint service leaves almost every slot holding the very Endpoint object it held
# (the cache keeps the objects of the slices that did not change, keep_slots their slots),
# and such a slot's element is the one rendered before: reused, not formatted again (two
# strings and a tuple, most of re-rendering such a service). The identity check makes a
# stale or foreign entry harmless: an element is reused only for the same object at the same
# index of the same list. Bounded by elements (a tuple each, ~100 bytes with the list's
# share: their strings are the ones the store keeps), oldest list dropped first. No port of
# fewer than OWN_MAP_SLOTS endpoints is kept, so a table without big services keeps nothing.
# The live CLI's handlers render too, in their own threads: the bookkeeping is single dict
# operations (each atomic under the GIL) on snapshots, so no lock is needed (nor allowed in
# this pure module).
_BIG_LIST_ELEMENTS: dict[tuple[str, Key, int], tuple[Sequence[Endpoint], tuple[Item, ...]]] = {}
BIG_LIST_ELEMENTS_KEPT = 100_000


def _big_list_elements(container: str, prefix: Key, slots: Sequence[Endpoint],
                       offset: int) -> tuple[Item, ...]:
    key = (container, prefix, offset)
    last = _BIG_LIST_ELEMENTS.get(key)
    if last is None:
        items = tuple([_new_tuple(Item, (_ELEMENT, container, prefix + (i,),  # noqa: RUF005
                                         (ep.ip, ep.port)))
                       for i, ep in enumerate(slots, offset)])
    else:
        before, rendered = last
        size = len(before)
        items = tuple([
            rendered[i - offset] if i - offset < size and before[i - offset] is ep
            else _new_tuple(Item, (_ELEMENT, container, prefix + (i,),  # noqa: RUF005
                                   (ep.ip, ep.port)))
            for i, ep in enumerate(slots, offset)])
    if len(items) <= BIG_LIST_ELEMENTS_KEPT:
        _BIG_LIST_ELEMENTS.pop(key, None)
        _BIG_LIST_ELEMENTS[key] = (slots, items)  # (re)inserted last: the newest
        entries = list(_BIG_LIST_ELEMENTS.items())  # oldest first
        kept = sum(len(entry[1]) for _, entry in entries)
        for old, (_, dropped) in entries:
            if kept <= BIG_LIST_ELEMENTS_KEPT:
                break
            _BIG_LIST_ELEMENTS.pop(old, None)
            kept -= len(dropped)
    return items


def _collapsed(ranges: Sequence[str]) -> tuple[str, ...]:
    """CIDRs of one family without overlaps (the interval set refuses overlapping ones)."""
    nets: list[Any] = [ip_network(r) for r in ranges]
    # A single address is written (and printed back by nft) without its /32 or /128.
    return tuple(str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n)
                 for n in collapse_addresses(nets))


def _masquerade(cfg: RenderConfig) -> str:
    return f"meta mark set meta mark | {cfg.mark}"


@dataclass(frozen=True)
class _Picker:
    """How a pick chain draws the index into the endpoints map."""

    cfg: RenderConfig
    proto: str
    balancing: Balancing
    # Round robin's chains are per service (named after it); the others ignore the port.
    port: ServicePort | None

    def index(self, count: int, offset: int) -> str:
        """An index in offset..offset+count-1, per the algorithm."""
        ip, alg, off = self.cfg.ip, self.balancing.algorithm, f" offset {offset}" if offset else ""
        seed = f" seed 0x{self.balancing.seed:08x}"
        if alg is Algorithm.ROUND_ROBIN:
            return f"numgen inc mod {count}{off}"
        if alg is Algorithm.SOURCE_HASH:
            return f"jhash {ip} saddr mod {count}{seed}{off}"
        if alg is Algorithm.MAGLEV:
            return f"jhash {ip} saddr . {self.proto} sport mod {count}{seed}{off}"
        return f"numgen random mod {count}{off}"

    def dnat(self, count: int, offset: int, nodeport: bool, suffix: str = "") -> str:
        """`suffix`: that of the service's own endpoints map (OWN_MAP_SLOTS)."""
        ip, proto = self.cfg.ip, self.proto
        if nodeport:
            key, container = f"{proto} dport", nodeport_endpoints_map(proto)
        else:
            key, container = f"{ip} daddr . {proto} dport", endpoints_map(proto)
        container = _own_name(container, suffix)
        return f"dnat {ip} to {key} . {self.index(count, offset)} map @{container}"

    def chain_name(self, base: str) -> str:
        """Random keeps the plain shared name; hashing shares chains per seed; round robin's
        `numgen inc` counter lives in its rule, so each service gets its own chain."""
        alg = self.balancing.algorithm
        if alg is Algorithm.ROUND_ROBIN:
            assert self.port is not None, "a round-robin chain is named after its service"
            return f"{base}-rr-{service_base_name(self.port)}"[:250]
        if alg is Algorithm.SOURCE_HASH:
            return f"{base}-sh-{self.balancing.seed:08x}"
        if alg is Algorithm.MAGLEV:
            return f"{base}-mh-{self.balancing.seed:08x}"
        return base


def _cluster_pick_chain(picker: _Picker, count: int) -> Item:
    if picker.balancing.algorithm is Algorithm.ROUND_ROBIN:
        return _build_cluster_pick_chain(picker, count)
    return _shared_cluster_pick_chain(picker.cfg, picker.proto, picker.balancing, count)


@functools.lru_cache(maxsize=1024)
def _shared_cluster_pick_chain(cfg: RenderConfig, proto: str, balancing: Balancing,
                               count: int) -> Item:
    # Thousands of services share each of these chains: build it once, not per service.
    return _build_cluster_pick_chain(_Picker(cfg, proto, balancing, None), count)


def _build_cluster_pick_chain(picker: _Picker, count: int, suffix: str = "") -> Item:
    """`suffix`: that of the service's own endpoints map: the chain is its own too."""
    cfg, proto = picker.cfg, picker.proto
    name = picker.chain_name(_own_name(f"cluster-{proto}-{count}", suffix))
    rules = []
    if cfg.masquerade_all:
        rules.append(_masquerade(cfg))
    else:
        # Sources outside the cluster (a static route to the service CIDR, the node itself)
        # are masqueraded so that replies come back through this node.
        not_local = cfg.local_match(negate=True)
        if not_local:
            rules.append(f"{not_local} {_masquerade(cfg)}")
    rules.append(picker.dnat(count, 0, nodeport=False, suffix=suffix))
    return _chain(name, rules)


def _own_name(name: str, suffix: str) -> str:
    """A shared map's or pick chain's name, or that of a service's own (OWN_MAP_SLOTS)."""
    return f"{name}-{suffix}" if suffix else name


def _external_pick_chain(picker: _Picker, cluster: int, local: int, is_local: bool,
                         nodeport: bool, suffix: str = "") -> Item:
    """`suffix`: that of the service's own endpoints map: the chain is its own too."""
    cfg, proto = picker.cfg, picker.proto
    kind = "nodeport" if nodeport else "external"
    if not is_local:
        # externalTrafficPolicy: Cluster: always masqueraded (the endpoint may be elsewhere).
        return _chain(picker.chain_name(_own_name(f"{kind}-{proto}-{cluster}", suffix)),
                      (_masquerade(cfg), picker.dnat(cluster, 0, nodeport, suffix)))
    rules = []
    if cluster:
        to_cluster = picker.dnat(cluster, local, nodeport, suffix)
        local_pods = cfg.local_match()
        if local_pods:
            # Pod traffic to an external address behaves as if it left and came back:
            # short-circuit it to the cluster list, unmasqueraded.
            rules.append(f"{local_pods} {to_cluster}")
        # Host processes would otherwise use the VIP as source: masquerade, then cluster list.
        rules.append(f"fib saddr type local {_masquerade(cfg)} {to_cluster}")
    if local:
        rules.append(picker.dnat(local, 0, nodeport, suffix))
    name = _own_name(f"{kind}-local-{proto}-{local}-{cluster}", suffix)
    return _chain(picker.chain_name(name), rules)


# ---------------------------------------------------------------------------------------------
# Session affinity: upstream's per-service layout


def _hash8(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:8]


# nft names are at most 256 bytes; leave room for the longest prefix, as upstream does.
_MAX_BASE_NAME = 240


def _named(raw: str) -> str:
    name = f"{_hash8(raw)}-{raw}"
    return name if len(name) <= _MAX_BASE_NAME else name[: _MAX_BASE_NAME - 3] + "..."


def service_base_name(port: ServicePort) -> str:
    """`HASH-ns/name/proto/port` as upstream names per-service chains ('/' cannot occur in
    Kubernetes names, so these never collide with static chains)."""
    raw = f"{port.name.namespace}/{port.name.name}/{port.protocol.lower()}/{port.name.port}"
    return _named(raw)


def endpoint_base_name(port: ServicePort, ep: Endpoint) -> str:
    raw = (f"{port.name.namespace}/{port.name.name}/{port.protocol.lower()}/{port.name.port}"
           f"__{ep.ip.replace(':', '.')}/{ep.port}")
    return _named(raw)


def affinity_set_name(port: ServicePort, ep: Endpoint) -> str:
    # The timeout is part of the hash: a set's timeout cannot change in place, so a new
    # timeout makes a new set (and the old one goes with the rules that used it).
    base = endpoint_base_name(port, ep)
    return f"affinity-{_hash8(f'{base}/{port.affinity_timeout}')}-{base.split('-', 1)[1]}"


@dataclass
class _AffinityRender:
    svc: _ServiceRender

    def chain(self, prefix: str) -> str:
        return f"{prefix}-{service_base_name(self.svc.port)}"

    def items(self) -> Iterator[Item]:
        svc = self.svc
        internal = self.chain("local" if svc.port.internal_policy is TrafficPolicy.LOCAL
                              else "service")
        if svc.sel.cluster is not None:
            yield from self.policy_chain(self.chain("service"), svc.sel.cluster,
                                         internal == self.chain("service"))
        if svc.sel.local is not None:
            yield from self.policy_chain(self.chain("local"), svc.sel.local,
                                         internal == self.chain("local"))
        if svc.internal_list():
            yield _elem(SERVICE_IPS_MAP, svc.destination(svc.cip), svc.goto(internal))
        else:
            yield _elem(NO_ENDPOINT_SERVICES_MAP, svc.destination(svc.cip), svc.drop())
        if not svc.externals() and not svc.port.node_port:
            return
        external = self.chain("external")
        yield _chain(external, self.external_rules())
        for addr in svc.externals():
            yield _elem(SERVICE_IPS_MAP, svc.destination(addr), svc.goto(external))
            if svc.external_is_local() and not svc.sel.local:
                yield _elem(NO_ENDPOINT_SERVICES_MAP, svc.destination(addr), svc.drop())
        if svc.port.node_port:
            key = svc.node_port_key()
            yield _elem(SERVICE_NODEPORTS_MAP, key, svc.goto(external))
            if svc.external_is_local() and not svc.sel.local:
                yield _elem(NO_ENDPOINT_NODEPORTS_MAP, key, svc.drop())

    def external_rules(self) -> list[str]:
        svc, cfg = self.svc, self.svc.cfg
        to_cluster = f"goto {self.chain('service')}"
        if not svc.external_is_local():
            return [_masquerade(cfg), to_cluster]
        rules = []
        local_pods = cfg.local_match()
        if local_pods:
            rules.append(f"{local_pods} {to_cluster}")
        rules.append(f"fib saddr type local {_masquerade(cfg)}")
        rules.append(f"fib saddr type local {to_cluster}")
        if svc.sel.local:
            rules.append(f"goto {self.chain('local')}")
        return rules

    def policy_chain(self, name: str, endpoints: Sequence[Endpoint],
                     internal: bool) -> Iterator[Item]:
        svc, cfg = self.svc, self.svc.cfg
        ip, proto = cfg.ip, svc.proto
        rules = []
        if internal:
            entry = f"{ip} daddr {svc.cip} {proto} dport {svc.port.port}"
            if cfg.masquerade_all:
                rules.append(f"{entry} {_masquerade(cfg)}")
            elif cfg.local_match(negate=True):
                rules.append(f"{entry} {cfg.local_match(negate=True)} {_masquerade(cfg)}")
        sets: dict[str, str] = {}
        for ep in endpoints:
            aff = affinity_set_name(svc.port, ep)
            sets[ep.key] = aff
            yield _set(aff, SetDecl((cfg.addr_type,), flags=("dynamic", "timeout"),
                                    timeout=svc.port.affinity_timeout))
            # Every endpoint, drained ones too: a returning client keeps its endpoint, and
            # renews its element, so the timeout is the time it may stay away (kube-proxy's
            # endpoint chains `update` on every connection, new or returning).
            rules.append(f"{ip} saddr @{aff} update @{aff} {{ {ip} saddr }} "
                         f"{_dnat_to(cfg, proto, ep)}")
        # New clients: a cascade over the weighted slots (hashing algorithms would fight the
        # affinity sets, so with affinity only the weights apply).
        weights, _ = effective_weights(svc.port, endpoints)
        choices = weighted_slots(endpoints, weights)
        n = len(choices)
        for j, ep in enumerate(choices):
            choose = f"numgen random mod {n - j} == 0 " if j < n - 1 else ""
            rules.append(f"{choose}update @{sets[ep.key]} {{ {ip} saddr }} "
                         f"{_dnat_to(cfg, proto, ep)}")
        yield _chain(name, rules)


def _dnat_to(cfg: RenderConfig, proto: str, ep: Endpoint) -> str:
    target = f"[{ep.ip}]:{ep.port}" if cfg.family is IPFamily.IPv6 else f"{ep.ip}:{ep.port}"
    return f"meta l4proto {proto} dnat {cfg.ip} to {target}"
