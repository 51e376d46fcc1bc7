"""Fast failure side by side with kube-proxy v1.37.2 (issue 38, point 3): `make
bench-fast-failure` (root; `make k8s`).

One real control plane (kube-apiserver, etcd, kube-controller-manager: its EndpointSlice
controller) and two copies of node-a (testkit/netlab.py's standard topology, one Lab each):
one programmed by kube-proxy v1.37.2 in nftables mode, one by pyproxy, both fed by the same
API server. A Service `web` selects two Pods (pod-a, pod-b: keep-alive backends in the pod
namespaces of both copies, testkit/keepalive.py). In each round:

1. clients in both copies hold idle keep-alive connections through the ClusterIP (each has
   made one request) until at least `--per-delay` × 2 of them in each copy reached pod-a;
2. pod-a is deleted as a pod goes: its network silent first in both copies (everything to
   it dropped: no FIN, no reset, no answer), then its Pod object deleted (grace 0), after
   which the EndpointSlice controller removes its endpoint and each proxy hears of it;
3. each held connection to pod-a sends its next request, half of them at once (the request
   races the endpoint's removal), the other half `--delay` s later (the proxies have long
   synced): the time from the request until it fails (a reset) or is answered, capped at
   `--cap` s (no answer by then: still retransmitting; TCP gives up after tcp_retries2,
   about 15 minutes). The connections to pod-b send one too (a control: they must go on).

Prints, per proxy and per delay, how each request ended and its median and maximum time.
`--json FILE` keeps every sample (bench/results/)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from testkit.controlplane import (
    ControlPlane,
    ControlPlaneError,
    Kube,
    kube_proxy_config,
    plane_for_proxies,
    proxy_kubeconfigs,
    start_pyproxy,
    wait_for,
)
from testkit.keepalive import Held, KeepAliveServer, silence, unsilence
from testkit.netlab import Cluster, Lab

NS = "fastfail"
VIP = "10.96.3.1"
PODS = ("pod-a", "pod-b")


@dataclass
class Island:
    """One copy of node-a, its proxy and the keep-alive servers in its pods."""

    name: str
    lab: Lab
    cluster: Cluster
    servers: list[KeepAliveServer] = field(default_factory=list)

    def answers(self, count: int = 6) -> set[str]:
        """Who new connections through the ClusterIP reach."""
        out = set()
        for _ in range(count):
            try:
                held = Held(self.cluster.client, VIP, 80)
            except OSError as err:
                out.add(str(err))
                continue
            out.add(held.ask(timeout=1.0)[0])
            held.close()
        return out


def island(name: str, lab: Lab, plane: ControlPlane) -> Island:
    cluster = lab.standard_topology(backends=list(PODS), tcp_ports=(8081,), udp_ports=())
    plane.attach(cluster.node)
    return Island(name, lab, cluster,
                  [KeepAliveServer(pod) for pod in cluster.pods.values()])


def objects(kube: Kube, cluster: Cluster, round_: int) -> None:
    """pod-a and pod-b of this round, Running and Ready on node-b."""
    for name in PODS:
        pod = cluster.pods[name]
        kube.pod(NS, f"{name}-{round_}", "node-b", (pod.ip4,), {"app": "web"})


def hold(each: Island, wanted: int, limit: int = 40) -> dict[str, list[Held]]:
    """Held connections by the pod they reached, until `wanted` reached pod-a."""
    held: dict[str, list[Held]] = {name: [] for name in PODS}
    for _ in range(limit):
        conn = Held(each.cluster.client, VIP, 80)
        answer, _ = conn.ask()
        held.setdefault(answer, []).append(conn)
        if len(held["pod-a"]) >= wanted and held["pod-b"]:
            break
    return held


@dataclass
class Sample:
    proxy: str
    round: int
    delay: float  # seconds after the deletion the request was sent
    pod: str  # the pod the connection had reached
    outcome: str  # reset, the answering pod, or timeout (the cap)
    seconds: float  # from the request to its outcome


def ask_later(each: Island, conn: Held, pod: str, round_: int, deleted: float, delay: float,
              cap: float, out: list[Sample]) -> None:
    time.sleep(max(0.0, deleted + delay - time.monotonic()))
    outcome, seconds = conn.ask(timeout=cap)
    out.append(Sample(each.name, round_, delay, pod, outcome, seconds))
    conn.close()


def one_round(kube: Kube, islands: list[Island], round_: int, args: argparse.Namespace,
              out: list[Sample]) -> None:
    objects(kube, islands[0].cluster, round_)
    for each in islands:
        wait_for(lambda e=each: e.answers() == set(PODS), 60,
                 f"{each.name} reaching both pods", interval=0.5)
    held = {each.name: hold(each, 2 * args.per_delay) for each in islands}
    for each in islands:
        silence(each.lab, each.cluster.pods["pod-a"])
    deleted = time.monotonic()
    kube.delete_pod(NS, f"pod-a-{round_}", grace=0)
    threads = []
    for each in islands:
        doomed = held[each.name]["pod-a"]
        plan = [(conn, "pod-a", 0.0 if i % 2 == 0 else args.delay)
                for i, conn in enumerate(doomed)]
        plan += [(conn, "pod-b", args.delay) for conn in held[each.name]["pod-b"]]
        for conn, pod, delay in plan:
            thread = threading.Thread(target=ask_later, args=(
                each, conn, pod, round_, deleted, delay, args.cap, out))
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    kube.delete_pod(NS, f"pod-b-{round_}", grace=0)
    for each in islands:
        unsilence(each.lab, each.cluster.pods["pod-a"])


@contextmanager
def side_by_side(plane: ControlPlane, kube: Kube) -> Iterator[list[Island]]:
    with ExitStack() as stack:
        kp_lab, py_lab = stack.enter_context(Lab()), stack.enter_context(Lab())
        kp, py = island("kube-proxy", kp_lab, plane), island("pyproxy", py_lab, plane)
        kube.node("node-a", (kp.cluster.node_ip4,))
        kube.node("node-b", ("192.168.50.3",))
        kube.core.create_namespaced_service(NS, {
            "metadata": {"name": "web"},
            "spec": {"clusterIP": VIP, "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                                "targetPort": 8080}]}})
        kp_kubeconfig, py_kubeconfig = proxy_kubeconfigs(plane, kube, kp_lab.workdir)
        config = kube_proxy_config(kp_lab.workdir / "kube-proxy.yaml", kp_kubeconfig)
        proc = kp_lab.popen(kp.cluster.node, [plane.bin / "kube-proxy", f"--config={config}",
                                              "-v=1"], log_name="kube-proxy.log")
        stack.callback(kp_lab.stop_process, proc)
        daemon = start_pyproxy(py_lab, py.cluster.node, py_kubeconfig, "node-a")
        stack.callback(py_lab.stop_process, daemon.proc)
        for each in (kp, py):
            stack.callback(lambda e=each: [s.close() for s in e.servers])
        yield [kp, py]


def summary(samples: list[Sample], cap: float) -> str:
    lines = [f"{'proxy':<11} {'delay':>5} {'pod':<6} {'n':>3}  outcomes"
             f"{'':<28} median     max"]
    keys = sorted({(s.proxy, s.delay, s.pod) for s in samples})
    for proxy, delay, pod in keys:
        mine = [s for s in samples if (s.proxy, s.delay, s.pod) == (proxy, delay, pod)]
        counts: dict[str, int] = {}
        for s in mine:
            counts[s.outcome] = counts.get(s.outcome, 0) + 1
        text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        times = [s.seconds for s in mine]
        capped = all(s.outcome == "timeout" for s in mine)
        median = f">{cap:.0f} s" if capped else f"{statistics.median(times):.3f} s"
        top = f">{cap:.0f} s" if any(s.outcome == "timeout" for s in mine) \
            else f"{max(times):.3f} s"
        lines.append(f"{proxy:<11} {delay:>5.1f} {pod:<6} {len(mine):>3}  {text:<36} "
                     f"{median:>8} {top:>8}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-delay", type=int, default=2,
                        help="connections to pod-a per delay and round, per proxy")
    parser.add_argument("--delay", type=float, default=2.0,
                        help="seconds after the deletion of the later requests")
    parser.add_argument("--cap", type=float, default=30.0,
                        help="seconds a request is waited on")
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args()
    samples: list[Sample] = []
    started = time.time()
    try:
        with plane_for_proxies() as (plane, kube):
            kube.namespace(NS)
            with side_by_side(plane, kube) as islands:
                for round_ in range(args.rounds):
                    one_round(kube, islands, round_, args, samples)
                    print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    except ControlPlaneError as err:
        print(err, file=sys.stderr)
        return 2
    print(summary(samples, args.cap))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"started": started, "args": vars(args),
                       "samples": [vars(s) for s in samples]}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

