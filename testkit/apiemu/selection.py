"""Label and field selectors with the kube-apiserver's grammar and semantics.

Named ``selection`` rather than ``selectors`` so that running anything from this directory can
never shadow the standard library's ``selectors`` module (which ``socketserver`` imports).

Label selectors follow ``k8s.io/apimachinery/pkg/labels`` (``=``, ``==``, ``!=``, ``in``,
``notin``, ``key``, ``!key``, ``>``, ``<``; a comma is AND). Field selectors follow
``k8s.io/apimachinery/pkg/fields`` (``=``, ``==``, ``!=`` with ``\\`` escapes); which field labels
exist is decided per resource by the caller (the real server answers 400 for unknown ones).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FieldRequirement",
    "FieldSelector",
    "LabelRequirement",
    "LabelSelector",
    "SelectorError",
    "parse_field_selector",
    "parse_label_selector",
]


class SelectorError(ValueError):
    """The selector text does not parse; the server turns this into a 400 BadRequest."""


# --- label selectors -------------------------------------------------------------------------

_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Characters that end an identifier token, as in the apiserver's lexer.
_SPECIAL = set(" \t\r\n,()=!<>")
_OPERATORS = ("==", "!=", "=", "!", "(", ")", ",", ">", "<")


def _validate_label_key(key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        raise SelectorError(f"invalid label key {key!r}: prefix must be a DNS subdomain")
    if not name or len(name) > 63 or not _NAME_RE.match(name):
        raise SelectorError(f"invalid label key {key!r}: name part must be a valid label name")


def _validate_label_value(value: str) -> None:
    if value and (len(value) > 63 or not _NAME_RE.match(value)):
        raise SelectorError(f"invalid label value: {value!r}")


@dataclass(frozen=True)
class LabelRequirement:
    """One comma-separated term of a label selector."""

    key: str
    op: str  # "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key, "")
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            # Like the real server: "!=" and "notin" also select objects without the key.
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        return present and _compare_int(value, self.op, int(self.values[0]))


def _compare_int(value: str, op: str, bound: int) -> bool:
    try:
        number = int(value)
    except ValueError:
        return False
    return number > bound if op == "gt" else number < bound


@dataclass(frozen=True)
class LabelSelector:
    """AND of requirements; the empty selector selects everything."""

    requirements: tuple[LabelRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(req.matches(labels) for req in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        op = next((o for o in _OPERATORS if text.startswith(o, i)), None)
        if op is not None:
            tokens.append(op)
            i += len(op)
            continue
        start = i
        while i < len(text) and text[i] not in _SPECIAL:
            i += 1
        tokens.append(text[start:i])
    return tokens


class _LabelParser:
    """Recursive-descent parser over the token list; one instance per selector string."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.pos += 1
        return token

    def fail(self, why: str) -> SelectorError:
        return SelectorError(f"unable to parse requirement: {why} (selector {self.text!r})")

    def identifier(self, what: str) -> str:
        token = self.take()
        if token is None or token in _OPERATORS:
            raise self.fail(f"expected {what}, found {token!r}")
        return token

    def parse(self) -> LabelSelector:
        requirements: list[LabelRequirement] = []
        while self.peek() is not None:
            requirements.append(self.requirement())
            token = self.take()
            if token is None:
                break
            if token != "," or self.peek() is None:
                raise self.fail(f"expected ',' between requirements, found {token!r}")
        return LabelSelector(tuple(requirements))

    def requirement(self) -> LabelRequirement:
        if self.peek() == "!":
            self.take()
            key = self.identifier("label key")
            _validate_label_key(key)
            return LabelRequirement(key, "!")
        key = self.identifier("label key")
        _validate_label_key(key)
        op = self.peek()
        if op is None or op == ",":
            return LabelRequirement(key, "exists")
        self.take()
        if op in ("=", "=="):
            return LabelRequirement(key, "in", (self.value(),))
        if op == "!=":
            return LabelRequirement(key, "notin", (self.value(),))
        if op in (">", "<"):
            return self.numeric(key, "gt" if op == ">" else "lt")
        if op in ("in", "notin"):
            return LabelRequirement(key, op, self.value_set())
        raise self.fail(f"unknown operator {op!r}")

    def value(self) -> str:
        # "key=" is legal and means "the label value is empty".
        token = self.peek()
        if token is None or token == ",":
            return ""
        value = self.identifier("label value")
        _validate_label_value(value)
        return value

    def numeric(self, key: str, op: str) -> LabelRequirement:
        value = self.identifier("integer")
        try:
            int(value)
        except ValueError as exc:
            why = f"for 'gt', 'lt' operators, the value must be an integer: {value!r}"
            raise self.fail(why) from exc
        return LabelRequirement(key, op, (value,))

    def value_set(self) -> tuple[str, ...]:
        if self.take() != "(":
            raise self.fail("expected '(' after set operator")
        # Elements are separated by ',' tokens; an element may be empty ("in (a,)" holds "").
        elements: list[list[str]] = [[]]
        while (token := self.take()) != ")":
            if token is None:
                raise self.fail("unterminated value set")
            if token == ",":
                elements.append([])
            elif token in _OPERATORS:
                raise self.fail(f"unexpected {token!r} in value set")
            else:
                elements[-1].append(token)
        if elements == [[]]:
            raise self.fail("for 'in', 'notin' operators, values set can't be empty")
        values: list[str] = []
        for element in elements:
            if len(element) > 1:
                raise self.fail(f"expected ',' between values, found {element[1]!r}")
            value = element[0] if element else ""
            _validate_label_value(value)
            values.append(value)
        return tuple(values)


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse a ``labelSelector`` query value; raises `SelectorError` on bad input."""
    if text is None or not text.strip():
        return LabelSelector()
    return _LabelParser(text).parse()


# --- field selectors -------------------------------------------------------------------------

FieldGetter = Callable[[Mapping[str, Any]], str]


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    value: str
    negate: bool

    def matches(self, fields: Mapping[str, str]) -> bool:
        return (fields.get(self.field, "") == self.value) != self.negate


@dataclass(frozen=True)
class FieldSelector:
    requirements: tuple[FieldRequirement, ...] = ()

    def matches(self, fields: Mapping[str, str]) -> bool:
        return all(req.matches(fields) for req in self.requirements)

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(req.field for req in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    escaped = False
    for ch in text:
        if escaped:
            current.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if escaped:
        raise SelectorError(f"invalid field selector: trailing backslash in {text!r}")
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    out: list[str] = []
    chars = iter(text)
    for ch in chars:
        if ch != "\\":
            out.append(ch)
            continue
        nxt = next(chars, "")
        if nxt not in ("\\", ",", "="):
            raise SelectorError(f"invalid field selector: invalid escape sequence '\\{nxt}'")
        out.append(nxt)
    return "".join(out)


def _find_operator(term: str) -> tuple[int, str] | None:
    """Position of the first unescaped operator in a term (``!=`` and ``==`` before ``=``)."""
    i = 0
    while i < len(term):
        if term[i] == "\\":
            i += 2
            continue
        for op in ("!=", "==", "="):
            if term.startswith(op, i):
                return i, op
        i += 1
    return None


def _parse_field_term(term: str) -> FieldRequirement:
    found = _find_operator(term)
    if found is None:
        raise SelectorError(f"invalid selector: '{term}'; can't understand '{term}'")
    at, op = found
    field = _unescape(term[:at])
    value = _unescape(term[at + len(op) :])
    return FieldRequirement(field, value, negate=op == "!=")


def parse_field_selector(text: str | None) -> FieldSelector:
    """Parse a ``fieldSelector`` query value (field names are checked by the caller)."""
    if text is None or not text.strip():
        return FieldSelector()
    terms = [t for t in _split_unescaped(text, ",") if t.strip()]
    return FieldSelector(tuple(_parse_field_term(t.strip()) for t in terms))
