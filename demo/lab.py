"""The demo's namespace lab: network namespaces, veth links, routes and processes, all torn
down as a whole, plus in-process backends and clients.

Everything lives in namespaces named ``pyproxy-demo-<name>`` that this module creates; the
root namespace's ruleset, routes and sysctls are never touched. Only one demo runs at a time
(a lock file), so whatever namespaces of the demo exist when the lock is taken are leftovers
of a run that was killed: `sweep()` removes them (processes inside first).

Backends and clients are not processes: a helper thread enters a namespace (setns(2) changes
only the calling thread's namespace), opens a socket there and leaves; the socket stays in
that namespace whoever uses it afterwards. So the demo's own process serves every pod and
drives every client, and nothing of that can outlive it. The only child processes are the
pyproxy daemons (and short `ip`/`nft` commands); they get SIGTERM if the demo dies
(PR_SET_PDEATHSIG), and the sweep catches anything that still remains.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TypeVar

PREFIX = "pyproxy-demo-"
NETNS_DIR = Path("/run/netns")
LOCK_PATH = Path(tempfile.gettempdir()) / "pyproxy-demo.lock"
CMD_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)

T = TypeVar("T")

# Sysctls of every demo namespace (a fresh namespace's defaults partly follow the host's).
BASE_SYSCTLS = {
    "net.ipv6.conf.all.disable_ipv6": "1",  # the demo cluster is IPv4-only
    "net.ipv6.conf.default.disable_ipv6": "1",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
}
ROUTER_SYSCTLS = {"net.ipv4.ip_forward": "1"}


class LabError(RuntimeError):
    """A lab operation failed (the message carries the command and its stderr)."""


def sh(argv: Sequence[str], *, check: bool = True,
       timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"timed out after {timeout}s: {' '.join(argv)}") from exc
    if check and proc.returncode != 0:
        raise LabError(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc


def list_netns() -> list[str]:
    out = sh(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def delete_netns(full: str) -> None:
    """Kill what still runs inside one of our namespaces (by pid), then delete it."""
    def pids() -> list[int]:
        out = sh(["ip", "netns", "pids", full], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    for _ in range(5):
        found = pids()
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: not pids(), timeout=1.0)
    sh(["ip", "netns", "del", full], check=False)


# --------------------------------------------------------------------------------------------
# One demo at a time, and the leftovers of a killed one


class Locked(RuntimeError):
    """Another demo is running."""


@contextlib.contextmanager
def single_instance() -> Iterator[None]:
    """Hold the demo's lock file for the duration (removed again on the way out; the inode
    check makes removing it safe against a run that opened it just before)."""
    while True:
        fh = open(LOCK_PATH, "a+")  # noqa: SIM115 - held for the whole run
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            other = fh.read().strip() or "?"
            fh.close()
            raise Locked(f"another pyproxy demo is running (pid {other}; lock {LOCK_PATH})") \
                from None
        try:
            current = os.stat(LOCK_PATH).st_ino
        except FileNotFoundError:
            current = -1
        if current == os.fstat(fh.fileno()).st_ino:
            break
        fh.close()  # the previous holder removed it meanwhile: lock the new file
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(LOCK_PATH)
        fh.close()


def sweep(short_names: Iterable[str]) -> list[str]:
    """Remove the namespaces (and temp dirs) a killed earlier demo left. Call with the lock
    held. Only the demo's own names are considered, nobody else's namespaces."""
    ours = {PREFIX + n for n in short_names}
    removed = [name for name in list_netns() if name in ours]
    for name in removed:
        delete_netns(name)
    for workdir in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if workdir.is_dir():
            shutil.rmtree(workdir, ignore_errors=True)
            removed.append(str(workdir))
    return removed


# --------------------------------------------------------------------------------------------
# Entering a namespace from a thread


def in_netns(full: str, fn: Callable[[], T]) -> T:
    """Run fn in a short-lived thread that has entered namespace `full` (setns affects only
    the calling thread). Sockets fn opens stay in that namespace."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(NETNS_DIR / full, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns {full}: {os.strerror(code)}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{full}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# The lab


class Lab:
    """Namespaces, links and daemons, torn down as a whole by close() (idempotent)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.namespaces: list[str] = []  # full names, in creation order
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.stop = threading.Event()  # backends watch it
        self._ifindex = 1000

    @staticmethod
    def full(name: str) -> str:
        return PREFIX + name

    def add_ns(self, name: str, *, router: bool = False) -> str:
        full = self.full(name)
        sh(["ip", "netns", "add", full])
        self.namespaces.append(full)  # registered at once: close() removes it whatever happens
        self.ip(name, "link", "set", "lo", "up")
        self.sysctl(name, {**BASE_SYSCTLS, **(ROUTER_SYSCTLS if router else {})})
        return full

    def sysctl(self, name: str, values: dict[str, str]) -> None:
        """Set sysctls of the namespace (from a thread inside it: /proc/sys/net is the opening
        thread's namespace's). IPv6 keys are skipped on a kernel without IPv6."""
        def write() -> None:
            for key, value in values.items():
                path = Path("/proc/sys") / key.replace(".", "/")
                if key.startswith("net.ipv6.") and not path.exists():
                    continue
                path.write_text(value)

        in_netns(self.full(name), write)

    def ip(self, name: str, *args: str) -> None:
        sh(["ip", "-n", self.full(name), *args])

    def run(self, name: str, argv: Sequence[str], *, check: bool = True,
            timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return sh(["ip", "netns", "exec", self.full(name), *argv], check=check, timeout=timeout)

    def link(self, a: str, if_a: str, b: str, if_b: str) -> None:
        """A veth pair created inside `a` with its peer inside `b` (never in the root
        namespace). Distinct explicit ifindexes: two fresh namespaces would give both ends the
        same index, which delays the carrier by up to a second."""
        self._ifindex += 2
        self.ip(a, "link", "add", if_a, "index", str(self._ifindex), "type", "veth",
                "peer", "name", if_b, "netns", self.full(b), "index", str(self._ifindex + 1))
        self.ip(a, "link", "set", if_a, "up")
        self.ip(b, "link", "set", if_b, "up")

    def wait_links_up(self, timeout: float = 5.0) -> None:
        """Every veth in the lab operationally up (bounded)."""
        def all_up() -> bool:
            for full in self.namespaces:
                out = sh(["ip", "-n", full, "-j", "link", "show", "type", "veth"]).stdout
                if any(dev.get("operstate") != "UP" for dev in json.loads(out or "[]")):
                    return False
            return True

        if not _wait_until(all_up, timeout):
            raise LabError(f"links not up after {timeout}s")

    # -- daemons ---------------------------------------------------------------------------

    def popen(self, name: str, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """A long-running process in the namespace, output to a log in the workdir. It is in
        its own session (a Ctrl-C reaches only the demo, which then stops it in order) and
        gets SIGTERM should the demo die."""
        log = open(self.workdir / log_name, "ab")  # noqa: SIM115 - closed in close()
        self.logs.append(log)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.full(name), *argv], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def close(self) -> int:
        """Stop everything and delete the namespaces; returns how many were deleted."""
        self.stop.set()
        for proc in self.procs:  # everybody at once, so they stop in parallel
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_TIMEOUT)
        self.procs.clear()
        deleted = len(self.namespaces)
        for full in reversed(self.namespaces):
            with contextlib.suppress(Exception):
                delete_netns(full)
        self.namespaces.clear()
        for log in self.logs:
            with contextlib.suppress(OSError):
                log.close()
        self.logs.clear()
        return deleted

    # -- backends ---------------------------------------------------------------------------

    def serve(self, name: str, ip: str, port: int, answer: str) -> None:
        """A backend in namespace `name`: answers each TCP connection on ip:port with an HTTP
        response whose body starts with `answer` (so `curl` works too)."""

        def listen() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port))
            sock.listen(256)
            sock.settimeout(0.2)
            return sock

        listener = in_netns(self.full(name), listen)
        threading.Thread(target=self._accept_loop, args=(listener, answer),
                         name=f"backend-{name}", daemon=True).start()

    def _accept_loop(self, listener: socket.socket, answer: str) -> None:
        with listener:
            while not self.stop.is_set():
                try:
                    conn, peer = listener.accept()
                except (TimeoutError, BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError:
                    return
                threading.Thread(target=_answer, args=(conn, peer, answer), daemon=True).start()


def _die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _answer(conn: socket.socket, peer: tuple[str, int], answer: str) -> None:
    with conn:
        conn.settimeout(2.0)
        request = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                request += chunk
        body = f"{answer} (client {peer[0]}:{peer[1]})\n".encode()
        head = (f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}"
                "\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(OSError):
            conn.sendall(head + body)


# --------------------------------------------------------------------------------------------
# Clients

ERRORS = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable",
          errno.ENETUNREACH: "unreachable", errno.ECONNRESET: "reset", errno.EPIPE: "reset"}
REQUEST = b"GET / HTTP/1.0\r\nHost: demo\r\n\r\n"


def probe(full: str, ip: str, port: int, count: int, timeout: float = 1.0) -> Counter[str]:
    """`count` concurrent HTTP requests from namespace `full` to ip:port, counted by the name
    in the answer; failures count as "no answer" (silently dropped), "refused", ...."""

    def run() -> Counter[str]:
        sel = selectors.DefaultSelector()
        results: Counter[str] = Counter()
        pending: dict[socket.socket, bytearray] = {}
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((ip, port))
            if code not in (0, errno.EINPROGRESS):
                results[ERRORS.get(code, errno.errorcode.get(code, str(code)))] += 1
                sock.close()
                continue
            pending[sock] = bytearray()
            sel.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                outcome = _step(sel, conn, pending[conn])
                if outcome is not None:
                    results[outcome] += 1
                    sel.unregister(conn)
                    conn.close()
                    del pending[conn]
        for sock in pending:
            results["no answer"] += 1
            sock.close()
        sel.close()
        return results

    return in_netns(full, run)


def _step(sel: selectors.BaseSelector, sock: socket.socket, buf: bytearray) -> str | None:
    """Advance one client connection; returns its outcome once known."""
    try:
        if sel.get_key(sock).events & selectors.EVENT_WRITE:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                return ERRORS.get(code, errno.errorcode.get(code, str(code)))
            sock.sendall(REQUEST)
            sel.modify(sock, selectors.EVENT_READ)
            return None
        chunk = sock.recv(4096)
    except OSError as exc:
        return ERRORS.get(exc.errno or 0, f"error {exc.errno}")
    if chunk:
        buf += chunk
        return None
    _head, _, body = bytes(buf).partition(b"\r\n\r\n")
    return body.split(maxsplit=1)[0].decode() if body.strip() else "empty answer"
