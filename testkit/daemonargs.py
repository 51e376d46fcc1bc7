"""`pyproxy run` as a process of its own: the one place that spells its command line.

Where a real process is the point (its RSS, its signals, the installed binary, a node
namespace of its own), the tests, drills, benchmarks and the demo start it with
`DaemonArgs(...).argv()`; in-process they build it with `pyproxy.run.build_daemon(config,
kernel=..., clock=...)`. The defaults are the lab's: node-a, kube-proxy's health and metrics
ports on loopback, no debug socket, a 200 ms minimum and a 5 s full sync period. A field set to
None is not given at all, so a configuration file (`config`) keeps its own value.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

# The virtualenv's entry point, beside the interpreter running the tests.
PYPROXY = str(Path(sys.executable).parent / "pyproxy")


def _flag(name: str) -> dict[str, str]:
    """A field's metadata: given as `name=value`, unless it is None."""
    return {"flag": name}


@dataclass(frozen=True)
class DaemonArgs:
    """What one `pyproxy run` is given: its source (a configuration file, a kubeconfig, a
    snapshot), its node, its periods and its servers; `extra`: flags of a test's own."""

    config: str | Path | None = field(default=None, metadata=_flag("--config"))
    kubeconfig: str | Path | None = field(default=None, metadata=_flag("--kubeconfig"))
    snapshot: str | Path | None = field(default=None, metadata=_flag("--snapshot"))
    node: str | None = field(default="node-a", metadata=_flag("--hostname-override"))
    bind_address: str | None = field(default=None, metadata=_flag("--bind-address"))
    cluster_cidr: str | None = field(default=None, metadata=_flag("--cluster-cidr"))
    min_sync_period: str | None = field(default="200ms", metadata=_flag("--min-sync-period"))
    sync_period: str | None = field(default="5s", metadata=_flag("--sync-period"))
    healthz: str | None = field(default="127.0.0.1:10256", metadata=_flag("--healthz-bind-address"))
    metrics: str | None = field(default="127.0.0.1:10249", metadata=_flag("--metrics-bind-address"))
    debug_socket: str | None = field(default="", metadata=_flag("--debug-socket"))
    extra: tuple[str, ...] = ()
    binary: str = PYPROXY

    def argv(self) -> list[str]:
        """`pyproxy run --flag=value ...` (`=`: an empty value, a server turned off, stays
        one argument)."""
        given = [f"{f.metadata['flag']}={value}" for f in fields(self) if "flag" in f.metadata
                 and (value := getattr(self, f.name)) is not None]
        return [self.binary, "run", *given, *self.extra]
