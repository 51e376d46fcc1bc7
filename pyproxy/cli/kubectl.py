"""`kubectl pyproxy`: pyproxy's live commands from anywhere kubectl reaches the cluster.

kubectl runs an executable named `kubectl-pyproxy` on PATH for `kubectl pyproxy ...` (its
plugin mechanism). This one finds the pyproxy pod on the node named by --node (the DaemonSet's
pods, by their label, on that node, running) and runs `pyproxy COMMAND ARGS...` in it through
`kubectl exec`, so the output and the exit code are the command's own (`status` 1 when the node
is not healthy, `diff` 1 when the kernel differs...). What this plugin cannot do exits with
pyproxy's codes too: 2 for a usage mistake, 3 when the node's pyproxy cannot be reached (no
such pod, kubectl refused).

kubectl's connection flags (--context, --kubeconfig, --cluster, --user, --request-timeout) are
passed to every kubectl it runs, as kubectl passes them to a plugin unparsed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
# pyproxy's live commands (the daemon's debug socket, in the pod), and `version`.
COMMANDS = ("explain", "status", "services", "trace", "diff", "history", "version")
NAMESPACE = "kube-system"
SELECTOR = "app.kubernetes.io/name=pyproxy"
CONTAINER = "pyproxy"
KUBECTL_FLAGS = ("context", "kubeconfig", "cluster", "user", "request-timeout")


class PluginError(Exception):
    def __init__(self, message: str, code: int = EXIT_UNREACHABLE) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl pyproxy",
        description="Run pyproxy's commands in the pyproxy pod of a node, through kubectl "
                    "exec: the same output and exit codes as on the node. "
                    "Example: kubectl pyproxy --node worker-1 explain default/web",
        epilog="Offline commands (explain/trace -f SNAPSHOT, render) need no cluster: run "
               "pyproxy itself.")
    parser.add_argument("--node", required=True, help="the node whose pyproxy to ask")
    parser.add_argument("-n", "--namespace", default=NAMESPACE,
                        help=f"pyproxy's namespace (default {NAMESPACE})")
    parser.add_argument("-l", "--selector", default=SELECTOR,
                        help=f"the label selector of pyproxy's pods (default {SELECTOR})")
    parser.add_argument("-c", "--container", default=CONTAINER,
                        help=f"the container to run in (default {CONTAINER})")
    for flag in KUBECTL_FLAGS:
        parser.add_argument(f"--{flag}", help="passed to kubectl")
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND",
                        help=f"pyproxy's command: {', '.join(COMMANDS)}")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="its arguments, as `pyproxy COMMAND --help` lists them")
    return parser


def kubectl_command(args: argparse.Namespace) -> list[str]:
    """kubectl with the connection flags the plugin was given."""
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl") or "kubectl"
    flags = [f"--{flag}={getattr(args, flag.replace('-', '_'))}" for flag in KUBECTL_FLAGS
             if getattr(args, flag.replace("-", "_")) is not None]
    return [kubectl, *flags, f"--namespace={args.namespace}"]


def running_pod(pods: dict[str, Any], node: str) -> str:
    """The name of the running pyproxy pod of `kubectl get pods -o json`'s answer (a pod
    being deleted is left to its successor when both are there)."""
    candidates = [pod for pod in pods.get("items", [])
                  if pod.get("status", {}).get("phase") == "Running"]
    if not candidates:
        raise PluginError(f"no running pyproxy pod on node {node}")
    candidates.sort(key=lambda pod: ("deletionTimestamp" in pod["metadata"],
                                     pod["metadata"].get("creationTimestamp", "")))
    return str(candidates[0]["metadata"]["name"])


def find_pod(kubectl: list[str], selector: str, node: str) -> str:
    try:
        out = subprocess.run([*kubectl, "get", "pods", f"--selector={selector}",
                              f"--field-selector=spec.nodeName={node}", "--output=json"],
                             capture_output=True, text=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PluginError(f"kubectl: {err}") from None
    if out.returncode != 0:
        raise PluginError(f"kubectl get pods: {out.stderr.strip()}")
    return running_pod(json.loads(out.stdout), node)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "version" and {"-f", "--file"} & {a.split("=")[0] for a in args.args}:
        print("kubectl pyproxy: -f/--file reads a snapshot on this machine: run pyproxy "
              "itself for offline commands", file=sys.stderr)
        return EXIT_USAGE
    kubectl = kubectl_command(args)
    try:
        pod = find_pod(kubectl, args.selector, args.node)
    except PluginError as err:
        print(f"kubectl pyproxy: {err}", file=sys.stderr)
        return err.code
    # stdin is not passed (no command reads it); stdout and stderr are the command's, and
    # kubectl exec exits with its exit code.
    try:
        return subprocess.run([*kubectl, "exec", pod, f"--container={args.container}", "--",
                               "pyproxy", args.command, *args.args],
                              stdin=subprocess.DEVNULL, check=False).returncode
    except OSError as err:
        print(f"kubectl pyproxy: kubectl: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
