"""Endpoint selection for this node: traffic policies, terminating fallback, topology hints and
topology keys. One pure function, `select_endpoints`, like upstream's CategorizeEndpoints, plus a
human-readable trace of every decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pyproxy.model import (
    LABEL_HOSTNAME,
    LABEL_ZONE,
    TOPOLOGY_KEY_ANY,
    Endpoint,
    IPFamily,
    Node,
    ServicePort,
    TrafficPolicy,
)

TOPOLOGY_NONE = "None"
PREFER_SAME_NODE = "PreferSameNode"
PREFER_SAME_ZONE = "PreferSameZone"
TOPOLOGY_KEYS_PREFIX = "TopologyKeys:"

NodeLabels = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True, slots=True)
class Selection:
    """The endpoints one service port uses on this node, for one IP family.

    `cluster` is None when the service does not use a cluster-wide list (iTP=Local on a service
    nobody reaches from outside); `local` is None when it does not use a node-local list. An
    empty tuple means "used, and empty". `all_reachable` is every endpoint some rule on this
    node may send traffic to. `has_any_endpoints` is false when a connection must be rejected
    (as opposed to dropped for a Local policy without local endpoints).
    """

    family: IPFamily
    cluster: tuple[Endpoint, ...] | None
    local: tuple[Endpoint, ...] | None
    all_reachable: tuple[Endpoint, ...]
    has_any_endpoints: bool
    topology: str
    reasons: tuple[str, ...]


def select_endpoints(
    port: ServicePort,
    family: IPFamily,
    endpoints: Sequence[Endpoint],
    node: Node,
    node_labels: NodeLabels | None = None,
) -> Selection:
    """Which of `endpoints` (all of this port and family, from the merged slices) this node
    uses for cluster and local traffic. `node_labels` maps other nodes' names to their labels,
    needed only by topology keys."""
    reasons: list[str] = []
    note = reasons.append
    _note_policies(port, family, note)
    if not endpoints:
        note("no endpoints in any EndpointSlice: connections are rejected")
        used_cluster = port.uses_cluster_endpoints(family)
        used_local = port.uses_local_endpoints(family)
        return Selection(
            family, () if used_cluster else None, () if used_local else None, (), False,
            TOPOLOGY_NONE, tuple(reasons),
        )

    topology = TOPOLOGY_NONE
    cluster: tuple[Endpoint, ...] | None = None
    has_any = False
    if port.uses_cluster_endpoints(family):
        cluster, topology = _cluster_endpoints(port, endpoints, node, node_labels or {}, note)
        has_any = bool(cluster)

    if not port.uses_local_endpoints(family):
        assert cluster is not None
        return Selection(family, cluster, None, cluster, has_any, topology, tuple(reasons))

    local, local_is_fallback, anywhere = _local_endpoints(endpoints, node.name, note)
    has_any = has_any or anywhere
    if cluster is None:
        return Selection(family, None, local, local, has_any, topology, tuple(reasons))
    if topology == TOPOLOGY_NONE and not local_is_fallback:
        # The cluster list then holds every ready endpoint, a superset of the local one.
        reachable = cluster
    else:
        reachable = _union(cluster, local)
    return Selection(family, cluster, local, reachable, has_any, topology, tuple(reasons))


def _note_policies(port: ServicePort, family: IPFamily, note: Callable[[str], None]) -> None:
    if port.internal_policy is TrafficPolicy.LOCAL:
        note("internalTrafficPolicy: Local: cluster-IP traffic uses endpoints on this node only")
    if port.external_policy is TrafficPolicy.LOCAL and port.externally_accessible(family):
        note(
            "externalTrafficPolicy: Local: external traffic uses endpoints on this node only "
            "(client IP preserved); pod and host traffic to external addresses uses the "
            "cluster list"
        )


# ---------------------------------------------------------------------------------------------
# The cluster list


def _cluster_endpoints(
    port: ServicePort,
    endpoints: Sequence[Endpoint],
    node: Node,
    node_labels: NodeLabels,
    note: Callable[[str], None],
) -> tuple[tuple[Endpoint, ...], str]:
    keys = port.topology_keys
    if keys and port.external_policy is TrafficPolicy.LOCAL:
        note(
            "topology keys ignored: they cannot be combined with externalTrafficPolicy: Local"
        )
        keys = ()
    if keys:
        return _by_topology_keys(keys, endpoints, node, node_labels, note)

    ready = [ep for ep in endpoints if ep.ready]
    mode = _mode_from_hints(port, ready, node, note)
    if mode == PREFER_SAME_NODE:
        chosen = [ep for ep in ready if node.name in ep.node_hints]
    elif mode == PREFER_SAME_ZONE:
        chosen = [ep for ep in ready if node.zone in ep.zone_hints]
    else:
        chosen = ready
    if chosen:
        note(f"cluster traffic: {len(chosen)} ready endpoint(s)" + _of_total(chosen, endpoints))
        return tuple(chosen), mode
    # Ready endpoints anywhere would have been chosen above (the hint safeguards fall back to
    # all of them), so none is ready: use the ones still serving while terminating.
    fallback = tuple(ep for ep in endpoints if ep.serving and ep.terminating)
    if fallback:
        note(
            f"cluster traffic: no ready endpoint; falling back to {len(fallback)} serving "
            "terminating endpoint(s)"
        )
    else:
        note("cluster traffic: no ready or serving-terminating endpoint: connections are rejected")
    return fallback, mode


def _of_total(chosen: Sequence[Endpoint], endpoints: Sequence[Endpoint]) -> str:
    return f" of {len(endpoints)}" if len(chosen) != len(endpoints) else ""


def _mode_from_hints(
    port: ServicePort, ready: Sequence[Endpoint], node: Node, note: Callable[[str], None]
) -> str:
    """Upstream's topologyModeFromHints, with the reason for every safeguard that fires.
    Only ready endpoints count (kubernetes#106507)."""
    requested = port.traffic_distribution or port.topology_mode_annotation
    if not ready:
        return TOPOLOGY_NONE
    if not any(ep.node_hints or ep.zone_hints for ep in ready):
        # No hints at all (most services): one pass instead of the counts below.
        if requested:
            note(f"{_requested_field(port)}={requested} but the EndpointSlices carry no hints "
                 "(the EndpointSlice controller writes them): all ready endpoints are used")
        return TOPOLOGY_NONE
    missing_node = sum(1 for ep in ready if not ep.node_hints)
    missing_zone = sum(1 for ep in ready if not ep.zone_hints)
    if missing_node == 0:
        if any(node.name in ep.node_hints for ep in ready):
            note(f"PreferSameNode: every ready endpoint has a node hint; using those for "
                 f"{node.name}")
            return PREFER_SAME_NODE
        note(f"same-node hints ignored: no endpoint is hinted for node {node.name}")
    elif missing_node < len(ready):
        note(
            f"same-node hints ignored: {missing_node} of {len(ready)} ready endpoints have no "
            "node hint"
        )
    if missing_zone == 0:
        if node.zone and any(node.zone in ep.zone_hints for ep in ready):
            note(f"PreferSameZone: every ready endpoint has a zone hint; using those for zone "
                 f"{node.zone}")
            return PREFER_SAME_ZONE
        if not node.zone:
            note(f"zone hints ignored: node {node.name} has no {LABEL_ZONE} label")
        else:
            note(f"zone hints ignored: no endpoint is hinted for zone {node.zone}")
    elif missing_zone < len(ready):
        note(
            f"zone hints ignored: {missing_zone} of {len(ready)} ready endpoints have no zone "
            "hint (hints being rolled out, or removed by the controller's safeguards)"
        )
    elif requested:
        note(
            f"{_requested_field(port)}={requested} but the EndpointSlices carry no hints "
            "(the EndpointSlice controller writes them): all ready endpoints are used"
        )
    return TOPOLOGY_NONE


def _requested_field(port: ServicePort) -> str:
    if port.traffic_distribution:
        return "trafficDistribution"
    return "topology-mode annotation"


def _by_topology_keys(
    keys: Sequence[str],
    endpoints: Sequence[Endpoint],
    node: Node,
    node_labels: NodeLabels,
    note: Callable[[str], None],
) -> tuple[tuple[Endpoint, ...], str]:
    """The first key (in order) for which endpoints share this node's label value wins; "*"
    takes any endpoint; no match and no "*" leaves the service without endpoints here."""
    usable = [ep for ep in endpoints if ep.ready]
    if not usable:
        usable = [ep for ep in endpoints if ep.serving and ep.terminating]
        if usable:
            note(f"no ready endpoint; topology keys apply to {len(usable)} serving terminating")
    for key in keys:
        if key == TOPOLOGY_KEY_ANY:
            note(f'topology key "*": any of {len(usable)} usable endpoint(s)')
            return tuple(usable), TOPOLOGY_KEYS_PREFIX + key
        mine = node.labels.get(key)
        if mine is None and key == LABEL_HOSTNAME:
            mine = node.name
        if mine is None:
            note(f"topology key {key}: node {node.name} has no such label, next key")
            continue
        matched = [ep for ep in usable if endpoint_label(ep, key, node_labels) == mine]
        if matched:
            note(f"topology key {key}={mine}: {len(matched)} endpoint(s) match")
            return tuple(matched), TOPOLOGY_KEYS_PREFIX + key
        note(f"topology key {key}={mine}: no endpoint matches, next key")
    note('no topology key matched and no "*": no endpoints for this node (connections rejected)')
    return (), TOPOLOGY_KEYS_PREFIX


def endpoint_label(ep: Endpoint, key: str, node_labels: NodeLabels) -> str | None:
    """A label of the node an endpoint runs on: from that Node object when known, else from
    what the EndpointSlice itself says (deprecatedTopology, zone, nodeName)."""
    if ep.node_name and ep.node_name in node_labels:
        value = node_labels[ep.node_name].get(key)
        if value is not None:
            return value
    for k, v in ep.topology:
        if k == key:
            return v
    if key == LABEL_ZONE:
        return ep.zone
    if key == LABEL_HOSTNAME:
        return ep.node_name
    return None


# ---------------------------------------------------------------------------------------------
# The local list


def _local_endpoints(
    endpoints: Sequence[Endpoint], node_name: str, note: Callable[[str], None]
) -> tuple[tuple[Endpoint, ...], bool, bool]:
    """(local list, whether it is the terminating fallback, whether any endpoint is usable
    anywhere). Hints never apply here; the fallback is independent of the cluster list."""
    anywhere = any(ep.ready or (ep.serving and ep.terminating) for ep in endpoints)
    local = tuple(ep for ep in endpoints if ep.is_local(node_name) and ep.ready)
    if local:
        note(f"local traffic: {len(local)} ready endpoint(s) on node {node_name}")
        return local, False, anywhere
    local = tuple(
        ep for ep in endpoints if ep.is_local(node_name) and ep.serving and ep.terminating
    )
    if local:
        note(
            f"local traffic: no ready endpoint on node {node_name}; falling back to "
            f"{len(local)} serving terminating"
        )
        return local, True, anywhere
    note(f"local traffic: no endpoint on node {node_name}: such connections are dropped")
    return (), False, anywhere


def _union(a: Iterable[Endpoint], b: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    merged = {ep.key: ep for ep in a}
    for ep in b:
        merged.setdefault(ep.key, ep)
    return tuple(merged[key] for key in sorted(merged))
