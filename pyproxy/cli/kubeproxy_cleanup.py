"""`pyproxy cleanup --kube-proxy`: remove what kube-proxy leaves behind when a node moves to
pyproxy, and nothing else.

- nftables mode: its tables, `table ip kube-proxy` and `table ip6 kube-proxy`.
- iptables and ipvs modes: its chains in the `nat`, `filter` and `mangle` tables of every
  iptables backend in use (nf_tables and legacy, IPv4 and IPv6), with the rules elsewhere that
  jump to them.

Only kube-proxy's own chain names are touched, the ones its own cleanup (`kube-proxy
--cleanup`, v1.37) removes: the kubelet's `KUBE-FIREWALL`, `KUBE-KUBELET-CANARY` and
`KUBE-IPTABLES-HINT`, and other software's `KUBE-*` chains (kube-router's `KUBE-ROUTER-*`,
`KUBE-POD-FW-*`, `KUBE-NWPLCY-*` hold network policies) stay. The ipvs mode's IPVS virtual
servers, `kube-ipvs0` device and ipsets are not removed (`kube-proxy --cleanup` does that).

Listing an iptables table that does not exist may create it (iptables-nft) or load kernel
modules (legacy), so a table is only listed when it is there already.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pyproxy.kernel.libnftables import LibNftables, NftError

KUBE_PROXY_TABLE = "kube-proxy"
NFT_FAMILIES = ("ip", "ip6")

# kube-proxy's fixed chains per iptables table: iptables mode (pkg/proxy/iptables) and ipvs
# mode (pkg/proxy/ipvs), as their CleanupLeftovers list them.
KUBE_PROXY_CHAINS: dict[str, frozenset[str]] = {
    "nat": frozenset({"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
                      "KUBE-PROXY-CANARY", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"}),
    "filter": frozenset({"KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD",
                         "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY",
                         "KUBE-NODE-PORT", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER",
                         "KUBE-IPVS-OUT-FILTER"}),
    "mangle": frozenset({"KUBE-PROXY-CANARY"}),
}
# The iptables mode's chains per service and endpoint, in the nat table (KUBE-XLB-: the
# externalTrafficPolicy: Local chains of releases before v1.24).
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-",
                          "KUBE-XLB-")

# `iptables` and `ip6tables` are whichever backend the distribution chose; the explicit names
# reach the other one. Tools of the same family and backend are the same tables.
IPTABLES_TOOLS = ("iptables", "ip6tables", "iptables-nft", "ip6tables-nft", "iptables-legacy",
                  "ip6tables-legacy")
LEGACY_TABLE_NAMES = {"ip": Path("/proc/net/ip_tables_names"),
                      "ip6": Path("/proc/net/ip6_tables_names")}

Run = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=60)


@dataclass
class Outcome:
    """What the cleanup removed, and what it could not (one line each)."""

    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def is_kube_proxy_chain(table: str, chain: str) -> bool:
    if chain in KUBE_PROXY_CHAINS.get(table, ()):
        return True
    return table == "nat" and chain.startswith(SERVICE_CHAIN_PREFIXES)


def iptables_commands(table: str, listing: str) -> list[list[str]]:
    """The iptables arguments (after `-t TABLE`) that remove kube-proxy's chains from one
    table, given `iptables -t TABLE -S`: first the rules of other chains that jump or go to
    them (a referenced chain cannot be deleted), then flush them all (they reference each
    other), then delete them."""
    rules = [shlex.split(line) for line in listing.splitlines() if line.strip()]
    doomed = sorted(r[1] for r in rules
                    if len(r) > 1 and r[0] == "-N" and is_kube_proxy_chain(table, r[1]))
    commands = [["-D", *rule[1:]] for rule in rules
                if len(rule) > 1 and rule[0] == "-A" and rule[1] not in doomed
                and _target(rule) in doomed]
    commands += [["-F", chain] for chain in doomed]
    commands += [["-X", chain] for chain in doomed]
    return commands


def _target(rule: list[str]) -> str | None:
    for flag in ("-j", "--jump", "-g", "--goto"):
        if flag in rule[:-1]:
            return rule[rule.index(flag) + 1]
    return None


def cleanup_kube_proxy(nft: LibNftables | None = None, run: Run = _run,
                       which: Callable[[str], str | None] = shutil.which) -> Outcome:
    """Remove kube-proxy's nftables tables and iptables chains in this network namespace.
    Missing pieces are not errors; commands that fail are reported in `failed`."""
    nft = nft or LibNftables()
    outcome = Outcome()
    tables = nft_tables(nft)
    for family in NFT_FAMILIES:
        if (family, KUBE_PROXY_TABLE) not in tables:
            continue
        try:
            nft.run(f"delete table {family} {KUBE_PROXY_TABLE}")
            outcome.removed.append(f"deleted nftables table {family} {KUBE_PROXY_TABLE}")
        except NftError as err:
            outcome.failed.append(f"nftables table {family} {KUBE_PROXY_TABLE}: {err}")
    for tool, family, backend in iptables_backends(run, which):
        for table in KUBE_PROXY_CHAINS:
            if _iptables_table_exists(family, backend, table, tables):
                _clean_iptables_table(tool, table, run, outcome)
    return outcome


def nft_tables(nft: LibNftables) -> set[tuple[str, str]]:
    """(family, name) of every nftables table in this network namespace."""
    listing = nft.run("list tables")
    return {(words[1], words[2]) for words in (line.split() for line in listing.splitlines())
            if len(words) == 3 and words[0] == "table"}


def iptables_backends(run: Run = _run, which: Callable[[str], str | None] = shutil.which,
                      ) -> list[tuple[str, str, str]]:
    """(tool, family, backend) for each distinct family and backend ("nf_tables" or
    "legacy") an installed iptables tool reaches."""
    found: dict[tuple[str, str], str] = {}
    for tool in IPTABLES_TOOLS:
        if which(tool) is None:
            continue
        version = run([tool, "--version"])
        if version.returncode != 0:
            continue
        # iptables >= 1.8 names its backend; older ones only had the legacy one.
        backend = "nf_tables" if "nf_tables" in version.stdout else "legacy"
        family = "ip6" if tool.startswith("ip6") else "ip"
        found.setdefault((family, backend), tool)
    return [(tool, family, backend) for (family, backend), tool in found.items()]


def _iptables_table_exists(family: str, backend: str, table: str,
                           nft_tables_present: set[tuple[str, str]]) -> bool:
    if backend == "nf_tables":
        return (family, table) in nft_tables_present
    try:
        return table in LEGACY_TABLE_NAMES[family].read_text().split()
    except OSError:  # x_tables not loaded: no legacy table at all
        return False


def _clean_iptables_table(tool: str, table: str, run: Run, outcome: Outcome) -> None:
    listing = run([tool, "-w", "-t", table, "-S"])
    if listing.returncode != 0:
        outcome.failed.append(f"{tool} -t {table} -S: {listing.stderr.strip()}")
        return
    for command in iptables_commands(table, listing.stdout):
        done = run([tool, "-w", "-t", table, *command])
        text = f"{tool} -t {table} {shlex.join(command)}"
        if done.returncode == 0:
            if command[0] != "-F":  # flushing is a step of deleting, not worth a line
                outcome.removed.append(text)
        else:
            outcome.failed.append(f"{text}: {done.stderr.strip()}")


def pyproxy_tables_present(nft: LibNftables | None = None) -> bool:
    """Whether pyproxy has programmed this network namespace (a table of either family)."""
    from pyproxy.render.objects import TABLE

    tables = nft_tables(nft or LibNftables())
    return any((family, TABLE) in tables for family in NFT_FAMILIES)
