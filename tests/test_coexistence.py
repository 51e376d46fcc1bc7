"""Other tables' base chains that drop what pyproxy accepts (issue 27, point 7): the decision
as a table of chains (pure), how a chain ends read from nft's JSON, the change events that
ask for a check, the check's log and metric, and `status`/`explain`; then real nft in a
throwaway namespace: the chains read back from the kernel, and the daemon reporting a
`policy drop` forward chain that real packets show breaking a NodePort."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from pyproxy.cli.formats import format_status
from pyproxy.core.coexistence import BaseChain, chain_ending, findings
from pyproxy.core.model import IPFamily
from pyproxy.kernel.basechains import CoexistenceCheck, read_base_chains
from pyproxy.kernel.nftevents import (
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWGEN,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSETELEM,
    Message,
    Transaction,
    other_table_change,
)
from pyproxy.serve.live import with_other_tables
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, Lab, tally
from testkit.waits import until

V4, V6 = (IPFamily.IPv4,), (IPFamily.IPv4, IPFamily.IPv6)


def chain(**tweaks: Any) -> BaseChain:
    """Docker's iptables-backend FORWARD, as iptables-nft leaves it in nftables."""
    base = BaseChain(family="ip", table="filter", name="FORWARD", type="filter",
                     hook="forward", priority=0, policy="drop")
    return replace(base, **tweaks)


@pytest.mark.parametrize(("chains", "families", "expected"), [
    pytest.param([chain()], V4, ["policy drop"], id="a policy drop forward chain is reported"),
    pytest.param([chain(policy="accept")], V4, [], id="a policy accept chain drops nothing"),
    pytest.param([chain(policy="accept", final_verdict="reject", family="inet",
                        table="firewalld", name="filter_FORWARD", priority=10)], V4,
                 ["a final reject rule"], id="a final reject rule is a drop too (firewalld)"),
    pytest.param([chain(accepts_dnat=True)], V4, [],
                 id="ct status dnat accept before the drop lets pyproxy's connections through"),
    pytest.param([chain(hook="prerouting", priority=-150, accepts_dnat=True)], V4,
                 ["policy drop"], id="before DNAT no connection has ct status dnat yet"),
    pytest.param([chain(hook="prerouting", priority=0, accepts_dnat=True)], V4, [],
                 id="after DNAT in prerouting it has"),
    pytest.param([chain(family="ip6")], V4, [], id="an ip6 chain on an IPv4-only node"),
    pytest.param([chain(family="inet")], V4, ["policy drop"], id="an inet chain sees IPv4"),
    pytest.param([chain(family="bridge")], V6, [], id="bridge chains see no routed packets"),
    pytest.param([chain(hook="ingress", family="netdev")], V4, [], id="netdev ingress"),
    pytest.param([chain(table="pyproxy")], V4, [], id="our own table is never reported"),
    pytest.param([chain(table="pyproxy", family="inet")], V4, ["policy drop"],
                 id="inet pyproxy is not ours"),
    pytest.param([chain(hook="input"), chain(hook="output", name="OUTPUT"),
                  chain(hook="postrouting", type="nat", name="POSTROUTING")], V4,
                 ["policy drop"] * 3, id="input, output and postrouting are crossed too"),
])
def test_which_chains_drop_what_pyproxy_accepts(chains: list[BaseChain],
                                                families: tuple[IPFamily, ...],
                                                expected: list[str]) -> None:
    assert [f.drops for f in findings(chains, families)] == expected


def test_a_finding_says_what_breaks_and_where_the_fix_is() -> None:
    (found,) = findings([chain()], V4)
    assert found.text() == (
        "table ip filter, chain FORWARD (filter hook forward priority 0) has policy drop: it "
        "drops what its own rules do not accept, whatever pyproxy accepts — connections "
        "DNATed to pods: NodePorts, external and load-balancer IPs from outside, ClusterIPs "
        "from pods (docs/deploying.md, \"Other firewalls on the node\")")
    assert found.as_dict()["hook"] == "forward" and found.as_dict()["table"] == "filter"


def rules(*exprs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"nftables": [{"metainfo": {"json_schema_version": 1}},
                         {"chain": {"family": "inet", "table": "t", "name": "c"}},
                         *({"rule": {"expr": e}} for e in exprs)]}


COUNTER: dict[str, Any] = {"counter": {"packets": 0, "bytes": 0}}
DNAT_ACCEPT = [{"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}},
               {"accept": None}]
TCP_22 = {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}},
                    "right": 22}}


@pytest.mark.parametrize(("listing", "expected"), [
    pytest.param(rules(), (None, False), id="no rules"),
    pytest.param(rules([COUNTER, {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}]),
                 ("reject", False), id="firewalld's last rule"),
    pytest.param(rules([{"drop": None}]), ("drop", False), id="a bare drop"),
    pytest.param(rules([TCP_22, {"drop": None}]), (None, False), id="a conditional drop"),
    pytest.param(rules([{"drop": None}], [TCP_22, {"accept": None}]), (None, False),
                 id="a drop that is not last"),
    pytest.param(rules(DNAT_ACCEPT, [{"drop": None}]), ("drop", True),
                 id="ct status dnat accept before it"),
    pytest.param(rules([COUNTER, *DNAT_ACCEPT]), (None, True), id="with a counter"),
    pytest.param(rules([TCP_22, *DNAT_ACCEPT]), (None, False),
                 id="dnat accepted only for one port is not all of it"),
    pytest.param(rules([{"match": {"op": "in", "left": {"ct": {"key": "status"}},
                                   "right": ["dnat", "snat"]}}, {"accept": None}]),
                 (None, False), id="dnat and snat both: not every DNATed connection"),
])
def test_how_a_chain_ends(listing: dict[str, Any], expected: tuple[str | None, bool]) -> None:
    assert chain_ending(listing) == expected


def test_another_tables_chains_or_rules_ask_for_a_check_once_per_transaction() -> None:
    docker = Message(NFT_MSG_NEWCHAIN, 77, 2, "docker-bridges", "filter-FORWARD")
    rule = Message(NFT_MSG_NEWRULE, 77, 1, "firewalld", "filter_FORWARD")
    assert other_table_change(docker) and other_table_change(rule)
    assert not other_table_change(Message(NFT_MSG_NEWSETELEM, 77, 2, "kube-proxy", "s"))
    assert not other_table_change(Message(NFT_MSG_NEWCHAIN, 77, 2, "pyproxy", "c"))
    assert not other_table_change(Message(NFT_MSG_NEWCHAIN, 0, 2, "other", "c"))
    pending, _ = Transaction().feed(docker, ())
    pending, _ = pending.feed(rule, ())
    assert pending.other_tables and pending.changes == ()
    pending, report = pending.feed(Message(NFT_MSG_NEWGEN, 77, 0), ())
    assert report is None and pending == Transaction()


class TestCoexistenceCheck:
    def test_a_new_finding_is_logged_once_and_its_count_handed_on(self) -> None:
        """Each check hands the findings on (the gauge); the log says what changed only."""
        kernel = [chain(policy="accept")]
        counts: list[int] = []
        check = CoexistenceCheck(V4, lambda found: counts.append(len(found)),
                                 read=lambda: tuple(kernel))
        with capture_logs() as logs:
            check.check()
            kernel[0] = chain()
            check.check()
            check.check()
            kernel.clear()
            check.check()
        assert counts == [0, 1, 1, 0]
        assert [(e["event"], e.get("table"), e.get("hook")) for e in logs] == [
            ("other_table_drops", "filter", "forward"), ("other_table_drops_cleared", None, None)]
        assert logs[0]["log_level"] == "warning"

    def test_checks_at_start_and_when_asked_at_most_once_per_interval(self) -> None:
        reads: list[int] = []
        stop = threading.Event()

        def read() -> tuple[BaseChain, ...]:
            reads.append(1)
            if len(reads) == 2:
                stop.set()
            return ()

        check = CoexistenceCheck(V4, read=read, min_interval=0.0, period=30.0)
        check.request()  # a change event while the first check runs
        check.run(stop)
        assert len(reads) == 2

    def test_no_check_after_stop(self) -> None:
        """Stopped while waiting for a change: the next request ends it, unchecked."""
        reads: list[int] = []
        stop = threading.Event()
        check = CoexistenceCheck(V4, read=lambda: reads.append(1) or (), min_interval=0.0,
                                 period=30.0)
        thread = threading.Thread(target=check.run, args=(stop,))
        thread.start()
        until(lambda: reads, 5, "the first check")
        stop.set()
        check.request()
        thread.join(5)
        assert not thread.is_alive() and len(reads) == 1

    def test_an_unreadable_ruleset_is_a_warning_and_no_crash(self) -> None:
        stop = threading.Event()

        def read() -> tuple[BaseChain, ...]:
            stop.set()
            raise OSError("nft list chains: Operation not permitted")

        with capture_logs() as logs:
            CoexistenceCheck(V4, read=read, min_interval=0.0, period=0.0).run(stop)
        assert logs[0]["event"] == "other_tables_unreadable"


def test_status_and_explain_show_the_findings() -> None:
    found = findings([chain()], V4)
    status = {"node": "node-a", "families": ["IPv4"], "healthy": True, "nodeEligible": True,
              "sources": {}, "services": 0, "servicePorts": 0,
              "pendingChanges": {"services": 0, "endpoints": 0}, "syncs": 0,
              "syncFailures": 0, "lastSync": None, "lastFullSync": None,
              "lastPartialSync": None, "invalidObjects": {}}
    text = format_status({**status, "otherTables": [f.as_dict() for f in found]})
    assert "other tables:      WARNING: 1 chain(s) may drop pyproxy's traffic" in text
    assert "  table ip filter, chain FORWARD (filter hook forward priority 0)" in text
    assert "no chain drops" in format_status({**status, "otherTables": []})
    report = {"node": {"name": "node-a", "labels": {}}, "services": []}
    assert with_other_tables(report, ()) == report
    explained = with_other_tables(report, found)
    assert explained["warnings"] == [found[0].text()]
    assert explained["otherTables"][0]["chain"] == "FORWARD"


# ---------------------------------------------------------------------------------------------
# Real nft, real packets, in throwaway namespaces

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
NODEPORT = 30090
DOCKER_LIKE = ("table ip filter { chain FORWARD { type filter hook forward priority 0; "
               "policy drop; }; }")
FIREWALLD_LIKE = """
table inet firewalld {
  chain filter_FORWARD { type filter hook forward priority 10; policy accept;
    ct state established,related accept; ct status dnat accept;
    counter reject with icmpx admin-prohibited; }
  chain filter_INPUT { type filter hook input priority 10; policy accept;
    ct state established,related accept; iifname "lo" accept;
    reject with icmpx admin-prohibited; }
  chain filter_OUTPUT { type filter hook output priority 10; policy accept; }
  chain filter_IN_public { }
}
"""


@pytest.mark.netns
@requires_netns
def test_the_kernels_base_chains_read_back() -> None:
    """What the shell reads from real nft 1.0.6: hooks, priorities, policies, how each chain
    ends; regular chains left out; and the decision on them."""
    with Lab() as lab:
        ns = lab.add_ns("chains")
        lab.nft(ns, DOCKER_LIKE + FIREWALLD_LIKE)
        chains = call_in_netns(ns.full, read_base_chains)
        assert {c.label: (c.hook, c.priority, c.policy, c.final_verdict, c.accepts_dnat)
                for c in chains} == {
            "ip filter FORWARD": ("forward", 0, "drop", None, False),
            "inet firewalld filter_FORWARD": ("forward", 10, "accept", "reject", True),
            "inet firewalld filter_INPUT": ("input", 10, "accept", "reject", False),
            "inet firewalld filter_OUTPUT": ("output", 10, "accept", None, False)}
        assert [(f.chain.label, f.drops) for f in findings(chains, V6)] == [
            ("inet firewalld filter_INPUT", "a final reject rule"),
            ("ip filter FORWARD", "policy drop")]


def nodeport_objects(c: Cluster) -> list[dict[str, Any]]:
    def nodeport(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="NodePort",
                           ports=[{"name": "http", "port": 80, "nodePort": NODEPORT}])

    return [make_node("node-a", "zone-1"),
            make_service("ns", "web", nodeport, ip="10.96.0.20"),
            make_slice("ns", "web", [ep(c.pods["pod-a"].ip4, "node-b")])]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    snapshot = tmp_path / "cluster.yaml"
    sock = str(tmp_path / "run" / "pyproxy.sock")
    with Lab() as lab:
        c = lab.standard_topology(backends=1)
        snapshot.write_text(yaml.safe_dump_all(nodeport_objects(c)))
        proc = lab.popen(c.node, DaemonArgs(
            snapshot=snapshot, bind_address=c.node_ip4, cluster_cidr=c.cluster_cidr4,
            min_sync_period="100ms", debug_socket=sock).argv(), log_name="pyproxy-coexist.log")
        until(lambda: status(sock).get("lastFullSync") is not None, 20, "the first sync",
              interval=0.2)
        yield c, sock
        lab.stop_process(proc)


def status(sock: str) -> dict[str, Any]:
    out = subprocess.run([PYPROXY, "status", "-o", "json", "--socket", sock],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout) if out.stdout.strip() else {}


def nodeport_answers(c: Cluster) -> int:
    results = c.lab.connect(c.client, c.node_ip4, NODEPORT, count=6, parallel=6, timeout=0.5)
    return tally(results)["pod-a"]


def metric(c: Cluster) -> str:
    def get() -> str:
        with urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=5) as answer:
            return str(answer.read().decode())

    return next(line for line in call_in_netns(c.node.full, get).splitlines()
                if line.startswith("pyproxy_other_table_drop_chains "))


@pytest.mark.netns
@requires_netns
def test_a_drop_policy_forward_chain_breaks_a_nodeport_and_is_reported(
        daemon: tuple[Cluster, str]) -> None:
    """Docker's `policy drop` FORWARD chain added under a running pyproxy: the NodePort's
    connections from outside time out, and pyproxy says why within seconds (a change
    event; the periodic check is a minute away) in status, explain, the metric; gone
    again when the chain is. firewalld's shape (a final reject after `ct status dnat
    accept`) lets the NodePort through and is not reported."""
    c, sock = daemon
    assert nodeport_answers(c) == 6
    assert status(sock)["otherTables"] == [] and metric(c).endswith(" 0.0")

    c.lab.nft(c.node, DOCKER_LIKE)
    assert nodeport_answers(c) == 0  # real packets: dropped after pyproxy's DNAT
    until(lambda: status(sock)["otherTables"], 10, "the finding", interval=0.2)
    (found,) = status(sock)["otherTables"]
    assert (found["table"], found["chain"], found["hook"], found["drops"]) == (
        "filter", "FORWARD", "forward", "policy drop")
    assert metric(c).endswith(" 1.0")
    explained = json.loads(subprocess.run(
        [PYPROXY, "explain", "-o", "json", "--socket", sock], capture_output=True, text=True,
        timeout=60).stdout)
    assert explained["otherTables"][0]["chain"] == "FORWARD"
    text = subprocess.run([PYPROXY, "status", "--socket", sock], capture_output=True,
                          text=True, timeout=60).stdout
    assert "other tables:      WARNING: 1 chain(s)" in text

    c.lab.run(c.node, ["nft", "delete", "table", "ip", "filter"])
    c.lab.nft(c.node, FIREWALLD_LIKE.replace(
        "    ct state established,related accept; iifname \"lo\" accept;\n"
        "    reject with icmpx admin-prohibited; }", "}"))  # its input chain left open
    until(lambda: not status(sock)["otherTables"], 10, "the finding cleared", interval=0.2)
    assert nodeport_answers(c) == 6
    assert metric(c).endswith(" 0.0")
