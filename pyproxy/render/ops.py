"""A transaction as typed operations on our table, and the one writer that turns them into nft
text. Pure: the kernel shell (kernel/libnftables.py) sends the text, the fake kernel
(testkit/fakes.py) applies the operations themselves, so nothing reads back the text
pyproxy wrote.

As knftables does, an operation is a verb and an object: the table, a chain, a rule (its
typed statements, objects.Rule), a set or map (with its declaration), or some elements of one
set or map."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import NamedTuple

from pyproxy.render import objects
from pyproxy.render.objects import TABLE, ElementValue, Key, SetDecl, element_text, key_text


class Verb(StrEnum):
    ADD = "add"
    FLUSH = "flush"
    DELETE = "delete"


class Table(NamedTuple):
    """Our table (`ip pyproxy` / `ip6 pyproxy`: the family is the transaction's)."""

    comment: str = ""


class Chain(NamedTuple):
    """A chain; a base chain has its (type, hook, priority) and policy accept."""

    name: str
    base: tuple[str, str, int] | None = None


class Rule(NamedTuple):
    """A rule appended to its chain."""

    chain: str
    rule: objects.Rule


class Set(NamedTuple):
    """A set or map; `declaration` None: one found in the kernel that only gets deleted."""

    name: str
    declaration: SetDecl | None = None


class Elements(NamedTuple):
    """Elements of one set or map, (key, value) each (a deletion writes only the keys)."""

    set: str
    elements: tuple[tuple[Key, ElementValue], ...]


Object = Table | Chain | Rule | Set | Elements


class Op(NamedTuple):
    verb: Verb
    obj: Object


def add(obj: Object) -> Op:
    return Op(Verb.ADD, obj)


def flush(obj: Object) -> Op:
    return Op(Verb.FLUSH, obj)


def delete(obj: Object) -> Op:
    return Op(Verb.DELETE, obj)


def line(family: str, op: Op) -> str:
    """One operation as an nft command."""
    verb, obj = op
    where = f"{family} {TABLE}"
    if isinstance(obj, Table):
        if verb is Verb.ADD and obj.comment:
            return f'add table {where} {{ comment "{obj.comment}"; }}'
        return f"{verb} table {where}"
    if isinstance(obj, Chain):
        if verb is Verb.ADD and obj.base is not None:
            kind, hook, priority = obj.base
            return (f"add chain {where} {obj.name} {{ type {kind} hook {hook} priority "
                    f"{priority}; policy accept; }}")
        return f"{verb} chain {where} {obj.name}"
    if isinstance(obj, Rule):
        return f"{verb} rule {where} {obj.chain} {obj.rule.text()}"
    if isinstance(obj, Set):
        declaration = obj.declaration
        kind = "set" if declaration is None else declaration.kind
        if verb is Verb.ADD and declaration is not None:
            return f"add {kind} {where} {obj.name} {{ {declaration.body()} }}"
        return f"{verb} {kind} {where} {obj.name}"
    if verb is Verb.DELETE:
        written = [key_text(key) for key, _ in obj.elements]
    else:
        written = [element_text(key, value) for key, value in obj.elements]
    return f"{verb} element {where} {obj.set} {{ {', '.join(written)} }}"


def script(family: str, ops: Iterable[Op]) -> str:
    """The operations as an nft script, one command a line."""
    return "".join(line(family, op) + "\n" for op in ops)
