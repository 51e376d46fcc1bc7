"""What `make bench-vs-kube-proxy` measures besides the proxies themselves (issue 37, point 1):
the control plane's cost (loading the objects, each proxy's start), how far a kube-proxy got
when its cap hit, the one-Service changes' time in the kernel, the load average per phase,
and the targets, printed met or missed.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from testkit.controlplane import ControlPlane
from testkit.inproc import call_in_netns
from testkit.netlab import Netns

CLK_TCK = os.sysconf("SC_CLK_TCK")


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (the machine is shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def process(pid: int) -> dict[str, float]:
    """Resident memory (now and peak) and CPU seconds of one process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "hwm_mib": round(int(fields["VmHWM"].split()[0]) / 1024, 1),
            "cpu_s": (int(stat[11]) + int(stat[12])) / CLK_TCK}


def etcd_db_mib(plane: ControlPlane) -> float:
    db = plane.dir / "etcd" / "member" / "snap" / "db"
    return round(db.stat().st_size / 2**20, 1) if db.exists() else float("nan")


def control_plane(plane: ControlPlane) -> dict[str, Any]:
    """kube-apiserver's and etcd's memory and CPU so far, etcd's database file."""
    assert plane.apiserver is not None and plane.etcd is not None
    return {"apiserver": process(plane.apiserver.pid), "etcd": process(plane.etcd.pid),
            "etcd_db_mib": etcd_db_mib(plane), "load": load_average()}


def loading_cost(before: dict[str, Any], after: dict[str, Any], seconds: float,
                 objects: int) -> dict[str, Any]:
    """What creating the objects cost the control plane."""
    return {"seconds": round(seconds, 1), "objects": objects,
            "objects_per_s": round(objects / seconds, 1) if seconds else None,
            "apiserver_cpu_s": round(after["apiserver"]["cpu_s"]
                                     - before["apiserver"]["cpu_s"], 1),
            "etcd_cpu_s": round(after["etcd"]["cpu_s"] - before["etcd"]["cpu_s"], 1),
            "after": after}


@dataclass(frozen=True)
class ApiSample:
    apiserver_cpu_s: float
    etcd_cpu_s: float
    tx_bytes: int  # what the control plane's end of the node's link has sent


def node_link(plane: ControlPlane, node: Netns) -> str:
    """The control plane's end of the node's link: its transmitted bytes are the node's."""
    return next(lk.if_a for lk in plane.lab.links if lk.ns_b is node)


def api_sample(plane: ControlPlane, ifname: str) -> ApiSample:
    assert plane.apiserver is not None and plane.etcd is not None
    links = json.loads(plane.lab.ip(plane.ns, "-j", "-s", "link", "show").stdout)
    tx = next(int(lk["stats64"]["tx"]["bytes"]) for lk in links if lk["ifname"] == ifname)
    return ApiSample(process(plane.apiserver.pid)["cpu_s"], process(plane.etcd.pid)["cpu_s"],
                     tx)


def api_delta(before: ApiSample, after: ApiSample) -> dict[str, float]:
    return {"apiserver_cpu_s": round(after.apiserver_cpu_s - before.apiserver_cpu_s, 2),
            "etcd_cpu_s": round(after.etcd_cpu_s - before.etcd_cpu_s, 2),
            "mib_sent": round((after.tx_bytes - before.tx_bytes) / 2**20, 2)}


# -- the proxies from outside -----------------------------------------------------------------


def metrics(netns: str, prefix: str) -> dict[str, float]:
    """The series of a proxy's /metrics (127.0.0.1:10249 in its namespace) under `prefix`."""
    def scrape() -> str:
        with urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=20) as r:
            return str(r.read().decode())
    try:
        text = call_in_netns(netns, scrape, timeout=30)
    except Exception:  # a proxy busy or gone: no figures, the bench goes on
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            series, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[series] = float(value)
    return out


def histogram_means(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Each histogram's observations between two scrapes: their count and mean (seconds)."""
    out: dict[str, Any] = {}
    for series, total in after.items():
        if not series.endswith("_count") and "_count{" not in series:
            continue
        name = series.replace("_count", "", 1)
        count = total - before.get(series, 0.0)
        summed = after.get(series.replace("_count", "_sum", 1), 0.0) \
            - before.get(series.replace("_count", "_sum", 1), 0.0)
        if count:
            out[name] = {"count": int(count), "mean_s": round(summed / count, 4)}
    return out


def partial_sync_ms(means: dict[str, Any]) -> float | None:
    """The mean of the partial syncs (one-Service changes) from a proxy's own histogram
    (kube-proxy's kubeproxy_sync_partial_proxy_rules_duration_seconds; pyproxy exports the
    same), in ms."""
    for name, figures in means.items():
        if name.startswith("kubeproxy_sync_partial_proxy_rules_duration_seconds"):
            return round(1000 * float(figures["mean_s"]), 2)
    return None


def table_progress(node: Netns, table: str, service_ports: int,
                   attempts: int = 5) -> dict[str, Any]:
    """How much of a (capped) proxy's ruleset is in the kernel: its table's chains, the
    per-service ones among them (kube-proxy's `service-HASH-ns/name/proto/port`), against
    the Service ports the cluster has. A listing that a commit interrupts fails (nft: EINTR
    while the proxy writes), so it is tried again; the last error is kept."""
    error = ""
    for _ in range(attempts):
        listed = node.run(["nft", "list", "chains", "ip", table], check=False, timeout=300)
        if listed.returncode == 0:
            break
        error = listed.stderr.strip()[:300]
    else:
        return {"error": error, "service_ports_in_cluster": service_ports}
    chains = [line.split()[1] for line in listed.stdout.splitlines()
              if line.strip().startswith("chain ")]
    return {"chains": len(chains),
            "service_chains": sum(1 for c in chains if c.startswith("service-")),
            "endpoint_chains": sum(1 for c in chains if c.startswith("endpoint-")),
            "service_ports_in_cluster": service_ports}


def log_syncs(log: Path, since: float, until: float) -> list[dict[str, Any]]:
    """pyproxy's `synced` log lines between two wall-clock times (its own text log)."""
    from bench.bench_vs_kube_proxy import log_event

    out = []
    for line in log.read_text().splitlines():
        event = log_event(line)
        if not event or event.get("event") != "synced":
            continue
        try:
            at = datetime.fromisoformat(str(event["timestamp"])).timestamp()
        except (KeyError, ValueError):
            continue
        if since <= at <= until:
            out.append(event)
    return out


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 2),
            "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 2),
            "max": round(ordered[-1], 2)}


def pyproxy_changes(log: Path, since: float, until: float) -> dict[str, Any]:
    """The incremental syncs of the quiet flips: their kernel write and whole duration (ms)."""
    syncs = [e for e in log_syncs(log, since, until) if str(e.get("full")).lower() == "false"]
    return {"kernel_ms": quantiles([float(e["kernel_ms"]) for e in syncs]),
            "duration_ms": quantiles([float(e["duration_ms"]) for e in syncs])}


# -- targets ------------------------------------------------------------------------------------


LARGE = ((44000, 1), (5000, 50))


def targets(result: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, met: True/False/None when not measurable, the figures) of one size."""
    py = result["runs"].get("pyproxy", {})
    kp = result["runs"].get("kube-proxy", {})
    floor = result.get("kernel_floor", {})
    out: list[tuple[str, bool | None, str]] = []
    py_first = py.get("first_ruleset_s")
    kp_first = kp.get("first_ruleset_s")
    if (result["services"], result["endpoints"]) in LARGE and py_first is not None:
        if kp_first is not None:
            out.append(("first complete ruleset ≤ 1/20 of kube-proxy's",
                        py_first * 20 <= kp_first, f"{py_first:.1f} / {kp_first:.1f} s = "
                        f"{py_first / kp_first:.3f}"))
        elif kp.get("capped_at_s"):
            cap = kp["capped_at_s"]
            out.append(("first complete ruleset ≤ 1/20 of kube-proxy's",
                        True if py_first * 20 <= cap else None,
                        f"{py_first:.1f} s against > {cap:.0f} s (its cap): < "
                        f"{py_first / cap:.3f}"))
    if py_first is not None and floor.get("wall_s"):
        out.append(("first complete ruleset ≤ 3 × the kernel floor",
                    py_first <= 3 * floor["wall_s"],
                    f"{py_first:.1f} / {floor['wall_s']:.2f} s = "
                    f"{py_first / floor['wall_s']:.1f}×"))
    change = py.get("one_service_change", {}).get("duration_ms", {})
    if change.get("n"):
        out.append(("one-Service change ≤ 10 ms (the sync, p50)", change["p50"] <= 10,
                    f"p50 {change['p50']} ms, p99 {change['p99']} ms "
                    f"(kernel p50 {py['one_service_change']['kernel_ms']['p50']} ms)"))
    for label, when, key in (("RSS after the first sync", "after_first_sync", "rss_mib"),
                             ("peak RSS at the end", "after_1000_more", "hwm_mib")):
        if when in py and when in kp:
            ours, theirs = py[when][key], kp[when][key]
            out.append((f"{label} ≤ kube-proxy's", ours <= theirs,
                        f"{ours:.0f} / {theirs:.0f} MiB"))
    if py.get("npl_churn_20", {}).get("p99") and kp.get("npl_churn_20", {}).get("p99"):
        ours, theirs = py["npl_churn_20"]["p99"], kp["npl_churn_20"]["p99"]
        out.append(("NPL p99 at 20 changes/s ≤ 1/3 of kube-proxy's", ours * 3 <= theirs,
                    f"{1000 * ours:.0f} / {1000 * theirs:.0f} ms = {ours / theirs:.2f}"))
    return out


def targets_text(result: dict[str, Any]) -> str:
    lines = [f"targets at {result['services']} × {result['endpoints']}:"]
    for name, met, figures in targets(result):
        word = {True: "met", False: "MISSED", None: "not measurable"}[met]
        lines.append(f"  {word:>14}: {name}: {figures}")
    return "\n".join(lines)


# -- the one table of the sizes ------------------------------------------------------------------


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def _at(run: dict[str, Any], *path: str) -> float | None:
    value: Any = run
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "" if ours is None or not theirs else f" ({ours / theirs:.2f})"


def _cells(result: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """One size's (pyproxy, kube-proxy) cells, the ratio pyproxy / kube-proxy in brackets."""
    py, kp = result["runs"].get("pyproxy", {}), result["runs"].get("kube-proxy", {})
    floor = result.get("kernel_floor", {}).get("wall_s")
    out: dict[str, tuple[str, str]] = {}
    first, kp_first = _at(py, "first_ruleset_s"), _at(kp, "first_ruleset_s")
    if kp_first is None and kp.get("capped_at_s"):
        cap = float(kp["capped_at_s"])
        kp_cell = f"> {cap:,.0f} s (its cap: not finished)"
        ratio = "" if first is None else f" (< {first / cap:.3f})"
    else:
        kp_cell, ratio = _fmt(kp_first, " s"), _ratio(first, kp_first)
    floor_note = "" if first is None or not floor else f"; {first / floor:.1f}× the floor"
    out["start → first complete ruleset"] = (f"**{_fmt(first, ' s')}**{ratio}{floor_note}",
                                             kp_cell)
    out["the kernel floor: one `nft -f` of pyproxy's whole ruleset"] = (_fmt(floor, " s", 2), "")

    def pair(label: str, *path: str, scale: float = 1.0, unit: str = "",
             digits: int = 1) -> None:
        ours, theirs = _at(py, *path), _at(kp, *path)
        ours = None if ours is None else ours * scale
        theirs = None if theirs is None else theirs * scale
        out[label] = (_fmt(ours, unit, digits) + _ratio(ours, theirs),
                      _fmt(theirs, unit, digits))

    pair("CPU s to the first sync, children's included", "after_first_sync", "total_cpu_s")
    pair("RSS after the first sync, MiB", "after_first_sync", "rss_mib", digits=0)
    pair("peak RSS at the end, MiB", "after_1000_more", "hwm_mib", digits=0)
    pair("one-Service change, the sync's mean (its histogram), ms", "partial_sync_ms")
    pair("NPL p50, quiet, ms", "npl_quiet", "p50", scale=1000, digits=0)
    pair("NPL p99, quiet, ms", "npl_quiet", "p99", scale=1000, digits=0)
    pair("NPL p50 at 20 changes/s, ms", "npl_churn_20", "p50", scale=1000, digits=0)
    pair("NPL p99 at 20 changes/s, ms", "npl_churn_20", "p99", scale=1000, digits=0)
    pair("the start: API server CPU s", "api_start", "apiserver_cpu_s")
    pair("the start: MiB the API server sent", "api_start", "mib_sent")
    return out


def sizes_table(results: list[dict[str, Any]]) -> str:
    """The sizes side by side: per size pyproxy (its ratio to kube-proxy) and kube-proxy."""
    cells = [_cells(r) for r in results]
    head = "| |" + "".join(f" {_size(r['services'])} × {r['endpoints']}: pyproxy | kube-proxy |"
                           for r in results)
    lines = [head, "|---|" + "---:|---:|" * len(results)]
    for label in cells[0]:
        lines.append(f"| {label} |" + "".join(f" {c[label][0]} | {c[label][1]} |"
                                               for c in cells))
    return "\n".join(lines)


def _size(services: int) -> str:
    return f"{services // 1000}k" if services % 1000 == 0 else str(services)
