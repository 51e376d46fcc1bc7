"""Outlier ejection on real packets, over IPv4 and over IPv6: the real daemon in the node
namespace, four backends, one of which starts dropping SYNs while its endpoint stays ready.
The daemon's conntrack events show the unanswered attempts; the endpoint is ejected (no new
connection reaches it, explain says why and until when, the metrics count it), then comes
back once it answers again."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.waits import eventually, until

pytestmark = [pytest.mark.netns, requires_netns]

VIP, VIP6 = "10.96.0.10", "fd00:96::10"
PYPROXY = str(Path(sys.executable).parent / "pyproxy")
PODS = ["pod-a", "pod-b", "pod-c", "pod-d"]
DROP_SYNS = """table inet fault {
    chain input {
        type filter hook input priority 0;
        tcp dport 8080 tcp flags & (syn | ack) == syn drop
    }
}
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Lab() as lab:
        yield lab.standard_topology(backends=PODS)


def objects(cluster: Cluster, v6: bool) -> list[dict[str, Any]]:
    service = make_service("ns", "web", ip=VIP6 if v6 else VIP)
    service["spec"]["ipFamilies"] = ["IPv6" if v6 else "IPv4"]
    service["metadata"]["annotations"] = {"service.pyproxy.io/outlier-ejection": "true"}
    return [make_node("node-a", "zone-1"), service,
            make_slice("ns", "web", [ep(cluster.pods[p].addr(v6), "node-b") for p in PODS],
                       family="IPv6" if v6 else "IPv4")]


def cli_json(sock: str, *args: str) -> Any:
    out = subprocess.run([PYPROXY, *args, "--socket", sock, "-o", "json"], capture_output=True,
                         text=True, timeout=60)
    return yaml.safe_load(out.stdout)


def metric(cluster: Cluster, name: str) -> float:
    def scrape() -> str:
        with urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=5) as response:
            return str(response.read().decode())
    text = call_in_netns(cluster.node.full, scrape)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def landed(cluster: Cluster, count: int, v6: bool) -> dict[str, int]:
    return dict(tally(cluster.lab.connect(cluster.client, VIP6 if v6 else VIP, 80, count=count,
                                          parallel=10, timeout=0.5)))


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_a_pod_dropping_syns_is_ejected_and_comes_back(cluster: Cluster, tmp_path: Path,
                                                       v6: bool) -> None:
    snapshot, sock = tmp_path / "cluster.yaml", str(tmp_path / "debug.sock")
    snapshot.write_text(yaml.safe_dump_all(objects(cluster, v6)))
    daemon = cluster.lab.popen(cluster.node, DaemonArgs(
        snapshot=snapshot, bind_address=cluster.node_ip4,
        cluster_cidr=f"{cluster.cluster_cidr4},{cluster.cluster_cidr6}",
        min_sync_period="100ms", debug_socket=sock, extra=(
            "--outlier-ejection-policy=failures=3,window=4s,ejection=8s,replyTimeout=500ms",
        )).argv(),
        log_name="pyproxy-outliers.log")
    bad = cluster.pods["pod-a"]
    bad_ip = bad.addr(v6)
    bad_endpoint = f"[{bad_ip}]:8080" if v6 else f"{bad_ip}:8080"
    try:
        eventually(lambda: set(landed(cluster, 40, v6)) == set(PODS), what="all four serving")
        assert metric(cluster, "pyproxy_outlier_ejections_total") == 0
        bad.ns.nft(DROP_SYNS)
        faulted = time.monotonic()
        # Attempts through the fault: pod-a's time out, until it is ejected.
        until(lambda: "timeout" not in landed(cluster, 40, v6), 15, "pod-a ejected")
        detected = time.monotonic() - faulted
        assert metric(cluster, "pyproxy_outlier_ejected_endpoints") == 1
        assert set(landed(cluster, 60, v6)) == {"pod-b", "pod-c", "pod-d"}
        # The unanswered attempts' SYN_SENT entries were deleted as they failed: none would
        # pin a retransmitted SYN, or a new connection reusing its port, to pod-a.
        unanswered = cluster.node.run(["conntrack", "-L", "-f", "ipv6" if v6 else "ipv4",
                                       "-p", "tcp", "--state", "SYN_SENT",
                                       "--reply-src", bad_ip]).stdout
        assert unanswered.strip() == "", unanswered
        [entry] = cli_json(sock, "explain", "ns/web")["services"]
        [ejected] = entry["outliers"]["ejected"]
        assert ejected["endpoint"] == bad_endpoint and ejected["ejection"] == 1
        assert "connection attempts in a row failed" in ejected["reason"], ejected
        assert "no reply" in ejected["reason"], ejected
        assert any(r.startswith(f"outlier ejection: {bad_endpoint} ejected until")
                   for r in entry["reasons"])
        assert metric(cluster, "pyproxy_outlier_ejections_total") == 1
        assert metric(cluster, 'pyproxy_outlier_failed_attempts_total{reason="no_reply"}') >= 3
        # The fault over: back after its ejection (8 s), on probation for a window (4 s).
        bad.ns.run(["nft", "delete", "table", "inet", "fault"])
        until(lambda: "pod-a" in landed(cluster, 40, v6), 25, "pod-a back", interval=0.5)
        [entry] = cli_json(sock, "explain", "ns/web")["services"]
        assert entry["outliers"]["ejected"] == []
        print(f"pod-a ejected {detected:.1f} s after it started dropping SYNs (the attempts "
              "taking 0.5 s each)")
    finally:
        bad.ns.run(["nft", "delete", "table", "inet", "fault"], check=False)
        cluster.lab.stop_process(daemon)
        for family in ("ip", "ip6"):
            cluster.node.run(["nft", "delete", "table", family, "pyproxy"], check=False)
