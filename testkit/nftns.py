"""Run pyproxy's nftables code against the kernel of a test network namespace.

A libnftables context opens its netlink socket when it is created, so a context created on a
thread that has entered a namespace (setns, testkit/inproc.py) keeps talking to that namespace
afterwards, from any thread. The test process itself never leaves the root namespace, and
never touches its ruleset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import ClusterState, IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import SyncPlan
from pyproxy.kernel.libnftables import OWN_SOCKETS, LibNftables, OwnSockets
from pyproxy.kernel.nlelements import netlink_socket
from pyproxy.sync.proxier import FamilyProxier, desired_state, node_families, script_of
from testkit.inproc import call_in_netns
from testkit.netlab import Netns


def libnft_in(netns: str, sockets: OwnSockets = OWN_SOCKETS,
              raw_elements: bool = True, kind: type[LibNftables] = LibNftables) -> LibNftables:
    """A LibNftables (or `kind` of it) whose contexts' sockets, and the raw netlink socket
    its element edits use (unless `raw_elements` is false: then libnftables makes them),
    live in the named namespace."""
    import nftables

    def context() -> Any:
        ctx = call_in_netns(netns, nftables.Nftables)
        ctx.set_echo_output(False)
        return ctx

    def socket_in_netns() -> Any:
        return call_in_netns(netns, netlink_socket)

    return kind(context, sockets, netlink=socket_in_netns if raw_elements else None,
                queries=socket_in_netns)


class NodeProxy:
    """pyproxy programming one node namespace from successive lists of API objects."""

    def __init__(self, netns: str, config: NodeConfig,
                 families: tuple[IPFamily, ...] = (IPFamily.IPv4, IPFamily.IPv6)) -> None:
        nft = libnft_in(netns)
        self.proxiers = [FamilyProxier(f, config, nft) for f in families]

    def apply(self, objects: list[dict[str, Any]], plan: SyncPlan | None = None) -> list[Any]:
        state = build_state(objects)
        assert not [s for s in state.skipped if s.invalid], state.skipped
        return [p.sync(state, plan=plan) for p in self.proxiers]


def listing(ns: Netns, family: str = "ip") -> dict[str, Any]:
    """Our table as JSON, normalised: no handles, set elements sorted."""
    out = ns.run(["nft", "-j", "list", "table", family, "pyproxy"]).stdout
    objects = []
    for obj in json.loads(out)["nftables"]:
        for kind in ("table", "chain", "rule", "set", "map"):
            if kind in obj:
                body = {k: v for k, v in obj[kind].items() if k != "handle"}
                if "elem" in body:
                    body["elem"] = sorted(json.dumps(e, sort_keys=True) for e in body["elem"])
                objects.append(json.dumps({kind: body}, sort_keys=True))
    return {"objects": sorted(objects)}


def render_script(state: ClusterState, config: NodeConfig,
                  families: Iterable[IPFamily] | None = None) -> str:
    """The complete nft script for the node: what `nft -f` loads into an empty namespace."""
    return script_of({family: desired_state(state, config, family)
                      for family in (families or node_families(state, config))})
