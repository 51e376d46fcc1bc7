"""The `pyproxy` command line."""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from collections.abc import Sequence

from pyproxy.config import ConfigError, add_flags, from_args
from pyproxy.explain import explain_report, format_table
from pyproxy.model import IPFamily, ServiceKey
from pyproxy.nft import Applier, NftError
from pyproxy.proxier import FamilyProxier, NodeConfig, fragments, node_families
from pyproxy.render import TABLE, LocalMode
from pyproxy.ruleset import Change, DesiredState, full_commands
from pyproxy.snapshot import SnapshotError, load_snapshot

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def _service_key(text: str) -> ServiceKey:
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {text!r}")
    return ServiceKey(namespace, name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyproxy",
        description="A Kubernetes service proxy for nftables, and the tools to see into it.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    explain = commands.add_parser(
        "explain",
        help="show which endpoints a node uses for each service port, and why",
        description=(
            "Read a cluster snapshot (Nodes, Services, EndpointSlices as `kubectl get -o yaml` "
            "prints them) and show what NODE would do with every service port: the cluster "
            "and local endpoint lists, the topology mode in force and the reasons."
        ),
    )
    explain.add_argument("-f", "--file", required=True, help="snapshot file (YAML or JSON)")
    explain.add_argument("--node", required=True, help="the node to explain for")
    explain.add_argument(
        "--service", type=_service_key, metavar="NS/NAME", help="only this service"
    )
    explain.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )
    explain.set_defaults(handler=_cmd_explain)

    for name, help_text in (
        ("render", "print the complete nftables ruleset a node would get, as an nft script"),
        ("apply", "program the rules for a node into this network namespace, once"),
    ):
        cmd = commands.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("-f", "--file", required=True, help="snapshot file (YAML or JSON)")
        _node_flags(cmd)
        cmd.set_defaults(handler=_cmd_render if name == "render" else _cmd_apply)

    cleanup = commands.add_parser(
        "cleanup", help="remove everything pyproxy programmed (its nftables tables)")
    cleanup.set_defaults(handler=_cmd_cleanup)

    run = commands.add_parser(
        "run", help="run the proxy: keep this node's nftables rules in step with the cluster",
        description=(
            "Watch Services, EndpointSlices and this Node (or a snapshot file with "
            "--snapshot) and keep this node's nftables rules in step, batching changes "
            "(minSyncPeriod). Stops on SIGTERM/SIGINT and leaves the rules in place."),
    )
    add_flags(run)
    run.set_defaults(handler=_cmd_run)
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from pyproxy.run import run_daemon

    try:
        config = from_args(args)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    return run_daemon(config)


def _node_flags(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--node", "--hostname-override", dest="node", required=True,
                     help="the node's name (as in its Node object)")
    cmd.add_argument("--node-ip", action="append", default=[], metavar="IP",
                     help="this node's address (repeat for dual-stack); NodePorts listen on it")
    cmd.add_argument("--cluster-cidr", default="",
                     help="pod CIDR(s), comma-separated: traffic from elsewhere to a ClusterIP "
                          "is masqueraded")
    cmd.add_argument("--detect-local-mode", default="ClusterCIDR",
                     choices=[m.value for m in LocalMode if m is not LocalMode.NONE],
                     help="how pod traffic is recognised (default ClusterCIDR)")
    cmd.add_argument("--pod-interface", default="",
                     help="bridge name or interface prefix for the interface detect-local modes")
    cmd.add_argument("--nodeport-addresses", default="primary",
                     help="CIDRs (comma-separated) or 'primary' of node addresses accepting "
                          "NodePorts; empty for all local addresses (default primary)")
    cmd.add_argument("--masquerade-all", action="store_true",
                     help="masquerade all traffic to ClusterIPs")


def _node_config(args: argparse.Namespace) -> NodeConfig:
    def split(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())

    try:
        ips = tuple(str(ipaddress.ip_address(ip)) for ip in args.node_ip)
        cidrs = tuple(str(ipaddress.ip_network(c, strict=False)) for c in split(args.cluster_cidr))
        nodeport = split(args.nodeport_addresses)
        for entry in nodeport:
            if entry != "primary":
                ipaddress.ip_network(entry, strict=False)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return NodeConfig(
        node_name=args.node, node_ips=ips, cluster_cidrs=cidrs,
        local_mode=LocalMode(args.detect_local_mode), local_interface=args.pod_interface,
        nodeport_addresses=nodeport, masquerade_all=args.masquerade_all,
    )


class UsageError(ValueError):
    """A flag's value is unusable."""


def _cmd_render(args: argparse.Namespace) -> int:
    state = load_snapshot(args.file)
    config = _node_config(args)
    for family in node_families(state, config):
        desired = DesiredState()
        change = Change()
        for owner, fragment in fragments(state, config, family).items():
            desired.set(owner, fragment, change)
        sys.stdout.write(full_commands(family.nft_family, desired).text())
    return EXIT_OK


def _cmd_apply(args: argparse.Namespace) -> int:
    state = load_snapshot(args.file)
    config = _node_config(args)
    for family in node_families(state, config):
        result = FamilyProxier(family, config).sync(state, full=True)
        print(f"{family.nft_family} {TABLE}: {result.commands} commands applied in "
              f"{result.kernel_seconds * 1000:.0f} ms")
    for skipped in state.skipped:
        if skipped.invalid:
            print(f"skipped {skipped.object}: {skipped.reason}", file=sys.stderr)
    return EXIT_OK


def _cmd_cleanup(args: argparse.Namespace) -> int:
    for family in IPFamily:
        Applier(family.nft_family).cleanup()
    return EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    state = load_snapshot(args.file)
    report = explain_report(state, args.node, args.service)
    if args.service is not None and not report["services"] and not report["skipped"]:
        print(f"pyproxy: service {args.service} is not in the snapshot", file=sys.stderr)
        return EXIT_ERROR
    if args.output == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(report))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except (SnapshotError, NftError) as err:
        print(f"pyproxy: {err}", file=sys.stderr)
        return EXIT_ERROR
    except UsageError as err:
        print(f"pyproxy: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())
