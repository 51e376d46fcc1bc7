"""A fleet on one machine: what N kube-proxies, then N pyproxies, cost one real API server.

`make bench-fleet` (root; `make k8s` builds the control plane first; issue 29). One real
control plane (testkit/controlplane.py) loaded through the API with bench/synth.py's cluster
(1,000 Services × 10 endpoints; `--size 10000x10`), and N node namespaces (`--nodes`, default
50), each linked to the control plane by its own veth and with its own Node object. First N
kube-proxies (nftables mode, their default client settings: protobuf, qps 5 / burst 10), then
N pyproxies, on the same loaded cluster; for each fleet, three phases:

(a) start: all N started at once, until every one has made its first sync (the gauge
    `kubeproxy_sync_proxy_rules_last_timestamp_seconds`, which both export, set);
(b) churn: `--churn-rate` endpoint changes per second (20) for `--churn-seconds` (300);
(c) restart: kube-apiserver killed (SIGKILL), `--downtime` seconds (5) down, started
    again, then `--after-seconds` (180) watched;
(d) the churn again for `--after-churn-seconds` (60): what a change costs on the watches
    the restart made.

Measured, per phase: the API server's CPU seconds (/proc, its process; etcd's beside it),
the bytes it sent to the proxies (the transmit counters of the control plane's end of each
node's veth: everything the proxies received, TLS and TCP included), and from its /metrics
the watch events it sent (`apiserver_watch_events_sizes`) and its requests by verb; per node
process: RSS, peak RSS, and CPU with its children's (kube-proxy runs `nft` for every
transaction). In (b), the network programming latency of one probed node (fleet-00), p50 and
p99 from the growth of its proxy's `kubeproxy_network_programming_duration_seconds` histogram
over the phase (each write of the churn carries its own time as the slice's
`endpoints.kubernetes.io/last-change-trigger-time`), interpolated within the buckets as
Prometheus' histogram_quantile does. Every request of the proxies' two ServiceAccounts is in
an audit log (metadata only), so the requests after the restart are counted per node (by its
veth address): lists (a `watch` with sendInitialEvents is a streamed list and counted as one),
watches, 410s, requests per second at the API server, and when each node's EndpointSlice
watch was back.

Before the fleets (`--no-baseline` skips it) the same churn and restart run with no proxy,
so that what the API server spends on the writes themselves and on its own restart can be
told apart from what it spends on the proxies: the per-change-per-node figures subtract it.

kube-proxy writes conntrack sysctls and owns the ruleset of the namespace it runs in: it
is only ever started in one of the lab's node namespaces, which is checked before (the
namespace is neither this process's nor init's) and after (the process is in it) each start.

Prints the table of both fleets and the ratios pyproxy / kube-proxy; the figures go to
bench/results/fleet-SIZE-nN-COMMIT.json (`--json` elsewhere).

`--mixed` runs N/2 kube-proxies and N/2 pyproxies side by side instead, through one start,
one churn and one restart: both fleets then see the same etcd history when the API server
restarts, so whether their watches resume is compared on equal terms. It records where each
restarted watch cache began (a watch from resourceVersion 1 is refused with "too old
resource version: 1 (N)"; one from N or later is served), the position every node's first
watch after the restart asked for and how it was answered, what etcd wrote between the
oldest EndpointSlice position asked and the cache's start (its keys, from a watch of the
whole keyspace through etcd's JSON gateway), and per fleet the requests per second and
when they came (bench/results/fleet-mixed-SIZE-nN-COMMIT.json).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from bench.bench_vs_kube_proxy import (
    CLUSTER_CIDRS,
    MIN_SYNC,
    Churn,
    load,
    proc_figures,
    pyproxy_argv,
)
from bench.bytecode import compile_pyproxy
from bench.synth import Cluster as Synth
from testkit import controlplane
from testkit.controlplane import ControlPlane, Kube
from testkit.inproc import call_in_netns
from testkit.netlab import Netns

REPO = Path(__file__).resolve().parent.parent
FLEETS = ("kube-proxy", "pyproxy")
USERS = {"kube-proxy": "system:serviceaccount:kube-system:kube-proxy",
         "pyproxy": "system:serviceaccount:kube-system:pyproxy"}
# ControlPlane.attach gives each node a /30 of 192.168.200.0/24.
MAX_NODES = 60
# The API server's metric families kept at each sample (all of their series).
METRICS = ("apiserver_request_total", "apiserver_watch_events_sizes_sum",
           "apiserver_watch_events_sizes_count", "apiserver_response_sizes_sum",
           "apiserver_longrunning_requests")
SYNC_GAUGE = re.compile(rb"^kubeproxy_sync_proxy_rules_last_timestamp_seconds(?:\{[^}]*\})? "
                        rb"(\S+)", re.M)
SYNC_COUNT = re.compile(rb"^kubeproxy_sync_proxy_rules_duration_seconds_count(?:\{[^}]*\})? "
                        rb"(\S+)", re.M)
# Network programming latency, from each EndpointSlice's last-change-trigger-time (the churn
# stamps its writes with it) to the commit of the rules. Both proxies have the same buckets
# (upstream's: 0.25 s, 0.5 s, 1 to 59 s by 1 s, 60 to 115 s by 5 s, 120 to 300 s by 30 s;
# pyproxy/serve/metrics.py _NPL_BUCKETS), so p50 and p99 are bucket-interpolated alike:
# below 1 s they cannot be told apart more finely than 0.25 s.
NPL_BUCKET = re.compile(rb'^kubeproxy_network_programming_duration_seconds_bucket\{'
                        rb'(?:[^}]*,)?le="([^"]+)"[^}]*\} (\S+)', re.M)
PROBED = 0  # the node whose latency is read: fleet-00
SETTLE = 3.0  # after a phase, for the last events to reach every node


# -- the audit log: every request of the proxies, metadata only -------------------------------


def audit_args(folder: Path) -> tuple[tuple[str, ...], Path]:
    """The API server's flags for an audit log of the proxies' requests, and its path."""
    policy = folder / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump({
        "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
        # A watch is logged when its response starts (and again when it ends): deduplicated
        # by auditID, each request counts once at the time it was received.
        "omitStages": ["RequestReceived"],
        "rules": [{"level": "Metadata", "users": list(USERS.values())}, {"level": "None"}]}))
    log = folder / "audit.log"
    return (f"--audit-policy-file={policy}", f"--audit-log-path={log}",
            "--audit-log-maxsize=0", "--audit-log-maxbackup=0"), log


@dataclass(frozen=True)
class Request:
    received: float  # wall time
    user: str
    source: str
    verb: str  # list (a streamed one too), watch, get, create…
    resource: str
    uri: str
    code: int
    lasted: float | None = None  # seconds to its response's end (None: never ended)
    streamed: bool = False  # a watch with sendInitialEvents: a list, then the watch


def read_audit(path: Path) -> list[Request]:
    events: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return []
    with path.open() as fh:
        for line in fh:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by a SIGKILL
            previous = events.get(event["auditID"])
            # keep the last stage's status (a watch refused with 410 has only ResponseComplete)
            if previous is None or event.get("stage") == "ResponseComplete":
                events[event["auditID"]] = event
    out = []
    for event in events.values():
        uri = event.get("requestURI", "")
        verb = event.get("verb", "")
        streamed = verb == "watch" and "sendInitialEvents=true" in uri
        if streamed:
            verb = "list"
        received = datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        ended = (datetime.fromisoformat(event["stageTimestamp"]).timestamp()
                 if event.get("stage") == "ResponseComplete" and "stageTimestamp" in event
                 else None)
        out.append(Request(
            received=received,
            user=event.get("user", {}).get("username", ""),
            source=(event.get("sourceIPs") or [""])[0], verb=verb,
            resource=(event.get("objectRef") or {}).get("resource", ""), uri=uri,
            code=int((event.get("responseStatus") or {}).get("code") or 0),
            lasted=None if ended is None else ended - received, streamed=streamed))
    return sorted(out, key=lambda r: r.received)


# -- the nodes ----------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    ns: Netns
    address: str  # its end of the link: the API server sees its requests from there
    cp_ifname: str  # the control plane's end: what it transmits is what the node received
    proc: subprocess.Popen[str] | None = None
    started_wall: float = 0.0
    first_sync_s: float | None = None
    first_sync_exact: bool = True


def netns_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def refuse_unless_node_netns(ns: Netns) -> None:
    """A proxy starts only in a namespace of the lab: never this process's nor init's."""
    target = netns_id(f"/run/netns/{ns.full}")
    for other in ("/proc/self/ns/net", "/proc/1/ns/net"):
        try:
            same = netns_id(other) == target
        except PermissionError:  # init of another PID namespace (a container's host)
            continue
        if same:
            raise RuntimeError(f"{ns.full} is {other}: refusing to start a proxy there")


def check_in_node_netns(node: Node, timeout: float = 10.0) -> None:
    """Once `ip netns exec` has exec'd the proxy, the process is in the node's namespace
    (else it is killed: it must not touch another namespace's sysctls or ruleset)."""
    assert node.proc is not None
    pid = node.proc.pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and node.proc.poll() is None:
        try:
            if Path(os.readlink(f"/proc/{pid}/exe")).name != "ip":
                if netns_id(f"/proc/{pid}/ns/net") != netns_id(f"/run/netns/{node.ns.full}"):
                    node.proc.kill()
                    raise RuntimeError(f"the proxy of {node.name} is not in {node.ns.full}")
                return
        except FileNotFoundError:
            break
        time.sleep(0.01)
    if node.proc.poll() is not None:
        raise RuntimeError(f"the proxy of {node.name} exited ({node.proc.returncode})")
    raise RuntimeError(f"the proxy of {node.name} not started within {timeout} s")


def make_nodes(plane: ControlPlane, kube: Kube, count: int) -> list[Node]:
    nodes = []
    for i in range(count):
        name = f"fleet-{i:02d}"
        ns = plane.lab.add_ns(name)
        attachment = plane.attach(ns)
        link = next(lk for lk in plane.lab.links if lk.ns_b is ns)
        kube.node(name, (attachment.address,), zone=f"zone-{1 + i % 2}", region="region-1")
        nodes.append(Node(name, ns, attachment.address, link.if_a))
    return nodes


def node_metrics(node: Node) -> bytes | None:
    """The node's proxy's /metrics (a process starving for CPU answers slowly: 10 s
    allowed); None when nothing answers."""
    def get() -> bytes:
        with urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=10) as r:
            return bytes(r.read())
    try:
        return call_in_netns(node.ns.full, get, timeout=15)
    except (OSError, TimeoutError):
        return None


def last_sync(node: Node) -> tuple[float, int]:
    """The node's proxy's last sync (Unix time; 0 before the first) and how many syncs it
    has made, from its metrics."""
    text = node_metrics(node)
    if text is None:
        return 0.0, 0
    found, count = SYNC_GAUGE.search(text), SYNC_COUNT.search(text)
    return (float(found.group(1)) if found else 0.0,
            int(float(count.group(1))) if count else 0)


def npl_buckets(text: bytes) -> dict[float, float]:
    """The cumulative buckets (upper bound → count) of the network programming latency
    histogram in a /metrics text, its series added up (kube-proxy's has one per IP family)."""
    out: dict[float, float] = defaultdict(float)
    for le, count in NPL_BUCKET.findall(text):
        out[float(le)] += float(count)
    return dict(out)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative buckets (upper bound → count, +Inf
    among them): the bucket the q-th observation falls in, interpolated linearly within it
    (from 0 for the first bucket); in the +Inf bucket, the highest finite bound. NaN with
    no observation. A figure read this way is only as fine as the buckets around it."""
    bounds = sorted(buckets)
    if len(bounds) < 2 or bounds[-1] != float("inf") or not 0 <= q <= 1:
        return float("nan")
    counts = [buckets[b] for b in bounds]
    for i in range(1, len(counts)):  # as Prometheus: a count never goes down
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return float("nan")
    rank = q * total
    i = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if i == len(bounds) - 1:
        return bounds[-2]
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    start, below = (0.0, 0.0) if i == 0 else (bounds[i - 1], counts[i - 1])
    return start + (bounds[i] - start) * (rank - below) / (counts[i] - below)


def npl_figures(node: str, before: bytes | None, after: bytes | None) -> dict[str, Any]:
    """The network programming latency one node's proxy observed between two scrapes of
    its histogram: the buckets' growth, its count, p50 and p99 (bucket-interpolated)."""
    if before is None or after is None:
        return {"node": node, "observations": 0, "p50_s": None, "p99_s": None,
                "error": "no metrics " + ("before" if before is None else "after")}
    first, last = npl_buckets(before), npl_buckets(after)
    grown = {le: count - first.get(le, 0.0) for le, count in last.items()}
    p50, p99 = histogram_quantile(0.5, grown), histogram_quantile(0.99, grown)
    return {"node": node, "observations": int(grown.get(float("inf"), 0.0)),
            "p50_s": None if p50 != p50 else round(p50, 4),
            "p99_s": None if p99 != p99 else round(p99, 4),
            "buckets": {str(le): count for le, count in sorted(grown.items()) if count}}


def all_figures(pid: int) -> dict[str, float]:
    """proc_figures with the CPU of the children it waited for (kube-proxy's `nft` runs)."""
    figures = proc_figures(pid)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    figures["children_cpu_s"] = (int(stat[13]) + int(stat[14])) / os.sysconf("SC_CLK_TCK")
    figures["total_cpu_s"] = figures["cpu_s"] + figures["children_cpu_s"]
    return figures


# -- samples of the control plane and the nodes -------------------------------------------------


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def apiserver_metrics(plane: ControlPlane) -> dict[str, float]:
    api = plane.admin_client()
    try:
        response = api.call_api("GET", f"{plane.url}/metrics", _request_timeout=30)
        text = response.read().decode()
    finally:
        api.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(METRICS):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


# The proxies' resources: where a restarted API server's watch cache of each begins.
CACHED = {"services": "/api/v1/services", "nodes": "/api/v1/nodes",
          "endpointslices": "/apis/discovery.k8s.io/v1/endpointslices",
          "servicecidrs": "/apis/networking.k8s.io/v1/servicecidrs"}
TOO_OLD = re.compile(r"too old resource version: \d+ \((\d+)\)")


def cache_starts(plane: ControlPlane) -> dict[str, int]:
    """resource → the revision its (restarted) watch cache listed etcd at: a watch from
    resourceVersion 1 is refused with "too old resource version: 1 (that revision)"
    (watchCacheHistory.GetIntervalLocked), and one from it or later is served."""
    api = plane.admin_client()
    out: dict[str, int] = {}
    try:
        for resource, path in CACHED.items():
            try:
                response = api.call_api(
                    "GET", f"{plane.url}{path}?watch=true&resourceVersion=1&timeoutSeconds=1",
                    header_params={"Accept": "application/json"}, _request_timeout=10)
                text = response.read().decode(errors="replace")
            except Exception as err:  # a 410 raised by the client: its body says the same
                text = str(getattr(err, "body", "") or err)
            if found := TOO_OLD.search(text):
                out[resource] = int(found.group(1))
    finally:
        api.close()
    return out


def etcd_history(plane: ControlPlane, first: int, last: int) -> list[dict[str, Any]]:
    """Every write etcd made from revision `first` to `last` (its key and revision), from a
    watch of the whole keyspace from `first` through etcd's JSON gateway (the embedded
    etcd serves it on its client URL), read for two seconds."""
    body = json.dumps({"create_request": {
        "key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode(),
        "start_revision": str(first)}})

    def read() -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", 2379, timeout=2)
        chunks = []
        try:
            conn.request("POST", "/v3/watch", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            while True:
                chunk = response.read1(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except TimeoutError:
            pass
        finally:
            conn.close()
        return b"".join(chunks)

    return etcd_writes(call_in_netns(plane.ns.full, read).decode(), first, last)


def etcd_writes(text: str, first: int, last: int) -> list[dict[str, Any]]:
    """The writes from revision `first` to `last` in the messages of etcd's JSON watch
    (concatenated JSON objects; keys base64), by revision."""
    writes = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            message, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        for event in message.get("result", {}).get("events", []):
            kv = event.get("kv", {})
            revision = int(kv.get("mod_revision", 0))
            if first <= revision <= last:
                writes.append({"revision": revision, "type": event.get("type", "PUT"),
                               "key": base64.b64decode(kv.get("key", "")).decode(
                                   errors="replace")})
    return sorted(writes, key=lambda w: w["revision"])


@dataclass
class Sample:
    wall: float
    apiserver_cpu: float
    etcd_cpu: float
    tx: dict[str, int]  # node name → bytes the control plane sent it
    metrics: dict[str, float]
    procs: dict[str, dict[str, float]] = field(default_factory=dict)


def sample(plane: ControlPlane, nodes: list[Node]) -> Sample:
    assert plane.apiserver is not None and plane.etcd is not None
    links = json.loads(plane.lab.ip(plane.ns, "-j", "-s", "link", "show").stdout)
    tx = {link["ifname"]: int(link["stats64"]["tx"]["bytes"]) for link in links}
    procs = {n.name: all_figures(n.proc.pid) for n in nodes
             if n.proc is not None and n.proc.poll() is None}
    return Sample(time.time(), cpu_seconds(plane.apiserver.pid), cpu_seconds(plane.etcd.pid),
                  {n.name: tx.get(n.cp_ifname, 0) for n in nodes}, apiserver_metrics(plane),
                  procs)


def delta(before: Sample, after: Sample, *, restarted: bool = False) -> dict[str, Any]:
    """What one phase cost: the API server's CPU (a restarted one: all of the new
    process's), etcd's, the bytes sent to the nodes, metric increments."""
    def increments() -> dict[str, float]:
        out = {}
        for series, value in after.metrics.items():
            if series.startswith("apiserver_longrunning_requests"):
                continue
            grown = value - (0.0 if restarted else before.metrics.get(series, 0.0))
            if grown:
                out[series] = grown
        return out
    sent = {name: after.tx[name] - before.tx.get(name, 0) for name in after.tx}
    return {"seconds": round(after.wall - before.wall, 2),
            "apiserver_cpu_s": round(after.apiserver_cpu
                                     - (0.0 if restarted else before.apiserver_cpu), 3),
            "etcd_cpu_s": round(after.etcd_cpu - before.etcd_cpu, 3),
            "bytes_sent": sum(sent.values()), "bytes_sent_per_node": sent,
            "watch_events": watch_events(increments()), "requests": requests(increments())}


def watch_events(grown: dict[str, float]) -> dict[str, dict[str, float]]:
    """resource → watch events sent and their bytes (as the API server serialized them)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"events": 0.0, "bytes": 0.0})
    for series, value in grown.items():
        if series.startswith("apiserver_watch_events_sizes_"):
            resource = _label(series, "resource")
            out[resource]["bytes" if "_sum" in series else "events"] += value
    return dict(out)


def requests(grown: dict[str, float]) -> dict[str, float]:
    """"VERB resource" → requests the API server answered (every client)."""
    out: Counter[str] = Counter()
    for series, value in grown.items():
        if series.startswith("apiserver_request_total"):
            out[f"{_label(series, 'verb')} {_label(series, 'resource')}"] += int(value)
    return dict(out)


def _label(series: str, name: str) -> str:
    found = re.search(rf'[{{,]{name}="([^"]*)"', series)
    return found.group(1) if found else ""


# -- one fleet ----------------------------------------------------------------------------------


@dataclass
class Bench:
    plane: ControlPlane
    kube: Kube
    synth: Synth
    nodes: list[Node]
    args: argparse.Namespace
    audit_log: Path
    kubeconfigs: dict[str, Path]
    generation: int = 0

    def starter(self, fleet: str, node: Node) -> list[str]:
        workdir = self.plane.lab.workdir
        if fleet == "kube-proxy":
            config = controlplane.kube_proxy_config(workdir / f"kube-proxy-{node.name}.yaml",
                                       self.kubeconfigs[fleet], node.name, CLUSTER_CIDRS,
                                       MIN_SYNC, "30s")
            return [str(self.plane.bin / "kube-proxy"), f"--config={config}"]
        return pyproxy_argv(self.kubeconfigs[fleet], node.name)

    def start(self, fleet: str) -> dict[str, Any]:
        """(a) every proxy started at once, until each has synced once."""
        return self.start_fleets({fleet: self.nodes})

    def start_fleets(self, fleets: dict[str, list[Node]]) -> dict[str, Any]:
        """(a) for one fleet or several side by side (--mixed): every proxy started at once,
        until each has synced once. With several, the audit figures are per fleet."""
        before = sample(self.plane, self.nodes)
        started = [(fleet, node) for fleet, nodes in fleets.items() for node in nodes]
        for fleet, node in started:
            refuse_unless_node_netns(node.ns)
            node.first_sync_s = None
            node.started_wall = time.time()
            node.proc = self.plane.lab.popen(node.ns, self.starter(fleet, node),
                                             log_name=f"{fleet}-{node.name}.log")
        for _, node in started:
            check_in_node_netns(node)
        deadline = time.monotonic() + self.args.start_timeout
        waiting = [node for _, node in started]
        names = ", ".join(fleets)
        with ThreadPoolExecutor(len(waiting)) as pool:
            while waiting and time.monotonic() < deadline:
                for node, (synced, count) in zip(waiting, pool.map(last_sync, waiting),
                                                 strict=True):
                    if synced > 0:
                        # the gauge is the last sync's time: the first's only while there
                        # has been one (a later one, every syncPeriod, is an upper bound)
                        node.first_sync_s = round(synced - node.started_wall, 3)
                        node.first_sync_exact = count <= 1
                    elif node.proc is not None and node.proc.poll() is not None:
                        raise RuntimeError(f"{names} on {node.name} exited "
                                           f"({node.proc.returncode}); see its log in "
                                           f"{self.plane.lab.workdir}")
                waiting = [n for n in waiting if n.first_sync_s is None]
                time.sleep(0.5)
        if waiting:
            raise RuntimeError(f"{names}: {len(waiting)} nodes not synced within "
                               f"{self.args.start_timeout} s")
        time.sleep(SETTLE)
        after = sample(self.plane, self.nodes)
        nodes = [node for _, node in started]
        syncs = sorted(n.first_sync_s or 0.0 for n in nodes)
        log = read_audit(self.audit_log)
        audits = {fleet: audit_summary(log, USERS.get(fleet), before.wall, after.wall, members)
                  for fleet, members in fleets.items()}
        return {**delta(before, after), "first_sync_s": {n.name: n.first_sync_s
                                                          for n in nodes},
                "first_sync_p50_s": statistics.median(syncs), "first_sync_max_s": syncs[-1],
                "first_sync_upper_bounds": [n.name for n in nodes if not n.first_sync_exact],
                "procs": after.procs,
                "audit": next(iter(audits.values())) if len(audits) == 1 else audits}

    def churn(self, seconds: float) -> dict[str, Any]:
        """(b) endpoint changes at --churn-rate for `seconds`."""
        self.generation += 1
        probed = self.nodes[PROBED]
        # the probed node's latency histogram right before and right after (no proxy in the
        # baseline: nothing answers, no figure)
        npl_before = node_metrics(probed) if probed.proc is not None else None
        before = sample(self.plane, self.nodes)
        with Churn(self.kube, self.synth, self.args.churn_rate, self.generation) as churn:
            time.sleep(seconds)
        changes = churn.done
        time.sleep(SETTLE)
        npl_after = node_metrics(probed) if probed.proc is not None else None
        after = sample(self.plane, self.nodes)
        # Watches started meanwhile: a streamed list's stream (gzipped) ended, a plain one
        # (not gzipped) took over.
        watches = Counter(r.source for r in read_audit(self.audit_log)
                          if before.wall <= r.received <= after.wall and r.verb == "watch")
        return {**delta(before, after), "changes": changes,
                "rate": round(changes / seconds, 2), "procs_before": before.procs,
                "procs": after.procs, "nodes_whose_watches_rolled_over": len(watches),
                **({"npl_probed_node": npl_figures(probed.name, npl_before, npl_after)}
                   if probed.proc is not None else {})}

    def restart(self, fleet: str | None) -> dict[str, Any]:
        """(c) kube-apiserver killed, down --downtime s, started, watched --after-seconds."""
        return self.restart_fleets({fleet: self.nodes} if fleet else {})

    def restart_fleets(self, fleets: dict[str, list[Node]]) -> dict[str, Any]:
        """(c) for no fleet (the baseline), one, or several side by side (--mixed); also
        where the restarted API server's watch caches begin (a watch resumes from a
        resourceVersion at or after it) and what etcd wrote before that."""
        before = sample(self.plane, self.nodes)
        killed = time.time()
        self.plane.kill_apiserver()
        time.sleep(self.args.downtime)
        started = time.time()
        self.plane.start_apiserver()
        ready = time.time()
        caches = cache_starts(self.plane)
        time.sleep(self.args.after_seconds)
        after = sample(self.plane, self.nodes)
        # The proxies are answered as soon as it listens, before /readyz says ready.
        log = read_audit(self.audit_log)
        audits = {name: audit_summary(log, USERS[name], killed, after.wall, members,
                                      back_from=started)
                  for name, members in fleets.items()}
        result: dict[str, Any] = {
            **delta(before, after, restarted=True),
            "started_after_kill_s": round(started - killed, 2),
            "ready_after_start_s": round(ready - started, 2),
            "procs_before": before.procs, "procs": after.procs, "cache_starts": caches}
        if len(audits) <= 1:
            result["audit"] = (next(iter(audits.values())) if audits else audit_summary(
                log, "", killed, after.wall, self.nodes, back_from=started))
        else:
            result["audit"] = audits
        # What etcd wrote between the oldest EndpointSlice position a proxy resumed from and
        # the revision the restarted cache began at: why a watch could (not) resume.
        asked = [int(rv) for audit in audits.values() for n in audit["per_node"].values()
                 if (rv := n["asked_after_restart"].get("endpointslices", "")).isdigit()]
        begins = caches.get("endpointslices")
        if asked and begins:
            try:
                result["etcd_writes"] = etcd_history(self.plane, min(asked), begins + 3)
            except Exception as err:  # a figure, not the bench's purpose
                result["etcd_writes"] = {"error": f"{type(err).__name__}: {err}"}
        return result

    def stop(self) -> None:
        running = [n for n in self.nodes if n.proc is not None]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: self.plane.lab.stop_process(n.proc), running))
        for node in self.nodes:
            node.proc = None
            # the node's own namespace (never the root's): the next fleet starts clean
            self.plane.lab.run(node.ns, ["nft", "flush", "ruleset"])

    def fleet(self, fleet: str) -> dict[str, Any]:
        print(f"{fleet}: starting {len(self.nodes)}…", flush=True)
        try:
            result = {"start": self.start(fleet)}
            print(f"  synced: p50 {result['start']['first_sync_p50_s']:.1f} s, "
                  f"max {result['start']['first_sync_max_s']:.1f} s; churn "
                  f"{self.args.churn_seconds:.0f} s…", flush=True)
            result["churn"] = self.churn(self.args.churn_seconds)
            print("  restarting the API server…", flush=True)
            result["restart"] = self.restart(fleet)
            if self.args.after_churn_seconds:
                # the watches the restart made: streamed lists read on as watches?
                print(f"  churn {self.args.after_churn_seconds:.0f} s…", flush=True)
                result["churn_after_restart"] = self.churn(self.args.after_churn_seconds)
        finally:
            self.stop()
        return result

    def mixed(self) -> dict[str, Any]:
        """--mixed: half the nodes kube-proxies, half pyproxies, side by side on one control
        plane through one start, one churn and one restart: at the restart both fleets see
        the same etcd history, so a difference in how their watches resume is theirs."""
        half = len(self.nodes) // 2
        fleets = {"kube-proxy": self.nodes[:half], "pyproxy": self.nodes[half:]}
        print(f"mixed: {half} kube-proxies and {len(self.nodes) - half} pyproxies…",
              flush=True)
        try:
            result = {"start": self.start_fleets(fleets)}
            print(f"  synced: max {result['start']['first_sync_max_s']:.1f} s; churn "
                  f"{self.args.churn_seconds:.0f} s…", flush=True)
            result["churn"] = self.churn(self.args.churn_seconds)
            print("  restarting the API server…", flush=True)
            result["restart"] = self.restart_fleets(fleets)
        finally:
            self.stop()
        return result

    def baseline(self) -> dict[str, Any]:
        print(f"baseline (no proxy): churn {self.args.baseline_seconds:.0f} s, restart…",
              flush=True)
        return {"churn": self.churn(self.args.baseline_seconds), "restart": self.restart(None)}


def audit_summary(log: list[Request], user: str | None, since: float, until: float,
                  nodes: list[Node], back_from: float | None = None) -> dict[str, Any]:
    """The proxies' requests in [since, until]: per node, lists by resource, watches, 410s;
    requests per second (from since); with `back_from` (the API server started again): when
    each node's EndpointSlice watch was back."""
    by_address = {n.address: n.name for n in nodes}
    window = [r for r in log if since <= r.received <= until and r.user == user]
    per_node: dict[str, dict[str, Any]] = {
        n.name: {"lists": Counter(), "watches": 0, "gone_410": 0, "requests": 0,
                 "slices_watch_back_s": None, "asked_after_restart": {},
                 "first_answer_after_restart": {}} for n in nodes}
    for r in window:
        node = per_node.get(by_address.get(r.source, ""))
        if node is None:
            continue
        node["requests"] += 1
        if (back_from is not None and r.received >= back_from and r.verb == "watch"
                and r.resource not in node["asked_after_restart"]):
            # the position its first watch after the restart resumed from, and the answer:
            # 200 and lasting (resumed), 200 and ended at once (a 410 ERROR event), 403…
            asked = re.search(r"[?&]resourceVersion=(\d*)", r.uri)
            node["asked_after_restart"][r.resource] = asked.group(1) if asked else ""
            node["first_answer_after_restart"][r.resource] = (
                "resumed" if r.code == 200 and (r.lasted is None or r.lasted > 1.0)
                else "gone" if r.code in (200, 410) else str(r.code))
        if r.code == 410:
            node["gone_410"] += 1
        if r.verb == "list":
            node["lists"][r.resource] += 1
        else:
            node["watches"] += r.verb == "watch"
        # back: a watch (a streamed list is one) that stayed; one that ended at once
        # carried a 410 ERROR event
        if ((r.verb == "watch" or r.streamed) and back_from is not None
                and r.resource == "endpointslices" and r.code < 400
                and (r.lasted is None or r.lasted > 1.0)
                and node["slices_watch_back_s"] is None and r.received >= back_from):
            node["slices_watch_back_s"] = round(r.received - back_from, 2)
    per_second = Counter(int(r.received - since) for r in window)
    lists = [sum(n["lists"].values()) for n in per_node.values()]
    back = [n["slices_watch_back_s"] for n in per_node.values()]
    # when the requests came, in seconds after the API server's start (or `since`)
    times = sorted(r.received - (back_from or since) for r in window
                   if r.source in by_address)
    spread = ({f"p{q}": round(times[min(len(times) - 1, int(q / 100 * len(times)))], 2)
               for q in (0, 10, 50, 90, 100)} if times else {})
    return {"requests": len(window), "lists": sum(lists), "lists_max_per_node": max(lists),
            "request_times_s": spread,
            "slices_resumed": sum(1 for n in per_node.values()
                                  if not n["lists"].get("endpointslices")),
            "nodes_that_listed": sum(1 for n in lists if n),
            "gone_410": sum(n["gone_410"] for n in per_node.values()),
            "requests_per_second_max": max(per_second.values(), default=0),
            "requests_per_second": [per_second.get(s, 0)
                                    for s in range(int(until - since) + 1)],
            "slices_watch_back_max_s": None if None in back or not back else max(back),
            "per_node": {name: {**n, "lists": dict(n["lists"])}
                         for name, n in per_node.items()}}


# -- the report ----------------------------------------------------------------------------------


def per_change_per_node(phase: dict[str, Any], base: dict[str, Any] | None, key: str,
                        nodes: int) -> float:
    """A churn figure per change per node, the same churn without proxies subtracted (by
    rate: the baseline may be shorter)."""
    changes = max(1, int(phase["changes"]))
    value = float(phase[key]) / changes
    if base is not None and key == "apiserver_cpu_s":
        value -= base[key] / max(1, base["changes"])
    return value / nodes


def node_stat(procs: dict[str, dict[str, float]], key: str, how: str = "p50") -> float:
    values = sorted(p[key] for p in procs.values())
    if not values:
        return float("nan")
    return values[-1] if how == "max" else statistics.median(values)


def rows(result: dict[str, Any], base: dict[str, Any] | None,
         nodes: int) -> list[tuple[str, float]]:
    start, churn, restart = result["start"], result["churn"], result["restart"]
    node_cpu_churn = [churn["procs"][name]["total_cpu_s"]
                      - churn["procs_before"][name]["total_cpu_s"] for name in churn["procs"]]
    npl = churn.get("npl_probed_node") or {}
    return [
        ("(a) start: API server CPU s", start["apiserver_cpu_s"]),
        ("(a) start: bytes sent to the proxies, MiB", start["bytes_sent"] / 2**20),
        ("(a) start → first sync, p50 / max of the nodes (s)", start["first_sync_p50_s"]),
        ("", start["first_sync_max_s"]),
        ("(a) node CPU s to the first sync incl. children, p50", node_stat(
            start["procs"], "total_cpu_s")),
        ("(a) node RSS after it, p50 (MiB)", node_stat(start["procs"], "rss_mib")),
        ("(b) changes/s reached", churn["rate"]),
        ("(b) API server CPU ms per change per node" + (" (writes subtracted)" if base else ""),
         1000 * per_change_per_node(churn, base["churn"] if base else None,
                                    "apiserver_cpu_s", nodes)),
        ("(b) bytes sent per change per node", per_change_per_node(
            churn, None, "bytes_sent", nodes)),
        ("(b) nodes whose watches were started again meanwhile (gzip ended)",
         churn["nodes_whose_watches_rolled_over"]),
        ("(b) node CPU ms per change, p50 (children incl.)",
         1000 * statistics.median(node_cpu_churn) / max(1, churn["changes"])),
        # from the write's trigger time to the commit of its rules; bucket-interpolated
        ("(b) NPL of one probed node, p50 / p99 (s)", _or_nan(npl.get("p50_s"))),
        ("", _or_nan(npl.get("p99_s"))),
        ("(c) API server CPU s, restart + window", restart["apiserver_cpu_s"]),
        ("(c) the same above the restart without proxies", restart["apiserver_cpu_s"]
         - (base["restart"]["apiserver_cpu_s"] if base else float("nan"))),
        ("(c) bytes sent to the proxies, MiB", restart["bytes_sent"] / 2**20),
        ("(c) lists after the restart, all nodes", restart["audit"]["lists"]),
        ("(c) lists per node, max", restart["audit"]["lists_max_per_node"]),
        ("(c) proxies' requests/s at the API server, max", restart["audit"][
            "requests_per_second_max"]),
        ("(c) last node's EndpointSlice watch back (s after the API server's start)",
         restart["audit"]["slices_watch_back_max_s"] or float("nan")),
        ("(d) after it: bytes sent per change per node", per_change_per_node(
            result["churn_after_restart"], None, "bytes_sent", nodes)
         if "churn_after_restart" in result else float("nan")),
        ("node RSS at the end, p50 / max (MiB)", node_stat(restart["procs"], "rss_mib")),
        ("", node_stat(restart["procs"], "rss_mib", "max")),
        ("node peak RSS, max (MiB)", node_stat(restart["procs"], "hwm_mib", "max")),
    ]


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def table(report: dict[str, Any]) -> str:
    fleets = {name: fleet for name, fleet in report["fleets"].items() if "error" not in fleet}
    n = report["nodes"]
    base = report.get("baseline")
    head = (f"| {report['services']} × {report['endpoints']}, N = {n} | pyproxy | kube-proxy "
            "| pyproxy / kube-proxy |")
    lines = [head, "|---|---:|---:|---:|"]
    py = rows(fleets["pyproxy"], base, n) if "pyproxy" in fleets else None
    kp = rows(fleets["kube-proxy"], base, n) if "kube-proxy" in fleets else None
    for i, (label, _) in enumerate(py or kp or []):
        ours = py[i][1] if py else float("nan")
        theirs = kp[i][1] if kp else float("nan")
        ratio = ours / theirs if theirs else float("nan")
        lines.append(f"| {label or '…'} | {ours:.2f} | {theirs:.2f} | {ratio:.2f} |")
    if sizes := report.get("wire_sizes"):
        lines.append("\none EndpointSlice on the wire: " + ", ".join(
            f"{k} {v:,} B" for k, v in sizes.items()))
    if base:
        lines.append(f"without proxies: churn {base['churn']['changes']} changes, API "
                     f"server {base['churn']['apiserver_cpu_s']:.2f} CPU s; restart + window "
                     f"{base['restart']['apiserver_cpu_s']:.2f} CPU s")
    return "\n".join(lines)


def mixed_table(result: dict[str, Any]) -> str:
    """--mixed: per fleet, how its watches came back after the restart and how spread its
    requests were; where the restarted caches began and what etcd wrote before."""
    restart = result["restart"]
    lines = ["| after the restart | " + " | ".join(restart["audit"]) + " |",
             "|---|" + "---:|" * len(restart["audit"])]

    def row(label: str, fn: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(str(fn(a)) for a in restart["audit"].values())
                     + " |")

    row("nodes", lambda a: len(a["per_node"]))
    row("EndpointSlice watch resumed (no slice list)", lambda a: a["slices_resumed"])
    for resource in CACHED:
        row(f"{resource}: positions asked, first watch", lambda a, r=resource: " ".join(
            sorted({n["asked_after_restart"].get(r, "-") for n in a["per_node"].values()})))
        row(f"{resource}: its answers", lambda a, r=resource: " ".join(
            f"{k}×{v}" for k, v in sorted(Counter(n["first_answer_after_restart"].get(
                r, "-") for n in a["per_node"].values()).items())))
    row("lists", lambda a: a["lists"])
    row("requests", lambda a: a["requests"])
    row("requests/s max", lambda a: a["requests_per_second_max"])
    row("request times p0/p10/p50/p90/p100 (s after start)",
        lambda a: "/".join(f"{v:.1f}" for v in a["request_times_s"].values()))
    lines.append(f"\ncaches began at {restart['cache_starts']}")
    writes = restart.get("etcd_writes")
    if isinstance(writes, list):
        lines.append("etcd writes from the oldest slice position asked to the slice cache's "
                     "start (+3): " + ", ".join(f"{w['revision']} {w['key']}"
                                                for w in writes[-12:]))
    return "\n".join(lines)


def change_events(plane: ControlPlane, kube: Kube, synth: Synth) -> dict[str, bytes]:
    """One endpoint change of a synthetic EndpointSlice as each client reads it off a plain
    watch, JSON and protobuf (the whole response: the event, and the frame's 4-byte length
    for protobuf); the object alone in JSON; and the whole list of slices both ways."""
    key = synth.key(0)
    path = f"/apis/discovery.k8s.io/v1/namespaces/{key.namespace}/endpointslices"
    name = synth.endpoint_slice(0, synth.initial_endpoints(0))["metadata"]["name"]
    api = plane.admin_client()
    json_type, proto_type = "application/json", "application/vnd.kubernetes.protobuf"

    def get(url: str, accept: str) -> bytes:
        response = api.call_api("GET", f"{plane.url}{url}", header_params={"Accept": accept},
                                _request_timeout=30)
        return bytes(response.read())

    try:
        as_json = get(f"{path}/{name}", json_type)
        obj = json.loads(as_json)
        version = obj["metadata"]["resourceVersion"]
        endpoints = obj["endpoints"]
        endpoints[0]["addresses"] = ["10.255.0.1"]
        kube.discovery.patch_namespaced_endpoint_slice(name, key.namespace,
                                                       {"endpoints": endpoints})
        # the watch from before the change replays it, then ends after a second
        watch = (f"{path}?watch=true&resourceVersion={version}&timeoutSeconds=1"
                 f"&fieldSelector=metadata.name%3D{name}")
        lists = "/apis/discovery.k8s.io/v1/endpointslices"
        return {"object_json": as_json,
                "watch_event_json": get(watch, json_type),
                "watch_event_protobuf": get(watch, proto_type),
                "slice_list_json": get(lists, json_type),
                "slice_list_protobuf": get(lists, proto_type)}
    finally:
        api.close()


def wire_sizes(plane: ControlPlane, kube: Kube, synth: Synth) -> dict[str, int]:
    """One endpoint change of a synthetic EndpointSlice as each client reads it off a watch:
    JSON (pyproxy with contentType application/json), protobuf (kube-proxy's default
    contentType, and pyproxy's on plain watches); the object alone in JSON with and without
    its managedFields; and the whole list in both."""
    return sizes_of(change_events(plane, kube, synth))


def sizes_of(raw: dict[str, bytes]) -> dict[str, int]:
    obj = json.loads(raw["object_json"])
    obj["metadata"].pop("managedFields", None)
    event_json, event_proto = raw["watch_event_json"], raw["watch_event_protobuf"]
    # A streamed list's stream (watch-list, kube-proxy's first watch of each resource
    # until it ends after 5 to 10 minutes) is gzipped by the server event by event, for
    # a client that accepts gzip (level 1, one gzip member per flush): as compressed here.
    return {"watch_event_json": len(event_json),
            "watch_event_protobuf": len(event_proto),
            "watch_event_json_gzip": len(gzip.compress(event_json, compresslevel=1)),
            "watch_event_protobuf_gzip": len(gzip.compress(event_proto, compresslevel=1)),
            "slice_json": len(raw["object_json"]),
            "slice_json_without_managed_fields": len(json.dumps(obj, separators=(",", ":"))),
            "slice_list_json": len(raw["slice_list_json"]),
            "slice_list_protobuf": len(raw["slice_list_protobuf"])}


def commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=50,
                        help=f"node processes per fleet (default %(default)s, at most "
                             f"{MAX_NODES})")
    parser.add_argument("--size", default="1000x10", help="SERVICESxENDPOINTS")
    parser.add_argument("--churn-seconds", type=float, default=300.0)
    parser.add_argument("--churn-rate", type=float, default=20.0, help="changes per second")
    parser.add_argument("--baseline-seconds", type=float, default=60.0,
                        help="the churn without proxies")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--downtime", type=float, default=5.0,
                        help="seconds the API server stays down")
    parser.add_argument("--after-seconds", type=float, default=180.0,
                        help="watched after the restarted API server answers")
    parser.add_argument("--after-churn-seconds", type=float, default=60.0,
                        help="(d) the churn again after the restart (0: skipped)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--order", default=",".join(FLEETS),
                        type=lambda s: [name for name in s.split(",") if name])
    parser.add_argument("--mixed", action="store_true",
                        help="instead of one fleet after the other: N/2 kube-proxies and "
                             "N/2 pyproxies side by side through one start, churn and "
                             "restart (the same etcd history at the restart for both)")
    parser.add_argument("--json", help="default: bench/results/fleet-SIZE-nN-COMMIT.json "
                                       "(fleet-mixed-… with --mixed)")
    parser.add_argument("--logs", help="copy the proxies' and the API server's logs here")
    args = parser.parse_args()
    if args.mixed and args.nodes < 2:
        parser.error("--mixed: at least 2 nodes (half of each)")
    if not 1 <= args.nodes <= MAX_NODES:
        parser.error(f"--nodes: 1 to {MAX_NODES}")
    if unknown := set(args.order) - set(FLEETS):
        parser.error(f"--order: unknown {', '.join(sorted(unknown))}")
    services, endpoints = (int(x) for x in args.size.split("x"))
    bin_dir = controlplane.binaries_dir()
    if controlplane.missing_binaries(bin_dir):
        print(f"run `make k8s` first ({bin_dir})", file=sys.stderr)
        return 2
    compile_pyproxy()
    report: dict[str, Any] = {"commit": commit(), "services": services,
                              "endpoints": endpoints, "nodes": args.nodes,
                              "args": vars(args), "fleets": {}}
    with tempfile.TemporaryDirectory(prefix="ppx-fleet-") as tmp:
        flags, audit_log = audit_args(Path(tmp))
        with controlplane.running_control_plane(bin_dir, apiserver_args=flags) as plane:
            kube = Kube(plane.admin_client())
            controlplane.apply_manifests(kube)
            synth = Synth(services, endpoints)
            report["load_s"] = load(kube, synth, "192.168.0.10")
            print(f"{services} services × {endpoints} endpoints loaded through the API in "
                  f"{report['load_s']:.0f} s", flush=True)
            report["wire_sizes"] = wire_sizes(plane, kube, synth)
            workdir = plane.lab.workdir
            kubeconfigs = {
                "kube-proxy": plane.node_kubeconfig(workdir / "kube-proxy.kubeconfig",
                                                    controlplane.kube_proxy_token(kube)),
                "pyproxy": plane.node_kubeconfig(workdir / "pyproxy.kubeconfig",
                                                 controlplane.service_account_token(kube))}
            nodes = make_nodes(plane, kube, args.nodes)
            bench = Bench(plane, kube, synth, nodes, args, audit_log, kubeconfigs)
            if not args.no_baseline:
                report["baseline"] = bench.baseline()
            try:
                if args.mixed:
                    report["mixed"] = bench.mixed()
                for fleet in [] if args.mixed else args.order:
                    try:
                        report["fleets"][fleet] = bench.fleet(fleet)
                    except Exception as err:  # the other fleet is still measured
                        print(f"  {fleet} failed: {err}", flush=True)
                        report["fleets"][fleet] = {"error": f"{type(err).__name__}: {err}"}
            finally:
                if args.logs:
                    Path(args.logs).mkdir(parents=True, exist_ok=True)
                    for log in [*workdir.glob("*.log"), audit_log]:
                        (Path(args.logs) / log.name).write_bytes(log.read_bytes())
    out = Path(args.json) if args.json else (
        REPO / "bench" / "results"
        / f"fleet-{'mixed-' if args.mixed else ''}{services}x{endpoints}-n{args.nodes}-"
          f"{report['commit']}.json")
    out.write_text(json.dumps(report, indent=1, default=str))
    print("\n" + (mixed_table(report["mixed"]) if args.mixed else table(report)), flush=True)
    print(f"\nfigures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
