"""Bursts of endpoint changes, coalesced by minSyncPeriod."""

from __future__ import annotations

import itertools
import math
import time

from drills.harness import WEB, ApiBench, Env, Obj, Probe, Result, api_bench, until, web
from testkit.builders import ep, make_slice


def burst(env: Env, changes: int = 1000, window: float = 1.0, min_sync_period: float = 1.0,
          bench: ApiBench | None = None) -> Result:
    with api_bench(env, bench, "burst", min_sync_period=min_sync_period, sync_period=30) as b:
        emu, daemon = b.emu, b.daemon
        min_sync_period = daemon.min_sync_period
        r = Result("burst", f"{changes} endpoint changes within {window:g} s "
                   f"(minSyncPeriod {min_sync_period:g} s)")

        def state(i: int) -> list[Obj]:
            # pod-a stays ready throughout the burst while pod-b and pod-c flip; the last
            # state (b and c, not a) happens only once, at the end.
            a_ready, b_ready, c_ready = True, (i % 2 == 0), (i % 3 != 0)
            if i == changes - 1:
                a_ready, b_ready, c_ready = False, True, True
            return [ep(env.pod("pod-a"), "node-b", ready=a_ready),
                    ep(env.pod("pod-b"), "node-b", ready=b_ready),
                    ep(env.pod("pod-c"), "node-b", ready=c_ready)]

        b.apply(web(env, ["pod-a", "pod-b", "pod-c"]))
        until(lambda: daemon.endpoints("web") == env.pods("pod-a", "pod-b", "pod-c"), 20,
              "initial state programmed")
        emu.wait_for_watches(1, "endpointslices")
        events_before = sum(w["events"] for w in daemon.status()["source"]["api"])
        time.sleep(min_sync_period + 0.1)  # the cooldown of the last sync is over
        probe = Probe(env, WEB)
        started_wall = time.time()
        start = time.monotonic()
        for i in range(changes):
            emu.apply("EndpointSlice", make_slice("ns", "web", state(i)))
            if i % 50 == 49:  # spread evenly over the window
                time.sleep(max(0.0, start + window * (i + 1) / changes - time.monotonic()))
        spent = time.monotonic() - start
        r.check(spent <= window * 1.5, f"the burst took {spent:.2f} s")
        r.converge_s = until(lambda: daemon.endpoints("web") == env.pods("pod-b", "pod-c"),
                             30, "final state after the burst")
        r.converge_what = "last change to programmed"
        r.check(r.converge_s <= min_sync_period + 1.0, "final state later than minSyncPeriod")
        time.sleep(min_sync_period + 0.2)  # a last sync would come now
        r.check(set(env.connect(WEB, 24)) == {"pod-b", "pod-c"}, "datapath not final")
        records = [h for h in daemon.history() if h["started"] >= started_wall - 0.01
                   and (h["services_changed"] or h["endpoints_changed"] or h["error"])]
        syncs = len(records)
        covered = time.time() - started_wall
        allowed = math.ceil(covered / min_sync_period) + 1
        r.check(syncs <= allowed, f"{syncs} syncs in {covered:.1f} s")
        gaps = [b2["started"] - (a["started"] + a["seconds"])
                for a, b2 in itertools.pairwise(records)]
        r.check(all(g >= min_sync_period - 0.05 for g in gaps),
                f"syncs closer than minSyncPeriod: {[round(g, 3) for g in gaps]}")
        r.check(daemon.status()["pendingChanges"] == {"services": 0, "endpoints": 0},
                "changes still pending")
        probe.finish()
        r.add_probe(probe)
        r.check(probe.failed == 0, f"{probe.failed} connections failed: {probe.tally()}")
        r.figures["burst took"] = f"{spent:.2f} s"
        r.figures["syncs with changes, burst to settled"] = f"{syncs} (at most {allowed})"
        r.figures["endpoint changes per sync"] = [h["endpoints_changed"] for h in records]
        r.figures["watch events received"] = sum(
            w["events"] for w in daemon.status()["source"]["api"]) - events_before
    return r
