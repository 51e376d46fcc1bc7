"""A soak (issue 37, point 3): `make soak` (root; `make k8s`), DURATION seconds (default
3600).

The real `pyproxy run` process (as bench_vs_kube_proxy starts it: kube-proxy's settings,
minSyncPeriod 1 s, in a node namespace of its own) against the real control plane
(testkit/controlplane.py: kube-apiserver and etcd), under:

- a steady churn (`--rate`, default 100 changes/s, from `--workers` threads): `--services`
  (default 300) plain ClusterIP Services in namespace `soak`, each with one EndpointSlice of
  0-6 endpoints, their ClusterIPs from 10.96.200.0/23; each change PATCHes one slice with a
  new endpoint list, every `--member-every`th (default 20th: 5/s) deletes a Service (its slice
  first) or adds one back, alternately, from `--spare` (default 30) absent ones;
- kube-apiserver SIGKILLed every `--restart-every` s (default 600), down `--downtime` s (5),
  started again; the churn pauses while it is away. While it is away the table must keep its
  elements (no flush), and the daemon's watches must come back (their list and watch counts
  are recorded);
- the probe Service's one endpoint flipped between two real backends every `--flip-every` s
  (default 2): network programming latency measured as bench/bench_npl.py measures it (its
  `flips`: write start until the first new connection lands on the new backend).

Every `--sample-every` s (default 60): the churn is paused, the expected element count is
computed from what the API holds (each `soak` Service: its cluster-ips element, its
service-ips (or no-endpoint-services) element and one endpoints-tcp element per endpoint, so
2 + endpoints), and the kernel's count of the elements keyed by those ClusterIPs is read until
it equals the expected one (`--converge-timeout`, default 60 s: "converged" and the seconds
it took); the churn resumes; the daemon's RSS, CPU, open descriptors and threads are read from
/proc, and the NPL p50/p99 of the minute. Written to bench/results/soak-COMMIT.json (`--json`)
with the SVG (`--svg`); the verdicts (bench/soak_analysis.py) printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bench_npl
from bench import bench_vs_kube_proxy as vs
from bench import soak_analysis as analysis
from bench.bytecode import compile_pyproxy
from pyproxy.serve import debug
from testkit.controlplane import (
    ControlPlane,
    Kube,
    apply_manifests,
    binaries_dir,
    missing_binaries,
    running_control_plane,
    service_account_token,
)
from testkit.netlab import Cluster, Lab

REPO = Path(__file__).resolve().parent.parent
NS = "soak"
VIP_PREFIXES = ("10.96.200.", "10.96.201.")  # the churned Services' ClusterIPs
MAX_ENDPOINTS = 6
# The containers a soak Service's elements go in (render/services.py: a ClusterIP/TCP port).
CONTAINERS = ("cluster-ips", "service-ips", "no-endpoint-services", "endpoints-tcp")
REQUEST_TIMEOUT = 10


def vip(index: int) -> str:
    return f"{VIP_PREFIXES[index // 256]}{index % 256}"


def service_name(index: int) -> str:
    return f"s{index:03d}"


def endpoints_of(index: int, count: int, generation: int) -> list[dict[str, Any]]:
    """`count` ready endpoints on another node (no hairpin element), their addresses new
    with each generation."""
    host = 8 * (index // 256)
    return [{"addresses": [f"10.{128 + generation % 100}.{index % 256}.{1 + j + host}"],
             "nodeName": "node-b",
             "conditions": {"ready": True, "serving": True, "terminating": False}}
            for j in range(count)]


def expected_elements(services: list[Any], slices: list[Any]) -> int:
    """What the table must hold for the soak Services the API holds: per Service 2 (its
    cluster-ips element and its service-ips or no-endpoint-services one) + one endpoints-tcp
    element per ready endpoint of its slices."""
    names = {s.metadata.name for s in services if s.spec.cluster_ip.startswith(VIP_PREFIXES)}
    count = 2 * len(names)
    for piece in slices:
        owner = (piece.metadata.labels or {}).get("kubernetes.io/service-name")
        if owner in names:
            count += sum(1 for ep in piece.endpoints or [] if ep.conditions.ready)
    return count


def kernel_elements(listing: dict[str, Any]) -> tuple[int, int]:
    """From `nft -j list table ip pyproxy`: (the elements keyed by a soak ClusterIP in the
    soak Services' containers, every element of the table)."""
    soak = total = 0
    for item in listing.get("nftables", []):
        body = item.get("set") or item.get("map")
        if body is None:
            continue
        elements = body.get("elem", [])
        total += len(elements)
        if body["name"] not in CONTAINERS:
            continue
        soak += sum(1 for e in elements if first_address(e).startswith(VIP_PREFIXES))
    return soak, total


def first_address(element: Any) -> str:
    """The first field of an element's key as nft's JSON writes it (a plain value, a
    concatenation, a map's [key, value], an element with counters: {"elem": {"val": …}})."""
    while True:
        if isinstance(element, list):
            element = element[0]
        elif isinstance(element, dict):
            element = (element.get("elem", {}).get("val") if "elem" in element
                       else element.get("concat", [""])[0] if "concat" in element
                       else element.get("prefix", {}).get("addr", ""))
        else:
            return str(element)


# -- the churn ---------------------------------------------------------------------------------


@dataclass
class Membership:
    """Which Services the churn believes exist; a Service is live once its slice exists."""

    live: list[int]
    absent: deque[int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    delete_next: bool = True


class Churn:
    """`rate` changes/s from `workers` threads until stopped; `pause()` waits until no write
    is in flight."""

    def __init__(self, kube: Kube, members: Membership, rate: float, workers: int,
                 member_every: int) -> None:
        self.kube, self.members, self.rate = kube, members, rate
        self.member_every = member_every
        self.tokens: deque[int] = deque()
        self.cond = threading.Condition()
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.in_flight = 0
        self.n = 0
        self.done = self.failed = self.member_ops = 0
        self.active_s = 0.0
        self.last_error = ""
        self.random = random.Random(37)
        self.threads = [threading.Thread(target=self._dispatch, daemon=True)] + [
            threading.Thread(target=self._work, daemon=True) for _ in range(workers)]

    def start(self) -> None:
        self.running.set()
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.running.set()
        with self.cond:
            self.cond.notify_all()
        for thread in self.threads:
            thread.join(30)

    def pause(self, timeout: float = 60.0) -> None:
        self.running.clear()
        deadline = time.monotonic() + timeout
        with self.cond:
            self.tokens.clear()
            while self.in_flight and time.monotonic() < deadline:
                self.cond.wait(0.1)

    def resume(self) -> None:
        self.running.set()

    def _dispatch(self) -> None:
        # Tokens at the rate while running; a pause restarts the schedule (no catch-up burst).
        while not self.stopped.is_set():
            self.running.wait()
            started, sent = time.monotonic(), 0
            while self.running.is_set() and not self.stopped.is_set():
                due = started + sent / self.rate
                time.sleep(max(0.0, due - time.monotonic()))
                with self.cond:
                    if not self.running.is_set():
                        break
                    if len(self.tokens) < 4 * self.rate:  # workers behind: drop, not queue
                        self.tokens.append(self.n)
                        self.n += 1
                        self.cond.notify()
                sent += 1
            self.active_s += time.monotonic() - started

    def _work(self) -> None:
        while not self.stopped.is_set():
            with self.cond:
                while not self.tokens and not self.stopped.is_set():
                    self.cond.wait(0.5)
                if self.stopped.is_set():
                    return
                n = self.tokens.popleft()
                self.in_flight += 1
            try:
                self._change(n)
                self.done += 1
            except Exception as err:
                self.failed += 1
                self.last_error = f"{type(err).__name__}: {str(err)[:200]}"
                time.sleep(0.2)
            finally:
                with self.cond:
                    self.in_flight -= 1
                    self.cond.notify_all()

    def _change(self, n: int) -> None:
        if self.member_every and n % self.member_every == 0:
            self.member_ops += 1
            self._membership(n)
            return
        with self.members.lock:
            if not self.members.live:
                return
            index = self.random.choice(self.members.live)
            count = self.random.randint(0, MAX_ENDPOINTS)
        self.kube.discovery.patch_namespaced_endpoint_slice(
            f"{service_name(index)}-1", NS,
            {"endpoints": endpoints_of(index, count, n), "metadata": {"annotations": {
                "endpoints.kubernetes.io/last-change-trigger-time": vs.trigger_time()}}},
            _request_timeout=REQUEST_TIMEOUT)

    def _membership(self, n: int) -> None:
        m = self.members
        with m.lock:
            delete, m.delete_next = m.delete_next, not m.delete_next
            if delete and m.live:
                index = m.live.pop(self.random.randrange(len(m.live)))
            elif not delete and m.absent:
                index = m.absent.popleft()
            else:
                return
        try:
            if delete:
                remove_service(self.kube, index)
            else:
                create_service(self.kube, index, self.random.randint(0, MAX_ENDPOINTS), n)
        except Exception:
            with m.lock:  # tried again later: the API decides what it held
                (m.absent.append(index) if delete else m.live.append(index))
            raise
        with m.lock:
            (m.absent.append(index) if delete else m.live.append(index))


def _tolerate(status: int, call: Any, *args: Any, **kwargs: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        call(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    except ApiException as err:
        if err.status != status:
            raise


def create_service(kube: Kube, index: int, endpoints: int, generation: int) -> None:
    """The Service with its ClusterIP and its one slice (an earlier, interrupted add's
    halves are taken as made)."""
    name = service_name(index)
    _tolerate(409, kube.core.create_namespaced_service, NS, {
        "metadata": {"name": name},
        "spec": {"clusterIP": vip(index), "ports": [
            {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
    _tolerate(409, kube.discovery.create_namespaced_endpoint_slice, NS, {
        "metadata": {"name": f"{name}-1", "labels": {
            "kubernetes.io/service-name": name,
            "endpointslice.kubernetes.io/managed-by": "bench"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints_of(index, endpoints, generation)})


def remove_service(kube: Kube, index: int) -> None:
    name = service_name(index)
    _tolerate(404, kube.discovery.delete_namespaced_endpoint_slice, f"{name}-1", NS)
    _tolerate(404, kube.core.delete_namespaced_service, name, NS)


# -- the daemon, seen from outside -------------------------------------------------------------


def process_figures(pid: int) -> dict[str, float]:
    figures = vs.proc_figures(pid)
    status = Path(f"/proc/{pid}/status").read_text()
    threads = next(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("Threads:"))
    return {"rss_mib": figures["rss_mib"], "hwm_mib": figures["hwm_mib"],
            "cpu_s": figures["cpu_s"], "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": threads}


@dataclass
class Soak:
    plane: ControlPlane
    kube: Kube
    cluster: Cluster
    daemon: subprocess.Popen[str]
    sock: str
    churn: Churn
    args: argparse.Namespace
    t0: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    npl: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    restart_windows: list[tuple[float, float]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def elements(self) -> tuple[int, int]:
        out = self.cluster.node.run(["nft", "-j", "list", "table", "ip", "pyproxy"])
        return kernel_elements(json.loads(out.stdout))

    def expected(self) -> int:
        services = self.kube.core.list_namespaced_service(
            NS, _request_timeout=REQUEST_TIMEOUT).items
        slices = self.kube.discovery.list_namespaced_endpoint_slice(
            NS, _request_timeout=REQUEST_TIMEOUT).items
        return expected_elements(services, slices)

    def converge(self, resume: bool = True) -> dict[str, Any]:
        """Pause the churn; wait for the kernel to hold what the API holds."""
        paused = time.monotonic()
        self.churn.pause()
        expected = self.expected()
        deadline = paused + self.args.converge_timeout
        while True:
            soak, total = self.elements()
            if soak == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        converge_s = time.monotonic() - paused
        if resume:
            self.churn.resume()
        return {"elements": soak, "expected": expected, "converged": soak == expected,
                "converge_s": round(converge_s, 2), "table_elements": total}

    def sample(self, last_cpu: float, last_t: float) -> dict[str, Any]:
        convergence = self.converge()
        proc = process_figures(self.daemon.pid)
        t = self.now()
        minute = [n["npl"] for n in self.npl if "npl" in n and last_t <= n["t"] < t]
        s = {"t": round(t, 1), **convergence, **{k: proc[k] for k in
                                                  ("rss_mib", "hwm_mib", "fds", "threads")},
             "cpu_s": round(proc["cpu_s"], 2),
             "cpu_pct": round(100 * (proc["cpu_s"] - last_cpu) / max(1e-9, t - last_t), 1),
             "npl_p50_ms": round(1000 * analysis.percentile(minute, 0.5), 1),
             "npl_p99_ms": round(1000 * analysis.percentile(minute, 0.99), 1),
             "npl_n": len(minute), "writes": self.churn.done, "failed": self.churn.failed,
             "member_ops": self.churn.member_ops, "load": list(os.getloadavg()),
             "live_services": len(self.churn.members.live)}
        self.samples.append(s)
        if self.args.json:  # what a run cut short leaves
            Path(f"{self.args.json}.partial").write_text(json.dumps(
                {"samples": self.samples, "npl": self.npl, "restarts": self.restarts}))
        print(f"  {t / 60:5.1f} min: rss {s['rss_mib']:.1f} MiB, cpu {s['cpu_pct']:.0f} %, "
              f"fds {s['fds']}, threads {s['threads']}, elements {s['elements']}/"
              f"{s['expected']} in {s['converge_s']:.1f} s, NPL p50 {s['npl_p50_ms']:.0f} "
              f"p99 {s['npl_p99_ms']:.0f} ms (n={len(minute)}), writes {s['writes']} "
              f"({s['failed']} failed), load {s['load'][0]:.1f}", flush=True)
        return s

    def watches(self) -> dict[str, dict[str, int]]:
        status = debug.ask(self.sock, "/status")
        return {w["kind"]: {"lists": w["lists"], "watches": w["watches"]}
                for w in status.get("source", {}).get("api", [])}

    def restart_apiserver(self) -> dict[str, Any]:
        """Kill kube-apiserver with the churn paused and the table converged; the table must
        keep its elements while it is away; the watches must come back."""
        begun = self.now()
        self.restart_windows.append((begun, float("inf")))
        held_before = self.converge(resume=False)["elements"]
        before = self.watches()
        self.plane.kill_apiserver()
        time.sleep(self.args.downtime)
        held_during, _ = self.elements()
        self.plane.start_apiserver()
        self.churn.resume()
        back = self.now()
        deadline = time.monotonic() + 120
        after = self.watches()
        while (not all(after[k]["lists"] + after[k]["watches"]
                       > before[k]["lists"] + before[k]["watches"] for k in before)
               and time.monotonic() < deadline):
            time.sleep(0.5)
            after = self.watches()
        result: dict[str, Any] = {"t": round(begun, 1), "api_back_after_s": round(back - begun, 1),
                  "watches_back_after_s": round(self.now() - back, 1),
                  "elements_before": held_before, "elements_while_away": held_during,
                  "kept": held_during == held_before and held_before > 0,
                  "watches_before": before, "watches_after": after,
                  "relisted": sorted(k for k in before
                                     if after[k]["lists"] > before[k]["lists"])}
        self.restarts.append(result)
        self.restart_windows[-1] = (begun, self.now() + 30)
        print(f"  {begun / 60:5.1f} min: kube-apiserver restarted, back in "
              f"{result['api_back_after_s']:.0f} s; elements {held_before} → {held_during} "
              f"while away; relisted: {', '.join(result['relisted']) or 'none'}", flush=True)
        return result

    def probe_loop(self, kube: Kube) -> None:
        """Flip the probe Service's endpoint every --flip-every s (two flips per call of
        bench_npl.flips: there and back)."""
        history = lambda: list(debug.ask(self.sock, "/history", n=50))  # noqa: E731
        while not self.stop.is_set():
            at = self.now()
            try:
                for sample in bench_npl.flips("pyproxy", kube, self.cluster, 2,
                                              self.args.flip_every, history):
                    near = any(a - 5 <= at <= b for a, b in self.restart_windows)
                    self.npl.append({"t": round(at, 1), "near_restart": near,
                                     **{k: round(v, 4) for k, v in sample.items()}})
            except Exception as err:
                self.npl.append({"t": round(at, 1), "error": str(err)[:200]})
                self.stop.wait(1.0)

    def run(self, kube: Kube) -> None:
        self.t0 = time.monotonic()
        prober = threading.Thread(target=self.probe_loop, args=(kube,), daemon=True)
        prober.start()
        self.churn.start()
        last_cpu, last_t = process_figures(self.daemon.pid)["cpu_s"], 0.0
        next_sample = self.args.sample_every
        next_restart = self.args.restart_every + self.args.sample_every / 2 \
            if self.args.restart_every else float("inf")
        try:
            while self.now() < self.args.duration:
                if self.daemon.poll() is not None:
                    raise RuntimeError(f"pyproxy exited ({self.daemon.returncode})")
                if self.now() >= next_restart:
                    self.restart_apiserver()
                    next_restart += self.args.restart_every
                if self.now() >= next_sample:
                    s = self.sample(last_cpu, last_t)
                    last_cpu, last_t = s["cpu_s"], s["t"]
                    while next_sample <= self.now():  # one sample however late
                        next_sample += self.args.sample_every
                time.sleep(0.2)
            if self.now() - last_t > self.args.sample_every / 2:
                self.sample(last_cpu, last_t)
        finally:
            self.churn.stop()
            self.stop.set()
            prober.join(150)


# -- setting it up ------------------------------------------------------------------------------


def populate(kube: Kube, services: int, spare: int) -> Membership:
    kube.namespace(NS)
    rng = random.Random(1)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: create_service(kube, i, rng.randint(1, MAX_ENDPOINTS), 0),
                      range(services)))
    return Membership(live=list(range(services)),
                      absent=deque(range(services, services + spare)))


@contextlib.contextmanager
def soak_setup(plane: ControlPlane, args: argparse.Namespace) -> Iterator[tuple[Soak, Kube]]:
    kube = Kube(plane.admin_client())
    apply_manifests(kube)
    with Lab() as lab:
        cluster = lab.standard_topology(backends=2)
        plane.attach(cluster.node)
        for name, ip in ((vs.NODE, cluster.node_ip4), ("node-b", "192.168.0.11")):
            kube.node(name, (ip,), zone="zone-1", region="region-1")
        kube.namespace(vs.PROBE_NS)
        service, piece = vs.probe_objects(cluster.pods["pod-a"].ip4)
        kube.core.create_namespaced_service(vs.PROBE_NS, service)
        kube.discovery.create_namespaced_endpoint_slice(vs.PROBE_NS, piece)
        members = populate(kube, args.services, args.spare)
        kubeconfig = plane.node_kubeconfig(lab.workdir / "pyproxy.kubeconfig",
                                           service_account_token(kube))
        sock = str(lab.workdir / "pyproxy.sock")
        argv = vs.pyproxy_argv(kubeconfig, debug_socket=sock)

        def stop(proc: Any) -> None:
            lab.stop_process(proc)

        daemon, first_s = vs.cold_start("pyproxy", lambda: lab.popen(
            cluster.node, argv, log_name="pyproxy.log"), stop, kube, cluster)
        print(f"pyproxy's first complete ruleset in {first_s:.1f} s", flush=True)
        # The churn's own client: its pool is not the prober's.
        churn = Churn(Kube(plane.admin_client()), members, args.rate, args.workers,
                      args.member_every)
        try:
            yield Soak(plane, Kube(plane.admin_client()), cluster, daemon, sock, churn,
                       args), kube
        finally:
            stop(daemon)
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                for log in lab.workdir.glob("*.log"):
                    (Path(args.logs) / log.name).write_bytes(log.read_bytes())


def run(plane: ControlPlane, args: argparse.Namespace) -> dict[str, Any]:
    """One soak on a running control plane; returns the result (also what --json gets)."""
    with soak_setup(plane, args) as (soak, kube):
        started = time.time()
        soak.run(kube)
    duration = soak.samples[-1]["t"] if soak.samples else 0.0
    found = analysis.verdicts(soak.samples, [n for n in soak.npl if "npl" in n], duration,
                              args.warmup)
    return {
        "commit": commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                     time.gmtime(started)),
        "duration_s": duration, "settings": {k: v for k, v in vars(args).items()
                                            if k not in ("json", "svg", "logs")},
        "command": "make soak" + (f" DURATION={args.duration:g}"
                                  if args.duration != 3600 else ""),
        "machine": {"cpus": os.cpu_count(), "load_at_end": list(os.getloadavg())},
        "churn": {"writes": soak.churn.done, "failed": soak.churn.failed,
                  "member_ops": soak.churn.member_ops,
                  "rate_while_running": round(soak.churn.done / max(1e-9, soak.churn.active_s),
                                              1),
                  "last_error": soak.churn.last_error},
        "samples": soak.samples, "npl": soak.npl, "restarts": soak.restarts,
        "npl_thirds": analysis.npl_thirds([n for n in soak.npl if "npl" in n], duration),
        "verdicts": [{"name": v.name, "met": v.met, "figure": v.figure} for v in found],
    }


def commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def report(result: dict[str, Any]) -> str:
    load = [s["load"][0] for s in result["samples"]]
    lines = ["", f"soak at {result['commit']}: {result['duration_s'] / 60:.0f} min, "
             f"{result['churn']['writes']} writes ({result['churn']['failed']} failed, "
             f"{result['churn']['rate_while_running']}/s while running), "
             f"{len(result['restarts'])} kube-apiserver restarts"
             + (f", load average {min(load):.1f}-{max(load):.1f}" if load else "")]
    for r in result["restarts"]:
        lines.append(f"  restart at {r['t'] / 60:.0f} min: elements {r['elements_before']} → "
                     f"{r['elements_while_away']} while away, watches back in "
                     f"{r['watches_back_after_s']:.0f} s, relisted "
                     f"{', '.join(r['relisted']) or 'none'}")
    for v in result["verdicts"]:
        lines.append(f"  {'met   ' if v['met'] else 'MISSED'} {v['name']}: {v['figure']}")
    return "\n".join(lines)


def duration(text: str) -> float:
    """Seconds from 3600, 90s, 30m or 1h."""
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=duration, default=3600.0, help="3600, 90s, 30m, 1h")
    p.add_argument("--rate", type=float, default=100.0, help="changes/s")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--services", type=int, default=300)
    p.add_argument("--spare", type=int, default=30)
    p.add_argument("--member-every", type=int, default=20)
    p.add_argument("--restart-every", type=duration, default=600.0, help="0: never")
    p.add_argument("--downtime", type=float, default=5.0)
    p.add_argument("--sample-every", type=duration, default=60.0)
    p.add_argument("--flip-every", type=float, default=2.0)
    p.add_argument("--converge-timeout", type=float, default=60.0)
    p.add_argument("--warmup", type=duration, default=analysis.WARMUP_S)
    p.add_argument("--json", help="default bench/results/soak-COMMIT.json")
    p.add_argument("--svg", help="default: --json's name with .svg")
    p.add_argument("--logs", help="copy the daemon's and the control plane's logs here")
    return p


def main() -> int:
    args = parser().parse_args()
    if args.services + args.spare > 512:
        print("--services + --spare: at most 512 (10.96.200.0/23)", file=sys.stderr)
        return 2
    bin_dir = binaries_dir()
    if missing_binaries(bin_dir):
        print(f"run `make k8s` first ({bin_dir})", file=sys.stderr)
        return 2
    compile_pyproxy()
    args.json = args.json or str(REPO / "bench" / "results" / f"soak-{commit()}.json")
    with running_control_plane(bin_dir) as plane:
        result = run(plane, args)
    Path(f"{args.json}.partial").unlink(missing_ok=True)
    result["machine"]["note"] = (
        "a shared 2-core machine: other sessions' tests and benchmarks ran beside it "
        "(each sample's load average in samples[].load)")
    json_path = Path(args.json)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    svg_path = Path(args.svg) if args.svg else json_path.with_suffix(".svg")
    svg_path.write_text(analysis.svg(
        f"make soak at {result['commit']}: {result['duration_s'] / 60:.0f} min, "
        f"{args.rate:g} changes/s", result["samples"],
        [n for n in result["npl"] if "npl" in n], [r["t"] for r in result["restarts"]]))
    print(report(result))
    print(f"\n{json_path}\n{svg_path}")
    return 0 if all(v["met"] for v in result["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
