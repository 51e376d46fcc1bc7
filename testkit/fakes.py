"""Fakes for the I/O shells (no mocks): an in-memory nftables kernel that applies the
applier's operations to tables it can list back (so repair, `diff` and `trace --verify` run
without a namespace), the same kernel recording every script, and a clock that moves only
when the code under test waits."""

from __future__ import annotations

import bisect
import contextlib
import copy
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from pyproxy.cluster.cache import ClusterCache
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.kernel.libnftables import NftError, structure_of
from pyproxy.render import ops
from pyproxy.render.objects import (
    TABLE,
    Element,
    ElementValue,
    Key,
    Rule,
    SetDecl,
    Verdict,
    element_text,
    key_text,
)
from pyproxy.render.ops import Op, Verb
from pyproxy.render.ruleset import Structure
from pyproxy.render.staging import ElementChunk
from pyproxy.sync.node import NodeProxier, SyncObserver
from pyproxy.sync.proxier import FamilyProxier


@dataclass
class _Chain:
    base: tuple[str, str, int] | None = None  # (type, hook, priority) of a base chain
    rules: list[Rule] = field(default_factory=list)


@dataclass
class _Set:
    declaration: SetDecl
    elements: dict[Key, ElementValue] = field(default_factory=dict)


@dataclass
class _Table:
    comment: str = ""
    chains: dict[str, _Chain] = field(default_factory=dict)
    sets: dict[str, _Set] = field(default_factory=dict)

    def references(self) -> set[str]:
        """Names of the chains and sets that rules and map values refer to."""
        found: set[str] = set()
        for chain in self.chains.values():
            for rule in chain.rules:
                found.update(rule.sets(), rule.chains())
        for found_set in self.sets.values():
            found.update(value.chain for value in found_set.elements.values()
                         if isinstance(value, Verdict) and value.chain)
        return found


class FakeKernel:
    """The operations the applier, staging and cleanup send (pyproxy/render/ops.py),
    applied to in-memory tables as objects: the table, chains and their rules, sets and
    maps with their declarations and elements. Like the kernel, a transaction is all or
    nothing, and it fails for a missing object, a clashing element, a chain or set still
    referenced, a set declared otherwise, or a base chain whose properties would change in
    place. Rules are kept as given (nft would normalise their text). `fail_next` refuses the
    next transactions as the kernel would (the drills' /fault)."""

    def __init__(self) -> None:
        self.tables: dict[str, _Table] = {}  # by family: only our table is kept
        self.fail_next = 0
        self.transactions = 0
        self.element_transactions = 0  # those of them through apply_elements

    # --- what the applier calls (pyproxy.kernel.nft.Kernel) -------------------------------

    def apply(self, family: str, transaction: Sequence[Op]) -> str:
        if self.fail_next:
            self.fail_next -= 1
            raise NftError("Error: Could not process rule: Invalid argument (injected)")
        tables = copy.deepcopy(self.tables)
        for number, op in enumerate(transaction, 1):
            try:
                self._apply(tables, family, op)
            except NftError as err:
                text = ops.line(family, op)[:120]
                raise NftError(f"Error: {err} (command {number}: {text})") from None
        self.tables = tables
        self.transactions += 1
        return ops.script(family, transaction)

    def apply_elements(self, family: str, transaction: Sequence[Op],
                       declarations: Mapping[str, SetDecl]) -> str:
        """As `apply`; counted in `element_transactions`. Only element edits of declared
        sets, as the real kernel shell requires."""
        for verb, obj in transaction:
            if not isinstance(obj, ops.Elements) or verb is Verb.FLUSH \
                    or obj.set not in declarations:
                raise ValueError(f"not an element edit of a declared set: {verb} {obj}")
        script = self.apply(family, transaction)
        self.element_transactions += 1
        return script

    def add_elements(self, family: str, chunk: ElementChunk) -> None:
        self.apply(family, chunk.ops())

    def bulk(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def renew(self) -> None:
        pass

    def list_structure(self, family: str) -> Structure | None:
        return structure_of(self.list_ruleset(), family)

    def list_elements(self, family: str, kind: str, name: str) -> list[Element] | None:
        found = self._set(family, name)
        return None if found is None else list(found.elements.items())

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        table = self.tables.get(family)
        return ([], []) if table is None else (list(table.chains), list(table.sets))

    def table_comment(self, family: str) -> str | None:
        table = self.tables.get(family)
        return None if table is None else table.comment

    # --- for tests -----------------------------------------------------------------------

    def list_ruleset(self) -> dict[str, Any]:
        """The tables as a terse `nft -j list ruleset` lists them (no elements; a rule's
        expression is its nft text here, where nft would give its JSON form)."""
        out: list[dict[str, Any]] = [{"metainfo": {"json_schema_version": 1}}]
        for family, table in self.tables.items():
            where = {"family": family, "table": TABLE}
            out.append({"table": {"family": family, "name": TABLE, "handle": 1}})
            for set_name, found in table.sets.items():
                declaration = found.declaration
                out.append({declaration.kind: {**where, "name": set_name,
                                               "type": list(declaration.key_types),
                                               "flags": list(declaration.flags)}})
            for chain_name, chain in table.chains.items():
                base = {} if chain.base is None else dict(zip(
                    ("type", "hook", "prio"), chain.base, strict=True), policy="accept")
                out.append({"chain": {**where, "name": chain_name, **base}})
            for chain_name, chain in table.chains.items():
                out += [{"rule": {**where, "chain": chain_name, "expr": rule.text()}}
                        for rule in chain.rules]
        return {"nftables": out}

    def _set(self, family: str, name: str) -> _Set | None:
        table = self.tables.get(family)
        return None if table is None else table.sets.get(name)

    # --- one operation -----------------------------------------------------------------------

    def _apply(self, tables: dict[str, _Table], family: str, op: Op) -> None:
        verb, obj = op
        if isinstance(obj, ops.Table):
            self._table(tables, verb, family, obj)
            return
        table = tables.get(family)
        if table is None:
            raise NftError(f"No such file or directory: table {family} {TABLE}")
        if isinstance(obj, ops.Chain):
            self._chain(table, verb, obj)
        elif isinstance(obj, ops.Rule):
            if verb is not Verb.ADD or obj.chain not in table.chains:
                raise NftError(f"No such file or directory: {verb} rule in {obj.chain}")
            table.chains[obj.chain].rules.append(obj.rule)
        elif isinstance(obj, ops.Set):
            self._container(table, verb, obj)
        else:
            self._elements(table, verb, obj)

    def _table(self, tables: dict[str, _Table], verb: Verb, family: str,
               obj: ops.Table) -> None:
        if verb is Verb.ADD:
            # as the kernel: a comment is the table's from its creation on (an `add` of a
            # table that exists leaves it as it was)
            if family not in tables:
                tables[family] = _Table(comment=obj.comment)
        elif verb is Verb.DELETE and family in tables:
            del tables[family]
        elif verb is Verb.FLUSH and family in tables:
            for chain in tables[family].chains.values():
                chain.rules.clear()
            for found in tables[family].sets.values():
                found.elements.clear()
        else:
            raise NftError(f"No such file or directory: {verb} table {family} {TABLE}")

    def _chain(self, table: _Table, verb: Verb, obj: ops.Chain) -> None:
        chain = table.chains.get(obj.name)
        if verb is Verb.ADD:
            if chain is None:
                table.chains[obj.name] = _Chain(obj.base)
            elif obj.base is not None and chain.base != obj.base:
                raise NftError(f"Device or resource busy: chain {obj.name} is {chain.base}")
        elif chain is None:
            raise NftError(f"No such file or directory: {verb} chain {obj.name}")
        elif verb is Verb.FLUSH:
            chain.rules.clear()
        else:
            if obj.name in table.references():
                raise NftError(f"Device or resource busy: chain {obj.name} is still "
                               "referenced")
            del table.chains[obj.name]

    def _container(self, table: _Table, verb: Verb, obj: ops.Set) -> None:
        found = table.sets.get(obj.name)
        if verb is Verb.ADD:
            if obj.declaration is None:
                raise NftError(f"syntax error: set {obj.name} without a declaration")
            if found is None:
                table.sets[obj.name] = _Set(obj.declaration)
            elif found.declaration != obj.declaration:
                raise NftError(f"File exists: {obj.declaration.kind} {obj.name} is declared "
                               "otherwise")
        elif found is None:
            raise NftError(f"No such file or directory: {verb} set {obj.name}")
        elif verb is Verb.FLUSH:
            found.elements.clear()
        else:
            if obj.name in table.references():
                raise NftError(f"Device or resource busy: set {obj.name} is still referenced")
            del table.sets[obj.name]

    def _elements(self, table: _Table, verb: Verb, obj: ops.Elements) -> None:
        found = table.sets.get(obj.set)
        if found is None:
            raise NftError(f"No such file or directory: set {obj.set}")
        for key, value in obj.elements:
            have = found.elements.get(key)
            if verb is Verb.ADD:
                if have is not None and have != value:
                    raise NftError(f"Device or resource busy: {obj.set} holds "
                                   f"{element_text(key, have)!r}")
                found.elements[key] = value
            elif verb is Verb.DELETE:
                if have is None:
                    raise NftError(f"No such file or directory: element {key_text(key)} in "
                                   f"{obj.set}")
                del found.elements[key]
            else:
                raise NftError(f"syntax error: {verb} element")


class FakeNft(FakeKernel):
    """The fake kernel, recording every transaction it took as the script it writes
    (`last`: the latest)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []

    def apply(self, family: str, transaction: Sequence[Op]) -> str:
        script = super().apply(family, transaction)
        self.scripts.append(script)
        return script

    @property
    def last(self) -> str:
        return self.scripts[-1] if self.scripts else ""


def fake_node_proxier(nft: FakeNft | None = None, observers: Sequence[SyncObserver] = (),
                      ) -> tuple[NodeProxier, FakeNft, list[int]]:
    """node-a (192.168.50.1, IPv4) on the recording fake kernel, expecting the Service and
    EndpointSlice lists (not yet complete), its syncs heard by `observers`; the list counts
    the syncs it asked for."""
    nft = nft or FakeNft()
    requests: list[int] = []
    proxier = NodeProxier(
        ClusterCache("node-a"),
        [FamilyProxier(IPFamily.IPv4, NodeConfig("node-a", node_ips=("192.168.50.1",)), nft)],
        request_sync=lambda: requests.append(1), observers=list(observers))
    for source in ("Service", "EndpointSlice"):
        proxier.expect(source)
    return proxier, nft, requests


class FakeClock:
    """Time that moves only when the code under test waits or a fake sync takes time.

    Like trio's autojump MockClock: `wait(cond, timeout)` jumps straight to the deadline, or to
    the next scripted instant if that comes first, fires its events and returns as a notify
    would.
    Events run inside the runner's wait (the runner's lock is re-entrant, so they may call
    `run()`).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def at(self, when: float, action: Callable[[], None]) -> None:
        bisect.insort(self._events, (when, len(self._events), action), key=lambda e: e[:2])

    def advance(self, seconds: float) -> None:
        """Let time pass (a sync that takes a while), firing the events that fall inside."""
        target = self.now + seconds
        while self._events and self._events[0][0] <= target:
            self._fire_next()
        self.now = target

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        deadline = math.inf if timeout is None else self.now + timeout
        if self._events and self._events[0][0] <= deadline:
            # Everything scheduled for the same instant happens before the runner looks again.
            first = self._events[0][0]
            while self._events and self._events[0][0] == first:
                self._fire_next()
            return
        assert deadline < math.inf, "the runner would block forever with nothing scripted"
        self.now = deadline

    def _fire_next(self) -> None:
        when, _, action = self._events.pop(0)
        self.now = max(self.now, when)
        action()
