"""The pick chains: how a service port's new connection chooses its endpoint's slot (numgen
random, round robin, weights, source hash, Maglev), shared between service ports of the same
shape, or a big port's own. Pure."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pyproxy.core.balancing import Balancing
from pyproxy.core.model import (
    Algorithm,
    ServicePort,
)
from pyproxy.render.objects import (
    FROM_NODE,
    Draw,
    Item,
    PickDnat,
    endpoints_map,
    nodeport_endpoints_map,
    rule,
)
from pyproxy.render.skeleton import (
    RenderConfig,
    chain_item,
    masquerade,
    service_base_name,
)


@dataclass(frozen=True)
class Picker:
    """How a pick chain draws the index into the endpoints map."""

    cfg: RenderConfig
    proto: str
    balancing: Balancing
    # Round robin's chains are per service (named after it); the others ignore the port.
    port: ServicePort | None

    def dnat(self, count: int, offset: int, nodeport: bool, suffix: str = "") -> PickDnat:
        """DNAT to one of `count` slots from `offset` on, the index drawn per the algorithm.
        `suffix`: that of the service's own endpoints map (OWN_MAP_SLOTS)."""
        ip, proto, alg = self.cfg.ip, self.proto, self.balancing.algorithm
        if nodeport:
            key, container = f"{proto} dport", nodeport_endpoints_map(proto)
        else:
            key, container = f"{ip} daddr . {proto} dport", endpoints_map(proto)
        pick = PickDnat(ip, key, Draw.RANDOM, count, own_name(container, suffix), offset)
        if alg is Algorithm.ROUND_ROBIN:
            return pick._replace(draw=Draw.ROUND_ROBIN)
        if alg is Algorithm.SOURCE_HASH:
            return pick._replace(draw=Draw.HASH, hashed=f"{ip} saddr", seed=self.balancing.seed)
        if alg is Algorithm.MAGLEV:
            return pick._replace(draw=Draw.HASH, hashed=f"{ip} saddr . {proto} sport",
                                 seed=self.balancing.seed)
        return pick

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


def cluster_pick_chain(picker: Picker, count: int) -> Item:
    if picker.balancing.algorithm is Algorithm.ROUND_ROBIN:
        return build_cluster_pick_chain(picker, count)
    return shared_cluster_pick_chain(picker.cfg, picker.proto, picker.balancing, count)


@functools.lru_cache(maxsize=1024)
def shared_cluster_pick_chain(cfg: RenderConfig, proto: str, balancing: Balancing,
                               count: int) -> Item:
    # Thousands of services share each of these chains: build it once, not per service.
    return build_cluster_pick_chain(Picker(cfg, proto, balancing, None), count)


def build_cluster_pick_chain(picker: Picker, count: int, suffix: str = "") -> Item:
    """`suffix`: that of the service's own endpoints map: the chain is its own too."""
    cfg, proto = picker.cfg, picker.proto
    name = picker.chain_name(own_name(f"cluster-{proto}-{count}", suffix))
    rules = []
    if cfg.masquerade_all:
        rules.append(rule(masquerade(cfg)))
    else:
        # Sources outside the cluster (a static route to the service CIDR, the node itself)
        # are masqueraded so that replies come back through this node.
        not_local = cfg.local_match(negate=True)
        if not_local:
            rules.append(rule(not_local, masquerade(cfg)))
    rules.append(rule(picker.dnat(count, 0, nodeport=False, suffix=suffix)))
    return chain_item(name, rules)


def own_name(name: str, suffix: str) -> str:
    """A shared map's or pick chain's name, or that of a service's own (OWN_MAP_SLOTS)."""
    return f"{name}-{suffix}" if suffix else name


def external_pick_chain(picker: Picker, cluster: int, local: int, is_local: bool,
                         nodeport: bool, suffix: str = "") -> Item:
    """`suffix`: that of the service's own endpoints map: the chain is its own too."""
    cfg, proto = picker.cfg, picker.proto
    kind = "nodeport" if nodeport else "external"
    if not is_local:
        # externalTrafficPolicy: Cluster: always masqueraded (the endpoint may be elsewhere).
        return chain_item(picker.chain_name(own_name(f"{kind}-{proto}-{cluster}", suffix)),
                          (rule(masquerade(cfg)), rule(picker.dnat(cluster, 0, nodeport, suffix))))
    rules = []
    if cluster:
        to_cluster = picker.dnat(cluster, local, nodeport, suffix)
        local_pods = cfg.local_match()
        if local_pods:
            # Pod traffic to an external address behaves as if it left and came back:
            # short-circuit it to the cluster list, unmasqueraded.
            rules.append(rule(local_pods, to_cluster))
        # Host processes would otherwise use the VIP as source: masquerade, then cluster list.
        rules.append(rule(FROM_NODE, masquerade(cfg), to_cluster))
    if local:
        rules.append(rule(picker.dnat(local, 0, nodeport, suffix)))
    name = own_name(f"{kind}-local-{proto}-{local}-{cluster}", suffix)
    return chain_item(picker.chain_name(name), rules)
