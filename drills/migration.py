"""The migration drill: a node moves from the real kube-proxy (v1.37.2, nftables mode) to
pyproxy and back, under traffic, as docs/deploying.md ("Migrating from kube-proxy") says to do
it. tests/test_k8s_migration.py runs a short version, `make chaos` (drills.chaos) the long one.

The node is the standard netlab topology's, attached to the real control plane of
testkit/controlplane.py: Services and Pods are API objects (the pods bound to another node, with
the status a kubelet would write), EndpointSlices come from the real controller. Both proxies
run in the node namespace with the identities a cluster gives them and the same ports
(healthz 10256, metrics 10249), as two hostNetwork DaemonSets would.

One round trip, each step under continuous connections through every Service:

    kube-proxy  -- start pyproxy, wait for its first sync -->  both programmed
                -- stop kube-proxy -->  kube-proxy's table stale
                -- pyproxy cleanup --kube-proxy -->  pyproxy alone
                -- start kube-proxy, wait for its first sync -->  both programmed
                -- stop pyproxy -->  pyproxy's table stale
                -- pyproxy cleanup -->  kube-proxy alone
                -- restart kube-proxy -->  kube-proxy alone, serving every port

Between steps the traffic is in a *phase*; batches of connections that span a step are
counted ("failed" included) but not used for the affinity figures. Per phase, each client of
the ClientIP service must keep one endpoint; across each step the drill counts the clients
whose endpoint changed.
"""

from __future__ import annotations

import contextlib
import math
import re
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drills.harness import NODE, PYPROXY, Daemon, DrillError, Env, Result, until
from testkit import controlplane
from testkit.netlab import ConnResult, NetlabError

NAMESPACE = "migration"
SELECTOR = {"app": "migration"}
PODS = ("pod-a", "pod-b", "pod-c")
WEB4, WEB6 = "10.96.4.1", "fd00:96::4:1"
NODEPORT_VIP, NODE_PORT = "10.96.4.2", 30400
STICKY = "10.96.4.3"
# An externalTrafficPolicy: Local LoadBalancer whose endpoint is on this node: the client's
# address is kept, and its health-check node port is served by whichever proxy holds it.
LOCAL_VIP, LB_IP, LOCAL_NODE_PORT, HEALTH_NODE_PORT = "10.96.4.4", "192.168.77.40", 30402, 30401
LOCAL_SELECTOR = {"app": "migration-local"}
EXTRA_NET = "10.96.5."  # extra ClusterIP services: 10.96.5.1, .2, …
UDP_SPORT = 40053  # the one UDP flow's source port: one conntrack entry all along
AFFINITY_CLIENTS = "192.168.50.{}"  # client addresses: .100 on probe, .60-.99 fresh ones
KUBE_PROXY = "kube-proxy"
AFFINITY = "ClientIP affinity"
LOCAL = "LoadBalancer eTP=Local"
PYPROXY_TABLE = "pyproxy"


# ---------------------------------------------------------------------------------------------
# Traffic


@dataclass(frozen=True)
class Flow:
    """Connections to one address (or several in turn) from the client namespace. Each batch
    goes to the next target from the next source."""

    name: str
    targets: tuple[tuple[str, int], ...]
    proto: str = "tcp"
    sources: tuple[str | None, ...] = (None,)
    sport: int | None = None
    batch: int = 20


@dataclass(frozen=True)
class Record:
    flow: str
    source: str
    phase: str | None  # None: the batch spanned a step
    generation: int
    result: ConnResult


class Traffic:
    """One thread per flow, connecting until finish(). The drill names the current phase;
    a batch belongs to a phase when it started and ended in it."""

    def __init__(self, env: Env, flows: list[Flow], timeout: float = 1.0) -> None:
        self.env, self.timeout = env, timeout
        self.records: list[Record] = []
        self.errors: list[str] = []
        self.phase, self.generation = "setup", 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(f,), daemon=True,
                                          name=f"traffic-{f.name}") for f in flows]
        for thread in self._threads:
            thread.start()

    def enter(self, phase: str) -> None:
        """A new phase (also called at the start of every step, with the step's name)."""
        with self._lock:
            self.phase, self.generation = phase, self.generation + 1

    def sources_seen(self, flow: str) -> set[str]:
        """The sources of `flow` with a batch wholly in the current phase."""
        with self._lock:
            return {r.source for r in self.records
                    if r.flow == flow and r.generation == self.generation and r.phase}

    def _run(self, flow: Flow) -> None:
        turn = 0
        while not self._stop.is_set():
            (address, port), source = (flow.targets[turn % len(flow.targets)],
                                       flow.sources[turn % len(flow.sources)])
            turn += 1
            started = self.generation
            try:
                batch = self.env.lab.connect(self.env.cluster.client, address, port,
                                             flow.proto, count=flow.batch,  # type: ignore[arg-type]
                                             timeout=self.timeout, src=source, sport=flow.sport)
            except NetlabError as err:  # the client itself failed: counted as failures
                self.errors.append(str(err)[:200])
                batch = [ConnResult(False, error="client-failed")] * flow.batch
            with self._lock:
                phase = self.phase if self.generation == started else None
                self.records += [Record(flow.name, source or "", phase, started, r)
                                 for r in batch]

    def finish(self) -> list[Record]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return self.records


def flows(env: Env, clients: list[str], extra: int) -> list[Flow]:
    cluster = env.cluster
    out = [
        Flow("ClusterIP", ((WEB4, 80),)),
        Flow("ClusterIP IPv6", ((WEB6, 80),), batch=10),
        Flow("NodePort", ((cluster.node_ip4, NODE_PORT),)),
        Flow(LOCAL, ((LB_IP, 80),), batch=10),
        Flow(AFFINITY, ((STICKY, 80),), sources=tuple(clients), batch=3),
        # One 5-tuple all along: the conntrack entry made under kube-proxy carries it through.
        Flow("UDP, one flow", ((WEB4, 53),), proto="udp", sport=UDP_SPORT, batch=10),
    ]
    if extra:
        out.append(Flow(f"{extra} more ClusterIPs", tuple((f"{EXTRA_NET}{i + 1}", 80)
                                                         for i in range(extra)), batch=5))
    return out


# ---------------------------------------------------------------------------------------------
# The cluster and the two proxies


def service(name: str, ip: str, selector: dict[str, str] = SELECTOR,
            **spec: Any) -> dict[str, Any]:
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
    body: dict[str, Any] = {"selector": selector, "clusterIP": ip, "ports": ports}
    body.update(spec)
    return {"metadata": {"name": name}, "spec": body}


def services(extra: int) -> list[dict[str, Any]]:
    web = service("web", WEB4, ipFamilyPolicy="PreferDualStack", clusterIPs=[WEB4, WEB6],
                  ports=[{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                         {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}])
    nodeport = service("nodeport", NODEPORT_VIP, type="NodePort", ports=[
        {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
         "nodePort": NODE_PORT}])
    sticky = service("sticky", STICKY, sessionAffinity="ClientIP")
    local = service("local", LOCAL_VIP, LOCAL_SELECTOR, type="LoadBalancer",
                    externalTrafficPolicy="Local", healthCheckNodePort=HEALTH_NODE_PORT,
                    ports=[{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
                            "nodePort": LOCAL_NODE_PORT}])
    return [web, nodeport, sticky, local,
            *(service(f"extra-{i + 1}", f"{EXTRA_NET}{i + 1}") for i in range(extra))]


@dataclass
class Node:
    """The node namespace, its two proxies and what the drill measures about them."""

    env: Env
    plane: controlplane.ControlPlane
    kube: controlplane.Kube
    vips: list[str]
    kube_proxy_config: Path
    pyproxy_kubeconfig: Path
    pyproxy: Daemon | None = None
    kube_proxy: subprocess.Popen[str] | None = None
    kube_proxy_starts: int = 0
    fresh_clients: Iterator[int] = field(default_factory=lambda: iter(range(60, 100)))
    log: list[str] = field(default_factory=list)  # what happened when, for the notes

    def note(self, what: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {what}")

    # -- the proxies -----------------------------------------------------------------------

    def start_pyproxy(self) -> Daemon:
        if self.pyproxy is None:
            self.pyproxy = Daemon(self.env, ["--kubeconfig", str(self.pyproxy_kubeconfig)],
                                  "pyproxy-migration", sync_period=5.0, min_sync_period=0.2)
        else:
            self.pyproxy.restart()
        self.note("pyproxy started")
        return self.pyproxy

    def stop_pyproxy(self) -> None:
        assert self.pyproxy is not None
        self.pyproxy.stop()
        self.note("pyproxy stopped")

    def start_kube_proxy(self) -> float:
        """Start kube-proxy; returns the wall-clock time its first sync was seen."""
        self.kube_proxy_starts += 1
        log = f"kube-proxy-{self.kube_proxy_starts}.log"
        # -v=2: it logs every sync it completes, per family.
        self.kube_proxy = self.env.lab.popen(self.env.cluster.node, [
            self.plane.bin / "kube-proxy", f"--config={self.kube_proxy_config}", "-v=2"],
            log_name=log)
        self.note("kube-proxy started")
        until(lambda: self.kube_proxy_synced(self.env.workdir / log), 60,
              "kube-proxy's first sync", interval=0.05)
        return time.time()

    def kube_proxy_synced(self, log: Path) -> bool:
        """Its first sync is one transaction per family, with every Service in its map."""
        if self.kube_proxy is None or self.kube_proxy.poll() is not None:
            raise DrillError(f"kube-proxy exited; log in {self.env.workdir}")
        text = log.read_text()
        if not all(f'"SyncProxyRules complete" ipFamily="{f}"' in text for f in ("IPv4", "IPv6")):
            return False
        v4 = self.elements("ip", KUBE_PROXY, "service-ips")
        v6 = self.elements("ip6", KUBE_PROXY, "service-ips")
        return all(f"{vip} . tcp . 80" in v4 for vip in self.vips) and f"{WEB6} . tcp" in v6

    def stop_kube_proxy(self) -> None:
        assert self.kube_proxy is not None
        self.env.lab.stop_process(self.kube_proxy)
        self.kube_proxy = None
        self.note("kube-proxy stopped")

    # -- the kernel ------------------------------------------------------------------------

    def elements(self, family: str, table: str, name: str) -> str:
        out = self.env.cluster.node.run(["nft", "list", "map", family, table, name],
                                        check=False)
        return out.stdout if out.returncode == 0 else ""

    def tables(self) -> set[str]:
        listing = self.env.cluster.node.run(["nft", "list", "tables"]).stdout
        return {line.split(" ", 1)[1] for line in listing.splitlines()}

    def affinity_holders(self, client: str) -> list[str]:
        """The tables whose affinity sets hold this client address."""
        pattern = re.compile(rf"(?<![\d.]){re.escape(client)}(?![\d.])")
        holders = []
        for table in (KUBE_PROXY, PYPROXY_TABLE):
            listing = self.env.cluster.node.run(["nft", "list", "table", "ip", table],
                                                check=False).stdout
            if pattern.search(listing):
                holders.append(table)
        return holders

    def who_decides(self) -> str:
        """Which proxy's rules chose the endpoint of a new connection: one connection from an
        address neither has seen to the ClientIP service; the table that remembers it."""
        client = AFFINITY_CLIENTS.format(next(self.fresh_clients))
        self.env.lab.add_addr(self.env.cluster.client, "eth0", f"{client}/24")
        try:
            result = self.env.lab.connect(self.env.cluster.client, STICKY, 80, src=client)[0]
            holders = self.affinity_holders(client)
        finally:
            self.env.lab.ip(self.env.cluster.client, "addr", "del", f"{client}/24", "dev",
                            "eth0")
        if not result.ok or len(holders) != 1:
            return f"unclear ({result.label}, remembered by {holders or 'nobody'})"
        return holders[0]

    def cleanup(self, *flags: str) -> list[str]:
        out = self.env.cluster.node.run([PYPROXY, "cleanup", *flags])
        self.note(f"pyproxy cleanup {' '.join(flags)}: {out.stdout.strip()!r}")
        return out.stdout.splitlines()

    def answers(self, url: str) -> bool:
        with contextlib.suppress(OSError):
            return self.env.http_get(url, timeout=1.0)[0] == 200
        return False

    def ports_watch(self, who: str) -> PortsWatch:
        """From now on (a proxy just stopped), until the other answers on the ports both
        want: /healthz (10256) and the LoadBalancer's health-check node port."""
        return PortsWatch(self, who, {
            "/healthz": "http://127.0.0.1:10256/healthz",
            "health-check node port": f"http://{self.env.cluster.node_ip4}:{HEALTH_NODE_PORT}/",
        })


class PortsWatch:
    """Polls in the background, until finish(), whether each URL answers 200; records after
    how long each first did."""

    def __init__(self, node: Node, who: str, urls: dict[str, str]) -> None:
        self.node, self.who, self.urls = node, who, urls
        self.took: dict[str, float] = {}
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ports-watch")
        self._thread.start()

    def _run(self) -> None:
        while len(self.took) < len(self.urls) and not self._stop.wait(0.1):
            for what, url in self.urls.items():
                if what not in self.took and self.node.answers(url):
                    self.took[what] = time.monotonic() - self._started

    def finish(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(30)
        return self.took


# ---------------------------------------------------------------------------------------------
# Figures


@dataclass
class Steps:
    """The phase of every step, in order, and what the drill saw at each."""

    phases: list[tuple[int, str]] = field(default_factory=list)  # (generation, phase)
    steps: list[tuple[int, str]] = field(default_factory=list)  # (generation, step)
    both_present: list[float] = field(default_factory=list)  # first sync to other's cleanup
    start_to_sync: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    decided_by: list[str] = field(default_factory=list)
    # "who: what" → seconds from the other proxy's stop until it answered, per round trip
    ports_back: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def ports_answered(self, watch: PortsWatch) -> None:
        took = watch.finish()
        for what in watch.urls:
            self.ports_back[f"{watch.who}: {what}"].append(took.get(what, math.inf))


def step(traffic: Traffic, steps: Steps, name: str) -> None:
    traffic.enter(f"step: {name}")
    steps.steps.append((traffic.generation, name))


def phase(traffic: Traffic, steps: Steps, name: str) -> None:
    traffic.enter(name)
    steps.phases.append((traffic.generation, name))


def hold(traffic: Traffic, seconds: float, clients: set[str]) -> None:
    """Stay in the phase `seconds`, and until every ClientIP client has connected in it
    (a busy machine makes the probe slower, not the phase less observed)."""
    time.sleep(seconds)
    until(lambda: traffic.sources_seen(AFFINITY) >= clients, 60,
          "every ClientIP client connected in this phase", interval=0.1)


def endpoints_per_phase(records: list[Record]) -> dict[int, dict[str, Counter[str]]]:
    """generation → client → the endpoints the ClientIP service's connections reached."""
    seen: dict[int, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for rec in records:
        if rec.flow == AFFINITY and rec.phase and rec.result.ok \
                and not rec.phase.startswith("step: "):
            seen[rec.generation][rec.source][rec.result.label] += 1
    return seen


def switches(steps: Steps, seen: dict[int, dict[str, Counter[str]]]) -> dict[str, list[int]]:
    """Per step: how many clients reached another endpoint after it than before it (one
    entry per time the step was taken)."""
    out: dict[str, list[int]] = defaultdict(list)
    order = sorted([(g, "phase", n) for g, n in steps.phases]
                   + [(g, "step", n) for g, n in steps.steps])
    before: int | None = None
    pending: str | None = None
    for generation, kind, name in order:
        if kind == "step":
            pending = name
            continue
        if before is not None and pending is not None:
            old, new = seen.get(before, {}), seen.get(generation, {})
            out[pending].append(sum(1 for c in old.keys() & new.keys()
                                    if set(old[c]) != set(new[c])))
        before, pending = generation, None
    return out


# ---------------------------------------------------------------------------------------------
# The drill


def migration(env: Env, plane: controlplane.ControlPlane, round_trips: int = 1, hold_s: float = 2.0,
              clients: int = 6, extra: int = 0) -> Result:
    more = f", {extra} more ClusterIPs" if extra else ""
    r = Result("kube-proxy migration",
               f"kube-proxy v1.37.2 (nftables) -> pyproxy -> kube-proxy, {round_trips}x, "
               f"under traffic: ClusterIP (IPv4, IPv6), NodePort, LoadBalancer eTP=Local, "
               f"ClientIP affinity ({clients} clients), one UDP flow{more}; {hold_s:g} s a phase")
    addresses = [AFFINITY_CLIENTS.format(100 + i) for i in range(clients)]
    kube = controlplane.Kube(plane.admin_client())
    node = _setup(env, plane, kube, extra)
    for address in addresses:
        env.lab.add_addr(env.cluster.client, "eth0", f"{address}/24")
    steps = Steps()
    traffic: Traffic | None = None
    try:
        node.start_kube_proxy()
        until(lambda: _all_answer(env, extra), 30, "every Service answers through kube-proxy")
        traffic = Traffic(env, flows(env, addresses, extra))
        trip = Trip(node, traffic, steps, r, hold_s, set(addresses))
        phase(traffic, steps, "kube-proxy")
        trip.hold()
        for _ in range(round_trips):
            trip.there()
            trip.back()
        records = traffic.finish()
        r.notes += [f"client failed: {e}" for e in traffic.errors[:5]]
        traffic = None
        _judge(r, node, steps, records)
    finally:
        if traffic is not None:
            traffic.finish()
        _teardown(env, node, kube, addresses)
    return r


@dataclass
class Trip:
    """The steps of a round trip, each followed by a phase under traffic."""

    node: Node
    traffic: Traffic
    steps: Steps
    r: Result
    seconds: float
    clients: set[str]

    def step(self, name: str) -> None:
        step(self.traffic, self.steps, name)

    def phase(self, name: str) -> None:
        phase(self.traffic, self.steps, name)

    def hold(self) -> None:
        hold(self.traffic, self.seconds, self.clients)

    def there(self) -> None:
        """kube-proxy → pyproxy."""
        node, r = self.node, self.r
        self.step("start pyproxy")
        started = time.time()
        daemon = node.start_pyproxy()
        daemon.wait_ready(timeout=60)
        synced = _first_sync_end(daemon)
        self.steps.start_to_sync["pyproxy"].append(synced - started)
        node.note("pyproxy synced")
        self.phase("both, pyproxy started last")
        self.steps.decided_by.append(f"pyproxy started last: {node.who_decides()}")
        self.hold()

        self.step("stop kube-proxy")
        node.stop_kube_proxy()
        watch = node.ports_watch("pyproxy")
        self.phase("kube-proxy's table stale")
        self.hold()

        self.step("pyproxy cleanup --kube-proxy")
        removed = node.cleanup("--kube-proxy")
        self.steps.both_present.append(time.time() - synced)
        r.check(removed == [f"deleted nftables table {f} kube-proxy" for f in ("ip", "ip6")],
                f"cleanup --kube-proxy said {removed}")
        tables = node.tables()
        r.check(not {"ip kube-proxy", "ip6 kube-proxy"} & tables, f"left: {tables}")
        r.check({"ip pyproxy", "ip6 pyproxy"} <= tables, f"pyproxy's tables gone: {tables}")
        self.phase("pyproxy alone")
        r.check(daemon.diff_clean(), "pyproxy's rules differ from what it committed")
        self.hold()
        # pyproxy retries /healthz every 5 s and its health-check node ports at every sync
        # (at least every syncPeriod).
        until(lambda: len(watch.took) == len(watch.urls), 60,
              "pyproxy serving the ports kube-proxy held")
        self.steps.ports_answered(watch)

    def back(self) -> None:
        """pyproxy → kube-proxy."""
        node, r = self.node, self.r
        self.step("start kube-proxy")
        started = time.time()
        synced = node.start_kube_proxy()
        self.steps.start_to_sync["kube-proxy (first sync seen)"].append(synced - started)
        self.phase("both, kube-proxy started last")
        self.steps.decided_by.append(f"kube-proxy started last: {node.who_decides()}")
        self.hold()

        self.step("stop pyproxy")
        node.stop_pyproxy()
        watch = node.ports_watch("kube-proxy, until restarted")
        self.phase("pyproxy's table stale")
        self.hold()

        self.step("pyproxy cleanup")
        node.cleanup()
        self.steps.both_present.append(time.time() - synced)
        tables = node.tables()
        r.check(not {"ip pyproxy", "ip6 pyproxy"} & tables, f"pyproxy's tables left: {tables}")
        r.check({"ip kube-proxy", "ip6 kube-proxy"} <= tables, f"kube-proxy's gone: {tables}")
        self.phase("kube-proxy alone")
        self.hold()
        self.steps.ports_answered(watch)

        # kube-proxy retries a health-check node port it could not bind only at its next
        # sync, and it syncs on a change or once an hour: a restart opens them.
        self.step("restart kube-proxy")
        node.stop_kube_proxy()
        node.start_kube_proxy()
        watch = node.ports_watch("kube-proxy restarted")
        self.phase("kube-proxy restarted")
        self.hold()
        until(lambda: len(watch.took) == len(watch.urls), 30,
              "kube-proxy serving the ports pyproxy held, once restarted")
        self.steps.ports_answered(watch)


def _judge(r: Result, node: Node, steps: Steps, records: list[Record]) -> None:
    r.attempted = len(records)
    r.failed = sum(1 for rec in records if not rec.result.ok)
    failures = Counter((rec.flow, rec.phase or "across a step", rec.result.label)
                       for rec in records if not rec.result.ok)
    r.check(r.failed == 0, f"{r.failed} connections failed: {dict(failures)}")
    if r.failed:
        r.notes.extend(node.log)
    per_flow = Counter(rec.flow for rec in records)
    r.figures["connections per flow"] = dict(per_flow)
    # From outside the cluster CIDR both proxies masquerade every one of these (kube-proxy's
    # and pyproxy's masquerade rules share mark bit 0x4000): a backend that saw the client's
    # own address means a mark got lost between the two tables.
    # The eTP=Local LoadBalancer's are the opposite: never masqueraded, only the local endpoint.
    unmasked = sum(1 for rec in records if rec.result.ok and rec.flow != LOCAL
                   and rec.result.seen_ip == rec.result.local_ip)
    r.check(unmasked == 0, f"{unmasked} connections were not masqueraded")
    local = Counter((rec.result.label, rec.result.seen_ip == rec.result.local_ip)
                    for rec in records if rec.flow == LOCAL and rec.result.ok)
    r.check(set(local) == {("pod-a", True)},
            f"eTP=Local: {dict(local)} (expected pod-a, client address kept)")
    udp = Counter(rec.result.label for rec in records if rec.flow == "UDP, one flow")
    r.figures["the UDP flow (one 5-tuple) reached"] = dict(udp)
    r.check(len([k for k in udp if k.startswith("pod-")]) == 1,
            f"the UDP flow's conntrack entry did not carry it through: {dict(udp)}")
    r.figures["time both tables were present (pyproxy's first sync or kube-proxy's, to the "
              "other's cleanup)"] = ", ".join(f"{s:.1f} s" for s in steps.both_present)
    r.converge_s = max(steps.both_present, default=None)
    r.converge_what = "both proxies' tables present (max)"
    r.figures["start to first sync"] = {k: ", ".join(f"{s:.1f} s" for s in v)
                                        for k, v in steps.start_to_sync.items()}
    # Each retries /healthz every 5 s while the other holds it; pyproxy its health-check node
    # ports at every sync (at least every syncPeriod), kube-proxy only at its next sync.
    r.figures["answering on the ports both want, after the other stopped (or restarted)"] = {
        what: ", ".join(f"{s:.1f} s" if math.isfinite(s) else "not yet" for s in took)
        for what, took in steps.ports_back.items()}

    r.figures["new connections decided by, both present"] = steps.decided_by
    for verdict in steps.decided_by:
        last, _, decided = verdict.partition(" started last: ")
        r.check(decided == ("pyproxy" if last == "pyproxy" else KUBE_PROXY),
                f"both present, {verdict} (expected the proxy started last)")
    _judge_affinity(r, steps, records)


def _judge_affinity(r: Result, steps: Steps, records: list[Record]) -> None:
    seen = endpoints_per_phase(records)
    clients = {c for per_client in seen.values() for c in per_client}
    split = {(g, c): dict(e) for g, per_client in seen.items() for c, e in per_client.items()
             if len(e) > 1}
    r.check(not split, f"a client reached two endpoints within one phase: {split}")
    moved = switches(steps, seen)
    r.figures[f"ClientIP clients ({len(clients)}) that reached another endpoint after"] = {
        name: counts for name, counts in moved.items()}
    # Only a proxy starting changes a client's endpoint (its own affinity sets start empty and
    # its chains run first); stopping one or removing its table must not.
    for name, counts in moved.items():
        if not name.startswith("start "):
            r.check(not any(counts), f"{name} moved ClientIP clients: {counts}")
    kept = [c for name, counts in moved.items() if name.startswith("start ") for c in counts]
    r.verdict = (f"ok: 0 failed; ClientIP clients moved only when a proxy started "
                 f"({sum(kept)} of {len(clients) * len(kept)})")


def _first_sync_end(daemon: Daemon) -> float:
    """Wall clock at which the daemon's first sync since its start was committed."""
    first = daemon.history(n=1000)[-1]
    return float(first["started"] + first["seconds"])


def _all_answer(env: Env, extra: int) -> bool:
    targets = [WEB4, WEB6, STICKY, *(f"{EXTRA_NET}{i + 1}" for i in range(extra))]
    answers = [env.connect(vip, 3, 0.5, 3) for vip in targets]
    if set(env.connect(LB_IP, 3, 0.5, 3)) != {"pod-a"}:
        return False
    answers.append(Counter(r.label for r in env.lab.connect(
        env.cluster.client, env.cluster.node_ip4, NODE_PORT, count=3, timeout=0.5)))
    return all(set(a) <= set(PODS) for a in answers)


def _setup(env: Env, plane: controlplane.ControlPlane, kube: controlplane.Kube, extra: int) -> Node:
    cluster = env.cluster
    plane.attach(cluster.node)
    controlplane.apply_manifests(kube)
    kube.namespace(NAMESPACE)
    kube.node(NODE, (cluster.node_ip4, cluster.node_ip6), zone="zone-1")
    kube.node("node-b", ("192.168.50.3",), zone="zone-1")
    for svc in services(extra):
        kube.core.create_namespaced_service(NAMESPACE, svc)
    for name in PODS:
        pod = cluster.pods[name]
        kube.pod(NAMESPACE, name, "node-b", (pod.ip4, pod.ip6), SELECTOR)
    local = cluster.pods["pod-a"]  # the same backend, as a pod bound to this node
    kube.pod(NAMESPACE, "local-pod-a", NODE, (local.ip4, local.ip6), LOCAL_SELECTOR)
    kube.core.patch_namespaced_service_status("local", NAMESPACE, {"status": {"loadBalancer": {
        "ingress": [{"ip": LB_IP, "ipMode": "VIP"}]}}})
    workdir = env.workdir
    kube_proxy = controlplane.kube_proxy_config(
        workdir / "kube-proxy.yaml",
        plane.node_kubeconfig(workdir / "kube-proxy.kubeconfig",
                              controlplane.kube_proxy_token(kube)))
    py_kubeconfig = plane.node_kubeconfig(workdir / "pyproxy-migration.kubeconfig",
                                          controlplane.service_account_token(kube))
    vips = [WEB4, NODEPORT_VIP, STICKY, LOCAL_VIP, LB_IP,
            *(f"{EXTRA_NET}{i + 1}" for i in range(extra))]
    return Node(env, plane, kube, vips, kube_proxy, py_kubeconfig)


def _teardown(env: Env, node: Node, kube: controlplane.Kube, addresses: list[str]) -> None:
    if node.kube_proxy is not None:
        node.stop_kube_proxy()
    if node.pyproxy is not None:
        node.pyproxy.stop()
    for table in (KUBE_PROXY, PYPROXY_TABLE):
        for family in ("ip", "ip6"):
            env.cluster.node.run(["nft", "delete", "table", family, table], check=False)
    env.lab.flush_conntrack(env.cluster.node)
    for address in addresses:
        env.lab.ip(env.cluster.client, "addr", "del", f"{address}/24", "dev", "eth0")
    with contextlib.suppress(Exception):  # the API server's state dies with it anyway
        kube.core.delete_namespace(NAMESPACE)
        for name in (NODE, "node-b"):
            kube.core.delete_node(name)


@contextlib.contextmanager
def control_plane() -> Iterator[controlplane.ControlPlane]:
    """The real control plane, for the long drill (the tests use their session's)."""
    bin_dir = controlplane.binaries_dir()
    missing = controlplane.missing_binaries(bin_dir)
    if missing:
        raise DrillError(f"the control plane is not built ({', '.join(missing)} missing in "
                         f"{bin_dir}): run `make k8s`")
    with controlplane.running_control_plane(bin_dir) as plane:
        yield plane


def chaos(env: Env, round_trips: int = 3, hold_s: float = 10.0, clients: int = 16,
          extra: int = 20) -> Result:
    """The long version, with a control plane of its own."""
    with control_plane() as plane:
        return migration(env, plane, round_trips, hold_s, clients, extra)
