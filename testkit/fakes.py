"""Fakes for the I/O shells (no mocks): an in-memory nftables kernel that applies the
applier's scripts to tables it can list back (so repair, `diff` and `trace --verify` run
without a namespace), the same kernel recording every script, and a clock that moves only
when the code under test waits."""

from __future__ import annotations

import bisect
import contextlib
import copy
import math
import re
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from pyproxy.cluster.cache import ClusterCache
from pyproxy.core.model import IPFamily, NodeConfig
from pyproxy.kernel.libnftables import NftError, parse_elements, split_top_level, table_block
from pyproxy.render.staging import ElementChunk
from pyproxy.sync.node import NodeProxier, SyncObserver
from pyproxy.sync.proxier import FamilyProxier

_REFERENCE = re.compile(r"(?:jump|goto) (\S+)|@(\S+)")


@dataclass
class _Chain:
    spec: str = ""  # `type … hook … priority …; policy …;` for a base chain
    rules: list[str] = field(default_factory=list)


@dataclass
class _Set:
    kind: str  # "set" or "map"
    body: str
    elements: dict[str, str] = field(default_factory=dict)  # key → element as added


@dataclass
class _Table:
    comment: str = ""
    chains: dict[str, _Chain] = field(default_factory=dict)
    sets: dict[str, _Set] = field(default_factory=dict)

    def references(self) -> set[str]:
        """Names of the chains and sets that rules and map values refer to."""
        found: set[str] = set()
        texts = [rule for chain in self.chains.values() for rule in chain.rules]
        texts += [e for s in self.sets.values() for e in s.elements.values()]
        for text in texts:
            for match in _REFERENCE.finditer(text):
                found.add((match[1] or match[2]).rstrip(";,}"))
        return found


def element_key(element: str) -> str:
    """What identifies an element in its set or map: the text before ` : ` (a map's value)
    and before ` comment ` / ` timeout `."""
    key = element.split(" : ", 1)[0]
    for word in (" comment ", " timeout ", " expires "):
        key = key.split(word, 1)[0]
    return " ".join(key.split())


def _braced(rest: str) -> tuple[str, str]:
    """`name { body }` → (name, body); `name` → (name, "")."""
    name, _, body = rest.partition(" ")
    body = body.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    return name, body


class FakeKernel:
    """The commands the applier, staging and cleanup send, applied to in-memory tables:
    `add|delete table`, `add|flush|delete chain`, `add rule`, `add|flush|delete set|map`,
    `add|delete element`. Like the kernel, a transaction is all or nothing, and it fails
    for a missing object, a clashing element, a chain or set still referenced, or a base
    chain whose properties would change in place. Rule texts are kept as given (nft
    would normalise them). `fail_next` refuses the next transactions as the kernel
    would (the drills' /fault)."""

    def __init__(self) -> None:
        self.tables: dict[tuple[str, str], _Table] = {}
        self.fail_next = 0
        self.transactions = 0

    # --- what the applier calls (pyproxy.nft.Kernel) -----------------------------------

    def run(self, script: str) -> str:
        if self.fail_next:
            self.fail_next -= 1
            raise NftError("Error: Could not process rule: Invalid argument (injected)")
        tables = copy.deepcopy(self.tables)
        for number, line in enumerate(script.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                try:
                    self._apply(tables, line)
                except NftError as err:
                    raise NftError(f"Error: {err} (line {number}: {line[:120]})") from None
        self.tables = tables
        self.transactions += 1
        return ""

    def add_elements(self, family: str, chunk: ElementChunk) -> None:
        self.run(chunk.script(family))

    def bulk(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def renew(self) -> None:
        pass

    def list_structure(self, family: str) -> str | None:
        return table_block(self.list_ruleset(), family)

    def list_elements(self, family: str, kind: str, name: str) -> list[str] | None:
        found = self._set(family, name)
        if found is None:
            return None
        listing = "elements = { " + ", ".join(found.elements.values()) + " }"
        return parse_elements(listing) if found.elements else []

    def get_element(self, family: str, container: str, key: str) -> str | None:
        found = self._set(family, container)
        return None if found is None else found.elements.get(element_key(key))

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        table = self.tables.get((family, "pyproxy"))
        return ([], []) if table is None else (list(table.chains), list(table.sets))

    def table_comment(self, family: str) -> str | None:
        table = self.tables.get((family, "pyproxy"))
        return None if table is None else table.comment.strip('"')

    # --- for tests -----------------------------------------------------------------------

    def list_ruleset(self) -> str:
        """The tables as a terse `nft list ruleset` prints them (elements left out)."""
        lines: list[str] = []
        for (family, name), table in self.tables.items():
            lines.append(f"table {family} {name} {{")
            if table.comment:
                lines.append(f"\tcomment {table.comment}")
            for set_name, found in table.sets.items():
                lines.append(f"\t{found.kind} {set_name} {{")
                lines += [f"\t\t{p.strip()}" for p in found.body.split(";") if p.strip()]
                lines.append("\t}")
            for chain_name, chain in table.chains.items():
                lines.append(f"\tchain {chain_name} {{")
                if chain.spec:
                    lines.append(f"\t\t{chain.spec}")
                lines += [f"\t\t{rule}" for rule in chain.rules]
                lines.append("\t}")
            lines.append("}")
        return "".join(line + "\n" for line in lines)

    def _set(self, family: str, name: str) -> _Set | None:
        table = self.tables.get((family, "pyproxy"))
        return None if table is None else table.sets.get(name)

    # --- one command -----------------------------------------------------------------------

    def _apply(self, tables: dict[tuple[str, str], _Table], line: str) -> None:
        words = line.split(" ", 4)
        if len(words) < 4:
            raise NftError(f"syntax error: {line!r}")
        verb, what, family, table_name = words[:4]
        rest = words[4] if len(words) > 4 else ""
        where = (family, table_name)
        if what == "table":
            self._table(tables, verb, where, rest)
            return
        table = tables.get(where)
        if table is None:
            raise NftError(f"No such file or directory: table {family} {table_name}")
        if what == "chain":
            self._chain(table, verb, *_braced(rest))
        elif what == "rule":
            chain_name, _, rule = rest.partition(" ")
            if verb != "add" or chain_name not in table.chains:
                raise NftError(f"No such file or directory: {verb} rule in {chain_name}")
            table.chains[chain_name].rules.append(" ".join(rule.split()))
        elif what in ("set", "map"):
            self._container(table, verb, what, *_braced(rest))
        elif what == "element":
            self._element(table, verb, *_braced(rest))
        else:
            raise NftError(f"syntax error: {line!r}")

    def _table(self, tables: dict[tuple[str, str], _Table], verb: str,
               where: tuple[str, str], rest: str) -> None:
        if verb == "add":
            # as the kernel: a comment is the table's from its creation on (an `add` of a
            # table that exists leaves it as it was)
            if where not in tables:
                comment = re.search(r'comment ("[^"]*")', rest)
                tables[where] = _Table(comment=comment[1] if comment else "")
        elif verb == "delete" and where in tables:
            del tables[where]
        elif verb == "flush" and where in tables:
            for chain in tables[where].chains.values():
                chain.rules.clear()
            for found in tables[where].sets.values():
                found.elements.clear()
        else:
            raise NftError(f"No such file or directory: {verb} table {' '.join(where)}")

    def _chain(self, table: _Table, verb: str, name: str, spec: str) -> None:
        chain = table.chains.get(name)
        if verb == "add":
            if chain is None:
                table.chains[name] = _Chain(spec)
            elif spec and chain.spec != spec:
                raise NftError(f"Device or resource busy: chain {name} is {chain.spec!r}")
        elif chain is None:
            raise NftError(f"No such file or directory: {verb} chain {name}")
        elif verb == "flush":
            chain.rules.clear()
        elif verb == "delete":
            if name in table.references():
                raise NftError(f"Device or resource busy: chain {name} is still referenced")
            del table.chains[name]
        else:
            raise NftError(f"syntax error: {verb} chain")

    def _container(self, table: _Table, verb: str, kind: str, name: str, body: str) -> None:
        found = table.sets.get(name)
        if verb == "add":
            if found is None:
                table.sets[name] = _Set(kind, body)
            elif " ".join(found.body.split()) != " ".join(body.split()):
                raise NftError(f"File exists: {kind} {name} is declared otherwise")
        elif found is None:
            raise NftError(f"No such file or directory: {verb} {kind} {name}")
        elif verb == "flush":
            found.elements.clear()
        elif verb == "delete":
            if name in table.references():
                raise NftError(f"Device or resource busy: {kind} {name} is still referenced")
            del table.sets[name]
        else:
            raise NftError(f"syntax error: {verb} {kind}")

    def _element(self, table: _Table, verb: str, name: str, body: str) -> None:
        found = table.sets.get(name)
        if found is None:
            raise NftError(f"No such file or directory: set {name}")
        for element in split_top_level(body):
            key = element_key(element)
            have = found.elements.get(key)
            if verb == "add":
                if have is not None and have != element:
                    raise NftError(f"Device or resource busy: {name} holds {have!r}")
                found.elements[key] = element
            elif verb == "delete":
                if have is None:
                    raise NftError(f"No such file or directory: element {key} in {name}")
                del found.elements[key]
            else:
                raise NftError(f"syntax error: {verb} element")


class FakeNft(FakeKernel):
    """The fake kernel, recording every script it was given (`last`: the latest)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []

    def run(self, script: str) -> str:
        out = super().run(script)
        self.scripts.append(script)
        return out

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
