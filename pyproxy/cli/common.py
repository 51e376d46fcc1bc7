"""What the `pyproxy` commands share: exit codes, the usage error, the node options of the
offline commands and the node configuration they resolve to, loading a snapshot."""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pyproxy.cluster.snapshot import SnapshotError, load_snapshot, nothing_usable
from pyproxy.config import (
    NODE_SETTINGS,
    ConfigError,
    add_flags,
    from_args,
)
from pyproxy.core.explain import conflict_text
from pyproxy.core.model import ClusterState, ServiceKey, override_ips
from pyproxy.core.nodeconfig import NodeConfig, unusable_address_warnings
from pyproxy.serve.live import service_key

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3  # the live commands could not reach the daemon


def command(commands: Any, name: str, handler: Callable[[argparse.Namespace], int], help: str,
            description: str | None = None, outputs: Sequence[str] = ()) -> argparse.ArgumentParser:
    """A subcommand that runs `handler`; with `outputs`, its `-o/--output` formats (the first
    is the default)."""
    cmd: argparse.ArgumentParser = commands.add_parser(name, help=help, description=description)
    if outputs:
        cmd.add_argument("-o", "--output", choices=tuple(outputs), default=outputs[0])
    cmd.set_defaults(handler=handler)
    return cmd


# What most commands print: a table for people, JSON for programs.
TABLE_OR_JSON = ("table", "json")


def service_key_arg(text: str) -> ServiceKey:
    try:
        return service_key(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def node_flags(cmd: argparse.ArgumentParser) -> None:
    """The node options of `render`, `apply` and offline `trace`: `run`'s, with the same
    names and meanings (and --config), plus the node's name and addresses, which `run` learns
    from the host and its Node object."""
    cmd.add_argument("--node", help="the node's name (as in its Node object); the same as "
                                    "--hostname-override, which may also come from --config")
    cmd.add_argument("--node-ip", action="append", default=[], metavar="IP",
                     help="this node's IP, at most one per family (repeat for "
                          "dual-stack); NodePorts listen on it with --nodeport-addresses "
                          "primary (the default). Default: the Node object's "
                          "(status.addresses, InternalIP first); a given address replaces the "
                          "Node's of its family, the other family keeps the Node's")
    cmd.add_argument("--node-address", action="append", default=[], metavar="IP",
                     help="another address of the node's interfaces (repeat for each): "
                          "--nodeport-addresses CIDRs select among these and the node's IPs, "
                          "as `run` matches them against every local address. Default: the "
                          "node's IPs are its only addresses")
    add_flags(cmd, settings=NODE_SETTINGS)


def node_ips(texts: Sequence[str]) -> tuple[str, ...]:
    """--node-ip values: one per family, as a node has one primary IP per family."""
    by_family: dict[int, str] = {}
    for text in texts:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            raise UsageError(f"--node-ip: {text!r} is not an IP address") from None
        if ip.version in by_family:
            raise UsageError(f"--node-ip: two IPv{ip.version} addresses ({by_family[ip.version]}, "
                             f"{ip}): give at most one per family")
        by_family[ip.version] = str(ip)
    return tuple(by_family.values())


def node_addresses(texts: Sequence[str]) -> tuple[str, ...]:
    """--node-address values: addresses, each once."""
    try:
        return tuple(dict.fromkeys(str(ipaddress.ip_address(text)) for text in texts))
    except ValueError as err:
        raise UsageError(f"--node-address: {err}") from None


def node_config(args: argparse.Namespace, state: ClusterState) -> NodeConfig:
    """The node options over what the snapshot's Node object says, as `run` resolves them:
    --config, then the flags; the Node's IPs (status.addresses, as kube-proxy picks them),
    each --node-ip replacing the one of its family; its podCIDRs (detect-local mode
    NodeCIDR); its local addresses, which nodePortAddresses selects from: the node IPs and
    every --node-address (without any, the node IPs stand in, as they always did)."""
    try:
        config = from_args(args)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    name = (args.node or config.hostname_override or "").strip().lower()
    if not name:
        raise UsageError(f"{args.command} needs --node (or --hostname-override, or "
                         f"hostnameOverride in --config)")
    node = state.nodes.get(name)
    ips = override_ips(node_ips(args.node_ip), node.host_ips if node else ())
    addresses = node_addresses(args.node_address)
    node_config = config.node_config(name, ips, node.pod_cidrs if node else ())
    if addresses:
        local = dict.fromkeys((*node_config.node_ips, *addresses))
        node_config = config.node_config(name, ips, node.pod_cidrs if node else (),
                                         tuple(local))
    for warning in unusable_address_warnings(node, node_config):
        print(f"pyproxy: warning: {warning}", file=sys.stderr)
    return node_config


class UsageError(ValueError):
    """A flag's value is unusable."""


def load_offline(path: str, allow_empty: bool | None) -> ClusterState:
    """The snapshot of an offline command, refused when nothing in it is usable (most likely
    the wrong file: `apply` would program an empty ruleset over the node's rules).
    allow_empty: --allow-empty, None where the command has no such flag."""
    state = load_snapshot(path)
    why = nothing_usable(state)
    if why is not None and not allow_empty:
        raise SnapshotError(f"{path}: nothing usable in this snapshot ({why}); expected what "
                            "`kubectl get nodes,services,endpointslices -A -o yaml` prints"
                            + ("; --allow-empty goes on anyway" if allow_empty is not None
                               else ""))
    return state


def report_input(state: ClusterState, found: list[dict[str, Any]]) -> None:
    """What an offline command dropped or had to choose, on stderr (standard output holds the
    answer): the invalid objects and the conflicts `found`, as explain lists them."""
    for skipped in state.skipped:
        if skipped.invalid:
            print(f"pyproxy: skipped {skipped.object}: {skipped.reason}", file=sys.stderr)
    for conflict in found:
        print(f"pyproxy: conflict: {conflict_text(conflict)}", file=sys.stderr)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")
