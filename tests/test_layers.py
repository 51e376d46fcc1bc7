"""The layers point down, and the pure stages stay pure.

Direction: each package imports only from itself and the layers below it (`LAYERS`), so a
change to a shell (the daemon, the servers) cannot reach the stages under it, and a lower
stage can be read, tested and reused without the ones above.

Purity: the modules from the model to the ruleset (and what they import of pyproxy) import
no I/O library — no API client, no libnftables, no netlink, no YAML reader, no sockets, no
threads — so they run in unit tests as they run in the daemon."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pyproxy"

# The packages (and top-level modules) from the bottom up. Each imports only from itself and
# the layers below; two packages on one layer do not import each other. The order is the data
# flow's: the model; the configuration, in the model's terms; the cluster as the API gives it
# and the ruleset computed from a state (side by side: neither needs the other); the kernel,
# which applies what render computed; sync, which decides what to apply when; serve, which
# reads the sync layer for health, metrics and the debug socket; the daemon, which builds all
# of it; the commands.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("logs", "version", "memory", "lazy"),  # process housekeeping: import nothing of pyproxy
    ("yamlfile",),  # documents read within limits: the configuration file, snapshots
    ("core",),
    ("config",),
    ("cluster", "render"),
    ("kernel",),
    ("sync",),
    ("serve",),
    ("run",),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}

# watch → cache → sync → topology → render → ruleset: the stages that only compute.
PURE = ("core.model", "core.convert", "core.plan", "cluster.cache", "core.topology",
        "core.balancing", "core.outliers", "core.attempts", "core.coexistence",
        "core.conntrack", "core.departed", "core.explain", "render", "render.connection_keys",
        "render.ruleset", "render.staging", "render.trace")
FORBIDDEN = ("kubernetes", "nftables", "pyroute2", "yaml", "threading", "socketserver",
             "subprocess", "http", "urllib", "asyncio", "selectors", "concurrent")
# The socket module's address conversions are computation, not I/O (convert.py uses them),
# and its protocol numbers constants (core/conntrack.py).
SOCKET_ALLOWED = {"inet_pton", "inet_ntop", "AF_INET", "AF_INET6", "IPPROTO_TCP", "IPPROTO_UDP"}


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


def _layer_of(name: str) -> str:
    """The layer entry of pyproxy.<name>: its package, or the module itself at the top."""
    return name.split(".")[0]


def _modules() -> list[str]:
    """Every pyproxy module, dotted below pyproxy (`cluster.watch`, `run`)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _against_the_layers(module: str, imported: set[str]) -> list[str]:
    """The pyproxy modules of `imported` that `module` may not import: any from its own layer
    but another package, or from a layer above."""
    own = _layer_of(module)
    bad = []
    for name in sorted(imported):
        if not name.startswith("pyproxy."):
            continue
        target = _layer_of(name.split(".", 1)[1])
        if target != own and RANK[target] >= RANK[own]:
            bad.append(name)
    return bad


def test_every_package_has_its_layer() -> None:
    """A new package (or top-level module) is placed in LAYERS, not left out of the check."""
    missing = sorted({_layer_of(m) for m in _modules()} - RANK.keys())
    assert not missing, f"add {missing} to LAYERS"


@pytest.mark.parametrize("module", _modules())
def test_a_module_imports_only_from_its_layer_and_below(module: str) -> None:
    """Imports inside functions and under TYPE_CHECKING count too: they are dependencies all
    the same (a Protocol in the lower layer is the way to name a higher one's object)."""
    bad = _against_the_layers(module, _imports(_tree(module)))
    assert not bad, f"{_path(module)} imports {bad}, which is not below {_layer_of(module)}"


def test_imports_are_absolute() -> None:
    """The layer check reads absolute imports; a relative one would pass it unseen."""
    relative = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                for path in sorted(PACKAGE.rglob("*.py"))
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, relative


def test_no_module_imports_another_modules_private_names() -> None:
    """A name another module needs is part of its public surface: no `from pyproxy.x import
    _name`."""
    private = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module}.{alias.name}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyproxy")
               for alias in node.names
               if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not private, private


@pytest.mark.parametrize(("module", "imported", "refused"), [
    ("cluster.sources", "pyproxy.sync.node", True),  # up
    ("kernel.nlsets", "pyproxy.serve.connections", True),  # up
    ("cluster.watch", "pyproxy.render.objects", True),  # a sibling on the same layer
    ("kernel.nft", "pyproxy.render.objects", False),  # down
    ("serve.live", "pyproxy.serve.connections", False),  # its own package
    ("run", "pyproxy.logs", False),  # down to the housekeeping
    ("logs", "pyproxy.core.model", True),
])
def test_the_layer_check_refuses_an_import_that_does_not_point_down(
        module: str, imported: str, refused: bool) -> None:
    assert bool(_against_the_layers(module, {imported})) == refused


def test_the_pure_stages_do_not_import_the_shells() -> None:
    """Nothing pure reaches the file reader, the kernel, the watches or the daemon."""
    shells = {"cluster.snapshot", "kernel.nft", "kernel.libnftables", "kernel.netlink",
              "cluster.watch", "cluster.sources", "sync.node", "run", "cli", "config",
              "serve.health", "serve.metrics", "serve.debug", "serve.live", "sync.proxier",
              "sync.runner"}
    assert not _closure(PURE) & shells, sorted(_closure(PURE) & shells)


def test_the_store_and_the_applier_take_the_vocabulary_not_the_renderer() -> None:
    """The slot store, staging and the applier consume what rendering produces: they import
    its vocabulary (render/objects.py), not the renderer."""
    for module in ("render.ruleset", "render.staging", "sync.applier"):
        imported = _imports(_tree(module))
        assert "pyproxy.render.services" not in imported, module
        assert "pyproxy.render.objects" in imported, module


@pytest.mark.parametrize("folder", [PACKAGE, PACKAGE.parent / "image"], ids=["pyproxy", "image"])
def test_the_product_does_not_import_the_test_kit(folder: Path) -> None:
    """The test kit (testkit/), the drills, the benchmarks and the demo sit beside the
    package and import it; no pyproxy module imports them back, nor does `make image`'s
    builder (image/), which ships the product (the test kit's cluster images import it)."""
    outside = {"testkit", "tests", "drills", "bench", "demo"}
    for path in sorted(folder.rglob("*.py")):
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


def test_no_module_is_a_drawer() -> None:
    """Issue 36: no file under pyproxy/ over 600 lines, and run.py, which only wires the
    daemon's parts (each in its stage's package), at most 250."""
    root = Path(__file__).resolve().parent.parent / "pyproxy"
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines())
             for p in root.rglob("*.py")}
    assert not {name: n for name, n in sizes.items() if n > 600}
    assert sizes["run.py"] <= 250


# `pyproxy run` that only acts and exits: no daemon to spell a command line for.
ONE_SHOT = {"--cleanup", "--init-only", "--version"}


def test_one_place_spells_the_daemons_command_line() -> None:
    """Every test, drill, benchmark and the demo that starts `pyproxy run` as a process of its
    own gets its command line from testkit/daemonargs.py (in-process: build_daemon), so a
    flag is renamed in one place: no other list starts [PYPROXY, "run", ...]."""
    root = PACKAGE.parent
    spelled = []
    for folder in ("tests", "testkit", "drills", "bench", "demo"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name == "daemonargs.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.List) or len(node.elts) < 2:
                    continue
                first, second = node.elts[:2]
                words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if (isinstance(first, ast.Name) and first.id.lower() == "pyproxy"
                        and isinstance(second, ast.Constant) and second.value == "run"
                        and not words & ONE_SHOT):
                    spelled.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not spelled, spelled
