"""Fast failure for removed endpoints on real packets (core/departed.py, --fast-failure).

The real daemon in the node namespace, fed a snapshot file; keep-alive backends in the pods
(one line answered per line asked, on one connection for as long as the client keeps it) and a
client that holds an idle connection through the Service. A pod is deleted the way a real one
goes: its network goes silent first (everything to it dropped, as when the pod's network
namespace is torn down), so the backend never sends a FIN or a reset of its own; then its
endpoint leaves the EndpointSlice. The client's next request on the held connection:

- with fast failure (the default): a reset, from the Service's other endpoint (the packet,
  a new flow to conntrack once the entry is gone, was DNATed afresh) or from the reject chain
  when no endpoint is left; a new connection then reaches the endpoint left;
- with --fast-failure=false, the baseline measured in the same test: no answer at all in ten
  times the time the fast run took (plus 2 s), since its packets still go to the gone
  address and TCP retransmits for minutes.

No absolute time is asserted: only the outcome, and the baseline against the fast run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.builders import ep, make_node, make_service, make_slice, terminating
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.keepalive import Held, KeepAliveServer, silence
from testkit.netlab import Cluster, Lab, Pod
from testkit.waits import eventually

pytestmark = [pytest.mark.netns, requires_netns]

NODE_PORT = 30080
EXTERNAL_IP = "192.168.77.30"
Obj = dict[str, Any]


def service(name: str, ip: str, node_port: int = 0, external: str | None = None) -> Obj:
    def tweak(svc: Obj) -> None:
        if node_port:
            svc["spec"]["type"] = "NodePort"
            svc["spec"]["ports"][0]["nodePort"] = node_port
        if external:
            svc["spec"]["externalIPs"] = [external]
    return make_service("ns", name, tweak, ip=ip)


def write(path: Path, services: dict[str, tuple[Obj, list[Obj]]]) -> None:
    docs = [make_node("node-a", "zone-1")]
    for name, (svc, endpoints) in services.items():
        docs += [svc, make_slice("ns", name, endpoints)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    os.replace(tmp, path)


@contextlib.contextmanager
def daemon(cluster: Cluster, snapshot: Path, *extra: str) -> Iterator[subprocess.Popen[str]]:
    argv = DaemonArgs(snapshot=snapshot, bind_address=cluster.node_ip4,
                      cluster_cidr=f"{cluster.cluster_cidr4},{cluster.cluster_cidr6}",
                      min_sync_period="100ms", healthz="", extra=extra).argv()
    proc = cluster.lab.popen(cluster.node, argv, log_name="pyproxy.log")
    try:
        yield proc
    finally:
        cluster.lab.stop_process(proc)


def programmed(cluster: Cluster, *present: str) -> None:
    def check() -> bool:
        rules = cluster.lab.nft_list(cluster.node)
        return all(ip in rules for ip in present)
    eventually(check, what=f"rules with {present}")


def only_reached(cluster: Cluster, ip: str, port: int, pod: Pod) -> None:
    """New connections reach `pod` alone: the sync that removed the others is in."""
    def check() -> bool:
        answers = set()
        for _ in range(6):
            try:
                fresh = Held(cluster.client, ip, port)
            except OSError as err:  # the gone pod picked: unreachable
                answers.add(str(err))
                continue
            answers.add(fresh.ask(timeout=1.0)[0])
            fresh.close()
        return answers == {pod.name}
    eventually(check, what=f"only {pod.name} reached at {ip}:{port}")


@pytest.fixture
def servers() -> Iterator[list[KeepAliveServer]]:
    made: list[KeepAliveServer] = []
    yield made
    for server in made:
        server.close()


def held_to(cluster: Cluster, ip: str, port: int, pods: dict[str, Pod]) -> tuple[Held, Pod]:
    """A held connection and the pod that answered it."""
    held = Held(cluster.client, ip, port)
    answer, _ = held.ask()
    assert answer in pods, answer
    return held, pods[answer]


def held_on(cluster: Cluster, ip: str, pod: Pod, attempts: int = 30) -> Held:
    """A held connection to (ip, 80) that reached `pod` (the others closed)."""
    for _ in range(attempts):
        held = Held(cluster.client, ip, 80)
        if held.ask()[0] == pod.name:
            return held
        held.close()
    raise AssertionError(f"no connection to {ip} reached {pod.name} in {attempts}")


def removed_endpoint_outcome(lab: Lab, tmp_path: Path, servers: list[KeepAliveServer],
                             fast: bool, wait: float) -> tuple[str, float, str]:
    """Service web (pod-a, pod-b); the pod a held connection reached is deleted; (the held
    connection's next request, waited on for `wait` seconds at most, its seconds, a new
    connection's answer)."""
    cluster = lab.standard_topology(backends=2, tcp_ports=(8081,), udp_ports=())
    pods = dict(cluster.pods)
    servers += [KeepAliveServer(pod) for pod in pods.values()]
    snapshot = tmp_path / f"cluster-{fast}.yaml"
    vip = cluster.service_ip(10)
    write(snapshot, {"web": (service("web", vip), [ep(p.ip4, "node-b") for p in pods.values()])})
    with daemon(cluster, snapshot, f"--fast-failure={str(fast).lower()}"):
        programmed(cluster, *(p.ip4 for p in pods.values()))
        held, gone = held_to(cluster, vip, 80, pods)
        left = next(p for p in pods.values() if p is not gone)
        silence(cluster.lab, gone)
        write(snapshot, {"web": (service("web", vip), [ep(left.ip4, "node-b")])})
        only_reached(cluster, vip, 80, left)
        time.sleep(0.5)  # the cleanup runs after the sync, off its thread
        try:
            answer, seconds = held.ask(timeout=wait)
        finally:
            held.close()
        fresh = Held(cluster.client, vip, 80)
        try:
            again, _ = fresh.ask()
        finally:
            fresh.close()
    return answer, seconds, again


def test_a_removed_endpoints_connection_fails_at_once_not_after_tcp_gives_up(
        tmp_path: Path, servers: list[KeepAliveServer]) -> None:
    with Lab() as lab:
        answer, seconds, again = removed_endpoint_outcome(lab, tmp_path, servers, True, 20.0)
    assert answer == "reset", f"{answer} after {seconds:.2f} s"
    assert again.startswith("pod-")
    # The baseline: the same with fast failure off, waited on ten times as long.
    window = 10 * seconds + 2.0
    with Lab() as lab:
        baseline, waited, again = removed_endpoint_outcome(lab, tmp_path, servers, False,
                                                           window)
    assert baseline == "timeout", f"with --fast-failure=false: {baseline} after {waited:.2f} s"
    assert again.startswith("pod-")


def test_what_fast_failure_resets_and_what_it_keeps(lab: Lab, tmp_path: Path,
                                                    servers: list[KeepAliveServer]) -> None:
    """The last endpoint of a Service gone: the reject chain resets. A NodePort's and an
    external IP's connections to a removed endpoint: reset. A terminating endpoint still
    serving, and one whose port number changed: their connections go on."""
    cluster = lab.standard_topology(backends=["solo", "drain", "moved", "np-a", "np-b"],
                                    tcp_ports=(8081,), udp_ports=())
    pods = dict(cluster.pods)
    servers += [KeepAliveServer(pod) for pod in pods.values()]
    ips = {name: cluster.service_ip(n) for name, n in
           (("solo", 11), ("drain", 12), ("moved", 13), ("np", 14))}
    nodeport_pods = {n: pods[n] for n in ("np-a", "np-b")}
    before = {
        "solo": (service("solo", ips["solo"]), [ep(pods["solo"].ip4, "node-b")]),
        "drain": (service("drain", ips["drain"]), [ep(pods["drain"].ip4, "node-b")]),
        "moved": (service("moved", ips["moved"]), [ep(pods["moved"].ip4, "node-b")]),
        "np": (service("np", ips["np"], NODE_PORT, EXTERNAL_IP),
               [ep(p.ip4, "node-b") for p in nodeport_pods.values()]),
    }
    snapshot = tmp_path / "cluster.yaml"
    write(snapshot, before)
    with daemon(cluster, snapshot):
        programmed(cluster, *(p.ip4 for p in pods.values()))
        solo, _ = held_to(cluster, ips["solo"], 80, pods)
        drain, _ = held_to(cluster, ips["drain"], 80, pods)
        moved, _ = held_to(cluster, ips["moved"], 80, pods)
        node_port, gone = held_to(cluster, cluster.node_ip4, NODE_PORT, nodeport_pods)
        left = next(p for p in nodeport_pods.values() if p is not gone)
        external = held_on(cluster, EXTERNAL_IP, gone)
        for pod in (pods["solo"], gone):
            silence(cluster.lab, pod)
        moved_slice = make_slice("ns", "moved", [ep(pods["moved"].ip4, "node-b")])
        moved_slice["ports"][0]["port"] = 9090  # the targetPort changed, the pod stays
        after = {
            "solo": (before["solo"][0], []),
            "drain": (before["drain"][0], [terminating(pods["drain"].ip4, "node-b")]),
            "np": (before["np"][0], [ep(left.ip4, "node-b")]),
        }
        write(snapshot, after)
        with snapshot.open("a") as out:
            out.write("---\n" + yaml.safe_dump(before["moved"][0]) + "---\n"
                      + yaml.safe_dump(moved_slice))
        programmed(cluster, "9090")
        only_reached(cluster, cluster.node_ip4, NODE_PORT, left)
        time.sleep(0.5)  # the cleanup runs after the sync, off its thread
        outcomes = {name: held.ask(timeout=10.0)[0] for name, held in
                    (("solo", solo), ("np", node_port), ("external", external),
                     ("drain", drain), ("moved", moved))}
        for held in (solo, node_port, external, drain, moved):
            held.close()
    assert outcomes == {"solo": "reset", "np": "reset", "external": "reset", "drain": "drain",
                        "moved": "moved"}
