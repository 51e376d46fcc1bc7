"""Endpoint selection for this node: traffic policies, terminating fallback, topology hints and
topology keys, with spillover to wider topology levels. One pure function, `select_endpoints`,
like upstream's CategorizeEndpoints, plus a human-readable trace of every decision.

Spillover (`service.pyproxy.io/topology-min-endpoints: N`): when the preferred level holds
fewer than N ready endpoints, the next level's endpoints are added, level by level, until N
are used or the levels run out. The levels, each including the ones before it:
  hints PreferSameNode: node (hinted for this node) → zone (hinted for this node's zone, or
      located in it) → region → all
  hints PreferSameZone: zone (hinted for this node's zone) → region → all
  topology keys: each key that has endpoints, in order ("*" = all)
"Located" reads the endpoint's Node object when known (all nodes are watched for such a
service), else the EndpointSlice (zone field, deprecatedTopology). The region level needs this
node's region label and endpoints whose region is known; EndpointSlices carry no region, so an
endpoint on an unknown Node is reached only at "all". Node-local lists never widen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from pyproxy.core.least import LeastSlots
from pyproxy.core.model import (
    ANNOTATION_TOPOLOGY_MIN_ENDPOINTS,
    LABEL_HOSTNAME,
    LABEL_REGION,
    LABEL_ZONE,
    MAX_TOPOLOGY_MIN_ENDPOINTS,
    TOPOLOGY_KEY_ANY,
    ClusterState,
    Endpoint,
    IPFamily,
    Node,
    ServiceKey,
    ServicePort,
    TrafficPolicy,
)
from pyproxy.core.outliers import PortOutliers

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
    # The topology levels whose endpoints the cluster list holds, preferred first ("node",
    # "zone", "region", "all", or topology keys); more than one when it spilled over. Empty
    # without a topology preference.
    levels: tuple[str, ...] = ()
    # Outlier ejection's verdict on these endpoints (core/outliers.py), set by the daemon
    # after selection: the ejected get no slot for new connections. None: not used.
    outliers: PortOutliers | None = None
    # Least-connection balancing's slot table (core/least.py), set by the daemon's feedback
    # from the connections in flight. None: not used, or no feedback yet.
    least: LeastSlots | None = None


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
    levels: tuple[str, ...] = ()
    cluster: tuple[Endpoint, ...] | None = None
    has_any = False
    if port.uses_cluster_endpoints(family):
        cluster, topology, levels = _cluster_endpoints(
            port, endpoints, node, node_labels or {}, note)
        has_any = bool(cluster)

    if not port.uses_local_endpoints(family):
        assert cluster is not None
        return Selection(family, cluster, None, cluster, has_any, topology, tuple(reasons),
                         levels)

    if port.topology_min_endpoints:
        note("topology-min-endpoints does not apply to the node-local list: a Local traffic "
             "policy never leaves this node")
    local, local_is_fallback, anywhere = _local_endpoints(endpoints, node.name, note)
    has_any = has_any or anywhere
    if cluster is None:
        return Selection(family, None, local, local, has_any, topology, tuple(reasons), levels)
    if topology == TOPOLOGY_NONE and not local_is_fallback:
        # The cluster list then holds every ready endpoint, a superset of the local one.
        reachable = cluster
    else:
        reachable = _union(cluster, local)
    return Selection(family, cluster, local, reachable, has_any, topology, tuple(reasons),
                     levels)


def _note_policies(port: ServicePort, family: IPFamily, note: Callable[[str], None]) -> None:
    if port.topology_note:
        note(port.topology_note)
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
) -> tuple[tuple[Endpoint, ...], str, tuple[str, ...]]:
    """(cluster list, topology mode, topology levels used)."""
    keys = port.topology_keys
    if keys and port.external_policy is TrafficPolicy.LOCAL:
        note(
            "topology keys ignored: they cannot be combined with externalTrafficPolicy: Local"
        )
        keys = ()
    minimum = port.topology_min_endpoints
    if keys:
        return _by_topology_keys(keys, endpoints, node, node_labels, minimum, note)

    ready = [ep for ep in endpoints if ep.ready]
    mode = _mode_from_hints(port, ready, node, note)
    levels: tuple[str, ...] = ()
    if mode == TOPOLOGY_NONE:
        chosen: Sequence[Endpoint] = ready
        if minimum and ready:
            note(f"topology-min-endpoints {minimum}: no topology preference in force, every "
                 "ready endpoint is used already")
    else:
        hint_levels = _hint_levels(mode, node, node_labels, ready, minimum)
        chosen, levels = _widen(hint_levels, ready, minimum, "ready", note)
    if chosen:
        note(f"cluster traffic: {len(chosen)} ready endpoint(s)" + _of_total(chosen, endpoints))
        return tuple(chosen), mode, levels
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
    return fallback, mode, levels


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
    minimum: int,
    note: Callable[[str], None],
) -> tuple[tuple[Endpoint, ...], str, tuple[str, ...]]:
    """The first key (in order) for which endpoints share this node's label value wins; "*"
    takes any endpoint; no match and no "*" leaves the service without endpoints here. With a
    minimum, the endpoints of the following keys are added until it is met."""
    usable = [ep for ep in endpoints if ep.ready]
    what = "ready"
    if not usable:
        usable = [ep for ep in endpoints if ep.serving and ep.terminating]
        what = "serving terminating"
        if usable:
            note(f"no ready endpoint; topology keys apply to {len(usable)} serving terminating")
    for i, key in enumerate(keys):
        level = _key_level(key, node, node_labels)
        if level is None:
            note(f"topology key {key}: node {node.name} has no such label, next key")
            continue
        matched = [ep for ep in usable if level.contains(ep)]
        if not matched:
            note(f"topology key {level.text}: no endpoint matches, next key")
            continue
        if key == TOPOLOGY_KEY_ANY:
            note(f'topology key "*": any of {len(usable)} usable endpoint(s)')
        else:
            note(f"topology key {level.text}: {len(matched)} endpoint(s) match")
        # Keys this node has no label for match nothing, wider or not.
        wider = [lv for lv in (_key_level(k, node, node_labels) for k in keys[i + 1:])
                 if lv] if minimum else []
        chosen, used = _widen([level, *wider], usable, minimum, what, note)
        return tuple(chosen), TOPOLOGY_KEYS_PREFIX + key, used
    note('no topology key matched and no "*": no endpoints for this node (connections rejected)')
    return (), TOPOLOGY_KEYS_PREFIX, ()


def _key_level(key: str, node: Node, node_labels: NodeLabels) -> Level | None:
    """The level of one key for this node; None when the node lacks that label."""
    if key == TOPOLOGY_KEY_ANY:
        return Level(key, '"*"', _anything)
    mine = node.labels.get(key)
    if mine is None and key == LABEL_HOSTNAME:
        mine = node.name
    if mine is None:
        return None
    return Level(key, f"{key}={mine}", _located(key, mine, node_labels))


# ---------------------------------------------------------------------------------------------
# Spillover: wider topology levels


def parse_min_endpoints(text: str | None) -> tuple[int, str | None]:
    """The `topology-min-endpoints` annotation: (N, None); (0, None) when absent; (0, why) when
    unusable. A bad value is ignored rather than skipping the service (as for the balancing
    annotations): the service keeps working, without spillover, and explain says why."""
    if text is None:
        return 0, None
    value = text.strip()
    # isascii: str.isdigit also accepts other scripts' digits; the length check spares int()
    # a huge string.
    if value.isascii() and value.isdigit() and len(value) <= 9:
        number = int(value)
        if 1 <= number <= MAX_TOPOLOGY_MIN_ENDPOINTS:
            return number, None
    return 0, (f"{ANNOTATION_TOPOLOGY_MIN_ENDPOINTS}={text[:40]!r} is not a whole number from 1 "
               f"to {MAX_TOPOLOGY_MIN_ENDPOINTS}: ignored (no spillover)")


@dataclass(frozen=True, slots=True)
class Level:
    """One topology level: its name ("zone", a topology key), how explain names it for this
    node ("zone zone-1"), and which endpoints belong to it."""

    name: str
    text: str
    contains: Callable[[Endpoint], bool]
    # Noted when widening reaches this level (what it cannot see).
    caveat: str = ""


def _anything(ep: Endpoint) -> bool:
    return True


def _located(key: str, value: str, node_labels: NodeLabels) -> Callable[[Endpoint], bool]:
    return lambda ep: endpoint_label(ep, key, node_labels) == value


def _hint_levels(
    mode: str, node: Node, node_labels: NodeLabels, ready: Sequence[Endpoint], minimum: int
) -> list[Level]:
    """The levels of a hint mode, preferred first. The preferred level is exactly upstream's
    choice (the hints); wider levels also take endpoints by where they are, since hints name
    only a node or a zone and regions have none."""
    zone = node.zone
    if mode == PREFER_SAME_NODE:
        levels = [Level("node", f"node {node.name}", lambda ep: node.name in ep.node_hints)]
    else:
        levels = [Level("zone", f"zone {zone}", lambda ep: zone in ep.zone_hints)]
    if not minimum:
        return levels  # no spillover: skip the work below
    # A level this node cannot have (no such label) is left out; the next one says so.
    missing: list[str] = []
    if mode == PREFER_SAME_NODE:
        if zone:
            in_zone = _located(LABEL_ZONE, zone, node_labels)
            levels.append(Level("zone", f"zone {zone}",
                                lambda ep: zone in ep.zone_hints or in_zone(ep)))
        else:
            missing.append(f"no zone level: node {node.name} has no {LABEL_ZONE} label")
    region = node.labels.get(LABEL_REGION)
    if region:
        unknown = sum(1 for ep in ready
                      if endpoint_label(ep, LABEL_REGION, node_labels) is None
                      and not any(level.contains(ep) for level in levels))
        if unknown:
            missing.append(f"{unknown} more ready endpoint(s) of unknown region (neither a "
                           "known Node nor deprecatedTopology gives it): only in all")
        levels.append(Level("region", f"region {region}",
                            _located(LABEL_REGION, region, node_labels), "; ".join(missing)))
        missing = []
    else:
        missing.append(f"no region level: node {node.name} has no {LABEL_REGION} label")
    levels.append(Level("all", "all", _anything, "; ".join(missing)))
    return levels


def _widen(
    levels: Sequence[Level],
    candidates: Sequence[Endpoint],
    minimum: int,
    what: str,
    note: Callable[[str], None],
) -> tuple[list[Endpoint], tuple[str, ...]]:
    """The candidates of the first level, then, while fewer than `minimum`, those of each next
    level as well (widening adds: the narrower levels' endpoints stay). In candidate order."""
    first = levels[0]
    chosen = [ep for ep in candidates if first.contains(ep)]
    if not minimum:
        return chosen, (first.name,)
    if len(chosen) >= minimum:
        note(f"topology-min-endpoints {minimum}: {first.text} has {len(chosen)} {what} "
             "endpoint(s), enough")
        return chosen, (first.name,)
    summary = (f"{first.text} has {len(chosen)} {what} endpoint(s), fewer than "
               f"topology-min-endpoints {minimum}: ")
    used = [first]
    steps: list[str] = []
    for level in levels[1:]:
        if len(chosen) >= minimum:
            break
        before = len(chosen)
        used.append(level)
        chosen = [ep for ep in candidates if any(u.contains(ep) for u in used)]
        steps.append(f"{level.text} (+{len(chosen) - before})")
        if level.caveat:
            steps[-1] += f" [{level.caveat}]"
    if steps:
        summary += f"widened to {', '.join(steps)}: {len(chosen)} endpoint(s)"
    if len(chosen) < minimum:
        summary += (", still fewer with every level used" if steps
                    else "no wider level: using these")
    note(summary)
    return chosen, tuple(u.name for u in used)


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
# Where an endpoint is, seen from this node

SCOPE_NODE, SCOPE_ZONE, SCOPE_CLUSTER = "node", "zone", "cluster"


def endpoint_scope(ep: Endpoint, node: Node, node_labels: NodeLabels) -> str:
    """Where an endpoint runs relative to this node: "node" (on this node, as the Local traffic
    policies count it), "zone" (elsewhere in this node's zone: its Node's zone label when that
    Node is known, else the EndpointSlice's zone) or "cluster" (anywhere else, a zone that is
    unknown included, and every other node's endpoint when this node has no zone label). It
    says where traffic went, not why the endpoint was eligible: an endpoint a zone hint lends
    to this zone from another one is "cluster"."""
    if ep.is_local(node.name):
        return SCOPE_NODE
    if node.zone and endpoint_label(ep, LABEL_ZONE, node_labels) == node.zone:
        return SCOPE_ZONE
    return SCOPE_CLUSTER


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


@dataclass(frozen=True, slots=True)
class PortSelection:
    port: ServicePort
    family: IPFamily
    selection: Selection


def select_all(
    state: ClusterState, node_name: str, services: Iterable[ServiceKey] | None = None
) -> Iterator[PortSelection]:
    """Endpoint selection for every service port and family (or only those of `services`),
    in a stable order."""
    node = state.node(node_name)
    labels = state.node_labels()
    ports = state.ports if services is None else [
        port for key in sorted(set(services)) for port in state.ports_of(key)]
    for port in ports:
        for family in port.families():
            endpoints = state.endpoints(port.name, family)
            selection = select_endpoints(port, family, endpoints, node, labels)
            yield PortSelection(port, family, selection)
