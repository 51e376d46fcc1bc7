"""docs/logging.md lists every log event the code logs, with its levels and fields, and
nothing else (issue 35, point 4): read from the calls themselves, `log.<level>("event",
field=…)` in every module of pyproxy/ (tests/test_layers.py holds them to that one shape)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyproxy"
DOC = ROOT / "docs" / "logging.md"
LEVELS = ("debug", "info", "warning", "error", "exception", "critical")
# structlog's names for what a call passes: exc_info=True renders the traceback as `exception`
RENDERED = {"exc_info": "exception"}
ROW = re.compile(r"^\| `([a-z0-9_]+)` \| ([a-z, ]+) \| (.*?) \| (.+) \|$")


@dataclass
class Event:
    levels: set[str] = field(default_factory=set)
    fields: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)


def _dict_keys(node: ast.AST | None) -> set[str] | None:
    """The keys of a dict literal with constant string keys (None: not one)."""
    if not isinstance(node, ast.Dict):
        return None
    keys = {key.value for key in node.keys
            if isinstance(key, ast.Constant) and isinstance(key.value, str)}
    return keys if len(keys) == len(node.keys) else None


def _spread_fields(tree: ast.Module, value: ast.expr) -> set[str]:
    """The fields of `**value` in a log call: a name bound to a dict literal in the module,
    or a call of a module function that returns one. Anything else fails the test: the
    check must see every field."""
    if isinstance(value, ast.Name):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id == value.id):
                keys = _dict_keys(node.value)
                if keys is not None:
                    return keys
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == value.func.id:
                returns = [r for r in ast.walk(node) if isinstance(r, ast.Return)]
                if len(returns) == 1:
                    keys = _dict_keys(returns[0].value)
                    if keys is not None:
                        return keys
    raise AssertionError(f"cannot tell the fields of **{ast.unparse(value)}")


def events_in_code() -> dict[str, Event]:
    found: dict[str, Event] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log"):
                continue
            name = node.args[0]
            assert isinstance(name, ast.Constant) and isinstance(name.value, str)
            event = found.setdefault(name.value, Event())
            event.levels.add(node.func.attr)
            event.calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            for keyword in node.keywords:
                if keyword.arg is None:
                    event.fields |= _spread_fields(tree, keyword.value)
                else:
                    event.fields.add(RENDERED.get(keyword.arg, keyword.arg))
    return found


def events_in_doc() -> dict[str, Event]:
    found: dict[str, Event] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        name, levels, fields, _meaning = match.groups()
        assert name not in found, f"{name} is in docs/logging.md twice"
        found[name] = Event(
            {level.strip() for level in levels.split(",")},
            set() if fields == "—" else set(re.findall(r"`([a-z0-9_]+)`", fields)))
    return found


def test_every_event_in_the_code_is_documented_with_its_levels_and_fields() -> None:
    code, doc = events_in_code(), events_in_doc()
    missing = sorted(code.keys() - doc.keys())
    assert not missing, f"not in docs/logging.md: {[(m, code[m].calls) for m in missing]}"
    for name, event in code.items():
        assert doc[name].levels == event.levels, (name, event.calls)
        assert doc[name].fields == event.fields, (name, event.calls)


def test_every_documented_event_is_logged() -> None:
    gone = sorted(events_in_doc().keys() - events_in_code().keys())
    assert not gone, f"docs/logging.md lists events nothing logs: {gone}"


def test_the_reader_sees_every_row() -> None:
    """Each table row of the doc is read (a row the pattern missed would go unchecked)."""
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    assert len(rows) == len(events_in_doc()) > 50


@pytest.mark.parametrize(("source", "fields"), [
    pytest.param('log.info("a", x=1, exc_info=True)', {"x", "exception"}, id="keywords"),
    pytest.param('f = {"x": 1, "y": 2}\nlog.info("a", **f)', {"x", "y"}, id="a dict"),
    pytest.param('def g(o):\n    return {"x": o}\nlog.info("a", **g(1))', {"x"},
                 id="a function returning one"),
])
def test_the_reader_finds_the_fields_of_a_call(source: str, fields: set[str]) -> None:
    tree = ast.parse(source)
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute))
    found = {RENDERED.get(k.arg, k.arg) for k in call.keywords if k.arg}
    for keyword in call.keywords:
        if keyword.arg is None:
            found |= _spread_fields(tree, keyword.value)
    assert found == fields
