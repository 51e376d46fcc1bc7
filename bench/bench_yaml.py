"""`pyproxy explain` on one cluster snapshot written as YAML and as JSON: time and peak
resident memory of the whole command, and the ratios YAML / JSON (issue 39: within 2x each).

The snapshot is bench/synth.py's cluster (SERVICES x ENDPOINTS, its mix of kinds and
policies) as `kubectl get nodes,services,endpointslices -A -o yaml|json` prints it: one
`kind: List`, keys sorted, YAML in block style, JSON indented by 4. Each round runs both
commands in fresh processes, one after the other (their order alternating), with standard
output to /dev/null. The figures are the medians over the rounds of the wall time, the CPU
time (user + system: on a loaded machine the steadier figure) and the peak, from the
child's own rusage. With --against REV, that commit's pyproxy (a temporary git worktree,
bench/against.py) runs in the same rounds: before and after a change, at the machine's speed
of the moment. No root needed; a few minutes at 3,000 x 10 (with a pure-Python YAML
reader, much longer).

    make bench-yaml [YAML_FLAGS='--size 3000x10 --rounds 5 --against 5dbe308']
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench import against
from bench.synth import THIS_NODE
from bench.synth import Cluster as Synth

REPO = Path(__file__).resolve().parent.parent
FORMATS = ("yaml", "json")


def commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def launcher(folder: Path, source: Path) -> str:
    """A `pyproxy` that runs `source`'s package (not whatever the virtualenv's entry point
    imports; -P keeps the working directory off sys.path): the bench can run from a
    worktree of its own while this one is edited."""
    path = folder / "pyproxy"
    path.write_text(f"#!/bin/sh\nPYTHONPATH={source} exec {sys.executable} -P -c "
                    "'import sys; from pyproxy.cli import main; sys.exit(main())' \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def write_snapshot(directory: Path, services: int, endpoints: int) -> dict[str, Path]:
    """The same List in both formats, as kubectl prints them."""
    document = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
                "items": list(Synth(services, endpoints).objects())}
    paths = {fmt: directory / f"snapshot.{fmt}" for fmt in FORMATS}
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # writing is not what is measured
    paths["yaml"].write_text(yaml.dump(document, Dumper=dumper, default_flow_style=False,
                                       sort_keys=True), encoding="utf-8")
    paths["json"].write_text(json.dumps(document, indent=4, sort_keys=True), encoding="utf-8")
    return paths


def run_explain(pyproxy: str, path: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak resident MiB) of one `pyproxy explain -f path --node
    THIS_NODE`. CPU time (user + system) is what the command costs; the wall time on a
    loaded machine is several times it, and varies as much. The peak is the child's own,
    from wait4: Linux counts in it the memory of the process that started it until its
    exec, which is why the snapshot is written by another process."""
    command = [pyproxy, "explain", "-f", str(path), "--node", THIS_NODE]
    started = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        child = subprocess.Popen(command, stdout=sink, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} exited {os.waitstatus_to_exitcode(status)}")
    return elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # KiB on Linux


def measure(builds: dict[str, str], paths: dict[str, Path], rounds: int) -> dict[str, Any]:
    """Per build: both formats' medians and the ratios. Each round runs every (build,
    format), the order reversed every other round."""
    order = [(build, fmt) for build in builds for fmt in FORMATS]
    runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {key: [] for key in order}
    for round_ in range(rounds):
        for build, fmt in order if round_ % 2 == 0 else order[::-1]:
            runs[build, fmt].append(run_explain(builds[build], paths[fmt]))
            wall, cpu, mib = runs[build, fmt][-1]
            print(f"  round {round_ + 1} {build} {fmt}: {wall:.2f} s ({cpu:.2f} s CPU), "
                  f"{mib:.0f} MiB", flush=True)
    report: dict[str, Any] = {}
    for build in builds:
        figures: dict[str, Any] = {}
        for fmt in FORMATS:
            got = runs[build, fmt]
            figures[fmt] = {
                "seconds": round(statistics.median(r[0] for r in got), 3),
                "cpu_seconds": round(statistics.median(r[1] for r in got), 3),
                "peak_mib": round(statistics.median(r[2] for r in got), 1),
                "runs": [[round(x, 3) for x in r] for r in got],
            }
        for key, name in (("seconds", "time_ratio"), ("cpu_seconds", "cpu_ratio"),
                          ("peak_mib", "memory_ratio")):
            figures[name] = round(figures["yaml"][key] / figures["json"][key], 2)
        report[build] = figures
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="3000x10", help="SERVICESxENDPOINTS (3000x10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", metavar="REV",
                        help="also REV's pyproxy (a temporary git worktree), in the same rounds")
    parser.add_argument("--json", help="default: bench/results/yaml-SIZE-COMMIT.json")
    parser.add_argument("--write-to", metavar="DIR", help=argparse.SUPPRESS)  # the writer
    args = parser.parse_args()
    services, endpoints = (int(n) for n in args.size.split("x"))
    if args.write_to:
        write_snapshot(Path(args.write_to), services, endpoints)
        return 0
    report: dict[str, Any] = {"commit": commit(), "services": services, "endpoints": endpoints,
                              "pyyaml": yaml.__version__,
                              "libyaml": bool(getattr(yaml, "__with_libyaml__", False))}
    with tempfile.TemporaryDirectory(prefix="bench-yaml-") as tmp, contextlib.ExitStack() as stack:
        builds = {"this checkout": launcher(Path(tmp), REPO)}
        subprocess.run([sys.executable, "-m", "bench.bench_yaml", "--size", args.size,
                        "--write-to", tmp], check=True, cwd=REPO)
        paths = {fmt: Path(tmp) / f"snapshot.{fmt}" for fmt in FORMATS}
        report["bytes"] = {fmt: paths[fmt].stat().st_size for fmt in FORMATS}
        if args.against:
            builds[args.against] = stack.enter_context(against.other_build(args.against))
        print(f"explain on {services} x {endpoints}: YAML {report['bytes']['yaml'] >> 20} MiB, "
              f"JSON {report['bytes']['json'] >> 20} MiB; {args.rounds} rounds", flush=True)
        report["builds"] = measure(builds, paths, args.rounds)
    for build, figures in report["builds"].items():
        print(f"{build}: " + ", ".join(
            f"{fmt} {figures[fmt]['seconds']:.2f} s ({figures[fmt]['cpu_seconds']:.2f} s CPU) "
            f"{figures[fmt]['peak_mib']:.0f} MiB" for fmt in FORMATS)
              + f"; YAML / JSON: time {figures['time_ratio']:.2f} (CPU "
                f"{figures['cpu_ratio']:.2f}), memory {figures['memory_ratio']:.2f} "
                "(target: each within 2)")
    out = Path(args.json or REPO / "bench" / "results" /
               f"yaml-{args.size}-{report['commit']}.json")
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
