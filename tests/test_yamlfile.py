"""The YAML reader (pyproxy/yamlfile.py): what it builds is what PyYAML's safe loader builds,
its strict reading refuses what the configuration's loader refused, and its limits hold."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pyproxy import yamlfile
from pyproxy.yamlfile import MAX_DEPTH, DocumentError, DuplicateKeyError, TooDeepError

KUBECTL_LIST = """\
apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      note: "quoted: text"
      other: 'single'
    creationTimestamp: "2026-11-28T06:00:00Z"
    name: web
    namespace: default
  spec:
    clusterIP: 10.96.0.10
    ports:
    - {name: http, port: 80, protocol: TCP, targetPort: 8080}
    - name: dns
      port: 53
      targetPort: dns
    selector: {}
    sessionAffinity: None
kind: List
metadata:
  resourceVersion: ""
"""

# Every kind of scalar PyYAML's resolver knows, plain and quoted, and the YAML 1.1 corners.
SCALARS = """\
str: text
quoted: "123"
single: '0x1F'
int: 42
negative: -7
octal: 0o17
old_octal: 017
hex: 0x1F
binary: 0b101
underscore: 1_000
sexagesimal: 1:30
float: 1.5
exp: 6.02e+23
inf: .inf
nan_is_a_float: .NaN
true: yes
off: Off
null: ~
empty:
date: 2026-11-28
timestamp: 2026-11-28T06:00:00Z
1: one
2.5: two and a half
? explicit
: key
literal: |
  two
  lines
folded: >
  one
  line
non_specific: ! 12
"""


def standard(text: str) -> list[Any]:
    """What PyYAML's own safe loader (its Python parser) builds."""
    return list(yaml.load_all(text, Loader=yaml.SafeLoader))


class TestSameAsPyYAML:
    @pytest.mark.parametrize("text", [
        pytest.param(KUBECTL_LIST, id="kubectl's List"),
        pytest.param(SCALARS, id="every scalar"),
        pytest.param("a: 1\n---\n---\n- b\n...\n", id="several documents, an empty one"),
        pytest.param("", id="nothing"),
        pytest.param("# only a comment\n", id="a comment"),
        pytest.param("plain\n", id="a scalar document"),
        pytest.param("a: 1\nb: 2\na: 3\n", id="a duplicate key: the last value, first place"),
        pytest.param("{1: a, true: b, 1.0: c}\n", id="keys equal in Python"),
        pytest.param("[[], {}, [[{}]]]\n", id="empty collections"),
        # what the events path leaves to PyYAML's constructor
        pytest.param("a: &x [1, 2]\nb: *x\n", id="anchor and alias"),
        pytest.param("base: &b {x: 1}\nderived:\n  <<: *b\n  y: 2\n", id="merge key"),
        pytest.param("a: !!str 5\nb: !!float 1\n", id="explicit scalar tags"),
        pytest.param("a: !!binary aGVsbG8=\n", id="binary"),
        pytest.param("s: !!set {a, b}\n", id="a set"),
        pytest.param("o: !!omap [a: 1, b: 2]\n", id="an ordered map"),
        pytest.param("= : value\n", id="the value key"),
        pytest.param("a: &s text\n", id="an anchor without alias"),
    ])
    def test_documents(self, text: str) -> None:
        """Plain collections and untagged scalars, built from the events, and what the events
        path leaves to PyYAML's constructor: what PyYAML builds."""
        assert standard(text) == yamlfile.load_all(text)

    def test_aliases_stay_one_object(self) -> None:
        """An alias is the anchored object itself, not a copy (as PyYAML constructs it)."""
        document = yamlfile.load("a: &x [1]\nb: *x\n")
        assert document["a"] is document["b"]

    @settings(max_examples=60, deadline=None)
    @given(st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8)
        | st.floats(allow_nan=False),
        lambda inner: st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=4),
        max_leaves=30), st.booleans())
    def test_whatever_pyyaml_writes(self, data: Any, flow: bool) -> None:
        """Any data PyYAML writes, in block or flow style, reads back as PyYAML reads it."""
        text = yaml.safe_dump(data, default_flow_style=flow, sort_keys=False)
        assert standard(text) == yamlfile.load_all(text)

    def test_json_is_yaml(self) -> None:
        """JSON, as `kubectl -o json` prints it, reads the same through either reader."""
        text = json.dumps(yaml.safe_load(KUBECTL_LIST), indent=4)
        assert yamlfile.load(text) == yamlfile.load_json(text) == json.loads(text)


class TestErrors:
    @pytest.mark.parametrize(("text", "message"), [
        pytest.param("items: [\n", "not valid YAML or JSON: while parsing a flow node: did not "
                     "find expected node content at line 2, column 1", id="unclosed"),
        pytest.param("mode: [nftables\n", "not valid YAML or JSON: while parsing a flow "
                     "sequence at line 1, column 7: did not find expected ',' or ']' at line "
                     "2, column 1", id="where it started and where it failed"),
        pytest.param("a: b\n  c: d\n", "not valid YAML or JSON: mapping values are not "
                     "allowed in this context at line 2, column 4", id="bad indentation"),
        pytest.param("x: \x00\n", "not valid YAML or JSON: unacceptable character #x0000: "
                     "control characters are not allowed at position 3", id="a NUL"),
        pytest.param("a: !!python/object:os.system x\n", "not valid YAML or JSON: could not "
                     "determine a constructor for the tag 'tag:yaml.org,2002:python/object:"
                     "os.system' at line 1, column 4", id="a Python object"),
        pytest.param("a: *nowhere\n", "not valid YAML or JSON: found undefined alias at line "
                     "1, column 4", id="undefined alias"),
        pytest.param("? [a]\n: 1\n", "not valid YAML or JSON: while constructing a mapping at "
                     "line 1, column 1: found unhashable key at line 1, column 3",
                     id="a list as key"),
        pytest.param("a: 2026-13-01\n", "not a valid value: month must be in 1..12",
                     id="a date that is none"),
    ])
    def test_one_line_naming_where(self, text: str, message: str) -> None:
        """A document that cannot be read is one error line, with the line and column."""
        with pytest.raises(DocumentError) as caught:
            yamlfile.load_all(text)
        assert message == str(caught.value)

    def test_a_second_document_where_one_is_expected(self) -> None:
        """`load` takes one document, and says where the second starts."""
        with pytest.raises(DocumentError, match="but found another document at line 2"):
            yamlfile.load("a: 1\n---\nb: 2\n")


class TestStrict:
    @pytest.mark.parametrize(("text", "key", "line"), [
        pytest.param("mode: nftables\nmode: ''\n", "mode", 2, id="top level"),
        pytest.param("a:\n  b: 1\n  c: 2\n  b: 3\n", "b", 4, id="nested"),
        pytest.param('{"a": 1, "a": 2}', "a", 1, id="JSON"),
        pytest.param("1: a\ntrue: b\n", "True", 2, id="equal in Python"),
        pytest.param("base: &b {x: 1}\nd:\n  <<: *b\n  x: 2\n", "x", 4,
                     id="over a merged key, as before"),
    ])
    def test_duplicate_keys_refused(self, text: str, key: str, line: int) -> None:
        """Strict reading refuses a key given twice, naming it and the line of the second."""
        with pytest.raises(DuplicateKeyError) as caught:
            yamlfile.load(text, strict=True)
        assert f"{key}: duplicate field (line {line})" == str(caught.value)

    def test_a_list_key_is_an_error_not_a_crash(self) -> None:
        """A collection as a key is PyYAML's error (the strict check used to raise TypeError)."""
        with pytest.raises(DocumentError, match="found unhashable key"):
            yamlfile.load("? [a]\n: 1\n", strict=True)

    def test_not_strict_keeps_the_last(self) -> None:
        """Without strict, YAML's rule: the last value of a key given twice."""
        assert yamlfile.load("a: 1\na: 2\n") == {"a": 2}


def nested(depth: int, *, flow: bool, anchor: bool = False) -> str:
    """A document of `depth` levels: lists in flow style, or mappings in block style, with a
    scalar at the bottom (that scalar is a level too)."""
    head = "x: &a 1\n" if anchor else ""
    if flow:
        return head + "y: " + "[" * (depth - 2) + "1" + "]" * (depth - 2) + "\n"
    return head + "".join(" " * i + "k:\n" for i in range(depth - 1)) + " " * (depth - 1) + "v\n"


class TestDepth:
    @pytest.mark.parametrize("flow", [True, False], ids=["flow", "block"])
    @pytest.mark.parametrize("anchor", [False, True], ids=["events", "standard path"])
    def test_the_limit(self, flow: bool, anchor: bool) -> None:
        """MAX_DEPTH levels are read, one more is refused, either way the text is read."""
        assert yamlfile.load(nested(MAX_DEPTH, flow=flow, anchor=anchor)) is not None
        with pytest.raises(TooDeepError, match=f"nested deeper than {MAX_DEPTH} levels"):
            yamlfile.load(nested(MAX_DEPTH + 1, flow=flow, anchor=anchor))

    @pytest.mark.parametrize("text", [
        pytest.param("[" * 5000 + "]" * 5000, id="flow"),
        pytest.param("".join(" " * i + "a:\n" for i in range(5000)), id="block"),
        pytest.param("- " * 5000 + "x\n", id="compact sequences"),
        pytest.param(nested(5000, flow=True, anchor=True), id="standard path, flow"),
        pytest.param(nested(5000, flow=False, anchor=True), id="standard path, block"),
    ])
    def test_5000_deep(self, text: str) -> None:
        """5,000 levels: the limit, not a RecursionError (PyYAML's composer recursed)."""
        with pytest.raises(TooDeepError, match=rf"^nested deeper than {MAX_DEPTH} levels"):
            yamlfile.load_all(text)

    def test_json(self) -> None:
        """JSON has the same limit, and 5,000 levels are not json's RecursionError."""
        assert yamlfile.load_json(nested_json(MAX_DEPTH)) is not None
        for depth in (MAX_DEPTH + 1, 5000):
            with pytest.raises(TooDeepError):
                yamlfile.load_json(nested_json(depth))

    def test_empty_at_the_limit(self) -> None:
        """An empty collection at the last level is within it, in JSON as in YAML."""
        text = "[" * MAX_DEPTH + "]" * MAX_DEPTH
        assert yamlfile.load_json(text) == yamlfile.load(text)


def nested_json(depth: int) -> str:
    return "[" * (depth - 1) + "1" + "]" * (depth - 1)


class TestReadLimited:
    def test_within(self, tmp_path: Path) -> None:
        """A file up to the limit is read whole."""
        path = tmp_path / "f"
        path.write_bytes(b"x" * 1024)
        assert yamlfile.read_limited(path, 1024, "a test") == b"x" * 1024

    def test_beyond_names_the_limit(self, tmp_path: Path) -> None:
        """One byte more is refused, naming the limit and what it is for."""
        path = tmp_path / "f"
        path.write_bytes(b"x" * 1025)
        with pytest.raises(yamlfile.TooLargeError) as caught:
            yamlfile.read_limited(path, 1024, "a test")
        assert str(caught.value) == "larger than 1 KiB, the limit for a test"

    def test_a_huge_file_is_not_read(self, tmp_path: Path) -> None:
        """A file far beyond the limit is refused by its size, before any of it is read."""
        path = tmp_path / "sparse"
        with open(path, "wb") as fh:
            fh.truncate(64 << 30)
        with pytest.raises(yamlfile.TooLargeError, match="larger than 1 MiB"):
            yamlfile.read_limited(path, 1 << 20, "a test")

    def test_a_pipe_is_read_up_to_the_limit(self, tmp_path: Path) -> None:
        """A stream with no size (a FIFO) is read up to the limit and one byte, no more."""
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        pid = os.fork()
        if pid == 0:  # the writer, as `kubectl get ... > fifo` would be
            try:
                with open(fifo, "wb") as fh:
                    fh.write(b"y" * 4096)
            finally:
                os._exit(0)
        try:
            with pytest.raises(yamlfile.TooLargeError):
                yamlfile.read_limited(fifo, 1024, "a test")
        finally:
            os.waitpid(pid, 0)
