"""Least-connection balancing against random (`make bench-least`; root, ~3 min).

1. The spread, on real packets (testkit/netlab.py): a ClusterIP Service of three endpoints,
   clients opening RATE long-lived connections per second for DURATION seconds through it;
   a connection to the slow endpoint is held SLOW_HOLD seconds, to the others HOLD seconds
   (a slow backend: its requests take longer, so it holds its connections longer). The same
   run with the Service balanced `random` (kube-proxy's) and `lc`, the feedback stepping
   every INTERVAL as the daemon's (sync/least.py's update, then the family proxier's sync of
   the changed Service, real map writes). Measured: the connections held open per endpoint,
   every second of the second half of the run; the spread is the slow endpoint's mean over
   the others'.
2. The CPU the feedback costs at 1,000 Services using it (10 endpoints each), in a namespace:
   synthetic connections in flight through the pure step and the real writes of the changed
   slots, the loads responding to the shares as connections would (`cost_run`) or drawn
   anew each step (the most a step can have to write); CPU per step, and its share of one
   CPU at the default interval of 2 s.

Results in bench/results/least-COMMIT.json; the figures in docs/services.md.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import subprocess
import time
from pathlib import Path
from statistics import mean
from typing import Any

from pyproxy.cluster.snapshot import build_state
from pyproxy.config import LogFormat
from pyproxy.core.inflight import FlowIndex, count
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.logs import setup_logging
from pyproxy.sync.least import LeastConnections
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.held import HeldClients, HoldingServer, least_feedback
from testkit.netlab import Cluster, Lab
from testkit.nftns import libnft_in

VIP, HELD = "10.96.0.50", 9090
RESULTS = Path(__file__).parent / "results"


def objects(c: Cluster, algorithm: str) -> list[dict[str, Any]]:
    def tweak(svc: dict[str, Any]) -> None:
        svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": algorithm}
        svc["spec"]["ports"][0]["targetPort"] = HELD

    def port(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": HELD, "protocol": "TCP"}]

    return [make_node("node-a", "zone-1"), make_service("ns", "svc", tweak, ip=VIP),
            make_slice("ns", "svc", [ep(c.pods[p].ip4, "node-a") for p in c.pods], port)]


def spread_run(c: Cluster, algorithm: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the workload under `algorithm`; held connections per endpoint per second."""
    least, proxier, reader = least_feedback(c, interval=args.interval)
    state = build_state(objects(c, algorithm))
    proxier.sync(state)
    slow = sorted(c.pods)[0]
    hold = {p: args.slow_hold if p == slow else args.hold for p in c.pods}
    clients = HeldClients(c.client.full, VIP, 80)
    closing: list[tuple[float, str]] = []  # (when, endpoint), one per connection
    samples: list[dict[str, int]] = []
    steps, step_cpu = 0, 0.0
    start = time.monotonic()
    next_open, next_step, next_sample = start, start + args.interval, start + 1.0
    try:
        while (now := time.monotonic()) < start + args.duration:
            while closing and closing[0][0] <= now:
                _, name = heapq.heappop(closing)
                socks = clients.where.get(name) or []
                if socks:
                    socks.pop(0).close()
            if now >= next_open:
                for name, n in clients.open(1).items():
                    for _ in range(n):
                        heapq.heappush(closing, (now + hold[name], name))
                next_open += 1.0 / args.rate
            if algorithm == "lc" and now >= next_step:
                cpu = time.process_time()
                ports = list(proxier.selections.values())
                changed = least.update(ports, reader.current(0))
                if changed:
                    proxier.sync(state, changed=changed)
                step_cpu += time.process_time() - cpu
                steps += 1
                next_step += args.interval
            if now >= next_sample:
                samples.append({p: len(clients.where.get(p, [])) for p in c.pods})
                next_sample += 1.0
            time.sleep(0.005)
    finally:
        clients.close()
        c.node.run(["nft", "delete table ip pyproxy"], check=False)
        c.lab.flush_conntrack(c.node)
    tail = samples[len(samples) // 2:]
    held = {p: round(mean(s[p] for s in tail), 1) for p in c.pods}
    others = mean(v for p, v in held.items() if p != slow)
    return {"algorithm": algorithm, "slow": slow, "held": held,
            "spread": round(held[slow] / others, 2) if others else None,
            "steps": steps, "step_cpu_ms": round(1000 * step_cpu / steps, 2) if steps else None,
            "samples": samples}


def cost_run(lab: Lab, services: int, endpoints: int, steps: int, interval: float,
             responding: bool) -> dict[str, Any]:
    """The feedback's CPU at `services` least-connection Services, real map writes. The
    connections in flight start at 0-49 per endpoint (drawn); each step, with `responding`,
    every endpoint's count moves half way to its share of its Service's connections (the
    slots it holds: what the feedback set) and by up to ±5 % of noise, as connections would;
    without, every count is drawn anew (loads that ignore the shares: the most a step can
    have to write)."""
    node = lab.add_ns(f"lc-cost-{responding}")
    config = NodeConfig("node-a", node_ips=("192.168.0.10",), cluster_cidrs=("10.128.0.0/9",))
    least = LeastConnections(interval=interval)
    proxier = FamilyProxier(IPFamily.IPv4, config, libnft_in(node.full), least.adjust)

    def tweak(svc: dict[str, Any]) -> None:
        svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": "lc"}

    objs: list[dict[str, Any]] = [make_node("node-a", "zone-1")]
    addresses = []
    for i in range(services):
        vip = f"10.96.{i // 250}.{i % 250 + 1}"
        eps = [f"10.{128 + (i * endpoints + e) // 65536}.{(i * endpoints + e) // 256 % 256}."
               f"{(i * endpoints + e) % 256}" for e in range(endpoints)]
        addresses.append((vip, eps))
        objs += [make_service("ns", f"svc-{i}", tweak, ip=vip),
                 make_slice("ns", f"svc-{i}", [ep(a, "node-b") for a in eps])]
    state = build_state(objs)
    proxier.sync(state)
    rng = random.Random(7)
    active = {(vip, a): float(rng.randrange(0, 50)) for vip, eps in addresses for a in eps}
    rows = []
    for _ in range(steps):
        ports = list(proxier.selections.values())
        if responding:
            active = respond(active, ports, rng)
        else:
            active = {key: float(rng.randrange(0, 50)) for key in active}
        flows = {(vip, 80, a, 8080): [round(n), 0] for (vip, a), n in active.items()}
        cpu = time.process_time()
        in_flight = count(flows, FlowIndex.of(
            (ps, [*(ps.selection.cluster or ())]) for ps in ports))
        changed = least.update(ports, in_flight)
        mid = time.process_time()
        result = proxier.sync(state, changed=changed)
        rows.append({"pure_ms": round(1000 * (mid - cpu), 1),
                     "writes_ms": round(1000 * (time.process_time() - mid), 1),
                     "services_changed": len(changed), "slots_written": result.slots_changed})
    lab.del_ns(node)
    tail = rows[len(rows) // 2:]
    per_step = mean(r["pure_ms"] + r["writes_ms"] for r in tail) / 1000
    return {"services": services, "endpoints": endpoints, "responding": responding,
            "steps": rows, "tail_cpu_ms_per_step": round(1000 * per_step, 1),
            "tail_slots_per_step": round(mean(r["slots_written"] for r in tail)),
            "cpu_share_at_interval": round(per_step / interval, 3)}


def respond(active: dict[tuple[str, str], float], ports: list[Any],
            rng: random.Random) -> dict[tuple[str, str], float]:
    """Each endpoint's count half way to its share of its Service's total, ±5 %."""
    out = dict(active)
    for ps in ports:
        vip = ps.port.cluster_ip(ps.family)
        eps = [e.ip for e in ps.selection.cluster or ()]
        total = sum(active[(vip, a)] for a in eps)
        table = ps.selection.least.table if ps.selection.least else None
        for a in eps:
            share = (table.count(f"{a}:8080") / len(table)) if table else 1 / len(eps)
            now = active[(vip, a)]
            out[(vip, a)] = (now + 0.5 * (share * total - now)) * rng.uniform(0.95, 1.05)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=10.0, help="new connections per second")
    parser.add_argument("--hold", type=float, default=2.0)
    parser.add_argument("--slow-hold", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--services", type=int, default=1000, help="0: no cost part")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    setup_logging(LogFormat.TEXT, 0)  # the reads' debug lines are not figures
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    with Lab() as lab:
        c = lab.standard_topology(backends=3)
        servers = [HoldingServer(c.pods[p].ns.full, c.pods[p].ip4, HELD, p) for p in c.pods]
        try:
            runs = [spread_run(c, algorithm, args) for algorithm in ("random", "lc")]
        finally:
            for server in servers:
                server.close()
        for run in runs:
            print(f"{run['algorithm']:>6}: held per endpoint {run['held']} (slow: "
                  f"{run['slow']}), spread {run['spread']}"
                  + (f", {run['steps']} steps, {run['step_cpu_ms']} ms CPU each"
                     if run["steps"] else ""))
        costs = [cost_run(lab, args.services, 10, args.steps, 2.0, responding)
                 for responding in (True, False)] if args.services else []
        for cost in costs:
            first = cost["steps"][0]
            print(f"{cost['services']} lc services, loads "
                  + ("responding to the shares" if cost["responding"] else "redrawn each step")
                  + f": first step {first['pure_ms']} ms pure + {first['writes_ms']} ms writes "
                  f"({first['slots_written']} slots); second half {cost['tail_cpu_ms_per_step']}"
                  f" ms per step ({cost['tail_slots_per_step']} slots), "
                  f"{cost['cpu_share_at_interval']:.1%} of a CPU at a 2 s interval")
    out = Path(args.out) if args.out else RESULTS / f"least-{commit}.json"
    out.write_text(json.dumps({"commit": commit, "args": vars(args), "runs": runs,
                               "cost": costs}, indent=1) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
