"""`pyproxy cleanup --kube-proxy`: kube-proxy's leftovers go, and nothing else.

The iptables part is checked against listings in `iptables -S`'s format (this machine has no
iptables); the nftables part and the command line run in a network namespace. The whole
migration, with the real kube-proxy, is tests/test_k8s_migration.py."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from pyproxy.cli import kubeproxy_cleanup as kc
from testkit.fixtures import requires_netns
from testkit.netlab import Lab
from testkit.nftns import libnft_in

# iptables mode (kube-proxy v1.37) next to the kubelet's chains and kube-router's network
# policy chains, as `iptables -t nat -S` / `-t filter -S` print them.
NAT = """\
-P PREROUTING ACCEPT
-P POSTROUTING ACCEPT
-N KUBE-EXT-ABCDEF
-N KUBE-KUBELET-CANARY
-N KUBE-MARK-MASQ
-N KUBE-NODEPORTS
-N KUBE-POSTROUTING
-N KUBE-PROXY-CANARY
-N KUBE-SEP-XYZ
-N KUBE-SERVICES
-N KUBE-SVC-ABCDEF
-N CNI-NAT
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.244.0.0/16 -j CNI-NAT
-A CNI-NAT -d 10.96.0.0/12 -g KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "ns/web:http cluster IP" \
-m tcp --dport 80 -j KUBE-SVC-ABCDEF
-A KUBE-SVC-ABCDEF -m comment --comment "ns/web:http -> 10.244.1.2:8080" -j KUBE-SEP-XYZ
-A KUBE-SEP-XYZ -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080
"""
FILTER = """\
-P INPUT ACCEPT
-N KUBE-FIREWALL
-N KUBE-FORWARD
-N KUBE-PROXY-FIREWALL
-N KUBE-ROUTER-INPUT
-N KUBE-POD-FW-ABC
-N KUBE-NWPLCY-DEF
-A INPUT -j KUBE-FIREWALL
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" \
-j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kube-router netpol" -j KUBE-ROUTER-INPUT
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A KUBE-ROUTER-INPUT -j KUBE-POD-FW-ABC
-A KUBE-POD-FW-ABC -j KUBE-NWPLCY-DEF
"""


def test_removes_kube_proxy_chains_and_the_jumps_into_them() -> None:
    commands = kc.iptables_commands("nat", NAT.replace("\\\n", ""))
    chains = ["KUBE-EXT-ABCDEF", "KUBE-MARK-MASQ", "KUBE-NODEPORTS", "KUBE-POSTROUTING",
              "KUBE-PROXY-CANARY", "KUBE-SEP-XYZ", "KUBE-SERVICES", "KUBE-SVC-ABCDEF"]
    assert commands == [
        # Quoted comments stay one argument each, or iptables would find no such rule.
        ["-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals",
         "-j", "KUBE-SERVICES"],
        ["-D", "OUTPUT", "-m", "comment", "--comment", "kubernetes service portals",
         "-j", "KUBE-SERVICES"],
        ["-D", "POSTROUTING", "-m", "comment", "--comment", "kubernetes postrouting rules",
         "-j", "KUBE-POSTROUTING"],
        ["-D", "CNI-NAT", "-d", "10.96.0.0/12", "-g", "KUBE-SERVICES"],  # a goto counts too
        *[["-F", c] for c in chains],
        *[["-X", c] for c in chains],
    ]


def test_leaves_the_kubelets_and_other_softwares_kube_chains() -> None:
    commands = kc.iptables_commands("filter", FILTER.replace("\\\n", ""))
    touched = {c[1] for c in commands if c[0] in ("-F", "-X")}
    assert touched == {"KUBE-FORWARD", "KUBE-PROXY-FIREWALL"}
    deleted_rules = [c for c in commands if c[0] == "-D"]
    assert [r[-1] for r in deleted_rules] == ["KUBE-PROXY-FIREWALL", "KUBE-FORWARD"]
    # Per-service prefixes mean kube-proxy's chains in nat only.
    assert not kc.is_kube_proxy_chain("filter", "KUBE-SVC-ABCDEF")


def test_ipvs_mode_chains() -> None:
    listing = ("-N KUBE-IPVS-FILTER\n-N KUBE-LOAD-BALANCER\n-N KUBE-NODE-PORT\n"
               "-A INPUT -m comment --comment \"kubernetes ipvs access filter\" "
               "-j KUBE-IPVS-FILTER\n")
    assert [c[1] for c in kc.iptables_commands("filter", listing) if c[0] == "-X"] == [
        "KUBE-IPVS-FILTER", "KUBE-NODE-PORT"]
    assert [c[1] for c in kc.iptables_commands("nat", listing) if c[0] == "-X"] == [
        "KUBE-LOAD-BALANCER", "KUBE-NODE-PORT"]


class FakeTools:
    """iptables tools as `run` sees them: versions, listings per (tool, table), and a log."""

    def __init__(self, versions: dict[str, str], listings: dict[tuple[str, str], str],
                 fail: Sequence[str] = ()) -> None:
        self.versions, self.listings, self.fail = versions, listings, fail
        self.calls: list[list[str]] = []

    def which(self, tool: str) -> str | None:
        return f"/usr/sbin/{tool}" if tool in self.versions else None

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv)
        tool = argv[0]
        if argv[1:] == ["--version"]:
            return subprocess.CompletedProcess(argv, 0, self.versions[tool], "")
        if argv[-1] == "-S":
            return subprocess.CompletedProcess(argv, 0, self.listings.get((tool, argv[3]), ""),
                                               "")
        failed = any(chain in argv for chain in self.fail)
        return subprocess.CompletedProcess(argv, 1 if failed else 0, "",
                                           "busy" if failed else "")


class FakeNft:
    def __init__(self, tables: str) -> None:
        self.tables, self.scripts = tables, list[str]()

    def run(self, script: str) -> str:
        self.scripts.append(script)
        return self.tables if script == "list tables" else ""


def test_each_backend_once_and_only_existing_tables(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    # iptables and iptables-nft are the same tables; ip6tables-legacy's table list is empty.
    versions = {"iptables": "iptables v1.8.9 (nf_tables)\n",
                "iptables-nft": "iptables v1.8.9 (nf_tables)\n",
                "ip6tables-legacy": "ip6tables v1.8.9 (legacy)\n"}
    tools = FakeTools(versions, {("iptables", "nat"): NAT.replace("\\\n", "")})
    legacy6 = tmp_path / "ip6_tables_names"
    legacy6.write_text("")
    monkeypatch.setitem(kc.LEGACY_TABLE_NAMES, "ip6", legacy6)
    nft = FakeNft("table ip nat\ntable ip kube-proxy\ntable ip pyproxy\ntable ip6 pyproxy\n")
    outcome = kc.cleanup_kube_proxy(nft, tools.run, tools.which)  # type: ignore[arg-type]
    listed = [c for c in tools.calls if c[-1] == "-S"]
    assert listed == [["iptables", "-w", "-t", "nat", "-S"]]  # filter/mangle: not there
    assert nft.scripts == ["list tables", "delete table ip kube-proxy"]
    assert outcome.failed == []
    assert outcome.removed[0] == "deleted nftables table ip kube-proxy"
    assert "iptables -t nat -X KUBE-SERVICES" in outcome.removed


def test_failures_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    tools = FakeTools({"iptables": "iptables v1.8.9 (nf_tables)\n"},
                      {("iptables", "nat"): NAT.replace("\\\n", "")}, fail=["KUBE-SEP-XYZ"])
    outcome = kc.cleanup_kube_proxy(FakeNft("table ip nat\n"), tools.run,  # type: ignore[arg-type]
                                    tools.which)
    assert outcome.failed == ["iptables -t nat -F KUBE-SEP-XYZ: busy",
                              "iptables -t nat -X KUBE-SEP-XYZ: busy"]
    assert "iptables -t nat -X KUBE-SERVICES" in outcome.removed


# -- the command, in a network namespace ------------------------------------------------------

TABLES = {
    "kube-proxy": "table ip kube-proxy { chain nat-prerouting { type nat hook prerouting "
                  "priority -100; }; }; table ip6 kube-proxy { set s { type ipv6_addr; }; }",
    "pyproxy": "table ip pyproxy { chain c { }; }; table ip6 pyproxy { chain c { }; }",
    "other": "table inet other { chain c { }; }",
}


def tables_in(lab: Lab, ns: str) -> set[str]:
    return {line.split(" ", 1)[1] for line in
            lab.run(ns, ["nft", "list", "tables"]).stdout.splitlines()}


@requires_netns
@pytest.mark.netns
def test_command_removes_only_kube_proxys_tables(lab: Lab) -> None:
    from testkit.controlplane import PYPROXY

    ns = lab.add_ns("node")
    lab.nft(ns, TABLES["kube-proxy"] + "; " + TABLES["other"])
    # Before pyproxy has programmed the node, the cleanup would leave it without rules.
    refused = lab.run(ns, [PYPROXY, "cleanup", "--kube-proxy"], check=False)
    assert refused.returncode == 1 and "pyproxy status" in refused.stderr
    assert tables_in(lab, ns) == {"ip kube-proxy", "ip6 kube-proxy", "inet other"}

    lab.nft(ns, TABLES["pyproxy"])
    done = lab.run(ns, [PYPROXY, "cleanup", "--kube-proxy"])
    assert done.stdout.splitlines() == ["deleted nftables table ip kube-proxy",
                                        "deleted nftables table ip6 kube-proxy"]
    assert tables_in(lab, ns) == {"ip pyproxy", "ip6 pyproxy", "inet other"}
    again = lab.run(ns, [PYPROXY, "cleanup", "--kube-proxy"])
    assert again.stdout.strip() == "nothing of kube-proxy's was left"

    # Going back: `pyproxy cleanup` removes pyproxy's own tables, and kube-proxy's stay.
    lab.nft(ns, TABLES["kube-proxy"])
    lab.run(ns, [PYPROXY, "cleanup"])
    assert tables_in(lab, ns) == {"ip kube-proxy", "ip6 kube-proxy", "inet other"}
    forced = lab.run(ns, [PYPROXY, "cleanup", "--kube-proxy", "--force"])
    assert forced.returncode == 0
    assert tables_in(lab, ns) == {"inet other"}


@requires_netns
@pytest.mark.netns
def test_nft_tables_lists_every_family(lab: Lab) -> None:
    ns = lab.add_ns("node")
    lab.nft(ns, TABLES["kube-proxy"] + "; " + TABLES["other"])
    assert kc.nft_tables(libnft_in(ns.full)) == {("ip", "kube-proxy"), ("ip6", "kube-proxy"),
                                                 ("inet", "other")}
