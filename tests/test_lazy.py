"""pyproxy/lazy.py: a package's module imported with the package's `__init__` deferred."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(code: str) -> str:
    """In a fresh interpreter: the packages here must not be imported yet."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_module_comes_without_its_packages_init_which_runs_when_asked_for() -> None:
    assert run("""
        import sys
        from pyproxy.lazy import submodule
        client = submodule("kubernetes.client")
        client.ApiClient(client.Configuration())
        print("kubernetes.config" in sys.modules, "kubernetes.watch" in sys.modules)
        import kubernetes
        kubernetes.watch  # a submodule asked for: imported alone
        print("kubernetes.config" in sys.modules, "kubernetes.watch" in sys.modules)
        # anything else asked of the package: its __init__ runs
        print(kubernetes.__version__ == client.__version__, "kubernetes.config" in sys.modules)
    """).splitlines() == ["False False", "False True", "True True"]


def test_from_package_import_name_gets_the_whole_package() -> None:
    assert run("""
        from pyproxy.lazy import submodule
        linux = submodule("pyroute2.iproute.linux")
        from pyroute2 import IPRoute, NFCTSocket
        print(IPRoute is linux.IPRoute, NFCTSocket.__name__)
    """) == "True NFCTSocket"


def test_a_package_imported_already_is_left_as_it_is() -> None:
    assert run("""
        import pyroute2
        from pyproxy.lazy import submodule
        submodule("pyroute2.iproute.linux")
        import sys
        print(type(sys.modules["pyroute2"]).__name__, hasattr(pyroute2, "NDB"))
    """) == "module True"
