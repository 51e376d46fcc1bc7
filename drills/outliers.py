"""`make drill-outliers`: a pod dropping SYNs while Ready, pyproxy's outlier ejection against
kube-proxy v1.37.2 (nftables mode), on real packets (root; `make k8s` builds the control plane).

A real control plane; the lab's node namespace with four backend pods; a Service with four
endpoints (a hand-made EndpointSlice, every endpoint ready, as a probe that keeps passing
would keep them) annotated `service.pyproxy.io/outlier-ejection: "true"`. Each proxy in turn
runs in the node namespace with kube-proxy's settings (minSyncPeriod 1 s) while clients in
the client namespace connect through the ClusterIP without pause, with a 1 s connect
timeout; after `--before` seconds pod-a starts dropping every SYN (an nft rule in its own
namespace: its endpoint stays ready) for `--fault` seconds, then answers again for
`--after` seconds. Failures are counted per second of the fault, and split into the
detection window (the first 5 s) and the rest.

    .venv/bin/python -m drills.outliers                  # 60 s of fault per proxy
    .venv/bin/python -m drills.outliers --fault 120 --json bench/results/outliers.json

Exit status 0 when pyproxy met the target (failures after the detection window ≤ 0.1 % of
the attempts there), 1 otherwise, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from testkit.controlplane import (
    ControlPlane,
    Kube,
    binaries_dir,
    kube_proxy_config,
    missing_binaries,
    plane_for_proxies,
    proxy_kubeconfigs,
)
from testkit.daemonargs import DaemonArgs
from testkit.netlab import NETNS_USABLE, Cluster, Lab, tally
from testkit.waits import until

PODS = ("pod-a", "pod-b", "pod-c", "pod-d")
NS, NAME, VIP = "drill", "web", "10.96.0.50"
NODE = "node-a"
CLUSTER_CIDRS = "10.0.0.0/8"
DETECTION_WINDOW = 5.0  # the target: failures only in the first 5 s of the fault
TARGET_PERCENT = 0.1  # ... then at most this share of the attempts
DROP_SYNS = """table inet fault {
    chain input {
        type filter hook input priority 0;
        tcp dport 8080 tcp flags & (syn | ack) == syn drop
    }
}
"""


def service_objects(cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
    service = {"metadata": {"name": NAME, "annotations": {
                   "service.pyproxy.io/outlier-ejection": "true"}},
               "spec": {"clusterIP": VIP, "ports": [{"name": "http", "port": 80,
                                                     "targetPort": 8080, "protocol": "TCP"}]}}
    piece = {"metadata": {"name": f"{NAME}-1", "labels": {
                 "kubernetes.io/service-name": NAME,
                 "endpointslice.kubernetes.io/managed-by": "drill"}},
             "addressType": "IPv4",
             "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
             "endpoints": [{"addresses": [cluster.pods[p].ip4], "nodeName": "node-b",
                            "conditions": {"ready": True, "serving": True,
                                           "terminating": False}} for p in PODS]}
    return service, piece


@dataclass(frozen=True)
class Attempt:
    started: float
    label: str  # the backend's name, or the error ("timeout", "refused", …)

    @property
    def ok(self) -> bool:
        return self.label in PODS


class Clients:
    """`loops` client processes at a time, each a batch of `batch` parallel connections
    through the VIP with a 1 s connect timeout, again and again until `stop`."""

    def __init__(self, cluster: Cluster, loops: int = 4, batch: int = 20) -> None:
        self.cluster, self.batch = cluster, batch
        self.attempts: list[Attempt] = []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(loops)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            results = self.cluster.lab.connect(self.cluster.client, VIP, 80, count=self.batch,
                                               timeout=1.0, parallel=self.batch)
            with self._lock:
                self.attempts += [Attempt(r.started, r.label) for r in results]

    def finish(self) -> list[Attempt]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        return sorted(self.attempts, key=lambda a: a.started)


def figures(attempts: list[Attempt], fault: float, end: float, last: float) -> dict[str, Any]:
    """The attempts split at the fault's start and end and at the detection window; where
    they landed from `last` on (pod-a back?)."""
    during = [a for a in attempts if fault <= a.started < end]
    early = [a for a in during if a.started < fault + DETECTION_WINDOW]
    late = [a for a in during if a.started >= fault + DETECTION_WINDOW]
    per_second = [0] * int(end - fault + 1)
    for a in during:
        if not a.ok:
            per_second[int(a.started - fault)] += 1
    failed_late = sum(not a.ok for a in late)
    last_early = max((a.started - fault for a in during if not a.ok
                      and a.started < fault + 3 * DETECTION_WINDOW), default=None)
    return {
        "fault_started": fault,
        "attempts_before": sum(a.started < fault for a in attempts),
        "failed_before": sum(not a.ok for a in attempts if a.started < fault),
        "attempts_during": len(during), "failed_during": sum(not a.ok for a in during),
        "failed_percent_during": round(100 * sum(not a.ok for a in during)
                                       / max(1, len(during)), 2),
        "attempts_window": len(early), "failed_window": sum(not a.ok for a in early),
        "attempts_after_window": len(late), "failed_after_window": failed_late,
        "failed_percent_after_window": round(100 * failed_late / max(1, len(late)), 3),
        "failures_after_window_at": [(round(a.started - fault, 2), a.label)
                                     for a in late if not a.ok][:50],
        "last_failure_in_first_15s": None if last_early is None else round(last_early, 2),
        "failures_per_second": per_second,
        "attempts_after_fault": sum(a.started >= end for a in attempts),
        "failed_after_fault": sum(not a.ok for a in attempts if a.started >= end),
        "landed_last_10s": dict(Counter(a.label for a in attempts if a.started >= last)),
    }


def run_fault(cluster: Cluster, before: float, fault: float, after: float) -> dict[str, Any]:
    """Clients through the VIP; pod-a drops SYNs from `before` s for `fault` s."""
    pod = cluster.pods["pod-a"]
    clients = Clients(cluster)
    try:
        time.sleep(before)
        started = time.time()
        pod.ns.nft(DROP_SYNS)
        time.sleep(fault)
        pod.ns.run(["nft", "delete", "table", "inet", "fault"])
        ended = time.time()
        time.sleep(after)
    finally:
        pod.ns.run(["nft", "delete", "table", "inet", "fault"], check=False)
        attempts = clients.finish()
    return figures(attempts, started, ended, ended + after - 10)


@contextmanager
def proxy_running(name: str, start: Callable[[], Any], cluster: Cluster,
                  table: str) -> Iterator[Any]:
    proc = start()
    try:
        until(lambda: set(tally(cluster.lab.connect(cluster.client, VIP, 80, count=40,
                                                    parallel=20, timeout=1.0))) == set(PODS),
              120, f"{name}: all four endpoints answering", interval=0.5)
        yield proc
    finally:
        cluster.lab.stop_process(proc)
        for family in ("ip", "ip6"):
            cluster.node.run(["nft", "delete", "table", family, table], check=False)
        cluster.lab.flush_conntrack(cluster.node)


def starters(plane: ControlPlane, lab: Lab, cluster: Cluster,
             kube: Kube) -> dict[str, tuple[Callable[[], Any], str]]:
    kp_kubeconfig, py_kubeconfig = proxy_kubeconfigs(plane, kube, lab.workdir)
    kp_config = kube_proxy_config(lab.workdir / "kube-proxy.yaml", kp_kubeconfig, NODE,
                                  CLUSTER_CIDRS, "1s", "30s")
    py_args = DaemonArgs(kubeconfig=py_kubeconfig, cluster_cidr=CLUSTER_CIDRS,
                         min_sync_period="1s", sync_period="30s")
    return {
        "kube-proxy": (lambda: lab.popen(cluster.node, [plane.bin / "kube-proxy",
                                                         f"--config={kp_config}"],
                                         log_name="kube-proxy.log"), "kube-proxy"),
        "pyproxy": (lambda: lab.popen(cluster.node, py_args.argv(), log_name="pyproxy.log"),
                    "pyproxy"),
    }


def ejections(lab: Lab) -> list[str]:
    """pyproxy's log lines about ejections (what it decided, with why)."""
    log = lab.workdir / "pyproxy.log"
    return [line for line in log.read_text().splitlines() if "endpoint_ejected" in line] \
        if log.exists() else []


def logged_at(line: str) -> float:
    """The wall-clock time of a pyproxy text log line (its `timestamp=` field, UTC)."""
    stamp = line.split("timestamp=", 1)[1].split()[0]
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| proxy | attempts during the fault | failed | in the first 5 s | after 5 s "
            "| after 5 s, share | last failure of the first 15 s |",
            "|---|---|---|---|---|---|---|"]
    for name, f in results.items():
        rows.append(f"| {name} | {f['attempts_during']:,} | {f['failed_during']:,} "
                    f"({f['failed_percent_during']} %) | {f['failed_window']:,} of "
                    f"{f['attempts_window']:,} | {f['failed_after_window']:,} of "
                    f"{f['attempts_after_window']:,} | {f['failed_percent_after_window']} % "
                    f"| {f['last_failure_in_first_15s']} s |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=float, default=5.0)
    parser.add_argument("--fault", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=60.0,
                        help="seconds after the fault (the last 10: is pod-a back?)")
    parser.add_argument("--only", choices=("kube-proxy", "pyproxy"), action="append")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if not NETNS_USABLE or missing_binaries(binaries_dir()):
        print("drill-outliers: needs root, network namespaces and `make k8s`", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    with plane_for_proxies() as (plane, kube), Lab() as lab:
        cluster = lab.standard_topology(backends=PODS)
        for pod in cluster.pods.values():  # as drills/harness.py's Env, same reasons
            lab.sysctl(pod.ns, {"net.ipv4.tcp_max_tw_buckets": "0"})
        lab.sysctl(cluster.client, {"net.ipv4.ip_local_port_range": "1024 65535"})
        plane.attach(cluster.node)
        kube.node(NODE, (cluster.node_ip4,))
        kube.namespace(NS)
        service, piece = service_objects(cluster)
        kube.core.create_namespaced_service(NS, service)
        kube.discovery.create_namespaced_endpoint_slice(NS, piece)
        for name, (start, nft_table) in starters(plane, lab, cluster, kube).items():
            if args.only and name not in args.only:
                continue
            print(f"== {name}: {args.fault:g} s of pod-a dropping SYNs", flush=True)
            with proxy_running(name, start, cluster, nft_table):
                results[name] = run_fault(cluster, args.before, args.fault, args.after)
            print(json.dumps({k: v for k, v in results[name].items()
                              if k != "failures_per_second"}), flush=True)
            print("failures per second of the fault:",
                  results[name]["failures_per_second"], flush=True)
        logged = ejections(lab)
        if "pyproxy" in results and logged:
            results["pyproxy"]["ejected_after_s"] = round(
                logged_at(logged[0]) - results["pyproxy"]["fault_started"], 2)
    print("\n" + table(results))
    for line in logged:
        print("pyproxy:", line[:300])
    ours = results.get("pyproxy")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results,
                                               "ejections": logged}, indent=2))
    if ours is None:
        return 0
    met = (ours["failed_percent_after_window"] <= TARGET_PERCENT)
    print(f"\ntarget (pyproxy: failures after the first {DETECTION_WINDOW:g} s ≤ "
          f"{TARGET_PERCENT} % of the attempts): {'met' if met else 'missed'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
