#!/usr/bin/env python3
"""What a Maglev service costs next to a default (random) one: elements and time to program
it, and elements touched and time per endpoint change, on a table already holding
--services default services. Runs in a throwaway network namespace (root).

    python -m bench.bench_maglev --services 10000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time

from bench.synth import NODE_CONFIG, Cluster
from pyproxy.cluster.snapshot import build_state
from pyproxy.core.convert import convert_service
from pyproxy.core.convert_endpoints import convert_endpoint_slice
from pyproxy.core.model import IPFamily, ServiceKey
from pyproxy.sync.proxier import FamilyProxier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(args: argparse.Namespace) -> None:
    cluster = Cluster(args.services, 10)
    state = build_state(list(cluster.objects()))
    proxier = FamilyProxier(IPFamily.IPv4, NODE_CONFIG)
    proxier.sync(state)
    print(f"table: {args.services} default services x 10 endpoints loaded\n")
    print(f"{'algorithm':<10} {'program: elements':>18} {'ms':>7}   "
          f"{'endpoint change: elements':>26} {'ms (median of 10)':>18}")
    for n, algorithm in enumerate(("random", "maglev")):
        key = ServiceKey("bench", f"{algorithm}-svc")
        svc = {"kind": "Service", "metadata": {
            "namespace": key.namespace, "name": key.name,
            "annotations": {"service.pyproxy.io/balancing": algorithm}},
            "spec": {"clusterIP": f"10.99.{n}.1", "ports": [{"name": "http", "port": 80}]}}
        ports = convert_service(svc)
        assert isinstance(ports, tuple)

        def slice_of(generation: int, first: int,
                     n: int = n, key: ServiceKey = key) -> object:
            eps = [{"addresses": [f"10.77.{n}.{first + i}"], "nodeName": "node-b"}
                   for i in range(10)]
            return convert_endpoint_slice({
                "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"namespace": key.namespace, "name": f"{key.name}-{generation}",
                             "labels": {"kubernetes.io/service-name": key.name}},
                "ports": [{"name": "http", "port": 8080}], "endpoints": eps})

        state = dataclasses.replace(
            state, ports_by_service={**state.ports_by_service, key: ports},
            slices={**state.slices, key: (slice_of(0, 1),)})
        t = time.perf_counter()
        added = proxier.sync(state, changed={key})
        program_ms = (time.perf_counter() - t) * 1000
        touched, times = [], []
        for g in range(1, 11):
            # one endpoint replaced: the endpoint list shifts by one address
            state = dataclasses.replace(state, slices={**state.slices,
                                                        key: (slice_of(g, 1 + g),)})
            t = time.perf_counter()
            result = proxier.sync(state, changed={key})
            times.append((time.perf_counter() - t) * 1000)
            touched.append(result.slots_changed)
        print(f"{algorithm:<10} {added.slots_changed:>18} {program_ms:>7.1f}   "
              f"{statistics.median(touched):>26.0f} {statistics.median(times):>18.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_netns:
        measure(args)
        return 0
    ns = f"ppxmaglev-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m",
                               "bench.bench_maglev", "--services", str(args.services),
                               "--in-netns"], cwd=REPO).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    sys.exit(main())
