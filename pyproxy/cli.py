"""The `pyproxy` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pyproxy.explain import explain_report, format_table
from pyproxy.model import ServiceKey
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
    return parser


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
    except SnapshotError as err:
        print(f"pyproxy: {err}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())
