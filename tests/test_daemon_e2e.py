"""`pyproxy run` end to end: the real daemon in the node namespace, fed by a snapshot file or
by the API emulator over a socket, with real backends and clients."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.apiemu import ApiEmulator
from testkit.builders import ep, make_node, make_service, make_service_cidr, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, ConnResult, Lab, tally
from testkit.waits import eventually, synced

pytestmark = [pytest.mark.netns, requires_netns]

VIP = "10.96.0.10"
PYPROXY = str(Path(sys.executable).parent / "pyproxy")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=3)


def objects(cluster: Cluster, pods: list[str], with_service: bool = True) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [make_node("node-a", "zone-1")]
    if with_service:
        out.append(make_service("ns", "web", ip=VIP))
    out.append(make_slice("ns", "web", [ep(cluster.pods[p].ip4, "node-b") for p in pods]))
    return out


def start_daemon(cluster: Cluster, *extra: str, name: str = "pyproxy") -> subprocess.Popen[str]:
    argv = DaemonArgs(bind_address=cluster.node_ip4,
                      cluster_cidr=f"{cluster.cluster_cidr4},{cluster.cluster_cidr6}",
                      extra=extra).argv()
    return cluster.lab.popen(cluster.node, argv, log_name=f"{name}.log")


def stop_daemon(cluster: Cluster, proc: subprocess.Popen[str]) -> None:
    cluster.lab.stop_process(proc)


def cleanup_tables(cluster: Cluster) -> None:
    for family in ("ip", "ip6"):
        cluster.node.run(["nft", "delete", "table", family, "pyproxy"], check=False)
    cluster.lab.flush_conntrack(cluster.node)


def backends(cluster: Cluster, count: int = 30) -> set[str]:
    return set(tally(cluster.lab.connect(cluster.client, VIP, 80, count=count, parallel=10,
                                         timeout=0.5)))


def write_atomically(path: Path, docs: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    os.replace(tmp, path)


def test_snapshot_mode_follows_the_file(cluster: Cluster, tmp_path: Path) -> None:
    snapshot = tmp_path / "cluster.yaml"
    sock = str(tmp_path / "debug.sock")
    write_atomically(snapshot, objects(cluster, ["pod-a", "pod-b"]))
    daemon = start_daemon(cluster, "--snapshot", str(snapshot), "--debug-socket", sock)
    try:
        eventually(lambda: backends(cluster) == {"pod-a", "pod-b"}, what="first sync")
        write_atomically(snapshot, objects(cluster, ["pod-c"]))
        took = eventually(lambda: backends(cluster, 10) == {"pod-c"}, what="endpoint change")
        assert took < 5
        write_atomically(snapshot, objects(cluster, ["pod-c"], with_service=False))
        eventually(lambda: backends(cluster, 3) == {"timeout"}, what="service deleted")
        # a broken file changes nothing: the daemon reads it, counts the error, and runs on
        snapshot.write_text("{ not: yaml: at all")
        eventually(lambda: synced(sock)["source"]["errors"] >= 1, what="the broken file read")
        assert daemon.poll() is None
    finally:
        stop_daemon(cluster, daemon)
        cleanup_tables(cluster)


@pytest.fixture
def emulator(cluster: Cluster) -> Iterator[ApiEmulator]:
    with emulator_in_node(cluster) as emu:
        yield emu


@contextlib.contextmanager
def emulator_in_node(cluster: Cluster, **kwargs: Any) -> Iterator[ApiEmulator]:
    # The emulator's listening socket lives in the node namespace (127.0.0.1 there), so the
    # daemon reaches it while the test changes the cluster in-process.
    emu = call_in_netns(cluster.node.full,
                        lambda: ApiEmulator(bookmark_interval=1.0, **kwargs).start())
    try:
        yield emu
    finally:
        emu.stop()


class Probe:
    """A continuous connection probe through the VIP, in the background."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.results: list[ConnResult] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.results += self.cluster.lab.connect(self.cluster.client, VIP, 80, count=20,
                                                     timeout=1.0)

    def finish(self) -> list[ConnResult]:
        self.stop.set()
        self.thread.join(30)
        return self.results


def test_api_mode_end_to_end(cluster: Cluster, emulator: ApiEmulator, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    emulator.write_kubeconfig(str(kubeconfig))
    for obj in objects(cluster, ["pod-a"]):
        emulator.create(obj["kind"], obj)
    daemon = start_daemon(cluster, "--kubeconfig", str(kubeconfig), name="pyproxy-api")
    try:
        eventually(lambda: backends(cluster) == {"pod-a"}, what="first sync from the API")
        # its start is recorded as kube-proxy's is: one Event regarding its Node
        eventually(lambda: [(e["reason"], e["regarding"]["name"]) for e in
                            emulator.list_objects("events", "default")] == [("Starting", "node-a")],
                   what="the start Event")
        # scale up: traffic follows
        scaled = objects(cluster, ["pod-a", "pod-b", "pod-c"])[-1]
        emulator.apply("EndpointSlice", scaled)
        eventually(lambda: backends(cluster, 40) == {"pod-a", "pod-b", "pod-c"}, what="scale up")

        # the API goes away: traffic keeps flowing; changes made meanwhile arrive later
        emulator.set_available(False, mode="503")
        time.sleep(1.5)
        assert backends(cluster, 30) == {"pod-a", "pod-b", "pod-c"}
        emulator.apply("EndpointSlice", objects(cluster, ["pod-b"])[-1])
        emulator.compact()
        time.sleep(0.5)
        assert "pod-a" in backends(cluster, 30)  # not seen yet: the API is away
        emulator.set_available(True)
        eventually(lambda: backends(cluster, 10) == {"pod-b"}, timeout=40,
                   what="catch up after the API returns")

        # restart under a continuous probe: no connection fails
        probe = Probe(cluster)
        time.sleep(0.5)  # connections through the old daemon's rules
        stop_daemon(cluster, daemon)
        sock = str(tmp_path / "debug.sock")
        daemon = start_daemon(cluster, "--kubeconfig", str(kubeconfig), "--debug-socket", sock,
                              name="pyproxy-api-2")
        synced(sock)  # the new daemon's first sync
        time.sleep(1.0)  # connections through its rules
        results = probe.finish()
        assert len(results) >= 40
        assert tally(results) == {"pod-b": len(results)}, tally(results)

        # the service is deleted: its address stops answering
        emulator.delete("Service", "web", "ns")
        eventually(lambda: backends(cluster, 3) == {"timeout"}, what="service deleted")
    finally:
        stop_daemon(cluster, daemon)
        cleanup_tables(cluster)


# --- ServiceCIDRs ----------------------------------------------------------------------------

UNALLOCATED = "10.96.0.99"  # in the service CIDR, no Service's


def api_daemon(cluster: Cluster, emulator: ApiEmulator, tmp_path: Path,
               name: str) -> subprocess.Popen[str]:
    kubeconfig = tmp_path / "kubeconfig"
    emulator.write_kubeconfig(str(kubeconfig))
    for obj in objects(cluster, ["pod-a"]):
        emulator.create(obj["kind"], obj)
    return start_daemon(cluster, "--kubeconfig", str(kubeconfig), name=name)


def unallocated(cluster: Cluster) -> set[str]:
    return set(tally(cluster.lab.connect(cluster.client, UNALLOCATED, 8080, count=2,
                                         timeout=0.5)))


def test_api_mode_drops_unallocated_addresses_of_service_cidrs(cluster: Cluster,
                                                               tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        emulator = stack.enter_context(emulator_in_node(cluster))
        emulator.create("ServiceCIDR", make_service_cidr("kubernetes", cluster.service_cidr4))
        # pod-c answers at the unallocated address: what is forwarded gets an answer
        stack.enter_context(cluster.answering_at("pod-c", UNALLOCATED))
        daemon = api_daemon(cluster, emulator, tmp_path, "pyproxy-cidrs")
        try:
            eventually(lambda: backends(cluster) == {"pod-a"}, what="first sync")
            eventually(lambda: unallocated(cluster) == {"timeout"}, what="dropped")
            emulator.delete("ServiceCIDR", "kubernetes")  # a watch event: forwarded again
            eventually(lambda: unallocated(cluster) == {"pod-c"}, what="ServiceCIDR deleted")
            emulator.create("ServiceCIDR", make_service_cidr("other", "10.96.0.0/24"))
            eventually(lambda: unallocated(cluster) == {"timeout"}, what="ServiceCIDR added")
        finally:
            stop_daemon(cluster, daemon)
            cleanup_tables(cluster)


def test_api_mode_without_the_service_cidr_api(cluster: Cluster, tmp_path: Path) -> None:
    # An API server before 1.33 answers 404: no ServiceCIDRs known, and the node is still
    # programmed (the first sync does not wait for them), without the drop.
    with contextlib.ExitStack() as stack:
        emulator = stack.enter_context(emulator_in_node(cluster, unserved=("servicecidrs",)))
        stack.enter_context(cluster.answering_at("pod-c", UNALLOCATED))
        daemon = api_daemon(cluster, emulator, tmp_path, "pyproxy-no-cidrs")
        try:
            eventually(lambda: backends(cluster) == {"pod-a"}, what="first sync")
            assert unallocated(cluster) == {"pod-c"}
            assert emulator.count("list", "servicecidrs") == 1  # asked once, not retried
        finally:
            stop_daemon(cluster, daemon)
            cleanup_tables(cluster)
        log = (cluster.lab.workdir / "pyproxy-no-cidrs.log").read_text()
        assert "api_unavailable_retrying" not in log, log


# --- A refused API connection ----------------------------------------------------------------


def scrape(cluster: Cluster) -> str:
    """The daemon's /metrics, from inside the node namespace."""
    def get() -> str:
        with urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=5) as answer:
            return str(answer.read().decode())
    return call_in_netns(cluster.node.full, get)


def test_api_mode_refused_by_rbac_says_why(cluster: Cluster, emulator: ApiEmulator,
                                           tmp_path: Path) -> None:
    """Every request refused with RBAC's 403 from the start: the log gives RBAC's message
    whole, /metrics counts the 403s as client-go does and has each watch disconnected; once
    served, the node is programmed and the watches are connected."""
    emulator.forbid("system:serviceaccount:kube-system:pyproxy")
    sock = str(tmp_path / "debug.sock")
    kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig")
    for obj in objects(cluster, ["pod-a"]):
        emulator.create(obj["kind"], obj)
    daemon = start_daemon(cluster, "--kubeconfig", str(kubeconfig), "--debug-socket", sock,
                          name="pyproxy-forbidden")
    log_file = cluster.lab.workdir / "pyproxy-forbidden.log"
    host = f'host="127.0.0.1:{emulator.port}"'
    try:
        message = ('error="403 Forbidden: services is forbidden: User \\"system:serviceaccount:'
                   'kube-system:pyproxy\\" cannot list resource \\"services\\" in API group '
                   '\\"\\" at the cluster scope"')
        eventually(lambda: message in log_file.read_text(), what="RBAC's message in the log")
        metrics = scrape(cluster)
        assert re.search(rf'^rest_client_requests_total{{code="403",host="127.0.0.1:'
                         rf'{emulator.port}",method="GET"}} [1-9]', metrics, re.MULTILINE), metrics
        assert ('pyproxy_watch_state{resource="Service",state="disconnected"} 1.0'
                in metrics), metrics
        emulator.forbid(None)
        eventually(lambda: backends(cluster) == {"pod-a"}, timeout=60, what="served again")
        metrics = scrape(cluster)
        assert 'pyproxy_watch_state{resource="Service",state="connected"} 1.0' in metrics
        assert re.search(rf'^rest_client_request_duration_seconds_count{{{host},verb="GET"}} '
                         r'[1-9]', metrics, re.MULTILINE), metrics
        assert all(watch["state"] == "connected"
                   for watch in synced(sock)["source"]["api"]), synced(sock)
    finally:
        stop_daemon(cluster, daemon)
        cleanup_tables(cluster)
