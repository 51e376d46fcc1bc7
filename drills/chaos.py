"""`make chaos`: the long versions of the drills (docs/drills.md), each with its own daemon,
in network namespaces the run creates and removes. Prints every drill's figures and, at the
end, the table of faults (connections attempted/failed, time to converge) in Markdown.

    .venv/bin/python -m drills.chaos                 # everything (about 10 minutes)
    .venv/bin/python -m drills.chaos --only outage   # drills whose name contains "outage"
    .venv/bin/python -m drills.chaos --markdown out.md --json out.json

(from the repository root, as `make chaos` runs it: the drills import the kit, testkit/).

Exit status: 0 when every drill met its expectations (the known bugs, still open, are
expected to fail and are reported, not counted), 1 otherwise, 2 when the run could not start
(not root, no network namespaces).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from drills import migration
from drills import scenarios as d
from testkit.netlab import NETNS_USABLE, Lab

Drill = tuple[str, Callable[[d.Env], d.Result | list[d.Result]]]


def drills(seed: int) -> list[Drill]:
    return [
        ("api-outage", lambda env: d.api_outage(env, outage=60.0, mode="refuse")),
        ("api-outage-503", lambda env: d.api_outage(env, outage=30.0, mode="503")),
        ("410-storm", lambda env: d.watch_gone_storm(env, duration=60.0, period=0.25)),
        ("stalled-watch", lambda env: d.stalled_watch(env, stall=75.0, wait_alone=True)),
        ("stalled-watch-reflector", lambda env: d.reflector_read_timeout(env, 2.0)),
        ("sigkill-restart", lambda env: d.kill_restart(env, kills=10, gap=1.0, changes=True)),
        ("tamper", lambda env: d.tamper(env, sync_period=2.0)),
        ("kernel-rejects", lambda env: d.kernel_faults(env, sync_period=5.0, hold=14.0)),
        ("burst", lambda env: d.burst(env, changes=1000, window=1.0)),
        ("burst-long", lambda env: d.burst(env, changes=10000, window=10.0)),
        ("bad-input", lambda env: d.bad_input(env, count=10000, seed=seed)),
        ("injection", d.injection),
        ("inputs", d.input_cases),
        ("oversized", lambda env: d.oversized(env, slices=20, ports=100, port_endpoints=1000)),
        ("security", d.security),
        # Starts its own control plane (make k8s builds it).
        ("kube-proxy-migration", lambda env: migration.chaos(env, round_trips=3, hold_s=10.0,
                                                             clients=16, extra=20)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run only drills whose name contains this (repeatable)")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                        help="hypothesis seed of the bad-input drill (default: from the clock)")
    parser.add_argument("--markdown", help="also write the table of faults to this file")
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args(argv)
    if not NETNS_USABLE:
        print("chaos: needs root and `ip netns` (network namespaces)", file=sys.stderr)
        return 2
    selected = [(n, f) for n, f in drills(args.seed)
                if not args.only or any(o in n for o in args.only)]
    results: list[d.Result] = []
    started = time.monotonic()
    print(f"chaos: {len(selected)} drills, seed {args.seed}", flush=True)
    with Lab() as lab:
        # Outlier ejection on for every TCP Service of every drill's daemon: no drill has a
        # failing endpoint, so none may be ejected (checked after each drill).
        env = d.Env(lab.standard_topology(backends=3), daemon_flags=("--outlier-ejection",))
        for name, run in selected:
            print(f"\n== {name}", flush=True)
            t0 = time.monotonic()
            ejected = d.ejections_logged(env.workdir)
            try:
                outcome = run(env)
            except Exception as err:  # a drill that breaks down is a result too
                outcome = d.Result(name, "(the drill broke down)")
                outcome.violations.append(f"{type(err).__name__}: {err}")
                outcome.notes.append(traceback.format_exc()[-1500:])
                env.cleanup()
            batch = outcome if isinstance(outcome, list) else [outcome]
            ejected = d.ejections_logged(env.workdir) - ejected
            batch[0].figures["outlier_ejections"] = ejected
            batch[0].check(ejected == 0, f"{ejected} endpoint(s) ejected by outlier ejection "
                           "(on in every drill's daemon): no drill has a failing endpoint")
            for res in batch:
                print(res.summary(), flush=True)
            print(f"   ({time.monotonic() - t0:.0f} s)", flush=True)
            results += batch
    known = {res.fault for res in results if res.drill == "known bug"}
    failed = [res for res in results if not res.ok and res.fault not in known]
    table = d.markdown_table(results)
    print(f"\nchaos: {len(results)} results in {time.monotonic() - started:.0f} s, "
          f"{len(failed)} not as expected (known bugs excluded)\n")
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results],
                                              indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
