#!/usr/bin/env python3
"""pyproxy sync benchmark (`make bench`): cold start and one-service changes against the real
kernel, with an upstream-style baseline measured in the same run. See bench/README.md.

    python -m bench.bench_sync                  # 10,000 services x 10 endpoints + baseline
    python -m bench.bench_sync --quick          # 1,000 services: a smoke run
    python -m bench.bench_sync --large          # 44,000 services x 5 endpoints
    python -m bench.bench_sync --no-baseline --services 5000 --endpoints 20 --json out.json

Must run as root. Every kernel measurement runs in a fresh network namespace created here
(`ppxbench-<pid>-<n>`) and always deleted (finally + atexit + signal handlers); the worker
processes re-run this module inside it with `ip netns exec` and refuse to run if they find
themselves in the root namespace. The root namespace's ruleset is never touched.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench import conncount
from pyproxy.render.staging import DEFAULT_CHUNK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")

COLD_TARGETS = {(10_000, 10): 10.0, (44_000, 5): 60.0,  # seconds
                (10_000, 25): 10.0, (5_000, 50): 10.0}
CHANGE_TARGET_MS = 50.0
# The scale envelope (issue 14): its sizes, and the one-service change target there.
ENVELOPE = ((10_000, 25), (5_000, 50))
ENVELOPE_CHANGE_TARGET_MS = 10.0
BIG_SERVICE_TARGET_MS = 20.0  # one endpoint added to / removed from a 5,000-endpoint service
RENDER_SHARE_TARGET = 0.10


# =============================================================================================
# Measurement helpers (used inside the workers)


class GcClock:
    """Time spent in the cyclic garbage collector, via gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0  # generation-2 collections
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            if info.get("generation") == 2:
                self.full += 1

    def mark(self) -> tuple[float, int]:
        return self.seconds, self.full


def rss() -> dict[str, float]:
    cur = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
    return {"vmrss_mb": cur,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def netns_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def assert_not_root_netns() -> None:
    """The driver passes the inode of the namespace it runs in; a worker that is still in it
    (not re-executed in the benchmark's namespace) must not touch the ruleset."""
    parent = int(os.environ.get("PPXBENCH_PARENT_NETNS", "0"))
    if not parent or netns_inode() == parent:
        sys.exit("refusing to run: this worker is not in a namespace of its own")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p90": pct(values, 90), "min": min(values),
            "max": max(values), "n": len(values)}


class Profiler:
    """Optional cProfile around named phases (--profile DIR)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.profiles: dict[str, Any] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.directory:
            yield
            return
        import cProfile
        prof = self.profiles.setdefault(name, cProfile.Profile())
        prof.enable()
        try:
            yield
        finally:
            prof.disable()

    def dump(self) -> None:
        if not self.directory:
            return
        import io
        import pstats
        os.makedirs(self.directory, exist_ok=True)
        for name, prof in self.profiles.items():
            path = os.path.join(self.directory, f"{name}.prof")
            prof.dump_stats(path)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            with open(os.path.join(self.directory, f"{name}.txt"), "w") as f:
                f.write(out.getvalue())
            log(f"profile {name}: {path} (+ .txt, top 20 by own time)")


# =============================================================================================
# Worker: pyproxy


def worker_pyproxy(args: argparse.Namespace) -> dict[str, Any]:
    assert_not_root_netns()
    import pyproxy.sync.proxier as proxier_mod
    from bench.synth import NODE_CONFIG, NODE_IP, Cluster, apply_change, plan_changes
    from pyproxy.cluster.codec import JSON
    from pyproxy.cluster.resources import SLICE_CODEC
    from pyproxy.cluster.snapshot import build_state
    from pyproxy.core.model import IPFamily
    from pyproxy.core.plan import Cause, Scope, SyncPlan
    from pyproxy.kernel.libnftables import LibNftables
    from pyproxy.render.objects import TABLE, Kind
    from pyproxy.render.ruleset import Change as RChange
    from pyproxy.render.ruleset import DesiredState
    from pyproxy.sync.applier import SyncResult
    from pyproxy.sync.proxier import FamilyProxier

    prof = Profiler(args.profile)
    gcc = GcClock()
    render = {"s": 0.0}
    # Selection + rendering time: SyncResult.render_seconds where the proxier reports it,
    # else timed around `fragments` (which older FamilyProxier.sync looked up at call time).
    reports_render = "render_seconds" in {f.name for f in dataclasses.fields(SyncResult)}
    if not reports_render:
        real_fragments = proxier_mod.fragments

        def timed_fragments(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_fragments(*a, **kw)
            finally:
                render["s"] += time.perf_counter() - t0

        proxier_mod.fragments = timed_fragments

    def render_of(result: Any) -> float:
        return result.render_seconds if reports_render else render["s"]

    res: dict[str, Any] = {"rss_start": rss()}
    t0 = time.perf_counter()
    cluster = Cluster(args.services, args.endpoints, seed=args.seed)
    # Two list bodies, as the daemon reads them: EndpointSlices, and everything else.
    everything = list(cluster.objects())
    payloads = [json.dumps({"metadata": {}, "items": [o for o in everything
                                                      if (o["kind"] == "EndpointSlice") is s]
                            }).encode() for s in (False, True)]
    del everything
    res["generate_s"] = time.perf_counter() - t0
    res["payload_mb"] = sum(len(p) for p in payloads) / 1e6
    log(f"pyproxy: synthetic cluster generated ({res['payload_mb']:.1f} MB of API JSON, "
        f"{res['generate_s']:.1f} s, not timed)")
    gc.collect()

    # ---- cold start ------------------------------------------------------------------------
    cold: dict[str, Any] = {}
    if args.gc_tuned:
        gc.disable()  # experiment: no cyclic GC during the cold start (see --gc-tuned)
    g0 = gcc.mark()
    t0 = time.perf_counter()
    with prof.phase("cold_decode"):
        # the daemon's decoders: plain dicts, and the slices' typed documents
        objects = [*JSON.page(payloads[0])[1], *SLICE_CODEC.page(payloads[1])[1]]
    t1 = time.perf_counter()
    with prof.phase("cold_build_state"):
        state = build_state(objects)
    t2 = time.perf_counter()
    g1 = gcc.mark()
    del objects, payloads
    cold["decode_s"] = t1 - t0
    cold["build_state_s"] = t2 - t1
    cold["gc_build_s"] = g1[0] - g0[0]
    bad = [s for s in state.skipped if s.invalid]
    assert not bad, bad[:3]
    res["service_ports"] = len(state.ports)
    res["endpoints_total"] = sum(len(ep.endpoints) for sl in state.slices.values() for ep in sl)
    res["rss_after_build"] = rss()
    log(f"pyproxy: build_state done ({len(state.ports)} service ports), cold sync ...")

    nft = LibNftables()
    proxier = FamilyProxier(IPFamily.IPv4, NODE_CONFIG, nft)
    # 0: the whole cold start as one libnftables transaction (no staging, the fresh
    # table's neither)
    proxier.applier.stage_chunk = args.stage_chunk or 10**12
    if not args.stage_chunk:
        proxier.applier.stage_fresh = 10**12
    render["s"] = 0.0
    g2 = gcc.mark()
    t3 = time.perf_counter()
    with prof.phase("cold_sync"):
        result = proxier.sync(state)
    t4 = time.perf_counter()
    g3 = gcc.mark()
    cold["sync_s"] = t4 - t3
    cold["render_s"] = render_of(result)
    # the selection's part (0 on versions that do not report it)
    cold["select_s"] = getattr(result, "select_seconds", 0.0)
    cold["diff_s"] = result.diff_seconds
    cold["kernel_s"] = result.kernel_seconds
    cold["other_s"] = (cold["sync_s"] - cold["render_s"] - result.diff_seconds
                       - result.kernel_seconds)
    cold["total_s"] = cold["decode_s"] + cold["build_state_s"] + cold["sync_s"]
    cold["gc_sync_s"] = g3[0] - g2[0]
    cold["gc_s"] = cold["gc_build_s"] + cold["gc_sync_s"]
    cold["gc_full_collections"] = g3[1] - g0[1]
    cold["full"] = result.full
    cold["commands"] = result.commands
    staged = re.match(r"# staged full sync: (\d+) transactions", proxier.applier.last_script)
    cold["transactions"] = int(staged[1]) if staged else 1
    cold["script_mb"] = result.script_bytes / 1e6
    cold["slots"] = len(proxier.desired)
    proxier.applier.last_script = ""  # the mirror keeps the last script; not state proper
    if args.gc_tuned:
        gc.freeze()  # everything loaded so far moves to the permanent generation
        gc.enable()
    cold.update(rss())
    res["cold"] = cold
    log(f"pyproxy: cold start {cold['total_s']:.2f} s (sync {cold['sync_s']:.2f} s, "
        f"kernel {cold['kernel_s']:.2f} s), VmRSS {cold['vmrss_mb']:.0f} MB")

    # ---- one-service changes ---------------------------------------------------------------
    plan = plan_changes(cluster, args.changes, seed=args.seed + 1)
    samples: dict[str, list[dict[str, float]]] = {}
    for change in plan:
        new_state = apply_change(state, change)  # outside the timed region
        render["s"] = 0.0
        g0 = gcc.mark()
        with prof.phase("change_sync"):
            t0 = time.perf_counter()
            r = proxier.sync(new_state, changed={change.key})
            t1 = time.perf_counter()
        g1 = gcc.mark()
        assert not r.full and r.commands > 0, (change.op, r)
        parts = render_of(r) + r.diff_seconds + r.kernel_seconds
        samples.setdefault(change.op, []).append({
            "total_ms": (t1 - t0) * 1e3, "render_ms": render_of(r) * 1e3,
            "diff_ms": r.diff_seconds * 1e3, "kernel_ms": r.kernel_seconds * 1e3,
            "other_ms": (t1 - t0 - parts) * 1e3,
            "gc_ms": (g1[0] - g0[0]) * 1e3, "gc_full": g1[1] - g0[1],
            "commands": r.commands, "script_bytes": r.script_bytes,
            # a shared pick chain of a size no service had before: the structure changes
            "new_chain": "add chain" in proxier.applier.last_script,
            "service": change.index, "endpoints": f"{change.endpoints_before}"
                                                  f"->{change.endpoints_after}"})
        state = new_state
        done = sum(len(v) for v in samples.values())
        if done % 25 == 0:
            log(f"pyproxy: {done}/{len(plan)} changes")
    res["changes"] = samples
    first = plan[0]
    res["first_change"] = {"op": first.op, **samples[first.op][0]}
    log("pyproxy: one-service changes done")

    # ---- one service with many endpoints (--big-service N) --------------------------------
    if args.big_service:
        state = big_service_changes(args, proxier, state, res, render_of, prof)

    # ---- what a full collection costs on this heap (it can land on any later sync) ---------
    t0 = time.perf_counter()
    gc.collect()
    res["gc_full_pause_ms"] = (time.perf_counter() - t0) * 1e3
    res["gc_tracked_objects"] = len(gc.get_objects())

    # ---- checks (untimed) -------------------------------------------------------------------
    # The mirror after all the partial syncs must equal a fresh full render of the final state
    # (with the slot order the endpoints keep across changes), and the kernel must hold what
    # the mirror says (counted on one map).
    fresh = DesiredState()
    for owner, fragment in proxier_mod.rendered(
            state, NODE_CONFIG, IPFamily.IPv4, None, {}, orders=dict(proxier.slot_orders),
            previous=proxier.selections):
        fresh.set(owner, fragment, RChange())
    res["check_mirror_equals_full_render"] = dict(fresh.slots()) == dict(
        proxier.desired.slots())
    del fresh
    want = sum(1 for (kind, container, _k), _v in proxier.desired.slots()
               if kind is Kind.ELEMENT and container == "service-ips")
    nft._nft.set_json_output(True)
    try:
        rc, out, _err = nft._nft.cmd(f"list map ip {TABLE} service-ips")
    finally:
        nft._nft.set_json_output(False)
    have = -1
    if rc == 0:
        for obj in json.loads(out)["nftables"]:
            if "map" in obj:
                have = len(obj["map"].get("elem", []))
    res["check_kernel_service_ips"] = {"mirror": want, "kernel": have, "ok": want == have}

    # ---- a full resync of the loaded, unchanged table (informational) ----------------------
    render["s"] = 0.0
    g0 = gcc.mark()
    t0 = time.perf_counter()
    with prof.phase("resync"):
        r = proxier.sync(state, plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    t1 = time.perf_counter()
    g1 = gcc.mark()
    res["resync"] = {"total_s": t1 - t0, "render_s": render_of(r), "diff_s": r.diff_seconds,
                     "kernel_s": r.kernel_seconds, "gc_s": g1[0] - g0[0]}
    proxier.applier.last_script = ""
    res["rss_end"] = rss()
    if not args.no_counting:
        from bench.conncount import measure

        log("pyproxy: counting new connections: with and without, reading the counters ...")
        res["connections"] = measure(proxier, state, cluster, NODE_CONFIG, NODE_IP, rss,
                                     args.seed + 2)
    prof.dump()
    return res


def big_service_changes(args: argparse.Namespace, proxier: Any, state: Any,
                        res: dict[str, Any], render_of: Callable[[Any], float],
                        prof: Profiler) -> Any:
    """kube-proxy's known weak case: one service with --big-service endpoints (in slices of
    100, the EndpointSlice controller's default) is added to the loaded table, then one
    endpoint at a time is added or removed; each change is one partial sync, timed whole.
    Returns the final state (the checks compare the mirror with it)."""
    from bench.synth import big_service_objects
    from pyproxy.cluster.snapshot import build_state

    def with_service(count: int, generation: int) -> Any:
        sub = build_state(big_service_objects(count, generation))
        key = next(iter(sub.ports_by_service))
        # A slice that did not change stays the object it was, as in the daemon's cache
        # (set_slice keeps an equal one): only the slice with the changed endpoint is new.
        kept = {piece.name: piece for piece in state.slices.get(key, ())}
        pieces = tuple(kept[p.name] if kept.get(p.name) == p else p for p in sub.slices[key])
        return key, dataclasses.replace(
            state, ports_by_service={**state.ports_by_service, key: sub.ports_of(key)},
            slices={**state.slices, key: pieces})

    n = args.big_service
    key, state = with_service(n, 0)
    t0 = time.perf_counter()
    r = proxier.sync(state, changed={key})
    added_ms = (time.perf_counter() - t0) * 1e3
    samples: dict[str, list[dict[str, float]]] = {"endpoint added": [], "endpoint removed": []}
    count = n
    for step in range(2 * args.changes):
        op = "endpoint added" if step % 2 == 0 else "endpoint removed"
        count += 1 if op == "endpoint added" else -1
        _key, new_state = with_service(count, step + 1)  # built outside the timed region
        with prof.phase("big_service_change"):
            t0 = time.perf_counter()
            r = proxier.sync(new_state, changed={key})
            t1 = time.perf_counter()
        assert not r.full and r.commands > 0, (op, r)
        samples[op].append({"total_ms": (t1 - t0) * 1e3, "render_ms": render_of(r) * 1e3,
                            "diff_ms": r.diff_seconds * 1e3,
                            "kernel_ms": r.kernel_seconds * 1e3, "commands": r.commands})
        state = new_state
    res["big_service"] = {"endpoints": n, "service_added_ms": added_ms, "changes": samples}
    log(f"pyproxy: one service with {n} endpoints: added in {added_ms:.0f} ms, "
        f"{2 * args.changes} one-endpoint changes done")
    return state


# =============================================================================================
# Worker: baseline (upstream-style layout)


def worker_baseline(args: argparse.Namespace) -> dict[str, Any]:
    assert_not_root_netns()
    import nftables

    from bench.synth import CLUSTER_CIDR, THIS_NODE, Cluster, apply_change, plan_changes
    from bench.upstream_layout import cold_chunks, render_services, update
    from pyproxy.cluster.snapshot import build_state

    nft = nftables.Nftables()
    nft.set_echo_output(False)

    def run(text: str) -> float:
        t0 = time.perf_counter()
        rc, _out, err = nft.cmd(text)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"baseline transaction failed: {err[:1500]}")
        return dt

    res: dict[str, Any] = {}
    cluster = Cluster(args.services, args.endpoints, seed=args.seed)
    state = build_state(list(cluster.objects()))
    log("baseline: state built (not timed), cold load in chunks ...")
    t0 = time.perf_counter()
    rendered = render_services(state, THIS_NODE, CLUSTER_CIDR)
    render_s = time.perf_counter() - t0
    kernel_s, tx, size, chains = 0.0, 0, 0, 0
    t_last = time.perf_counter()
    for text in cold_chunks(rendered):
        t0 = time.perf_counter()
        size += len(text)
        chains += text.count("add chain ")
        render_s += t0 - t_last  # the generator renders the chunk before yielding it
        kernel_s += run(text)
        tx += 1
        t_last = time.perf_counter()
        if tx % 20 == 0:
            log(f"baseline: {tx} transactions, {kernel_s:.1f} s in the kernel so far")
    res["cold"] = {"render_s": render_s, "kernel_s": kernel_s, "total_s": render_s + kernel_s,
                   "transactions": tx, "script_mb": size / 1e6,
                   "chains": chains + 14, **rss()}
    log(f"baseline: cold load {render_s + kernel_s:.1f} s ({tx} transactions)")

    samples: dict[str, list[dict[str, float]]] = {}
    for change in plan_changes(cluster, args.changes, seed=args.seed + 1):
        new_state = apply_change(state, change)
        old = {p.name: rendered[p.name] for p in state.ports_of(change.key)
               if p.name in rendered}
        t0 = time.perf_counter()
        new = render_services(new_state, THIS_NODE, CLUSTER_CIDR, {change.key})
        text = update(old, new)
        t1 = time.perf_counter()
        k = run(text)
        for p in state.ports_of(change.key):
            rendered.pop(p.name, None)
        rendered.update(new)
        samples.setdefault(change.op, []).append({
            "render_ms": (t1 - t0) * 1e3, "kernel_ms": k * 1e3,
            "total_ms": (t1 - t0 + k) * 1e3, "commands": text.count("\n")})
        state = new_state
        done = sum(len(v) for v in samples.values())
        if done % 25 == 0:
            log(f"baseline: {done} changes")
    res["changes"] = samples
    res["rss_end"] = rss()
    log("baseline: one-service changes done")
    return res


# =============================================================================================
# Driver (root namespace): namespaces, workers, report

_NAMESPACES: set[str] = set()


def _delete_netns(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL, check=False)
    _NAMESPACES.discard(ns)


def _cleanup_all() -> None:
    for ns in list(_NAMESPACES):
        _delete_netns(ns)


def _on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_in_netns(kind: str, args: argparse.Namespace, n: int) -> dict[str, Any] | None:
    ns = f"ppxbench-{os.getpid()}-{n}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    _NAMESPACES.add(ns)
    cmd = ["ip", "netns", "exec", ns, args.python, "-m", "bench.bench_sync", "--worker", kind,
           "--services", str(args.services), "--endpoints", str(args.endpoints),
           "--changes", str(args.changes), "--seed", str(args.seed),
           "--big-service", str(args.big_service), "--stage-chunk", str(args.stage_chunk)]
    if args.no_counting:
        cmd.append("--no-counting")
    if args.profile and kind == "pyproxy":
        cmd += ["--profile", os.path.join(args.profile, f"run{n}")]
    if args.gc_tuned:
        cmd.append("--gc-tuned")
    proc = None
    try:
        env = {**os.environ, "PPXBENCH_PARENT_NETNS": str(netns_inode())}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env=env, cwd=REPO)
        out, _ = proc.communicate(timeout=args.timeout)
        if proc.returncode != 0:
            print(f"{kind} worker failed (exit {proc.returncode})", file=sys.stderr)
            return None
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]
    except subprocess.TimeoutExpired:
        print(f"{kind} worker: timeout after {args.timeout} s", file=sys.stderr)
        return None
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own worker's process group
            proc.wait()
        _delete_netns(ns)


def host_info() -> dict[str, Any]:
    nft_v = subprocess.run(["nft", "--version"], capture_output=True, text=True).stdout.strip()

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", REPO, *a], capture_output=True,
                              text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "pyproxy")
    return {"commit": git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in pyproxy/"
                                                             if dirty else ""),
            "kernel": platform.release(), "nft": nft_v, "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Cold start: median over runs of each figure. Changes: all samples of all runs pooled."""
    cold_keys = [k for k, v in runs[0]["cold"].items() if isinstance(v, (int, float))
                 and not isinstance(v, bool)]
    cold = {k: statistics.median(r["cold"][k] for r in runs) for k in cold_keys}
    cold["total_s_runs"] = [r["cold"]["total_s"] for r in runs]
    changes: dict[str, dict[str, Any]] = {}
    for op in runs[0]["changes"]:
        pooled = [s for r in runs for s in r["changes"][op]]
        changes[op] = {f: summary([s[f] for s in pooled])
                       for f in pooled[0] if f.endswith("_ms")}
        changes[op]["commands"] = statistics.median(s["commands"] for s in pooled)
        if "gc_full" in pooled[0]:
            changes[op]["gc_full"] = sum(s["gc_full"] for s in pooled)
    return {"cold": cold, "changes": changes}


def report(args: argparse.Namespace, info: dict[str, Any], py: list[dict[str, Any]],
           base: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    P = aggregate(py)
    B = aggregate([base]) if base else None
    c = P["cold"]
    lines: list[str] = []
    w = lines.append
    first = py[0]
    w(f"pyproxy sync benchmark: {args.services} services x {args.endpoints} endpoints "
      f"({first['service_ports']} service ports, {first['endpoints_total']} endpoints; "
      f"3 nodes / 2 zones; proxy on node-a; IPv4)")
    if args.gc_tuned:
        w("EXPERIMENT --gc-tuned: GC disabled during the cold start, gc.freeze() after it "
          "(not the product's behaviour)")
    w(f"host: kernel {info['kernel']}, {info['nft']}, {info['cpus']} CPUs, python "
      f"{info['python']}, load average at start {info['loadavg'][0]:.2f}; {info['date']}")
    w(f"pyproxy: commit {info['commit']}")
    runs = f"median of {len(py)} runs" if len(py) > 1 else "1 run"
    w("")
    how = (f"staged ({c.get('transactions', 0):.0f} transactions of ≤ {args.stage_chunk} "
           "elements, made before break: packets see all or nothing)"
           if c.get("transactions", 1) > 1 else "ONE libnftables transaction")
    w(f"COLD START: one full sync, {how}, fresh netns ({runs})")
    rows = [
        ("decode (the API lists, as the daemon's codecs do)", c["decode_s"]),
        ("convert (build_state)", c["build_state_s"]),
        ("select + render (fragments)", c["render_s"]),
        ("  of which endpoint selection", c.get("select_s", 0.0)),
        ("  of which rendering", c["render_s"] - c.get("select_s", 0.0)),
        ("diff / commands (Applier up to the kernel call)", c["diff_s"]),
        ("kernel (libnftables; staged: elements over netlink)", c["kernel_s"]),
        ("other (rest of sync: bookkeeping, post-commit)", c["other_s"]),
    ]
    for label, v in rows:
        w(f"  {label:<50} {v:8.2f} s  {100 * v / c['total_s']:5.1f} %")
    w(f"  {'TOTAL':<50} {c['total_s']:8.2f} s"
      + (f"   (runs: {', '.join(f'{x:.2f}' for x in c['total_s_runs'])})" if len(py) > 1 else ""))
    w(f"  {'  of which in the garbage collector':<50} {c['gc_s']:8.2f} s  "
      f"{100 * c['gc_s'] / c['total_s']:5.1f} %  ({c['gc_full_collections']:.0f} full "
      f"collections)")
    w(f"  script {c['script_mb']:.1f} MB, {c['commands']:.0f} commands, {c['slots']:.0f} slots; "
      f"API JSON {first['payload_mb']:.1f} MB")
    w(f"  RSS after: VmRSS {c['vmrss_mb']:.0f} MB, peak (ru_maxrss) {c['maxrss_mb']:.0f} MB "
      f"(after build_state: {first['rss_after_build']['vmrss_mb']:.0f} MB)")
    w("")
    n = P["changes"][next(iter(P["changes"]))]["total_ms"]["n"]
    w(f"ONE-SERVICE CHANGES on the loaded table: partial sync, {n:.0f} samples each, each on a "
      f"different service; ms")
    w(f"  {'change':<20} {'render':>7} {'diff':>7} {'kernel':>7} {'other':>7} {'TOTAL':>8} "
      f"{'p90':>7} {'min':>6} {'max':>7} {'gc':>6} {'cmds':>5}")
    for op, s in P["changes"].items():
        w(f"  {op:<20} {s['render_ms']['median']:7.2f} {s['diff_ms']['median']:7.2f} "
          f"{s['kernel_ms']['median']:7.2f} {s['other_ms']['median']:7.2f} "
          f"{s['total_ms']['median']:8.2f} "
          f"{s['total_ms']['p90']:7.2f} {s['total_ms']['min']:6.2f} {s['total_ms']['max']:7.2f} "
          f"{s['gc_ms']['median']:6.2f} {s['commands']:5.0f}")
    w("  (render/diff/kernel/other/TOTAL: medians; other = the rest of the sync call, after the "
      "kernel; p90/min/max of TOTAL; gc: median ms in the collector)")
    full_gcs = sum(s.get("gc_full", 0) for s in P["changes"].values())
    if full_gcs:
        w(f"  full (generation-2) collections during the changes: {full_gcs:.0f}; the max "
          f"column shows their cost")
    chained = [x for op in first["changes"].values() for x in op if x.get("new_chain")]
    if chained:
        def listed(field: str) -> str:
            return ", ".join(f"{x[field]:.1f}" for x in chained)

        w(f"  {len(chained)} of the changes created a new shared pick chain (a service "
          f"reaching an endpoint count no other had): {listed('total_ms')} ms, of which "
          f"kernel {listed('kernel_ms')} and other {listed('other_ms')} (no longer a read of "
          f"the table's structure: only the periodic tamper check reads it); included above")
    w(f"  a full GC collection on this heap ({first['gc_tracked_objects'] / 1e6:.1f} M tracked "
      f"objects) pauses {first['gc_full_pause_ms']:.0f} ms; it can land on any sync")
    rs = first["resync"]
    w("")
    w(f"FULL RESYNC of the loaded, unchanged table (informational, run 1): {rs['total_s']:.2f} s "
      f"(render {rs['render_s']:.2f}, diff {rs['diff_s']:.2f}, kernel {rs['kernel_s']:.2f}, "
      f"gc {rs['gc_s']:.2f})")
    ok_mirror = all(r["check_mirror_equals_full_render"] for r in py)
    ok_kernel = all(r["check_kernel_service_ips"]["ok"] for r in py)
    k = first["check_kernel_service_ips"]
    w(f"checks: mirror after the partial syncs == fresh full render: "
      f"{'OK' if ok_mirror else 'FAIL'};"
      f" kernel service-ips elements == mirror ({k['kernel']}/{k['mirror']}): "
      f"{'OK' if ok_kernel else 'FAIL'}")

    ratios: dict[str, Any] = {}
    if B:
        bc = B["cold"]
        w("")
        w(f"BASELINE: upstream-style layout (chain per service and per endpoint, anonymous "
          f"numgen vmap), {bc['transactions']:.0f} transactions of 500 services")
        w(f"  cold load: render {bc['render_s']:.2f} s + kernel {bc['kernel_s']:.2f} s = "
          f"{bc['total_s']:.2f} s; {bc['chains']:.0f} chains, script {bc['script_mb']:.1f} MB, "
          f"VmRSS {bc['vmrss_mb']:.0f} MB")
        w(f"  {'change':<20} {'render':>7} {'kernel':>8} {'TOTAL':>8} {'p90':>8} {'max':>8}")
        for op, s in B["changes"].items():
            w(f"  {op:<20} {s['render_ms']['median']:7.2f} {s['kernel_ms']['median']:8.2f} "
              f"{s['total_ms']['median']:8.2f} {s['total_ms']['p90']:8.2f} "
              f"{s['total_ms']['max']:8.2f}")
        py_cold = c["render_s"] + c["diff_s"] + c["kernel_s"] + c["other_s"]
        ratios["cold_excl_decode_convert"] = py_cold / bc["total_s"]
        ratios["cold_incl_decode_convert"] = c["total_s"] / bc["total_s"]
        ratios["cold_kernel"] = c["kernel_s"] / bc["kernel_s"]
        ratios["changes_median_total"] = {
            op: P["changes"][op]["total_ms"]["median"] / B["changes"][op]["total_ms"]["median"]
            for op in P["changes"]}
        ratios["changes_median_kernel"] = {
            op: P["changes"][op]["kernel_ms"]["median"] / B["changes"][op]["kernel_ms"]["median"]
            for op in P["changes"]}
        w("")
        w("RATIOS pyproxy / baseline (< 1: pyproxy faster)")
        w(f"  cold start, sync only (render+diff+kernel vs render+kernel): "
          f"{ratios['cold_excl_decode_convert']:.2f}  ({py_cold:.2f} s vs {bc['total_s']:.2f} s)")
        w(f"  cold start, pyproxy incl. decode+build_state:               "
          f"{ratios['cold_incl_decode_convert']:.2f}")
        w(f"  cold start, kernel time only:                               "
          f"{ratios['cold_kernel']:.2f}")
        for op in P["changes"]:
            w(f"  {op:<20} total {ratios['changes_median_total'][op]:6.3f}   kernel "
              f"{ratios['changes_median_kernel'][op]:6.3f}")

    # ---- targets ---------------------------------------------------------------------------
    targets: list[dict[str, Any]] = []
    cold_target = COLD_TARGETS.get((args.services, args.endpoints))
    if cold_target is not None:
        targets.append({"target": f"cold start {args.services}x{args.endpoints} <= "
                                  f"{cold_target:.0f} s", "value": f"{c['total_s']:.2f} s",
                        "met": c["total_s"] <= cold_target})
    else:
        targets.append({"target": "cold start (targets defined for 10000x10 <= 10 s and "
                                  "44000x5 <= 60 s)", "value": f"{c['total_s']:.2f} s",
                        "met": None})
    # The issue's target is rendering; selection with it is shown beside it, not judged.
    share = (c["render_s"] - c.get("select_s", 0.0)) / c["total_s"]
    both = c["render_s"] / c["total_s"]
    targets.append({"target": "rendering <= 10 % of the cold start",
                    "value": f"{100 * share:.1f} % (with selection {100 * both:.1f} %)",
                    "met": share <= RENDER_SHARE_TARGET})
    limit = (ENVELOPE_CHANGE_TARGET_MS if (args.services, args.endpoints) in ENVELOPE
             else CHANGE_TARGET_MS)
    for op, s in P["changes"].items():
        med, p90, mx = (s["total_ms"][q] for q in ("median", "p90", "max"))
        targets.append({"target": f"{op} <= {limit:.0f} ms",
                        "value": f"median {med:.1f} ms, p90 {p90:.1f}, max {mx:.1f}",
                        "met": med <= limit, "p90_met": p90 <= limit, "max_met": mx <= limit})
    if "big_service" in first:
        big = first["big_service"]
        w("")
        w(f"ONE SERVICE WITH {big['endpoints']} ENDPOINTS (in slices of 100) on the loaded "
          f"table: added in {big['service_added_ms']:.0f} ms; one-endpoint changes, ms")
        for op, samples in big["changes"].items():
            st = summary([x["total_ms"] for x in samples])
            parts = " / ".join(f"{statistics.median(x[f] for x in samples):.2f}"
                               for f in ("render_ms", "diff_ms", "kernel_ms"))
            w(f"  {op:<20} median {st['median']:6.2f}  p90 {st['p90']:6.2f}  max "
              f"{st['max']:7.2f}  (render / diff / kernel {parts}; "
              f"{statistics.median(x['commands'] for x in samples):.0f} commands)")
            targets.append({"target": f"{op}, {big['endpoints']}-endpoint service <= "
                                      f"{BIG_SERVICE_TARGET_MS:.0f} ms",
                            "value": f"median {st['median']:.1f} ms, p90 {st['p90']:.1f}",
                            "met": st["median"] <= BIG_SERVICE_TARGET_MS,
                            "p90_met": st["p90"] <= BIG_SERVICE_TARGET_MS,
                            "max_met": st["max"] <= BIG_SERVICE_TARGET_MS})
    more_lines, more_targets = conncount.report(py)  # counting new connections
    lines += more_lines
    targets += more_targets
    w("")
    w("TARGETS")
    for t in targets:
        verdict = "n/a " if t["met"] is None else ("MET " if t["met"] else "MISS")
        extra = ""
        if "p90_met" in t and t["met"]:
            extra = ("" if t["max_met"] else "  (but max above the target)") if t["p90_met"] \
                else "  (median only; p90 above the target)"
        w(f"  [{verdict}] {t['target']:<48} {t['value']}{extra}")
    w("  (change targets judged on the median; p90 and max shown; the other core of this "
      "machine is busy, so single samples can be noisy)")
    data = {"args": {k: v for k, v in vars(args).items() if k not in ("python",)},
            "host": info, "pyproxy": {"runs": py, "aggregate": P},
            "baseline": {"run": base, "aggregate": B} if base else None,
            "ratios": ratios, "targets": targets}
    return "\n".join(lines) + "\n", data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--large", action="store_true", help="44,000 services x 5 endpoints")
    ap.add_argument("--quick", action="store_true", help="1,000 services (smoke run)")
    ap.add_argument("--changes", type=int, default=25,
                    help="samples per one-service change kind (default 25, minimum 20)")
    ap.add_argument("--runs", type=int, default=1,
                    help="pyproxy runs, each in a fresh netns (cold start: median of runs; "
                         "changes: samples pooled)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the upstream-style baseline (~6 min at 10k x 10)")
    ap.add_argument("--with-baseline", action="store_true",
                    help="run the baseline with --large too (off by default there: its cold "
                         "load takes well over 20 min at 44k and triggered kernel soft lockups "
                         "on the test machine)")
    ap.add_argument("--big-service", type=int, default=0, metavar="N",
                    help="also time one-endpoint changes of one service with N endpoints")
    ap.add_argument("--envelope", action="store_true",
                    help="the scale envelope instead of one size: 10,000 x 25 and 5,000 x 50 "
                         "(no baseline), and one service with 5,000 endpoints")
    ap.add_argument("--stage-chunk", type=int, default=DEFAULT_CHUNK, metavar="N",
                    help="elements per transaction of a staged full sync (the daemon's "
                         f"{DEFAULT_CHUNK}); 0: the cold start in ONE libnftables transaction")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write all figures as JSON ('-': "
                    "JSON on stdout instead of the table)")
    ap.add_argument("--profile", metavar="DIR",
                    help="cProfile the pyproxy phases into DIR (inflates the timings)")
    ap.add_argument("--gc-tuned", action="store_true",
                    help="experiment, not the product's behaviour: disable the cyclic GC during "
                         "the cold start and gc.freeze() after it")
    ap.add_argument("--timeout", type=int, default=3600, help="per-worker timeout, seconds")
    ap.add_argument("--python", default=VENV_PY if os.path.exists(VENV_PY) else sys.executable)
    ap.add_argument("--no-counting", action="store_true",
                    help="skip the cost of counting new connections per endpoint (cold start "
                         "and changes with and without it, reading the counters: ~1 min at 10k)")
    ap.add_argument("--worker", choices=("pyproxy", "baseline"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        fn: Callable[[argparse.Namespace], dict[str, Any]] = (
            worker_pyproxy if args.worker == "pyproxy" else worker_baseline)
        print(json.dumps(fn(args)))
        return

    if args.large:
        args.services, args.endpoints = 44_000, 5
        args.no_baseline = args.no_baseline or not args.with_baseline
    elif args.quick:
        args.services = 1_000
    if args.changes < 20:
        ap.error("--changes must be at least 20")
    if os.geteuid() != 0:
        sys.exit("must run as root (it creates network namespaces)")
    atexit.register(_cleanup_all)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    info = host_info()
    if args.envelope:
        args.no_baseline = True
        args.big_service = args.big_service or 5_000
        texts, datas = [], []
        for services, endpoints in ENVELOPE:
            one = argparse.Namespace(**{**vars(args), "services": services,
                                        "endpoints": endpoints})
            args.big_service = 0  # once is enough
            text, data = bench_size(one, info)
            sys.stdout.write(text + "\n")
            texts.append(text)
            datas.append(data)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(datas, f, indent=1)
        return
    text, data = bench_size(args, info)
    if args.json == "-":
        json.dump(data, sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
            log(f"JSON written to {args.json}")


def bench_size(args: argparse.Namespace, info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The pyproxy runs (and the baseline) at one size, and their report."""
    log(f"bench: {args.services} x {args.endpoints}, {args.runs} pyproxy run(s), baseline "
        f"{'off' if args.no_baseline else 'on'}")
    py: list[dict[str, Any]] = []
    try:
        for n in range(args.runs):
            r = run_in_netns("pyproxy", args, n)
            if r is None:
                sys.exit(1)
            py.append(r)
        base = None if args.no_baseline else run_in_netns("baseline", args, args.runs)
        if not args.no_baseline and base is None:
            log("baseline failed; reporting pyproxy only")
    finally:
        _cleanup_all()
    return report(args, info, py, base)


if __name__ == "__main__":
    main()
