"""Quiet network programming latency, focused (issue 37): `make bench-npl` (root; `make k8s`).

One real control plane loaded with the synthetic cluster (`--size`, default 1,000 × 10), then
pyproxy and kube-proxy v1.37.2 started on it alternately (`--rounds`, default 3, each proxy
started afresh every round, in bench_vs_kube_proxy's node namespace with its settings), and
in each round `--flips` (default 20) changes of the probe Service's one endpoint between two
real backends, `--spacing` s apart (default 2: nothing else pending). Per change:

- write: the PATCH's own round trip (the bench's client to the API server and back);
- NPL: the write's start until the first new connection through the Service lands on the new
  backend (probed every ~5 ms from a client namespace), as bench_vs_kube_proxy measures it;
- pyproxy only, from its sync history (its debug socket): the write's start until its sync
  started (the API server's commit, the watch's delivery, the decode, the cache, the
  runner), and that sync's own duration (render, diff, kernel commit, bookkeeping).

Prints each round's medians and, over the rounds, the median of pyproxy / kube-proxy per
round: the machine's speed varies by 1.5-2x over minutes, so only ratios measured in the same
run are compared. `--against REV` adds a third proxy, another commit's pyproxy (a temporary
worktree, bench/against.py), in each round. `--json FILE` keeps every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import against as against_build
from bench import bench_vs_kube_proxy as vs
from bench.bytecode import compile_pyproxy
from pyproxy.serve import debug
from testkit.controlplane import (
    binaries_dir,
    missing_binaries,
    running_control_plane,
    service_account_token,
)


def sync_split(written: float, history: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """(write start → start of the first sync that began after it, that sync's duration) in
    seconds, from pyproxy's sync history (wall clock); None when no sync began after it."""
    after = [r for r in history if r["started"] >= written and not r.get("error")]
    if not after:
        return None
    first = min(after, key=lambda r: r["started"])
    return first["started"] - written, first["finished"] - first["started"]


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in samples for k in s})
    return {k: statistics.median(s[k] for s in samples if k in s) for k in keys}


def flips(name: str, kube: vs.Kube, cluster: vs.Cluster, count: int, spacing: float,
          history: Callable[[], list[dict[str, Any]]] | None) -> list[dict[str, float]]:
    prober = vs.Prober(cluster.client.full)
    pods = [cluster.pods["pod-a"].ip4, cluster.pods["pod-b"].ip4]
    names = ["pod-a", "pod-b"]
    out: list[dict[str, float]] = []
    for n in range(count):
        target = (n + 1) % 2
        body = vs.probe_slice(pods[target])
        written = time.time()
        kube.discovery.patch_namespaced_endpoint_slice(f"{vs.PROBE_NAME}-1", vs.PROBE_NS, {
            "endpoints": body["endpoints"],
            "metadata": {"annotations": body["metadata"]["annotations"]}})
        sample = {"write": time.time() - written}
        if prober.first_landing(names[target], timeout=60) is None:
            raise RuntimeError(f"{name}: change {n} never arrived")
        sample["npl"] = time.time() - written
        out.append(sample)
        time.sleep(max(0.0, spacing - (time.time() - written)))
        if history is not None:
            split = sync_split(written, history())
            if split is not None:
                sample["to_sync_start"], sample["sync"] = split
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1000x10", help="SERVICESxENDPOINTS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flips", type=int, default=20)
    parser.add_argument("--spacing", type=float, default=2.0)
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--against", metavar="REV",
                        help="also REV's pyproxy in each round (a temporary git worktree)")
    args = parser.parse_args()
    bin_dir = binaries_dir()
    if missing_binaries(bin_dir):
        print(f"run `make k8s` first ({bin_dir})", file=sys.stderr)
        return 2
    compile_pyproxy()
    services, endpoints = (int(x) for x in args.size.split("x"))
    rounds: list[dict[str, list[dict[str, float]]]] = []
    with contextlib.ExitStack() as stack:
        theirs = stack.enter_context(against_build.other_build(args.against)) \
            if args.against else None
        plane = stack.enter_context(running_control_plane(bin_dir))
        kube, _synth, cluster, lab, load_s = stack.enter_context(
            vs.loaded_cluster(plane, services, endpoints))
        print(f"{services} × {endpoints} loaded through the API in {load_s:.0f} s", flush=True)
        kubeconfig = plane.node_kubeconfig(lab.workdir / "pyproxy.kubeconfig",
                                           service_account_token(kube))
        sock = lab.workdir / "pyproxy.sock"

        def pyproxy(binary: str, log: str) -> Callable[[], Any]:
            argv = vs.pyproxy_argv(kubeconfig, vs.NODE, binary, debug_socket=str(sock))
            return lambda: lab.popen(cluster.node, argv, log_name=log)

        proxies: dict[str, tuple[Callable[[], Any], str, bool]] = {
            "pyproxy": (pyproxy(vs.PYPROXY, "pyproxy.log"), "pyproxy", True),
            "kube-proxy": (vs.kube_proxy_starter(plane, lab, cluster, kube), "kube-proxy",
                           False)}
        if theirs is not None:
            proxies[f"pyproxy {args.against}"] = (
                pyproxy(theirs, f"pyproxy-{args.against}.log"), "pyproxy", True)
        for n in range(args.rounds):
            rounds.append({})
            for name, (start, table, has_history) in proxies.items():
                def stop(proc: Any, table: str = table) -> None:
                    lab.stop_process(proc)
                    for family in ("ip", "ip6"):
                        cluster.node.run(["nft", "delete", "table", family, table],
                                         check=False)
                    lab.flush_conntrack(cluster.node)

                handle, _ = vs.cold_start(name, start, stop, kube, cluster)
                try:
                    time.sleep(2.0)  # the first sync's aftermath settles
                    history = (lambda: debug.ask(str(sock), "/history", n=50)) \
                        if has_history else None
                    samples = flips(name, kube, cluster, args.flips, args.spacing, history)
                finally:
                    stop(handle)
                rounds[-1][name] = samples
                m = medians(samples)
                print(f"  round {n + 1} {name}: " + ", ".join(
                    f"{k} {1000 * v:.1f} ms" for k, v in m.items()), flush=True)
    print(report(rounds))
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "rounds": rounds}, indent=1))
    return 0


def report(rounds: list[dict[str, list[dict[str, float]]]]) -> str:
    """Medians over every sample per proxy, and the median of the per-round ratios of each
    proxy's NPL p50 to kube-proxy's."""
    names = list(rounds[0])
    lines = ["", "quiet NPL, medians over the rounds' samples (ms):"]
    for name in names:
        pooled = [s for r in rounds for s in r[name]]
        m = medians(pooled)
        lines.append(f"  {name:>24}: " + ", ".join(f"{k} {1000 * v:.1f}"
                                                   for k, v in m.items()) + f" (n={len(pooled)})")
    for name in names:
        if name == "kube-proxy":
            continue
        ratios = [statistics.median(s["npl"] for s in r[name])
                  / statistics.median(s["npl"] for s in r["kube-proxy"]) for r in rounds]
        lines.append(f"  NPL p50 {name} / kube-proxy, per round: "
                     + ", ".join(f"{x:.2f}" for x in ratios)
                     + f"; median {statistics.median(ratios):.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
