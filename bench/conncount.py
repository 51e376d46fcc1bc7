"""The cost of counting new connections per endpoint (`make bench`, from bench_sync.py's
pyproxy worker, after its own measurements).

- What the feature adds to a sync: the same cold start and one-service changes with and
  without it (`count_connections`), alternated in one process on two tables in two network
  namespaces, so that the load of a shared machine falls on both alike (separate runs a
  minute apart differed by up to 5x on the project's VM).
- What reading the counters costs: every (service address, endpoint) pair of the worker's
  loaded table gets an element with a counter, as if every endpoint had taken connections
  through every address of its service (the most a read can meet at this size); then the
  daemon's read (a netlink dump of the eight sets, labels from the selections, the ledger)
  and a whole scrape of /metrics are timed, and one-service changes and a full resync run
  with all those elements in the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

MEASURED_READS = 3
CHANGES_WITH_ELEMENTS = 10  # per kind
COLD_ROUNDS = 3  # cold starts of each variant, alternated
CHANGES_PER_KIND = 25
# The feature may add this much to the cold start and to a one-service change (the issue).
COST_LIMIT = 0.10
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def measure(proxier: Any, state: Any, cluster: Any, node_config: Any, node_ip: str,
            rss: Callable[[], dict[str, float]], seed: int) -> dict[str, Any]:
    out = measure_reads(proxier, state, node_config, node_ip, rss)
    out.update(syncs_with_elements(proxier, state, cluster, seed))
    out["with_without"] = with_and_without(cluster, node_config, seed)
    return out


# ---------------------------------------------------------------------------------------------
# With and without, alternated


def _in_netns(netns: str, fn: Callable[[], T]) -> T:
    """fn on a thread that entered the namespace: a libnftables context made there keeps
    talking to it (the worker itself stays where it is)."""
    made: dict[str, Any] = {}

    def enter() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns}")
            finally:
                os.close(fd)
            made["result"] = fn()
        except BaseException as err:
            made["error"] = err

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    return made["result"]  # type: ignore[no-any-return]


@contextlib.contextmanager
def _namespaces(*names: str) -> Iterator[None]:
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        yield
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL, check=False)


def with_and_without(cluster: Any, node_config: Any, seed: int) -> dict[str, Any]:
    import nftables

    from bench.synth import apply_change, plan_changes
    from pyproxy.cluster.snapshot import build_state
    from pyproxy.core.model import IPFamily
    from pyproxy.kernel.libnftables import LibNftables
    from pyproxy.render.objects import TABLE
    from pyproxy.sync.proxier import FamilyProxier

    state = build_state(list(cluster.objects()))
    names = {True: f"ppxbench-{os.getpid()}-counting", False: f"ppxbench-{os.getpid()}-not"}
    cold: dict[bool, list[float]] = {True: [], False: []}
    changes: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    with _namespaces(*names.values()):
        def proxier_in(counting: bool) -> Any:
            netns = names[counting]
            nft = LibNftables(lambda: _in_netns(netns, nftables.Nftables))
            config = dataclasses.replace(node_config, count_connections=counting)
            return FamilyProxier(IPFamily.IPv4, config, nft)

        proxiers: dict[bool, Any] = {}
        for round_ in range(COLD_ROUNDS):
            for counting in ((True, False) if round_ % 2 == 0 else (False, True)):
                if counting in proxiers:
                    proxiers[counting].applier.nft.run(f"delete table ip {TABLE}\n")
                proxiers[counting] = proxier_in(counting)
                t0 = time.perf_counter()
                proxiers[counting].sync(state)
                cold[counting].append(time.perf_counter() - t0)
        for i, change in enumerate(plan_changes(cluster, CHANGES_PER_KIND, seed=seed)):
            new_state = apply_change(state, change)
            for counting in ((True, False) if i % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                proxiers[counting].sync(new_state, changed={change.key})
                changes[counting].setdefault(change.op, []).append(
                    (time.perf_counter() - t0) * 1e3)
            state = new_state
    return {"cold_s": {"with": cold[True], "without": cold[False]},
            "changes_ms": {"with": changes[True], "without": changes[False]}}


# ---------------------------------------------------------------------------------------------
# Reading the counters


def _elements(proxier: Any, node_ip: str) -> Iterator[tuple[int, str]]:
    """(shard, element) for every address and reachable endpoint of every service port."""
    from pyproxy.render.objects import connection_shard

    for ps in proxier.selections.values():
        port = ps.port
        proto = str(port.protocol).lower()
        cluster_ip = port.cluster_ip(ps.family)
        if cluster_ip is None:
            continue
        entries = [(a, port.port) for a in (cluster_ip, *port.external_ips_of(ps.family),
                                            *port.load_balancer_vips(ps.family))]
        if port.node_port:
            entries.append((node_ip, port.node_port))
        for ep in ps.selection.all_reachable:
            for address, number in entries:
                packets = hash((address, ep.ip)) % 1000
                yield (connection_shard(ep.ip), f"{address} . {proto} . {number} . {ep.ip} . "
                                                f"{ep.port} counter packets {packets} bytes 0")


def measure_reads(proxier: Any, state: Any, node_config: Any, node_ip: str,
                  rss: Callable[[], dict[str, float]]) -> dict[str, Any]:
    from prometheus_client import generate_latest

    from pyproxy.core.model import IPFamily
    from pyproxy.kernel.nlsets import KernelCounters
    from pyproxy.render.objects import CONNECTION_SHARDS, TABLE, connections_set
    from pyproxy.serve.connections import ConnectionCounters, CountingContext, Kernel
    from pyproxy.serve.metrics import Metrics

    by_shard: dict[int, list[str]] = {n: [] for n in range(CONNECTION_SHARDS)}
    for shard, element in _elements(proxier, node_ip):
        by_shard[shard].append(element)
    count = sum(len(v) for v in by_shard.values())
    for shard, elements in by_shard.items():
        if elements:
            proxier.applier.nft.run(f"add element ip {TABLE} {connections_set(shard)} "
                                    f"{{ {', '.join(elements)} }}\n")
    del by_shard

    selections = tuple(proxier.selections.values())
    node = state.node(node_config.node_name)
    labels = state.node_labels()
    kernel = KernelCounters()
    counters = ConnectionCounters([IPFamily.IPv4],
                                  lambda: CountingContext(selections, node, labels),
                                  Kernel(kernel.read, kernel.delete), min_interval=0)
    dumps = []
    for _ in range(MEASURED_READS):
        t0 = time.perf_counter()
        read = kernel.read(IPFamily.IPv4)
        dumps.append(time.perf_counter() - t0)
    assert len(read) == count, (len(read), count)
    del read
    before = rss()["vmrss_mb"]
    t0 = time.perf_counter()
    series = len(counters.totals())
    first_s = time.perf_counter() - t0
    reads = []
    for _ in range(MEASURED_READS):
        t0 = time.perf_counter()
        counters.totals()
        reads.append(time.perf_counter() - t0)
    ledger_mb = rss()["vmrss_mb"] - before
    # a whole scrape of /metrics: a read, and prometheus_client writing every series
    metrics = Metrics()
    metrics.watch_connections(counters.totals)
    scrapes = []
    for _ in range(MEASURED_READS):
        t0 = time.perf_counter()
        text = generate_latest(metrics.registry)
        scrapes.append(time.perf_counter() - t0)
    return {"elements": count, "series": series, "dump_s": statistics.median(dumps),
            "first_read_s": first_s, "read_s": statistics.median(reads), "reads_s": reads,
            "ledger_mb": ledger_mb, "scrape_s": statistics.median(scrapes),
            "scrape_mb": len(text) / 1e6}


def syncs_with_elements(proxier: Any, state: Any, cluster: Any, seed: int) -> dict[str, Any]:
    """One-service changes and a full resync with the counting sets full: libnftables must
    not read their elements before each transaction (it would cost seconds at this size)."""
    from bench.synth import apply_change, plan_changes
    from pyproxy.core.plan import Cause, Scope, SyncPlan

    changes: dict[str, list[float]] = {}
    for change in plan_changes(cluster, CHANGES_WITH_ELEMENTS, seed=seed + 1):
        new_state = apply_change(state, change)
        t0 = time.perf_counter()
        proxier.sync(new_state, changed={change.key})
        changes.setdefault(change.op, []).append((time.perf_counter() - t0) * 1e3)
        state = new_state
    t0 = time.perf_counter()
    proxier.sync(state, plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    return {"changes_ms": changes, "resync_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# The report


def report(runs: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The section of the report, and its targets."""
    found = [r["connections"] for r in runs if "connections" in r]
    if not found:
        return [], []
    both = [c["with_without"] for c in found]
    lines = ["", f"NEW CONNECTIONS PER ENDPOINT: cold start and changes with and without "
                 f"counting, alternated in one process on two tables ({len(found)} run(s))"]
    w = lines.append
    targets = []
    cold = {k: statistics.median(x for b in both for x in b["cold_s"][k])
            for k in ("with", "without")}
    w(f"  {'':<30} {'with':>9} {'without':>9} {'ratio':>7}")
    w(f"  {'cold start (sync), s, median':<30} {cold['with']:9.2f} {cold['without']:9.2f} "
      f"{cold['with'] / cold['without']:7.3f}")
    targets.append(_target("cold start", cold["with"], cold["without"], "s"))
    for op in both[0]["changes_ms"]["with"]:
        a, b = (statistics.median(x for r in both for x in r["changes_ms"][k][op])
                for k in ("with", "without"))
        w(f"  {op + ', median ms':<30} {a:9.2f} {b:9.2f} {a / b:7.3f}")
        targets.append(_target(op, a, b, "ms"))
    c = found[0]
    w(f"  reading the counters with every (address, endpoint) pair counted: {c['elements']} "
      f"elements, {c['series']} series")
    w(f"    netlink dump of the 8 sets {1e3 * c['dump_s']:.0f} ms; whole read (dump, labels, "
      f"ledger) {1e3 * c['read_s']:.0f} ms (first {1e3 * c['first_read_s']:.0f} ms); the "
      f"ledger holds {c['ledger_mb']:.0f} MB")
    w(f"    a scrape of /metrics (a read and prometheus_client writing the series) "
      f"{1e3 * c['scrape_s']:.0f} ms, {c['scrape_mb']:.1f} MB")
    w("    with those elements in the kernel, one-service changes, median ms: " + ", ".join(
        f"{op} {statistics.median(v):.1f}" for op, v in c["changes_ms"].items())
      + f"; full resync {c['resync_s']:.2f} s")
    return lines, targets


def _target(what: str, with_: float, without: float, unit: str) -> dict[str, Any]:
    return {"target": f"counting: {what} within {100 * COST_LIMIT:.0f} % of without",
            "value": f"{with_:.2f} {unit} vs {without:.2f} {unit} "
                     f"({100 * (with_ / without - 1):+.1f} %)",
            "met": with_ <= without * (1 + COST_LIMIT)}
