"""Importing a module of a package whose `__init__` imports far more than the module needs.

`import kubernetes.client` runs `kubernetes/__init__.py` first, which imports the client's
config loaders (oauthlib, requests, google-auth's helpers), its dynamic client, watch,
stream (websockets), leader election and informers: none of which the daemon uses.
`pyroute2/__init__.py` imports every one of its netlink families (IPDB, NDB, ethtool, WiFi,
IPVS, …) for the two the daemon asks (addresses and routes, conntrack). Measured on the
project's VM (issue 37): 0.06 and 0.09 s of CPU and 7 and 6 MiB resident, out of a start to
the first sync of ~0.7 s and ~90 MiB at 1k services.

`submodule("kubernetes.client")` imports the module with its package's `__init__` deferred:
the package is registered without running it, and runs it the first time anything else is
asked of the package (`kubernetes.config`, `from pyroute2 import IPRoute`), so code that
expects the whole package still gets it. A package already imported is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


class _Deferred(ModuleType):
    """A package whose `__init__` has not run yet. A submodule asked for is imported
    (`from pyroute2 import config`, as pyroute2's own modules do); anything else runs the
    `__init__` first."""

    def __getattr__(self, name: str) -> object:
        if not name.startswith("__") and \
                importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")
        spec = self.__spec__
        self.__class__ = ModuleType  # type: ignore[assignment]  # an ordinary module: runs once
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(self)
        return getattr(self, name)


def submodule(name: str) -> ModuleType:
    """`import name` (a dotted module name), its top-level package's `__init__` deferred
    unless that package is imported already."""
    package = name.partition(".")[0]
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations is not None:
            module = importlib.util.module_from_spec(spec)
            module.__class__ = _Deferred
            sys.modules[package] = module
    return importlib.import_module(name)
