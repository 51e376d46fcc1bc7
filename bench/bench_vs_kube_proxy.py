"""pyproxy against the real kube-proxy (v1.37.2, nftables mode) on the same loaded cluster.

`make bench-vs-kube-proxy` (root; builds the control plane with `make k8s` first). For each size
(44k × 1, 5k × 50 and 10k × 10 by default, issue 37's): a real control plane
(testkit/controlplane.py) is loaded through the real API (or, `--load-via etcd`, straight
into its etcd) with the synthetic cluster of bench/synth.py (Services, EndpointSlices,
Nodes; the realistic mix of NodePort, LoadBalancer, affinity, eTP=Local…), then each proxy is
started on it, one after the other, in the same node namespace with the same minSyncPeriod
(1 s), and measured from outside:

- start → first complete ruleset: process start until a connection through the Service that
  was created last (its endpoint a real backend) succeeds (pyproxy's: and its log says its
  first sync ended, a large one being staged in several transactions); a kube-proxy past
  `--cap` is stopped, with how far it got;
- what the start cost the API server: its CPU and the bytes it sent the node;
- resident memory (VmRSS) after the first sync and its peak (VmHWM), CPU seconds (utime+stime);
- network programming latency: the last Service's one endpoint is moved between two real
  backends ≥ 30 times, ≥ 2 s apart; the latency is API write → the first new connection
  landing on the new backend (probed every ~5 ms from a client namespace);
- the same under a churn of 20 endpoint changes/s on other Services;
- memory after 1,000 more changes (RSS flat?).

Prints one table per size and the ratios, the kernel floor (bench/kernel_floor.py), issue
37's targets met or missed, the sizes side by side (bench/vs_sizes.py); `--json FILE` keeps
the figures, written after each size.

`--against REV` (the Makefile passes AGAINST, default 9f93ef9: the code issue 14 set its
3 s against) first starts REV's pyproxy (a temporary git worktree, bench/against.py) and
this checkout's alternately on each loaded cluster, `--pairs` cold starts each, and prints
the ratio of their medians of start → first complete ruleset: the real apiserver's answer to
the question `make bench-daemon` asks of the emulator. `--order ""` measures only that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import against as against_build
from bench import etcd_load, vs_sizes
from bench.bytecode import compile_pyproxy
from bench.kernel_floor import kernel_floor
from bench.synth import Cluster as Synth
from bench.synth import ip4
from testkit import controlplane
from testkit.daemonargs import PYPROXY, DaemonArgs
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, Lab

NODE = "node-a"
PROBE_NS, PROBE_NAME, PROBE_VIP = "bench-probe", "probe", "10.96.250.1"
MIN_SYNC = "1s"
PROXIES = ("kube-proxy", "pyproxy")
# One range covering the synthetic endpoints (10.128.0.0/9) and the lab's real backends
# (10.244.0.0/16): kube-proxy takes one CIDR per family.
CLUSTER_CIDRS = "10.0.0.0/8"


# -- loading the cluster through the API ------------------------------------------------------


def strip(obj: dict[str, Any]) -> dict[str, Any]:
    """A synthetic object as a client would create it (the server sets uid, versions…)."""
    meta = {k: v for k, v in obj["metadata"].items()
            if k in ("name", "namespace", "labels", "annotations")}
    return {**{k: v for k, v in obj.items() if k not in ("metadata", "status")},
            "metadata": meta}


def service_body(obj: dict[str, Any]) -> dict[str, Any]:
    # The NodePorts and healthCheckNodePorts synth.py hands out are unique and in the
    # default range: the API server takes them as asked.
    body = strip(obj)
    spec = dict(body["spec"])
    spec.pop("selector", None)  # slices are ours: no controller may manage them
    body["spec"] = spec
    return body


def slice_body(obj: dict[str, Any]) -> dict[str, Any]:
    body = strip(obj)
    body["metadata"]["labels"] = {**body["metadata"]["labels"],
                                  "endpointslice.kubernetes.io/managed-by": "bench"}
    return body


def load(kube: controlplane.Kube, synth: Synth, node_ip: str, workers: int = 8,
         etcd: controlplane.ControlPlane | None = None) -> float:
    """Creates the synthetic cluster through the API, `workers` requests at a time; the
    answers are read, not decoded (at 44k Services decoding them was most of the client's
    CPU). `etcd`: the Services and EndpointSlices written into that control plane's etcd
    instead (bench/etcd_load.py), the namespaces and Nodes through the API."""
    from kubernetes import client

    started = time.monotonic()
    for ns in sorted({synth.key(i).namespace for i in range(synth.services)}):
        kube.core.create_namespace({"metadata": {"name": ns}})
    for name, zone, ip in (("node-a", "zone-1", node_ip), ("node-b", "zone-1", "192.168.0.11"),
                           ("node-c", "zone-2", "192.168.0.12")):
        kube.node(name, (ip,), zone=zone, region="region-1")
    if etcd is not None:
        etcd_load.put_all(etcd, synth)
        etcd_load.wait_listed(kube, synth.services, sum(
            1 for i in range(synth.services) if not synth.shape(i).no_endpoints))
        return time.monotonic() - started
    discovery = client.DiscoveryV1Api(kube.api)

    def one(i: int) -> None:
        svc = synth.service(i)
        ns = svc["metadata"]["namespace"]
        kube.core.create_namespaced_service(ns, service_body(svc),
                                            _preload_content=False).read()
        ingress = svc["status"]["loadBalancer"].get("ingress")
        if ingress:
            kube.core.patch_namespaced_service_status(
                svc["metadata"]["name"], ns, {"status": {"loadBalancer": {"ingress": ingress}}},
                _preload_content=False).read()
        if not synth.shape(i).no_endpoints:
            discovery.create_namespaced_endpoint_slice(
                ns, slice_body(synth.endpoint_slice(i, synth.initial_endpoints(i))),
                _preload_content=False).read()

    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(one, range(synth.services)):
            pass
    return time.monotonic() - started


def probe_objects(ip: str) -> tuple[dict[str, Any], dict[str, Any]]:
    service = {"metadata": {"name": PROBE_NAME},
               "spec": {"clusterIP": PROBE_VIP, "ports": [{"name": "http", "port": 80,
                                                           "targetPort": 8080,
                                                           "protocol": "TCP"}]}}
    return service, probe_slice(ip)


def trigger_time(now_ns: int | None = None) -> str:
    """`endpoints.kubernetes.io/last-change-trigger-time` as the EndpointSlice controller
    writes it, Go's time.RFC3339Nano in UTC (nanoseconds, trailing zeros dropped:
    2026-11-27T19:00:00.1234Z), the time the proxies' network programming latency is
    measured from. Whole seconds (as this wrote before) made every latency up to 1 s longer."""
    ns = time.time_ns() if now_ns is None else now_ns
    seconds, fraction = divmod(ns, 1_000_000_000)
    digits = f"{fraction:09d}".rstrip("0")
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
            + (f".{digits}" if digits else "") + "Z")


def probe_slice(ip: str) -> dict[str, Any]:
    return {"metadata": {"name": f"{PROBE_NAME}-1", "labels": {
                "kubernetes.io/service-name": PROBE_NAME,
                "endpointslice.kubernetes.io/managed-by": "bench"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time":
                                trigger_time()}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "nodeName": "node-b", "zone": "zone-1",
                           "conditions": {"ready": True, "serving": True,
                                          "terminating": False}}]}


# -- measuring a proxy from outside ---------------------------------------------------------


def proc_figures(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(stat[11]) + int(stat[12])) / ticks
    # The children it waited for: kube-proxy runs `nft` for every transaction (pyproxy
    # calls libnftables in-process, so its own figure holds that work already).
    children = (int(stat[13]) + int(stat[14])) / ticks
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "hwm_mib": int(fields["VmHWM"].split()[0]) / 1024,
            "cpu_s": cpu, "children_cpu_s": children, "total_cpu_s": cpu + children}


LOGFMT_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def log_event(line: str) -> dict[str, Any] | None:
    """One line of pyproxy's log as a dict: JSON (`--logging-format json`) or the default
    text, key=value pairs with quoted values (numbers read as numbers)."""
    if line.startswith("{"):
        try:
            return dict(json.loads(line))
        except ValueError:
            return None
    fields: dict[str, Any] = {}
    for key, raw in LOGFMT_FIELD.findall(line):
        value = raw[1:-1] if raw.startswith('"') else raw
        try:
            fields[key] = float(value)
        except ValueError:
            fields[key] = value
    return fields or None


def start_timeline(log: Path, since: float) -> dict[str, float]:
    """Where pyproxy's start went, from its own log (ISO timestamps), in seconds after
    `since` (the wall-clock time it was started): its first line (interpreter, imports,
    configuration), `starting`, each initial list completed, the first sync's end and its
    render and kernel parts."""
    out: dict[str, float] = {}
    for line in log.read_text().splitlines():
        event = log_event(line)
        if event is None:
            continue
        try:
            at = datetime.fromisoformat(str(event["timestamp"])).timestamp() - since
        except (ValueError, KeyError, TypeError):
            continue
        if at < 0:
            continue  # an earlier start's lines (the alternated cold starts)
        name = event.get("event")
        out.setdefault("first_line", at)
        if name == "starting":
            out.setdefault("starting", at)
        elif name == "initial_list_completed":
            out.setdefault(f"listed {event.get('source')}", at)
        elif name == "synced" and "first_sync_end" not in out:
            out["first_sync_end"] = at
            out["first_sync_render"] = float(event.get("render_ms", 0)) / 1000
            out["first_sync_kernel"] = float(event.get("kernel_ms", 0)) / 1000
            out["first_sync_duration"] = float(event.get("duration_ms", 0)) / 1000
    return out


def wait_first_sync(log: Path, since: float, timeout: float) -> float | None:
    """Seconds from `since` to the end of pyproxy's first sync, once its log says so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end = start_timeline(log, since).get("first_sync_end")
        if end is not None:
            return end
        time.sleep(0.2)
    return None


class Prober:
    """Connects to the probe VIP from the client namespace in a tight loop; `first_landing`
    returns when a connection lands on the backend asked for."""

    def __init__(self, netns: str) -> None:
        self.netns = netns

    def first_landing(self, want: str, timeout: float,
                      alive: Callable[[], bool] = lambda: True) -> float | None:
        """Seconds until a connection to the probe VIP answers with backend `want`."""

        def loop() -> float | None:
            started = time.monotonic()
            while time.monotonic() - started < timeout and alive():
                try:
                    with socket.create_connection((PROBE_VIP, 80), timeout=0.2) as s:
                        line = s.recv(200).decode()
                    if line.split(" ", 1)[0] == want:
                        return time.monotonic() - started
                except OSError:
                    pass
                time.sleep(0.005)
            return None

        return call_in_netns(self.netns, loop, timeout=timeout + 10)


@dataclass
class Run:
    proxy: str
    figures: dict[str, Any] = field(default_factory=dict)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "n": len(ordered)}


class Churn:
    """Endpoint changes on the synthetic Services at a steady rate, in the background."""

    def __init__(self, kube: controlplane.Kube, synth: Synth, rate: float, generation: int) -> None:
        from kubernetes import client

        self.discovery = client.DiscoveryV1Api(kube.api)
        self.synth, self.rate, self.generation = synth, rate, generation
        self.stop = threading.Event()
        self.done = 0  # writes made: "changes/s reached" counts these
        self._turn = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _next_service(self) -> int:
        """The next Service to change, skipping those with no endpoints (nothing to write),
        so that every slot of the rate is a write."""
        for _ in range(self.synth.services):
            i = (self._turn * 7919) % self.synth.services
            self._turn += 1
            if not self.synth.shape(i).no_endpoints:
                return i
        raise ValueError("no Service with endpoints to change")

    def _change(self, n: int) -> None:
        i = self._next_service()
        eps = self.synth.initial_endpoints(i)
        eps[0] = (ip4((10 << 24) | (200 << 16) | (self.generation << 12) | (n & 0xFFF)),
                  eps[0][1])
        body = slice_body(self.synth.endpoint_slice(i, eps))
        key = self.synth.key(i)
        self.discovery.patch_namespaced_endpoint_slice(
            body["metadata"]["name"], key.namespace,
            {"endpoints": body["endpoints"], "metadata": {"annotations": {
                "endpoints.kubernetes.io/last-change-trigger-time": trigger_time()}}})

    def _run(self) -> None:
        started = time.monotonic()
        n = 0
        while not self.stop.is_set():
            due = started + n / self.rate
            self.stop.wait(max(0.0, due - time.monotonic()))
            if self.stop.is_set():
                return
            self._change(n)
            n += 1
            self.done = n

    def __enter__(self) -> Churn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def cold_start(name: str, start: Callable[[], Any], stop: Callable[[Any], None],
               kube: controlplane.Kube, cluster: Cluster,
               timeout: float = 600) -> tuple[Any, float]:
    """Starts a proxy; returns its handle and the seconds from its start until a connection
    through the probe Service (created after every synthetic one) lands on pod-a. Raises
    Capped (the proxy left running) when none did within `timeout`."""
    # The probe Service points at pod-a again before each proxy starts.
    kube.discovery.patch_namespaced_endpoint_slice(
        f"{PROBE_NAME}-1", PROBE_NS,
        {"endpoints": probe_slice(cluster.pods["pod-a"].ip4)["endpoints"]})
    started = time.monotonic()
    handle = start()
    first = Prober(cluster.client.full).first_landing(
        "pod-a", timeout=timeout, alive=lambda: handle.poll() is None)
    if first is None:
        if handle.poll() is None:
            raise Capped(handle, time.monotonic() - started)
        stop(handle)
        raise RuntimeError(f"{name}: exited ({handle.returncode}) before its first sync")
    return handle, time.monotonic() - started


class Capped(Exception):
    """A proxy still running with no complete ruleset when its cap hit."""

    def __init__(self, handle: Any, seconds: float) -> None:
        super().__init__(f"no complete ruleset within {seconds:.0f} s")
        self.handle, self.seconds = handle, seconds


@dataclass(frozen=True)
class Plan:
    """How one proxy is measured: the flips, the churn, its cap."""

    flips: int
    churn_flips: int
    memory_changes: int
    cap_s: float  # the most its start may take to a complete ruleset
    flip_timeout_s: float = 120.0


def flip_series(name: str, kube: controlplane.Kube, cluster: Cluster, count: int, spacing: float,
                timeout: float) -> dict[str, Any]:
    """The last Service's one endpoint moved between pod-a and pod-b `count` times: API
    write → the first connection landing on the new backend. A change that has not landed
    within `timeout` ends the series (the proxy is not keeping up: the rest would wait on it)."""
    prober = Prober(cluster.client.full)
    pods = [cluster.pods["pod-a"].ip4, cluster.pods["pod-b"].ip4]
    names = ["pod-a", "pod-b"]
    samples: list[float] = []
    since = time.time()
    for n in range(count):
        target = (n + 1) % 2
        written = time.monotonic()
        body = probe_slice(pods[target])
        kube.discovery.patch_namespaced_endpoint_slice(f"{PROBE_NAME}-1", PROBE_NS, {
            "endpoints": body["endpoints"],
            "metadata": {"annotations": body["metadata"]["annotations"]}})
        if prober.first_landing(names[target], timeout=timeout) is None:
            print(f"  {name}: change {n} not in {timeout:.0f} s: series ended", flush=True)
            return {**percentiles(samples), "lost_after_s": timeout, "since": since,
                    "until": time.time()} if samples else {"n": 0, "lost_after_s": timeout}
        samples.append(time.monotonic() - written)
        time.sleep(max(0.0, spacing - (time.monotonic() - written)))
    return {**percentiles(samples), "since": since, "until": time.time()}


def measure(name: str, start: Callable[[], Any], stop: Callable[[Any], None],
            kube: controlplane.Kube, synth: Synth, cluster: Cluster, plan: Plan,
            plane: controlplane.ControlPlane, log: Path | None = None) -> Run:
    run = Run(name)
    wall_started = time.time()
    link = vs_sizes.node_link(plane, cluster.node)
    api_before = vs_sizes.api_sample(plane, link)
    run.figures["load"] = {"start": vs_sizes.load_average()}
    try:
        handle, run.figures["first_ruleset_s"] = cold_start(name, start, stop, kube, cluster,
                                                            timeout=plan.cap_s)
    except Capped as capped:
        # How far it got: its table's chains, its sync metrics, its last log lines.
        run.figures.update(capped_at_s=round(capped.seconds), first_ruleset_s=None,
                           at_cap=proc_figures(int(capped.handle.pid)),
                           api_start=vs_sizes.api_delta(api_before,
                                                        vs_sizes.api_sample(plane, link)),
                           progress=vs_sizes.table_progress(
                               cluster.node, PROXY_TABLES[name], service_ports(synth)),
                           metrics=vs_sizes.metrics(cluster.node.full, "kubeproxy_sync"))
        run.figures["load"]["cap"] = vs_sizes.load_average()
        stop(capped.handle)
        return run
    if log is not None:
        # pyproxy stages a large first sync in several transactions (made before break):
        # the probe Service can answer before the last of them. Complete is the later of
        # the probe's answer and the first sync's end in its log.
        run.figures["probe_s"] = run.figures["first_ruleset_s"]
        synced = wait_first_sync(log, wall_started, plan.cap_s)
        run.figures["first_ruleset_s"] = max(run.figures["probe_s"], synced or 0.0)
    run.figures["api_start"] = vs_sizes.api_delta(api_before, vs_sizes.api_sample(plane, link))
    run.figures["load"]["first_sync"] = vs_sizes.load_average()
    pid = int(handle.pid)
    time.sleep(2.0)  # let the first sync's allocations settle
    run.figures["after_first_sync"] = proc_figures(pid)
    if log is not None:
        run.figures["start_timeline"] = start_timeline(log, wall_started)
    before = vs_sizes.metrics(cluster.node.full, "kubeproxy_sync")
    quiet = flip_series(name, kube, cluster, plan.flips, 2.0, plan.flip_timeout_s)
    run.figures["npl_quiet"] = quiet
    run.figures["sync_metrics_quiet"] = vs_sizes.histogram_means(
        before, vs_sizes.metrics(cluster.node.full, "kubeproxy_sync"))
    run.figures["partial_sync_ms"] = vs_sizes.partial_sync_ms(run.figures["sync_metrics_quiet"])
    if log is not None and "since" in quiet:
        run.figures["one_service_change"] = vs_sizes.pyproxy_changes(
            log, quiet["since"], quiet["until"])
    run.figures["load"]["quiet"] = vs_sizes.load_average()
    with Churn(kube, synth, 20.0, generation=1) as churn:
        run.figures["npl_churn_20"] = flip_series(name, kube, cluster, plan.churn_flips, 2.0,
                                                  plan.flip_timeout_s)
        run.figures["churn_20_written"] = churn.done
    run.figures["load"]["churn"] = vs_sizes.load_average()
    run.figures["after_changes"] = proc_figures(pid)
    with Churn(kube, synth, 50.0, generation=2) as churn:
        while churn.done < plan.memory_changes:
            time.sleep(0.5)
    time.sleep(3.0)
    run.figures["after_1000_more"] = proc_figures(pid)
    stop(handle)
    return run


PROXY_TABLES = {"kube-proxy": "kube-proxy", "pyproxy": "pyproxy"}


def service_ports(synth: Synth) -> int:
    return sum(len(synth.shape(i).ports) for i in range(synth.services))


@contextmanager
def loaded_cluster(plane: controlplane.ControlPlane, services: int, endpoints: int,
                   cost: dict[str, Any] | None = None, workers: int = 8,
                   via_etcd: bool = False) -> Iterator[
        tuple[controlplane.Kube, Synth, Cluster, Lab, float]]:
    """`cost`, when given, receives what loading the objects cost the control plane."""
    kube = controlplane.Kube(plane.admin_client())
    controlplane.apply_manifests(kube)
    synth = Synth(services, endpoints)
    with Lab() as lab:
        cluster = lab.standard_topology(backends=2)
        plane.attach(cluster.node)
        before = vs_sizes.control_plane(plane)
        load_s = load(kube, synth, cluster.node_ip4, workers, plane if via_etcd else None)
        if cost is not None:
            objects = synth.services + sum(1 for i in range(synth.services)
                                           if not synth.shape(i).no_endpoints)
            cost.update(vs_sizes.loading_cost(before, vs_sizes.control_plane(plane), load_s,
                                              objects), before=before,
                        via="etcd" if via_etcd else "api")
        kube.namespace(PROBE_NS)
        service, piece = probe_objects(cluster.pods["pod-a"].ip4)
        kube.core.create_namespaced_service(PROBE_NS, service)
        kube.discovery.create_namespaced_endpoint_slice(PROBE_NS, piece)
        yield kube, synth, cluster, lab, load_s


def kube_proxy_starter(plane: controlplane.ControlPlane, lab: Lab, cluster: Cluster,
                       kube: controlplane.Kube) -> Callable[[], Any]:
    kubeconfig = plane.node_kubeconfig(lab.workdir / "kube-proxy.kubeconfig",
                                       controlplane.kube_proxy_token(kube))
    config = controlplane.kube_proxy_config(lab.workdir / "kube-proxy.yaml", kubeconfig, NODE,
                               CLUSTER_CIDRS, MIN_SYNC, "30s")

    def start() -> Any:
        return lab.popen(cluster.node, [plane.bin / "kube-proxy", f"--config={config}"],
                         log_name="kube-proxy.log")
    return start


def pyproxy_argv(kubeconfig: Path, node: str = NODE, binary: str = PYPROXY,
                 debug_socket: str = "") -> list[str]:
    """pyproxy as these benchmarks run it: kube-proxy's settings (minSyncPeriod 1 s,
    syncPeriod 30 s, the cluster CIDRs, health and metrics on their ports), no debug socket
    unless one is given."""
    return DaemonArgs(kubeconfig=kubeconfig, node=node, cluster_cidr=CLUSTER_CIDRS,
                      min_sync_period=MIN_SYNC, sync_period="30s", debug_socket=debug_socket,
                      binary=binary).argv()


def pyproxy_starter(lab: Lab, cluster: Cluster, kubeconfig: Path, binary: str = PYPROXY,
                    log_name: str = "pyproxy.log") -> Callable[[], Any]:
    def start() -> Any:
        return lab.popen(cluster.node, pyproxy_argv(kubeconfig, NODE, binary),
                         log_name=log_name)
    return start


def run_size(plane: controlplane.ControlPlane, services: int, endpoints: int,
             args: argparse.Namespace, theirs: str | None = None) -> dict[str, Any]:
    """One loaded cluster: `theirs` (--against's pyproxy) and this checkout's started
    alternately first when given, then each proxy of --order measured."""
    cost: dict[str, Any] = {}
    with loaded_cluster(plane, services, endpoints, cost, args.workers,
                        args.load_via == "etcd") as (
            kube, synth, cluster, lab, load_s):
        print(f"\n{services} services × {endpoints} endpoints: loaded ({cost['via']}) in "
              f"{load_s:.0f} s ({cost['objects_per_s']} objects/s; kube-apiserver "
              f"{cost['apiserver_cpu_s']} CPU s, now {cost['after']['apiserver']['rss_mib']} "
              f"MiB; etcd {cost['etcd_cpu_s']} CPU s, {cost['after']['etcd']['rss_mib']} "
              f"MiB, db {cost['after']['etcd_db_mib']} MiB; load {cost['after']['load']})",
              flush=True)
        runs = {}
        kubeconfig = plane.node_kubeconfig(lab.workdir / "pyproxy.kubeconfig",
                                           controlplane.service_account_token(kube))
        starters = {"kube-proxy": kube_proxy_starter(plane, lab, cluster, kube),
                    "pyproxy": pyproxy_starter(lab, cluster, kubeconfig)}

        def stopper(table: str) -> Callable[[Any], None]:
            def stop(proc: Any) -> None:
                lab.stop_process(proc)
                for family in ("ip", "ip6"):
                    cluster.node.run(["nft", "delete", "table", family, table], check=False)
                lab.flush_conntrack(cluster.node)
            return stop

        against = None
        if theirs is not None:
            # Its own log (--logs copies it too): this checkout's log then holds its
            # alternated starts followed by the measured one.
            their_start = pyproxy_starter(lab, cluster, kubeconfig, theirs,
                                          log_name=f"pyproxy-{args.against}.log")
            against = alternate(starters["pyproxy"], their_start, stopper("pyproxy"), kube,
                                cluster, args)
            against_build.report("start → first complete ruleset (real apiserver)",
                                 (services, endpoints), against)
        for name in args.order:
            stop = stopper(name)
            print(f"  {name}… (load {vs_sizes.load_average()})", flush=True)
            plan = Plan(args.flips, args.churn_flips, args.memory_changes,
                        args.cap if name == "kube-proxy" else 600, args.flip_timeout)
            runs[name] = measure(name, starters[name], stop, kube, synth, cluster, plan,
                                 plane, lab.workdir / "pyproxy.log" if name == "pyproxy"
                                 else None).figures
            print(f"  {name}: {json.dumps(runs[name])}", flush=True)
        floor = None
        if not args.no_floor:
            print(f"  the kernel floor… (load {vs_sizes.load_average()})", flush=True)
            service, piece = probe_objects(cluster.pods["pod-a"].ip4)
            probe = [{"apiVersion": "v1", "kind": "Service", **service,
                      "metadata": {**service["metadata"], "namespace": PROBE_NS}},
                     {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", **piece,
                      "metadata": {**piece["metadata"], "namespace": PROBE_NS}}]
            floor = kernel_floor(synth, NODE, cluster.node_ip4, CLUSTER_CIDRS, probe)
            floor["load"] = vs_sizes.load_average()
            print(f"  the kernel floor: {json.dumps(floor)}", flush=True)
        if args.logs:  # each proxy's own log, for where its time went
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in lab.workdir.glob("*.log"):
                (Path(args.logs) / f"{services}x{endpoints}-{log.name}").write_bytes(
                    log.read_bytes())
        kube.core.delete_node("node-a")
        result = {"services": services, "endpoints": endpoints, "load_s": load_s,
                  "control_plane_load": cost, "kube_proxy_cap_s": args.cap,
                  "control_plane_end": vs_sizes.control_plane(plane), "runs": runs}
        if floor is not None:
            result["kernel_floor"] = floor
        if against is not None:
            result["against"] = against
        return result


def alternate(ours: Callable[[], Any], theirs: Callable[[], Any], stop: Callable[[Any], None],
              kube: controlplane.Kube, cluster: Cluster,
              args: argparse.Namespace) -> dict[str, Any]:
    """--pairs cold starts of this checkout's pyproxy and of --against's on the loaded
    cluster, alternated (ours first in each pair): start → first complete ruleset only."""
    ours_s: list[float] = []
    theirs_s: list[float] = []
    for n in range(args.pairs):
        for name, start, into in (("this checkout", ours, ours_s),
                                  (args.against, theirs, theirs_s)):
            handle, seconds = cold_start(name, start, stop, kube, cluster)
            stop(handle)
            into.append(seconds)
            print(f"  {name}: cold start {n + 1} in {seconds:.2f} s", flush=True)
    return against_build.figures(args.against, ours_s, theirs_s)


def _get(run: dict[str, Any], *path: str, scale: float = 1.0) -> float | None:
    value: Any = run
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value) * scale


TABLE_ROWS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("start → first complete ruleset (s)", ("first_ruleset_s",), 1),
    ("RSS after the first sync (MiB)", ("after_first_sync", "rss_mib"), 1),
    ("peak RSS, VmHWM, after the first sync (MiB)", ("after_first_sync", "hwm_mib"), 1),
    ("CPU seconds to the first sync", ("after_first_sync", "cpu_s"), 1),
    ("the same with its children's (kube-proxy's nft)", ("after_first_sync", "total_cpu_s"), 1),
    ("one-Service change: its sync, mean (ms, its partial sync histogram)",
     ("partial_sync_ms",), 1),
    ("API server CPU s for the start", ("api_start", "apiserver_cpu_s"), 1),
    ("MiB the API server sent for the start", ("api_start", "mib_sent"), 1),
    ("NPL p50 (ms), quiet", ("npl_quiet", "p50"), 1000),
    ("NPL p90 (ms), quiet", ("npl_quiet", "p90"), 1000),
    ("NPL p99 (ms), quiet", ("npl_quiet", "p99"), 1000),
    ("NPL p50 (ms), 20 changes/s", ("npl_churn_20", "p50"), 1000),
    ("NPL p99 (ms), 20 changes/s", ("npl_churn_20", "p99"), 1000),
    ("RSS after the changes (MiB)", ("after_changes", "rss_mib"), 1),
    ("RSS after 1,000 more changes (MiB)", ("after_1000_more", "rss_mib"), 1),
    ("peak RSS at the end (MiB)", ("after_1000_more", "hwm_mib"), 1),
)


def table(result: dict[str, Any]) -> str:
    """Both proxies side by side; a kube-proxy stopped at its cap shows "> cap"."""
    kp, py = result["runs"]["kube-proxy"], result["runs"]["pyproxy"]
    lines = [f"| {result['services']} × {result['endpoints']} | pyproxy | kube-proxy | "
             "pyproxy / kube-proxy |", "|---|---:|---:|---:|"]
    for label, path, scale in TABLE_ROWS:
        ours, theirs = _get(py, *path, scale=scale), _get(kp, *path, scale=scale)
        if path == ("first_ruleset_s",) and theirs is None and kp.get("capped_at_s"):
            cap = float(kp["capped_at_s"])
            ratio = f"< {ours / cap:.3f}" if ours is not None else "—"
            lines.append(f"| {label} | {_cell(ours)} | > {cap:.0f} (its cap) | {ratio} |")
            continue
        ratio = f"{ours / theirs:.3f}" if ours is not None and theirs else "—"
        lines.append(f"| {label} | {_cell(ours)} | {_cell(theirs)} | {ratio} |")
    floor = result.get("kernel_floor")
    if floor:
        ours, wall = _get(py, "first_ruleset_s"), float(floor["wall_s"])
        ratio = "—" if ours is None else f"start / floor: {ours / wall:.1f}"
        lines.append(f"| the kernel floor: one nft -f of the whole ruleset (s) | "
                     f"{wall:.2f} | | {ratio} |")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="44000x1,5000x50,10000x10",
                        help="comma-separated SERVICESxENDPOINTS (default %(default)s)")
    parser.add_argument("--cap", type=float, default=1200,
                        help="seconds a kube-proxy start may take to its first complete "
                             "ruleset; past it, how far it got is recorded and it is "
                             "stopped (default %(default)s)")
    parser.add_argument("--flip-timeout", type=float, default=120,
                        help="seconds one NPL change may take; past it the series ends")
    parser.add_argument("--workers", type=int, default=8,
                        help="concurrent requests creating the objects")
    parser.add_argument("--load-via", choices=("api", "etcd"), default="api",
                        help="create the Services and EndpointSlices through the API "
                             "(default) or write them into etcd (bench/etcd_load.py: 44k "
                             "through the API took over half an hour on the shared machine)")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the kernel floor (one nft -f of the whole ruleset)")
    parser.add_argument("--flips", type=int, default=30, help="quiet NPL samples (≥ 30)")
    parser.add_argument("--churn-flips", type=int, default=15,
                        help="NPL samples under 20 changes/s")
    parser.add_argument("--memory-changes", type=int, default=1000)
    parser.add_argument("--order", default="kube-proxy,pyproxy",
                        type=lambda s: [name for name in s.split(",") if name],
                        help="the proxies measured, in this order; empty: only --against's "
                             "cold starts")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--logs", help="copy each proxy's log into this folder")
    against_build.add_arguments(parser, "pyproxy",
                                "the first complete ruleset on each loaded size")
    args = parser.parse_args()
    if unknown := set(args.order) - set(PROXIES):
        parser.error(f"--order: unknown {', '.join(sorted(unknown))} (known: {', '.join(PROXIES)})")
    if not args.order and not args.against:
        parser.error("nothing to measure: --order is empty and no --against")
    bin_dir = controlplane.binaries_dir()
    if controlplane.missing_binaries(bin_dir):
        print(f"run `make k8s` first ({bin_dir})", file=sys.stderr)
        return 2
    compile_pyproxy()  # start pyproxy as installed
    results = []
    with contextlib.ExitStack() as stack:
        # --against's build once for every size (a worktree and its bytecode).
        theirs = stack.enter_context(against_build.other_build(args.against)) \
            if args.against else None
        for size in args.sizes.split(","):
            services, endpoints = (int(x) for x in size.split("x"))
            # A fresh control plane per size: the previous size's objects would add up.
            with controlplane.running_control_plane(bin_dir) as plane:
                results.append(run_size(plane, services, endpoints, args, theirs))
            if set(results[-1]["runs"]) == set(PROXIES):
                print("\n" + table(results[-1]), flush=True)
            if args.json:  # after each size: a long run's first sizes are kept
                Path(args.json).write_text(json.dumps(results, indent=1))
    print()
    for result in results:
        if set(result["runs"]) == set(PROXIES):
            print(table(result) + "\n")
            print(vs_sizes.targets_text(result) + "\n")
    both = [r for r in results if set(r["runs"]) == set(PROXIES)]
    if both:
        print("The sizes side by side (pyproxy / kube-proxy in brackets):\n"
              + vs_sizes.sizes_table(both) + "\n")
        timeline = result["runs"].get("pyproxy", {}).get("start_timeline")
        if timeline:
            print(f"pyproxy's start at {result['services']} × {result['endpoints']}, seconds "
                  "after its exec: " + ", ".join(f"{k} {v:.2f}" for k, v in timeline.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
