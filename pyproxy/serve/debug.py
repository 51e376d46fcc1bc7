"""The daemon's local debug endpoint: JSON over HTTP on a unix socket that only root can
open (directory 0700, socket 0600). The live CLI (`pyproxy status`, `services`, `explain`,
`trace`, `diff`, `history`) talks to it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

DEFAULT_SOCKET = "/run/pyproxy/pyproxy.sock"

# handler(query) → (HTTP status, JSON-serialisable body)
Handler = Callable[[Mapping[str, str]], tuple[int, Any]]


class DebugError(RuntimeError):
    """The daemon could not be asked, or answered with an error."""


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class DebugServer:
    def __init__(self, path: str, handlers: Mapping[str, Handler]) -> None:
        self.path = path
        directory = os.path.dirname(path) or "."
        # An existing directory is left as it is (it may be shared): the socket itself is
        # created 0600, which is what keeps it root-only.
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # a socket left by a previous run
        routes = dict(handlers)

        class RequestHandler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                handler = routes.get(url.path)
                if handler is None:
                    self._reply(404, {"error": f"unknown path {url.path}",
                                      "paths": sorted(routes)})
                    return
                try:
                    code, body = handler(dict(parse_qsl(url.query)))
                except ValueError as err:
                    code, body = 400, {"error": str(err)}
                except Exception as err:  # a debug request must never hurt the daemon
                    code, body = 500, {"error": f"{type(err).__name__}: {err}"}
                self._reply(code, body)

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def address_string(self) -> str:
                return "unix"

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        old_umask = os.umask(0o177)  # the socket is created 0600: root only
        try:
            self.server = _UnixHTTPServer(path, RequestHandler)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self.thread = threading.Thread(target=self.server.serve_forever, name="debug",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def ask(path: str, endpoint: str, timeout: float = 30.0, **query: object) -> Any:
    """GET an endpoint of the daemon's debug socket; raises DebugError."""
    params = {k: str(v) for k, v in query.items() if v is not None}
    target = endpoint + (f"?{urlencode(params)}" if params else "")
    conn = _UnixConnection(path, timeout)
    try:
        conn.request("GET", target)
        response = conn.getresponse()
        body = json.loads(response.read() or b"null")
    except FileNotFoundError:
        raise DebugError(f"no pyproxy daemon socket at {path} (is `pyproxy run` running "
                         "here, and with --debug-socket?)") from None
    except PermissionError:
        raise DebugError(f"permission denied on {path}: the debug socket is root-only") from None
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        raise DebugError(f"cannot talk to the daemon at {path}: {err}") from None
    finally:
        conn.close()
    if response.status != 200:
        message = body.get("error") if isinstance(body, dict) else body
        raise DebugError(f"daemon answered {response.status}: {message}")
    return body
