"""`pyproxy explain`: what one node does with every service port, and why.

The JSON form is a contract that later tools build on:
  {"node": {"name", "labels"},
   "services": [{"service", "port", "protocol", "ipFamily", "clusterIPs", "internalTrafficPolicy",
                 "externalTrafficPolicy", "topology", "topologyLevels",
                 "topologyMinEndpoints", "clusterEndpoints", "localEndpoints",
                 "hasEndpoints", "reasons", "outliers"?}],
   "skipped": [{"object", "reason", "invalid"}],
   "serviceCIDRs": ["10.96.0.0/16", ...]}
Live, a TCP port's entry also has `inFlight` (core/inflight.py: its established connections
per endpoint, from conntrack).
A null endpoint list means the service does not use that list; [] means used and empty.
`topologyLevels` lists the topology levels the cluster list draws on, preferred first (more
than one when it spilled over: ["zone", "region", "all"]); [] without a topology preference.
`topologyMinEndpoints` is the service's valid topology-min-endpoints, or null.
`outliers` (only where outlier ejection is on): {"ejected": [{"endpoint", "reason", "until",
"ejection"}], "probation": [...], "note"}, `until` in UTC.
A dual-stack service port has one entry per family. `serviceCIDRs`: the ServiceCIDR objects'
ranges; traffic to an address in them that is no ClusterIP is dropped ([]: none known).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from pyproxy.core.balancing import MAGLEV_TABLE_SIZE, effective_weights
from pyproxy.core.inflight import endpoint_lines
from pyproxy.core.least import LEAST, LeastSlots, least_reason
from pyproxy.core.model import (
    Algorithm,
    ClusterState,
    Endpoint,
    ServiceKey,
    ServicePort,
    ip_family,
)
from pyproxy.core.outliers import PROBATION_SHARE, PortOutliers
from pyproxy.core.topology import TOPOLOGY_NONE, PortSelection, Selection, select_all


def explain_report(
    state: ClusterState, node_name: str, service: ServiceKey | None = None,
    outliers: Callable[[PortSelection], PortOutliers | None] | None = None,
    least: Callable[[PortSelection], LeastSlots | None] | None = None,
) -> dict[str, Any]:
    """`outliers`: outlier ejection's verdict in force for a port; `least`: the slot table
    least-connection balancing's feedback set for it (the daemon's; None offline, where there
    is neither)."""
    node = state.node(node_name)
    entries = [
        port_entry(_in_force(ps, outliers, least)) for ps in select_all(state, node_name)
        if service is None or ps.port.name.service == service
    ]
    skipped = [
        {"object": s.object, "reason": s.reason, "invalid": s.invalid}
        for s in state.skipped
        if service is None or (s.namespace, s.name) == (service.namespace, service.name)
    ]
    report: dict[str, Any] = {
        "node": {"name": node.name, "labels": dict(node.labels)},
        "services": entries,
        "skipped": skipped,
        "serviceCIDRs": list(state.service_cidrs),
    }
    if node_name not in state.nodes:
        report["warnings"] = [
            f"node {node_name} is not in the snapshot: it has no labels, so zone hints and "
            "topology keys other than the hostname cannot match"
        ]
    return report


def _in_force(ps: PortSelection,
              outliers: Callable[[PortSelection], PortOutliers | None] | None,
              least: Callable[[PortSelection], LeastSlots | None] | None) -> PortSelection:
    if outliers is not None:
        ps = replace(ps, selection=replace(ps.selection, outliers=outliers(ps)))
    if least is not None:
        ps = replace(ps, selection=replace(ps.selection, least=least(ps)))
    return ps


def _endpoint_list(endpoints: tuple[Endpoint, ...] | None) -> list[str] | None:
    return None if endpoints is None else [ep.key for ep in endpoints]


def port_entry(ps: PortSelection) -> dict[str, Any]:
    port, sel = ps.port, ps.selection
    return {
        "service": str(port.name.service),
        "port": port.name.port,
        "protocol": str(port.protocol),
        "ipFamily": str(ps.family),
        "clusterIPs": [ip for ip in port.cluster_ips if ip_family(ip) is ps.family],
        "servicePort": port.port,
        "type": port.service_type,
        "nodePort": port.node_port or None,
        "externalIPs": list(port.external_ips_of(ps.family)),
        "loadBalancerIPs": list(port.load_balancer_vips(ps.family)),
        "internalTrafficPolicy": str(port.internal_policy),
        "externalTrafficPolicy": str(port.external_policy),
        "sessionAffinity": "ClientIP" if port.session_affinity else "None",
        "topology": sel.topology,
        "topologyLevels": list(sel.levels),
        "topologyMinEndpoints": port.topology_min_endpoints or None,
        "clusterEndpoints": _endpoint_list(sel.cluster),
        "localEndpoints": _endpoint_list(sel.local),
        "hasEndpoints": sel.has_any_endpoints,
        "balancing": port.balancing.value,
        "weights": _weights(port, sel),
        "reasons": list(sel.reasons) + _balancing_reasons(port, sel) + _outlier_reasons(sel),
        **({"outliers": _outliers(sel.outliers)} if sel.outliers is not None else {}),
    }


def _outliers(out: PortOutliers) -> dict[str, Any]:
    """Outlier ejection's verdict: the ejected endpoints with why and until when (UTC)."""
    return {
        "ejected": [{"endpoint": key, "reason": ej.reason, "until": _utc(ej.until),
                     "ejection": ej.streak} for key, ej in sorted(out.ejected.items())],
        "probation": sorted(out.probation),
        "note": out.note,
    }


def _outlier_reasons(sel: Selection) -> list[str]:
    out = sel.outliers
    if out is None:
        return []
    lines = [f"outlier ejection: {key} ejected until {_utc(ej.until)} ({ej.reason}; "
             f"ejection {ej.streak} in a row), no new connections"
             for key, ej in sorted(out.ejected.items())]
    lines += [f"outlier ejection: {key} back from an ejection, on probation (1/"
              f"{PROBATION_SHARE} of a share of new connections; one failure ejects it again)"
              for key in sorted(out.probation)]
    if out.note:
        lines.append(f"outlier ejection: {out.note}")
    return lines or ["outlier ejection: on, no endpoint ejected"]


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _weights(port: ServicePort, sel: Selection) -> dict[str, int]:
    """Endpoint weights that differ from 1 (both lists)."""
    endpoints = {ep.key: ep for ep in (*(sel.cluster or ()), *(sel.local or ()))}
    weights, _ = effective_weights(port, list(endpoints.values()), sel.outliers)
    return {key: w for key, w in zip(endpoints, weights, strict=True) if w != 1}


def _balancing_reasons(port: ServicePort, sel: Selection) -> list[str]:
    out = []
    if port.balancing_note:
        out.append(f"balancing: {port.balancing_note}")
    algorithm = port.balancing
    if port.session_affinity and algorithm is not Algorithm.RANDOM:
        out.append(f"balancing: {algorithm} with session affinity: new clients are placed by "
                   "weight, returning clients keep their endpoint")
    elif algorithm is Algorithm.MAGLEV:
        out.append(f"balancing: Maglev over a {MAGLEV_TABLE_SIZE}-slot table, hashing the "
                   f"client address and port (seed 0x{port.hash_seed:08x}; `pyproxy trace "
                   "--sport` shows a flow's endpoint)")
    elif algorithm is Algorithm.SOURCE_HASH:
        out.append(f"balancing: source hash of the client address (seed "
                   f"0x{port.hash_seed:08x})")
    elif algorithm is Algorithm.ROUND_ROBIN:
        out.append("balancing: round robin (per node)")
    elif algorithm in LEAST:
        out.append(least_reason(algorithm, sel.least))
    endpoints = [*(sel.cluster or ()), *(sel.local or ())]
    _, weight_note = effective_weights(port, endpoints)  # the weights' own, not ejections
    if weight_note:
        out.append(f"balancing: {weight_note}")
    drained = sorted({ep.key for ep, w in zip(endpoints, effective_weights(
        port, endpoints)[0], strict=True) if w == 0})
    if drained:
        out.append(f"balancing: draining (weight 0, no new connections): {', '.join(drained)}")
    return out


# ---------------------------------------------------------------------------------------------
# The table form, for people


def format_table(report: dict[str, Any]) -> str:
    node = report["node"]
    zone = node["labels"].get("topology.kubernetes.io/zone", "-")
    lines = [f"node {node['name']} (zone {zone})"]
    lines.extend(f"warning: {w}" for w in report.get("warnings", ()))
    rows = [("SERVICE", "PORT", "FAMILY", "TOPOLOGY", "CLUSTER ENDPOINTS", "LOCAL ENDPOINTS")]
    details: list[str] = []
    for entry in report["services"]:
        rows.append(
            (
                entry["service"],
                f"{entry['port'] or '-'}/{entry['protocol']}",
                entry["ipFamily"],
                _topology_cell(entry),
                _cell(entry["clusterEndpoints"]),
                _cell(entry["localEndpoints"]),
            )
        )
        name = f"{entry['service']}:{entry['port']}" if entry["port"] else entry["service"]
        details.append(f"{name} ({entry['ipFamily']}):")
        details.extend(f"  - {reason}" for reason in entry["reasons"])
        if "inFlight" in entry:  # live only: conntrack's established connections
            details.extend(f"  - {line}" for line in endpoint_lines(entry["inFlight"]))
    lines.extend(_align(rows))
    if any(" more" in cell for row in rows[1:] for cell in row[4:]):
        lines.append(f"(endpoint lists are cut after {CELL_ENDPOINTS}: -o json has them all)")
    if details:
        lines.append("")
        lines.append("why:")
        lines.extend(details)
    if report["skipped"]:
        lines.append("")
        lines.append("skipped:")
        for s in report["skipped"]:
            tag = "invalid" if s["invalid"] else "not proxied"
            lines.append(f"  {s['object']} ({tag}): {s['reason']}")
    if report.get("conflicts"):
        lines.append("")
        lines.append("conflicts:")
        lines.extend(f"  {conflict_text(c)}" for c in report["conflicts"])
    if report.get("serviceCIDRs"):
        lines.append("")
        lines.append(f"service CIDRs: {', '.join(report['serviceCIDRs'])} (addresses in them "
                     "that are no ClusterIP: dropped)")
    return "\n".join(lines) + "\n"


def conflict_text(conflict: dict[str, Any]) -> str:
    """One of a report's `conflicts` (sync.proxier.conflicts) in words."""
    elements = conflict["elements"]
    more = f" and {len(elements) - 1} more element(s)" if len(elements) > 1 else ""
    return (f"{elements[0]}{more} ({conflict['family']}): claimed by "
            f"{', '.join(conflict['claimedBy'])}; the rules of {', '.join(conflict['used'])} "
            "are used (of differing rules the smallest wins, whatever the order of events)")


def topology_text(mode: str | None) -> str:
    """A topology mode in a table: `-` for none (JSON keeps kube-proxy's word, "None", which
    a table would show as if it were Python's)."""
    return "-" if mode in (None, TOPOLOGY_NONE) else str(mode)


def _topology_cell(entry: dict[str, Any]) -> str:
    """The mode, and the levels it spilled over to: "PreferSameZone+region+all"."""
    wider = (entry.get("topologyLevels") or [])[1:]
    return "+".join([topology_text(entry["topology"]), *wider])


# Endpoints shown in a table cell before "+ N more" (as kubectl's ENDPOINTS column): a
# 300-endpoint service would otherwise make one row thousands of characters wide.
CELL_ENDPOINTS = 3


def _cell(endpoints: list[str] | None) -> str:
    if endpoints is None:
        return "(not used)"
    if not endpoints:
        return "(none)"
    shown = ",".join(endpoints[:CELL_ENDPOINTS])
    more = len(endpoints) - CELL_ENDPOINTS
    return f"{shown} + {more} more" if more > 0 else shown


def _align(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
