"""The pure stages stay pure: the modules from the model to the ruleset (and what they import
of pyproxy) import no I/O library — no API client, no libnftables, no netlink, no YAML
reader, no sockets, no threads — so they run in unit tests as they run in the daemon, and a
change to an I/O shell cannot reach them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pyproxy"

# watch → cache → sync → topology → render → ruleset: the stages that only compute.
PURE = ("model", "convert", "cache", "topology", "balancing", "explain", "render", "ruleset",
        "staging", "trace")
FORBIDDEN = ("kubernetes", "nftables", "pyroute2", "yaml", "threading", "socketserver",
             "subprocess", "http", "urllib", "asyncio", "selectors", "concurrent")
# The socket module's address conversions are computation, not I/O (convert.py uses them).
SOCKET_ALLOWED = {"inet_pton", "inet_ntop", "AF_INET", "AF_INET6"}


def _tree(name: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))


def _imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _closure(names: tuple[str, ...]) -> set[str]:
    """The modules named and every pyproxy module they import, transitively."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [m.split(".", 1)[1] for m in _imports(_tree(name)) if m.startswith("pyproxy.")]
    return seen


@pytest.mark.parametrize("module", sorted(_closure(PURE)))
def test_a_pure_module_imports_no_io(module: str) -> None:
    tree = _tree(module)
    bad = sorted(m for m in _imports(tree) if m.split(".")[0] in FORBIDDEN)
    assert not bad, f"pyproxy/{module}.py imports {bad}"
    if "socket" in _imports(tree):
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "socket"}
        assert used <= SOCKET_ALLOWED, f"pyproxy/{module}.py uses socket.{used - SOCKET_ALLOWED}"


def test_the_pure_stages_do_not_import_the_shells() -> None:
    """Nothing pure reaches the file reader, the kernel, the watches or the daemon."""
    shells = {"snapshot", "nft", "netlink", "conntrack", "watch", "sources", "daemon", "run",
              "cli", "config", "health", "metrics", "debug", "live", "proxier", "runner"}
    assert not _closure(PURE) & shells, sorted(_closure(PURE) & shells)
