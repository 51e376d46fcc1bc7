"""Other tables' base chains that can drop what pyproxy accepts (issue 27, point 7).

In nftables every base chain of a hook runs, table after table: an `accept` ends only its own
chain, while a `drop` anywhere is final. So a firewall's base chain at a hook pyproxy's
traffic passes — a `policy drop` forward chain (Docker's iptables backend sets one on
`table ip filter`'s FORWARD when it enables forwarding), a chain ending in an unconditional
`reject` (firewalld's `filter_FORWARD` and `filter_INPUT`) — drops NodePort and ClusterIP
connections pyproxy has DNATed, and nothing pyproxy puts in its own table can prevent it.

Whether that chain's other rules accept pyproxy's traffic first cannot be decided without
evaluating arbitrary rules; one shape can: an unconditional `ct status dnat accept` (what
firewalld has, and what the docs recommend adding) accepts every connection pyproxy DNATed,
in a chain that runs after DNAT. Such a chain is not reported.

Pure: the chains' description in (`BaseChain`, parsed from `nft -j` listings by
`base_chains` and `chain_ending`), findings out. kernel/basechains.py reads the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyproxy.core.model import IPFamily

# pyproxy's own tables (render/objects.TABLE in each family): never a finding.
OWN_TABLE = "pyproxy"
NAT_PRIORITY = -100  # DNAT in prerouting and output (ours and kube-proxy's)

# The hooks pyproxy's connections cross, and which of them a drop there breaks.
BREAKS: dict[str, str] = {
    "prerouting": "every connection arriving for a NodePort, ClusterIP, external or "
                  "load-balancer IP",
    "forward": "connections DNATed to pods: NodePorts, external and load-balancer IPs from "
               "outside, ClusterIPs from pods",
    "input": "connections DNATed to host-network endpoints on this node",
    "output": "this node's own connections to Services",
    "postrouting": "connections this node forwards or makes to Services",
}
# Statements that do not make a rule conditional: a rule of only these and a verdict applies
# to every packet that reaches it.
_UNCONDITIONAL = frozenset({"counter", "log", "comment"})
_FAMILIES = {"ip": (IPFamily.IPv4,), "ip6": (IPFamily.IPv6,),
             "inet": (IPFamily.IPv4, IPFamily.IPv6)}


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseChain:
    """One base chain of the node's ruleset, as much of it as the decision needs."""

    family: str  # ip | ip6 | inet | bridge | netdev | arp
    table: str
    name: str
    type: str  # filter | nat | route
    hook: str
    priority: int
    policy: str  # accept | drop
    final_verdict: str | None = None
    """"drop" or "reject" when the chain's last rule drops every packet that reaches it;
    None when it has no such rule (or its rules were not read)."""
    accepts_dnat: bool = False
    """A rule before any final drop accepts every DNATed connection (`ct status dnat
    accept`, unconditional)."""

    @property
    def label(self) -> str:
        return f"{self.family} {self.table} {self.name}"


@dataclass(frozen=True, slots=True)
class Finding:
    """A base chain of another table that drops what its rules do not accept, at a hook
    pyproxy's connections cross."""

    chain: BaseChain
    drops: str  # "policy drop" | "a final drop rule" | "a final reject rule"

    def text(self) -> str:
        c = self.chain
        return (f"table {c.family} {c.table}, chain {c.name} ({c.type} hook {c.hook} priority "
                f"{c.priority}) has {self.drops}: it drops what its own rules do not accept, "
                f"whatever pyproxy accepts — {BREAKS[c.hook]} (docs/deploying.md, \"Other "
                "firewalls on the node\")")

    def as_dict(self) -> dict[str, Any]:
        c = self.chain
        return {"family": c.family, "table": c.table, "chain": c.name, "type": c.type,
                "hook": c.hook, "priority": c.priority, "drops": self.drops,
                "breaks": BREAKS[c.hook], "text": self.text()}


def findings(chains: Iterable[BaseChain], families: Iterable[IPFamily]) -> tuple[Finding, ...]:
    """The chains that can drop pyproxy's connections on a node proxying `families`, in a
    stable order. Not reported: pyproxy's own tables, other families (bridge, netdev, arp,
    or ip6 on an IPv4-only node), hooks pyproxy's traffic does not cross, chains that drop
    nothing unconditionally, and chains that accept every DNATed connection first (after
    DNAT only: a prerouting or output chain before priority -100 sees none yet)."""
    wanted = set(families)
    out = []
    for chain in chains:
        if chain.table == OWN_TABLE and chain.family in ("ip", "ip6"):
            continue
        if chain.hook not in BREAKS or not wanted & set(_FAMILIES.get(chain.family, ())):
            continue
        drops = _drops(chain)
        if drops is None or (chain.accepts_dnat and _after_dnat(chain)):
            continue
        out.append(Finding(chain, drops))
    return tuple(sorted(out, key=lambda f: (f.chain.family, f.chain.table, f.chain.name)))


def _drops(chain: BaseChain) -> str | None:
    if chain.policy == "drop":
        return "policy drop"
    if chain.final_verdict is not None:
        return f"a final {chain.final_verdict} rule"
    return None


def _after_dnat(chain: BaseChain) -> bool:
    return chain.hook in ("forward", "input", "postrouting") or chain.priority > NAT_PRIORITY


# ---------------------------------------------------------------------------------------------
# `nft -j` listings (libnftables JSON, schema 1) to BaseChain


def base_chains(listing: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The base chains of a `list chains` answer (regular chains have no hook)."""
    return [obj["chain"] for obj in listing.get("nftables", ())
            if isinstance(obj, dict) and "chain" in obj and "hook" in obj["chain"]]


def chain_ending(listing: Mapping[str, Any]) -> tuple[str | None, bool]:
    """From a `list chain` answer: (the final verdict of a last rule that drops every packet
    reaching it, or None; whether an unconditional `ct status dnat accept` comes first)."""
    rules = [obj["rule"].get("expr", []) for obj in listing.get("nftables", ())
             if isinstance(obj, dict) and "rule" in obj]
    final = _final_verdict(rules[-1]) if rules else None
    body = rules[:-1] if final is not None else rules
    return final, any(_accepts_dnat(expr) for expr in body)


def base_chain(chain: Mapping[str, Any], ending: tuple[str | None, bool]) -> BaseChain:
    return BaseChain(family=str(chain["family"]), table=str(chain["table"]),
                     name=str(chain["name"]), type=str(chain.get("type", "")),
                     hook=str(chain["hook"]), priority=int(chain.get("prio", 0)),
                     policy=str(chain.get("policy", "accept")), final_verdict=ending[0],
                     accepts_dnat=ending[1])


def _statements(expr: Sequence[Any]) -> list[str]:
    return [next(iter(e)) for e in expr if isinstance(e, dict) and e]


def _final_verdict(expr: Sequence[Any]) -> str | None:
    names = _statements(expr)
    if names and names[-1] in ("drop", "reject") and set(names[:-1]) <= _UNCONDITIONAL:
        return names[-1]
    return None


def _accepts_dnat(expr: Sequence[Any]) -> bool:
    """`ct status dnat accept` (with counters or a log at most)."""
    names = _statements(expr)
    if not names or names[-1] != "accept":
        return False
    matches = [e["match"] for e in expr if isinstance(e, dict) and "match" in e]
    if len(matches) != 1 or not set(names[:-1]) - {"match"} <= _UNCONDITIONAL:
        return False
    match = matches[0]
    right = match.get("right")
    values = right if isinstance(right, list) else [right]
    return (match.get("left") == {"ct": {"key": "status"}} and match.get("op") in ("in", "==")
            and values == ["dnat"])
