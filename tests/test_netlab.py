"""Tests of the netlab fixture itself, with real packets but without the product.

They prove that the topology routes, that backends report who they are and whom they saw, that
the client tells "refused" from "timeout", that nothing leaks, and (one test) that a hand-written
DNAT rule on the node works, i.e. the fixture is ready for the NAT tests of pyproxy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testkit.fixtures import (  # noqa: F401 - the fixtures register themselves by being imported
    cluster_fixture,
    lab_fixture,
    requires_netns,
    requires_nft,
)
from testkit.netlab import Cluster, ConnResult, Lab, Locked, Proto, sweep_stale, tally
from testkit.waits import until

pytestmark = [pytest.mark.netns, requires_netns]

ROOT = Path(__file__).resolve().parents[1]


def all_from(results: list[ConnResult], name: str, seen_ip: str) -> bool:
    """Every attempt answered by backend `name`, which saw the connection come from seen_ip."""
    return all(r.ok and r.name == name and r.seen_ip == seen_ip for r in results)


# -- routing through the node, no NAT ------------------------------------------------------------


def test_tcp_client_to_pods_routed_through_node(lab: Lab, cluster: Cluster) -> None:
    for pod in cluster.pods.values():
        results = lab.connect(cluster.client, pod.ip4, 8080, count=20)
        assert all_from(results, pod.name, cluster.client_ip4), results


def test_udp_client_to_pod(lab: Lab, cluster: Cluster) -> None:
    pod = cluster.pods["pod-b"]
    results = lab.connect(cluster.client, pod.ip4, 5353, proto="udp", count=20)
    assert all_from(results, "pod-b", cluster.client_ip4), results


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_udp_attempts_of_a_batch_are_flows_of_their_own(lab: Lab, cluster: Cluster,
                                                          v6: bool) -> None:
    # drawn at random, 300 ephemeral ports repeat one with a chance near 80 %; a repeated one
    # would ride the earlier attempt's conntrack entry instead of being a new flow
    pod = cluster.pods["pod-b"]
    results = lab.connect(cluster.client, pod.addr(v6), 5353, proto="udp", count=300,
                          parallel=8)
    assert tally(results) == {"pod-b": 300}
    assert len({r.local_port for r in results}) == 300


@pytest.mark.parametrize("proto,port", [("tcp", 8080), ("udp", 5353)])
def test_ipv6(lab: Lab, cluster: Cluster, proto: Proto, port: int) -> None:
    pod = cluster.pods["pod-a"]
    results = lab.connect(cluster.client, pod.ip6, port, proto=proto, count=20)
    assert all_from(results, "pod-a", cluster.client_ip6), results


def test_pod_client_to_pod_and_fixed_source_port(lab: Lab, cluster: Cluster) -> None:
    pod_client, pod = cluster.pod_client, cluster.pods["pod-b"]
    results = lab.connect(pod_client.ns, pod.ip4, 8080, count=5, src=pod_client.ip4, sport=4242)
    assert all_from(results, "pod-b", pod_client.ip4), results
    assert {r.seen_port for r in results} == {4242}


def test_large_batch_is_fast(lab: Lab, cluster: Cluster) -> None:
    start = time.monotonic()
    results = lab.connect(cluster.client, cluster.pods["pod-a"].ip4, 8080, count=200)
    assert tally(results) == {"pod-a": 200}
    assert time.monotonic() - start < 5.0  # typically ~0.2 s


# -- refused vs dropped --------------------------------------------------------------------------


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("v6", [False, True])
def test_closed_port_is_refused(lab: Lab, cluster: Cluster, proto: Proto, v6: bool) -> None:
    pod = cluster.pods["pod-a"]
    ip = pod.ip6 if v6 else pod.ip4
    # 50 in a row: ICMP rate limiting (lifted by the lab's sysctls) would turn most of these
    # into timeouts.
    results = lab.connect(cluster.client, ip, 9, proto=proto, count=50)
    assert tally(results) == {"refused": 50}
    assert all(r.rejected for r in results)


@requires_nft
def test_nft_drop_gives_timeout(lab: Lab, cluster: Cluster) -> None:
    pod = cluster.pods["pod-a"]
    assert tally(lab.connect(cluster.client, pod.ip4, 9999, timeout=0.3)) == {"refused": 1}
    # nft 1.0.6 wants a newline or ';' after a nested '}', so rulesets are written multi-line.
    lab.nft(
        pod.ns,
        """
        table inet t {
            chain in {
                type filter hook input priority 0;
                tcp dport 9999 drop;
            }
        }
    """,
    )
    results = lab.connect(cluster.client, pod.ip4, 9999, count=3, timeout=0.3, parallel=3)
    assert tally(results) == {"timeout": 3}
    # Other ports of the same pod are unaffected.
    assert tally(lab.connect(cluster.client, pod.ip4, 8080)) == {"pod-a": 1}


@requires_nft
@pytest.mark.parametrize("v6", [False, True])
def test_nft_reject_flavours(lab: Lab, cluster: Cluster, v6: bool) -> None:
    """A plain reject reads as "refused", admin-prohibited as "unreachable", both immediately.

    IPv6 TCP is the interesting case: without IP_RECVERR in the client the kernel only reports
    the ICMPv6 error after the first SYN retransmit (~1 s), so this also guards that.
    """
    pod = cluster.pods["pod-a"]
    lab.nft(
        cluster.node,
        """
        table inet f {
            chain forward_filter {
                type filter hook forward priority 0;
                meta l4proto { tcp, udp } th dport 7001 reject;
                meta l4proto { tcp, udp } th dport 7002 reject with icmpx admin-prohibited;
            }
        }
    """,
    )
    ip = pod.ip6 if v6 else pod.ip4
    protos: tuple[Proto, ...] = ("tcp", "udp")
    for proto in protos:
        start = time.monotonic()
        assert tally(lab.connect(cluster.client, ip, 7001, proto, count=10)) == {"refused": 10}
        assert tally(lab.connect(cluster.client, ip, 7002, proto, count=10)) == {"unreachable": 10}
        assert time.monotonic() - start < 5.0  # ~20 s if each waited for a SYN retransmit


# -- NAT readiness -------------------------------------------------------------------------------


@requires_nft
def test_dnat_vip_reaches_pod_a(lab: Lab, cluster: Cluster) -> None:
    pod_a = cluster.pods["pod-a"]
    vip = cluster.service_ip(10)
    lab.nft(
        cluster.node,
        f"""
        table ip t {{
            chain pre {{
                type nat hook prerouting priority dstnat;
                ip daddr {vip} tcp dport 80 dnat to {pod_a.ip4}:8080;
            }}
            chain out {{
                type nat hook output priority -100;
                ip daddr {vip} tcp dport 80 dnat to {pod_a.ip4}:8080;
            }}
        }}
    """,
    )
    # External client: DNAT only, so pod-a sees the client's real address.
    assert all_from(lab.connect(cluster.client, vip, 80, count=10), "pod-a", cluster.client_ip4)
    # Pod on the node.
    results = lab.connect(cluster.pod_client.ns, vip, 80, count=3)
    assert all_from(results, "pod-a", cluster.pod_client.ip4)
    # The node itself: works thanks to the service-CIDR route (source = the route's src).
    assert all_from(lab.connect(cluster.node, vip, 80, count=3), "pod-a", cluster.node_ip4)
    # Other service IPs are swallowed silently by the sink route.
    other = lab.connect(cluster.client, cluster.service_ip(11), 80, timeout=0.3)
    assert tally(other) == {"timeout": 1}


@requires_nft
def test_masquerade_is_visible_to_backend(lab: Lab, cluster: Cluster) -> None:
    pod_b = cluster.pods["pod-b"]
    lab.nft(
        cluster.node,
        f"""
        table inet t {{
            chain post {{
                type nat hook postrouting priority srcnat;
                oifname "{pod_b.node_if}" masquerade;
            }}
        }}
    """,
    )
    for ip, gateway in ((pod_b.ip4, pod_b.gw4), (pod_b.ip6, pod_b.gw6)):
        assert all_from(lab.connect(cluster.client, ip, 8080, count=3), "pod-b", gateway)
        assert all_from(lab.connect(cluster.client, ip, 5353, "udp", count=3), "pod-b", gateway)


# -- incremental changes -------------------------------------------------------------------------


def test_add_stop_remove_pod(lab: Lab, cluster: Cluster) -> None:
    pod_c = cluster.add_pod()
    assert pod_c.name == "pod-c"
    assert pod_c.ip4 == "10.244.3.2"
    assert all_from(lab.connect(cluster.client, pod_c.ip4, 8080), "pod-c", cluster.client_ip4)

    cluster.stop_backend("pod-c")
    assert tally(lab.connect(cluster.client, pod_c.ip4, 8080)) == {"refused": 1}
    cluster.start_backend("pod-c")
    assert tally(lab.connect(cluster.client, pod_c.ip4, 8080)) == {"pod-c": 1}

    cluster.remove_pod("pod-c")
    gone = lab.connect(cluster.client, pod_c.ip4, 8080, timeout=0.3)
    assert not gone[0].ok  # the node has no route to it any more
    assert tally(lab.connect(cluster.client, cluster.pods["pod-a"].ip4, 8080)) == {"pod-a": 1}


def test_sctp_when_available(lab: Lab) -> None:
    ns = lab.add_ns("solo")
    if not lab.sctp_available(ns):
        backend = lab.start_backend(ns, "solo", tcp_ports=[80], sctp_ports=[80])
        assert backend.sctp_ports == []  # skipped gracefully, the rest still serves
        assert tally(lab.connect(ns, "127.0.0.1", 80)) == {"solo": 1}
        pytest.skip("kernel has no SCTP")
    lab.start_backend(ns, "solo", sctp_ports=[80])
    assert tally(lab.connect(ns, "127.0.0.1", 80, proto="sctp", count=3)) == {"solo": 3}


# -- cleanup -------------------------------------------------------------------------------------


def pid_gone(pid: int) -> bool:
    """No such process, or only a zombie (an orphan's zombie lingers until PID 1 reaps it,
    which some container inits do lazily; it no longer runs or holds sockets)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_lab_exit_leaves_nothing() -> None:
    with Lab() as lab:
        cluster = lab.standard_topology()
        assert len(lab.leftovers()) == 5  # node, client, pod-client, pod-a, pod-b
        pids = [pod.backend.proc.pid for pod in cluster.pods.values() if pod.backend]
        workdir = lab.workdir
    assert lab.leftovers() == []
    assert pids and all(pid_gone(pid) for pid in pids)
    assert not workdir.exists()


def test_exception_inside_lab_still_cleans_up() -> None:
    with pytest.raises(KeyboardInterrupt), Lab() as lab:
        lab.standard_topology(backends=1)
        raise KeyboardInterrupt
    assert lab.leftovers() == []


def run_script(code: str) -> subprocess.CompletedProcess[str]:
    """Run a python snippet that uses netlab in a separate interpreter (from the repository
    root, which `python -c` puts on the path: the kit imports as `testkit`)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_atexit_closes_forgotten_lab() -> None:
    proc = run_script("""
        import os
        from testkit.netlab import Lab
        lab = Lab()
        lab.standard_topology(backends=1)
        print(lab.prefix, lab.backends[0].proc.pid)
    """)  # exits without closing the lab
    assert proc.returncode == 0, proc.stderr
    prefix, pid = proc.stdout.split()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names
    assert pid_gone(int(pid))


def test_killed_run_is_swept() -> None:
    """SIGKILL leaves namespaces behind (nothing can run), but backends exit on stdin EOF and
    sweep_stale() removes the namespaces of the dead pid."""
    proc = run_script("""
        import os, signal
        from testkit.netlab import Lab
        lab = Lab()
        lab.standard_topology(backends=1)
        print(lab.prefix, lab.backends[0].proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode == -signal.SIGKILL
    prefix, pid = proc.stdout.split()
    deadline = time.monotonic() + 5
    while not pid_gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pid_gone(int(pid))
    # (A concurrent test run may sweep them first: assert the outcome, not who did it.)
    sweep_stale()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names


def test_sweep_leaves_live_namespaces_alone(lab: Lab) -> None:
    ns = lab.add_ns("alive")
    sweep_stale()
    assert ns.full in lab.leftovers()
    assert os.getpid() == int(ns.full.split("-")[1])


# -- the demo's kind of lab: fixed names, one at a time, processes tied to the lab's ---------


def test_a_fixed_prefix_lab_runs_once_and_sweeps_a_killed_runs_leftovers() -> None:
    """A lab with fixed names holds a lock while it lives; a killed run's namespaces and
    workdir are removed by the next one, and its detached daemon got SIGTERM when it died."""
    prefix = f"ppxfixed{os.getpid()}-"
    proc = run_script(f"""
        import os, signal
        from testkit.netlab import Lab
        lab = Lab(prefix={prefix!r})
        lab.add_ns("a")
        daemon = lab.popen("a", ["sleep", "60"], detach=True)
        print(daemon.pid, lab.workdir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, workdir = proc.stdout.split()
    until(lambda: pid_gone(int(pid)), 5, "the detached daemon gone with its lab's process")
    with Lab(prefix=prefix) as lab:
        assert lab.swept == [f"{prefix}a", workdir]
        with pytest.raises(Locked):
            Lab(prefix=prefix)
        lab.add_ns("a")
        assert lab.leftovers() == [f"{prefix}a"]
    assert lab.leftovers() == []
    assert not lab.lock_path.exists()
    assert not Path(workdir).exists()


def test_in_process_backends_and_probes(lab: Lab, cluster: Cluster) -> None:
    """serve_http/probe_http: a backend and clients as threads of the test's own process."""
    pod = cluster.pods["pod-a"]
    lab.serve_http(pod.ns, pod.ip4, 9000, "alpha")
    assert lab.probe_http(cluster.client, pod.ip4, 9000, count=5) == {"alpha": 5}
    assert lab.probe_http(cluster.client, pod.ip4, 9001, count=2) == {"refused": 2}


def test_control_plane_forwarder_disables_nagle(lab: Lab) -> None:
    """testkit/controlplane.py's forwarder relays each side's segments as they come: with
    Nagle on its upstream socket a request whose body arrived after its headers (urllib3
    sends them apart) waited for the server's delayed ACK, 40 ms added to about half of the
    benches' API writes (issue 37: the quiet network programming latency's floor)."""
    import socket

    from testkit.controlplane import Forwarder
    from testkit.inproc import call_in_netns

    ns = lab.add_ns("server")
    server = call_in_netns(ns.full, lambda: socket.create_server(("127.0.0.1", 0)))
    forwarder = Forwarder(ns.full, ("127.0.0.1", server.getsockname()[1]))
    try:
        with socket.create_connection(("127.0.0.1", forwarder.port), timeout=10) as client:
            accepted, _ = server.accept()
            with accepted:
                client.sendall(b"headers")
                assert accepted.recv(16) == b"headers"  # the relay is up, both sockets made
                until(lambda: len(forwarder._sockets) == 2, timeout=10,
                      what="the forwarder's two sockets")
                assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                           for sock in forwarder._sockets)
    finally:
        forwarder.close()
        server.close()
