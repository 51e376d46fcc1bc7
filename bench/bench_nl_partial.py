#!/usr/bin/env python3
"""One-endpoint changes at 5,000 Services x 50 endpoints (0.5 % with ClientIP affinity: ~1,300
per-endpoint affinity sets), through libnftables and over raw netlink, alternately
(issue 37). Must run as root.

    python -m bench.bench_nl_partial [--services 5000] [--endpoints 50] [--pairs 40]

The synthetic cluster (bench/synth.py) is synced in full into a throwaway network namespace
(created and deleted here; the process never leaves the root namespace, whose ruleset it never
touches). Then each pair is two changes, each replacing one endpoint of a plain Service (a pod
restarted: the endpoints map's slot and the hairpin set change, nothing else): one committed
through libnftables (`LibNftables.apply`, the path before), one over raw netlink
(`apply_elements`), in alternating order. Each sync is timed whole, wall and CPU (this
process's: the kernel's work on our behalf is system time of this thread); the figure that
matters is the paired ratio, measured on the same table under the same load. The load average
is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench.synth import NODE_CONFIG, POD_NEW_BASE, Change, Cluster, apply_change, ip4
from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import ClusterState, IPFamily
from pyproxy.sync.proxier import FamilyProxier
from testkit.netlab import Lab
from testkit.nftns import libnft_in


def replace_one(cluster: Cluster, i: int, serial: int) -> Change:
    """Service i with its endpoint `serial % endpoints` replaced by a new pod IP."""
    eps = cluster.initial_endpoints(i)
    slot = serial % len(eps)
    eps[slot] = (ip4(POD_NEW_BASE + serial), eps[slot][1])
    return Change("endpoint replaced", i, cluster.key(i), cluster.service(i),
                  cluster.endpoint_slice(i, eps, generation=serial + 1), len(eps), len(eps))


def timed(proxier: FamilyProxier, state: ClusterState, change: Change) -> dict[str, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = proxier.sync(state, changed={change.key})
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert not result.full
    return {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "kernel_ms": result.kernel_seconds * 1e3}


def summary(samples: list[dict[str, float]], field: str) -> dict[str, float]:
    values = sorted(s[field] for s in samples)
    return {"p50": statistics.median(values), "mean": statistics.fmean(values),
            "p90": values[int(0.9 * (len(values) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=5000)
    parser.add_argument("--endpoints", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    cluster = Cluster(args.services, args.endpoints, seed=1)
    state = build_state(list(cluster.objects()))
    plain = [i for i in range(args.services) if cluster.shape(i).plain
             and cluster.initial_endpoints(i)]
    affinity = sum(1 for i in range(args.services) if cluster.shape(i).affinity)
    with Lab() as lab:
        ns = lab.add_ns(f"nlp{os.getpid()}")
        paths = {"libnftables": libnft_in(ns.full, raw_elements=False),
                 "netlink": libnft_in(ns.full)}
        proxier = FamilyProxier(IPFamily.IPv4, NODE_CONFIG, paths["netlink"])
        t0 = time.perf_counter()
        proxier.sync(state)
        load_s = time.perf_counter() - t0
        sets = len(proxier.applier.expected_shape().sets)
        load_before = os.getloadavg()
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
        for pair in range(args.pairs):
            order = list(paths) if pair % 2 == 0 else list(paths)[::-1]
            for k, name in enumerate(order):
                change = replace_one(cluster, plain[(2 * pair + k) * 7 % len(plain)],
                                     2 * pair + k)
                state = apply_change(state, change)  # outside the timed region
                proxier.applier.nft = paths[name]
                samples[name].append(timed(proxier, state, change))
            assert "element" in proxier.applier.last_script
        load_after = os.getloadavg()
    ratios = {field: statistics.median(n[field] / o[field] for n, o in zip(
        samples["netlink"], samples["libnftables"], strict=True))
        for field in ("wall_ms", "cpu_ms")}
    out: dict[str, Any] = {
        "services": args.services, "endpoints": args.endpoints, "affinity_services": affinity,
        "sets_and_maps": sets, "pairs": args.pairs, "full_sync_s": round(load_s, 1),
        "loadavg_before": load_before, "loadavg_after": load_after,
        "paths": {name: {f: summary(s, f) for f in ("wall_ms", "cpu_ms", "kernel_ms")}
                  for name, s in samples.items()},
        "paired_median_ratio_netlink_over_libnftables": ratios}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
