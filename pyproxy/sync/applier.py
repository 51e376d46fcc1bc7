"""The applier: executes a sync plan against the kernel (pyproxy/kernel/nft.py's `Kernel`:
the libnftables shell or a fake) and keeps the in-memory mirror of what was committed, so a
partial sync never reads the kernel back. What it decides: full or partial, staged or in
one transaction, patched or replaced whole (another layout's table, or one the kernel
refuses to patch), which stale chains to delete and when."""

from __future__ import annotations

import contextlib
import difflib
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import structlog

from pyproxy.core.plan import SyncFacts, SyncPlan, plan_sync
from pyproxy.kernel.libnftables import LibNftables, NftError
from pyproxy.kernel.nft import FaultyKernel, Kernel
from pyproxy.render import ops, staging
from pyproxy.render.objects import (
    TABLE,
    TABLE_COMMENT,
    Element,
    Fragment,
    Kind,
    SetDecl,
    element_text,
)
from pyproxy.render.ruleset import (
    Change,
    Commands,
    DesiredState,
    Shape,
    Structure,
    full_commands,
    incremental_commands,
    table_shape,
)

log = structlog.get_logger(__name__)

# Chains left without references are deleted this long after they were flushed: on kernels
# before 6.2 the kernel notices a chain is unreferenced only a short time after the vmap
# element that used it was deleted, and an immediate delete fails with EBUSY
# (kubernetes#122604).
# Chains left without references are deleted this long after they were flushed: on kernels
# before 6.2 the kernel notices a chain is unreferenced only a short time after the vmap
# element that used it was deleted, and an immediate delete fails with EBUSY
# (kubernetes#122604).
STALE_CHAIN_GRACE = 1.0


def _refusal(error: str) -> str:
    """nft's error and the command it names, on one line (without the caret line)."""
    lines = [line.strip() for line in error.splitlines()
             if line.strip() and not set(line.strip()) <= {"^", "~"}]
    return ": ".join(lines[:2])


def inject_faults(applier: Applier, count: int) -> int:
    """Make `applier`'s next `count` non-empty transactions fail (0: none); returns the
    count now pending."""
    if not isinstance(applier.nft, FaultyKernel):
        applier.nft = FaultyKernel(applier.nft)
    applier.nft.fail_next = count
    return count


def pending_faults(applier: Applier) -> int:
    return applier.nft.fail_next if isinstance(applier.nft, FaultyKernel) else 0


def element_edits(transaction: Iterable[ops.Op],
                  desired: DesiredState) -> dict[str, SetDecl] | None:
    """The declarations of the sets a transaction edits, when all it does is add and delete
    elements of sets the store declares; None otherwise."""
    declarations: dict[str, SetDecl] = {}
    for verb, obj in transaction:
        if not isinstance(obj, ops.Elements) or verb is ops.Verb.FLUSH:
            return None
        if obj.set not in declarations:
            declaration = desired.declaration(obj.set)
            if declaration is None:
                return None
            declarations[obj.set] = declaration
    return declarations or None


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
    replaced: str | None = None  # why the table was replaced whole, when it was

    @property
    def full(self) -> bool:
        return self.plan.full


@dataclass
class Applier:
    """Owns one family's table. `sync` takes the fragments that changed since the last call,
    puts them in the slot store `desired` and commits the difference in one transaction (or
    everything, for a full sync). The store belongs to whoever renders into it and reads it
    (the FamilyProxier, for `trace` and the tests); a standalone applier has its own."""

    family: str
    nft: Kernel = field(default_factory=LibNftables)
    clock: Callable[[], float] = time.monotonic
    desired: DesiredState = field(default_factory=DesiredState)
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
    committed_structure: Structure | None = None
    structure_changed: bool = False
    cleanup_failures: int = 0  # stale chains that could not be deleted (a metric)
    replacements: int = 0  # tables replaced whole (a metric)
    # A full sync of a store larger than this goes in transactions of at most this many
    # elements, made before break (pyproxy/render/staging.py): the memory peak of one huge
    # transaction was twice the daemon's steady size.
    stage_chunk: int = staging.DEFAULT_CHUNK
    # A full sync into a fresh table (nothing of ours in the kernel: the daemon's first start
    # on a node) is staged from this many slots on, below a chunk too: its elements then go
    # over raw netlink instead of through libnftables' parser, which held the whole script's
    # syntax tree in the daemon (1k services x 10 endpoints: a 0.7 MB script, a third of
    # the daemon's peak) and took most of the sync's CPU. A fresh table costs staging
    # nothing more: its hooks come last anyway (no shadow copies, unlike an existing table).
    stage_fresh: int = staging.FRESH_TABLE_MIN

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
            self.desired.set(owner, fragment, change)
        # Before the commands are made: a full sync lists the kernel's chains and flushes
        # those nobody wants, so a chain deleted after the listing failed the whole sync.
        self._delete_stale_chains(t0)
        # Another layout's table (an older or newer release's, or one made by hand) is not
        # patched: what it holds under our names may not be what the names mean to us.
        replaced = self._foreign_layout() if plan.full else None
        # A full sync patching our table reads the kernel's names once: what to flush and
        # delete, and whether to stage.
        names = self.nft.list_names(self.family) \
            if change is None and replaced is None else None
        cmds = self._commands(change, names)
        if change is None:
            # the listing found every chain nobody wants; keep their first-seen times
            self.stale_chains = {n: self.stale_chains.get(n, t0) for n in cmds.stale_chains}
        else:
            for name in cmds.stale_chains:
                self.stale_chains.setdefault(name, t0)
            for (kind, name, _), value in change.after.items():
                if kind is Kind.CHAIN and value is not None:
                    self.stale_chains.pop(name, None)
        fresh = names is not None and not (names[0] or names[1])
        staged = names is not None and staging.worth_staging(
            self.desired, names[1],
            min(self.stage_chunk, self.stage_fresh) if fresh else self.stage_chunk)
        script = ""
        t1 = self.clock()
        try:
            try:
                if staged:
                    assert names is not None
                    script = self._run_staged(cmds, table_exists=not fresh)
                elif cmds:
                    script = self._commit(cmds.ops(), change is not None)
            except NftError as err:
                if not plan.full or replaced is not None:
                    raise
                # A full sync the kernel refused: what the table holds cannot be patched
                # into ours (a set where a map was, another key type or flags, a base chain
                # of another priority). Replaced whole, within this sync, so that nothing
                # left in our table can keep a node without rules.
                replaced = f"the kernel refused a full sync: {_refusal(str(err))}"
                cmds = full_commands(self.family, self.desired, replace=True)
                self.nft.renew()  # the refused transaction may have left its cache wrong
                script = self.nft.apply(self.family, cmds.ops())
            if replaced is not None:
                self._replaced(replaced)
        except NftError:
            if not staged or replaced is not None:
                script = cmds.text()  # what was refused
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
        touched = len(self.desired) if change is None else change.touched()
        return SyncResult(plan, script.count("\n"), touched, t1 - t0, t2 - t1, len(script),
                          replaced=replaced)

    def _commit(self, transaction: list[ops.Op], partial: bool) -> str:
        """One transaction. A partial sync's that only adds and deletes elements (an
        endpoint come or gone: the endpoints map's slots, a few verdict-map elements) goes
        to `apply_elements`, which can send it without libnftables."""
        declarations = element_edits(transaction, self.desired) if partial else None
        if declarations is not None:
            return self.nft.apply_elements(self.family, transaction, declarations)
        return self.nft.apply(self.family, transaction)

    def _foreign_layout(self) -> str | None:
        """Why our table must be replaced rather than patched: it records another layout
        than ours (None: it records ours, there is none, or the kernel cannot say)."""
        found = self.nft.table_comment(self.family)
        if found is None or found == TABLE_COMMENT:
            return None
        return f"the table records another layout: {found!r}" if found else \
            "the table records no layout"

    def _replaced(self, reason: str) -> None:
        self.replacements += 1
        self.stale_chains.clear()  # the new table has none
        log.warning("table_replaced", family=self.family, reason=reason,
                    layout=TABLE_COMMENT)

    def _run_staged(self, cmds: Commands, table_exists: bool) -> str:
        """The full sync as bounded transactions, each through a fresh context (one that
        saw the elements of the last would read them all back first). Returns the last
        transaction's text, with a line saying how many went before it."""
        count, last = 0, ""
        with self.nft.bulk():
            for transaction in staging.transactions(self.family, self.desired, cmds,
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
        script = self.nft.apply(self.family, transaction)
        self.nft.renew()
        return count + 1, script

    def _commands(self, change: Change | None,
                  names: tuple[list[str], list[str]] | None = ([], [])) -> Commands:
        """The commands that apply `change`; None: every command of a full sync over the
        kernel's `names` (chains, sets; by default none), or with None for them one that
        deletes the table and writes it anew."""
        if change is not None:
            return incremental_commands(self.family, change)
        if names is None:
            return full_commands(self.family, self.desired, replace=True)
        chains, sets = names
        return full_commands(self.family, self.desired, chains, sets,
                             recreate_base_chains=not self.started and bool(chains))

    def _delete_stale_chains(self, now: float) -> None:
        """Delete chains flushed at least the grace period ago, in their own transaction (as
        upstream does) so that a failure here cannot fail the sync itself."""
        due = [n for n, since in self.stale_chains.items() if now - since >= STALE_CHAIN_GRACE]
        if not due:
            return
        try:
            self.nft.apply(self.family, [ops.delete(ops.Chain(n)) for n in due])
        except NftError:
            self.cleanup_failures += 1
            return  # retried at the next sync; a full sync finds them again anyway
        for name in due:
            del self.stale_chains[name]
        # Our own deletion changed the structure: the next check must not take it for
        # tampering (a needless full "repair" sync, and a false `pyproxy diff` until then).
        self.structure_changed = True

    def _structure(self) -> Structure | None:
        return self.nft.list_structure(self.family)

    def expected_shape(self) -> Shape:
        """The shape the kernel's table must have: the store's chains and sets, and the
        chains flushed but not yet deleted (empty)."""
        return table_shape(self.desired, self.stale_chains)

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
            if current.shape != self.expected_shape():
                return False
            self.adopt_structure(current)
            return True
        return current == self.committed_structure

    def adopt_structure(self, listing: Structure | None = None) -> None:
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
            for text in sorted(element_text(*e) for e in wanted - have)[:limit]:
                out.append(f"{kind} {name}: missing element {text}")
            for text in sorted(element_text(*e) for e in have - wanted)[:limit]:
                out.append(f"{kind} {name}: unexpected element {text}")
        return out

    def _structure_diff(self) -> list[str]:
        current = self._structure()
        if current is None:
            return [f"table {self.family} {TABLE} is missing"]
        if self.structure_changed or self.committed_structure is None:
            # our own commits changed it since it was last read: compared by shape
            return self.expected_shape().differences(current.shape)
        return list(difflib.unified_diff(
            self.committed_structure.lines, current.lines,
            "committed", "kernel", lineterm="", n=1))

    def _desired_elements(self) -> list[tuple[str, str, set[Element]]]:
        declared: dict[str, str] = {}
        for (_kind, container, _key), value in self.desired.slots():
            if isinstance(value, SetDecl) and not value.dynamic:
                declared[container] = value.kind
        elements = {container: set(entries) for container, entries in self.desired.elements()}
        return [(name, kind, elements.get(name, set())) for name, kind in sorted(declared.items())]

    def cleanup(self) -> None:
        """Remove the table and everything in it."""
        with contextlib.suppress(NftError):  # no table: nothing to remove
            self.nft.apply(self.family, [ops.delete(ops.Table())])
        self.desired.clear()
        self.in_step = False
        self.stale_chains.clear()
        self.committed_structure, self.structure_changed = None, False
