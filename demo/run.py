#!/usr/bin/env python3
"""make demo: the real pyproxy daemon on a miniature cluster built from network namespaces.

Three nodes in two zones (node-a and node-b in zone-1, node-c in zone-2), joined by a
"fabric" router namespace; on each node a backend pod answering with its own name and a
client pod. One `pyproxy run --snapshot` per node namespace programs that node's nftables;
connections from a node's client pod go through that node's rules, as on a real cluster.
The demo counts where 30 connections per node land for one Service per routing rule, then
makes zone-2's only pod unready (a live change of the snapshot file) and counts again.

Needs only root. Everything lives in `pyproxy-demo-*` namespaces and a temp directory,
removed on exit, Ctrl-C or SIGTERM; a killed run's leftovers are swept by the next one.
The host's own ruleset, routes and sysctls are never touched. The namespaces, the daemons,
the backends and the clients are the test kit's lab (testkit/netlab.py) with the demo's
fixed prefix: one demo at a time, daemons detached from the terminal and tied to the demo's
life, backends and clients as threads of the demo's own process.

    python -m demo.run            # run and clean up (from the repository root)
    python -m demo.run --keep     # leave the cluster running until Enter / Ctrl-C, to explore
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from demo.cluster import (
    CLUSTER_CIDR,
    NODES,
    POD,
    POD_PORT,
    PODS,
    SCENARIO,
    SCENARIOS,
    SERVICE_PORT,
    NodeSpec,
    Scenario,
    write_snapshot,
)
from pyproxy.core.explain import topology_text
from pyproxy.serve.debug import DebugError, ask
from testkit.daemonargs import DaemonArgs
from testkit.interrupts import (
    SIGPIPE_CODE,
    OutputClosed,
    hold_off_signals,
    output_closed,
    say,
    stop_on_signals,
    stopped_by,
)
from testkit.netlab import Lab, Locked, NetlabError

PREFIX = "pyproxy-demo-"
PYPROXY = Path(sys.executable).parent / "pyproxy"
FABRIC = "fabric"
NAMESPACES = (FABRIC, *(n.name for n in NODES), *(p.name for p in PODS),
              *(n.client for n in NODES))
SYNC_TIMEOUT = 30.0
# On top of the lab's own sysctls: the demo cluster is IPv4-only, and its routing is
# asymmetric for nobody, but reverse-path filtering is off everywhere as on a cluster's nodes.
SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1",
           "net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.default.rp_filter": "0"}
WIDTH = 92


# --------------------------------------------------------------------------------------------
# Output


def heading(text: str) -> None:
    say()
    say(text)
    say("-" * min(len(text), WIDTH))


def table(rows: Sequence[Sequence[str]], right: Callable[[int], bool] = lambda i: False,
          indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if right(i) else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        say((indent + "  ".join(cells)).rstrip())


def shown(argv: Sequence[str]) -> str:
    """A command as a person would type it (repo-relative pyproxy path)."""
    words = []
    for word in argv:
        if word == str(PYPROXY):
            with contextlib.suppress(ValueError):
                word = str(PYPROXY.relative_to(Path.cwd()))
        words.append(shlex.quote(word))
    return " ".join(words)


def wrapped(argv: Sequence[str], width: int = WIDTH - 6) -> list[str]:
    """A long command as shell lines continued with backslashes, breaking before flags."""
    words = shown(argv).split(" ")
    groups: list[str] = []
    for word in words:
        if groups and not word.startswith("--") and groups[-1].startswith("--") \
                and " " not in groups[-1]:
            groups[-1] += " " + word  # a flag and its value stay together
        else:
            groups.append(word)
    lines = [""]
    for group in groups:
        if lines[-1] and len(lines[-1]) + 1 + len(group) > width:
            lines.append("    " + group)
        else:
            lines[-1] = f"{lines[-1]} {group}" if lines[-1] else group
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


# --------------------------------------------------------------------------------------------
# Building the cluster


def build_network(lab: Lab) -> None:
    """fabric: a router with one link per node; each node routes its pod CIDR to point-to-
    point veths (one per pod, no bridge) and everything else to the fabric, which routes each
    pod CIDR to its node."""
    lab.add_ns(FABRIC, router=True, sysctls=SYSCTLS)
    for node in NODES:
        lab.add_ns(node.name, router=True, sysctls=SYSCTLS)
        lab.link(FABRIC, node.name, [f"{node.fabric_ip}/24"], [f"{node.ip}/24"],
                 if_a=f"to-{node.name}", if_b="eth0")
        lab.ip(node.name, "route", "add", "default", "via", node.fabric_ip)
        lab.ip(FABRIC, "route", "add", node.pod_cidr, "via", node.ip)
    for pod in PODS:
        attach(lab, pod.node, pod.name, pod.ip)
    for node in NODES:
        attach(lab, node, node.client, node.client_ip)


def attach(lab: Lab, node: NodeSpec, name: str, ip: str) -> None:
    """A pod-like namespace on `node`: ip/32 on eth0, default route via the node's pod
    gateway address (which the node holds on every pod link)."""
    lab.add_ns(name, sysctls=SYSCTLS)
    veth = f"veth-{name}"
    lab.link(node.name, name, [f"{node.pod_gateway}/32"], [f"{ip}/32"], if_a=veth, if_b="eth0")
    lab.ip(node.name, "route", "add", f"{ip}/32", "dev", veth)
    lab.ip(name, "route", "add", node.pod_gateway, "dev", "eth0", "scope", "link")
    lab.ip(name, "route", "add", "default", "via", node.pod_gateway, "dev", "eth0")


def socket_path(workdir: Path, node: NodeSpec) -> str:
    return str(workdir / f"{node.name}.sock")


def daemon_argv(node: NodeSpec, snapshot: Path, workdir: Path) -> list[str]:
    return DaemonArgs(snapshot=snapshot, node=node.name, bind_address=node.ip,
                      cluster_cidr=CLUSTER_CIDR, min_sync_period=None, sync_period=None,
                      debug_socket=socket_path(workdir, node), binary=str(PYPROXY)).argv()


# --------------------------------------------------------------------------------------------
# Asking the daemons


class DemoError(RuntimeError):
    pass


def status(workdir: Path, node: NodeSpec) -> dict[str, Any] | None:
    try:
        answer: dict[str, Any] = ask(socket_path(workdir, node), "/status", timeout=2.0)
    except DebugError:
        return None
    return answer


def settled(st: dict[str, Any] | None) -> bool:
    """Synced, and nothing waiting for the next sync."""
    if not st or not st.get("lastSync") or st["lastSync"].get("error"):
        return False
    pending = st.get("pendingChanges") or {}
    return not pending.get("services") and not pending.get("endpoints")


def wait_for(lab: Lab, workdir: Path, done: Callable[[NodeSpec, dict[str, Any] | None], bool],
             what: str) -> dict[str, dict[str, Any]]:
    """Poll every daemon's status until done() holds for all of them (bounded)."""
    deadline = time.monotonic() + SYNC_TIMEOUT
    while True:
        for proc, node in zip(lab.processes, NODES, strict=True):
            if proc.poll() is not None:
                raise DemoError(f"pyproxy on {node.name} exited ({proc.returncode}) "
                                f"while waiting for {what}")
        answers = {n.name: status(workdir, n) for n in NODES}
        if all(done(n, answers[n.name]) for n in NODES):
            return {k: v for k, v in answers.items() if v is not None}
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {SYNC_TIMEOUT:.0f}s waiting for {what}")
        time.sleep(0.1)


def service_entry(workdir: Path, node: NodeSpec, scenario: Scenario) -> dict[str, Any]:
    entries = ask(socket_path(workdir, node), "/services", service=scenario.key)
    if not entries:
        raise DemoError(f"{node.name}'s daemon does not know {scenario.key}")
    entry: dict[str, Any] = entries[0]
    return entry


def pod_names(endpoints: list[str] | None) -> str:
    if endpoints is None:
        return "-"
    if not endpoints:
        return "none"
    by_ip = {p.ip: p.name for p in PODS}
    return ",".join(by_ip.get(ep.rsplit(":", 1)[0], ep) for ep in endpoints)


# --------------------------------------------------------------------------------------------
# Traffic


def measure(lab: Lab, scenario: Scenario, count: int) -> dict[str, Counter[str]]:
    """`count` connections from every node's client pod to the service, all nodes at once."""
    def one(node: NodeSpec) -> Counter[str]:
        return lab.probe_http(node.client, scenario.ip, SERVICE_PORT, count)

    with ThreadPoolExecutor(len(NODES)) as pool:
        results = pool.map(one, NODES)
    return {node.name: counts for node, counts in zip(NODES, results, strict=True)}


def show(lab: Lab, workdir: Path, scenario: Scenario, count: int,
         heading_text: str | None = None, expect: str | None = None) -> dict[str, Counter[str]]:
    heading(heading_text or f"{scenario.number}. {scenario.title}")
    say(f"  service {scenario.key}  {scenario.ip}:{SERVICE_PORT} -> :{POD_PORT}  "
        f"endpoints {', '.join(scenario.pods)}")
    say(f"  {count} connections from each node's client pod; where they landed:")
    say()
    counts = measure(lab, scenario, count)
    extra = sorted({k for c in counts.values() for k in c} - set(POD))
    header = ["FROM", *POD, *extra, "TOPOLOGY (pyproxy services)", "ENDPOINTS IN USE"]
    rows = [header]
    for node in NODES:
        entry = service_entry(workdir, node, scenario)
        used = (entry["clusterEndpoints"] if entry["clusterEndpoints"] is not None
                else entry["localEndpoints"])
        rows.append([node.name, *(str(counts[node.name][k] or "-") for k in (*POD, *extra)),
                     topology_text(entry["topology"]), pod_names(used)])
    numeric = range(1, 1 + len(POD) + len(extra))
    table(rows, right=lambda i: i in numeric)
    expect = scenario.expect if expect is None else expect
    if expect:
        say()
        say(textwrap.fill(expect, WIDTH, initial_indent="  -> ", subsequent_indent="     "))
    return counts


# --------------------------------------------------------------------------------------------
# The demo


def introduce(workdir: Path) -> None:
    say("pyproxy demo: three nodes in two zones, one `pyproxy run` per node, real packets")
    say("=" * WIDTH)
    rows = [["NODE", "ZONE", "NODE IP", "POD CIDR", "BACKEND POD", "CLIENT POD"]]
    for node in NODES:
        pod = next(p for p in PODS if p.node == node)
        rows.append([node.name, node.zone, node.ip, node.pod_cidr, f"{pod.name} {pod.ip}",
                     f"{node.client} {node.client_ip}"])
    table(rows)
    say()
    say("  Each node, pod and client is a network namespace (pyproxy-demo-<name>); a 'fabric'")
    say("  namespace routes between the nodes. Backends answer HTTP on :8080 with their name.")
    say("  Services and EndpointSlices come from one snapshot file that every daemon follows")
    say("  (`pyproxy run --snapshot`) as it would the API server:")
    say(f"    {workdir}/cluster.yaml")


def start(lab: Lab, workdir: Path, snapshot: Path) -> None:
    heading("Starting")
    t0 = time.monotonic()
    build_network(lab)
    say(f"  {len(NAMESPACES)} namespaces wired up in {time.monotonic() - t0:.1f} s")
    write_snapshot(snapshot)
    node = NODES[0]
    say("  one daemon per node namespace, e.g. on node-a:")
    for line in wrapped(["ip", "netns", "exec", lab.ns(node.name).full,
                         *daemon_argv(node, snapshot, workdir)]):
        say(f"    {line}")
    t1 = time.monotonic()
    for node in NODES:  # before the backend threads: no other thread runs while forking
        lab.popen(node.name, daemon_argv(node, snapshot, workdir),
                  log_name=f"pyproxy-{node.name}.log", detach=True)
    for pod in PODS:
        lab.serve_http(pod.name, "0.0.0.0", POD_PORT, pod.name)
    wait_for(lab, workdir, lambda n, st: settled(st), "the first sync")
    say(f"  all three daemons synced {time.monotonic() - t1:.1f} s after starting")


def live_change(lab: Lab, workdir: Path, snapshot: Path, count: int) -> None:
    heading("6. Fallback: zone-2 loses its only ready pod (a live change)")
    before = {n.name: st["source"]["loads"]
              for n in NODES if (st := status(workdir, n)) is not None}
    written = time.time()
    write_snapshot(snapshot, not_ready=frozenset({"pod-c1"}))
    say("  The snapshot is rewritten (write + rename) with pod-c1 ready: false in every")
    say("  EndpointSlice. The daemons notice the file and sync (from their `pyproxy status`):")

    def picked_up(node: NodeSpec, st: dict[str, Any] | None) -> bool:
        return bool(st and st["source"]["loads"] > before.get(node.name, 0) and settled(st)
                    and st["lastSync"]["started"] >= written)

    answers = wait_for(lab, workdir, picked_up, "the change to be synced")
    for node in NODES:
        last = answers[node.name]["lastSync"]
        done_after = last["started"] + last["seconds"] - written
        say(f"    {node.name}: synced {done_after:.2f} s after the write: {last['commands']} "
            f"nft commands in one transaction, {last['kernel_seconds'] * 1000:.1f} ms in the "
            "kernel")
    show(lab, workdir, SCENARIO["zonal"], count,
         "6a. PreferSameZone after the change (demo/zonal)",
         "no ready endpoint is hinted for zone-2 any more: node-c's daemon ignores the zone "
         "hints and falls back to the zone-1 pods; zone-1 nodes are unaffected")
    show(lab, workdir, SCENARIO["nearest"], count,
         "6b. Topology keys after the change (demo/nearest)",
         "node-c matches neither its node nor its zone any more: the '*' key applies")


def explore(lab: Lab, workdir: Path) -> list[list[str]]:
    c = NODES[2]  # node-c: where the live change made a difference
    sock = socket_path(workdir, c)
    commands = [
        [str(PYPROXY), "services", "--socket", sock],
        [str(PYPROXY), "explain", SCENARIO["zonal"].key, "--socket", sock],
        [str(PYPROXY), "trace", "--socket", sock, "--src", c.client_ip,
         "--dst", f"{SCENARIO['zonal'].ip}:{SERVICE_PORT}"],
        ["ip", "netns", "exec", lab.ns(c.name).full, "nft", "list", "table", "ip", "pyproxy"],
    ]
    more = [
        [str(PYPROXY), "status", "--socket", sock],
        [str(PYPROXY), "history", "--socket", sock],
        [str(PYPROXY), "diff", "--socket", sock],
        ["ip", "netns", "exec", lab.ns(c.client).full, "curl", "-s",
         f"http://{SCENARIO['web'].ip}/"],
        ["ip", "netns", "exec", lab.ns(c.name).full, "curl", "-s", "127.0.0.1:10256/healthz"],
        ["ip", "netns", "exec", lab.ns(c.name).full, "curl", "-s", "127.0.0.1:10249/metrics"],
    ]
    heading("Look inside (node-c)")
    say("  Every daemon answers on its own debug socket (node-a.sock, node-b.sock, node-c.sock")
    say("  in the temp directory) and programs only its own node namespace:")
    for argv in commands + more:
        say(f"    {shown(argv)}")
    for argv in commands:
        say()
        say(f"$ {shown(argv)}")
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False,
                             stdin=subprocess.DEVNULL)
        text = (out.stdout + out.stderr).rstrip("\n")
        if argv[0] == "ip":
            text, elided = without_empty_sets(text)
            if elided:
                say(textwrap.fill(f"(the {len(elided)} empty sets and maps are left out here: "
                                  f"{', '.join(elided)})", WIDTH))
        say(text)
    return commands + more


def without_empty_sets(listing: str) -> tuple[str, list[str]]:
    """An `nft list table` without its empty sets and maps (there for other service types
    and protocols): the text and the names left out."""
    out: list[str] = []
    elided: list[str] = []
    block: list[str] = []
    for line in listing.splitlines():
        if block:
            block.append(line)
            if line == "\t}":
                if any("elements = " in b for b in block):
                    out += block
                else:
                    elided.append(block[0].split()[1])
                    if out and out[-1] == "":
                        out.pop()  # and the blank line before it
                block = []
        elif line.startswith(("\tset ", "\tmap ")):
            block = [line]
        else:
            out.append(line)
    return "\n".join(out + block).replace("{\n\n", "{\n"), elided


def keep_running(lab: Lab, workdir: Path, snapshot: Path, commands: list[list[str]]) -> None:
    heading("The cluster keeps running (--keep)")
    say("  In another terminal, as root, e.g.:")
    for argv in commands:
        say(f"    {shown(argv)}")
    say(f"  Edit {snapshot} to change the cluster: the daemons follow it.")
    say(f"  Daemon logs: {workdir}/pyproxy-node-*.log")
    say()
    try:
        if sys.stdin.isatty():
            say("  Press Enter (or Ctrl-C) to tear it all down.")
            try:
                input()
            except EOFError:
                signal.pause()
        else:
            say("  Ctrl-C (SIGINT/SIGTERM) tears it all down.")
            signal.pause()
    except KeyboardInterrupt:
        say()  # the normal way out of --keep


def report_leftovers(lab: Lab, started: float, daemons: int, deleted: int) -> int:
    left = lab.leftovers()
    if left:
        say(f"Cleanup incomplete: namespaces {', '.join(left)} remain (the next run removes "
            "them)")
        return 1
    say(f"Cleaned up: {daemons} daemons stopped, {deleted} namespaces and the temp directory "
        f"removed. {time.monotonic() - started:.1f} s in all.")
    return 0


def preflight() -> None:
    if os.geteuid() != 0:
        raise DemoError("the demo creates network namespaces: run it as root")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            raise DemoError(f"`{tool}` not found (Debian: apt-get install iproute2 nftables)")
    if not PYPROXY.exists():
        raise DemoError(f"{PYPROXY} missing: run `make venv` (or use the venv's python)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="leave the cluster running until Enter/Ctrl-C, to explore it")
    parser.add_argument("--count", type=int, default=30,
                        help="connections per node and service (default 30)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    stop_on_signals()
    try:
        preflight()
        lab = Lab(prefix=PREFIX)  # one demo at a time; a killed run's leftovers are swept
        workdir = lab.workdir
        failed = interrupted = False
        try:
            if lab.swept:
                dirs = sum(1 for s in lab.swept if s.startswith("/"))
                say(f"(removed what a killed earlier run left: {len(lab.swept) - dirs} "
                    f"namespaces, {dirs} temp directories)")
            snapshot = workdir / "cluster.yaml"
            introduce(workdir)
            start(lab, workdir, snapshot)
            for scenario in SCENARIOS:
                show(lab, workdir, scenario, args.count)
            live_change(lab, workdir, snapshot, args.count)
            commands = explore(lab, workdir)
            if args.keep:
                keep_running(lab, workdir, snapshot, commands)
        except (DemoError, NetlabError, DebugError) as err:
            failed = True
            say(f"\ndemo failed: {err}")
            for log in sorted(workdir.glob("pyproxy-*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                say(f"--- {log.name} (last lines)")
                for line in tail:
                    say(f"  {line}")
        except KeyboardInterrupt:
            interrupted = True
            say("\ninterrupted")
        except OutputClosed:
            pass  # nobody reads on: clean up below, exit as a shell reports SIGPIPE
        finally:
            hold_off_signals()  # let the cleanup finish
            with contextlib.suppress(OutputClosed):  # the reader may go just now
                say()
                say("Cleaning up ...")
            daemons, deleted = len(lab.processes), len(lab.namespaces)
            lab.close()  # daemons, backends, namespaces, the temp directory, the lock
        with contextlib.suppress(OutputClosed):
            code = report_leftovers(lab, started, daemons, deleted)
        if output_closed():
            return SIGPIPE_CODE
        return stopped_by() if interrupted else 1 if failed else code
    except Locked as err:
        say(f"demo: another pyproxy demo is running ({err})")
        return 1
    except DemoError as err:
        say(f"demo: {err}")
        return 1
    except KeyboardInterrupt:  # before the lab existed
        return stopped_by()
    except OutputClosed:  # before the lab existed, or while the cleanup reported
        return SIGPIPE_CODE


if __name__ == "__main__":
    sys.exit(main())
