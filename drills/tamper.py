"""Someone else deletes pyproxy's table, a base chain, a map, or deletes or changes an element:
repaired at once, and nothing the damage window left behind keeps connections broken."""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from drills.harness import (
    LB,
    WEB,
    Env,
    HealthWatch,
    Obj,
    Probe,
    Result,
    SnapshotBench,
    lb_local,
    snapshot_bench,
    until,
)
from pyproxy.core.plan import Cause
from pyproxy.sync.applier import STALE_CHAIN_GRACE
from testkit.builders import ep, make_service, make_slice
from testkit.netlab import ConnResult

POD_C = "10.244.3.2"  # the standard topology's pod-c: a backend, but no endpoint of `web`
TAMPERS = {
    "table ip pyproxy deleted": ["delete table ip pyproxy"],
    "base chain nat-prerouting deleted": ["delete chain ip pyproxy nat-prerouting"],
    "map service-ips deleted": ["flush chain ip pyproxy services",
                                "delete map ip pyproxy service-ips"],
    "table ip6 pyproxy deleted": ["delete table ip6 pyproxy"],
    # Elements (issue 28, point 3): announced like the rest, repaired by the same full sync.
    "element of map service-ips deleted": [
        f"delete element ip pyproxy service-ips {{ {WEB} . tcp . 80 }}"],
    "element of map endpoints-tcp changed": [
        f"delete element ip pyproxy endpoints-tcp {{ {WEB} . 80 . 0 }}",
        f"add element ip pyproxy endpoints-tcp {{ {WEB} . 80 . 0 : {POD_C} . 8080 }}"],
    # Clashes (issue 35, point 1): what no patch can turn into our table. Replaced whole by
    # the repair itself: the first records no layout, the second ours but is refused.
    "table ip pyproxy made anew, cluster-ips of another type": [
        "delete table ip pyproxy", "add table ip pyproxy",
        "add set ip pyproxy cluster-ips { type ipv4_addr . inet_service; }"],
    "map service-ips redeclared as a set": [
        "flush chain ip pyproxy services", "delete map ip pyproxy service-ips",
        "add set ip pyproxy service-ips { type ipv4_addr . inet_proto . inet_service; }"],
}
CLASHES = ("table ip pyproxy made anew, cluster-ips of another type",
           "map service-ips redeclared as a set")
# Tampers after which a connection started meanwhile is left hanging, not refused: with the
# table gone nothing rejects its SYN, which is routed on (to the ServiceCIDR's sink here).
HANGING = ("table ip pyproxy deleted", "table ip6 pyproxy deleted")
ELEMENTS = ("element of map service-ips deleted", "element of map endpoints-tcp changed")

# On any real node something else uses conntrack (firewalld, Docker, the kubelet's rules, a
# CNI). Without it, deleting our table leaves the namespace with no conntrack user at all:
# conntrack stops tracking, the damage window leaves no entry behind and a connection's
# retransmitted SYN is NATed afresh (measured: docs/drills.md). So the drill has one.
HOST_FIREWALL = ("table inet host-firewall {\n"
                 "  chain forward { type filter hook forward priority 0;"
                 " ct state established,related accept; }\n}\n")

# The held-window service: TCP and UDP, dual-stack, one endpoint (pod-a).
HELD4, HELD6 = "10.96.0.40", "fd00:96::40"
UDP_PORT = 53


def tamper(env: Env, sync_period: float = 1.0, which: Iterable[str] = tuple(TAMPERS),
           bench: SnapshotBench | None = None, hold: float | None = 0.3) -> Result:
    """Each tamper is announced by the kernel's nftables change events and repaired at once
    (the periodic structure check every syncPeriod is only the backstop). The issue's goals:
    repaired within 0.2 s; no connection attempted after a repair fails (those attempted
    while the rules were gone are the window's cost, reported); no conntrack entry made
    while the rules were gone outlives the repair. Then, for the tampers that leave
    connections hanging (`HANGING`), the daemon is paused for `hold` seconds to keep the
    rules missing: connections started meanwhile (TCP, and a UDP flow) must be answered once
    the rules are back (`hold` None: not done)."""
    which = list(which)
    with snapshot_bench(env, bench, "tamper", sync_period=sync_period) as b, \
            host_firewall(env):
        daemon = b.daemon
        sync_period = daemon.sync_period
        r = Result("tamper", f"{', '.join(which)} (syncPeriod {sync_period:g} s)")
        b.write([*b.base, *lb_local(env), *held_service(env)])
        repairs_before = daemon.metric("pyproxy_table_repairs_total")
        probe = Probe(env, WEB, timeout=0.3)
        windows: dict[str, tuple[float, float]] = {}
        unhealthy: dict[str, float] = {}
        for label in which:
            window = _one_tamper(env, b, r, label, unhealthy)
            if window is not None:
                windows[label] = window
        probe.finish()
        _count_probe(r, probe, windows)
        repairs = daemon.metric("pyproxy_table_repairs_total") - repairs_before
        r.check(repairs >= len(which), f"pyproxy_table_repairs_total counted {repairs}")
        history = [h for h in daemon.history() if h["cause"] == Cause.REPAIR.name.lower()]
        r.check(len(history) >= len(which), f"only {len(history)} repair syncs in history")
        left = until_value(lambda: not_dnated_entries(env, (WEB, LB, HELD4, HELD6)), 3.0)
        r.check(not left, f"conntrack entries never DNATed outlived the repairs: {left[:3]}")
        for label in [x for x in which if x in HANGING and hold is not None]:
            assert hold is not None
            _held_window(env, b, r, label, hold)
        times = {k: end - start for k, (start, end) in windows.items()}
        r.converge_s = max(times.values(), default=None)
        r.converge_what = "tamper to repaired (max)"
        r.figures.update({f"{k}: repaired after": f"{v:.3f} s" for k, v in times.items()})
        r.figures["/healthz 503 seen (last 503 after the tamper)"] = ", ".join(
            f"{v * 1000:.0f} ms" if v else "never (repaired between two polls)"
            for v in unhealthy.values())
        r.notes.append("connections attempted while the rules were gone fail (the cost of "
                       "the tampering window); none attempted after a repair may")
        # The bench as it was: `lb` and `held` gone, and their chains too (deleted a grace
        # period later).
        b.write(b.base, settle=STALE_CHAIN_GRACE + sync_period + 0.5)
    return r


def _one_tamper(env: Env, b: SnapshotBench, r: Result, label: str,
                unhealthy: dict[str, float]) -> tuple[float, float] | None:
    """Tamper, wait for the repair; the window (wall clock): from just before the tamper to
    the end of the repair's commit, read from the repair sync's own record."""
    daemon = b.daemon
    until(daemon.diff_clean, 10, "clean before tampering")
    time.sleep(0.2)
    r.check(daemon.health().healthz == 200, f"{label}: /healthz not 200 before")
    watch = HealthWatch(daemon)
    tampered_wall, tampered = time.time(), time.monotonic()
    env.nft(*TAMPERS[label])

    def repaired() -> bool:
        return daemon.diff_clean() and set(env.connect(WEB, 2, 0.3, 2)) <= {"pod-a", "pod-b"}

    until(repaired, daemon.sync_period * 3 + 10, f"repair of {label}")
    samples = watch.finish()
    repair = next((h for h in daemon.history() if h["cause"] == Cause.REPAIR.name.lower()
                   and h["started"] >= tampered_wall - 0.01), None)
    if not r.check(repair is not None, f"{label}: no repair sync in the history"):
        return None
    assert repair is not None
    end = repair["started"] + repair["seconds"]
    took = end - tampered_wall
    # The bound is 0.2 s; 0.3 s more of margin for a shared, busy machine.
    r.check(took <= 0.5, f"{label}: repaired {took:.2f} s after the tamper")
    bad = [x for x in samples if x.healthz != 200]
    unhealthy[label] = max((x.at for x in bad), default=tampered) - tampered
    r.check(all(x.livez == 200 for x in samples), f"{label}: /livez not 200")
    r.check(all(Cause.REPAIR.value in x.reason for x in bad),
            f"{label}: /healthz 503 for another reason: {[x.reason for x in bad][:3]}")
    after = daemon.health()
    r.check(after.healthz == 200 and after.node_port == 200,
            f"{label}: not healthy after the repair: {after}")
    if label in CLASHES:
        r.check(after.replaced.startswith("IPv4: ") and after.replaced == after.livez_replaced,
                f"{label}: /healthz and /livez do not say the table was replaced: {after}")
    return tampered_wall, end


def _count_probe(r: Result, probe: Probe, windows: dict[str, tuple[float, float]]) -> None:
    """Failures split by when they were attempted: while the rules were gone (the attempt
    overlaps a window: a connection in flight when the table vanished fails too) or not."""
    r.add_probe(probe)
    results = [res for _, res in probe.results]
    during = [res for res in results if not res.ok and _overlaps(res, windows.values())]
    after = [res for res in results if not res.ok and not _overlaps(res, windows.values())]
    # A changed endpoints element sends connections to pod-c until the repair: none after.
    stray = [res for res in results if res.ok and res.name not in ("pod-a", "pod-b")
             and not _overlaps(res, windows.values())]
    r.figures["failed while the rules were gone"] = _breakdown(during)
    r.figures["failed after the repair"] = _breakdown(after)
    r.figures["answered by no endpoint of the service, after the repair"] = len(stray)
    if r.check(not after, f"{len(after)} connections attempted after a repair failed "
                          f"({_breakdown(after)})"):
        r.verdict = f"ok: 0 failed after a repair ({len(during)} while the rules were gone)"
    r.check(not stray, f"{len(stray)} connections after a repair went to a non-endpoint")


def _overlaps(res: ConnResult, windows: Iterable[tuple[float, float]]) -> bool:
    return any(res.started <= end and res.ended >= start for start, end in windows)


def _breakdown(results: list[ConnResult]) -> str:
    if not results:
        return "0"
    kinds: dict[str, int] = {}
    for res in results:
        kinds[res.label] = kinds.get(res.label, 0) + 1
    return f"{len(results)} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})"


# ---------------------------------------------------------------------------------------------
# The held window: connections started while the rules are missing


def _held_window(env: Env, b: SnapshotBench, r: Result, label: str, hold: float) -> None:
    """Pause the daemon, tamper, make a UDP exchange from a fixed source port and, `hold` s
    after the tamper, start a TCP connection (it waits for its SYN's retransmission); once
    its SYN is out resume the daemon. Both must be answered once the rules are back: the TCP
    connection by its retransmitted SYN (1 s after the first), the UDP flow at its next
    datagram."""
    daemon = b.daemon
    vip = HELD6 if "ip6" in label else HELD4
    until(daemon.diff_clean, 10, "clean before tampering")
    # A port no earlier exchange used: an entry of one (NATed, 30 s) would answer the
    # datagram sent in the window.
    sport = random.randrange(20000, 60000)
    tcp: dict[str, ConnResult] = {}
    with daemon.paused():
        paused = time.time()
        env.nft(*TAMPERS[label])
        udp_before = env.lab.connect(env.cluster.client, vip, UDP_PORT, "udp",
                                     timeout=0.3, sport=sport)[0]
        time.sleep(max(0.0, hold - (time.time() - paused)))
        # The TCP connection last, just before the rules come back: its SYN's retransmission
        # then comes about 1 s after the repair starts, as after a real window of ~30 ms.
        thread = threading.Thread(target=lambda: tcp.update(
            r=env.lab.connect(env.cluster.client, vip, 80, timeout=6.0)[0]))
        thread.start()
        # Until its SYN went out (the client starts in ~0.1 s).
        during = until_value(lambda: not_dnated_entries(env, (vip,)), 3.0,
                             lambda lines: any(line.startswith("tcp") for line in lines))
        resumed = time.time()
    until(daemon.diff_clean, 10, f"repair of {label} (held)")
    left = until_value(lambda: not_dnated_entries(env, (vip,)), 3.0)
    udp_after = env.lab.connect(env.cluster.client, vip, UDP_PORT, "udp", timeout=1.0,
                                sport=sport)[0]
    thread.join(10)
    conn = tcp.get("r")
    r.figures[f"{label}, held {hold:g} s: entries without DNAT in the window"] = len(during)
    r.figures[f"{label}, held: TCP connection started in the window"] = (
        f"{conn.label} after {conn.ended - conn.started:.2f} s" if conn else "no result")
    r.figures[f"{label}, held: UDP flow (sport {sport}) after the repair"] = (
        f"{udp_after.label} (in the window: {udp_before.label})")
    r.check(not udp_before.ok, f"{label} (held): UDP answered while the rules were gone")
    r.check(conn is not None and conn.ok and conn.ended > resumed,
            f"{label} (held): TCP connection started in the window: "
            f"{conn.label if conn else 'no result'}")
    r.check(udp_after.ok, f"{label} (held): the UDP flow after the repair: {udp_after.label}")
    r.check(not left, f"{label} (held): entries without DNAT after the repair: {left[:2]}")


def held_service(env: Env) -> list[Obj]:
    """`held`: TCP 80 and UDP 53, dual-stack, its endpoint pod-a."""
    def tweak(svc: Obj) -> None:
        svc["spec"].update(clusterIPs=[HELD4, HELD6], ipFamilies=["IPv4", "IPv6"],
                           ipFamilyPolicy="RequireDualStack", ports=[
                               {"name": "http", "port": 80, "protocol": "TCP",
                                "targetPort": 8080},
                               {"name": "dns", "port": UDP_PORT, "protocol": "UDP",
                                "targetPort": 5353}])

    def ports(eps: Obj) -> None:
        eps["ports"] = [{"name": "http", "port": 8080, "protocol": "TCP"},
                        {"name": "dns", "port": 5353, "protocol": "UDP"}]

    pod = env.cluster.pods["pod-a"]
    return [make_service("ns", "held", tweak, ip=HELD4),
            make_slice("ns", "held", [ep(pod.ip4, "node-b")], ports),
            make_slice("ns", "held", [ep(pod.ip6, "node-b")], ports, family="IPv6")]


@contextmanager
def host_firewall(env: Env) -> Iterator[None]:
    env.lab.nft(env.cluster.node, HOST_FIREWALL)
    try:
        yield
    finally:
        env.cluster.node.run(["nft", "delete table inet host-firewall"], check=False)


# ---------------------------------------------------------------------------------------------
# conntrack in the node namespace

_TUPLES = re.compile(r"src=(\S+) dst=(\S+) sport=(\d+) dport=(\d+) .*?"
                     r"src=(\S+) dst=(\S+) sport=(\d+) dport=(\d+)")


@dataclass(frozen=True)
class Entry:
    line: str
    orig_dst: str
    orig_dport: str
    reply_src: str
    reply_sport: str


def not_dnated_entries(env: Env, addresses: Iterable[str]) -> list[str]:
    """`conntrack -L` lines (both families) addressed to one of `addresses` that no DNAT
    rewrote: answered from the very address and port the client sent to."""
    wanted = set(addresses)
    out = []
    for family in ("ipv4", "ipv6"):
        listing = env.cluster.node.run(["conntrack", "-L", "-f", family], check=False).stdout
        for line in listing.splitlines():
            found = _TUPLES.search(line)
            if found is None:
                continue
            entry = Entry(line, found[2], found[4], found[5], found[7])
            if (entry.orig_dst in wanted and entry.reply_src == entry.orig_dst
                    and entry.reply_sport == entry.orig_dport):
                out.append(line)
    return out


def until_value(get: Callable[[], list[str]], timeout: float,
                done: Callable[[list[str]], bool] = lambda value: not value) -> list[str]:
    """Poll `get` until its value is `done` (by default: empty) or `timeout` passes; the
    last value. (The conntrack cleanup runs on a thread of its own after the repair.)"""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)
