"""The API server faults: an outage (refused or 503) while the cluster changes, watches
ending with 410 Gone over and over, a watch that stalls without closing."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable

from drills.harness import (
    DOOMED,
    FRESH,
    WEB,
    ApiBench,
    DrillError,
    Env,
    Probe,
    Result,
    api_bench,
    api_errors,
    until,
    web,
)
from pyproxy.cluster.watchstate import BACKOFF_CAP
from testkit.inproc import call_in_netns


def api_outage(env: Env, outage: float = 10.0, mode: str = "refuse",
               bench: ApiBench | None = None) -> Result:
    r = Result("api-outage", f"API server unreachable ({mode}) {outage:g} s; meanwhile a "
               "Service+slice deleted, one created, an endpoint removed")
    with api_bench(env, bench, "outage") as b:
        emu, daemon = b.emu, b.daemon
        b.apply([*web(env, ["pod-a", "pod-b", "pod-c"]), *web(env, ["pod-a"], "doomed", DOOMED)])
        until(lambda: daemon.endpoints("doomed") == env.pods("pod-a")
              and daemon.endpoints("web") == env.pods("pod-a", "pod-b", "pod-c"), 20,
              "initial state programmed")
        lists = emu.count_lists("services")
        errors = api_errors(daemon)
        probe = Probe(env, WEB)
        time.sleep(0.5)
        emu.set_available(False, mode)  # type: ignore[arg-type]  # "503"|"reset"|"refuse"
        down = time.monotonic()
        time.sleep(min(1.0, outage / 4))
        emu.delete("Service", "doomed", "ns")
        emu.delete("EndpointSlice", "doomed-ipv4", "ns")
        b.apply([web(env, ["pod-a", "pod-b"])[1], *web(env, ["pod-b"], "fresh", FRESH)])
        time.sleep(max(0.0, down + outage - 0.5 - time.monotonic()))
        # Still away: the rules in force are the last known ones, and the daemon is healthy.
        r.check(daemon.alive, "daemon exited during the outage")
        r.check(daemon.endpoints("doomed") == env.pods("pod-a"),
                "rules cleared during the outage")
        r.check(daemon.endpoints("web") == env.pods("pod-a", "pod-b", "pod-c"),
                "web changed while the API server was away")
        r.check(daemon.healthz() == 200, "/healthz not 200 during the outage")
        errors = api_errors(daemon) - errors
        time.sleep(max(0.0, down + outage - time.monotonic()))
        # In the node namespace: after "refuse" this opens the listening socket again.
        call_in_netns(env.cluster.node.full, lambda: emu.set_available(True))

        def converged() -> bool:
            return (daemon.endpoints("doomed") is None
                    and daemon.endpoints("fresh") == env.pods("pod-b")
                    and daemon.endpoints("web") == env.pods("pod-a", "pod-b"))

        r.converge_s = until(converged, outage + 45, "state after the API returned")
        r.converge_what = "after the API returned"
        r.check(env.connect(DOOMED, 3, 0.3, 3) == {"timeout": 3}, "deleted service answers")
        r.check(set(env.connect(FRESH)) == {"pod-b"}, "created service not reachable")
        r.check(set(env.connect(WEB, 24)) == {"pod-a", "pod-b"}, "web endpoints wrong")
        probe.finish()
        r.add_probe(probe)
        r.check(probe.failed == 0, f"{probe.failed} connections failed: {probe.tally()}")
        r.figures["failed API calls while away (3 watches, capped backoff)"] = errors
        r.figures["relists (Service)"] = emu.count_lists("services") - lists
        emu.delete("Service", "fresh", "ns")
    return r


# ---------------------------------------------------------------------------------------------
# 2. Watches end with 410 Gone over and over (history compacted, connections dropped)


# What the reflector logs when a watch position has expired (410 Gone) and it lists again.
GONE_LOG = "watch_expired_listing_again"
# The kinds whose watches the storm ends (every watch is ended; these are always served).
STORM_KINDS = ("Service", "EndpointSlice", "Node")


def expirations_by_kind(log: str) -> Counter[str]:
    """How many times each kind's watch expired (410 Gone) in the daemon's log lines."""
    kinds: Counter[str] = Counter()
    for line in log.splitlines():
        if GONE_LOG in line:
            found = re.search(r'kind[=":\s]+"?(\w+)', line)
            kinds[found.group(1) if found else "?"] += 1
    return kinds


def watch_gone_storm(env: Env, duration: float = 5.0, period: float = 0.25,
                     bench: ApiBench | None = None) -> Result:
    r = Result("410-storm", f"every {period:g} s for {duration:g} s: an endpoint change, "
               "history compacted, every watch ended (alternately cleanly, so that it "
               "resumes into 410 Gone, and abruptly)")
    subsets = [("pod-a",), ("pod-a", "pod-b"), ("pod-b", "pod-c"), ("pod-a", "pod-b", "pod-c"),
               ("pod-c",), ("pod-b",)]
    with api_bench(env, bench, "gone") as b:
        emu, daemon = b.emu, b.daemon
        b.apply(web(env, ["pod-a", "pod-b", "pod-c"]))
        until(lambda: daemon.endpoints("web") == env.pods("pod-a", "pod-b", "pod-c"), 20,
              "initial state programmed")
        lists_before = emu.count_lists("endpointslices")
        watches_before = emu.count("watch", "endpointslices")
        gone_offset = len(daemon.log_path.read_text())
        syncs_before = daemon.status()["syncs"]
        probe = Probe(env, WEB)
        end = time.monotonic() + duration
        changes = 0
        while time.monotonic() < end:
            b.apply([web(env, subsets[changes % len(subsets)])[1]])
            changes += 1
            emu.compact()
            if changes % 2:
                # The streams end cleanly (as at the server's watch timeout) with events
                # still queued: the reflectors resume from their last resourceVersion,
                # which the compaction made too old: 410 Gone, relist.
                for watcher in emu.store.watchers():
                    watcher.overflowed.set()
            else:
                emu.drop_connections()  # abrupt end: an error, the resumed watch gets 410
            time.sleep(period)
        r.check(daemon.alive, "daemon exited during the storm")
        b.apply([web(env, ["pod-a", "pod-c"])[1]])
        # A reflector's retries and its relist after a 410 wait client-go's backoff steps
        # (0.8 s doubling, capped at 30 s, each wait in [d, 2d]; the steps start over only
        # 2 min after they last did), so by the storm's end the relist may wait up to
        # 2 x the cap: the bound is that, plus the list and the sync.
        r.converge_s = until(lambda: daemon.endpoints("web") == env.pods("pod-a", "pod-c"),
                             2 * BACKOFF_CAP + 15, "final endpoints after the storm")
        r.converge_what = "after the last change"
        r.check(set(env.connect(WEB, 24)) == {"pod-a", "pod-c"}, "datapath not final")
        probe.finish()
        r.add_probe(probe)
        r.check(probe.failed == 0, f"{probe.failed} connections failed: {probe.tally()}")
        log = daemon.log_path.read_text()
        gone_by_kind = expirations_by_kind(log[gone_offset:])
        gone = sum(gone_by_kind.values())
        r.figures["changes during the storm"] = changes
        r.figures["watches ended by 410 Gone (all kinds)"] = gone
        # A storm, not a blip: every reflector's watch expires at once (the first end is at
        # 0.25 s, its retry at 1.6 s at most), and with client-go's backoff it lives through
        # a second 410 cycle by 24 s (the longest waits: 1.6 + 3.2 s, then 6.4 + 12.8 s).
        least = 2 if duration >= 24 else 1
        few = {kind: gone_by_kind.get(kind, 0) for kind in STORM_KINDS
               if gone_by_kind.get(kind, 0) < least}
        r.check(not few, f"watches ended with 410 Gone fewer than {least} times: {few}")
        r.figures["relists (EndpointSlice)"] = emu.count_lists("endpointslices") - lists_before
        r.figures["watches started (EndpointSlice)"] = (emu.count("watch", "endpointslices")
                                                        - watches_before)
        r.figures["syncs"] = daemon.status()["syncs"] - syncs_before
    return r


# ---------------------------------------------------------------------------------------------
# 3. A watch that stalls without closing


def stalled_watch(env: Env, stall: float = 4.0, wait_alone: bool = False,
                  bench: ApiBench | None = None) -> Result:
    """The daemon's watches go silent (no events, no bookmarks, the connection stays open).
    `pyproxy run` has no flag for the reflector's read timeout (each watch's timeoutSeconds +
    30 s: 330 to 630 s): with wait_alone the drill measures how long the daemon takes to
    notice a change on its own; otherwise it checks the rules stay as they were, then
    un-stalls and measures the catch-up."""
    r = Result("stalled-watch", f"watches silent for {stall:g} s (connection kept open), "
               "an endpoint change made meanwhile")
    with api_bench(env, bench, "stall") as b:
        emu, daemon = b.emu, b.daemon
        b.apply(web(env, ["pod-a", "pod-b", "pod-c"]))
        until(lambda: daemon.endpoints("web") == env.pods("pod-a", "pod-b", "pod-c"), 20,
              "initial state programmed")
        emu.wait_for_watches(1, "endpointslices")
        probe = Probe(env, WEB)
        time.sleep(1.1)  # a bookmark went by: the stall starts from a live stream
        emu.stall_watches(True)
        b.apply([web(env, ["pod-a", "pod-b"])[1]])
        changed = time.monotonic()
        target = env.pods("pod-a", "pod-b")
        if wait_alone:
            try:
                alone = until(lambda: daemon.endpoints("web") == target, stall,
                              "change noticed while stalled", interval=0.25)
                r.figures["noticed while stalled after"] = f"{alone:.1f} s"
                r.converge_s, r.converge_what = alone, "while still stalled (read timeout)"
            except DrillError:
                r.figures["noticed while stalled after"] = f"not within {stall:g} s"
            time.sleep(max(0.0, changed + stall - time.monotonic()))
        else:
            time.sleep(stall)
            stale = daemon.endpoints("web") != target
            r.figures[f"change seen during a {stall:g} s stall"] = "no" if stale else "yes"
        emu.stall_watches(False)
        catch_up = until(lambda: daemon.endpoints("web") == target, 90, "catch-up")
        r.figures["caught up after un-stall"] = f"{catch_up:.2f} s"
        if r.converge_s is None:
            r.converge_s = time.monotonic() - changed
            r.converge_what = f"after the change ({stall:g} s stall + catch-up)"
        r.check(set(env.connect(WEB, 24)) == {"pod-a", "pod-b"}, "datapath not final")
        probe.finish()
        r.add_probe(probe)
        r.check(probe.failed == 0, f"{probe.failed} connections failed: {probe.tally()}")
        r.figures["read timeout of `pyproxy run`"] = ("the watch's timeoutSeconds + 30 s "
                                                       "(330-630 s), not configurable (no flag)")
    return r


def reflector_read_timeout(env: Env, read_timeout: float = 2.0) -> Result:
    """The reflector alone (in the node namespace) with a short read_timeout: a stalled watch
    is abandoned after read_timeout and a new one resumes from the last position (no relist:
    only 410 Gone lists again); the change made meanwhile arrives once the server streams."""
    from pyproxy.cluster.resources import endpoint_slices_resource
    from pyproxy.cluster.watch import Reflector
    from pyproxy.core.wire import SliceDoc

    r = Result("stalled-watch (reflector)", f"Reflector(read_timeout={read_timeout:g}) on a "
               "silent watch, change made while stalled")
    emu = env.emulator()
    # EndpointSlices are handed over as msgspec decodes them (pyproxy/core/wire.py)
    seen: list[tuple[float, SliceDoc | None]] = []
    synced = threading.Event()
    stop = threading.Event()
    client = emu.api_client()
    try:
        emu.create("EndpointSlice", web(env, ["pod-a", "pod-b", "pod-c"])[1])

        def handler(key: tuple[str, str], obj: SliceDoc | None) -> None:
            seen.append((time.monotonic(), obj))

        reflector = Reflector(client, endpoint_slices_resource(), handler, synced.set, stop,
                              read_timeout=read_timeout)
        thread = call_in_netns(env.cluster.node.full, lambda: _start_thread(reflector.run))
        until(synced.is_set, 10, "reflector synced")
        emu.wait_for_watches(1, "endpointslices")
        time.sleep(0.2)
        emu.stall_watches(True)
        emu.apply("EndpointSlice", web(env, ["pod-a"])[1])
        stalled = time.monotonic()

        def arrived() -> bool:
            return any(t > stalled and obj is not None and len(obj.endpoints or ()) == 1
                       for t, obj in seen)

        abandoned = until(lambda: reflector.status.watches >= 2, read_timeout + 15,
                          "stalled watch abandoned, a new one opened")
        r.figures["stalled watch abandoned after"] = f"{abandoned:.2f} s"
        r.check(abandoned <= read_timeout + 3, f"took {abandoned:.1f}s, more than "
                f"read_timeout + 3 s")
        emu.stall_watches(False)
        resumed = time.monotonic()
        r.converge_s = until(arrived, 15, "change through the resumed watch")
        r.converge_what = "change seen after the server streams again"
        r.figures["change after un-stall"] = f"{time.monotonic() - resumed:.2f} s"
        r.figures["lists"] = reflector.status.lists
        r.check(reflector.status.lists == 1, f"relisted: {reflector.status.lists} lists "
                "(only 410 Gone may list again)")
        stop.set()
        thread.join(read_timeout + 5)
    finally:
        stop.set()
        emu.stall_watches(False)
        client.close()
        emu.stop(check_leaks=False)
    return r


def _start_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread
