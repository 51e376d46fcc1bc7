"""The kernel refuses transactions (the debug socket's /fault): retries, /healthz, repair."""

from __future__ import annotations

import itertools
import time

from drills.harness import (
    NODE,
    WEB,
    Daemon,
    Env,
    HealthWatch,
    Probe,
    Result,
    SnapshotBench,
    lb_local,
    snapshot_bench,
    until,
    web,
    write_snapshot,
)
from drills.tamper import TAMPERS
from pyproxy.core.plan import Cause
from pyproxy.sync.applier import STALE_CHAIN_GRACE
from testkit.builders import make_node


def kernel_faults(env: Env, sync_period: float = 2.0, hold: float | None = None,
                  damage_check: bool = True, bench: SnapshotBench | None = None) -> Result:
    with snapshot_bench(env, bench, "faults", sync_period=sync_period) as b:
        daemon = b.daemon
        sync_period = daemon.sync_period
        hold = hold if hold is not None else 2 * sync_period + 1
        r = Result("kernel-rejects", f"every transaction refused for {hold:g} s (/fault), then "
                   f"one refused transaction (syncPeriod {sync_period:g} s)")
        node = make_node(NODE, "zone-1")
        lb = lb_local(env)
        b.write([node, *web(env, ["pod-a", "pod-b"]), *lb])
        r.check(daemon.healthz() == 200, "not healthy before the faults")
        if damage_check:
            _repair_refused(r, env, daemon, sync_period)
        probe = Probe(env, WEB)
        failures_before = daemon.status()["syncFailures"]
        loads = daemon.status()["source"]["loads"]
        answer = daemon.ask("/fault", fail=100000)
        r.check(set(answer["failNext"].values()) == {100000}, f"/fault answered {answer}")
        queued_wall = time.time()
        write_snapshot(b.path, [node, *web(env, ["pod-a", "pod-b", "pod-c"]), *lb])
        queued = time.monotonic()
        until(lambda: daemon.status()["source"]["loads"] > loads, 5, "snapshot read")
        codes = _watch_health(daemon, hold, since=queued)
        first_503 = min((t for t, c in codes.items() if c == 503), default=None)
        limit = 2 * sync_period
        r.check(first_503 is not None, f"/healthz never turned 503 in {hold:g} s of failures")
        if first_503 is not None:
            r.check(first_503 >= limit - 0.05,
                    f"/healthz 503 after {first_503:.2f} s, before 2 x syncPeriod")
            r.check(first_503 <= limit + 1.0, f"/healthz 503 only after {first_503:.2f} s")
            r.figures["/healthz 503 after (change queued, all syncs failing)"] = \
                f"{first_503:.2f} s (2 x syncPeriod = {limit:g} s)"
        r.check(daemon.endpoints("web") == env.pods("pod-a", "pod-b"),
                "the change was programmed despite the faults")
        daemon.ask("/fault", fail=0)
        r.converge_s = until(lambda: daemon.healthz() == 200 and daemon.endpoints("web")
                             == env.pods("pod-a", "pod-b", "pod-c"), sync_period * 3 + 5,
                             "recovery after the faults stop")
        r.converge_what = "faults stop to healthy + programmed"
        r.check(r.converge_s <= sync_period + 1.0, "recovery slower than one syncPeriod")
        after = [h for h in daemon.history() if h["started"] >= queued_wall - 0.1]
        failed = [h for h in after if h["error"]]
        gaps = [b2["started"] - (a["started"] + a["seconds"])
                for a, b2 in itertools.pairwise(failed)]
        r.check(len(failed) >= 2, f"only {len(failed)} failed syncs recorded")
        r.check(all(g >= sync_period * 0.9 for g in gaps),
                f"retries closer than syncPeriod: {gaps}")
        first_ok = next((h for h in after if not h["error"]), None)
        r.check(first_ok is not None and first_ok["full"],
                f"the sync after the failures was not a full one: {first_ok}")
        r.figures["failed syncs (retries)"] = (
            f"{len(failed)}, every {min(gaps, default=0):.2f}-{max(gaps, default=0):.2f} s")
        r.figures["syncFailures counted"] = daemon.status()["syncFailures"] - failures_before

        # One refused transaction: retried after syncPeriod, recovers alone, never 503.
        family = daemon.status()["families"][0]
        nft_family = "ip" if family == "IPv4" else "ip6"
        daemon.ask("/fault", fail=1, family=nft_family)
        before = daemon.status()["syncFailures"]
        write_snapshot(b.path, [node, *web(env, ["pod-a", "pod-b"])])  # `lb` goes too
        start = time.monotonic()
        seen_codes = set()
        while daemon.endpoints("web") != env.pods("pod-a", "pod-b"):
            r.check(time.monotonic() - start < sync_period * 3 + 5,
                    "did not recover alone from one refused transaction")
            if not r.ok:
                break
            seen_codes.add(daemon.healthz())
            time.sleep(0.1)
        took = time.monotonic() - start
        seen_codes |= set(_watch_health(daemon, 0.3).values())
        r.check(seen_codes == {200}, f"/healthz answered {sorted(seen_codes)} meanwhile")
        r.check(daemon.status()["syncFailures"] - before == 1, "not exactly one failed sync")
        r.figures["one refused transaction: programmed after"] = (
            f"{took:.2f} s, /healthz 200 throughout")
        # The endpoint count went 2 → 3 → 2: a chain of ours is deleted after a grace
        # period, which must not pass for tampering (no repair sync, `diff` clean).
        time.sleep(STALE_CHAIN_GRACE + sync_period + 0.3)
        spurious = [h for h in daemon.history() if h["started"] >= queued_wall
                    and h["cause"] == Cause.REPAIR.name.lower()]
        r.check(not spurious, "our own stale-chain deletion was taken for tampering")
        r.check(daemon.diff_clean(), "pyproxy diff not clean after the faults")
        probe.finish()
        r.add_probe(probe)
        r.check(probe.failed == 0, f"{probe.failed} connections failed: {probe.tally()}")
    return r


def _repair_refused(r: Result, env: Env, daemon: Daemon, sync_period: float) -> None:
    """A tamper whose repair the kernel keeps refusing, with nothing queued: traffic to every
    service fails (the DNAT base chain is gone), so /healthz and the health-check node port
    must answer 503, with the reason, at once and until the repair succeeds; /livez, about
    the process, stays 200."""
    idle = Probe(env, WEB, timeout=0.3)
    daemon.ask("/fault", fail=100000)
    seconds = 2 * sync_period + 2
    watch = HealthWatch(daemon)
    tampered = time.monotonic()
    env.nft(*TAMPERS["base chain nat-prerouting deleted"])
    time.sleep(seconds)
    daemon.ask("/fault", fail=0)
    stopped = time.monotonic()
    until(lambda: daemon.diff_clean() and daemon.health().healthz == 200, sync_period * 3 + 5,
          "repaired and healthy after the faults")
    samples = watch.finish()
    idle.finish()
    env.lab.flush_conntrack(env.cluster.node)  # un-NATed entries of that window
    during = [x for x in samples if tampered <= x.at <= stopped]
    first = next((x.at - tampered for x in during if x.healthz == 503), None)
    r.check(first is not None, "/healthz never 503 while the repair was refused")
    if first is not None:
        # Reported by the change event, then one refused repair: well under a second (a
        # generous bound; the figure is reported).
        r.check(first <= 1.0, f"/healthz 503 only {first:.2f} s after the tamper")
        held = [x for x in during if x.at - tampered >= first]
        r.check(all(x.healthz == 503 and x.node_port == 503 for x in held),
                "/healthz or the health-check node port back to 200 while still broken")
        reasons = {x.reason for x in held} | {x.node_port_reason for x in held}
        r.check(all(Cause.REPAIR.value in why for why in reasons),
                f"503 without the reason: {sorted(reasons)[:3]}")
        r.check(any("the repair failed" in why for why in reasons),
                f"the refused repair never named: {sorted(reasons)[:3]}")
        r.figures[f"repair refused {seconds:g} s, nothing queued: /healthz"] = (
            f"503 from {first * 1000:.0f} ms after the tamper until repaired "
            f"({idle.failed} of {len(idle.results)} connections failed meanwhile)")
        failed = sorted(why for why in reasons if "the repair failed" in why)
        r.figures["/healthz reason"] = min(failed or sorted(reasons) or [""], key=len)
    # /livez is about the process: the damage never fails it; only kube-proxy's own rule
    # does, once the refused repairs are older than 2 x syncPeriod.
    # Timed by when /livez answered: the sample's own time is /healthz's, asked before it
    # (a run under load saw /livez 503 "9.91 s" after the tamper by that time).
    early = [x for x in samples
             if x.livez != 200 and x.livez_at - tampered < 2 * sync_period - 0.05]
    r.check(not early, f"/livez {early[0].livez} {early[0].livez_at - tampered:.2f} s after "
            "the tamper" if early else "")
    r.check(all(Cause.REPAIR.value not in x.livez_reason for x in samples),
            "/livez failed because of the damage")


def _watch_health(daemon: Daemon, seconds: float, since: float | None = None,
                  interval: float = 0.1) -> dict[float, int]:
    """/healthz codes by time (seconds after `since`, default now)."""
    since = since if since is not None else time.monotonic()
    out: dict[float, int] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        code = daemon.healthz()
        out[time.monotonic() - since] = code
        time.sleep(interval)
    return out
