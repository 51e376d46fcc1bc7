"""Tables for people, from the JSON the live commands receive (kubectl-style)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pyproxy.core.explain import topology_text
from pyproxy.core.inflight import in_flight_text


def align(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _ago(timestamp: float | None) -> str:
    if not timestamp:
        return "never"
    seconds = max(0.0, time.time() - timestamp)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _sync(record: dict[str, Any] | None) -> str:
    if record is None:
        return "none yet"
    kind = "full" if record["full"] else "partial"
    text = (f"{_ago(record['started'])}, {kind} ({record['reason']}), "
            f"{record['seconds'] * 1000:.1f} ms, {record['commands']} commands")
    return text + (f", FAILED: {record['error']}" if record.get("error") else "")


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"node:              {s['node']} ({', '.join(s['families'])})",
        f"healthy:           {'yes' if s['healthy'] else 'NO'}"
        f" (node eligible for traffic: {'yes' if s['nodeEligible'] else 'no'})",
        *(f"api watches:       FAILING: {problem}" for problem in api_problems(s)),
        "initial lists:     " + ", ".join(
            f"{name} {'done' if done else 'PENDING'}" for name, done in s["sources"].items()),
        f"services:          {s['services']} ({s['servicePorts']} service ports programmed)",
        f"pending changes:   {s['pendingChanges']['services']} services, "
        f"{s['pendingChanges']['endpoints']} endpoint sets",
        f"syncs:             {s['syncs']} ({s['syncFailures']} failed)",
        f"last sync:         {_sync(s['lastSync'])}",
        f"last full sync:    {_sync(s['lastFullSync'])}",
        f"last partial sync: {_sync(s['lastPartialSync'])}",
    ]
    if s["invalidObjects"]:
        lines.append("invalid objects:   " + ", ".join(
            f"{kind} {count}" for kind, count in sorted(s["invalidObjects"].items())))
    other = s.get("otherTables")
    if other is not None:
        lines.append("other tables:      " + ("no chain drops pyproxy's traffic" if not other
                                              else f"WARNING: {len(other)} chain(s) may drop "
                                              "pyproxy's traffic"))
        lines.extend(f"  {finding['text']}" for finding in other)
    source = s.get("source") or {}
    if "snapshot" in source:
        last = f": {source['lastError']}" if source["lastError"] else ""
        lines.append(f"source:            snapshot {source['snapshot']} ({source['loads']} "
                     f"loads, {source['errors']} errors{last})")
    api_server = source.get("apiServer")
    if api_server:
        problem = api_server["problem"]
        lines.append(f"api server:        {api_server['host']}"
                     + (f": WARNING: {problem}" if problem else ""))
    for watch in source.get("api", []):
        state = "connected" if watch["connected"] else watch.get("state", "disconnected").upper()
        if watch.get("watch_encoding"):  # a daemon before protobuf watches has none
            state += f" ({watch['watch_encoding']})"
        lines.append(f"watch {watch['kind']:<14}{state}, resourceVersion "
                     f"{watch['resource_version'] or '-'}, {watch['events']} events, "
                     f"{watch['lists']} lists (last {watch['last_list_seconds']:.2f} s: "
                     f"server {watch['last_list_server_seconds']:.2f}, decode "
                     f"{watch['last_list_decode_seconds']:.2f}), "
                     f"{watch['errors']} errors"
                     + (f" (last: {watch['last_error']})" if watch["last_error"] else ""))
    return "\n".join(lines) + "\n"


def api_problems(s: dict[str, Any]) -> list[str]:
    """Why the API side is not well (a daemon before these were reported has none)."""
    return list((s.get("source") or {}).get("problems") or ())


def _endpoints(value: list[str] | None) -> str:
    if value is None:
        return "-"
    return ",".join(value) if value else "<none>"


def _connections(counts: list[dict[str, Any]] | None) -> str:
    """`10.244.1.2:8080=12(node),10.244.2.3:8080=9(zone)`: endpoints without one are left out."""
    if counts is None:
        return "-"  # the daemon was not asked, or does not count
    return ",".join(f"{c['endpoint']}={c['count']}({c['scope']})" for c in counts) or "<none>"


def format_services(entries: list[dict[str, Any]], wide: bool = False) -> str:
    header = ["SERVICE", "PORT", "TYPE", "CLUSTER-IP", "NODEPORT", "TOPOLOGY", "ENDPOINTS"]
    if wide:
        header += ["LOCAL-ENDPOINTS", "EXTERNAL-IPS", "POLICIES", "AFFINITY",
                   "NEW-CONNECTIONS", "IN-FLIGHT"]
    rows = [header]
    for e in entries:
        row = [e["service"], f"{e['servicePort']}/{e['protocol']}"
               + (f" ({e['port']})" if e["port"] else ""),
               e["type"], ",".join(e["clusterIPs"]) or "-", str(e["nodePort"] or "-"),
               topology_text(e["topology"]),
               # iTP=Local services use only the local list: show that one then
               _endpoints(e["clusterEndpoints"] if e["clusterEndpoints"] is not None
                          else e["localEndpoints"])]
        if wide:
            row += [_endpoints(e["localEndpoints"]),
                    ",".join(e["externalIPs"] + e["loadBalancerIPs"]) or "-",
                    f"int={e['internalTrafficPolicy']},ext={e['externalTrafficPolicy']}",
                    e["sessionAffinity"], _connections(e.get("newConnections")),
                    in_flight_text(e["inFlight"]) if "inFlight" in e else "-"]
        rows.append(row)
    return "\n".join(align(rows)) + "\n"


def format_trace(t: dict[str, Any]) -> str:
    lines = [f"{t['src']} -> {t['dst']}: {t['verdict']}"
             + (f" (service {t['service']})" if t["service"] else "")]
    lines.extend(f"  {step}" for step in t["steps"])
    for c in t["candidates"]:
        lines.append(f"  -> {c['endpoint']}  {c['probability'] * 100:.1f}%")
    if t["verdict"] == "DNAT":
        lines.append("  source: " + ("masqueraded to the node's address" if t["masquerade"]
                                     else "client address preserved"))
    return "\n".join(lines) + "\n"


def format_history(records: list[dict[str, Any]]) -> str:
    rows = [["WHEN", "KIND", "REASON", "SERVICES", "ENDPOINTS", "RENDER", "DIFF", "KERNEL",
             "COMMANDS", "RESULT"]]
    for r in records:
        rows.append([
            _ago(r["started"]), "full" if r["full"] else "partial", r["reason"],
            str(r["services_changed"]), str(r["endpoints_changed"]),
            f"{r['render_seconds'] * 1000:.1f}ms", f"{r['diff_seconds'] * 1000:.1f}ms",
            f"{r['kernel_seconds'] * 1000:.1f}ms", str(r["commands"]),
            "ok" if not r["error"] else f"FAILED: {r['error'][:60]}"])
    return "\n".join(align(rows)) + "\n"
