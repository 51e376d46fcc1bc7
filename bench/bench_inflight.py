"""What reading the connections in flight costs (`make bench-inflight`; root, a few minutes).

A throwaway network namespace gets N TCP conntrack entries, ESTABLISHED and DNATed as a
Service's rules would (testkit/ctfill.py: written over ctnetlink with a NAT attribute, so the
kernel sets the reply tuple and the DST_NAT status), spread over 1,000 Services of 10
endpoints. Measured, each the minimum of REPEATS:

- the daemon's read (pyproxy/kernel/nlconntrack.py: the filtered ctnetlink dump, decoded
  and counted per flow), CPU (user + system of this process: the kernel's side of a dump
  runs in its recv calls) and wall time;
- the baseline in the same run: the same entries dumped through pyroute2 (what
  pyproxy/kernel/netlink.py's cleanup uses), decoded into ConntrackEntry objects, once;
- the pure part (core/inflight.py): the index of the selections in force and the count of
  every flow, at 1,000 and 10,000 Services.

Figures in docs/performance.md ("Connections in flight"), history in bench/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.inflight import FlowIndex, count
from pyproxy.core.model import ClusterState, IPFamily
from pyproxy.core.topology import select_all
from pyproxy.kernel.netlink import ConntrackCleaner
from pyproxy.kernel.nlconntrack import KernelFlows
from pyproxy.kernel.nlelements import netlink_socket
from testkit import ctfill
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.inproc import call_in_netns
from testkit.netlab import Lab

REPEATS = 3
ENDPOINTS = 10
RESULTS = Path(__file__).parent / "results"


def frontend(i: int) -> tuple[str, int]:
    return f"10.96.{i // 250}.{i % 250 + 1}", 80


def state(services: int) -> ClusterState:
    """`services` Services of ENDPOINTS endpoints, addressed as ctfill.flows addresses them."""
    objects: list[dict[str, Any]] = [make_node("node-a", "zone-1")]
    for i in range(services):
        n = i * ENDPOINTS
        objects.append(make_service("ns", f"svc-{i}", ip=frontend(i)[0]))
        objects.append(make_slice("ns", f"svc-{i}", [
            ep(f"10.244.{(n + e) // 250}.{(n + e) % 250 + 2}", "node-b")
            for e in range(ENDPOINTS)]))
    return build_state(objects)


def best(fn: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, float, Any]:
    """(CPU seconds, wall seconds, result) of the fastest of `repeats` runs."""
    runs = []
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        runs.append((time.process_time() - cpu, time.perf_counter() - wall, result))
    return min(runs, key=lambda r: r[0])


def measure(lab: Lab, entries: int, services: int) -> dict[str, Any]:
    node = lab.add_ns(f"ct{entries}")
    lab.nft(node, "table ip nat { chain pre { type nat hook prerouting priority -100; }; }")
    fronts = [frontend(i) for i in range(services)]
    written = ctfill.insert(node.full, ctfill.flows(entries, fronts, ENDPOINTS))
    flows = KernelFlows(lambda: call_in_netns(node.full, netlink_socket))
    cpu, wall, counted = best(lambda: flows.read(IPFamily.IPv4))
    base_cpu, base_wall, dumped = best(
        lambda: ConntrackCleaner(netns=node.full).dump(IPFamily.IPv4, (6,)), 1)
    lab.del_ns(node)
    return {"entries": written, "flows": len(counted.flows), "decoded": counted.entries,
            "read_cpu_s": round(cpu, 4), "read_wall_s": round(wall, 4),
            "us_per_entry": round(cpu / written * 1e6, 2),
            "pyroute2_cpu_s": round(base_cpu, 3), "pyroute2_wall_s": round(base_wall, 3),
            "pyroute2_entries": len(dumped), "ratio": round(cpu / base_cpu, 4)}


def counting(services: int, flows: dict[Any, list[int]]) -> dict[str, Any]:
    s = state(services)
    selections = [(ps, s.endpoints(ps.port.name, ps.family)) for ps in select_all(s, "node-a")]
    index_cpu, _, index = best(lambda: FlowIndex.of(selections))
    count_cpu, _, result = best(lambda: count(flows, index))
    return {"services": services, "index_cpu_s": round(index_cpu, 4),
            "count_cpu_s": round(count_cpu, 4), "flows": len(flows),
            "established": sum(p.established for p in result.ports.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default="10000,100000")
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--out", help="JSON results file (default bench/results/...)")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    reads = []
    with Lab() as lab:
        for n in (int(x) for x in args.entries.split(",")):
            row = measure(lab, n, args.services)
            reads.append(row)
            print(f"{row['entries']:>7} entries: read {row['read_cpu_s'] * 1000:7.1f} ms CPU "
                  f"({row['us_per_entry']} µs/entry, {row['read_wall_s'] * 1000:.1f} ms wall), "
                  f"{row['flows']} flows; pyroute2 {row['pyroute2_cpu_s']:.2f} s CPU: "
                  f"ratio {row['ratio']:.3f}")
    flows = {(f"10.96.{i // 250}.{i % 250 + 1}", 80,
              f"10.244.{(i * ENDPOINTS + e) // 250}.{(i * ENDPOINTS + e) % 250 + 2}", 8080):
             [10, 0] for i in range(args.services) for e in range(ENDPOINTS)}
    pure = [counting(n, flows) for n in (args.services, 10 * args.services)]
    for row in pure:
        print(f"{row['services']:>6} services: index {row['index_cpu_s'] * 1000:.1f} ms, "
              f"count of {row['flows']} flows {row['count_cpu_s'] * 1000:.1f} ms CPU")
    out = Path(args.out) if args.out else RESULTS / f"inflight-{commit}.json"
    out.write_text(json.dumps({"commit": commit, "reads": reads, "counting": pure},
                              indent=1) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
