"""Whether this process may program the node, checked once before the daemon starts.

nftables, conntrack and the netlink sockets pyproxy reads all need CAP_NET_ADMIN (in the user
namespace owning the network namespace). Without it every sync is refused (EPERM), retried
and refused again, a traceback in the log each time, while /healthz keeps the node in load
balancers; kube-proxy fails the same way. So `pyproxy run` asks first and stops with one line
naming what is missing: the capability, and whether the process is root (a non-root user has
none by default; root in a container may have had it dropped).

`privilege_problem` reads the text of /proc/self/status (pure); `require_privileges` is the
shell around it.
"""

from __future__ import annotations

import os
from pathlib import Path

STATUS = "/proc/self/status"
# linux/capability.h
CAP_NET_ADMIN = 12


class MissingPrivilege(RuntimeError):
    """The process cannot program the node: nothing was changed on the host."""


def effective_capabilities(status: str) -> int:
    """The effective capability set (`CapEff:` of /proc/PID/status, hexadecimal)."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == "CapEff":
            return int(value.strip(), 16)
    raise ValueError("no CapEff line in the process status")


def privilege_problem(status: str, euid: int) -> str | None:
    """Why this process cannot program the node (None: it can), naming what is missing."""
    if effective_capabilities(status) >> CAP_NET_ADMIN & 1:
        return None
    who = ("runs as root (uid 0) but without CAP_NET_ADMIN: it was dropped (a container's "
           "capabilities, capsh, setpriv)" if euid == 0 else
           f"runs as uid {euid}, not root, without CAP_NET_ADMIN")
    return (f"cannot program this node: the process {who}. nftables, conntrack and "
            f"netlink need CAP_NET_ADMIN: run it as root, or give it the capability (the "
            f"DaemonSet's securityContext: privileged: true, or capabilities: add: "
            f"[NET_ADMIN]; systemd: AmbientCapabilities=CAP_NET_ADMIN)")


def require_privileges(status_path: str = STATUS, euid: int | None = None) -> None:
    """Raise MissingPrivilege when the process lacks what programming the node needs."""
    problem = privilege_problem(Path(status_path).read_text(encoding="ascii"),
                                os.geteuid() if euid is None else euid)
    if problem is not None:
        raise MissingPrivilege(problem)
