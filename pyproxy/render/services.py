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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from ipaddress import ip_address, ip_network

from pyproxy.core.balancing import balancing_of, effective_weights, slots, weighted_slots
from pyproxy.core.least import LEAST, least_slots
from pyproxy.core.model import (
    Algorithm,
    Endpoint,
    ServicePort,
    TrafficPolicy,
)
from pyproxy.core.topology import Selection
from pyproxy.render.objects import (
    CLUSTER_IPS_SET,
    FIREWALL_ALLOW_SET,
    FIREWALL_IPS_SET,
    FROM_NODE,
    HAIRPIN_SET,
    LOCALHOST_NODEPORT_REJECT_MAP,
    NO_ENDPOINT_NODEPORTS_MAP,
    NO_ENDPOINT_SERVICES_MAP,
    REJECT_CHAIN,
    SERVICE_IPS_MAP,
    SERVICE_NODEPORTS_MAP,
    ClientOf,
    DnatTo,
    Fragment,
    Item,
    Key,
    Remember,
    Rule,
    SetDecl,
    Verdict,
    element_comment,
    endpoints_map,
    localhost_nodeport_reject_chain,
    nodeport_endpoints_map,
    rule,
)
from pyproxy.render.picks import (
    Picker,
    build_cluster_pick_chain,
    cluster_pick_chain,
    external_pick_chain,
    own_name,
)
from pyproxy.render.skeleton import (
    ELEMENT,
    RenderConfig,
    affinity_set_name,
    chain_item,
    collapsed,
    element_item,
    endpoints_map_decl,
    hash8,
    masquerade,
    new_tuple,
    new_verdict,
    nodeport_endpoints_map_decl,
    service_base_name,
    set_item,
)

# ---------------------------------------------------------------------------------------------
# Per service port

# A service port with at least this many slots keeps them in an endpoints map of its own.
# libnftables (1.0.6) reads every element of the map a new rule refers to before it takes
# the rule, and every endpoint count of such a service is a new pick chain: with the shared
# map of 100k elements that read was 7 ms of the 8 ms a new chain cost (1.7 ms with a small
# map), 35-40 ms with 250k elements.
OWN_MAP_SLOTS = 1000



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
        self._picker: Picker | None = None

    def goto(self, chain: str) -> Verdict:
        """A dispatch element's value: to `chain`, commented with the service's name."""
        return new_verdict(Verdict, ("goto", chain, self._comment))

    def drop(self) -> Verdict:
        return new_verdict(Verdict, ("drop", "", self._comment))

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
        out = [element_item(CLUSTER_IPS_SET, (self.cip,)), *self.localhost_node_port()]
        if self.port.source_ranges:
            out += self.firewall()
        if not self.sel.has_any_endpoints:
            out += self.no_endpoints(self.goto(REJECT_CHAIN), self.all_entries())
            return out
        # Only this node's endpoints, as kube-proxy's hairpin-connections set: a pod reaches
        # its own service through the node it runs on, never through another one. At 100
        # nodes that is 1 % of the elements the set would hold with every endpoint.
        node = self.cfg.node_name
        out += [new_tuple(Item, (ELEMENT, HAIRPIN_SET, (ep.ip, ep.ip), ()))
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
        return [element_item(LOCALHOST_NODEPORT_REJECT_MAP, self.node_port_key(),
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
            yield element_item(container, key, verdict)

    def internal_list(self) -> tuple[Endpoint, ...]:
        if self.port.internal_policy is TrafficPolicy.LOCAL:
            return self.sel.local or ()
        return self.sel.cluster or ()

    def external_is_local(self) -> bool:
        return self.sel.local is not None and self.port.external_policy is TrafficPolicy.LOCAL

    def picker(self) -> Picker:
        if self._picker is None:
            self._picker = Picker(self.cfg, self.proto, balancing_of(self.port), self.port)
        return self._picker

    def weighted(self, endpoints: Sequence[Endpoint]) -> tuple[Endpoint, ...]:
        """The endpoints map's slots for a list: weights and the algorithm decide how often
        each endpoint appears (Maglev: its consistent-hashing table)."""
        algorithm = self.port.balancing
        if (algorithm is Algorithm.RANDOM or algorithm is Algorithm.ROUND_ROBIN
                or algorithm is Algorithm.SOURCE_HASH) and not self.port.endpoint_weights \
                and not self.sel.outliers and all(ep.weight is None for ep in endpoints):
            return tuple(endpoints)  # the common case: one slot per endpoint
        weights, _ = effective_weights(self.port, endpoints, self.sel.outliers)
        if algorithm in LEAST:  # the slot table the connections in flight last set
            return least_slots(endpoints, weights, algorithm, self.sel.least)
        return slots(endpoints, weights, algorithm)

    def cluster_ip(self) -> list[Item]:
        endpoints = self.weighted(self.internal_list())
        if not endpoints:
            # iTP=Local without a local endpoint while others exist elsewhere: drop.
            return [element_item(NO_ENDPOINT_SERVICES_MAP, self.destination(self.cip), self.drop())]
        suffix, declared = self.own_map(len(endpoints), nodeport=False)
        if suffix:
            chain = build_cluster_pick_chain(self.picker(), len(endpoints), suffix)
        else:
            chain = cluster_pick_chain(self.picker(), len(endpoints))
        return [*declared, chain,
                element_item(SERVICE_IPS_MAP, self.destination(self.cip),
                             self.goto(chain.container)),
                *self.slot_elements(own_name(endpoints_map(self.proto), suffix),
                                    (self.cip, self.port.port), endpoints)]

    def own_map(self, slot_count: int, nodeport: bool) -> tuple[str, list[Item]]:
        """For a service port with OWN_MAP_SLOTS slots or more: the suffix of its own
        endpoints map (and pick chains), and the map's declaration (the ClusterIP and the
        external paths may both declare it: a Fragment keeps an item once). ("", []) for
        every other one: the shared maps."""
        if slot_count < OWN_MAP_SLOTS:
            return "", []
        suffix = hash8(str(self.port.name))
        ip, proto = self.cfg.ip, self.proto
        if nodeport:
            name = own_name(nodeport_endpoints_map(proto), suffix)
            declaration = nodeport_endpoints_map_decl(ip, proto)
        else:
            name = own_name(endpoints_map(proto), suffix)
            declaration = endpoints_map_decl(ip, proto)
        return suffix, [set_item(name, declaration)]

    def slot_elements(self, container: str, prefix: Key, slots: Sequence[Endpoint],
                      offset: int = 0) -> Sequence[Item]:
        """The endpoints map's element of each slot, from index `offset` on: key `prefix`
        and the index."""
        # the bulk of a full render: one element per slot
        if len(slots) >= OWN_MAP_SLOTS:
            return _big_list_elements(container, prefix, slots, offset)
        # prefix + (i,): half the cost of (*prefix, i), once per slot
        return [new_tuple(Item, (ELEMENT, container, prefix + (i,),  # noqa: RUF005
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
                yield element_item(no_endpoints, key, self.goto(REJECT_CHAIN))
                return
            suffix, declared = self.own_map(len(cluster), nodeport)
            yield from declared
            chain = external_pick_chain(self.picker(), len(cluster), 0, False, nodeport,
                                         suffix)
            yield chain
            yield element_item(dispatch, key, self.goto(chain.container))
            yield from self.slot_elements(own_name(container, suffix), prefix, cluster)
            return
        local = self.weighted(self.sel.local or ())
        if not cluster and not local:
            yield element_item(no_endpoints, key, self.drop())
            return
        suffix, declared = self.own_map(len(cluster) + len(local), nodeport)
        yield from declared
        container = own_name(container, suffix)
        chain = external_pick_chain(self.picker(), len(cluster), len(local), True, nodeport,
                                     suffix)
        yield chain
        yield element_item(dispatch, key, self.goto(chain.container))
        yield from self.slot_elements(container, prefix, local)
        yield from self.slot_elements(container, prefix, cluster, offset=len(local))
        if not local:
            # Traffic from outside falls through the chain un-DNATed and is dropped here;
            # pod and host traffic was short-circuited to the cluster list before.
            yield element_item(no_endpoints, key, self.drop())

    def firewall(self) -> Iterator[Item]:
        # Overlapping ranges would be conflicting intervals in the set: collapse them. A
        # range covering everything is no firewall at all.
        ranges = collapsed(self.port.source_ranges_of(self.cfg.family))
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
            allowed = list(collapsed([*ranges, *vips]))
        for vip in vips:
            yield element_item(FIREWALL_IPS_SET, self.destination(vip))
            for source in allowed:
                yield element_item(FIREWALL_ALLOW_SET, (*self.destination(vip), source))


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
        items = tuple([new_tuple(Item, (ELEMENT, container, prefix + (i,),  # noqa: RUF005
                                         (ep.ip, ep.port)))
                       for i, ep in enumerate(slots, offset)])
    else:
        before, rendered = last
        size = len(before)
        items = tuple([
            rendered[i - offset] if i - offset < size and before[i - offset] is ep
            else new_tuple(Item, (ELEMENT, container, prefix + (i,),  # noqa: RUF005
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


# ---------------------------------------------------------------------------------------------
# Session affinity: upstream's per-service layout


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
            yield element_item(SERVICE_IPS_MAP, svc.destination(svc.cip), svc.goto(internal))
        else:
            yield element_item(NO_ENDPOINT_SERVICES_MAP, svc.destination(svc.cip), svc.drop())
        if not svc.externals() and not svc.port.node_port:
            return
        external = self.chain("external")
        yield chain_item(external, self.external_rules())
        for addr in svc.externals():
            yield element_item(SERVICE_IPS_MAP, svc.destination(addr), svc.goto(external))
            if svc.external_is_local() and not svc.sel.local:
                yield element_item(NO_ENDPOINT_SERVICES_MAP, svc.destination(addr), svc.drop())
        if svc.port.node_port:
            key = svc.node_port_key()
            yield element_item(SERVICE_NODEPORTS_MAP, key, svc.goto(external))
            if svc.external_is_local() and not svc.sel.local:
                yield element_item(NO_ENDPOINT_NODEPORTS_MAP, key, svc.drop())

    def external_rules(self) -> list[Rule]:
        svc, cfg = self.svc, self.svc.cfg
        to_cluster = Verdict("goto", self.chain("service"))
        if not svc.external_is_local():
            return [rule(masquerade(cfg)), rule(to_cluster)]
        rules = []
        local_pods = cfg.local_match()
        if local_pods:
            rules.append(rule(local_pods, to_cluster))
        rules.append(rule(FROM_NODE, masquerade(cfg)))
        rules.append(rule(FROM_NODE, to_cluster))
        if svc.sel.local:
            rules.append(rule(Verdict("goto", self.chain("local"))))
        return rules

    def policy_chain(self, name: str, endpoints: Sequence[Endpoint],
                     internal: bool) -> Iterator[Item]:
        svc, cfg = self.svc, self.svc.cfg
        ip, proto = cfg.ip, svc.proto
        rules = []
        if internal:
            entry = f"{ip} daddr {svc.cip} {proto} dport {svc.port.port}"
            not_local = cfg.local_match(negate=True)
            if cfg.masquerade_all:
                rules.append(rule(entry, masquerade(cfg)))
            elif not_local:
                rules.append(rule(entry, not_local, masquerade(cfg)))
        sets: dict[str, str] = {}
        for ep in endpoints:
            aff = affinity_set_name(svc.port, ep)
            sets[ep.key] = aff
            yield set_item(aff, SetDecl((cfg.addr_type,), flags=("dynamic", "timeout"),
                                    timeout=svc.port.affinity_timeout))
            # Every endpoint, drained ones too: a returning client keeps its endpoint, and
            # renews its element, so the timeout is the time it may stay away (kube-proxy's
            # endpoint chains `update` on every connection, new or returning). Not one
            # outlier ejection took out: it fails its connections, so its clients are placed
            # anew (and remembered for the endpoint they get).
            if not (svc.sel.outliers and ep.key in svc.sel.outliers.ejected):
                rules.append(rule(ClientOf(ip, aff), Remember(ip, aff),
                                  _dnat_to(cfg, proto, ep)))
        # New clients: a cascade over the weighted slots (hashing algorithms would fight the
        # affinity sets, so with affinity only the weights apply).
        weights, _ = effective_weights(svc.port, endpoints, svc.sel.outliers)
        choices = weighted_slots(endpoints, weights)
        n = len(choices)
        for j, ep in enumerate(choices):
            choose = (f"numgen random mod {n - j} == 0",) if j < n - 1 else ()
            rules.append(rule(*choose, Remember(ip, sets[ep.key]), _dnat_to(cfg, proto, ep)))
        yield chain_item(name, rules)


def _dnat_to(cfg: RenderConfig, proto: str, ep: Endpoint) -> DnatTo:
    return DnatTo(cfg.ip, proto, ep.ip, ep.port)
