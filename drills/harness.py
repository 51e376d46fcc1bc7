"""What every drill runs on: the environment (the standard netlab topology: node, client,
backend pods), the daemon under test, the continuous connection probe through a Service, the
drill's `Result` (connections attempted/failed, the time to converge, its figures, and
`violations`: what went against the expectation), the benches that let drills share a daemon,
the waits, and the report's table.

Everything happens in namespaces the lab created (the daemon, the API emulator's socket, the
probes); the root namespace is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pyproxy.serve.debug import DebugError, ask
from testkit import waits
from testkit.apiemu import ApiEmulator
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.daemonargs import DaemonArgs
from testkit.inproc import call_in_netns
from testkit.netlab import Cluster, ConnResult, NetlabError, tally

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
NODE = "node-a"
WEB, STICKY, DOOMED, FRESH = "10.96.0.10", "10.96.0.13", "10.96.0.20", "10.96.0.21"
LB, LB_HEALTH_PORT = "10.96.0.30", 30999  # an eTP=Local LoadBalancer and its health port
HEALTHZ = "127.0.0.1:10256"
METRICS = "127.0.0.1:10249"

Obj = dict[str, Any]


class DrillError(AssertionError):
    """A drill could not go on (something it waits for never happened)."""


def until(check: Callable[[], object], timeout: float, what: str,
          interval: float = 0.05) -> float:
    """Poll check() until it is true (a daemon not answering yet counts as not yet); returns
    the seconds it took. Bounded by timeout: DrillError."""
    return waits.until(check, timeout, what, interval, ignore=(DebugError,), error=DrillError)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class Result:
    drill: str
    fault: str
    attempted: int = 0
    failed: int = 0
    converge_s: float | None = None
    converge_what: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdict: str = ""  # the table's result column, when "ok" says too little

    def check(self, condition: object, message: str) -> bool:
        """Record a violated expectation (the drill goes on, to gather every figure)."""
        if not condition:
            self.violations.append(message)
        return bool(condition)

    def add_probe(self, probe: Probe) -> None:
        self.attempted += len(probe.results)
        self.failed += probe.failed
        if probe.failure_times:
            stamps = ", ".join(stamp(t) for t in probe.failure_times[:5])
            self.notes.append(f"probe {probe.vip}: batches with failures ended at {stamps}")

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        conv = "-" if self.converge_s is None else f"{self.converge_s:.2f} s"
        lines = [f"{self.drill}: {self.fault}",
                 f"  connections {self.attempted} attempted, {self.failed} failed; "
                 f"converged {conv} {self.converge_what}"]
        lines += [f"  {k}: {v}" for k, v in self.figures.items()]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  VIOLATION: {v}" for v in self.violations]
        return "\n".join(lines)


def stamp(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


# ---------------------------------------------------------------------------------------------
# The probe


class Probe:
    """Connections through a Service address from the client namespace, continuously, in
    the background (batches of sequential connections, one client process per batch)."""

    def __init__(self, env: Env, vip: str, port: int = 80, batch: int = 40,
                 timeout: float = 1.0) -> None:
        self.env, self.vip, self.port, self.batch, self.timeout = env, vip, port, batch, timeout
        self.results: list[tuple[float, ConnResult]] = []
        self.errors: list[str] = []
        self.failure_times: list[float] = []  # wall clock at the end of a batch with failures
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{vip}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self.env.lab.connect(self.env.cluster.client, self.vip, self.port,
                                             count=self.batch, timeout=self.timeout)
            except NetlabError as err:  # the client itself failed: counted as failures
                self.errors.append(str(err)[:200])
                batch = [ConnResult(False, error="client-failed")] * self.batch
            now = time.monotonic()
            with self._lock:
                self.results += [(now, r) for r in batch]
                if any(not r.ok for r in batch):
                    self.failure_times.append(time.time())

    def finish(self) -> Probe:
        self._stop.set()
        self._thread.join(60)
        return self

    @property
    def failed(self) -> int:
        with self._lock:
            return sum(1 for _, r in self.results if not r.ok)

    def tally(self) -> Counter[str]:
        with self._lock:
            return tally(r for _, r in self.results)

    def failures_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for t, r in self.results if start <= t <= end and not r.ok)


# ---------------------------------------------------------------------------------------------
# The daemon


def ejections_logged(workdir: Path) -> int:
    """Ejections the daemons in the lab's workdir logged so far (`endpoint_ejected`):
    `make chaos` runs every drill's daemon with outlier ejection on (`Env.daemon_flags`),
    and no drill has an endpoint failing that way (refusing or dropping connections while
    it stays ready), so none may eject one."""
    return sum(log.read_text(errors="replace").count("event=endpoint_ejected")
               + log.read_text(errors="replace").count('"event": "endpoint_ejected"')
               for log in workdir.glob("*.log"))


class Daemon:
    """`pyproxy run` in the node namespace, with its debug socket in the lab's workdir."""

    def __init__(self, env: Env, source: list[str], name: str, sync_period: float = 2.0,
                 min_sync_period: float = 0.1, extra: Iterable[str] = (),
                 servers: bool = True, socket_path: str | None = None) -> None:
        self.env = env
        self.name = name
        self.sync_period = sync_period
        self.min_sync_period = min_sync_period
        self.sock = socket_path or str(env.workdir / f"{name}-run" / "pyproxy.sock")
        cluster = env.cluster
        # servers=False: the health and metrics servers where the daemon's defaults put them.
        self.argv = DaemonArgs(
            node=NODE, bind_address=cluster.node_ip4,
            cluster_cidr=f"{cluster.cluster_cidr4},{cluster.cluster_cidr6}",
            min_sync_period=_duration(min_sync_period), sync_period=_duration(sync_period),
            debug_socket=self.sock, healthz=HEALTHZ if servers else None,
            metrics=METRICS if servers else None,
            extra=(*source, *env.daemon_flags, *extra)).argv()
        self.starts = 0
        self.proc: subprocess.Popen[str] = self._spawn()

    def _spawn(self) -> subprocess.Popen[str]:
        self.starts += 1
        return self.env.lab.popen(self.env.cluster.node, self.argv,
                                  log_name=f"{self.name}.log")

    @property
    def log_path(self) -> Path:
        return self.env.workdir / f"{self.name}.log"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        self.proc = self._spawn()

    def kill(self) -> None:
        """SIGKILL: no chance to clean up (`ip netns exec` execs, so this is pyproxy)."""
        self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.env.lab.stop_process(self.proc)

    def stop(self) -> None:
        self.env.lab.stop_process(self.proc)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP until the block ends, then SIGCONT: the daemon hears and repairs nothing
        meanwhile (what the kernel announces waits in its socket), so a fault lasts as long
        as the block."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    # -- the debug socket ---------------------------------------------------------------------

    def ask(self, endpoint: str, **query: object) -> Any:
        return ask(self.sock, endpoint, timeout=60, **query)

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.ask("/status")
        return result

    def services(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.ask("/services")
        return result

    def history(self, n: int = 100) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.ask("/history", n=n)
        return result

    def diff_clean(self) -> bool:
        return not any(self.ask("/diff").values())

    def endpoints(self, service: str, family: str = "IPv4") -> set[str] | None:
        """The cluster endpoints (IPs) the daemon uses for ns/SERVICE, None if not programmed."""
        for entry in self.services():
            if entry["service"] == f"ns/{service}" and entry["ipFamily"] == family:
                return {e.rsplit(":", 1)[0] for e in entry["clusterEndpoints"] or []}
        return None

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Until the daemon has synced once, without error, with nothing pending."""
        def ready() -> bool:
            if not self.alive:
                raise DrillError(f"daemon {self.name} exited:\n{self.log_tail()}")
            status = self.status()
            last = status.get("lastSync")
            return bool(status["initialized"] and last and last["error"] is None
                        and status["pendingChanges"] == {"services": 0, "endpoints": 0})
        return until(ready, timeout, f"daemon {self.name} ready")

    # -- health and metrics (servers listen inside the node namespace) ----------------------

    def http(self, path: str, address: str = HEALTHZ) -> tuple[int, dict[str, str], bytes]:
        return self.env.http_get(f"http://{address}{path}")

    def healthz(self) -> int:
        return self.http("/healthz")[0]

    def health(self) -> Health:
        """/healthz, /livez and the health-check node port of `lb` (`lb_local`), one after
        the other (`at`: when /healthz was asked; `livez_at`: when /livez answered)."""
        asked = time.monotonic()
        code, _, body = self.http("/healthz")
        livez, _, livez_body = self.http("/livez")
        livez_at = time.monotonic()
        node_port, _, port_body = self.http("/", f"{self.env.cluster.node_ip4}:{LB_HEALTH_PORT}")
        healthz, livez_json = json.loads(body), json.loads(livez_body)
        return Health(asked, code, healthz.get("reason", ""), livez,
                      livez_json.get("reason", ""), node_port,
                      json.loads(port_body or b"{}").get("reason", ""), livez_at,
                      healthz.get("tableReplaced", {}).get("reason", ""),
                      livez_json.get("tableReplaced", {}).get("reason", ""))

    def metrics(self) -> str:
        return self.http("/metrics", METRICS)[2].decode()

    def metric(self, name: str, labels: str = "") -> float:
        pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
        found = pattern.search(self.metrics())
        return float(found.group(1)) if found else 0.0


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


@dataclass(frozen=True)
class Health:
    """What the daemon's health endpoints answered at `at` (monotonic)."""

    at: float
    healthz: int
    reason: str  # /healthz's, when it is 503
    livez: int
    livez_reason: str
    node_port: int  # the health-check node port's
    node_port_reason: str
    # When /livez's answer arrived: the latest its verdict can have been made (/healthz's
    # round trip comes first, under load 0.1 s and more after `at`).
    livez_at: float = 0.0
    # Why our table was last replaced whole, as /healthz and /livez say ("": never)
    replaced: str = ""
    livez_replaced: str = ""


class HealthWatch:
    """The health endpoints polled in the background every `interval` (not flat out: the
    daemon's health server shares the interpreter with the sync being watched)."""

    def __init__(self, daemon: Daemon, interval: float = 0.02) -> None:
        self.daemon = daemon
        self.interval = interval
        self.samples: list[Health] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, ValueError):
                self.samples.append(self.daemon.health())

    def finish(self) -> list[Health]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


# ---------------------------------------------------------------------------------------------
# The environment


class Env:
    """The standard topology (node, client, pod-a…pod-c running backends on 8080)."""

    def __init__(self, cluster: Cluster, daemon_flags: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        # Flags every daemon of the drills gets (`make chaos`: --outlier-ejection).
        self.daemon_flags = daemon_flags
        self.lab = cluster.lab
        self.workdir = cluster.lab.workdir
        self._count = 0
        # The probes make hundreds of connections a second to the same three backends, which
        # close first: the client reuses a source port (connect() walks every other port of
        # the range) while the backend still holds the old connection in TIME_WAIT, and
        # about one SYN in 2,000 is then answered with an ACK instead of a SYN-ACK: a
        # 1 s retransmission, a "timeout" that has nothing to do with the proxy. So the
        # backends keep no TIME_WAIT sockets and the client has the whole port range.
        for pod in cluster.pods.values():
            self.lab.sysctl(pod.ns, {"net.ipv4.tcp_max_tw_buckets": "0"})
        self.lab.sysctl(cluster.client, {"net.ipv4.ip_local_port_range": "1024 65535"})

    def pod(self, name: str) -> str:
        return self.cluster.pods[name].ip4

    def pods(self, *names: str) -> set[str]:
        return {self.pod(n) for n in names}

    def unique(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}-{self._count}"

    def cleanup(self) -> None:
        """Remove pyproxy's tables and the conntrack state between drills."""
        for family in ("ip", "ip6"):
            self.cluster.node.run(["nft", "delete", "table", family, "pyproxy"], check=False)
        self.lab.flush_conntrack(self.cluster.node)

    def nft(self, *commands: str) -> None:
        self.cluster.node.run(["nft", "; ".join(commands)])

    def ruleset(self) -> str:
        return self.lab.nft_list(self.cluster.node)

    def connect(self, vip: str, count: int = 12, timeout: float = 0.5,
                parallel: int = 6) -> Counter[str]:
        return tally(self.lab.connect(self.cluster.client, vip, 80, count=count,
                                      timeout=timeout, parallel=parallel))

    def names(self, counts: Counter[str]) -> set[str]:
        return set(counts)

    def http_get(self, url: str, timeout: float = 3.0) -> tuple[int, dict[str, str], bytes]:
        """GET from inside the node namespace (no proxy from the environment)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def fetch() -> tuple[int, dict[str, str], bytes]:
            try:
                with opener.open(url, timeout=timeout) as resp:
                    return resp.status, dict(resp.headers), resp.read()
            except urllib.error.HTTPError as err:
                return err.code, dict(err.headers), err.read()

        return call_in_netns(self.cluster.node.full, fetch)

    def raw_http(self, address: str, request: bytes, timeout: float = 3.0) -> bytes:
        """Send raw bytes to a server in the node namespace, return everything it answers."""
        host, port = address.rsplit(":", 1)

        def exchange() -> bytes:
            with socket.create_connection((host, int(port)), timeout=timeout) as sock:
                sock.sendall(request)
                sock.shutdown(socket.SHUT_WR)
                chunks = []
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    while chunk := sock.recv(65536):
                        chunks.append(chunk)
                return b"".join(chunks)

        return call_in_netns(self.cluster.node.full, exchange)

    def emulator(self) -> ApiEmulator:
        # The emulator's socket lives in the node namespace (127.0.0.1 there).
        return call_in_netns(self.cluster.node.full,
                             lambda: ApiEmulator(bookmark_interval=1.0).start())

    def api_daemon(self, emu: ApiEmulator, name: str, **kw: Any) -> Daemon:
        kubeconfig = self.workdir / f"{name}.kubeconfig"
        emu.write_kubeconfig(str(kubeconfig))
        return Daemon(self, ["--kubeconfig", str(kubeconfig)], name, **kw)

    def snapshot_daemon(self, objects: list[Obj], name: str,
                        **kw: Any) -> tuple[Daemon, Path]:
        path = self.workdir / f"{name}.yaml"
        write_snapshot(path, objects)
        return Daemon(self, ["--snapshot", str(path)], name, **kw), path


def write_snapshot(path: Path, objects: list[Obj]) -> None:
    """Atomically (the daemon polls the file): JSON, which is YAML and much faster to dump."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    os.replace(tmp, path)


def web(env: Env, pods: Iterable[str], name: str = "web", ip: str = WEB,
        tweak: Callable[[Obj], None] | None = None) -> list[Obj]:
    """A Service and its EndpointSlice (endpoints on node-b, port 8080)."""
    return [make_service("ns", name, tweak, ip=ip),
            make_slice("ns", name, [ep(env.pod(p), "node-b") for p in sorted(pods)])]


def sticky(svc: Obj) -> None:
    svc["spec"]["sessionAffinity"] = "ClientIP"


def lb_local(env: Env) -> list[Obj]:
    """An externalTrafficPolicy: Local LoadBalancer with its endpoint on this node: its
    health-check node port answers 200 while the proxy is healthy."""
    def tweak(svc: Obj) -> None:
        svc["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local",
                           healthCheckNodePort=LB_HEALTH_PORT, ports=[{
                               "name": "http", "port": 80, "targetPort": 8080,
                               "protocol": "TCP", "nodePort": LB_HEALTH_PORT - 1}])
    return [make_service("ns", "lb", tweak, ip=LB),
            make_slice("ns", "lb", [ep(env.pod("pod-a"), NODE)])]


def wait_loaded(daemon: Daemon, loads_before: int, settle: float = 0.0) -> None:
    """After a snapshot write: until the daemon has read it and settled (`wait_settled`);
    then `settle` seconds more when a drill needs a timer of the daemon's to run out (e.g.
    the grace period before stale chains are deleted)."""
    until(lambda: daemon.status()["source"]["loads"] > loads_before, 15, "snapshot reloaded")
    wait_settled(daemon)
    if settle:
        time.sleep(settle)


def wait_settled(daemon: Daemon, timeout: float = 30.0) -> None:
    """Until the daemon's /status shows it settled: nothing pending and no sync for a
    minSyncPeriod (a change delivered while a sync held the lock gets a sync of its own,
    at most a minSyncPeriod after the one before)."""
    seen: dict[str, Any] = {}

    def quiet() -> bool:
        status, now = daemon.status(), time.monotonic()
        pending = status["pendingChanges"]
        key = (status["syncs"], pending["services"], pending["endpoints"])
        if key != seen.get("key"):
            seen.update(key=key, since=now)
        return key[1:] == (0, 0) and now - seen["since"] > daemon.min_sync_period + 0.1

    until(quiet, timeout, "the daemon settled: nothing pending, no sync for a minSyncPeriod")


@contextlib.contextmanager
def running(*daemons: Daemon) -> Iterator[None]:
    try:
        yield
    finally:
        for daemon in daemons:
            daemon.stop()


# ---------------------------------------------------------------------------------------------
# Benches: a daemon (and the API emulator) shared by several drills, so that the CI suite
# does not pay a daemon start for each. The drills make their own state on it first.


class ApiBench:
    """The API emulator in the node namespace and a daemon watching it."""

    def __init__(self, env: Env, name: str = "api", **daemon_kw: Any) -> None:
        self.env = env
        self.emu = env.emulator()
        self.emu.create("Node", make_node(NODE, "zone-1"))
        for obj in web(env, ["pod-a", "pod-b", "pod-c"]):
            self.emu.create(obj["kind"], obj)
        self.daemon = env.api_daemon(self.emu, name, **daemon_kw)
        self.daemon.wait_ready()

    def apply(self, objects: Iterable[Obj]) -> None:
        for obj in objects:
            self.emu.apply(obj["kind"], obj)

    def close(self) -> None:
        self.daemon.stop()
        self.emu.stop(check_leaks=False)
        self.env.cleanup()


class SnapshotBench:
    """A snapshot-mode daemon; drills write the file."""

    def __init__(self, env: Env, name: str = "snapshot", **daemon_kw: Any) -> None:
        self.env = env
        self.base = [make_node(NODE, "zone-1"), *web(env, ["pod-a", "pod-b"])]
        self.current = self.base
        self.daemon, self.path = env.snapshot_daemon(self.base, name, **daemon_kw)
        self.daemon.wait_ready()

    def write(self, objects: list[Obj], settle: float = 0.0) -> None:
        """Write the snapshot and wait until the daemon has read and synced it."""
        if json.dumps(objects) == json.dumps(self.current):
            return  # the same content: the daemon would not read it again
        loads = self.daemon.status()["source"]["loads"]
        self.current = objects
        write_snapshot(self.path, objects)
        wait_loaded(self.daemon, loads, settle)

    def close(self) -> None:
        self.daemon.stop()
        self.env.cleanup()


_Bench = TypeVar("_Bench", "ApiBench", "SnapshotBench")


@contextlib.contextmanager
def _given_or_own(kind: type[_Bench], env: Env, bench: _Bench | None, name: str,
                  **daemon_kw: Any) -> Iterator[_Bench]:
    """The given bench, or a new one for this drill alone (closed afterwards)."""
    if bench is not None:
        yield bench
        return
    own = kind(env, name, **daemon_kw)
    try:
        yield own
    finally:
        own.close()


def api_bench(env: Env, bench: ApiBench | None, name: str,
              **daemon_kw: Any) -> contextlib.AbstractContextManager[ApiBench]:
    return _given_or_own(ApiBench, env, bench, name, **daemon_kw)


def snapshot_bench(env: Env, bench: SnapshotBench | None, name: str,
                   **daemon_kw: Any) -> contextlib.AbstractContextManager[SnapshotBench]:
    return _given_or_own(SnapshotBench, env, bench, name, **daemon_kw)


def api_errors(daemon: Daemon) -> int:
    return sum(w["errors"] for w in daemon.status()["source"]["api"])


# ---------------------------------------------------------------------------------------------
# Reporting


def markdown_table(results: list[Result]) -> str:
    rows = ["| drill | fault | connections attempted | failed | converged | result |",
            "|---|---|---:|---:|---|---|"]
    for res in results:
        conv = "–" if res.converge_s is None else f"{res.converge_s:.2f} s {res.converge_what}"
        if res.ok:
            verdict = res.verdict or "ok"
        elif res.drill == "known bug":
            verdict = "bug (expected to fail): " + res.violations[0].split("\n")[0][:120]
        else:
            verdict = "**" + "; ".join(v.split("\n")[0] for v in res.violations)[:200] + "**"
        rows.append(f"| {res.drill} | {res.fault} | {res.attempted or '–'} | "
                    f"{res.failed if res.attempted else '–'} | {conv} | {verdict} |")
    return "\n".join(rows)


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
