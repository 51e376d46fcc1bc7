"""The live CLI against the real daemon (status, services, explain, trace, diff, history),
`trace` answers checked against real packets, and tampering detected and repaired."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from pyproxy.serve.debug import ask
from testkit.builders import ep, make_node, make_service, make_service_cidr, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.held import HeldClients, HoldingServer
from testkit.netlab import Cluster, Lab, tally
from testkit.waits import until

pytestmark = [pytest.mark.netns, requires_netns]

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
VIP, LOCAL_VIP, EMPTY_VIP, STICKY_VIP = "10.96.0.10", "10.96.0.11", "10.96.0.12", "10.96.0.13"
UNALLOCATED = "10.96.0.99"  # in the ServiceCIDR, no Service's
NODEPORT = 30080


def cluster_objects(c: Cluster) -> list[dict[str, Any]]:
    def nodeport_local(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="NodePort", externalTrafficPolicy="Local",
                           ports=[{"name": "http", "port": 80, "nodePort": NODEPORT}])

    def sticky(svc: dict[str, Any]) -> None:
        svc["spec"]["sessionAffinity"] = "ClientIP"

    pods = {name: pod.ip4 for name, pod in c.pods.items()}
    return [
        make_node("node-a", "zone-1"),
        make_service("ns", "web", ip=VIP),
        make_slice("ns", "web", [ep(pods["pod-a"], "node-a"), ep(pods["pod-b"], "node-b")]),
        make_service("ns", "local", nodeport_local, ip=LOCAL_VIP),
        make_slice("ns", "local", [ep(pods["pod-a"], "node-a"), ep(pods["pod-b"], "node-b")]),
        make_service("ns", "empty", ip=EMPTY_VIP),
        make_service("ns", "sticky", sticky, ip=STICKY_VIP),
        make_slice("ns", "sticky", [ep(pods["pod-a"], "node-a"), ep(pods["pod-b"], "node-b")]),
        make_service_cidr("kubernetes", c.service_cidr4),
    ]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str, Path]]:
    tmp = tmp_path_factory.mktemp("live")
    snapshot = tmp / "cluster.yaml"
    sock = str(tmp / "run" / "pyproxy.sock")
    with Lab() as lab:
        c = lab.standard_topology(backends=2)
        snapshot.write_text(yaml.safe_dump_all(cluster_objects(c)))
        daemon = lab.popen(c.node, DaemonArgs(
            snapshot=snapshot, bind_address=c.node_ip4, cluster_cidr=c.cluster_cidr4,
            min_sync_period="100ms", sync_period="2s", debug_socket=sock,
            extra=("--in-flight-interval", "1s")).argv(),
            log_name="pyproxy-live.log")
        until(lambda: cli(sock, "status")[0] == 0, 20, "the daemon healthy", interval=0.2)
        yield c, sock, snapshot
        lab.stop_process(daemon)


def cli(sock: str, *args: str) -> tuple[int, str]:
    out = subprocess.run([PYPROXY, *args, "--socket", sock], capture_output=True, text=True,
                         timeout=120)
    return out.returncode, out.stdout + out.stderr


def cli_json(sock: str, *args: str) -> Any:
    code, text = cli(sock, *args, "-o", "json")
    assert code in (0, 1), text
    return json.loads(text)


def test_status_and_history(env: tuple[Cluster, str, Path]) -> None:
    _, sock, _ = env
    status = cli_json(sock, "status")
    assert status["healthy"] and status["initialized"]
    assert status["node"] == "node-a" and status["services"] == 4
    assert status["lastFullSync"]["cause"] == "start"
    assert status["source"]["loads"] == 1
    code, text = cli(sock, "status")
    assert code == 0 and "healthy:           yes" in text
    history = cli_json(sock, "history")
    assert history[0]["full"] and history[0]["commands"] > 0
    assert "full" in cli(sock, "history")[1]


def test_services_and_live_explain(env: tuple[Cluster, str, Path]) -> None:
    c, sock, snapshot = env
    entries = cli_json(sock, "services")
    web = next(e for e in entries if e["service"] == "ns/web")
    assert sorted(web["clusterEndpoints"]) == sorted(
        [f"{c.pods['pod-a'].ip4}:8080", f"{c.pods['pod-b'].ip4}:8080"])
    code, text = cli(sock, "services", "-o", "wide")
    assert code == 0 and "ns/local" in text and "ext=Local" in text
    live = cli_json(sock, "explain", "ns/local")
    offline = json.loads(subprocess.run(
        [PYPROXY, "explain", "-f", str(snapshot), "--node", "node-a", "--service", "ns/local",
         "-o", "json"], capture_output=True, text=True, check=True).stdout)
    # live, a TCP port has its connections in flight too (none here)
    assert [e.pop("inFlight")["established"] for e in live["services"]] == [0]
    assert live == offline
    assert cli(sock, "explain", "ns/nope")[0] == 1


def traced(sock: str, src: str, dst: str, *extra: str) -> dict[str, Any]:
    result: dict[str, Any] = cli_json(sock, "trace", "--src", src, "--dst", dst, *extra)
    return result


def observed(c: Cluster, ns: Any, addr: str, port: int, count: int = 30) -> tuple[set[str],
                                                                                 set[str]]:
    results = c.lab.connect(ns, addr, port, count=count, parallel=6, timeout=0.5)
    return set(tally(results)), {str(r.seen_ip) for r in results if r.ok}


def endpoint_names(c: Cluster, candidates: list[dict[str, Any]]) -> set[str]:
    by_ip = {ip_address(p.ip4): name for name, p in c.pods.items()}
    return {by_ip[ip_address(x["endpoint"].rsplit(":", 1)[0])] for x in candidates}


@pytest.mark.parametrize("case", ["client-vip", "pod-vip", "client-nodeport-local",
                                  "pod-nodeport-local", "empty", "bad-port", "sticky",
                                  "unallocated"])
def test_trace_matches_real_packets(env: tuple[Cluster, str, Path], case: str) -> None:
    c, sock, _ = env
    client, pod = (c.client, c.client_ip4), (c.pod_client.ns, c.pod_client.ip4)
    source, dst, port = {
        "client-vip": (client, VIP, 80), "pod-vip": (pod, VIP, 80),
        "client-nodeport-local": (client, c.node_ip4, NODEPORT),
        "pod-nodeport-local": (pod, c.node_ip4, NODEPORT),
        "empty": (client, EMPTY_VIP, 80), "bad-port": (client, VIP, 81),
        "sticky": (client, STICKY_VIP, 80), "unallocated": (client, UNALLOCATED, 80),
    }[case]
    answer = traced(sock, source[1], f"{dst}:{port}/tcp")
    if case == "sticky":
        # one connection first: concurrent first connections of a new client race each
        # other to the affinity set (in kube-proxy too), later ones all find the entry
        observed(c, source[0], dst, port, count=1)
    names, seen = observed(c, source[0], dst, port)
    if answer["verdict"] == "DNAT":
        candidates = endpoint_names(c, answer["candidates"])
        if case == "sticky":
            assert len(names) == 1 and names <= candidates  # affinity: one of the candidates
        else:
            assert names == candidates, (answer, names)
        gateways = {c.pods[n].gw4 for n in names}
        assert seen == (gateways if answer["masquerade"] else {source[1]}), answer
    else:
        expected = {"REJECT": "refused", "DROP": "timeout"}[answer["verdict"]]
        # No backend ever answers; under load a reject can outlast the 0.5 s client timeout.
        assert expected in names and names <= {"refused", "timeout"}, (answer, names)


def test_diff_and_tampering_repaired(env: tuple[Cluster, str, Path]) -> None:
    c, sock, _ = env
    code, text = cli(sock, "diff")
    assert code == 0 and "table ip pyproxy: identical" in text, text
    # someone deletes an element: repaired at once (issue 28), so `diff` can only show it
    # while the kernel refuses the repair (the drills' /fault)
    with repair_refused(sock):
        c.node.run(["nft", "delete", "element", "ip", "pyproxy", "cluster-ips",
                    "{ 10.96.0.12 }"])
        code, text = cli(sock, "diff")
        assert code == 1 and "set cluster-ips: missing element 10.96.0.12" in text
    until(lambda: cli(sock, "diff")[0] == 0, 15, "the element repaired", interval=0.3)
    # someone flushes the dispatch chain: the daemon notices within syncPeriod and repairs it
    c.node.run(["nft", "flush", "chain", "ip", "pyproxy", "services"])
    # not DNATed until the repair (which may already have happened: syncPeriod is 2 s)
    until(lambda: observed(c, c.client, VIP, 80, count=3)[0] != {"refused"}, 10,
          "the dispatch chain repaired", interval=0.3)
    assert cli(sock, "diff")[0] == 0
    history = cli_json(sock, "history")
    assert any(r["cause"] == "repair" for r in history)
    metrics = c.lab.exec_python(c.node, "import urllib.request;print(urllib.request.urlopen("
                                "'http://127.0.0.1:10249/metrics').read().decode())").stdout
    assert "pyproxy_table_repairs_total 2.0" in metrics  # the element, the chain


@contextlib.contextmanager
def repair_refused(sock: str) -> Iterator[None]:
    """The kernel refuses every IPv4 transaction of the daemon (its repairs too) until the
    block ends; the daemon's retry then repairs what was changed meanwhile."""
    ask(sock, "/fault", fail=1000, family="ip")
    try:
        yield
    finally:
        ask(sock, "/fault", fail=0, family="ip")


def test_unreachable_daemon_exit_code(tmp_path: Path) -> None:
    assert cli(str(tmp_path / "none.sock"), "status")[0] == 3


def test_trace_verify_checks_the_answer_against_the_kernel(env: tuple[Cluster, str, Path]) -> None:
    c, sock, _ = env
    code, text = cli(sock, "trace", "--src", c.client_ip4, "--dst", f"{VIP}:80/tcp", "--verify")
    assert code == 0 and "every element the answer used is there" in text, text
    slot = f"{VIP} . 80 . 0"
    listing = c.node.run(["nft", "get", "element", "ip", "pyproxy", "endpoints-tcp",
                          f"{{ {slot} }}"]).stdout
    value = listing.split(f"{slot} : ", 1)[1].split()[0:3]
    assert value  # the slot is there to delete
    with repair_refused(sock):  # or the element would be back before the check
        c.node.run(["nft", "delete", "element", "ip", "pyproxy", "endpoints-tcp",
                    f"{{ {slot} }}"])
        code, text = cli(sock, "trace", "--src", c.client_ip4, "--dst", f"{VIP}:80/tcp",
                         "--verify")
        assert code == 1 and "endpoints-tcp: expected" in text, text
    until(lambda: cli(sock, "diff")[0] == 0, 15, "the element repaired", interval=0.3)


def new_connections(c: Cluster) -> dict[tuple[str, str, str], float]:
    """ns/web's new connections per (port, endpoint, scope), from the daemon's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = c.lab.exec_python(c.node, "import urllib.request;print(urllib.request.urlopen("
                             "'http://127.0.0.1:10249/metrics').read().decode())").stdout
    return {(s.labels["port"], s.labels["endpoint"], s.labels["scope"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "pyproxy_endpoint_new_connections"
            for s in family.samples if s.labels["service"] == "ns/web"}


def test_new_connections_per_endpoint_on_metrics_and_services(
        env: tuple[Cluster, str, Path]) -> None:
    c, sock, _ = env
    scope = {"pod-a": "node", "pod-b": "cluster"}  # pod-b's node-b is not in the snapshot
    series = {pod: ("http", f"{c.pods[pod].ip4}:8080", scope[pod]) for pod in scope}
    before = new_connections(c)
    landed = tally(c.lab.connect(c.client, VIP, 80, count=20, parallel=5))
    assert set(landed) <= set(scope), landed
    expected = {series[pod]: before.get(series[pod], 0) + n for pod, n in landed.items()}
    # the daemon reads the kernel at most once a second: a scrape may see the previous read
    until(lambda: new_connections(c) == {**before, **expected}, 10,
          f"the counters at {expected} (before: {before})", interval=0.3)
    now = new_connections(c)
    code, text = cli(sock, "services", "ns/web", "-o", "wide")
    assert code == 0 and "NEW-CONNECTIONS" in text, text
    for (_, endpoint, where), count in now.items():
        assert f"{endpoint}={int(count)}({where})" in text, text
    entry = cli_json(sock, "services", "ns/web")[0]
    assert sum(x["count"] for x in entry["newConnections"]) == sum(now.values())


@contextlib.contextmanager
def holding_service(env: tuple[Cluster, str, Path], name: str, port: int,
                    vip: str) -> Iterator[tuple[HeldClients, Callable[[list[Any]], None]]]:
    """Servers holding their connections on `port` in every pod, clients of vip:80, and a
    `serve(objects)` that puts ns/<name>'s objects in the snapshot beside the original ones
    and waits until they are programmed; at the end everything is closed and the snapshot is
    what it was, the Service gone."""
    c, sock, snapshot = env
    servers = [HoldingServer(c.pods[p].ns.full, c.pods[p].ip4, port, p) for p in c.pods]
    original = snapshot.read_text()
    clients = HeldClients(c.client.full, vip, 80)

    def serve(objects: list[Any]) -> None:
        snapshot.write_text(original + "---\n" + yaml.safe_dump_all(objects))
        until(lambda: cli(sock, "services", f"ns/{name}")[0] == 0 and cli_json(
            sock, "services", f"ns/{name}"), 20, f"ns/{name} programmed", interval=0.3)

    try:
        yield clients, serve
    finally:
        clients.close()
        for server in servers:
            server.close()
        snapshot.write_text(original)
        until(lambda: cli_json(sock, "status")["services"] == 4, 20, f"ns/{name} gone",
              interval=0.3)


def in_flight_metric(c: Cluster) -> dict[tuple[str, str], float]:
    """ns/held's connections in flight per (endpoint, terminating), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = c.lab.exec_python(c.node, "import urllib.request;print(urllib.request.urlopen("
                             "'http://127.0.0.1:10249/metrics').read().decode())").stdout
    return {(s.labels["endpoint"], s.labels["terminating"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "pyproxy_endpoint_connections_in_flight"
            for s in family.samples if s.labels["service"] == "ns/held"}


def test_connections_in_flight_and_a_drain_in_services_explain_and_metrics(
        env: tuple[Cluster, str, Path]) -> None:
    """Connections held open through a Service, seen per endpoint; one endpoint
    terminating shows "draining: N left", then 0 once its clients are done."""
    c, sock, _snapshot = env
    held, vip = 9090, "10.96.0.30"

    def objects(terminating: str | None = None) -> list[dict[str, Any]]:
        def ports(s: dict[str, Any]) -> None:
            s["ports"] = [{"name": "http", "port": held, "protocol": "TCP"}]

        return [make_service("ns", "held", lambda s: s["spec"]["ports"][0].update(
                    targetPort=held), ip=vip),
                make_slice("ns", "held", [ep(c.pods[p].ip4, "node-a", ready=p != terminating,
                                             serving=True, terminating=p == terminating)
                                          for p in c.pods], ports)]

    def entry() -> dict[str, Any]:
        return cast(dict[str, Any], cli_json(sock, "services", "ns/held")[0])

    with holding_service(env, "held", held, vip) as (clients, serve):
        serve(objects())
        landed = clients.open(20)
        busiest = max(landed, key=lambda p: landed[p])
        ip = {p: f"{c.pods[p].ip4}:{held}" for p in c.pods}
        # read at most every second (--in-flight-interval 1s): a look may see the last read
        until(lambda: entry()["inFlight"]["established"] == 20, 10, "20 in flight",
              interval=0.3)
        assert {e["endpoint"]: e["established"] for e in entry()["inFlight"]["endpoints"]} \
            == {ip[p]: landed.get(p, 0) for p in c.pods}
        assert in_flight_metric(c) == {(ip[p], "false"): n for p, n in landed.items()}
        serve(objects(busiest))
        draining = f"{ip[busiest]} terminating, draining: {landed[busiest]} left"
        until(lambda: draining in cli(sock, "explain", "ns/held")[1], 20, draining,
              interval=0.3)
        code, text = cli(sock, "services", "ns/held", "-o", "wide")
        assert code == 0 and f"20 (draining: {landed[busiest]} left)" in text, text
        clients.close(busiest)
        done = f"{ip[busiest]} terminating, draining: 0 left"
        until(lambda: done in cli(sock, "explain", "ns/held")[1], 10, done, interval=0.3)
        until(lambda: in_flight_metric(c).get((ip[busiest], "true")) == 0, 10,
              "the metric at 0 for the drained endpoint", interval=0.3)


def test_least_connections_in_the_daemon(env: tuple[Cluster, str, Path]) -> None:
    """A Service balanced by lc: the daemon's feedback (every 2 s, the default) reads the
    connections held open through it and moves the slots away from the endpoint holding
    them; a live explain shows the shares in force."""
    c, sock, _snapshot = env
    held, vip = 9091, "10.96.0.31"

    def objects(pods: list[str]) -> list[dict[str, Any]]:
        def lc(svc: dict[str, Any]) -> None:
            svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": "lc"}
            svc["spec"]["ports"][0]["targetPort"] = held

        def ports(s: dict[str, Any]) -> None:
            s["ports"] = [{"name": "http", "port": held, "protocol": "TCP"}]

        return [make_service("ns", "lc", lc, ip=vip),
                make_slice("ns", "lc", [ep(c.pods[p].ip4, "node-a") for p in pods], ports)]

    def shares() -> dict[str, float]:
        reasons = cli_json(sock, "explain", "ns/lc")["services"][0]["reasons"]
        line = next(r for r in reasons if "least connections (lc), by feedback" in r)
        if "; now " not in line:
            return {}
        return {part.split()[0]: float(part.split()[1].rstrip("%")) / 100
                for part in line.split("; now ")[1].split(", ")}

    busy, idle = f"{c.pods['pod-a'].ip4}:{held}", f"{c.pods['pod-b'].ip4}:{held}"
    with holding_service(env, "lc", held, vip) as (clients, serve):
        # pod-a alone first: it takes 20 connections; then pod-b joins
        serve(objects(["pod-a"]))
        assert clients.open(20) == {"pod-a": 20}
        serve(objects(["pod-a", "pod-b"]))
        until(lambda: shares().get(idle, 0) > 0.8, 30, "the idle endpoint's share above 80 %",
              interval=0.5)
        assert shares()[busy] < 0.2
        landed = clients.open(20)
        assert landed.get("pod-b", 0) >= 12, landed  # ~17 expected
