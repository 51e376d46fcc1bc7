"""What every table holds whatever the Services (the skeleton: base chains, the fixed sets,
maps and chains, the localhost NodePort rejects, the connection counters), the render
configuration one family's rendering reads (`RenderConfig`), and the item constructors the
renderer builds with. Pure."""

from __future__ import annotations

import base64
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import collapse_addresses, ip_network
from typing import Any

from pyproxy.core.model import (
    Endpoint,
    IPFamily,
    LocalMode,
    ServicePort,
    ip_family,
)
from pyproxy.core.nodeconfig import LocalhostNodePorts, NodeConfig
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
    Masquerade,
    Rule,
    Rules,
    SetDecl,
    SetRef,
    Source,
    SourceMatch,
    Statement,
    Verdict,
    connections_set,
    endpoints_map,
    localhost_nodeport_reject_chain,
    nodeport_endpoints_map,
    rule,
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

    def local_match(self, negate: bool = False) -> SourceMatch | None:
        """The nft match for "comes from a local pod" (or its negation), or None when no
        detector is configured. Interface modes use iifname: `iif` resolves names at load
        time and fails for absent interfaces and wildcards (kubernetes#134024)."""
        op, source = ("!= ", Source.NOT_LOCAL_POD) if negate else ("", Source.LOCAL_POD)
        if self.local_mode in (LocalMode.CLUSTER_CIDR, LocalMode.NODE_CIDR) and self.local_value:
            return SourceMatch(source, f"{self.ip} saddr {op}{self.local_value}")
        if self.local_mode is LocalMode.BRIDGE_INTERFACE and self.local_value:
            return SourceMatch(source, f'iifname {op}"{self.local_value}"')
        if self.local_mode is LocalMode.INTERFACE_NAME_PREFIX and self.local_value:
            return SourceMatch(source, f'iifname {op}"{self.local_value}*"')
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


def endpoints_map_decl(ip: str, proto: str) -> SetDecl:
    return SetDecl((f"{ip} daddr", f"{proto} dport", "numgen random mod 1"),
                   (f"{ip} daddr", f"{proto} dport"), typeof=True)


def nodeport_endpoints_map_decl(ip: str, proto: str) -> SetDecl:
    return SetDecl((f"{proto} dport", "numgen random mod 1"), (f"{ip} daddr", f"{proto} dport"),
                   typeof=True)


# ---------------------------------------------------------------------------------------------
# Item constructors (the types: objects.py)


def set_item(name: str, declaration: SetDecl) -> Item:
    return Item(Kind.SET, name, "", declaration)


def chain_item(name: str, rules: Sequence[Rule]) -> Item:
    return Item(Kind.CHAIN, name, "", tuple(rules))


# Item(...) goes through the NamedTuple's Python-level __new__; building the tuple directly
# halves the cost, which counts at a few hundred thousand elements per full render.
new_tuple: Callable[[type[Item], tuple[Kind, str, Key, ElementValue]], Item] = (
    tuple.__new__)
ELEMENT = Kind.ELEMENT
# The same for a verdict: one per service port and address.
new_verdict: Callable[[type[Verdict], tuple[str, str, str]], Verdict] = tuple.__new__


def element_item(container: str, key: Key, value: ElementValue = ()) -> Item:
    return new_tuple(Item, (ELEMENT, container, key, value))


def skeleton(cfg: RenderConfig, service_cidrs: Sequence[str] = ()) -> Fragment:
    """The static part: sets and maps, and the chains every ruleset has. `service_cidrs`
    (of any family; from the ServiceCIDR objects) fill `service-cidrs`."""
    ip, addr = cfg.ip, cfg.addr_type
    destination = (addr, "inet_proto", "inet_service")  # the type of `destination()`
    node_port = ("inet_proto", "inet_service")
    items = [
        set_item(CLUSTER_IPS_SET, SetDecl((addr,), comment="Active ClusterIPs")),
        set_item(HAIRPIN_SET, SetDecl((addr, addr), comment="endpoint . itself, for hairpin")),
        set_item(SERVICE_CIDRS_SET, SetDecl((addr,), flags=("interval",), comment="ServiceCIDRs")),
        set_item(FIREWALL_IPS_SET, SetDecl(destination, comment="destinations with source ranges")),
        set_item(FIREWALL_ALLOW_SET, SetDecl((*destination, addr), flags=("interval",),
                                         comment="allowed sources per destination")),
        set_item(SERVICE_IPS_MAP, SetDecl(destination, VERDICT, comment="ClusterIP, ExternalIP and "
                                      "LoadBalancer IP traffic")),
        set_item(SERVICE_NODEPORTS_MAP, SetDecl(node_port, VERDICT, comment="NodePort traffic")),
        set_item(NO_ENDPOINT_SERVICES_MAP, SetDecl(destination, VERDICT, comment="services without "
                                               "usable endpoints: reject or drop")),
        set_item(NO_ENDPOINT_NODEPORTS_MAP, SetDecl(node_port, VERDICT, comment="nodeports without "
                                                "usable endpoints: reject or drop")),
    ]
    for proto in PROTOCOLS:
        items.append(set_item(endpoints_map(proto), endpoints_map_decl(ip, proto)))
        items.append(set_item(nodeport_endpoints_map(proto),
                              nodeport_endpoints_map_decl(ip, proto)))
    items.extend(element_item(SERVICE_CIDRS_SET, (cidr,))
                 for cidr in collapsed([c for c in service_cidrs if ip_family(c) is cfg.family]))
    if cfg.nodeport_ips is not None:
        items.append(set_item(NODEPORT_IPS_SET, SetDecl((addr,),
                                                    comment="IPs that accept NodePort traffic")))
        items.extend(element_item(NODEPORT_IPS_SET, (ip_,)) for ip_ in cfg.nodeport_ips)
        nodeport_match: tuple[Statement, ...] = (f"{ip} daddr", SetRef(NODEPORT_IPS_SET))
    else:
        nodeport_match = (f"fib daddr type local {ip} daddr != {cfg.loopback}",)
    by_destination = f"{ip} daddr . meta l4proto . th dport"
    items += [
        chain_item(SERVICES_CHAIN, (
            rule(by_destination, "vmap", SetRef(SERVICE_IPS_MAP)),
            rule(*nodeport_match, "meta l4proto . th dport vmap", SetRef(SERVICE_NODEPORTS_MAP)),
        )),
        chain_item(SERVICE_ENDPOINTS_CHECK, (
            rule(by_destination, "vmap", SetRef(NO_ENDPOINT_SERVICES_MAP)),)),
        chain_item(NODEPORT_ENDPOINTS_CHECK, (
            rule(*nodeport_match, "meta l4proto . th dport vmap",
                 SetRef(NO_ENDPOINT_NODEPORTS_MAP)),
            *_localhost_nodeport_check(cfg))),
        chain_item(FIREWALL_CHECK, (
            rule(by_destination, SetRef(FIREWALL_IPS_SET), f"{by_destination} . {ip} saddr !=",
                 SetRef(FIREWALL_ALLOW_SET), "drop"),)),
        # Only traffic that no service DNATed gets here (forward, and output after nat).
        chain_item(CLUSTER_IPS_CHECK, (
            rule(f"{ip} daddr", SetRef(CLUSTER_IPS_SET),
                 'reject comment "invalid port of a ClusterIP"'),
            # An address of a ServiceCIDR that is no ClusterIP would otherwise be routed on
            # (often out of the default route). Empty set (no ServiceCIDR known): no match.
            rule(f"{ip} daddr", SetRef(SERVICE_CIDRS_SET), 'drop comment "unallocated ClusterIP"'),
        )),
        # Only a connection's first packet gets here (`ct state new`). A TCP one without SYN
        # is a connection conntrack lost, its endpoint gone (fast failure deleted the
        # entry, core/departed.py) and none left: an ICMP error would be a soft error to
        # an established socket, which retransmits until TCP gives up; a reset ends it.
        chain_item(REJECT_CHAIN, (rule("tcp flags & syn == 0 reject with tcp reset"),
                                  rule("reject"))),
        chain_item(MASQUERADING_CHAIN, (
            # Hairpin: an endpoint reaching itself through its service must be masqueraded,
            # or it would answer itself directly and the connection would not match.
            rule(f"ct status dnat {ip} saddr . {ip} daddr", SetRef(HAIRPIN_SET), masquerade(cfg)),
            rule(f"meta mark & {cfg.mark} == 0 return"),
            # Clear the bit so it does not leak into later processing.
            rule(f"meta mark set meta mark ^ {cfg.mark}"),
            rule("masquerade fully-random"),
        )),
        *_connection_counting(cfg),
        *_localhost_nodeport_rejects(cfg),
    ]
    return Fragment(tuple(items))


def _localhost_nodeport_check(cfg: RenderConfig) -> Rules:
    """In nodeport-endpoints-check (filter input: a connection from this node to itself
    passes there, DNATed by nobody since loopback is never a NodePort address): a localhost
    NodePort of a rejected protocol goes to that protocol's reject chain."""
    if not cfg.localhost_rejected:
        return ()
    return (rule(f"{cfg.ip} daddr {cfg.loopback} meta l4proto . th dport vmap",
                 SetRef(LOCALHOST_NODEPORT_REJECT_MAP)),)


def _localhost_nodeport_rejects(cfg: RenderConfig) -> tuple[Item, ...]:
    """The map, and a chain per rejected protocol whose rule counts and rejects. kube-proxy
    counts in named counters; an anonymous counter in the chain's rule does the same here
    (a full sync rewrites the chain and starts it from zero: metrics.py banks it)."""
    if not cfg.localhost_rejected:
        return ()
    return (
        set_item(LOCALHOST_NODEPORT_REJECT_MAP, SetDecl(("inet_proto", "inet_service"), VERDICT,
                                                    comment="localhost NodePorts rejected by "
                                                    "pyproxy")),
        *(chain_item(localhost_nodeport_reject_chain(proto), (rule("counter reject"),))
          for proto in cfg.localhost_rejected),
    )


@functools.lru_cache(maxsize=8)
def _connection_counting(cfg: RenderConfig) -> tuple[Item, ...]:
    """The counting chain and its sets (built once: every sync renders the skeleton). The
    chain exists without the feature too (empty): the base chains jump to it whatever the
    configuration."""
    if not cfg.count_connections:
        return (chain_item(COUNT_CONNECTIONS_CHAIN, ()),)
    ip, addr = cfg.ip, cfg.addr_type
    # Element keys: service address . protocol . service port (the node port for NodePorts)
    # . endpoint address . endpoint port. `dynamic`: filled by the packet path, never by a
    # sync, and never flushed by a full sync (which would reset the counters).
    declaration = SetDecl((addr, "inet_proto", "inet_service", addr, "inet_service"),
                          flags=("dynamic",), size=CONNECTION_SHARD_SIZE,
                          comment="new connections per service address and endpoint")
    items = [set_item(connections_set(shard), declaration) for shard in range(CONNECTION_SHARDS)]
    mask = "0.0.0.{}" if cfg.family is IPFamily.IPv4 else "::{:x}"
    key = (f"ct original {ip} daddr . meta l4proto . ct original proto-dst . {ip} daddr . "
           "th dport")
    # nft 1.0.6 types `ct original proto-dst` only when the rule names the protocol: one
    # rule per protocol and shard.
    rules = [rule(f"meta l4proto {proto} {ip} daddr & {mask.format(CONNECTION_SHARDS - 1)} == "
                  f"{mask.format(shard)} update", SetRef(connections_set(shard)),
                  f"{{ {key} counter }}")
             for proto in PROTOCOLS for shard in range(CONNECTION_SHARDS)]
    return (*items, chain_item(COUNT_CONNECTIONS_CHAIN, rules))


def collapsed(ranges: Sequence[str]) -> tuple[str, ...]:
    """CIDRs of one family without overlaps (the interval set refuses overlapping ones)."""
    nets: list[Any] = [ip_network(r) for r in ranges]
    # A single address is written (and printed back by nft) without its /32 or /128.
    return tuple(str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n)
                 for n in collapse_addresses(nets))


def masquerade(cfg: RenderConfig) -> Masquerade:
    return Masquerade(cfg.mark)


# ---------------------------------------------------------------------------------------------
# The names of a service port's own objects (upstream's: a hash, then the readable part)


def hash8(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:8]


# nft names are at most 256 bytes; leave room for the longest prefix, as upstream does.
_MAX_BASE_NAME = 240


def named_after(raw: str) -> str:
    name = f"{hash8(raw)}-{raw}"
    return name if len(name) <= _MAX_BASE_NAME else name[: _MAX_BASE_NAME - 3] + "..."


def service_base_name(port: ServicePort) -> str:
    """`HASH-ns/name/proto/port` as upstream names per-service chains ('/' cannot occur in
    Kubernetes names, so these never collide with static chains)."""
    raw = f"{port.name.namespace}/{port.name.name}/{port.protocol.lower()}/{port.name.port}"
    return named_after(raw)


def endpoint_base_name(port: ServicePort, ep: Endpoint) -> str:
    raw = (f"{port.name.namespace}/{port.name.name}/{port.protocol.lower()}/{port.name.port}"
           f"__{ep.ip.replace(':', '.')}/{ep.port}")
    return named_after(raw)


def affinity_set_name(port: ServicePort, ep: Endpoint) -> str:
    # The timeout is part of the hash: a set's timeout cannot change in place, so a new
    # timeout makes a new set (and the old one goes with the rules that used it).
    base = endpoint_base_name(port, ep)
    return f"affinity-{hash8(f'{base}/{port.affinity_timeout}')}-{base.split('-', 1)[1]}"
