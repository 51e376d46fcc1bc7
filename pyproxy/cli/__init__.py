"""The `pyproxy` command line."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyproxy.cli.common import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    TABLE_OR_JSON,
    UsageError,
    command,
    load_offline,
    node_config,
    node_flags,
    print_json,
    report_input,
    service_key_arg,
)
from pyproxy.cli.live import (
    live_commands,
    socket_flag,
)
from pyproxy.cluster.snapshot import SnapshotError
from pyproxy.config import (
    ConfigError,
    ProxyConfig,
    add_flags,
    from_args,
    run_actions,
)
from pyproxy.core.explain import explain_report, format_table
from pyproxy.core.model import ClusterState, IPFamily, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig, unusable_address_warnings
from pyproxy.kernel.libnftables import NftError
from pyproxy.kernel.privileges import MissingPrivilege
from pyproxy.logs import FORMATS, setup_logging
from pyproxy.render.objects import TABLE
from pyproxy.serve.debug import DebugError, ask
from pyproxy.sync.applier import Applier
from pyproxy.sync.proxier import (
    FamilyProxier,
    conflicts,
    desired_state,
    desired_states,
    disputes_report,
    node_families,
    script_of,
)
from pyproxy.version import commit, describe, version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyproxy",
        description="A Kubernetes service proxy for nftables, and the tools to see into it.",
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    explain = commands.add_parser(
        "explain",
        help="show which endpoints a node uses for each service port, and why",
        description=(
            "Show what a node does with every service port: the cluster and local endpoint "
            "lists, the topology mode in force and the reasons. With -f, offline from a "
            "cluster snapshot (Nodes, Services, EndpointSlices as `kubectl get -o yaml` "
            "prints them) for --node; without, live from the running daemon."
        ),
    )
    explain.add_argument("service_arg", nargs="?", type=service_key_arg, metavar="NS/NAME",
                         help="only this service")
    explain.add_argument("-f", "--file", help="snapshot file (YAML or JSON): offline mode")
    explain.add_argument("--node", help="the node to explain for (offline mode)")
    explain.add_argument(
        "--service", type=service_key_arg, metavar="NS/NAME", help="only this service"
    )
    explain.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )
    socket_flag(explain)
    explain.set_defaults(handler=_cmd_explain)

    for name, help_text in (
        ("render", "print the complete nftables ruleset a node would get, as an nft script"),
        ("apply", "program the rules for a node into this network namespace, once"),
    ):
        cmd = commands.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("-f", "--file", required=True, help="snapshot file (YAML or JSON)")
        cmd.add_argument("--allow-empty", action="store_true",
                         help="go on with a snapshot that holds nothing usable (empty, not "
                              "Kubernetes objects, all invalid): an empty ruleset, which "
                              "`apply` programs (refused without this flag)")
        node_flags(cmd)
        cmd.set_defaults(handler=_cmd_render if name == "render" else _cmd_apply)

    cleanup = commands.add_parser(
        "cleanup", help="remove pyproxy's rules, or with --kube-proxy kube-proxy's",
        description="Delete pyproxy's nftables tables (ip and ip6) in this network namespace. "
                    "With --kube-proxy, delete what kube-proxy left behind instead and leave "
                    "pyproxy's tables alone (docs/deploying.md, migrating from kube-proxy).")
    cleanup.add_argument("--kube-proxy", action="store_true",
                         help="remove kube-proxy's nftables tables (ip/ip6 kube-proxy) and the "
                              "iptables chains of its iptables and ipvs modes, not pyproxy's; "
                              "refused while pyproxy has no table here")
    cleanup.add_argument("--force", action="store_true",
                         help="with --kube-proxy: even where pyproxy has not programmed the "
                              "node (it is then left without any Service rules)")
    cleanup.set_defaults(handler=_cmd_cleanup)

    live_commands(commands)

    run = commands.add_parser(
        "run", help="run the proxy: keep this node's nftables rules in step with the cluster",
        description=(
            "Watch Services, EndpointSlices and this Node (or a snapshot file with "
            "--snapshot) and keep this node's nftables rules in step, batching changes "
            "(minSyncPeriod). Stops on SIGTERM/SIGINT and leaves the rules in place."),
    )
    add_flags(run)
    run.add_argument("--version", action=_VersionAction,
                     help="print the version and the commit, and exit (as kube-proxy's "
                          "--version)")
    run.set_defaults(handler=_cmd_run)

    _config_commands(commands)

    command(commands, "version", _cmd_version,
            "print pyproxy's version and the commit it was built from",
            "Print pyproxy's version (the package's, which the image is labelled with), the "
            "git commit it was built from (\"unknown\" when the build did not record one) and "
            "Python's.", TABLE_OR_JSON)

    completion = command(
        commands, "completion", _cmd_completion, "print the shell completion script for bash "
        "or zsh", "Print a completion script of pyproxy's commands and flags for bash or zsh, "
        "generated from this command line's parser (shtab). bash: `source <(pyproxy "
        "completion bash)`, or write it to /etc/bash_completion.d/pyproxy; zsh: write it as "
        "_pyproxy into a folder of $fpath.")
    completion.add_argument("shell", choices=("bash", "zsh"))

    for name, cmd in commands.choices.items():
        # `run` and `config`'s commands have it among kube-proxy's flags (and from --config)
        if name not in ("run", "config"):
            cmd.add_argument("--logging-format", choices=FORMATS, default=None,
                             help="log lines on stderr: text (key=value) or json "
                                  "(default: text)")
    return parser


class _VersionAction(argparse.Action):
    """--version: the version and the commit, found only when asked (finding the commit may
    run git, which every other command can do without)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 help: str = "print the version and the commit, and exit") -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(describe())
        parser.exit()


def _cmd_version(args: argparse.Namespace) -> int:
    if args.output == "json":
        print_json({"version": version(), "commit": commit(),
                     "python": platform.python_version()})
    else:
        print(f"pyproxy {version()} (commit {commit()}, Python {platform.python_version()})")
    return EXIT_OK


def _cmd_completion(args: argparse.Namespace) -> int:
    import shtab  # only here: nothing else needs it

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from pyproxy.kernel.host import init_host
    from pyproxy.run import run_daemon

    try:
        actions = run_actions(args)
        config = from_args(args)
        # kube-proxy's --write-config-to, --cleanup and --init-only: instead of running
        if actions.write_config_to:
            return _write_config(config, actions.write_config_to)
        if actions.cleanup:
            return _cmd_cleanup(argparse.Namespace(kube_proxy=False, force=False))
        if actions.init_only:
            return init_host(config)
        return run_daemon(config)
    except ConfigError as err:  # raised before anything on the host changed
        raise UsageError(str(err)) from None


def _write_config(config: ProxyConfig, path: str) -> int:
    from pyproxy.config.view import effective_configuration

    try:
        Path(path).write_text(effective_configuration(config).text(), encoding="utf-8")
    except OSError as err:
        raise UsageError(f"--write-config-to {path}: {err.strerror or err}") from None
    return EXIT_OK


def _config_commands(commands: Any) -> None:
    config = commands.add_parser(
        "config", help="check the configuration, or print the one `pyproxy run` would use",
        description="The configuration `pyproxy run` would use, without running it: "
                    "`check` reports every problem, `view` prints it.")
    sub = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    check = sub.add_parser(
        "check", help="report every problem of --config FILE and the flags",
        description="Check a configuration as `pyproxy run` would read it (--config FILE, "
                    "then run's flags): every problem, naming its field or flag and the file; "
                    "warnings (unknown fields, what is accepted but not applied); the notes "
                    "run logs at start. Exit code 0 usable, 1 problems, 2 usage.")
    add_flags(check, actions=False)
    check.set_defaults(handler=_cmd_config_check)
    view = sub.add_parser(
        "view", help="print the effective configuration as YAML",
        description="Print the configuration `pyproxy run` would use (defaults, then --config "
                    "FILE, then run's flags) as a KubeProxyConfiguration, which --config reads "
                    "back; what a file cannot say is listed after it as flags. Exit code 1 "
                    "if the configuration has problems (`pyproxy config check` lists them).")
    add_flags(view, actions=False)
    view.set_defaults(handler=_cmd_config_view)


def _cmd_config_check(args: argparse.Namespace) -> int:
    from pyproxy.config.view import check_configuration

    report = check_configuration(args)
    connection = _connection_notes(report.config) if report.config is not None else []
    for kind, lines in (("error", report.problems), ("warning", report.warnings),
                        ("change", report.changes), ("note", (*report.notes, *connection))):
        for line in lines:
            print(f"{kind}: {line}")
    where = args.config or "the defaults and flags"
    if report.problems:
        warned = f", {len(report.warnings)} warning(s)" if report.warnings else ""
        print(f"{where}: {len(report.problems)} problem(s){warned}: pyproxy run would refuse to "
              "start")
        return EXIT_ERROR
    counts = [f"{len(report.warnings)} warning(s)"] if report.warnings else []
    if report.changes:
        mode = report.config.kube_proxy_mode if report.config else ""
        counts.append(f"{len(report.changes)} change(s) from kube-proxy's {mode} mode: "
                      f"read them before the switch")
    print(f"{where}: " + (f"pyproxy run would start; {'; '.join(counts)}" if report.changes
                          else "ok" + (f" ({counts[0]})" if counts else "")))
    return EXIT_OK


def _connection_notes(config: ProxyConfig) -> list[str]:
    """What `run` would find of its API connection here. A note, not a problem: the files
    (kubeadm's kubeconfig.conf, the pod's token) often exist only on the node, where `run`
    checks them all at start before changing anything."""
    from pyproxy.cluster import apiconnection

    if config.snapshot:
        return ["API connection: none (--snapshot)"]
    if not config.kubeconfig and "KUBERNETES_SERVICE_HOST" not in os.environ:
        return ["API connection: in-cluster (the pod's service account, the API server from "
                "KUBERNETES_SERVICE_HOST/PORT): checked by run at start"]
    try:
        connection = apiconnection.load(config)
    except ConfigError as err:
        return [f"API connection: not usable here ({err}); run checks it again on the node "
                "at start and refuses to start if it is not usable there"]
    return [f"API connection: {connection.server} ({connection.source}): usable"]


def _cmd_config_view(args: argparse.Namespace) -> int:
    from pyproxy.config.view import check_configuration, effective_configuration

    report = check_configuration(args)
    if report.config is None:
        for line in report.problems:
            print(f"pyproxy: {line}", file=sys.stderr)
        return EXIT_ERROR
    sys.stdout.write(effective_configuration(report.config).text())
    return EXIT_OK


def _cmd_render(args: argparse.Namespace) -> int:
    state = load_offline(args.file, args.allow_empty)
    tables = desired_states(state, node_config(args, state))
    report_input(state, disputes_report(tables.items()))
    sys.stdout.write(script_of(tables))
    return EXIT_OK


def _cmd_apply(args: argparse.Namespace) -> int:
    state = load_offline(args.file, args.allow_empty)
    config = node_config(args, state)
    report_input(state, conflicts(state, config))
    for family in node_families(state, config):
        result = FamilyProxier(family, config).sync(state)  # a first, full sync
        print(f"{family.nft_family} {TABLE}: {result.commands} commands applied in "
              f"{result.kernel_seconds * 1000:.0f} ms")
    return EXIT_OK


def _cmd_cleanup(args: argparse.Namespace) -> int:
    if args.kube_proxy:
        return _cleanup_kube_proxy(args.force)
    if args.force:
        raise UsageError("--force goes with --kube-proxy")
    for family in IPFamily:
        Applier(family.nft_family).cleanup()
    return EXIT_OK


def _cleanup_kube_proxy(force: bool) -> int:
    """Only kube-proxy's leftovers: this runs on a node pyproxy programs (while it runs), and
    deleting pyproxy's tables too would leave the node without Service rules until its next
    sync repaired them."""
    from pyproxy.cli.kubeproxy_cleanup import cleanup_kube_proxy, pyproxy_tables_present

    if not force and not pyproxy_tables_present():
        print("pyproxy: no pyproxy table in this network namespace: kube-proxy's rules are "
              "the only Service rules here. Run pyproxy first and wait for its first sync "
              "(pyproxy status), or pass --force.", file=sys.stderr)
        return EXIT_ERROR
    outcome = cleanup_kube_proxy()
    for line in outcome.removed or ["nothing of kube-proxy's was left"]:
        print(line)
    for line in outcome.failed:
        print(f"pyproxy: failed: {line}", file=sys.stderr)
    return EXIT_ERROR if outcome.failed else EXIT_OK


def _cmd_explain(args: argparse.Namespace) -> int:
    service = args.service_arg or args.service
    if args.file:
        if not args.node:
            raise UsageError("explain -f needs --node")
        state = load_offline(args.file, None)
        report = explain_report(state, args.node, service)
        config = _explain_config(state, args.node)
        report["conflicts"] = _explain_conflicts(state, config, service)
        if unusable := unusable_address_warnings(state.nodes.get(args.node), config):
            report["warnings"] = [*report.get("warnings", ()), *unusable]
        where = "in the snapshot"
    else:
        report = ask(args.socket, "/explain", service=service, inflight="1")
        where = "known to the daemon"
    if service is not None and not _service_known(report, service):
        print(f"pyproxy: service {service} is not {where}", file=sys.stderr)
        return EXIT_ERROR
    if args.output == "json":
        print_json(report)
    else:
        sys.stdout.write(format_table(report))
    return EXIT_OK


def _service_known(report: dict[str, Any], service: ServiceKey) -> bool:
    """Whether explain found the Service: its ports, or the Service itself skipped (invalid,
    not proxied). Another object of that name skipped (an EndpointSlice named as the
    Service, as hand-made ones often are) is listed, but says nothing of the Service."""
    return bool(report["services"]) or f"Service {service}" in (
        s["object"] for s in report["skipped"])


def _explain_config(state: ClusterState, node_name: str) -> NodeConfig:
    """The node as explain sees it: run's default node settings, the Node's addresses."""
    node = state.nodes.get(node_name)
    return ProxyConfig().node_config(node_name, node.host_ips if node else (),
                                     node.pod_cidrs if node else ())


def _explain_conflicts(state: ClusterState, config: NodeConfig,
                       service: ServiceKey | None) -> list[dict[str, Any]]:
    """The conflicts render would report for this node."""
    return disputes_report(((family, desired_state(state, config, family))
                            for family in node_families(state, config)), service)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Before anything can log: structlog's default prints on stdout, which is for the answer
    # (`pyproxy render | nft -f -`). `run` sets up again from its configuration.
    fmt = args.logging_format if args.logging_format in FORMATS else "text"
    setup_logging(fmt, cache=False)
    try:
        code: int = args.handler(args)
    except (SnapshotError, NftError, MissingPrivilege) as err:
        print(f"pyproxy: {err}", file=sys.stderr)
        return EXIT_ERROR
    except DebugError as err:
        print(f"pyproxy: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except UsageError as err:
        print(f"pyproxy: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())
