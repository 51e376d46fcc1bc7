#!/usr/bin/env python3
"""First-packet latency (`make bench`): TCP connect time through a ClusterIP with a small and
a large table, measured with real packets in network namespaces.

    python -m bench.bench_first_packet                  # 10 vs 10,000 services, 1,000 connects each
    python -m bench.bench_first_packet --connects 2000 --large-services 44000

Two copies of testkit/netlab.py's standard topology (client → node → pod) run side by side:
pyproxy programs one node with the measured service and a few others (--small-services in
all), the other with the same service among --large-services (a synthetic mix: bench/synth.py,
10 endpoints each). A client in each lab makes sequential TCP connects to the service's
ClusterIP; each one is a new connection, so its SYN goes through the node's NAT lookup
(`services` → `service-ips` → pick chain → `endpoints-*`), and the time is connect() alone
(SYN out, SYN-ACK back). Rounds alternate between the labs (--round connects each), so a busy
moment of the machine lands on both sides alike. Target: median at the large size ≤ 1.1 ×
the median at the small size.

Root only. Everything runs in namespaces the labs create and remove (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from bench.synth import Cluster as Synthetic
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.netlab import Cluster, Lab
from testkit.nftns import NodeProxy

VIP = "10.96.0.10"  # synth's ClusterIPs start at 10.96.0.16
TARGET_RATIO = 1.1

# Runs in the client namespace with the lab's interpreter: COUNT sequential connects, each
# timed from connect() to its completion. The client reads the backend's answer line and
# closes first: the TIME_WAIT is then on the client, whose kernel picks ports clear of it,
# not on the backend, where the node's fully-random masquerade ports would run into them
# (a SYN hitting a TIME_WAIT of another connection is answered with a reset).
CLIENT = r"""
import json, socket, sys, time
addr, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out, replies = [], set()
for _ in range(count):
    s = socket.socket()
    s.settimeout(2.0)
    t = time.perf_counter_ns()
    s.connect((addr, port))
    out.append((time.perf_counter_ns() - t) / 1000)
    reply = b""
    while b"\n" not in reply and (chunk := s.recv(4096)):
        reply += chunk
    replies.add(reply.split()[0].decode() if reply else "")
    s.close()
print(json.dumps({"us": out, "replies": sorted(replies)}))
"""


def objects(cluster: Cluster, services: int) -> list[dict[str, Any]]:
    """The measured service (one endpoint, pod-a) and services - 1 synthetic others."""
    out: list[dict[str, Any]] = [make_node("node-a", "zone-1"),
                                 make_service("ns", "measured", ip=VIP),
                                 make_slice("ns", "measured",
                                            [ep(cluster.pods["pod-a"].ip4, "node-b")])]
    out += [o for o in Synthetic(services - 1, 10).objects() if o["kind"] != "Node"]
    return out


def program(cluster: Cluster, services: int) -> None:
    config = NodeConfig(node_name="node-a", node_ips=(cluster.node_ip4,),
                        cluster_cidrs=(cluster.cluster_cidr4,))
    NodeProxy(cluster.node.full, config, (IPFamily.IPv4,)).apply(objects(cluster, services))


def connects(cluster: Cluster, count: int) -> list[float]:
    proc = cluster.lab.exec_python(cluster.client, CLIENT, args=(VIP, "80", str(count)),
                                   timeout=60 + count)
    got = json.loads(proc.stdout)
    # every connect must have reached the service's one endpoint through the NAT
    assert got["replies"] == ["pod-a"], got["replies"]
    return [float(x) for x in got["us"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-services", type=int, default=10)
    ap.add_argument("--large-services", type=int, default=10_000)
    ap.add_argument("--connects", type=int, default=1000, help="per size (at least 1,000)")
    ap.add_argument("--round", type=int, default=50, help="connects per round")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_first_packet: needs root (network namespaces)")
    sizes = (args.small_services, args.large_services)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    rounds: dict[int, list[float]] = {n: [] for n in sizes}
    with Lab() as lab_small, Lab() as lab_large:
        labs = {sizes[0]: lab_small.standard_topology(backends=1),
                sizes[1]: lab_large.standard_topology(backends=1)}
        for n, cluster in labs.items():
            program(cluster, n)
            connects(cluster, 20)  # warm-up: ARP, route and socket caches
        while min(len(s) for s in samples.values()) < args.connects:
            for n, cluster in labs.items():
                got = connects(cluster, args.round)
                samples[n] += got
                rounds[n].append(statistics.median(got))
    small, large = (statistics.median(samples[n]) for n in sizes)
    per_round = [b / a for a, b in zip(rounds[sizes[0]], rounds[sizes[1]], strict=True)]
    print(f"\nTCP connect through a ClusterIP (µs), {len(samples[sizes[0]])} connects per size "
          f"in {len(per_round)} alternating rounds")
    for n in sizes:
        s = sorted(samples[n])
        print(f"  {n:>7} services: median {statistics.median(s):7.1f}  p10 "
              f"{s[len(s) // 10]:7.1f}  p90 {s[len(s) * 9 // 10]:7.1f}  max {s[-1]:8.1f}")
    ratio = large / small
    print(f"  ratio of the medians {sizes[1]} / {sizes[0]}: {ratio:.3f} (per round "
          f"{min(per_round):.2f}–{max(per_round):.2f}, median {statistics.median(per_round):.3f})")
    print(f"  target ≤ {TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"sizes": sizes, "samples_us": {str(n): samples[n] for n in sizes},
                       "ratio": ratio, "per_round_ratios": per_round}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
