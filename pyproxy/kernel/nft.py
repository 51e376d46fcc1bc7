"""The libnftables shell: runs transactions in the current network namespace and keeps the
in-memory mirror of what was committed, so a partial sync never reads the kernel back."""

from __future__ import annotations

import contextlib
import difflib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from pyproxy.core.plan import SyncFacts, SyncPlan, plan_sync
from pyproxy.kernel import nlelements
from pyproxy.render import staging
from pyproxy.render.objects import TABLE, Fragment, Kind
from pyproxy.render.ruleset import (
    Change,
    Commands,
    DesiredState,
    Shape,
    full_commands,
    incremental_commands,
    table_shape,
)

log = structlog.get_logger(__name__)

# Chains left without references are deleted this long after they were flushed: on kernels
# before 6.2 the kernel notices a chain is unreferenced only a short time after the vmap
# element that used it was deleted, and an immediate delete fails with EBUSY
# (kubernetes#122604).
STALE_CHAIN_GRACE = 1.0


class NftError(RuntimeError):
    """The kernel or libnftables refused a transaction; nothing of it was applied."""


class Kernel(Protocol):
    """What the applier needs from the kernel's nftables: `LibNftables` in production, the
    stateful fake (testkit/fakes.py) where no namespace is needed. Every method names our
    table by family; listings return None where the object does not exist."""

    def run(self, script: str) -> str:
        """Commit `script` as one transaction (all or nothing); NftError if refused."""
        ...

    def add_elements(self, family: str, chunk: staging.ElementChunk) -> None:
        """Add elements to sets and maps that nothing references yet, as one transaction
        (all or nothing; NftError if refused)."""
        ...

    def renew(self) -> None:
        """Drop whatever the connection caches of the table (after a full sync)."""
        ...

    def bulk(self) -> AbstractContextManager[None]:
        """A bulk of our own writes inside (a staged full sync): not announced to our own
        change listener, which compares the structure after instead."""
        ...

    def list_structure(self, family: str) -> str | None:
        """Our table as a terse listing: chains, rules, set declarations, no elements."""
        ...

    def list_elements(self, family: str, kind: str, name: str) -> list[str] | None:
        """The elements of one set or map as nft prints them."""
        ...

    def get_element(self, family: str, container: str, key: str) -> str | None:
        """One element as the kernel holds it."""
        ...

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        """Names of our table's chains and of its sets and maps (empty: no table)."""
        ...


class FaultyKernel:
    """A kernel that refuses the next `fail_next` sync transactions before they reach
    `inner`, as if the kernel did: the debug socket's /fault, for the drills
    (docs/drills.md). Installed in front of an applier's kernel only when a fault is
    asked for; everything else goes to `inner`. The deletion of stale chains (a transaction
    of its own, before a sync's) is let through: refused, it is only counted and retried,
    and it would take the fault meant for the sync."""

    def __init__(self, inner: Kernel) -> None:
        self.inner = inner
        self.fail_next = 0

    def run(self, script: str) -> str:
        if self.fail_next > 0 and script and not _only_chain_deletions(script):
            self._fail()
        return self.inner.run(script)

    def add_elements(self, family: str, chunk: staging.ElementChunk) -> None:
        if self.fail_next > 0:
            self._fail()
        self.inner.add_elements(family, chunk)

    def _fail(self) -> None:
        self.fail_next -= 1
        raise NftError("injected fault: transaction refused (debug socket /fault)")

    def renew(self) -> None:
        self.inner.renew()

    def bulk(self) -> AbstractContextManager[None]:
        return self.inner.bulk()

    def list_structure(self, family: str) -> str | None:
        return self.inner.list_structure(family)

    def list_elements(self, family: str, kind: str, name: str) -> list[str] | None:
        return self.inner.list_elements(family, kind, name)

    def get_element(self, family: str, container: str, key: str) -> str | None:
        return self.inner.get_element(family, container, key)

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        return self.inner.list_names(family)


def _only_chain_deletions(script: str) -> bool:
    return all(line.startswith("delete chain ") for line in script.splitlines() if line)


def inject_faults(applier: Applier, count: int) -> int:
    """Make `applier`'s next `count` non-empty transactions fail (0: none); returns the
    count now pending."""
    if not isinstance(applier.nft, FaultyKernel):
        applier.nft = FaultyKernel(applier.nft)
    applier.nft.fail_next = count
    return count


def pending_faults(applier: Applier) -> int:
    return applier.nft.fail_next if isinstance(applier.nft, FaultyKernel) else 0


def _new_context() -> Any:
    import nftables  # Debian's binding, matching the installed libnftables

    ctx = nftables.Nftables()
    ctx.set_echo_output(False)
    return ctx


NETLINK_NETFILTER = 12


class OwnSockets:
    """The netlink port ids of this process's libnftables transaction contexts. The kernel
    stamps every nftables change event with the port id of the socket that committed it, so
    an event carrying one of these is our own commit (pyproxy/kernel/nftevents.py). Process-wide,
    as sockets are. A replaced context's ids stay known a little longer: the events of its
    last commit may still be on their way to the listener when it is closed."""

    RETIRED_KEPT = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[int, tuple[int, ...]] = {}  # id(owner) → its context's ids
        self._retired: deque[int] = deque(maxlen=self.RETIRED_KEPT)
        self._listeners: list[Callable[[], None]] = []
        self._bulk_listeners: list[Callable[[bool], None]] = []

    def replace(self, owner: object, portids: Iterable[int]) -> None:
        """`owner`'s transaction context is now the one with these port ids. Listeners hear
        of it before the context commits anything."""
        with self._lock:
            self._retired.extend(self._current.get(id(owner), ()))
            self._current[id(owner)] = tuple(portids)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def subscribe_bulk(self, listener: Callable[[bool], None]) -> None:
        """`listener(True)` before a bulk of our own writes, `listener(False)` after it."""
        with self._lock:
            self._bulk_listeners.append(listener)

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Our writes inside are too many to announce. While anyone listens to the change
        events, the kernel builds one for every element committed, even though the
        listener's filter then drops ours: a quarter of the kernel time of a 10k-service
        cold start (measured: 0.52 → 0.78 s). The listeners stop listening meanwhile and,
        since someone else's change would have gone unheard, have the structure compared
        after."""
        with self._lock:
            listeners = list(self._bulk_listeners)
        for listener in listeners:
            listener(True)
        try:
            yield
        finally:
            for listener in listeners:
                listener(False)

    def current(self) -> frozenset[int]:
        """The port ids of the contexts in use."""
        with self._lock:
            return frozenset(p for ids in self._current.values() for p in ids)

    def __contains__(self, portid: object) -> bool:
        with self._lock:
            return any(portid in ids for ids in self._current.values()) \
                or portid in self._retired


OWN_SOCKETS = OwnSockets()


def netfilter_sockets() -> dict[int, int]:
    """This process's NETLINK_NETFILTER sockets: file descriptor → port id (0: not bound
    yet; the kernel binds a socket when it first sends)."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(int(name)))  # learns family and protocol
        except OSError:
            continue  # closed meanwhile, or not a socket Python can wrap
        with probe:
            if probe.family == socket.AF_NETLINK and probe.proto == NETLINK_NETFILTER:
                found[int(name)] = int(probe.getsockname()[0])
    return found


class _Commit:
    """One netlink batch of elements, committed now or (`background`) by a thread of its
    own (LibNftables.add_elements): `wait()` returns what the commit raised, if anything."""

    def __init__(self, sock: socket.socket, batch: nlelements.Batch, family: str,
                 loads: tuple[nlelements.Load, ...], background: bool) -> None:
        self.family = family
        self.loads = loads
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._commit, args=(sock, batch),
                                            name="netlink-commit", daemon=True)
            self._thread.start()
        else:
            self._commit(sock, batch)

    def _commit(self, sock: socket.socket, batch: nlelements.Batch) -> None:
        try:
            nlelements.commit(sock, batch)
        except BaseException as err:  # handed to the caller's thread by wait()
            self._error = err

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
        return self._error


class LibNftables:
    """libnftables through the Python binding. Text input: half the size of JSON, faster to
    load and to render (docs/nft-layout.md).

    Measured with libnftables 1.0.6 at 10k services: a context that has seen a large cache
    (after loading the whole table, or after a listing) refreshes all of it, set elements
    included, on its next transaction (~0.5 s). So transactions go through one context that
    is renewed after every full sync, and listings use throwaway contexts. `list table` is
    slow for the same reason (it fetches every element even with --terse: ~4 s at 10k),
    while a terse `list ruleset` is not (~40 ms): that is what the structure checks read.
    `factory` makes contexts (tests bind them to a network namespace).

    The transaction context's netlink port id goes into `sockets`, so that the change events
    of our own commits are told from someone else's.

    `netlink` makes the raw netlink socket that the elements of staged full syncs go
    through (pyproxy/kernel/nlelements.py), in the namespace the contexts talk to: by
    default the current one with the default factory; with another factory, none unless
    given (then libnftables adds them too)."""

    def __init__(self, factory: Callable[[], Any] = _new_context,
                 sockets: OwnSockets = OWN_SOCKETS,
                 netlink: Callable[[], socket.socket] | None = None) -> None:
        self._factory = factory
        self._sockets = sockets
        if netlink is None and factory is _new_context:
            netlink = nlelements.netlink_socket
        self._netlink = netlink() if netlink is not None else None
        self._pipelined = False
        self._in_flight: _Commit | None = None
        self._nft = self._writer()

    def _writer(self) -> Any:
        """A transaction context, its socket's port id registered. libnftables opens the
        socket with the context but the kernel assigns the port id only when it first sends:
        a small read makes it do so before any commit. `list flowtables` (there are none):
        `list tables` would mark the context's cache as a full one, and its first transaction
        would then fetch every element (~0.3 s at 10k services). Sockets other threads open
        meanwhile may be registered too; none of them writes nftables."""
        before = netfilter_sockets()
        ctx = self._factory()
        with contextlib.suppress(Exception):  # no table access: the commits will say so
            ctx.cmd("list flowtables")
        opened = {fd: portid for fd, portid in netfilter_sockets().items()
                  if fd not in before and portid}
        own = [] if self._netlink is None else [int(self._netlink.getsockname()[0])]
        self._sockets.replace(self, [*opened.values(), *own])
        return ctx

    def run(self, script: str) -> str:
        self._settle()  # transactions in the order they were asked for
        rc, out, err = self._nft.cmd(script)
        if rc != 0:
            raise NftError(_first_lines(err or out or f"nft exited {rc}"))
        return str(out)

    def add_elements(self, family: str, chunk: staging.ElementChunk) -> None:
        """Over raw netlink the sets whose declaration and elements nlelements understands
        (all of a table pyproxy renders, but for its interval sets), through libnftables the
        rest, in a transaction of their own: either way into sets nothing uses yet.

        Inside `bulk()` the netlink batch is committed by a thread of its own and this
        returns before the kernel answered: the kernel works through one chunk (the socket
        calls release the GIL) while the caller makes and encodes the next. Its answer is
        taken (a refusal handled as below, NftError raised) by the next call, or at the
        latest when the bulk ends."""
        left = list(chunk.loads)
        batch = None
        if self._netlink is not None:
            encoded, left = nlelements.encode_loads(chunk.loads)
            batch = nlelements.build_batch(family, TABLE, encoded)
        self._settle()  # one batch in the kernel at a time, in order
        if batch is not None and self._netlink is not None:
            commit = _Commit(self._netlink, batch, family, chunk.loads, self._pipelined)
            if self._pipelined:
                self._in_flight = commit
            else:
                self._answered(commit)
        elif batch is not None:  # the socket failed with the previous batch
            left = list(chunk.loads)
        if left:
            self.run(staging.ElementChunk(tuple(left)).script(family))

    def _settle(self) -> None:
        """Wait for the batch in flight, and handle its answer."""
        commit, self._in_flight = self._in_flight, None
        if commit is not None:
            self._answered(commit)

    def _answered(self, commit: _Commit) -> None:
        error = commit.wait()
        if isinstance(error, nlelements.BatchRefused):
            # Nothing of it was applied. libnftables gets the same elements: it refuses
            # them in its own words (a set deleted under us), or takes them (then the
            # encoder is wrong, and this says so).
            log.warning("raw_netlink_batch_refused", error=str(error))
            self.run(staging.ElementChunk(commit.loads).script(commit.family))
        elif isinstance(error, OSError):
            # The socket itself failed (a send buffer it may not raise, no answer):
            # libnftables adds every element from now on, as before this path existed.
            log.warning("raw_netlink_elements_off", error=str(error))
            if self._netlink is not None:
                self._netlink.close()
            self._netlink = None
            self.run(staging.ElementChunk(commit.loads).script(commit.family))
        elif error is not None:
            raise error

    def renew(self) -> None:
        """A fresh transaction context (drops libnftables' cache of the whole table)."""
        self._nft = self._writer()

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Our own writes, announced as a bulk (OwnSockets.bulk), element batches committed
        in the background (add_elements); all of them answered when it ends."""
        with self._sockets.bulk():
            self._pipelined = True
            try:
                yield
                self._settle()
            finally:
                self._pipelined = False
                commit, self._in_flight = self._in_flight, None
                if commit is not None:  # failing anyway: nothing may reach the kernel later
                    commit.wait()

    def list_structure(self, family: str) -> str | None:
        """Our table without set elements: chains, rules, set declarations. None when the
        table does not exist. Stateless: a rule's counter (the localhost NodePort reject
        chains') moves with traffic, which is nobody's tampering."""
        ctx = self._factory()
        ctx.set_terse_output(True)
        ctx.set_stateless_output(True)
        rc, out, _ = ctx.cmd("list ruleset")
        return table_block(str(out), family) if rc == 0 else None


    def list_elements(self, family: str, kind: str, name: str) -> list[str] | None:
        """The elements of one set or map as nft prints them (None: no such set)."""
        rc, out, _ = self._factory().cmd(f"list {kind} {family} {TABLE} {name}")
        return parse_elements(str(out)) if rc == 0 else None

    def get_element(self, family: str, container: str, key: str) -> str | None:
        """One element as the kernel holds it (`nft get element`), or None when absent."""
        rc, out, _ = self._factory().cmd(f"get element {family} {TABLE} {container} {{ {key} }}")
        if rc != 0:
            return None
        found = parse_elements(str(out))
        return found[0] if found else None

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        """Names of our table's chains and of its sets and maps."""
        block = self.list_structure(family)
        if block is None:
            return [], []  # no table yet
        chains, sets = [], []
        for line in block.splitlines():
            words = line.split()
            if len(words) >= 3 and words[-1] == "{":
                if words[0] == "chain":
                    chains.append(words[1])
                elif words[0] in ("set", "map"):
                    sets.append(words[1])
        return chains, sets


def table_block(ruleset: str, family: str) -> str | None:
    """Our table's text in a `list ruleset` output (None: not there). Tables print as
    `table FAMILY NAME {` … a closing brace alone at the start of a line."""
    header = f"table {family} {TABLE} {{"
    start = ruleset.find(header + "\n")
    if start < 0:
        return None
    end = ruleset.find("\n}", start)
    return ruleset[start:end + 2] if end >= 0 else ruleset[start:]


def listing_shape(block: str) -> Shape:
    """The shape of our table as a terse listing shows it: each chain with its number of
    rules, and the names of the sets and maps. A chain's `type … hook …` and `comment`
    lines are properties, not rules."""
    chains: dict[str, int] = {}
    sets: set[str] = set()
    current: str | None = None
    for line in block.splitlines():
        words = line.split()
        if len(words) == 3 and words[2] == "{" and words[0] in ("chain", "set", "map"):
            current = words[1] if words[0] == "chain" else None
            if current is not None:
                chains[current] = 0
            else:
                sets.add(words[1])
        elif words == ["}"]:
            current = None
        elif current is not None and words and not _chain_property(words):
            chains[current] += 1
    return Shape(chains, frozenset(sets))


def _chain_property(words: list[str]) -> bool:
    return (words[0] == "type" and "hook" in words) or words[0] in ("comment", "policy")


def parse_elements(listing: str) -> list[str]:
    """Elements from `nft list set|map` output: the text between `elements = {` and its
    closing brace, split at the top-level commas."""
    start = listing.find("elements = {")
    if start < 0:
        return []
    return split_top_level(listing[start + len("elements = {"):])


def split_top_level(body: str) -> list[str]:
    """`a, b { c, d }, e` → its parts at the top-level commas, white space folded; an
    unmatched `}` ends the body."""
    depth = 0
    current: list[str] = []
    out: list[str] = []
    for char in body:
        if char == "}" and depth == 0:
            break
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        if char == "," and depth == 0:
            out.append("".join(current))
            current = []
        else:
            current.append(char)
    out.append("".join(current))
    return [" ".join(e.split()) for e in out if e.strip()]


def _first_lines(text: str, limit: int = 20) -> str:
    lines = text.strip().splitlines()
    more = f"\n… {len(lines) - limit} more lines" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


@dataclass
class SyncResult:
    plan: SyncPlan
    commands: int
    slots_changed: int
    diff_seconds: float
    kernel_seconds: float
    script_bytes: int
    render_seconds: float = 0.0  # selection + rendering, filled in by the caller
    select_seconds: float = 0.0  # the part of render_seconds spent selecting endpoints

    @property
    def full(self) -> bool:
        return self.plan.full


@dataclass
class Applier:
    """Owns one family's table. `sync` takes the fragments that changed since the last call,
    puts them in the slot store `state` and commits the difference in one transaction (or
    everything, for a full sync). The store belongs to whoever renders into it and reads it
    (the FamilyProxier, for `trace` and the tests); a standalone applier has its own."""

    family: str
    nft: Kernel = field(default_factory=LibNftables)
    clock: Callable[[], float] = time.monotonic
    state: DesiredState = field(default_factory=DesiredState)
    # The kernel holds what the store says. False before the first full sync and from the
    # start of every sync until it has committed: after a failure only a full one makes them
    # agree again. The one "the next sync must be full" state: the node proxier's plans read it.
    in_step: bool = False
    started: bool = False  # a full sync has succeeded (this process has written the table)
    stale_chains: dict[str, float] = field(default_factory=dict)
    last_script: str = ""
    # The terse listing of our table as last read while it held what we had committed: what
    # a later listing must still show, unless someone else changed the table. Our own
    # commits do not read it again (at 10k services that read cost more CPU than a commit
    # that adds a chain): they set `structure_changed`, and the next check compares the
    # listing's shape with the store's instead, and keeps the listing if they agree.
    committed_structure: str | None = None
    structure_changed: bool = False
    cleanup_failures: int = 0  # stale chains that could not be deleted (a metric)
    # A full sync of a store larger than this goes in transactions of at most this many
    # elements, made before break (pyproxy/render/staging.py): the memory peak of one huge
    # transaction was twice the daemon's steady size.
    stage_chunk: int = staging.DEFAULT_CHUNK

    def own_plan(self) -> SyncPlan:
        """The plan of a sync nobody else planned (a standalone applier, the one-shot
        `apply`, tests): a full one until the kernel is known to hold the store."""
        return plan_sync(SyncFacts(synced=self.started, in_step=self.in_step))

    def sync(self, updates: Mapping[Hashable, Fragment] | Iterable[tuple[Hashable, Fragment]],
             plan: SyncPlan | None = None) -> SyncResult:
        """`updates`: owner → fragment, or (owner, fragment) pairs produced as they are
        consumed (the proxier renders while the store takes them in). `plan`: full or not,
        and why (None: `own_plan()`); a partial one only while the table is in step."""
        plan = plan or self.own_plan()
        if not plan.full and not self.in_step:
            raise ValueError(f"a partial sync ({plan.cause.value}) of a table not in step")
        # Until this sync has committed, the kernel is not known to hold the store: a failure
        # anywhere below (fragments produced while the store takes them, a listing, the
        # commit) leaves only a full sync to make them agree again.
        self.in_step = False
        t0 = self.clock()
        # A full sync rewrites everything from the store: no need to track what changed.
        change = None if plan.full else Change()
        pairs = updates.items() if isinstance(updates, Mapping) else updates
        for owner, fragment in pairs:
            self.state.set(owner, fragment, change)
        # Before the commands are made: a full sync lists the kernel's chains and flushes
        # those nobody wants, so a chain deleted after the listing failed the whole sync.
        self._delete_stale_chains(t0)
        cmds = self._commands(change)
        if change is None:
            # the listing found every chain nobody wants; keep their first-seen times
            self.stale_chains = {n: self.stale_chains.get(n, t0) for n in cmds.stale_chains}
        else:
            for name in cmds.stale_chains:
                self.stale_chains.setdefault(name, t0)
            for (kind, name, _), value in change.after.items():
                if kind is Kind.CHAIN and value is not None:
                    self.stale_chains.pop(name, None)
        names = self.nft.list_names(self.family) if plan.full and len(self.state) > \
            self.stage_chunk else None
        staged = names is not None and staging.worth_staging(self.state, names[1],
                                                             self.stage_chunk)
        script = "" if staged else cmds.text()
        t1 = self.clock()
        try:
            if staged:
                assert names is not None
                script = self._run_staged(cmds, table_exists=bool(names[0] or names[1]))
            elif script:
                self.nft.run(script)
        except NftError:
            # Forget stale chains: the next (full) sync finds them again.
            self.stale_chains.clear()
            raise
        finally:
            self.last_script = script
        t2 = self.clock()
        if plan.full:
            self.started = True
            self.nft.renew()
        self.in_step = True
        if change is None or any(slot[0] is not Kind.ELEMENT and change.before.get(slot) != value
                                 for slot, value in change.after.items()):
            # only when a chain or a declaration really changed: a service moving to an
            # existing shared pick chain touches the chain's slot but not its value
            self.structure_changed = True
        touched = len(self.state) if change is None else change.touched()
        return SyncResult(plan, script.count("\n"), touched, t1 - t0, t2 - t1, len(script))

    def _run_staged(self, cmds: Commands, table_exists: bool) -> str:
        """The full sync as bounded transactions, each through a fresh context (one that
        saw the elements of the last would read them all back first). Returns the last
        transaction's text, with a line saying how many went before it."""
        count, last = 0, ""
        with self.nft.bulk():
            for transaction in staging.transactions(self.family, self.state, cmds,
                                                    table_exists, self.stage_chunk):
                count, last = self._run_one(transaction, count, last)
        return f"# staged full sync: {count} transactions, the last:\n{last}"

    def _run_one(self, transaction: staging.Transaction, count: int,
                 last: str) -> tuple[int, str]:
        if isinstance(transaction, staging.ElementChunk):
            # over netlink where possible: the context sees none of these elements
            self.nft.add_elements(self.family, transaction)
            return count + 1, last
        if not transaction:
            return count, last
        self.nft.run(transaction)
        self.nft.renew()
        return count + 1, transaction

    def _commands(self, change: Change | None) -> Commands:
        """The commands that apply `change`; None: every command of a full sync."""
        if change is not None:
            return incremental_commands(self.family, change)
        chains, sets = self.nft.list_names(self.family)
        return full_commands(self.family, self.state, chains, sets,
                             recreate_base_chains=not self.started and bool(chains))

    def _delete_stale_chains(self, now: float) -> None:
        """Delete chains flushed at least the grace period ago, in their own transaction (as
        upstream does) so that a failure here cannot fail the sync itself."""
        due = [n for n, since in self.stale_chains.items() if now - since >= STALE_CHAIN_GRACE]
        if not due:
            return
        try:
            self.nft.run("".join(f"delete chain {self.family} {TABLE} {n}\n" for n in due))
        except NftError:
            self.cleanup_failures += 1
            return  # retried at the next sync; a full sync finds them again anyway
        for name in due:
            del self.stale_chains[name]
        # Our own deletion changed the structure: the next check must not take it for
        # tampering (a needless full "repair" sync, and a false `pyproxy diff` until then).
        self.structure_changed = True

    def _structure(self) -> str | None:
        return self.nft.list_structure(self.family)

    def expected_shape(self) -> Shape:
        """The shape the kernel's table must have: the store's chains and sets, and the
        chains flushed but not yet deleted (empty)."""
        return table_shape(self.state, self.stale_chains)

    def structure_intact(self) -> bool:
        """Whether chains, rules and set declarations are as we left them. Reads the table's
        structure (a terse listing, ~40 ms at 10k services): for the periodic check, not
        after every commit."""
        if not self.started:
            return True  # nothing committed yet
        current = self._structure()
        if current is None:
            return False  # the table is gone
        if self.structure_changed or self.committed_structure is None:
            if listing_shape(current) != self.expected_shape():
                return False
            self.adopt_structure(current)
            return True
        return current == self.committed_structure

    def adopt_structure(self, listing: str | None = None) -> None:
        """Take the kernel's structure, as it is now, as the reference. Also right after a
        repair: were the store's prediction ever to differ from how nft lists a chain, that
        would cost one repair, not one at every check."""
        self.committed_structure = listing if listing is not None else self._structure()
        self.structure_changed = False

    def diff(self, limit: int = 50) -> list[str]:
        """What differs between what we committed and what the kernel holds: the structure
        (chains, rules, declarations) and the elements of every set and map. Lists the
        elements, so it costs time proportional to the table: for `pyproxy diff`."""
        out = self._structure_diff() if self.started else []
        if out[:1] == [f"table {self.family} {TABLE} is missing"]:
            return out
        for name, kind, wanted in self._desired_elements():
            found = self.nft.list_elements(self.family, kind, name)
            if found is None:
                out.append(f"{kind} {name}: missing")
                continue
            have = set(found)
            for element in sorted(wanted - have)[:limit]:
                out.append(f"{kind} {name}: missing element {element}")
            for element in sorted(have - wanted)[:limit]:
                out.append(f"{kind} {name}: unexpected element {element}")
        return out

    def _structure_diff(self) -> list[str]:
        current = self._structure()
        if current is None:
            return [f"table {self.family} {TABLE} is missing"]
        if self.structure_changed or self.committed_structure is None:
            # our own commits changed it since it was last read: compared by shape
            return self.expected_shape().differences(listing_shape(current))
        return list(difflib.unified_diff(
            self.committed_structure.splitlines(), current.splitlines(),
            "committed", "kernel", lineterm="", n=1))

    def _desired_elements(self) -> list[tuple[str, str, set[str]]]:
        declared: dict[str, str] = {}
        elements: dict[str, set[str]] = {}
        for (kind, container, key), value in self.state.slots():
            if kind is Kind.SET and "dynamic" not in value:
                declared[container] = value.split(" ", 1)[0]
            elif kind is Kind.ELEMENT:
                elements.setdefault(container, set()).add(" ".join((key + value).split()))
        return [(name, kind, elements.get(name, set())) for name, kind in sorted(declared.items())]

    def cleanup(self) -> None:
        """Remove the table and everything in it."""
        with contextlib.suppress(NftError):  # no table: nothing to remove
            self.nft.run(f"delete table {self.family} {TABLE}")
        self.state.clear()
        self.in_step = False
        self.stale_chains.clear()
        self.committed_structure, self.structure_changed = None, False
