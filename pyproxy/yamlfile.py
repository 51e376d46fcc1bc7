"""YAML (and JSON, a subset of it) documents read at C speed, within limits: the one reader of
the configuration file and of cluster snapshots.

libyaml parses (PyYAML's C extension: the wheel has it built in, as Debian's python3-yaml
does; without it, PyYAML's own parser does, slowly, with the same results); PyYAML's
resolver and SafeConstructor decide what every value is. PyYAML's own pure-Python parser
took 16 times as long as `json` on a snapshot (issue 39: 12.3 against 0.73 s for `explain`
on 3,000 Services), and going through libyaml alone is not enough: composing a document
into PyYAML's nodes and constructing it from them costs three times the parsing and holds
the whole node tree (two position marks per scalar) in memory until the end. So the common
case is built straight from libyaml's events: plain block and flow collections, scalars
without an explicit tag, as `kubectl -o yaml` and every hand-written configuration use
them. Anything else (an anchor or alias, an explicit tag, a merge key `<<`, a key that is a
collection, a duplicate key in strict reading, any error) sends the whole text through
PyYAML's standard path (libyaml again, then nodes), which gives the answer and raises the
error. The fast path never decides anything the standard one would not: it skips the nodes.

Limits, both paths (issue 35): nesting deeper than MAX_DEPTH levels is refused (PyYAML's
composer is recursive: 5,000 levels were a RecursionError), and `read_limited` refuses a
file larger than the limit its caller names before reading it whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable
from typing import Any

import yaml
from yaml.events import (
    DocumentEndEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
    StreamStartEvent,
)
from yaml.nodes import MappingNode, ScalarNode

# Levels of nodes, the document's root the first and a scalar a level too (as PyYAML's
# composer descends). Kubernetes objects stay well under 20, managedFields included; the
# interpreter's recursion limit (1,000) is far above, which code reading a document may
# still come near.
MAX_DEPTH = 100

_BASE: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_STR = "tag:yaml.org,2002:str"
# The tags a plain scalar resolves to whose constructor is a pure function of the text (the
# others, `merge` and `value`, change the mapping they are in).
_PLAIN_TAGS = frozenset({_STR, "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                         "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null",
                         "tag:yaml.org,2002:timestamp"})
# libyaml's own nesting limit (1,000 levels), met before ours in flow collections: its
# scanner reads ahead over the brackets before the first event reaches us.
_LIBYAML_DEPTH = "exceeded maximum nesting depth"


class DocumentError(ValueError):
    """The text is not a document within the limits. `str()` is one line naming the
    problem and where (line numbers from 1), without a file name: the caller adds it.
    Text that is not YAML at all: "not valid YAML or JSON: " and the parser's complaint."""


class DuplicateKeyError(DocumentError):
    """A mapping with one key twice (strict reading only)."""

    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"{key}: duplicate field (line {line})")
        self.key = key
        self.line = line


class TooDeepError(DocumentError):
    """Nesting beyond MAX_DEPTH."""

    def __init__(self, line: int | None = None) -> None:
        where = f" at line {line}" if line is not None else ""
        super().__init__(f"nested deeper than {MAX_DEPTH} levels (the limit){where}")


class TooLargeError(DocumentError):
    """A file beyond the caller's size limit."""


class _Loader(_BASE):  # type: ignore[valid-type,misc]
    """PyYAML's safe loader (libyaml's when there is one), depth-limited: the composer tells
    the resolver each level it enters and leaves, before it recurses into the level."""

    strict = False

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def descend_resolver(self, current_node: Any, current_index: Any) -> None:
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise TooDeepError

    def ascend_resolver(self) -> None:
        self._depth -= 1


class _StrictLoader(_Loader):
    """Duplicate keys refused: YAML keeps the last one silently, kube-proxy's strict
    decoding refuses them."""

    strict = True


def _unique_mapping(loader: _StrictLoader, node: MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):
            continue  # construct_mapping says it is unhashable
        if key in seen:
            raise DuplicateKeyError(key, key_node.start_mark.line + 1)
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load(text: str, *, strict: bool = False) -> Any:
    """The one document of `text` (None when empty). strict: duplicate keys refused."""
    documents = load_all(text, strict=strict)
    if len(documents) > 1:  # PyYAML says where the second one starts
        return _standard(text, strict=strict, single=True)[0]
    return documents[0] if documents else None


def load_all(text: str, *, strict: bool = False) -> list[Any]:
    """Every document of `text`, in order (an empty document is None, as PyYAML has it)."""
    loader = (_StrictLoader if strict else _Loader)(text)
    try:
        return _build(loader)
    except DocumentError:
        raise
    except (_Fallback, yaml.YAMLError, ValueError, TypeError):
        pass  # the standard path decides, and says what is wrong
    finally:
        loader.dispose()
    return _standard(text, strict=strict, single=False)


def load_json(text: str) -> Any:
    """A JSON text, with the YAML reader's depth limit (the decoder is recursive too)."""
    try:
        document = json.loads(text)
    except RecursionError:
        raise TooDeepError from None
    _check_depth(document)
    return document


def read_limited(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of a file of at most `limit` bytes; a larger one is refused before it is
    read whole (a pipe or a file still growing too: at most limit + 1 bytes are read).
    `what` names the limit in the error ("a snapshot")."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size <= limit:  # 0 for a pipe
            data = fh.read(limit + 1)
            if len(data) <= limit:
                return data
    raise TooLargeError(f"larger than {_size(limit)}, the limit for {what}")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


class _Fallback(Exception):
    """The fast path met what only PyYAML's standard path constructs."""


def _build(loader: _Loader) -> list[Any]:
    """The documents built from the parser's events, in one pass over them. Raises
    _Fallback on anything outside plain collections and untagged scalars."""
    # Everything the loop touches is a local: a million events, each a few lookups.
    get_event = loader.get_event
    resolve = loader.resolve
    constructors = loader.yaml_constructors
    scalar, mapping_start, sequence_start = ScalarEvent, MappingStartEvent, SequenceStartEvent
    mapping_end, sequence_end = MappingEndEvent, SequenceEndEvent
    fallback, limit, plain_tags, strict = _Fallback, MAX_DEPTH, _PLAIN_TAGS, loader.strict
    plain_values: dict[str, Any] = {}  # a plain scalar's value by its text
    documents: list[Any] = []
    # The collections being built, innermost last: a list, or a mapping's keys and values
    # in one flat list (made a dict at its end, as construct_mapping does: last one wins).
    stack: list[list[Any]] = []
    top: list[Any] = documents
    append = top.append
    depth = 0  # the collections open
    if type(get_event()) is not StreamStartEvent:
        raise _Fallback
    while True:
        event = get_event()
        kind = type(event)
        if kind is scalar:
            if event.anchor is not None:
                raise fallback
            if depth >= limit:
                raise TooDeepError(event.start_mark.line + 1)
            value = event.value
            # Resolved by its text when plain, or tagged "!" (libyaml and PyYAML's parser
            # both mark those implicit), as the composer does; quoted: a string.
            if event.implicit[0]:
                got = plain_values.get(value, fallback)
                if got is fallback:
                    tag = resolve(ScalarNode, value, event.implicit)
                    if tag not in plain_tags:
                        raise fallback
                    got = value if tag == _STR else constructors[tag](
                        loader, ScalarNode(tag, value, event.start_mark, event.end_mark))
                    plain_values[value] = got
                append(got)
            elif event.tag is None:
                append(value)
            else:
                raise fallback
        elif kind is mapping_start or kind is sequence_start:
            if event.anchor is not None or (event.tag is not None and event.tag != "!"):
                raise fallback
            if depth >= limit:
                raise TooDeepError(event.start_mark.line + 1)
            depth += 1
            stack.append(top)
            top = []
            append = top.append
        elif kind is mapping_end:
            items = top
            top = stack.pop()
            append = top.append
            depth -= 1
            pairs = iter(items)  # key, value, key, value…: libyaml gives them in pairs
            try:
                done = dict(zip(pairs, pairs, strict=True))
            except TypeError:  # a key that is a collection: PyYAML says it is unhashable
                raise fallback from None
            if strict and 2 * len(done) != len(items):
                raise fallback  # a duplicate: the strict constructor names it
            append(done)
        elif kind is sequence_end:
            items = top
            top = stack.pop()
            append = top.append
            depth -= 1
            append(items)
        elif kind is StreamEndEvent:
            return documents
        elif kind is not DocumentStartEvent and kind is not DocumentEndEvent:
            raise fallback  # an alias


def _standard(text: str, *, strict: bool, single: bool) -> list[Any]:
    """PyYAML's own path (libyaml, nodes, SafeConstructor), its errors as DocumentError."""
    loader = (_StrictLoader if strict else _Loader)(text)
    try:
        if single:
            return [loader.get_single_data()]
        documents = []
        while loader.check_node():
            documents.append(loader.get_data())
        return documents
    except yaml.MarkedYAMLError as err:
        if err.problem == _LIBYAML_DEPTH:
            mark = err.problem_mark
            raise TooDeepError(mark.line + 1 if mark is not None else None) from None
        raise DocumentError(f"not valid YAML or JSON: {_problem(err)}") from None
    except yaml.reader.ReaderError as err:  # a character YAML does not allow
        reason = str(err).splitlines()[0]
        raise DocumentError(f"not valid YAML or JSON: {reason} at position {err.position}"
                            ) from None
    except yaml.YAMLError as err:
        raise DocumentError(f"not valid YAML or JSON: {err}") from None
    except DocumentError:
        raise
    except ValueError as err:  # a constructor's: a date that is none (2024-13-01), an int
        raise DocumentError(f"not a valid value: {err}") from None  # of 5,000 digits
    except RecursionError:  # the pure-Python parser, deep in a flow collection
        raise TooDeepError from None
    finally:
        loader.dispose()


def _problem(err: yaml.MarkedYAMLError) -> str:
    """The parser's complaint and where, on one line (its own text names "<unicode string>"
    and repeats the line): "while parsing a flow sequence at line 3, column 7: did not find
    expected ',' or ']' at line 4, column 1"."""
    text = str(err.problem or err)
    mark, context_mark = err.problem_mark, err.context_mark
    if mark is not None:
        text += f" at {_at(mark)}"
    if err.context:
        where = (f" at {_at(context_mark)}" if context_mark is not None and (
            mark is None or (mark.line, mark.column) != (context_mark.line, context_mark.column))
                 else "")
        text = f"{err.context}{where}: {text}"
    return text


def _at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _check_depth(document: Any) -> None:
    """TooDeepError when `document` has nodes deeper than MAX_DEPTH levels."""
    level = [document]
    for _ in range(MAX_DEPTH - 1):
        children: list[Any] = []
        for value in level:
            if type(value) is dict:
                children.extend(value.values())
            elif type(value) is list:
                children.extend(value)
        level = [value for value in children if type(value) is dict or type(value) is list]
        if not level:
            return
    if any(level):  # a collection at MAX_DEPTH with something in it
        raise TooDeepError
