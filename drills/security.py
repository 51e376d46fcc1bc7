"""The daemon's surfaces: the debug socket, the health server, the metrics server."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from typing import Any

from drills.harness import NODE, Daemon, Env, Result, running, web, write_snapshot
from testkit.builders import make_node


def security(env: Env) -> Result:
    r = Result("security", "debug socket permissions, health server surface, metrics bind "
               "address")
    from pyproxy.config import ProxyConfig
    from pyproxy.serve.debug import DebugServer

    defaults = ProxyConfig()
    r.check(defaults.metrics_bind_address == "127.0.0.1:10249",
            f"ProxyConfig() metrics default {defaults.metrics_bind_address}")
    r.check(defaults.debug_socket == "/run/pyproxy/pyproxy.sock", "debug socket default")
    r.figures["ProxyConfig() defaults"] = (f"metrics {defaults.metrics_bind_address}, healthz "
                                           f"{defaults.healthz_bind_address}")
    # Parents everybody may traverse, so that only the daemon's own directory and socket
    # stand between an unprivileged user and the socket (otherwise the check is vacuous).
    parent = env.workdir / "sec"
    parent.mkdir()
    for p in (env.workdir, parent):
        p.chmod(0o755)
    blocked = [str(p) for p in parent.parents if not p.stat().st_mode & 0o001]
    r.check(not blocked, f"parents not traversable by others: {blocked}")
    sock = parent / "run" / "pyproxy.sock"
    path = env.workdir / "security.yaml"
    write_snapshot(path, [make_node(NODE, "zone-1"), *web(env, ["pod-a"])])
    # No --healthz/--metrics flags: the default bind addresses.
    daemon = Daemon(env, ["--snapshot", str(path)], "security", servers=False,
                    socket_path=str(sock))
    with running(daemon):
        daemon.wait_ready()
        info = sock.stat()
        mode, dmode = stat.S_IMODE(info.st_mode), stat.S_IMODE(sock.parent.stat().st_mode)
        r.check(stat.S_ISSOCK(info.st_mode) and mode == 0o600, f"socket mode {mode:o}")
        r.check(dmode == 0o700, f"socket directory mode {dmode:o}")
        r.check(info.st_uid == 0 and sock.parent.stat().st_uid == 0, "not owned by root")
        r.figures["debug socket"] = f"{mode:04o}, directory {dmode:04o}, owner root"
        outcome = unprivileged_connect(str(sock))
        r.figures["unprivileged connect"] = outcome
        r.check(outcome.startswith("denied"), f"unprivileged user: {outcome}")
        r.check(daemon.status()["initialized"], "root cannot use the debug socket")

        listeners = env.cluster.node.run(["ss", "-Hltnp"]).stdout
        addresses = sorted(line.split()[3] for line in listeners.splitlines()
                           if f"pid={daemon.proc.pid}," in line)
        r.figures["listening (default flags, ss -ltn in the node namespace)"] = addresses
        r.check("127.0.0.1:10249" in addresses, f"metrics not on loopback: {addresses}")
        r.check(not [a for a in addresses if a.endswith(":10249")
                     and not a.startswith("127.0.0.1:")], "metrics on a non-loopback address")
        r.check(addresses == ["0.0.0.0:10256", "127.0.0.1:10249"],
                f"unexpected listeners {addresses}")
        health_surface(r, env, daemon)

    # The socket is 0600 even where its directory exists already with looser permissions
    # (e.g. created by someone else before the daemon started).
    loose = parent / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    server = DebugServer(str(loose / "pyproxy.sock"), {})
    try:
        lmode = stat.S_IMODE((loose / "pyproxy.sock").stat().st_mode)
        r.check(lmode == 0o600, f"socket in a pre-existing 0755 directory: {lmode:o}")
        outcome = unprivileged_connect(str(loose / "pyproxy.sock"))
        r.figures["unprivileged connect, directory pre-existing 0755"] = outcome
        r.check(outcome.startswith("denied"), f"unprivileged user: {outcome}")
    finally:
        server.server.server_close()
    env.cleanup()
    return r


def unprivileged_connect(path: str) -> str:
    """Connect to a unix socket as nobody (setpriv), report what happened."""
    code = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
            "try:\n s.connect(sys.argv[1]); print('connected')\n"
            "except PermissionError as e: print('denied', e.strerror)\n"
            "except OSError as e: print('error', e.strerror)\n")
    python = sys.executable
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
            python, "-I", "-S", "-c", code, path]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        return _setuid_connect(path)
    return (out.stdout.strip() or out.stderr.strip())[:120]


def _setuid_connect(path: str) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                msg = "connected"
            except PermissionError as err:
                msg = f"denied {err.strerror}"
            except OSError as err:
                msg = f"error {err.strerror}"
        except BaseException as err:
            msg = f"error {err}"
        os.write(write, msg.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        msg = fh.read()
    os.waitpid(pid, 0)
    return msg


KUBE_PROXY_HEALTHZ_FIELDS = {"lastUpdated", "currentTime", "nodeEligible", "healthy", "status"}


def health_surface(r: Result, env: Env, daemon: Daemon) -> None:
    """Only /healthz and /livez answer; bodies hold kube-proxy's fields and nothing else;
    no Server header; odd requests get 4xx without details."""
    address = "127.0.0.1:10256"
    code, headers, body = env.http_get(f"http://{address}/healthz")
    data = json.loads(body)
    r.check(code == 200, f"/healthz {code}")
    r.check(set(data) <= KUBE_PROXY_HEALTHZ_FIELDS, f"/healthz fields {sorted(data)}")
    r.check(all(set(v) <= {"lastUpdated", "healthy"} for v in data.get("status", {}).values()),
            f"/healthz status fields {data.get('status')}")
    r.check("Server" not in headers, f"Server header: {headers.get('Server')}")
    code, _, body = env.http_get(f"http://{address}/livez")
    r.check(code == 200 and "nodeEligible" not in json.loads(body), "/livez")
    leaks = ["node-a", "10.96.", "10.244.", "192.168.50", "pyproxy", "Python", "BaseHTTP"]
    probes = ["/", "/metrics", "/debug/pprof/", "/configz", "/healthz/../metrics", "/status",
              "/%2e%2e/etc/passwd", "//healthz", "/livez/x", "/HEALTHZ", "/" + "a" * 5000]
    answers: dict[str, Any] = {}
    for path in probes:
        code, headers, body = env.http_get(f"http://{address}{path}")
        answers[path[:20]] = code
        # "//healthz" is /healthz after path cleaning (Go redirects it, Python serves it).
        allowed = (404, 414) if path != "//healthz" else (200, 301, 404)
        r.check(code in allowed, f"{path[:30]}: {code}")
        text = body.decode(errors="replace")
        r.check(not [w for w in leaks if w in text], f"{path[:30]} leaks: {text[:100]}")
        r.check("Server" not in headers, f"{path[:30]}: Server header")
    raw = {
        "POST": b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
        "long header": b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
        "absolute URI": b"GET http://evil.example/healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        "HTTP/0.9": b"GET /healthz\r\n",
    }
    for label, request in raw.items():
        try:
            answer = env.raw_http(address, request)
        except OSError as err:
            answer = f"({type(err).__name__})".encode()
        text = answer.decode(errors="replace")
        status = text.split("\r\n", 1)[0][:40]
        answers[label] = status
        r.check(not [w for w in leaks if w in text], f"{label} leaks: {text[:200]}")
        r.check("Server:" not in text, f"{label}: Server header in {text[:200]}")
    r.figures["health server answers"] = answers
    r.check(daemon.alive, "daemon died from odd health requests")
    code, _, _ = env.http_get(f"http://{address}/healthz")
    r.check(code == 200, "health server broken after odd requests")
