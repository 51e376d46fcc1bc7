"""The kernel floor of a first sync: the time one `nft -f` takes to commit pyproxy's whole
ruleset for a size into a fresh table, in one transaction, in a throwaway namespace.

The ruleset is the one `pyproxy render` prints for the synthetic cluster of bench/synth.py
(node-a, the benchmark's cluster CIDR), so the figure is the same nft text pyproxy would write,
parsed by nft and committed by the kernel in one go: no API, no decode, no diff. A proxy's
start → first complete ruleset divided by it says how far the start is from what the kernel
itself needs. Wall seconds and the `nft` process's user and system CPU (rusage) are kept: the
system part is the kernel's commit, the user part nft's parser.

`python -m bench.kernel_floor --sizes 44000x1,5000x50` prints it alone (root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.synth import Cluster as Synth
from testkit.netlab import Lab

PYPROXY = str(Path(sys.executable).parent / "pyproxy")


def snapshot(synth: Synth, extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The synthetic cluster as a kubectl-style List, the file `pyproxy render -f` reads."""
    return {"apiVersion": "v1", "kind": "List", "items": [*synth.objects(), *(extra or [])]}


def render(snapshot_file: Path, node: str, node_ip: str, cluster_cidrs: str) -> str:
    out = subprocess.run(
        [PYPROXY, "render", "-f", str(snapshot_file), "--node", node, "--node-ip", node_ip,
         "--cluster-cidr", cluster_cidrs], capture_output=True, text=True, check=True,
        timeout=900)
    return out.stdout


def commit_once(lab: Lab, script: Path, n: int) -> dict[str, float]:
    """One `nft -f` of the script into a fresh namespace: wall seconds, nft's user and
    system CPU seconds (the kernel's commit runs in its system time)."""
    ns = lab.add_ns(f"floor{n}")
    started = time.monotonic()
    proc = subprocess.Popen(["ip", "netns", "exec", ns.full, "nft", "-f", str(script)],
                            stderr=subprocess.PIPE, text=True)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode:
        raise RuntimeError(f"nft -f failed ({proc.returncode}): {err[:500]}")
    listed = ns.run(["nft", "list", "table", "ip", "pyproxy"], timeout=300).stdout
    lab.del_ns(ns)
    return {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "listed_lines": listed.count("\n")}


def kernel_floor(synth: Synth, node: str, node_ip: str, cluster_cidrs: str,
                 extra: list[dict[str, Any]] | None = None, repeats: int = 3) -> dict[str, Any]:
    """Renders the size's ruleset and commits it `repeats` times, each into a fresh
    namespace; the median and the minimum of each figure."""
    with tempfile.TemporaryDirectory() as tmp, Lab() as lab:
        snap = Path(tmp) / "snapshot.json"
        snap.write_text(json.dumps(snapshot(synth, extra)))
        started = time.monotonic()
        text = render(snap, node, node_ip, cluster_cidrs)
        render_s = time.monotonic() - started
        script = Path(tmp) / "ruleset.nft"
        script.write_text(text)
        runs = [commit_once(lab, script, n) for n in range(repeats)]
    out: dict[str, Any] = {"render_cli_s": round(render_s, 2), "script_bytes": len(text),
                           "script_lines": text.count("\n"), "repeats": repeats, "runs": runs}
    for key in ("wall_s", "user_s", "sys_s"):
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 3)
        out[f"min_{key}"] = round(min(values), 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="44000x1,5000x50,10000x10")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for size in args.sizes.split(","):
        services, endpoints = (int(x) for x in size.split("x"))
        figures = kernel_floor(Synth(services, endpoints), "node-a", "192.168.0.10",
                               "10.0.0.0/8", repeats=args.repeats)
        print(f"{size}: one nft -f of {figures['script_bytes'] / 2**20:.1f} MiB "
              f"({figures['script_lines']} lines): {figures['wall_s']:.2f} s wall "
              f"(min {figures['min_wall_s']:.2f}), nft user {figures['user_s']:.2f} s, "
              f"system {figures['sys_s']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
