"""Run pyproxy's nftables code against the kernel of a test network namespace.

A libnftables context opens its netlink socket when it is created, so a context created on a
thread that has entered a namespace (setns) keeps talking to that namespace afterwards, from
any thread. The test process itself never leaves the root namespace, and never touches its
ruleset.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import IPFamily, NodeConfig
from pyproxy.kernel.nft import OWN_SOCKETS, LibNftables, OwnSockets
from pyproxy.sync.proxier import FamilyProxier

_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def call_in_netns(netns: str, fn: Callable[[], T], timeout: float = 30.0) -> T:
    """Run fn on a short-lived thread that entered the namespace: sockets it creates (a
    libnftables context, a listening server) stay in that namespace afterwards. Threads that
    fn starts inherit the namespace; the test's own threads never leave the root one."""
    made: dict[str, Any] = {}

    def enter_and_call() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            made["result"] = fn()
        except BaseException as err:  # reported on the calling thread
            made["error"] = err

    thread = threading.Thread(target=enter_and_call, daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" in made:
        raise made["error"]
    return made["result"]  # type: ignore[no-any-return]


def libnft_in(netns: str, sockets: OwnSockets = OWN_SOCKETS) -> LibNftables:
    """A LibNftables whose contexts' sockets live in the named namespace."""
    import nftables

    def context() -> Any:
        ctx = call_in_netns(netns, nftables.Nftables)
        ctx.set_echo_output(False)
        return ctx

    return LibNftables(context, sockets)


class NodeProxy:
    """pyproxy programming one node namespace from successive lists of API objects."""

    def __init__(self, netns: str, config: NodeConfig,
                 families: tuple[IPFamily, ...] = (IPFamily.IPv4, IPFamily.IPv6)) -> None:
        nft = libnft_in(netns)
        self.proxiers = [FamilyProxier(f, config, nft) for f in families]

    def apply(self, objects: list[dict[str, Any]], full: bool = False) -> list[Any]:
        state = build_state(objects)
        assert not [s for s in state.skipped if s.invalid], state.skipped
        return [p.sync(state, full=full) for p in self.proxiers]
