"""netlab: real-packet test fixture built from Linux network namespaces.

A `Lab` creates network namespaces, veth links, addresses, routes and per-namespace sysctls
with iproute2, starts small backend servers (testkit/netlab_backend.py) inside them and drives
batches of client connections (testkit/netlab_client.py) from them. Everything lives in
namespaces the lab created itself; the root namespace is never touched. Namespaces are named
``ppx-<pid>-<lab>-<name>`` so `sweep_stale()` can remove leftovers of crashed runs (dead pid)
without touching anybody else's.

Cleanup happens on `Lab.close()` / leaving the ``with`` block (also on exceptions and
KeyboardInterrupt), in the pytest fixture finalizer (testkit/fixtures.py), and in an atexit
hook as a last resort. Backends additionally exit when their stdin pipe closes, so even a
SIGKILLed test run does not leak processes (its namespaces are swept by the next run).

A lab with a fixed prefix (`Lab(prefix="pyproxy-demo-")`, the demo's) names its namespaces
``<prefix><name>`` and runs one at a time: it holds a lock file while it lives, so whatever
namespaces with its prefix exist when it takes the lock are leftovers of a run that was
killed, and it removes them first (`Lab.swept`). Its daemons can be started detached
(`popen(..., detach=True)`: their own session, SIGKILL should the lab's process die).
Backends and clients also come without a process: `Lab.serve_http` and `Lab.probe_http`
(testkit/inproc.py) serve and probe from threads of the lab's own process.

Standard topology (`Lab.standard_topology()`, see `Cluster`)
-------------------------------------------------------------
::

                        192.168.50.0/24, fd00:50::/64
    [client] eth0 .2 ---------------------------------- .1 eth0 [node]   ip/ipv6 forwarding on
                                                              |   kube-svc0 (sink): routes for
                                                              |   10.96.0.0/16, fd00:96::/108
        10.244.N.0/24, fd00:244:0:N::/64 (one per pod)        |
    [pod-a]      eth0 .2 / ::2 ---------------------- .1 / ::1 vpod1
    [pod-b]      eth0 .2 / ::2 ---------------------- .1 / ::1 vpod2
    [pod-client] eth0 .2 / ::2 ---------------------- .1 / ::1 vpod0   (no backend)

- Cluster (pod) CIDR 10.244.0.0/16 and fd00:244::/48. Pod number N owns 10.244.N.0/24 and
  fd00:244:0:N::/64; the pod is .2/::2, the node's end of that link .1/::1. ``pod-client`` is N=0,
  backend pods are N=1, 2, ... in creation order. Point-to-point links (no bridge) make every
  packet, including hairpin pod -> service -> same pod, cross the node's routing and netfilter
  hooks, without depending on br_netfilter.
- Service CIDR 10.96.0.0/16 and fd00:96::/108 are routed on the node to a sink device (with the
  node IP as preferred source). Locally generated traffic to a ClusterIP needs *a* route before
  the output NAT hook can rewrite it (otherwise connect() fails with ENETUNREACH); unmatched
  service traffic is swallowed by the sink device, i.e. it times out, as a real cluster would.
- The node IP (what NodePorts are reached on) is 192.168.50.1 / fd00:50::1.
- Every non-node namespace has its default route via the node, so pod <-> client traffic always
  crosses the node: a backend that sees the client's address got an un-masqueraded connection,
  one that sees its own gateway (10.244.N.1) was masqueraded by the node.

Typical use::

    @requires_netns
    @pytest.mark.netns
    def test_something(lab: Lab) -> None:
        cluster = lab.standard_topology()
        lab.nft(cluster.node, RULESET)
        results = lab.connect(cluster.client, cluster.service_ip(10), 80, count=50)
        assert set(tally(results)) == {"pod-a", "pod-b"}

Kernel and tool behaviour worth knowing (all measured on 6.18 / nft 1.0.6)
-------------------------------------------------------------------------
- ICMP errors are rate limited per destination (~6 back-to-back, then 1/s) and by a global token
  bucket (burst 50, random 0-2 credits per message). A batch against a rejected port would read
  mostly "timeout"; BASE_SYSCTLS lifts both limits inside lab namespaces.
- Between namespaces the ICMP error for a SYN comes back while connect() still holds the socket
  lock, so the kernel keeps it as a "soft" error: for IPv6, connect() only fails after the SYN
  retransmit (~1 s). The client reads such errors from the IP_RECVERR queue instead.
- UDP sockets ignore host/net-unreachable ICMP unless IP_RECVERR is set (the client sets it).
- Conntrack entries keep their NAT decision: after changing rules, traffic reusing a 5-tuple
  (fixed sport, UDP) still goes to the old endpoint until `Lab.flush_conntrack()`.
- Two veth ends with equal ifindexes get their carrier-up delayed by ~1 s (see `Lab.link`).
- The `dummy` link type may be missing (module): see `Lab.add_sink`.
- nft 1.0.6: a one-line ruleset needs ';' after a nested '}' (`{ chain c { ...; }; }`), some
  words (fwd) are keywords and cannot name chains, and the `dstnat` priority name is refused on
  the output hook (use -100).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from testkit.inproc import HttpBackend, http_probe

HERE = Path(__file__).resolve().parent
BACKEND_SCRIPT = HERE / "netlab_backend.py"  # run as scripts (-I -S), not imported
CLIENT_SCRIPT = HERE / "netlab_client.py"

NS_PREFIX = "ppx-"
_NS_RE = re.compile(r"^ppx-(\d+)-")
CMD_TIMEOUT = 10.0  # seconds for any single ip/nft/sysctl command
STOP_TIMEOUT = 3.0  # seconds a stopped process gets to exit before SIGKILL

Proto = Literal["tcp", "udp", "sctp"]
Cmd = Sequence[str | os.PathLike[str]]

# Sysctls every lab namespace gets. Values in a fresh namespace partly depend on the host
# (net.core.devconf_inherit_init_net), so everything a test relies on is set explicitly.
BASE_SYSCTLS = {
    # Fresh IPv6 addresses are usable at once (we also pass `nodad`; this covers link-locals).
    "net.ipv6.conf.all.accept_dad": "0",
    "net.ipv6.conf.default.accept_dad": "0",
    # ICMP errors are rate limited per destination (about 6 back-to-back, then 1/s): a batch of
    # probes against a REJECTed or closed UDP port would then report "timeout" for most of them.
    "net.ipv4.icmp_ratelimit": "0",
    "net.ipv4.icmp_msgs_per_sec": "1000000",
    "net.ipv4.icmp_msgs_burst": "100000",
    "net.ipv6.icmp.ratelimit": "0",
    # And no ICMP error type is rate limited at all (the global limiter draws a random cost
    # per message besides the figures above). Batches that expect "refused" or
    # "unreachable" still saw one "timeout" in five now and then under load, with either
    # proxy; the cause is not pinned down, this takes the rate limiters out of the question.
    "net.ipv4.icmp_ratemask": "0",
    "net.ipv6.icmp.ratemask": "",
}
ROUTER_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    "net.ipv6.conf.all.forwarding": "1",
    # Loose/strict reverse-path filtering would drop asymmetric test traffic; make it explicit.
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
}


class NetlabError(RuntimeError):
    """A lab operation failed (the message carries the command and its stderr)."""


# --------------------------------------------------------------------------------------------
# Low-level helpers
# --------------------------------------------------------------------------------------------


def _cmd(
    argv: Cmd, *, input: str | None = None, check: bool = True, timeout: float = CMD_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run a command with a timeout; with check, failures raise NetlabError including stderr."""
    args = [os.fspath(a) for a in argv]
    try:
        proc = subprocess.run(
            args, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetlabError(f"timed out after {timeout}s: {' '.join(args)}") from exc
    if check and proc.returncode != 0:
        raise NetlabError(
            f"command failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr.strip()}"
        )
    return proc


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded now: not in a child between fork and exec


def _die_with_parent() -> None:
    """In a child between fork and exec: SIGKILL when the parent (thread) dies. Not SIGTERM:
    the parent's death is a power cut, and a graceful stop can hang on what died beside it
    (kube-apiserver, SIGTERMed with its etcd, was still shutting down 30 s later)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _list_netns() -> list[str]:
    """Names of all named namespaces (`ip netns list` prints 'name (id: N)' lines)."""
    out = _cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(full_name: str) -> list[int]:
    out = _cmd(["ip", "netns", "pids", full_name], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_netns_processes(full_name: str) -> None:
    """SIGKILL whatever still runs in one of *our* namespaces (a netns with live processes would
    outlive `ip netns del`, keeping its veths and sockets around)."""
    for _ in range(10):  # bounded: a process could in theory respawn children
        pids = _netns_pids(full_name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: not _netns_pids(full_name), timeout=1.0)


def _delete_netns(full_name: str) -> None:
    _kill_netns_processes(full_name)
    _cmd(["ip", "netns", "del", full_name], check=False)


def _wait_until(predicate: Callable[[], object], *, timeout: float, interval: float = 0.02) -> bool:
    """Poll predicate() until true or timeout; returns whether it became true. Bounded."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _ask_to_stop(proc: subprocess.Popen[str]) -> None:
    """Ask both ways at once: stdin EOF (what netlab_backend.py waits for) and SIGTERM (what
    daemons such as pyproxy expect)."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)


def _stop_process(proc: subprocess.Popen[str], timeout: float = STOP_TIMEOUT) -> None:
    """Ask the process to stop, SIGKILL it if still there after timeout; reap it. Bounded."""
    _ask_to_stop(proc)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=CMD_TIMEOUT)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def sweep_stale() -> list[str]:
    """Delete ``ppx-<pid>-*`` namespaces (and lab workdirs) whose creating process is gone;
    returns the names of the namespaces removed.

    Only names with this fixture's exact prefix and a dead pid are touched, so concurrent test
    runs (other pids) and namespaces of other tools are left alone.
    """
    removed = []
    for name in _list_netns():
        match = _NS_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_netns(name)
            removed.append(name)
    for workdir in Path(tempfile.gettempdir()).glob(f"{NS_PREFIX}*"):
        match = _NS_RE.match(workdir.name)
        if match and workdir.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(workdir, ignore_errors=True)
    return removed


def netns_usable() -> bool:
    """True when we are root and iproute2 can manage named network namespaces."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    try:
        return _cmd(["ip", "netns", "list"], check=False, timeout=5).returncode == 0
    except (OSError, NetlabError):
        return False


NETNS_USABLE = netns_usable()


class Locked(NetlabError):
    """Another run holds the lab's prefix (a fixed-prefix lab runs one at a time)."""


def _lock(path: Path) -> IO[str]:
    """Take the lock file (non-blocking) and write our pid into it; raises Locked if another
    process holds it. The inode check makes removing it on release safe against a run that
    opened it just before."""
    while True:
        fh = open(path, "a+")  # noqa: SIM115 - held for the lab's life, closed by _unlock
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            other = fh.read().strip() or "?"
            fh.close()
            raise Locked(f"pid {other} holds {path}") from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = -1
        if current == os.fstat(fh.fileno()).st_ino:
            break
        fh.close()  # the previous holder removed it meanwhile: lock the new file
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _unlock(fh: IO[str], path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    fh.close()


def sweep_prefix(prefix: str) -> list[str]:
    """Delete every namespace named ``<prefix>*`` (processes inside first) and every temp
    directory of that prefix; returns the namespace names and directory paths removed. Only
    for a fixed-prefix lab holding its lock: then nobody else uses these names."""
    removed = [name for name in _list_netns() if name.startswith(prefix)]
    for name in removed:
        _delete_netns(name)
    for workdir in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        if workdir.is_dir():
            shutil.rmtree(workdir, ignore_errors=True)
            removed.append(str(workdir))
    return removed


# --------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Netns:
    """One network namespace of a lab. ``name`` is the short name tests use ("node"), ``full``
    the real `ip netns` name."""

    lab: Lab
    name: str
    full: str
    router: bool = False
    ifnames: set[str] = field(default_factory=lambda: {"lo"})

    def run(
        self,
        argv: Cmd,
        *,
        input: str | None = None,
        check: bool = True,
        timeout: float = CMD_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        """Shortcut for ``lab.run(ns, ...)``."""
        return self.lab.run(self, argv, input=input, check=check, timeout=timeout)

    def nft(self, ruleset: str) -> None:
        self.lab.nft(self, ruleset)

    def __str__(self) -> str:
        return self.full


NsRef = Netns | str


@dataclass(frozen=True)
class Link:
    """A veth pair: ``if_a`` lives in ``ns_a``, ``if_b`` in ``ns_b``."""

    ns_a: Netns
    if_a: str
    ns_b: Netns
    if_b: str


@dataclass(eq=False)
class Backend:
    """A running netlab_backend.py process. Ports list what it actually serves."""

    ns: Netns
    name: str
    proc: subprocess.Popen[str]
    log: Path
    tcp_ports: list[int]
    udp_ports: list[int]
    sctp_ports: list[int]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.ns.lab.stop_backend(self)


@dataclass(frozen=True)
class ConnResult:
    """Outcome of one client attempt.

    ok: an answer arrived; then ``name`` is the backend's name and ``seen_ip``/``seen_port`` the
    client address the backend saw. Otherwise ``error`` is "refused", "unreachable", "reset",
    "timeout" or "other:...". ``local_ip``/``local_port`` is the client socket's own address
    (when it got as far as connecting), handy for conntrack assertions. ``started``/``ended``:
    when the attempt began and ended (wall clock, 0.0 when not known).
    """

    ok: bool
    name: str | None = None
    seen_ip: str | None = None
    seen_port: int | None = None
    error: str | None = None
    local_ip: str | None = None
    local_port: int | None = None
    started: float = 0.0
    ended: float = 0.0

    @property
    def label(self) -> str:
        """Backend name on success, error kind otherwise (what `tally` counts)."""
        return self.name if self.ok and self.name is not None else str(self.error)

    @property
    def rejected(self) -> bool:
        """Actively refused (RST or ICMP error), as opposed to silently dropped."""
        return self.error in ("refused", "unreachable")

    @classmethod
    def from_json(cls, line: str) -> ConnResult:
        data = json.loads(line)
        local = data.get("local") or [None, None]
        started, ended = data.get("at") or (0.0, 0.0)
        if not data["ok"]:
            return cls(False, error=data["error"], local_ip=local[0], local_port=local[1],
                       started=started, ended=ended)
        name, ip, port = data["reply"].split()
        return cls(True, name, ip, int(port), None, local[0], local[1], started, ended)


def tally(results: Iterable[ConnResult]) -> Counter[str]:
    """Count results by backend name (successes) or error kind (failures)."""
    return Counter(r.label for r in results)


# --------------------------------------------------------------------------------------------
# The lab
# --------------------------------------------------------------------------------------------

_LAB_IDS = itertools.count()
_IFINDEXES = itertools.count(1000, 2)
# Strong references on purpose: a lab that a test forgot (and dropped) must still be closed.
_LIVE_LABS: set[Lab] = set()


@atexit.register
def _close_live_labs() -> None:
    """Safety net for labs nobody closed (e.g. an interpreter exiting mid-test)."""
    for lab in list(_LIVE_LABS):
        lab.close()


class Lab:
    """A set of namespaces, links and processes that is torn down as a whole.

    All methods that take a namespace accept a `Netns` or its short name.
    """

    def __init__(self, *, python: str = sys.executable, sweep: bool = True,
                 prefix: str | None = None) -> None:
        """``prefix``: fixed namespace names ``<prefix><name>`` instead of per-process ones;
        the lab then takes the prefix's lock file (`Locked` if another run holds it) and
        removes a killed run's leftovers (``swept``). ``sweep``: remove the namespaces of dead
        test runs first (per-process names only)."""
        self._lock: IO[str] | None = None
        self.swept: list[str] = []
        if prefix is not None:
            self.lock_path = Path(tempfile.gettempdir()) / f"{prefix.rstrip('-')}.lock"
            self._lock = _lock(self.lock_path)
            self.swept = sweep_prefix(prefix)
        elif sweep:
            sweep_stale()
        self.python = python  # interpreter for exec_python and the scripts (the venv's by default)
        # The backend/client scripts use only the standard library: -I -S skips site-packages
        # (.pth hooks of editable installs) and the environment, halving interpreter start-up.
        self._script_python = [python, "-I", "-S"]
        self.prefix = prefix or f"{NS_PREFIX}{os.getpid()}-{next(_LAB_IDS)}-"
        self.namespaces: dict[str, Netns] = {}
        self.backends: list[Backend] = []
        self.links: list[Link] = []
        # Process-wide (labs may link to each other's namespaces, e.g. the control plane's)
        # so the two ends of a veth pair never share an ifindex (see link()).
        self._ifindexes = _IFINDEXES
        self._procs: list[subprocess.Popen[str]] = []
        self._logs: list[IO[str]] = []
        self._http: list[HttpBackend] = []
        self.workdir = Path(tempfile.mkdtemp(prefix=self.prefix))
        self.closed = False
        _LIVE_LABS.add(self)

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process, delete every namespace and the workdir.

        Idempotent, and each step runs even if an earlier one failed. ``closed`` is only set at
        the end, so if close() itself is interrupted (a second Ctrl-C) the atexit hook finishes
        the job. Set NETLAB_KEEP_LOGS=1 to keep the workdir (process logs) for debugging.
        """
        if self.closed:
            return
        for http in self._http:
            http.stop()
        self._http.clear()
        for proc in self._procs:  # signal everybody first, so they all exit in parallel
            _ask_to_stop(proc)
        for proc in reversed(self._procs):
            with contextlib.suppress(Exception):
                _stop_process(proc)
        self._procs.clear()
        for ns in reversed(list(self.namespaces.values())):
            with contextlib.suppress(Exception):
                _delete_netns(ns.full)
            del self.namespaces[ns.name]
        for log in self._logs:
            with contextlib.suppress(OSError):
                log.close()
        if not os.environ.get("NETLAB_KEEP_LOGS"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._lock is not None:
            _unlock(self._lock, self.lock_path)
            self._lock = None
        self.closed = True
        _LIVE_LABS.discard(self)

    @property
    def processes(self) -> list[subprocess.Popen[str]]:
        """The processes `popen` started that are still the lab's, in start order."""
        return list(self._procs)

    def leftovers(self) -> list[str]:
        """Namespaces of this lab that still exist (empty after close(), tests assert it)."""
        return [n for n in _list_netns() if n.startswith(self.prefix)]

    # -- namespaces, links, addresses, routes ------------------------------------------------

    def ns(self, ref: NsRef) -> Netns:
        """Resolve a short name to its Netns (a Netns is returned as is)."""
        if isinstance(ref, Netns):
            return ref
        try:
            return self.namespaces[ref]
        except KeyError:
            raise NetlabError(f"no namespace {ref!r} in this lab") from None

    def add_ns(self, name: str, *, router: bool = False,
               sysctls: Mapping[str, str] | None = None) -> Netns:
        """Create a namespace with lo up and the base sysctls (plus forwarding if router,
        then ``sysctls``)."""
        if self.closed:
            raise NetlabError("lab is closed")
        if name in self.namespaces:
            raise NetlabError(f"namespace {name!r} exists")
        ns = Netns(self, name, self.prefix + name, router)
        _cmd(["ip", "netns", "add", ns.full])
        self.namespaces[name] = ns  # registered at once so close() removes it even if setup fails
        self.ip(ns, "link", "set", "lo", "up")
        values = {**BASE_SYSCTLS, **(ROUTER_SYSCTLS if router else {}), **(sysctls or {})}
        self.sysctl(ns, values)
        return ns

    def del_ns(self, ref: NsRef) -> None:
        """Delete one namespace (its processes are killed, its veths vanish with it)."""
        ns = self.ns(ref)
        for backend in [b for b in self.backends if b.ns is ns]:
            backend.stop()
        _delete_netns(ns.full)
        del self.namespaces[ns.name]
        # The peers of its veths vanished with it: free their names on the other side.
        for link in [lk for lk in self.links if ns in (lk.ns_a, lk.ns_b)]:
            self.links.remove(link)
            other, ifname = (link.ns_b, link.if_b) if link.ns_a is ns else (link.ns_a, link.if_a)
            other.ifnames.discard(ifname)

    def ip(self, ref: NsRef, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``ip -n NS ARGS...`` (iproute2 switches namespaces itself: no extra exec)."""
        return _cmd(["ip", "-n", self.ns(ref).full, *args])

    def sysctl(self, ref: NsRef, values: dict[str, str]) -> None:
        """Set sysctls inside the namespace (one process for all of them)."""
        self.run(ref, ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items())])

    def _ifname(self, ns: Netns, wanted: str | None, peer: Netns) -> str:
        """Interface name unique within ns, at most 15 characters (IFNAMSIZ - 1)."""
        base = (wanted or f"to-{peer.name}")[:15]
        name = base
        for i in itertools.count(1):
            if name not in ns.ifnames:
                break
            if wanted is not None:
                raise NetlabError(f"interface {wanted!r} already exists in {ns.name}")
            name = f"{base[: 15 - len(str(i))]}{i}"
        ns.ifnames.add(name)
        return name

    def link(
        self,
        a: NsRef,
        b: NsRef,
        addrs_a: Sequence[str] = (),
        addrs_b: Sequence[str] = (),
        *,
        if_a: str | None = None,
        if_b: str | None = None,
    ) -> Link:
        """Connect two namespaces with a veth pair, bring both ends up and add addresses
        (CIDR strings, IPv4 and/or IPv6; IPv6 ones are added with nodad).

        The pair is created directly inside ``a`` with its peer inside ``b``, so it never
        appears in the root namespace, not even briefly.
        """
        ns_a, ns_b = self.ns(a), self.ns(b)
        name_a, name_b = self._ifname(ns_a, if_a, ns_b), self._ifname(ns_b, if_b, ns_a)
        # Explicit, distinct ifindexes: in two fresh namespaces both ends would otherwise get
        # ifindex 2, and the kernel treats a device whose peer index equals its own index as
        # "not stacked", delaying its carrier-up event by up to a second (linkwatch).
        index = next(self._ifindexes)
        self.ip(
            ns_a,
            "link",
            "add",
            name_a,
            "index",
            str(index),
            "type",
            "veth",
            "peer",
            "name",
            name_b,
            "netns",
            ns_b.full,
            "index",
            str(index + 1),
        )
        for ns, ifname, addrs in ((ns_a, name_a, addrs_a), (ns_b, name_b, addrs_b)):
            for cidr in addrs:
                self.add_addr(ns, ifname, cidr)
            self.ip(ns, "link", "set", ifname, "up")
        for ns, ifname in ((ns_a, name_a), (ns_b, name_b)):
            self._wait_oper_up(ns, ifname)
        link = Link(ns_a, name_a, ns_b, name_b)
        self.links.append(link)
        return link

    def _wait_oper_up(self, ns: Netns, ifname: str, timeout: float = 3.0) -> None:
        """Wait (bounded) until the device's operstate is UP: only then has IPv6 configured its
        link-local address, so tests start from a settled link."""

        def is_up() -> bool:
            out = self.ip(ns, "-j", "link", "show", "dev", ifname).stdout
            return bool(json.loads(out)[0].get("operstate") == "UP")

        if not _wait_until(is_up, timeout=timeout):
            raise NetlabError(f"{ns.name}/{ifname} not operationally up after {timeout}s")

    def add_addr(self, ref: NsRef, ifname: str, cidr: str) -> None:
        """Add an address; IPv6 with nodad so it is usable immediately (no 1-2 s tentative)."""
        extra = ["nodad"] if ipaddress.ip_interface(cidr).version == 6 else []
        self.ip(ref, "addr", "add", cidr, "dev", ifname, *extra)

    def add_sink(self, ref: NsRef, ifname: str) -> None:
        """A device that silently discards everything routed to it (like kube-proxy's
        kube-ipvs0 dummy). The `dummy` driver is not always available (it is a module), so this
        is a veth whose peer stays down in the same namespace: veth drops frames towards a down
        peer. ARP/ND is turned off so routed packets never wait for (and fail) neighbour
        resolution, which would turn "dropped" into EHOSTUNREACH after a few seconds."""
        ns = self.ns(ref)
        peer = f"{ifname[:13]}-p"
        for name in (ifname, peer):
            if name in ns.ifnames:
                raise NetlabError(f"interface {name!r} already exists in {ns.name}")
        self.ip(ns, "link", "add", ifname, "type", "veth", "peer", "name", peer)
        ns.ifnames.update((ifname, peer))
        self.ip(ns, "link", "set", ifname, "arp", "off", "up")

    def add_route(
        self,
        ref: NsRef,
        dst: str,
        *,
        via: str | None = None,
        dev: str | None = None,
        src: str | None = None,
    ) -> None:
        """``ip route add DST [via GW] [dev DEV] [src SRC]``; DST may be "default". The family
        is taken from dst/via so "default" works for both IPv4 and IPv6."""
        probe = via or (dst if dst != "default" else None) or src
        six = probe is not None and ipaddress.ip_interface(probe).version == 6
        args = ["-6"] if six else []
        args += ["route", "add", dst]
        for key, value in (("via", via), ("dev", dev), ("src", src)):
            if value is not None:
                args += [key, value]
        self.ip(ref, *args)

    # -- commands and processes ---------------------------------------------------------------

    def run(
        self,
        ref: NsRef,
        argv: Cmd,
        *,
        input: str | None = None,
        check: bool = True,
        timeout: float = CMD_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the namespace and wait for it (bounded by timeout)."""
        return _cmd(
            ["ip", "netns", "exec", self.ns(ref).full, *argv],
            input=input,
            check=check,
            timeout=timeout,
        )

    def exec_python(
        self,
        ref: NsRef,
        code: str,
        *,
        args: Sequence[str] = (),
        check: bool = True,
        timeout: float = CMD_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        """Run Python code (with the lab's interpreter, so the venv and its packages, e.g. the
        `nftables` binding or pyproxy, are importable) inside the namespace."""
        return self.run(ref, [self.python, "-c", code, *args], check=check, timeout=timeout)

    def popen(
        self,
        ref: NsRef,
        argv: Cmd,
        *,
        log_name: str | None = None,
        env: Mapping[str, str] | None = None,
        detach: bool = False,
    ) -> subprocess.Popen[str]:
        """Start a long-running process (e.g. pyproxy) in the namespace; stopped on close().

        stdin is a pipe (closed on stop, so EOF-aware programs exit promptly; SIGTERM follows);
        stdout+stderr go to a log file in the lab workdir (a pipe nobody reads could fill up and
        block the process). Its log is at ``workdir / log_name`` (default: derived from argv).

        ``detach``: the process gets its own session (a Ctrl-C at the terminal reaches only
        the lab's process, which then stops it in order) and SIGKILL should the lab's process
        die (PR_SET_PDEATHSIG). That signal follows the *thread* that started it, and the
        hook runs between fork and exec: call it from the main thread, before other threads
        (e.g. `serve_http`'s) run.
        """
        ns = self.ns(ref)
        log_path = self.workdir / (log_name or f"{ns.name}-{Path(os.fspath(argv[0])).name}.log")
        log = open(log_path, "a")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns.full, *(os.fspath(a) for a in argv)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else dict(env),
            start_new_session=detach,
            preexec_fn=_die_with_parent if detach else None,
        )
        self._procs.append(proc)
        return proc

    def stop_process(self, proc: subprocess.Popen[str]) -> None:
        """Stop a process started by this lab (bounded escalation up to SIGKILL)."""
        _stop_process(proc)
        if proc in self._procs:
            self._procs.remove(proc)

    def nft(self, ref: NsRef, ruleset: str) -> None:
        """Load an nft ruleset (``nft -f -``) inside the namespace."""
        self.run(ref, ["nft", "-f", "-"], input=ruleset)

    def nft_list(self, ref: NsRef) -> str:
        """The namespace's whole ruleset, as `nft list ruleset` prints it."""
        return self.run(ref, ["nft", "list", "ruleset"]).stdout

    def flush_conntrack(self, ref: NsRef) -> None:
        """Forget all conntrack entries of the namespace. Needed between phases of a test that
        reuse a 5-tuple: existing entries keep their old NAT decision."""
        self.run(ref, ["conntrack", "-F"])

    # -- backends and clients -----------------------------------------------------------------

    def start_backend(
        self,
        ref: NsRef,
        name: str,
        tcp_ports: Sequence[int] = (),
        udp_ports: Sequence[int] = (),
        sctp_ports: Sequence[int] = (),
        *,
        ready_timeout: float = 5.0,
    ) -> Backend:
        """Start netlab_backend.py in the namespace and wait (bounded) until every socket listens.

        SCTP ports are served only if the kernel supports SCTP; check ``backend.sctp_ports``.
        """
        targets = [(ref, name)]
        return self.start_backends(
            targets, tcp_ports, udp_ports, sctp_ports, ready_timeout=ready_timeout
        )[0]

    def start_backends(
        self,
        targets: Sequence[tuple[NsRef, str]],
        tcp_ports: Sequence[int] = (),
        udp_ports: Sequence[int] = (),
        sctp_ports: Sequence[int] = (),
        *,
        ready_timeout: float = 5.0,
    ) -> list[Backend]:
        """Start one backend per (namespace, name) with the same ports. All are spawned before
        waiting for any, so their interpreter start-ups overlap."""
        argv: list[str] = [*self._script_python, str(BACKEND_SCRIPT)]
        for flag, ports in (("--tcp", tcp_ports), ("--udp", udp_ports), ("--sctp", sctp_ports)):
            for port in ports:
                argv += [flag, str(port)]
        spawned = [self._spawn_backend(self.ns(ref), name, argv) for ref, name in targets]
        deadline = time.monotonic() + ready_timeout
        backends = []
        for ns, name, proc, log in spawned:
            served = self._wait_ready(proc, log, deadline)
            backends.append(
                Backend(ns, name, proc, log, served["tcp"], served["udp"], served["sctp"])
            )
        self.backends += backends
        return backends

    def _spawn_backend(
        self, ns: Netns, name: str, argv: list[str]
    ) -> tuple[Netns, str, subprocess.Popen[str], Path]:
        log = self.workdir / f"backend-{ns.name}-{name}.log"
        with open(log, "w") as errfile:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns.full, *argv, "--name", name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errfile,
                text=True,
            )
        self._procs.append(proc)
        return ns, name, proc, log

    def _wait_ready(
        self, proc: subprocess.Popen[str], log: Path, deadline: float
    ) -> dict[str, list[int]]:
        """Read the backend's single 'READY {json}' line, until the deadline."""
        assert proc.stdout is not None
        timeout = max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if readable else ""
        if not line.startswith("READY "):
            self.stop_process(proc)
            raise NetlabError(f"backend not ready in time (got {line!r}); log:\n{log.read_text()}")
        served: dict[str, list[int]] = json.loads(line[len("READY ") :])
        return served

    def stop_backend(self, backend: Backend) -> None:
        self.stop_process(backend.proc)
        if backend in self.backends:
            self.backends.remove(backend)

    def connect(
        self,
        ref: NsRef,
        addr: str,
        port: int,
        proto: Proto = "tcp",
        count: int = 1,
        timeout: float = 1.0,
        src: str | None = None,
        sport: int | None = None,
        *,
        parallel: int = 1,
    ) -> list[ConnResult]:
        """Make ``count`` attempts from the namespace to addr:port, one client process per batch.

        ``timeout`` bounds each step of an attempt (connect, then reading the answer).
        ``parallel`` > 1 runs attempts concurrently, e.g. to keep a batch against dropped
        traffic short; a fixed ``sport`` forces sequential attempts.
        """
        argv = [
            *self._script_python,
            str(CLIENT_SCRIPT),
            addr,
            str(port),
            "--proto",
            proto,
            "--count",
            str(count),
            "--timeout",
            str(timeout),
            "--parallel",
            str(parallel),
        ]
        if src is not None:
            argv += ["--src", src]
        if sport is not None:
            argv += ["--sport", str(sport)]
        rounds = -(-count // max(1, 1 if sport else parallel))
        proc = self.run(ref, argv, timeout=rounds * 2 * timeout + CMD_TIMEOUT)
        results = [ConnResult.from_json(line) for line in proc.stdout.splitlines() if line]
        if len(results) != count:
            raise NetlabError(
                f"client printed {len(results)} results for {count} attempts:\n"
                f"{proc.stdout}{proc.stderr}"
            )
        return results

    def serve_http(self, ref: NsRef, ip: str, port: int, answer: str) -> HttpBackend:
        """An in-process backend in the namespace (testkit/inproc.py): answers each TCP
        connection on ip:port with an HTTP response whose body starts with `answer`. Threads
        of this process, stopped on close(); nothing of it outlives the process."""
        backend = HttpBackend(self.ns(ref).full, ip, port, answer)
        self._http.append(backend)
        return backend

    def probe_http(self, ref: NsRef, ip: str, port: int, count: int,
                   timeout: float = 1.0) -> Counter[str]:
        """`count` concurrent HTTP requests from the namespace to ip:port, from this process
        (testkit/inproc.py), counted by backend name or failure ("no answer", "refused"...)."""
        return http_probe(self.ns(ref).full, ip, port, count, timeout)

    def sctp_available(self, ref: NsRef) -> bool:
        """Whether the kernel lets this namespace open SCTP sockets (module present)."""
        code = "import socket; socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132).close()"
        return self.exec_python(ref, code, check=False).returncode == 0

    # -- standard topology ----------------------------------------------------------------------

    def standard_topology(
        self,
        backends: int | Sequence[str] = 2,
        tcp_ports: Sequence[int] = (8080,),
        udp_ports: Sequence[int] = (5353,),
        sctp_ports: Sequence[int] = (),
    ) -> Cluster:
        """Build the node / client / pods topology described in the module docstring.

        ``backends`` is a number of pods (named pod-a, pod-b, ...) or explicit pod names; each
        runs a backend named like its pod, serving the given ports.
        """
        return Cluster(self, backends, tcp_ports, udp_ports, sctp_ports)


# --------------------------------------------------------------------------------------------
# Standard topology
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Pod:
    """A pod namespace linked point-to-point to the node.

    ``gw4``/``gw6`` are the node's addresses on this link: the default gateway of the pod and
    the source address a backend sees when the node masquerades towards it.
    """

    name: str
    index: int
    ns: Netns
    ip4: str
    ip6: str
    gw4: str
    gw6: str
    node_if: str
    backend: Backend | None = None

    def addr(self, v6: bool = False) -> str:
        """The pod's address of one family (handy in tests parametrized over v6)."""
        return self.ip6 if v6 else self.ip4


class Cluster:
    """The standard topology: one node, one external client, backend pods and a client pod.

    Addresses (see the module docstring for the picture) are attributes, so tests never
    hard-code them: ``client_ip4``, ``node_ip4``, ``pods["pod-a"].ip4``, ``service_ip(10)``...
    """

    CLIENT_IP4 = "192.168.50.2"
    CLIENT_IP6 = "fd00:50::2"
    NODE_IP4 = "192.168.50.1"
    NODE_IP6 = "fd00:50::1"
    CLUSTER_CIDR4 = "10.244.0.0/16"
    CLUSTER_CIDR6 = "fd00:244::/48"
    SERVICE_CIDR4 = "10.96.0.0/16"
    SERVICE_CIDR6 = "fd00:96::/108"
    SERVICE_DEV = "kube-svc0"
    POD_CLIENT = "pod-client"

    def __init__(
        self,
        lab: Lab,
        backends: int | Sequence[str] = 2,
        tcp_ports: Sequence[int] = (8080,),
        udp_ports: Sequence[int] = (5353,),
        sctp_ports: Sequence[int] = (),
    ) -> None:
        self.lab = lab
        self.tcp_ports, self.udp_ports, self.sctp_ports = tcp_ports, udp_ports, sctp_ports
        self.client_ip4, self.client_ip6 = self.CLIENT_IP4, self.CLIENT_IP6
        self.node_ip4, self.node_ip6 = self.NODE_IP4, self.NODE_IP6
        self.cluster_cidr4, self.cluster_cidr6 = self.CLUSTER_CIDR4, self.CLUSTER_CIDR6
        self.service_cidr4, self.service_cidr6 = self.SERVICE_CIDR4, self.SERVICE_CIDR6
        self.node = lab.add_ns("node", router=True)
        self.client = lab.add_ns("client")
        self._wire_client()
        self._wire_services()
        self.pod_client = self._make_pod(self.POD_CLIENT, 0)
        self.pods: dict[str, Pod] = {}  # backend pods by name, in creation order
        self._next_index = 1
        if isinstance(backends, int):
            backends = [f"pod-{chr(ord('a') + i)}" for i in range(backends)]
        pods = [self.add_pod(name, backend=False) for name in backends]
        started = lab.start_backends(
            [(p.ns, p.name) for p in pods], tcp_ports, udp_ports, sctp_ports
        )
        for pod, backend in zip(pods, started, strict=True):
            pod.backend = backend

    def _wire_client(self) -> None:
        self.lab.link(
            self.client,
            self.node,
            [f"{self.client_ip4}/24", f"{self.client_ip6}/64"],
            [f"{self.node_ip4}/24", f"{self.node_ip6}/64"],
            if_a="eth0",
            if_b="eth0",
        )
        self.lab.add_route(self.client, "default", via=self.node_ip4)
        self.lab.add_route(self.client, "default", via=self.node_ip6)

    def _wire_services(self) -> None:
        self.lab.add_sink(self.node, self.SERVICE_DEV)
        self.lab.add_route(self.node, self.service_cidr4, dev=self.SERVICE_DEV, src=self.node_ip4)
        self.lab.add_route(self.node, self.service_cidr6, dev=self.SERVICE_DEV, src=self.node_ip6)

    def _make_pod(self, name: str, index: int) -> Pod:
        """Pod number `index` gets the index-th /24 and /64 of the cluster CIDRs: the node's end
        of the link is .1/::1, the pod .2/::2."""
        if not 0 <= index <= 255:
            raise NetlabError("pod index out of range (0..255)")
        base4 = ipaddress.ip_network(self.cluster_cidr4).network_address + (index << 8)
        base6 = ipaddress.ip_network(self.cluster_cidr6).network_address + (index << 64)
        ns = self.lab.add_ns(name)
        pod = Pod(
            name,
            index,
            ns,
            ip4=str(base4 + 2),
            ip6=str(base6 + 2),
            gw4=str(base4 + 1),
            gw6=str(base6 + 1),
            node_if=f"vpod{index}",
        )
        self.lab.link(
            ns,
            self.node,
            [f"{pod.ip4}/24", f"{pod.ip6}/64"],
            [f"{pod.gw4}/24", f"{pod.gw6}/64"],
            if_a="eth0",
            if_b=pod.node_if,
        )
        self.lab.add_route(ns, "default", via=pod.gw4)
        self.lab.add_route(ns, "default", via=pod.gw6)
        return pod

    # -- incremental changes --------------------------------------------------------------------

    def add_pod(self, name: str | None = None, *, backend: bool = True) -> Pod:
        """Add a backend pod to the running cluster (next free index), starting its backend
        unless backend=False."""
        index = self._next_index
        name = name or (f"pod-{chr(ord('a') + index - 1)}" if index <= 26 else f"pod-{index}")
        if name in self.pods:
            raise NetlabError(f"pod {name!r} exists")
        pod = self._make_pod(name, index)
        self._next_index += 1
        self.pods[name] = pod
        if backend:
            self.start_backend(name)
        return pod

    def start_backend(self, name: str) -> Backend:
        """(Re)start the backend of a pod with the cluster's ports."""
        pod = self.pods[name]
        if pod.backend is not None and pod.backend.alive:
            raise NetlabError(f"backend of {name} is running")
        pod.backend = self.lab.start_backend(
            pod.ns, name, self.tcp_ports, self.udp_ports, self.sctp_ports
        )
        return pod.backend

    def stop_backend(self, name: str) -> None:
        """Stop a pod's backend; the pod stays reachable, its ports now refuse."""
        pod = self.pods[name]
        if pod.backend is not None:
            pod.backend.stop()
            pod.backend = None

    @contextlib.contextmanager
    def answering_at(self, name: str, address: str) -> Iterator[Pod]:
        """Pod `name` answers at `address` too (added to its eth0, routed there from the node)
        until the block ends. Within the service CIDR this makes "forwarded un-DNATed" visible
        (the pod's backend answers) where the sink would swallow it like a drop."""
        pod = self.pods[name]
        six = ipaddress.ip_address(address).version == 6
        host = f"{address}/{128 if six else 32}"
        self.lab.add_addr(pod.ns, "eth0", host)
        try:
            self.lab.add_route(self.node, host, via=pod.ip6 if six else pod.ip4)
            try:
                yield pod
            finally:
                self.lab.ip(self.node, *(["-6"] if six else []), "route", "del", host)
        finally:
            self.lab.ip(pod.ns, "addr", "del", host, "dev", "eth0")

    def remove_pod(self, name: str) -> None:
        """Delete a pod namespace entirely (its address stops answering at all)."""
        pod = self.pods.pop(name)
        pod.backend = None
        self.lab.del_ns(pod.ns)

    # -- addresses ----------------------------------------------------------------------------

    def service_ip(self, n: int, v6: bool = False) -> str:
        """The n-th address of the service CIDR: service_ip(10) == "10.96.0.10",
        service_ip(10, v6=True) == "fd00:96::a"."""
        net = ipaddress.ip_network(self.service_cidr6 if v6 else self.service_cidr4)
        return str(net.network_address + n)

    def client_ip(self, v6: bool = False) -> str:
        return self.client_ip6 if v6 else self.client_ip4

    def node_ip(self, v6: bool = False) -> str:
        return self.node_ip6 if v6 else self.node_ip4

    def pod_ips(self, v6: bool = False) -> list[str]:
        """Addresses of the backend pods, in creation order."""
        return [p.addr(v6) for p in self.pods.values()]
