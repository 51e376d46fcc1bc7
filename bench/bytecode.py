"""The daemon the benches start runs from this checkout (an editable install); an installed
one (the container image, `make install`) has its bytecode compiled by pip. Without it every
start compiles pyproxy's modules again (~0.2 s of a 10k x 10 start, more than the imports
themselves), and a shell with PYTHONDONTWRITEBYTECODE set never caches them."""

from __future__ import annotations

import compileall
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproxy")


def compile_pyproxy() -> None:
    """Write pyproxy's bytecode as installing it would (only what is stale)."""
    if not compileall.compile_dir(PACKAGE, quiet=1):
        raise RuntimeError(f"compiling {PACKAGE} failed")
