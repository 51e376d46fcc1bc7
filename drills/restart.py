"""SIGKILL and restart while traffic flows."""

from __future__ import annotations

import time
from collections import Counter

from drills.harness import (
    STICKY,
    WEB,
    ApiBench,
    Env,
    Probe,
    Result,
    api_bench,
    stamp,
    sticky,
    until,
    web,
)


def kill_restart(env: Env, kills: int = 2, gap: float = 1.0, changes: bool = False,
                 bench: ApiBench | None = None) -> Result:
    r = Result("sigkill-restart", f"daemon SIGKILLed and restarted {kills}x under traffic"
               + (", endpoint changes while it is down" if changes else ""))
    with api_bench(env, bench, "restart") as b:
        daemon = b.daemon
        b.apply([*web(env, ["pod-a", "pod-b", "pod-c"]),
                 *web(env, ["pod-a", "pod-b", "pod-c"], "sticky", STICKY, sticky)])
        # Both services with all their endpoints: the service and its slice can reach the
        # daemon in different syncs, and a probe started in between sees a reject.
        everyone = env.pods("pod-a", "pod-b", "pod-c")
        until(lambda: daemon.endpoints("web") == everyone == daemon.endpoints("sticky"),
              20, "initial state programmed")
        probes = [Probe(env, WEB), Probe(env, STICKY)]
        time.sleep(0.5)
        restarts = []
        moments: list[str] = []  # reported only when a probe failed: to place the failures
        for i in range(kills):
            daemon.kill()
            moments.append(f"kill {i} at {stamp(time.time())}")
            want = env.pods("pod-a", "pod-b", "pod-c")
            if changes:
                pods = ["pod-a", "pod-b", "pod-c"][: 2 + i % 2]
                b.apply([web(env, pods)[1]])
                want = env.pods(*pods)
            time.sleep(0.3)
            daemon.restart()
            moments.append(f"restart {i} at {stamp(time.time())}")
            restarts.append(daemon.wait_ready())
            until(lambda w=want: daemon.endpoints("web") == w, 20, "state after restart")
            first = daemon.history()[0]
            r.check(first["full"] and first["reason"] == "start",
                    f"first sync after restart {i}: {first['reason']}")
            time.sleep(gap)
        for probe in probes:
            probe.finish()
            r.add_probe(probe)
        if any(probe.failed for probe in probes):
            r.notes.extend(moments)
        web_probe, sticky_probe = probes
        r.check(web_probe.failed == 0, f"web: {web_probe.failed} failed {web_probe.tally()}")
        r.check(sticky_probe.failed == 0,
                f"sticky: {sticky_probe.failed} failed {sticky_probe.tally()}")
        endpoints = Counter({k: v for k, v in sticky_probe.tally().items()
                             if k.startswith("pod-")})
        r.check(len(endpoints) == 1, f"session affinity lost across restarts: {endpoints}")
        r.converge_s = max(restarts)
        r.converge_what = "restart to first sync (max)"
        r.figures["restart to first sync"] = (f"mean {sum(restarts) / len(restarts):.2f} s, "
                                              f"max {max(restarts):.2f} s")
        r.figures["ClientIP service: endpoints seen by the one client"] = dict(endpoints)
    return r
