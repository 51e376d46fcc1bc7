"""Someone else deletes pyproxy's table, a base chain, a map: repaired at once."""

from __future__ import annotations

import time
from collections.abc import Iterable

from drills.harness import (
    WEB,
    Env,
    HealthWatch,
    Probe,
    Result,
    SnapshotBench,
    lb_local,
    snapshot_bench,
    until,
)
from pyproxy.kernel.nft import STALE_CHAIN_GRACE
from pyproxy.sync.node import REPAIR_REASON

TAMPERS = {
    "table ip pyproxy deleted": ["delete table ip pyproxy"],
    "base chain nat-prerouting deleted": ["delete chain ip pyproxy nat-prerouting"],
    "map service-ips deleted": ["flush chain ip pyproxy services",
                                "delete map ip pyproxy service-ips"],
    "table ip6 pyproxy deleted": ["delete table ip6 pyproxy"],
}


def tamper(env: Env, sync_period: float = 1.0, which: Iterable[str] = tuple(TAMPERS),
           bench: SnapshotBench | None = None, max_failed: int = 50) -> Result:
    """Each tamper is announced by the kernel's nftables change events and repaired at once
    (the periodic structure check every syncPeriod is only the backstop). The issue's goals:
    repaired within 0.2 s, at most 50 failed connections (`max_failed`) in the long drill.
    How many fail depends on where the probe is when it happens: without the base chain or
    the map, `cluster-ips-check` rejects at once and the probe fails a connection every
    ~0.25 ms of the ~10 ms from the tamper's commit to the repair's."""
    which = list(which)
    with snapshot_bench(env, bench, "tamper", sync_period=sync_period) as b:
        daemon = b.daemon
        sync_period = daemon.sync_period
        r = Result("tamper", f"{', '.join(which)} (syncPeriod {sync_period:g} s)")
        b.write([*b.base, *lb_local(env)])
        repairs_before = daemon.metric("pyproxy_table_repairs_total")
        probe = Probe(env, WEB, timeout=0.3)
        times: dict[str, float] = {}
        unhealthy: dict[str, float] = {}
        for label in which:
            until(daemon.diff_clean, 10, "clean before tampering")
            time.sleep(0.2)
            r.check(daemon.health().healthz == 200, f"{label}: /healthz not 200 before")
            watch = HealthWatch(daemon)
            tampered_wall, tampered = time.time(), time.monotonic()
            env.nft(*TAMPERS[label])

            def repaired() -> bool:
                return daemon.diff_clean() and set(env.connect(WEB, 2, 0.3, 2)) <= {
                    "pod-a", "pod-b"}

            until(repaired, sync_period * 3 + 10, f"repair of {label}")
            samples = watch.finish()
            # From the repair sync's own record: when its commit ended.
            repair = next((h for h in daemon.history() if h["reason"] == REPAIR_REASON
                           and h["started"] >= tampered_wall - 0.01), None)
            if not r.check(repair is not None, f"{label}: no repair sync in the history"):
                continue
            assert repair is not None
            times[label] = took = repair["started"] + repair["seconds"] - tampered_wall
            # The bound is 0.2 s; 0.3 s more of margin for a shared, busy machine.
            r.check(took <= 0.5, f"{label}: repaired {took:.2f} s after the tamper")
            bad = [x for x in samples if x.healthz != 200]
            unhealthy[label] = max((x.at for x in bad), default=tampered) - tampered
            r.check(all(x.livez == 200 for x in samples), f"{label}: /livez not 200")
            r.check(all(REPAIR_REASON in x.reason for x in bad),
                    f"{label}: /healthz 503 for another reason: {[x.reason for x in bad][:3]}")
            after = daemon.health()
            r.check(after.healthz == 200 and after.node_port == 200,
                    f"{label}: not healthy after the repair: {after}")
        probe.finish()
        r.add_probe(probe)
        r.check(probe.failed <= max_failed,
                f"{probe.failed} connections failed (at most {max_failed})")
        repairs = daemon.metric("pyproxy_table_repairs_total") - repairs_before
        r.check(repairs >= len(which), f"pyproxy_table_repairs_total counted {repairs}")
        history = [h for h in daemon.history() if h["reason"] == REPAIR_REASON]
        r.check(len(history) >= len(which), f"only {len(history)} repair syncs in history")
        r.converge_s = max(times.values(), default=None)
        r.converge_what = "tamper to repaired (max)"
        r.figures.update({f"{k}: repaired after": f"{v:.3f} s" for k, v in times.items()})
        r.figures["/healthz 503 seen (last 503 after the tamper)"] = ", ".join(
            f"{v * 1000:.0f} ms" if v else "never (repaired between two polls)"
            for v in unhealthy.values())
        r.notes.append("connections fail while the rules are gone; the failed count is "
                       "the cost of the tampering window")
        # Connections made while the rules were gone left un-NATed conntrack entries (SYN_SENT,
        # 120 s): a later connection that happens to reuse one's source port would follow it
        # to nowhere. Not what the next drill is about.
        env.lab.flush_conntrack(env.cluster.node)
        # The bench as it was: `lb` gone, and its chains too (deleted a grace period later).
        b.write(b.base, settle=STALE_CHAIN_GRACE + sync_period + 0.5)
    return r
