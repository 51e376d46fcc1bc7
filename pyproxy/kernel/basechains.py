"""Reading other tables' base chains, and the check that runs on it (core/coexistence.py
decides). Never the whole ruleset: `list chains` (names, hooks, priorities and policies; no
rules, no elements) and then the rules of only the base chains at the hooks pyproxy's
traffic crosses, to see how each ends. Docker's, firewalld's or kube-proxy's chains hold a
handful of rules each; a ruleset with 10,000 services' elements is never read.

When: at start, after every change to another table's chains or rules (nftables change
events, kernel/nftevents.py; at most one check per `min_interval`, since kube-proxy's syncs
or a firewall reload come as bursts) and every `period` in case events are unavailable.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from pyproxy.core.coexistence import (
    BREAKS,
    OWN_TABLE,
    BaseChain,
    Finding,
    base_chain,
    base_chains,
    chain_ending,
    findings,
)
from pyproxy.core.model import IPFamily
from pyproxy.kernel.libnftables import new_context

log = structlog.get_logger(__name__)


def read_base_chains(factory: Callable[[], Any] = new_context) -> tuple[BaseChain, ...]:
    """The base chains of this network namespace, with how each relevant one ends. A chain
    gone between the two listings is left out (the change that removed it asks again)."""
    ctx = factory()
    ctx.set_json_output(True)
    chains = base_chains(_listing(ctx, "list chains"))
    out = []
    for chain in chains:
        if chain.get("hook") not in BREAKS or chain.get("table") == OWN_TABLE:
            out.append(base_chain(chain, (None, False)))
            continue
        # JSON commands: any table or chain name (nft's parser takes no quoted names, and
        # some names are keywords to it)
        rc, rules, _ = ctx.json_cmd({"nftables": [{"list": {"chain": {
            "family": chain["family"], "table": chain["table"], "name": chain["name"]}}}]})
        if rc == 0:
            out.append(base_chain(chain, chain_ending(rules)))
    return tuple(out)


def _listing(ctx: Any, command: str) -> Any:
    rc, out, err = ctx.cmd(command)
    if rc != 0:
        raise OSError(f"nft {command}: {str(err).strip()}")
    return json.loads(str(out) or "{}")


@dataclass
class CoexistenceCheck:
    """Finds other tables' base chains that drop what pyproxy accepts; logs each change of
    the findings (`other_table_drops`, a warning per chain; `other_table_drops_cleared`)
    and hands them to `on_findings` (the metric). `findings` is what `status` and `explain`
    show."""

    families: tuple[IPFamily, ...]
    on_findings: Callable[[tuple[Finding, ...]], None] = lambda found: None
    read: Callable[[], tuple[BaseChain, ...]] = read_base_chains
    min_interval: float = 2.0
    period: float = 60.0
    findings: tuple[Finding, ...] = ()
    _wanted: threading.Event = field(default_factory=threading.Event)

    def request(self) -> None:
        """Another table's chains or rules changed: check again (soon, not at once)."""
        self._wanted.set()

    def check(self) -> tuple[Finding, ...]:
        found = findings(self.read(), self.families)
        if found != self.findings:
            _log_change(self.findings, found)
            self.findings = found
        self.on_findings(found)
        return found

    def run(self, stop: threading.Event) -> None:
        while True:
            try:
                self.check()
            except (OSError, ValueError, KeyError) as err:  # no nft, odd JSON: try later
                log.warning("other_tables_unreadable", error=str(err))
            if stop.wait(self.min_interval):
                return
            self._wanted.wait(self.period)
            self._wanted.clear()
            if stop.is_set():  # stopped while waiting: no check of a node being left
                return

    def start(self, stop: threading.Event) -> None:
        threading.Thread(target=self.run, args=(stop,), name="coexistence",
                         daemon=True).start()


def _log_change(before: Iterable[Finding], after: tuple[Finding, ...]) -> None:
    known = {f.chain.label for f in before}
    for finding in after:
        if finding.chain.label not in known:
            c = finding.chain
            log.warning("other_table_drops", family=c.family, table=c.table, chain=c.name,
                        hook=c.hook, priority=c.priority, drops=finding.drops,
                        breaks=BREAKS[c.hook],
                        fix="docs/deploying.md, \"Other firewalls on the node\"")
    if known and not after:
        log.info("other_table_drops_cleared")
