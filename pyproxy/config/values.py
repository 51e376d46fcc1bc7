"""The values of the configuration: a value's type as the file spells it (JSON types) and as
a flag spells it (text), checked as kube-proxy's strict decoding checks it, and Go durations.

`ValueType` is the type of a setting or of a file field; `from_json` checks a file value against
it, `from_flag` reads a flag's text as the value the same field would have in the file.
Durations are in seconds (float) in pyproxy and Go duration strings (`30s`, `1m0s`, `500ms`) in
the file and in flags: `parse_duration`, `format_duration`. `ConfigError` is what a
configuration that cannot be used raises, whichever module finds it.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from fractions import Fraction
from typing import Any


class ConfigError(ValueError):
    """The configuration cannot be used. `problems`: every one found, each naming the field
    or flag at fault (and the file, when there is one); the message is one a line.
    `warnings`: what was found beside them that would only be warned about (unknown fields,
    settings accepted but not applied), so that `config check` reports those too."""

    def __init__(self, *problems: str, warnings: tuple[str, ...] = ()) -> None:
        super().__init__("\n".join(problems))
        self.problems: tuple[str, ...] = problems
        self.warnings = warnings


# ---------------------------------------------------------------------------------------------
# Go durations


_NS_PER_UNIT = {
    "ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000,
    "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
}
# One component of a Go duration: digits, optional fraction, unit (anything up to a digit/dot).
_DURATION_PART = re.compile(r"(\d*)(?:\.(\d*))?([^\d.]*)")
_MAX_NS = 2**63 - 1  # time.Duration is an int64 of nanoseconds


def parse_duration(text: str) -> float:
    """A Go duration string (`time.ParseDuration`) in seconds: `1h`, `2h30m`, `1m0s`, `500ms`,
    `1.5s`, `-2s`, or `0`. As in Go, every component needs a unit, and fractions are truncated
    to whole nanoseconds. Raises ValueError with Go's wording."""
    rest, negative = text, False
    if rest[:1] in ("-", "+"):
        negative, rest = rest[0] == "-", rest[1:]
    if rest == "0":
        return 0.0
    if not rest:
        raise ValueError(f"invalid duration {text!r}")
    total, pos = 0, 0
    while pos < len(rest):
        match = _DURATION_PART.match(rest, pos)
        assert match is not None  # every group is optional
        whole, fraction, unit = match.groups()
        if not whole and not fraction:
            raise ValueError(f"invalid duration {text!r}")
        if not unit:
            raise ValueError(f"missing unit in duration {text!r}")
        if unit not in _NS_PER_UNIT:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        fraction = fraction or ""
        amount = Fraction(int(whole or "0")) + Fraction(int(fraction or "0"), 10 ** len(fraction))
        total += int(amount * _NS_PER_UNIT[unit])
        pos = match.end()
    if total > _MAX_NS:
        raise ValueError(f"invalid duration {text!r}: out of range")
    return (-total if negative else total) / 1e9


def format_duration(seconds: float) -> str:
    """Seconds as Go prints a time.Duration: `0s`, `500ms`, `30s`, `1m30s`, `1h0m0s`."""
    ns = round(seconds * 1e9)
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    if ns == 0:
        return "0s"
    if ns < 1_000_000_000:
        unit = "ms" if ns >= 1_000_000 else "µs" if ns >= 1_000 else "ns"
        return f"{sign}{_decimal(ns, _NS_PER_UNIT[unit])}{unit}"
    hours, ns = divmod(ns, _NS_PER_UNIT["h"])
    minutes, ns = divmod(ns, _NS_PER_UNIT["m"])
    text = f"{_decimal(ns, _NS_PER_UNIT['s'])}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _decimal(value: int, scale: int) -> str:
    whole, fraction = divmod(value, scale)
    if not fraction:
        return str(whole)
    digits = str(fraction).rjust(len(str(scale)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}"


# ---------------------------------------------------------------------------------------------
# Value types: how a value is spelled in the file (JSON types) and in a flag (text)


class ValueType(StrEnum):
    STRING = "string"
    BOOL = "boolean"
    INT32 = "int32"
    UINT32 = "uint32"
    NUMBER = "number"
    DURATION = "duration"
    FLUSH = "duration or nanoseconds"  # logging.flushFrequency: a Go string or an integer
    STRINGS = "list of strings"
    GATES = "map of string to boolean"
    QUANTITY = "quantity"
    VMODULE = "list of {filePattern, verbosity}"


_INT_RANGES = {ValueType.INT32: (-(2**31), 2**31 - 1), ValueType.UINT32: (0, 2**32 - 1)}
_GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # strconv.ParseBool
_GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")
_QUANTITY = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?")
_DURATION_HINT = "a duration such as 30s, 1m0s, 500ms or 2h30m"


def describe(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string",
             list: "list", dict: "object"}
    name = names.get(type(value), type(value).__name__)
    if isinstance(value, (list, dict)):
        return name
    shown = json.dumps(value) if isinstance(value, (bool, int, float, str)) else repr(value)
    return f"{name} {shown}"


def _wrong(expected: str, value: object) -> ValueError:
    return ValueError(f"expected {expected}, got {describe(value)}")


def from_json(kind: ValueType, value: object) -> Any:
    """A file value checked against its Go type (strict, as encoding/json is: no strings for
    numbers, no numbers for durations)."""
    if kind in (ValueType.STRING, ValueType.QUANTITY) and isinstance(value, str):
        if kind is ValueType.QUANTITY and not _QUANTITY.fullmatch(value):
            raise _wrong(_expected(kind), value)
        return value
    if kind is ValueType.BOOL and isinstance(value, bool):
        return value
    if kind in _INT_RANGES and isinstance(value, int) and not isinstance(value, bool):
        return _int_in_range(kind, value)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind in (ValueType.NUMBER, ValueType.QUANTITY) and is_number:
        return value
    if kind in (ValueType.DURATION, ValueType.FLUSH) and isinstance(value, str):
        return _duration(value)
    if kind is ValueType.FLUSH and isinstance(value, int) and not isinstance(value, bool):
        return value / 1e9
    if kind is ValueType.STRINGS and isinstance(value, list):
        if not all(isinstance(item, str) for item in value):
            raise _wrong("a list of strings", value)
        return list(value)
    if kind is ValueType.GATES and isinstance(value, dict):
        for name, enabled in value.items():
            if not isinstance(name, str) or not isinstance(enabled, bool):
                raise ValueError(f"expected feature name: true|false, got {name!r}: {enabled!r}")
        return dict(value)
    if kind is ValueType.VMODULE and isinstance(value, list):
        return [_vmodule_item(item) for item in value]
    raise _wrong(_expected(kind), value)


_EXPECTED = {
    ValueType.STRING: "a string",
    ValueType.BOOL: "a boolean (true or false)",
    ValueType.INT32: "an integer (int32)",
    ValueType.UINT32: "a non-negative integer (uint32)",
    ValueType.NUMBER: "a number",
    ValueType.DURATION: f"{_DURATION_HINT} (a string)",
    ValueType.FLUSH: f"{_DURATION_HINT}, or an integer of nanoseconds",
    ValueType.STRINGS: "a list of strings",
    ValueType.GATES: "a map of feature names to true or false",
    ValueType.QUANTITY: "a quantity such as 0 or 64Ki",
    ValueType.VMODULE: "a list of {filePattern, verbosity}",
}


def _expected(kind: ValueType) -> str:
    return _EXPECTED[kind]


def _int_in_range(kind: ValueType, value: int) -> int:
    low, high = _INT_RANGES[kind]
    if not low <= value <= high:
        raise _wrong(f"an integer in {low}..{high} ({kind.value})", value)
    return value


def _vmodule_item(item: object) -> dict[str, Any]:
    if not isinstance(item, dict) or set(item) - {"filePattern", "verbosity"}:
        raise _wrong("{filePattern: string, verbosity: integer} items", item)
    if not isinstance(item.get("filePattern", ""), str):
        raise _wrong("a string filePattern", item["filePattern"])
    from_json(ValueType.UINT32, item.get("verbosity", 0))
    return item


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise ValueError(f"{err}; expected {_DURATION_HINT}") from None


def from_flag(kind: ValueType, text: str) -> Any:
    """A flag's text as the value the same field would have in the file."""
    if kind is ValueType.STRING:
        return text
    if kind is ValueType.BOOL:
        if text not in _GO_TRUE + _GO_FALSE:
            raise ValueError(f"expected true or false, got {text!r}")
        return text in _GO_TRUE
    if kind in _INT_RANGES:
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        return _int_in_range(kind, number)
    if kind is ValueType.NUMBER:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if kind is ValueType.DURATION:
        return _duration(text)
    if kind is ValueType.STRINGS:
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind is ValueType.GATES:
        return _gates_flag(text)
    if kind is ValueType.QUANTITY:
        if not _QUANTITY.fullmatch(text):
            raise ValueError(f"expected {_expected(kind)}, got {text!r}")
        return text
    if kind is ValueType.VMODULE:
        return _vmodule_flag(text)
    raise AssertionError(f"no flag has type {kind}")


def _gates_flag(text: str) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or value.strip() not in _GO_TRUE + _GO_FALSE:
            raise ValueError(f"expected Name=true|false[,...], got {item!r}")
        gates[name.strip()] = value.strip() in _GO_TRUE
    return gates


def _vmodule_flag(text: str) -> list[dict[str, Any]]:
    items = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        pattern, eq, level = item.partition("=")
        if not eq or not pattern or not level.isdigit():
            raise ValueError(f"expected pattern=N[,...], got {item!r}")
        items.append({"filePattern": pattern, "verbosity": int(level)})
    return items
