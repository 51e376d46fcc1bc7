"""The live commands: `status`, `services`, `trace`, `diff`, `history` ask the running daemon
over its debug socket (`trace -f` works offline from a snapshot)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pyproxy.cli import common
from pyproxy.cli.formats import (
    api_problems,
    format_history,
    format_services,
    format_status,
    format_trace,
)
from pyproxy.render.objects import TABLE
from pyproxy.render.skeleton import render_config
from pyproxy.serve.debug import DEFAULT_SOCKET, ask
from pyproxy.serve.live import TraceRequest, trace_request
from pyproxy.sync.proxier import (
    conflicts,
    desired_state,
)


def socket_flag(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--socket", default=DEFAULT_SOCKET,
                     help=f"the daemon's debug socket (default {DEFAULT_SOCKET})")


def live_commands(commands: Any) -> None:
    socket_flag(common.command(
        commands, "status", _cmd_status,
        "the running daemon: sync health, last syncs, counts, API connection",
        "Ask the running daemon how it is doing. Exit code 0 healthy, 1 not healthy (the rules "
        "are stale, damaged, or a watch of the API server has had no answer for more than 2 "
        "minutes: the output says which), 3 the daemon cannot be reached.", common.TABLE_OR_JSON))

    services = common.command(
        commands, "services", _cmd_services,
        "each service port, its addresses and the endpoints this node uses",
        "The service ports the daemon programs, with the endpoints in force and the topology "
        "mode (kubectl-style table).", ("table", "wide", "json"))
    services.add_argument("service", nargs="?", type=common.service_key_arg, metavar="NS/NAME")
    socket_flag(services)

    trace = common.command(
        commands, "trace", _cmd_trace, "where a new connection goes through this node's rules",
        "Follow a new connection through the rules the node programmed: the service matched, "
        "the chains walked, the DNAT candidates and their odds, masquerade or not, "
        "reject/drop. Live from the daemon's committed state, or offline with -f SNAPSHOT "
        "and the node flags.", common.TABLE_OR_JSON)
    trace.add_argument("--src", required=True, metavar="IP", help="the client's address")
    trace.add_argument("--dst", required=True, metavar="IP:PORT[/PROTO]",
                       help="destination, e.g. 10.96.0.10:80/tcp or [fd00::1]:53/udp")
    trace.add_argument("--sport", metavar="PORT",
                       help="the client's source port (Maglev hashes address and port)")
    trace.add_argument("--verify", action="store_true",
                       help="check every element the answer relied on against the kernel "
                            "(live mode); exit code 1 if the kernel disagrees")
    trace.add_argument("--from-node", action="store_true",
                       help="the connection starts on the node itself (output hook)")
    trace.add_argument("-f", "--file", help="snapshot file: trace offline")
    common.node_flags(trace)
    socket_flag(trace)

    socket_flag(common.command(
        commands, "diff", _cmd_diff,
        "what differs between the rules committed and what the kernel holds",
        "Compare the rules the daemon believes it committed with the kernel's. Exit code 0 "
        "identical, 1 different, 3 the daemon cannot be reached.", common.TABLE_OR_JSON))

    history = common.command(commands, "history", _cmd_history,
                             "the last syncs: what changed, why, how long each phase took",
                             outputs=common.TABLE_OR_JSON)
    history.add_argument("-n", type=int, default=20, help="how many (default 20)")
    socket_flag(history)


def _cmd_status(args: argparse.Namespace) -> int:
    status = ask(args.socket, "/status")
    if args.output == "json":
        common.print_json(status)
    else:
        sys.stdout.write(format_status(status))
    return common.EXIT_OK if status["healthy"] and not api_problems(status) else common.EXIT_ERROR


def _cmd_services(args: argparse.Namespace) -> int:
    # new connections per endpoint (the kernel's counters) and connections in flight
    # (conntrack): reads of the kernel, for the outputs showing them
    counts = "1" if args.output in ("wide", "json") else None
    entries = ask(args.socket, "/services", service=args.service, connections=counts,
                  inflight=counts)
    if args.output == "json":
        common.print_json(entries)
    else:
        sys.stdout.write(format_services(entries, wide=args.output == "wide"))
    return common.EXIT_OK


def _cmd_trace(args: argparse.Namespace) -> int:
    try:  # checked here too, so a live trace's mistakes name the flag as an offline one's do
        request = trace_request(args.src, args.dst, args.sport)
    except ValueError as err:
        raise common.UsageError(str(err)) from None
    if args.file:
        result = _offline_trace(args, request)
    else:
        result = ask(args.socket, "/trace", src=request.src, dst=args.dst, sport=request.sport,
                     from_node="1" if args.from_node else None,
                     verify="1" if args.verify else None)
    if args.output == "json":
        common.print_json(result)
    else:
        sys.stdout.write(format_trace(result))
    problems = result.get("verified")
    if problems is not None and args.output != "json":
        print("verified against the kernel: " + ("every element the answer used is there"
                                                 if not problems else "; ".join(problems)))
    return common.EXIT_ERROR if problems else common.EXIT_OK


def _offline_trace(args: argparse.Namespace, request: TraceRequest) -> dict[str, Any]:
    from pyproxy.core.model import ip_family
    from pyproxy.render.trace import trace

    state = common.load_offline(args.file, None)
    config = common.node_config(args, state)
    common.report_input(state, conflicts(state, config))
    family = ip_family(request.dst)
    answer = trace(desired_state(state, config, family), render_config(config, family),
                   request.src, request.dst, request.port, request.protocol,
                   from_node=args.from_node, sport=request.sport)
    return answer.as_dict()


def _cmd_diff(args: argparse.Namespace) -> int:
    result: dict[str, list[str]] = ask(args.socket, "/diff", timeout=600)
    if args.output == "json":
        common.print_json(result)
    else:
        for family, lines in result.items():
            print(f"table {family} {TABLE}: " + ("identical" if not lines else
                                                  f"{len(lines)} difference(s)"))
            for line in lines:
                print(f"  {line}")
    return common.EXIT_ERROR if any(result.values()) else common.EXIT_OK


def _cmd_history(args: argparse.Namespace) -> int:
    records = ask(args.socket, "/history", n=args.n)
    if args.output == "json":
        common.print_json(records)
    else:
        sys.stdout.write(format_history(records))
    return common.EXIT_OK
