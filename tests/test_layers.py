"""The pure stages stay pure: the modules from the model to the ruleset (and what they import
of pyproxy) import no I/O library — no API client, no libnftables, no netlink, no YAML
reader, no sockets, no threads — so they run in unit tests as they run in the daemon, and a
change to an I/O shell cannot reach them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pyproxy"

# watch → cache → sync → topology → render → ruleset: the stages that only compute.
PURE = ("core.model", "core.convert", "cluster.cache", "core.topology", "core.balancing",
        "core.coexistence",
        "core.explain", "render", "render.ruleset", "render.staging", "render.trace")
FORBIDDEN = ("kubernetes", "nftables", "pyroute2", "yaml", "threading", "socketserver",
             "subprocess", "http", "urllib", "asyncio", "selectors", "concurrent")
# The socket module's address conversions are computation, not I/O (convert.py uses them).
SOCKET_ALLOWED = {"inet_pton", "inet_ntop", "AF_INET", "AF_INET6"}


def _path(name: str) -> Path:
    """pyproxy.<name>'s file: a module, or a package's __init__."""
    base = PACKAGE.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _tree(name: str) -> ast.Module:
    return ast.parse(_path(name).read_text(encoding="utf-8"))


def _imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from pyproxy.cluster import watch` imports a module too
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
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
        todo += [m.split(".", 1)[1] for m in _imports(_tree(name))
                 if m.startswith("pyproxy.") and _path(m.split(".", 1)[1]).exists()]
    return seen


@pytest.mark.parametrize("module", sorted(_closure(PURE)))
def test_a_pure_module_imports_no_io(module: str) -> None:
    tree = _tree(module)
    bad = sorted({m.split(".")[0] for m in _imports(tree)} & set(FORBIDDEN))
    assert not bad, f"{_path(module)} imports {bad}"
    if "socket" in _imports(tree):
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "socket"}
        assert used <= SOCKET_ALLOWED, f"{_path(module)} uses socket.{used - SOCKET_ALLOWED}"


def test_the_pure_stages_do_not_import_the_shells() -> None:
    """Nothing pure reaches the file reader, the kernel, the watches or the daemon."""
    shells = {"cluster.snapshot", "kernel.nft", "kernel.netlink", "kernel.conntrack",
              "cluster.watch", "cluster.sources", "sync.node", "run", "cli", "config",
              "serve.health", "serve.metrics", "serve.debug", "serve.live", "sync.proxier",
              "sync.runner"}
    assert not _closure(PURE) & shells, sorted(_closure(PURE) & shells)


def test_the_store_and_the_applier_take_the_vocabulary_not_the_renderer() -> None:
    """The slot store, staging and the applier consume what rendering produces: they import
    its vocabulary (render/objects.py), not the renderer."""
    for module in ("render.ruleset", "render.staging", "kernel.nft"):
        imported = _imports(_tree(module))
        assert "pyproxy.render.services" not in imported, module
        assert "pyproxy.render.objects" in imported, module


def test_the_package_does_not_import_the_test_kit() -> None:
    """The test kit (testkit/), the drills, the benchmarks and the demo sit beside the
    package and import it; no pyproxy module imports them back."""
    outside = {"testkit", "tests", "drills", "bench", "demo"}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = {m.split(".")[0] for m in _imports(tree)}
        assert not found & outside, f"{path} imports {sorted(found & outside)}"


LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "msg"}


def test_log_events_are_constant_snake_case_names() -> None:
    """One log event style: `log.info("sync_completed", key=value)`, the event a constant
    snake_case name and the data key/values (never a message built with an f-string)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log"):
                event = node.args[0] if node.args else None
                if not (isinstance(event, ast.Constant) and isinstance(event.value, str)
                        and re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", event.value)):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, bad


def test_loggers_are_named_after_their_module() -> None:
    """`structlog.get_logger(__name__)` everywhere: one naming rule, which a processor or a
    filter can rely on (`pyproxy.cluster.watch`, not a name chosen per file)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get_logger"):
                named = (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                         and node.args[0].id == "__name__")
                if not named:
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, bad
