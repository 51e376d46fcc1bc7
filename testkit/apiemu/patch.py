"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

Strategic merge patch is applied as a merge patch. For the three emulated resources the only
difference is how lists with merge keys (e.g. ``spec.ports`` merged by ``port``) combine; tests
that patch lists send the whole list, which both patch flavours treat identically.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PatchError", "apply_json_patch", "apply_merge_patch"]


class PatchError(ValueError):
    """The patch cannot be applied; the server answers 422 (Invalid)."""


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def _unescape_token(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _split_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"invalid JSON pointer {pointer!r}")
    return [_unescape_token(t) for t in pointer[1:].split("/")]


def _list_index(container: list[Any], token: str, *, for_insert: bool) -> int:
    if for_insert and token == "-":
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r}")
    index = int(token)
    limit = len(container) if for_insert else len(container) - 1
    if index > limit:
        raise PatchError(f"array index {index} out of bounds")
    return index


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise PatchError(f"path component {token!r} does not exist")
            node = node[token]
        elif isinstance(node, list):
            node = node[_list_index(node, token, for_insert=False)]
        else:
            raise PatchError(f"cannot descend into {type(node).__name__} at {token!r}")
    return node


def _get(doc: Any, pointer: str) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        return doc
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {pointer!r} does not exist")
        return parent[last]
    if isinstance(parent, list):
        return parent[_list_index(parent, last, for_insert=False)]
    raise PatchError(f"path {pointer!r} does not exist")


def _add(doc: Any, pointer: str, value: Any) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        return value
    parent = _parent(doc, tokens)
    if isinstance(parent, dict):
        parent[tokens[-1]] = value
    elif isinstance(parent, list):
        parent.insert(_list_index(parent, tokens[-1], for_insert=True), value)
    else:
        raise PatchError(f"cannot add at {pointer!r}")
    return doc


def _remove(doc: Any, pointer: str) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, tokens)
    if isinstance(parent, dict):
        if tokens[-1] not in parent:
            raise PatchError(f"path {pointer!r} does not exist")
        del parent[tokens[-1]]
    elif isinstance(parent, list):
        del parent[_list_index(parent, tokens[-1], for_insert=False)]
    else:
        raise PatchError(f"cannot remove {pointer!r}")
    return doc


def _apply_op(doc: Any, op: dict[str, Any]) -> Any:
    kind = op.get("op")
    path = op.get("path")
    if not isinstance(path, str):
        raise PatchError(f"operation {op!r} has no string 'path'")
    if kind in ("add", "replace", "test") and "value" not in op:
        raise PatchError(f"operation {kind!r} needs a 'value'")
    if kind == "add":
        return _add(doc, path, copy.deepcopy(op["value"]))
    if kind == "remove":
        return _remove(doc, path)
    if kind == "replace":
        _get(doc, path)  # RFC 6902: the target must exist.
        return _add(_remove(doc, path), path, copy.deepcopy(op["value"])) if path else op["value"]
    if kind in ("move", "copy"):
        source = op.get("from")
        if not isinstance(source, str):
            raise PatchError(f"operation {kind!r} needs a string 'from'")
        value = copy.deepcopy(_get(doc, source))
        if kind == "move":
            doc = _remove(doc, source)
        return _add(doc, path, value)
    if kind == "test":
        if _get(doc, path) != op["value"]:
            raise PatchError(f"test operation failed at {path!r}")
        return doc
    raise PatchError(f"unknown operation {kind!r}")


def apply_json_patch(target: Any, patch: Any) -> Any:
    """RFC 6902 on a deep copy of ``target``; all-or-nothing like the real server."""
    if not isinstance(patch, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in patch:
        if not isinstance(op, dict):
            raise PatchError(f"operation {op!r} is not an object")
        doc = _apply_op(doc, op)
    return doc
