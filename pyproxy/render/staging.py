"""A large full sync as a series of bounded transactions that packets see as one
(make-before-break). Pure: the caller runs the scripts in order.

Why: libnftables turns a script into one netlink transaction only after parsing all of it,
and holds every parsed element meanwhile: at 10k services × 10 endpoints the full sync's
231k elements (a 9.3 MB script) took the daemon from ~200 MiB to ~570 MiB for the length of
that transaction. In transactions of at most `chunk` elements the peak is a chunk's worth.

What a packet sees never mixes old and new:
- fresh table (nothing of ours in the kernel): the table, its sets, maps and regular chains
  are created first, the elements are added in chunks, and the base chains (the hooks) come
  last, in one transaction: no packet reaches any of it before everything is there;
- existing table: the elements are loaded into shadow copies of the sets and maps that no
  rule references yet (`NAME-staged`), then one small transaction rewrites every chain to use
  the copies (the switch: all old → all new), the real sets are flushed in it too; they are
  then refilled in chunks and a last small transaction switches the rules back to them and
  deletes the copies. Twice the kernel work of one transaction, for the names to stay what
  every reader (trace, diff, the drills) looks for.

Dynamic sets (ClientIP affinity) are never copied: their contents are the connections'
affinity and must survive any sync.

The element chunks are `ElementChunk`s, not text: the kernel shell adds them over raw
netlink where it can (pyproxy/kernel/nlelements.py; libnftables' parser cost 1.2 s of the
1.55 s a 10k-service table's elements took), and as `add element` text otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pyproxy.render import ops
from pyproxy.render.objects import (
    BASE_CHAINS,
    ElementValue,
    Key,
    Kind,
    SetDecl,
)
from pyproxy.render.ops import Op
from pyproxy.render.ruleset import Commands, DesiredState

SHADOW_SUFFIX = "-staged"
# Elements per transaction: ~35 MiB of libnftables memory at ~1.6 KiB a parsed element.
DEFAULT_CHUNK = 20_000
# A full sync into a fresh table is staged from this many slots on (sync/applier.py's
# `Applier.stage_fresh` says why); below it, one transaction is cheaper than three.
FRESH_TABLE_MIN = 1_000


@dataclass(frozen=True)
class ElementChunk:
    """One transaction adding elements to sets and maps that nothing references yet:
    (set name, its declaration, its elements as (key, value)) for each."""

    loads: tuple[Load, ...]

    def __len__(self) -> int:
        return sum(len(elements) for _, _, elements in self.loads)

    def ops(self) -> list[Op]:
        """The same transaction as operations (what libnftables or a fake takes)."""
        return [ops.add(ops.Elements(name, elements)) for name, _, elements in self.loads]

    def script(self, family: str) -> str:
        """The same transaction as nft text."""
        return ops.script(family, self.ops())


# A set or map's name, its declaration, elements.
Load = tuple[str, SetDecl, tuple[tuple[Key, ElementValue], ...]]
Transaction = list[Op] | ElementChunk
# The declaration a load carries for elements of a set nobody declares (the kernel says what
# is wrong when they are added): no field the netlink encoder could encode.
_UNDECLARED = SetDecl(())


def shadow(name: str) -> str:
    return name + SHADOW_SUFFIX


def static_sets(state: DesiredState) -> dict[str, SetDecl]:
    """Name → declaration of the sets and maps whose elements the store owns (not dynamic)."""
    out: dict[str, SetDecl] = {}
    for kind, container, entries in state.containers():
        if kind is Kind.SET:
            for _key, value in entries:
                if isinstance(value, SetDecl) and not value.dynamic:
                    out[container] = value
    return out


def worth_staging(state: DesiredState, existing_sets: Iterable[str], above: int) -> bool:
    """Staged when the store holds more than `above` slots (a chunk; less for a fresh
    table), and no copy is left in the kernel by an interrupted staged sync: rules may still
    use such a copy, and only the one transaction (which rewrites every chain and deletes
    the copies at once) is safe then."""
    return len(state) > above and not any(n.endswith(SHADOW_SUFFIX) for n in existing_sets)


def transactions(family: str, state: DesiredState, cmds: Commands, table_exists: bool,
                 chunk: int = DEFAULT_CHUNK) -> Iterator[Transaction]:
    """The transactions of the staged form of the full sync `cmds` (what `full_commands`
    made from `state` and the kernel's names), in order, each made when asked for (so only
    one chunk's text exists at a time)."""
    sets = static_sets(state)
    if not table_exists:
        before = [*cmds.declare, *cmds.flush, *cmds.rules]
        yield [op for op in before if not _on_base(op)]
        yield from _chunks(state, chunk, sets, {})
        yield [op for op in before if _on_base(op)]
        return
    renamed = {name: shadow(name) for name in sets}
    # The table (someone may have deleted it), the copies, and every chain the new state
    # has (empty until the switch): the copies' verdicts must find their chains.
    declare_shadows = [cmds.declare[0],
                       *(ops.add(ops.Set(shadow(n), sets[n])) for n in sorted(sets)),
                       *(op for op in cmds.declare if op.verb is ops.Verb.ADD
                         and isinstance(op.obj, ops.Chain) and not _on_base(op))]
    chain_flushes = [op for op in cmds.flush if isinstance(op.obj, ops.Chain)]
    switch = [*cmds.declare, *cmds.flush, *(_renamed(op, renamed) for op in cmds.rules),
              *cmds.delete_sets]
    back = [*chain_flushes, *cmds.rules,
            *(ops.delete(ops.Set(shadow(n), sets[n])) for n in sorted(sets))]
    yield declare_shadows
    yield from _chunks(state, chunk, sets, renamed)
    yield switch
    yield from _chunks(state, chunk, sets, {})
    yield back


def _on_base(op: Op) -> bool:
    """An operation on one of the base chains (`add chain|rule`, `flush|delete chain`)."""
    obj = op.obj
    return ((isinstance(obj, ops.Chain) and obj.name in BASE_CHAINS)
            or (isinstance(obj, ops.Rule) and obj.chain in BASE_CHAINS))


def _renamed(op: Op, renamed: dict[str, str]) -> Op:
    """A rule using the copies of the sets and maps it uses."""
    added = op.obj
    if not isinstance(added, ops.Rule):
        return op
    return op._replace(obj=added._replace(rule=added.rule.renamed(renamed)))


def _chunks(state: DesiredState, chunk: int, sets: dict[str, SetDecl],
            renamed: dict[str, str]) -> Iterator[ElementChunk]:
    """Transactions of at most `chunk` elements, in container order; `sets`: the
    declarations (`static_sets`) each load carries."""
    loads: list[Load] = []
    size = 0
    for container, entries in state.elements():
        name = renamed.get(container, container)
        batch: list[tuple[Key, ElementValue]] = []
        for element in entries:
            batch.append(element)
            size += 1
            if size >= chunk:
                loads.append((name, sets.get(container, _UNDECLARED), tuple(batch)))
                yield ElementChunk(tuple(loads))
                loads, batch, size = [], [], 0
        if batch:
            loads.append((name, sets.get(container, _UNDECLARED), tuple(batch)))
    if loads:
        yield ElementChunk(tuple(loads))

