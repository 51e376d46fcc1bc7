"""The desired ruleset as reference-counted slots, and the nft commands that move the kernel
from one state to the next. Pure: the caller owns the kernel.

Every owner (a service port, or the static skeleton) contributes a `Fragment`. A slot (a set,
a chain, or one element) exists in the kernel while at least one owner wants it, so a pick
chain shared by thousands of services is written once and removed with its last user. When
owners disagree about a slot's value (two services claiming the same external IP and port),
the smallest value wins, so the result does not depend on event order.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain, groupby
from typing import Any, cast

from pyproxy.render import ops
from pyproxy.render.objects import (
    BASE_CHAIN_RULES,
    BASE_CHAINS,
    TABLE_COMMENT,
    ElementValue,
    Fragment,
    Item,
    Key,
    Kind,
    Rule,
    Rules,
    SetDecl,
    Value,
    Verdict,
)
from pyproxy.render.ops import Op

# A slot's key within its container: "" for a set, map or chain, the Key for an element.
SlotKey = str | Key
Slot = tuple[Kind, str, SlotKey]


@dataclass
class Change:
    """What one update does to the kernel, slot by slot (value None = absent)."""

    before: dict[Slot, Value | None] = field(default_factory=dict)
    after: dict[Slot, Value | None] = field(default_factory=dict)

    def touched(self) -> int:
        return sum(1 for s in self.after if self.before.get(s) != self.after[s])


class DesiredState:
    """All owners' fragments and the resulting slot values.

    A slot wanted by one owner (almost all of them) stores its value as it is; a slot
    shared or disputed stores {value: owners}. Slots are stored per (kind, container)
    and then by key, so no tuple is kept per slot: the element's own key string is the
    dictionary key. This keeps a 10k-service table's store small and its full sync quick."""

    def __init__(self) -> None:
        # Each owner's items, flattened (kind, container, key, value, kind, …): 32 bytes an
        # item where a tuple of Items costs 80, and the daemon keeps every owner's.
        self._fragments: dict[Hashable, tuple[_Field, ...]] = {}
        self._values: dict[tuple[Kind, str], dict[SlotKey, _Value]] = {}

    def __len__(self) -> int:
        return sum(len(inner) for inner in self._values.values())

    def clear(self) -> None:
        """Forget every owner's fragment (the table was removed)."""
        self._fragments.clear()
        self._values.clear()

    def value(self, slot: Slot) -> Value | None:
        kind, container, key = slot
        inner = self._values.get((kind, container))
        current = inner.get(key) if inner is not None else None
        if current is None or not isinstance(current, dict):
            return current
        return _first(current)

    def rules(self, chain: str) -> Rules | None:
        """The rules of `chain`, None when no owner wants it."""
        value = self.value((Kind.CHAIN, chain, ""))
        return None if value is None else _rules(value)

    def element(self, container: str, key: Key) -> ElementValue | None:
        """The value of element `key` of `container`, None when no owner wants it."""
        value = self.value((Kind.ELEMENT, container, key))
        return None if value is None else _element_value(value)

    def declaration(self, name: str) -> SetDecl | None:
        """The declaration of set or map `name`, None when no owner declares it."""
        value = self.value((Kind.SET, name, ""))
        return value if isinstance(value, SetDecl) else None

    def set(self, owner: Hashable, fragment: Fragment, change: Change | None = None) -> None:
        """Replace an owner's fragment (an empty fragment removes the owner), recording in
        `change` the before/after value of every slot it touches (a full sync, which
        rewrites everything, passes none)."""
        flat_old = self._fragments.get(owner, ())
        new = fragment.items
        flat_new = tuple(chain.from_iterable(new))
        if flat_old == flat_new:
            return
        removed: Iterable[Item]
        added: Iterable[Item]
        if not flat_old:
            removed, added = (), new  # a new owner (every owner of a cold start)
        elif len(flat_old) < _BIG_OWNER:
            removed, added, flat_new = _difference(flat_old, new)
        else:
            removed, added, flat_new = _block_difference(flat_old, flat_new)
        if change is not None:
            for item in (*removed, *added):
                slot = item[:3]
                if slot not in change.before:
                    change.before[slot] = self.value(slot)
        for item in removed:
            self._drop(item)
        for item in added:
            self._add(item)
        if change is not None:
            for item in (*removed, *added):
                slot = item[:3]
                change.after[slot] = self.value(slot)
        if new:
            self._fragments[owner] = flat_new
        else:
            self._fragments.pop(owner, None)

    def _add(self, item: Item) -> None:
        kind, container, key, value = item
        inner = self._values.get((kind, container))
        if inner is None:
            inner = self._values[(kind, container)] = {}
        current = inner.get(key)
        if current is None:
            inner[key] = value
        elif not isinstance(current, dict):
            shared = {current: 1}
            shared[value] = shared.get(value, 0) + 1
            inner[key] = shared
        else:
            current[value] = current.get(value, 0) + 1

    def _drop(self, item: Item) -> None:
        kind, container, key, value = item
        inner = self._values[(kind, container)]
        current = inner[key]
        if not isinstance(current, dict):
            del inner[key]
            if not inner:
                del self._values[(kind, container)]
            return
        current[value] -= 1
        if not current[value]:
            del current[value]
        if len(current) == 1 and next(iter(current.values())) == 1:
            inner[key] = next(iter(current))

    def slots(self) -> Iterator[tuple[Slot, Value]]:
        for kind, container, entries in self.containers():
            for key, value in entries:
                yield (kind, container, key), value

    def containers(self) -> Iterator[tuple[Kind, str, Iterator[tuple[SlotKey, Value]]]]:
        """Per (kind, container): its (key, value) pairs (a full sync writes them in one
        command per container)."""
        for (kind, container), inner in self._values.items():
            yield kind, container, _resolved(inner)


    def elements(self) -> Iterator[tuple[str, Iterator[tuple[Key, ElementValue]]]]:
        """Per set or map: its elements, (key, value)."""
        for (kind, container), inner in self._values.items():
            if kind is Kind.ELEMENT:  # an element's slot holds a Key and an ElementValue
                yield container, cast(Iterator[tuple[Key, ElementValue]], _resolved(inner))

    def disputes(self) -> list[Dispute]:
        """Slots owners want with different values (two Services claiming one external IP and
        port, or one NodePort), each with its owners per value; the smallest value is the
        one used. Scans every owner's items: for offline reports, not for the sync loop."""
        disputed = {(kind, container, key): current
                    for (kind, container), inner in self._values.items()
                    for key, current in inner.items()
                    if isinstance(current, dict) and len(current) > 1}
        if not disputed:
            return []
        owners: dict[tuple[Slot, Value], list[Hashable]] = {}
        for owner, flat in self._fragments.items():
            for i in range(0, len(flat), 4):
                slot = (Kind(str(flat[i])), str(flat[i + 1]), _slot_key(flat[i + 2]))
                if slot in disputed:
                    owners.setdefault((slot, cast(Value, flat[i + 3])), []).append(owner)
        return [Dispute(slot, tuple((value, tuple(owners.get((slot, value), ())))
                                    for value in sorted(values, key=_order)))
                for slot, values in sorted(disputed.items())]


@dataclass(frozen=True, slots=True)
class Dispute:
    """One slot owners disagree about: each value with the owners wanting it, the value used
    first (the smallest, so the outcome does not depend on the order of events)."""

    slot: Slot
    claims: tuple[tuple[Value, tuple[Hashable, ...]], ...]

    @property
    def used_by(self) -> tuple[Hashable, ...]:
        return self.claims[0][1]

    @property
    def owners(self) -> tuple[Hashable, ...]:
        return tuple(owner for _, owners in self.claims for owner in owners)


def _resolved(inner: dict[SlotKey, _Value]) -> Iterator[tuple[SlotKey, Value]]:
    for key, current in inner.items():
        yield key, _first(current) if isinstance(current, dict) else current


def _first(values: Iterable[Value]) -> Value:
    """The value a disputed slot holds: the smallest, so that the outcome does not depend on
    the order of events."""
    return min(values, key=_order)


def _order(value: Value) -> Any:
    """What values are ordered by: their own order, a chain's rules by their text (a rule's
    statements are of several types, which do not order among each other)."""
    return tuple(r.text() for r in cast(Rules, value)) if _is_rules(value) else value


_Value = Value | dict[Value, int]
# A field of an owner's flattened items (kind, container, key, value, kind, …).
_Field = str | Value


# Strings (4 an item) from which an owner's change is compared block by block.
_BIG_OWNER = 4 * 256
# Items per block.
_BLOCK = 64


def _difference(flat_old: tuple[_Field, ...], new: Iterable[Item],
                ) -> tuple[list[Item], list[Item], tuple[_Field, ...]]:
    """What replacing an owner's items (flat_old) by `new` removes and adds, and the new
    items flattened, made of the strings already stored wherever an item stays (the store's
    keys and values are those objects: an owner changed again and again holds one copy)."""
    old = _unflattened(flat_old)
    new = list(new)
    kept, new_set = {item: item for item in old}, set(new)
    removed = [item for item in old if item not in new_set]
    added = [item for item in new if item not in kept]
    return removed, added, tuple(chain.from_iterable(kept.get(item, item) for item in new))


def _block_difference(flat_old: tuple[_Field, ...], flat_new: tuple[_Field, ...],
                      ) -> tuple[list[Item], list[Item], tuple[_Field, ...]]:
    """`_difference` for a big owner, mostly unchanged: a 5,000-endpoint service with one
    endpoint more. Its items come in runs per container (its endpoints map's elements in
    slot order, which `keep_slots` keeps), so each run is compared with the same run before
    block by block, positionally, as tuples (in C); only the blocks that differ are compared
    item by item. An item is in a fragment once, so an item of a block equal on both sides
    is in no other block of either side."""
    old_runs = _runs(flat_old)
    pieces: list[tuple[_Field, ...]] = []  # the new flat items, block by block
    differing: list[int] = []  # the pieces that differ from the old block at their place
    old_differing: list[tuple[_Field, ...]] = []
    for run, (start, end) in _runs(flat_new).items():
        old_start, old_end = old_runs.pop(run, (0, 0))
        for offset in range(0, max(end - start, old_end - old_start), _BLOCK):
            block = flat_new[4 * min(start + offset, end):4 * min(start + offset + _BLOCK, end)]
            before = flat_old[4 * min(old_start + offset, old_end):
                              4 * min(old_start + offset + _BLOCK, old_end)]
            if block == before:
                pieces.append(before)
            else:
                differing.append(len(pieces))
                pieces.append(block)
                old_differing.append(before)
    old_differing += (flat_old[4 * start:4 * end] for start, end in old_runs.values())
    removed, added, flat_changed = _difference(
        tuple(chain.from_iterable(old_differing)),
        _unflattened(tuple(chain.from_iterable(pieces[i] for i in differing))))
    # The changed blocks take their (stored) strings back, in order.
    at = 0
    for i in differing:
        size = len(pieces[i])
        pieces[i] = flat_changed[at:at + size]
        at += size
    return removed, added, tuple(chain.from_iterable(pieces))


def _runs(flat: tuple[_Field, ...]) -> dict[tuple[_Field, _Field, int], tuple[int, int]]:
    """The runs of consecutive items of one kind and container, as item index ranges, keyed
    by (kind, container, how many runs of them came before)."""
    runs: dict[tuple[_Field, _Field, int], tuple[int, int]] = {}
    seen: dict[tuple[_Field, _Field], int] = {}
    start = 0
    for (kind, container), items in groupby(zip(flat[0::4], flat[1::4], strict=True)):
        end = start + sum(1 for _ in items)
        count = seen.get((kind, container), 0)
        seen[(kind, container)] = count + 1
        runs[(kind, container, count)] = (start, end)
        start = end
    return runs


def _unflattened(flat: tuple[_Field, ...]) -> list[Item]:
    fields = iter(flat)
    # tuple.__new__: the fields are an Item's already (the kind still a Kind)
    return [tuple.__new__(Item, group)
            for group in zip(fields, fields, fields, fields, strict=True)]
_EMPTY = Fragment()


# ---------------------------------------------------------------------------------------------
# The table's shape


@dataclass(frozen=True)
class Shape:
    """A table at the level of names: each chain with its number of rules, and the names of
    its sets and maps. What the store predicts a listing of the kernel's table shows (the
    exact text of a rule is nft's, normalised, and cannot be predicted)."""

    chains: Mapping[str, int]
    sets: frozenset[str]

    def differences(self, found: Shape) -> list[str]:
        """How `found` (the kernel's) differs from this shape (the expected one)."""
        out = [f"chain {n}: missing" for n in sorted(set(self.chains) - set(found.chains))]
        out += [f"chain {n}: unexpected" for n in sorted(set(found.chains) - set(self.chains))]
        out += [f"chain {n}: {found.chains[n]} rule(s), expected {want}"
                for n, want in sorted(self.chains.items())
                if n in found.chains and found.chains[n] != want]
        out += [f"set or map {n}: missing" for n in sorted(self.sets - found.sets)]
        out += [f"set or map {n}: unexpected" for n in sorted(found.sets - self.sets)]
        return out


@dataclass(frozen=True)
class Structure:
    """Our table as the kernel lists it without elements: each object (the table, a chain,
    a set or map, a rule) as one line of canonical JSON, in the listing's order, and the
    names it declares. Two listings are the same table when their lines are; the lines'
    differences are what `pyproxy diff` shows."""

    lines: tuple[str, ...]
    chains: Mapping[str, int]  # name → its number of rules, in listing order
    sets: tuple[str, ...]  # sets and maps, in listing order

    @property
    def shape(self) -> Shape:
        return Shape(self.chains, frozenset(self.sets))


def table_shape(state: DesiredState, flushed: Iterable[str] = ()) -> Shape:
    """The shape of the table a full sync of `state` leaves, with the `flushed` chains (no
    longer wanted, not yet deleted) still there, empty."""
    chains = {name: len(BASE_CHAIN_RULES.get(name, ())) for name in BASE_CHAINS}
    sets = set()
    for kind, container, entries in state.containers():
        if kind is Kind.CHAIN:
            for _key, rules in entries:
                chains[container] = len(_rules(rules))
        elif kind is Kind.SET:
            sets.add(container)
    for name in flushed:
        chains.setdefault(name, 0)
    return Shape(chains, frozenset(sets))


# ---------------------------------------------------------------------------------------------
# nft commands


@dataclass
class Commands:
    """A transaction's operations grouped by the order it needs them in."""

    family: str
    declare: list[Op] = field(default_factory=list)  # add set/map/chain
    flush: list[Op] = field(default_factory=list)  # flush chain/set
    rules: list[Op] = field(default_factory=list)  # add rule
    delete_elements: list[Op] = field(default_factory=list)
    add_elements: list[Op] = field(default_factory=list)
    delete_sets: list[Op] = field(default_factory=list)
    stale_chains: list[str] = field(default_factory=list)  # flushed now, deleted later

    def ops(self) -> list[Op]:
        return [*self.declare, *self.flush, *self.rules, *self.delete_elements,
                *self.add_elements, *self.delete_sets]

    def text(self) -> str:
        """The transaction as an nft script."""
        return ops.script(self.family, self.ops())

    def __bool__(self) -> bool:
        return any((self.declare, self.flush, self.rules, self.delete_elements,
                    self.add_elements, self.delete_sets))


def _rules(value: Value) -> Rules:
    """A chain's slot holds its Rules."""
    if isinstance(value, SetDecl | Verdict) or not all(isinstance(r, Rule) for r in value):
        raise TypeError(f"not a chain's rules: {value!r}")
    return cast(Rules, value)


def _element_value(value: Value) -> ElementValue:
    if isinstance(value, SetDecl) or _is_rules(value):
        raise TypeError(f"not an element's value: {value!r}")
    return cast(ElementValue, value)


def _slot_key(field: _Field) -> SlotKey:
    if isinstance(field, str):
        return field
    if isinstance(field, SetDecl) or _is_rules(field):
        raise TypeError(f"not a slot's key: {field!r}")
    return cast(Key, field)


def _is_rules(value: Value) -> bool:
    """A chain's rules (an element's value or key holds fields, not rules)."""
    return bool(value) and isinstance(value[0], Rule)


def _key(key: SlotKey) -> Key:
    if isinstance(key, str):
        raise TypeError(f"not an element's key: {key!r}")
    return key


def _decl(value: Value | None) -> SetDecl:
    if not isinstance(value, SetDecl):
        raise TypeError(f"not a declaration: {value!r}")
    return value


def _add_rules(chain: str, rules: Rules) -> list[Op]:
    return [ops.add(ops.Rule(chain, rule)) for rule in rules]


def _group_elements(verb: ops.Verb, pairs: list[tuple[str, Key, ElementValue]]) -> list[Op]:
    """One operation per container: `add element ip pyproxy m { k1 : v1, k2 : v2 }`."""
    by_container: dict[str, list[tuple[Key, ElementValue]]] = {}
    for container, key, value in pairs:
        by_container.setdefault(container, []).append((key, value))
    return [ops.Op(verb, ops.Elements(container, tuple(elements)))
            for container, elements in by_container.items()]


def incremental_commands(family: str, change: Change) -> Commands:
    """The commands that apply `change`, assuming the kernel holds its `before` values."""
    cmds = Commands(family)
    delete_elems: list[tuple[str, Key, ElementValue]] = []
    add_elems: list[tuple[str, Key, ElementValue]] = []
    for slot, after in sorted(change.after.items()):
        before = change.before.get(slot)
        if before == after:
            continue
        kind, container, key = slot
        if kind is Kind.SET:
            if before is None and after is not None:
                cmds.declare.append(ops.add(ops.Set(container, _decl(after))))
            elif after is None and before is not None:
                # Deleted last, after the chains that use it were flushed.
                cmds.delete_sets.append(ops.delete(ops.Set(container, _decl(before))))
            else:
                # Names are chosen so that no declaration changes in place (an affinity
                # set's timeout is in its name; the skeleton's depend on the family only):
                # nft refuses to redeclare a set (EEXIST), in a full sync's transaction too.
                raise ValueError(f"{container}: a set's declaration cannot change in place")
        elif kind is Kind.CHAIN:
            if before is None:
                cmds.declare.append(ops.add(ops.Chain(container)))
            else:
                cmds.flush.append(ops.flush(ops.Chain(container)))
            if after is None:
                cmds.stale_chains.append(container)
            else:
                cmds.rules.extend(_add_rules(container, _rules(after)))
        else:
            if before is not None:
                delete_elems.append((container, _key(key), _element_value(before)))
            if after is not None:
                add_elems.append((container, _key(key), _element_value(after)))
    cmds.delete_elements = _group_elements(ops.Verb.DELETE, delete_elems)
    cmds.add_elements = _group_elements(ops.Verb.ADD, add_elems)
    return cmds


def full_commands(
    family: str, state: DesiredState, existing_chains: Iterable[str] = (),
    existing_sets: Iterable[str] = (), recreate_base_chains: bool = False,
    replace: bool = False,
) -> Commands:
    """Commands that make the table exactly the desired state whatever it holds now, in one
    transaction and without a moment without rules: containers are flushed and refilled,
    chains flushed and rewritten. Dynamic affinity sets are declared, never flushed, so
    affinity survives a restart. `existing_*` are the names the kernel has (from a terse
    listing); those no longer desired are removed. `replace`: the table is deleted and
    written anew in the same transaction instead (make before break all the same: packets
    see the old table until the commit, then the new one), for a table that cannot be
    patched into ours (another layout's: a set where a map was, another key type, other
    flags); what packets filled in (affinity, connection counters) is lost."""
    cmds = Commands(family)
    if replace:
        # declared first, so that the delete cannot fail on a table that is not there
        cmds.declare += [ops.add(ops.Table()), ops.delete(ops.Table())]
        existing_chains, existing_sets, recreate_base_chains = (), (), False
    cmds.declare.append(ops.add(ops.Table(TABLE_COMMENT)))
    sets: dict[str, SetDecl] = {}
    chains: dict[str, Rules] = {}
    # No sorting of the (many) elements: their order in a command is irrelevant.
    elements = {container: tuple(entries) for container, entries in state.elements()}
    for kind, container, entries in state.containers():
        if kind is not Kind.ELEMENT:
            for _key, value in entries:  # one: chains and sets have no key
                if kind is Kind.CHAIN:
                    chains[container] = _rules(value)
                else:
                    sets[container] = _decl(value)
    for name in sorted(sets):
        declaration = sets[name]
        cmds.declare.append(ops.add(ops.Set(name, declaration)))
        if not declaration.dynamic:
            cmds.flush.append(ops.flush(ops.Set(name, declaration)))
    for name in BASE_CHAINS:
        if recreate_base_chains:
            # Base chain properties (priority) cannot change in place (kubernetes#123162):
            # declare, delete and create anew within the same transaction.
            cmds.declare.append(ops.add(ops.Chain(name)))
            cmds.declare.append(ops.delete(ops.Chain(name)))
        cmds.declare.append(ops.add(ops.Chain(name, BASE_CHAINS[name])))
        cmds.flush.append(ops.flush(ops.Chain(name)))
        cmds.rules.extend(_add_rules(name, BASE_CHAIN_RULES[name]))
    for name in sorted(chains):
        cmds.declare.append(ops.add(ops.Chain(name)))
        cmds.flush.append(ops.flush(ops.Chain(name)))
        cmds.rules.extend(_add_rules(name, chains[name]))
    for name in sorted(set(existing_chains) - set(chains) - set(BASE_CHAINS)):
        cmds.flush.append(ops.flush(ops.Chain(name)))
        cmds.stale_chains.append(name)
    for name in sorted(set(existing_sets) - set(sets)):
        cmds.delete_sets.append(ops.delete(ops.Set(name)))
    cmds.add_elements = [ops.add(ops.Elements(container, items))
                         for container, items in sorted(elements.items())]
    return cmds
