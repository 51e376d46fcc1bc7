"""HTTP front end of the emulator: kube-apiserver paths, list/watch protocol, test hooks.

One `ThreadingHTTPServer` thread accepts connections; each connection gets its own handler
thread (HTTP/1.1 keep-alive, like the connection pool of the real client). A watch holds its
connection's thread for the life of the stream and writes one JSON event per chunk.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import queue
import select
import socket
import socketserver
import ssl
import struct
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs, urlsplit

from testkit import protoenc

from . import resources as R
from .store import MERGE_PATCH, ApiError, Filter, Store, Watcher, bad_request, too_large_rv

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration

__all__ = ["ApiEmulator", "RequestRecord", "UnavailableMode"]

Obj = dict[str, Any]
UnavailableMode = Literal["503", "reset", "refuse"]
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # Go's strconv.ParseBool
GZIP_THRESHOLD = 128 * 1024  # kube-apiserver's defaultGzipThresholdBytes
_PROTOBUF = "application/vnd.kubernetes.protobuf"
_VERSION = {
    "major": "1",
    "minor": "34",
    "gitVersion": "v1.34.0-apiemu",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


@dataclass(frozen=True)
class RequestRecord:
    """One served request, for assertions such as "relisted after 410"."""

    method: str
    path: str
    query: Mapping[str, str]
    verb: str  # get/list/watch/create/update/patch/delete, or the lower-case method elsewhere
    resource: str | None
    namespace: str | None
    name: str | None
    status: int


@dataclass(frozen=True)
class Route:
    resource: R.ResourceDef
    namespace: str | None
    name: str | None
    subresource: str | None
    legacy_watch: bool = False


@dataclass
class _WatchOptions:
    since: int | None
    timeout: float | None
    bookmarks: bool
    send_initial: bool


# --- routing ---------------------------------------------------------------------------------


def _group_version(segments: list[str]) -> tuple[str, list[str]] | None:
    """Split ``/api/v1/...`` or ``/apis/<group>/<version>/...`` into (groupVersion, rest)."""
    if len(segments) >= 2 and segments[0] == "api":
        return segments[1], segments[2:]
    if len(segments) >= 3 and segments[0] == "apis":
        return f"{segments[1]}/{segments[2]}", segments[3:]
    return None


def route(path: str) -> Route | None:
    segments = [s for s in path.split("/") if s]
    split = _group_version(segments)
    if split is None or not split[1]:
        return None
    group_version, rest = split
    legacy_watch = rest[0] == "watch"  # deprecated /api/v1/watch/... form
    if legacy_watch:
        rest = rest[1:]
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    res = R.RESOURCES.get(rest[0])
    if res is None or res.api_version != group_version:
        return None
    if namespace is not None and not res.namespaced:
        return None
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub is not None and (sub != "status" or not res.has_status):
        return None
    if name is None and res.namespaced is False and namespace is not None:
        return None
    if name is not None and res.namespaced and namespace is None:
        return None  # namespaced objects are only addressable through their namespace
    return Route(res, namespace, name, sub, legacy_watch)


def _discovery(path: str, server_address: str) -> Obj | None:
    path = path.rstrip("/") or "/"
    if path == "/version":
        return dict(_VERSION)
    if path == "/api":
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
            ],
        }
    if path == "/apis":
        groups = [R.api_group(g) for g in R.group_names()]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    if path == "/api/v1":
        return R.api_resource_list("v1")
    for group in R.group_names():
        if path == f"/apis/{group}":
            return {"kind": "APIGroup", "apiVersion": "v1", **R.api_group(group)}
        if path == f"/apis/{group}/v1":
            return R.api_resource_list(f"{group}/v1")
    return None


def _verb(method: str, rt: Route, query: Mapping[str, str]) -> str:
    if method == "GET":
        if rt.legacy_watch or query.get("watch") in _TRUE:
            return "watch"
        return "get" if rt.name else "list"
    if method == "DELETE" and rt.name is None:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


# --- the request handler ---------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _record: dict[str, Any]  # set per request, consumed by send_response
    _body: bytes

    # Plumbing

    def setup(self) -> None:
        super().setup()
        # Go's net/http disables Nagle too; without this a small event can sit for 40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.emu._track_connection(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.emu._track_connection(self.connection, add=False)

    @property
    def emu(self) -> ApiEmulator:
        return self.server.emulator

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests are recorded in ApiEmulator.requests instead of spamming stderr

    def send_response(self, code: int, message: str | None = None) -> None:
        record = getattr(self, "_record", None)
        if record is not None:
            self.emu._log_request(RequestRecord(status=code, **record))
            del self._record
        super().send_response(code, message)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_PATCH(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    # Responses

    def _send_json(self, code: int, body: Any, extra: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        # As kube-apiserver (APIResponseCompression): a response above 128 KiB is gzipped
        # (level 1) for a client that accepts it.
        gzipped = (len(data) > GZIP_THRESHOLD
                   and "gzip" in (self.headers.get("Accept-Encoding") or ""))
        if gzipped:
            data = gzip.compress(data, compresslevel=1)
            self.emu._gzipped += 1
        self.send_response(code)
        # As kube-apiserver, on every answer: the audit ID and the priority-and-fairness
        # UIDs (the client prints every header before the body of an error).
        self.send_header("Audit-Id", str(uuid.uuid4()))
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Kubernetes-Pf-Flowschema-Uid", self.emu._flow_schema_uid)
        self.send_header("X-Kubernetes-Pf-Prioritylevel-Uid", self.emu._priority_level_uid)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        extra = {}
        if err.code in (429, 503, 504) and err.details and "retryAfterSeconds" in err.details:
            extra["Retry-After"] = str(err.details["retryAfterSeconds"])
        self._send_json(err.code, err.status(), extra)

    def _send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # Request parsing

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked_body()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _read_chunked_body(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()  # the empty line after the last chunk (no trailers)
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _json_body(self, required: bool) -> Any:
        raw = self._body
        if not raw:
            if required:
                raise bad_request("the request body is empty")
            return None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad_request(f"error decoding request body: {exc}") from exc

    # Dispatch

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        rt = route(parts.path)
        verb = _verb(self.command, rt, query) if rt else self.command.lower()
        self._record = {
            "method": self.command,
            "path": parts.path,
            "query": query,
            "verb": verb,
            "resource": rt.resource.plural if rt else None,
            "namespace": rt.namespace if rt else None,
            "name": rt.name if rt else None,
        }
        # Read the body before anything can fail: an unread body would be parsed as the next
        # request on this keep-alive connection.
        self._body = self._read_body()
        try:
            self._serve(parts.path, rt, verb, query)
        except ApiError as err:
            self._fail(err)
        except OSError:  # the client, or a test hook, closed the connection under us
            self.close_connection = True
        except Exception as exc:  # a bug in the emulator: report it, keep serving
            self.emu._note_error(exc)
            self._fail(ApiError(500, "InternalError", f"apiemu bug: {exc!r}"))

    def _fail(self, err: ApiError) -> None:
        if hasattr(self, "_record"):
            self._send_error(err)
        else:  # a response (e.g. a watch stream) is already under way: all we can do is cut it
            self.close_connection = True

    def _serve(self, path: str, rt: Route | None, verb: str, query: Mapping[str, str]) -> None:
        if not self.emu.available:
            # No Retry-After: urllib3 would honour it and sleep through its 3 retries.
            raise ApiError(
                503, "ServiceUnavailable", "the server is currently unable to handle the request"
            )
        if rt is not None and self.emu.forbidden_user is not None:
            raise _forbidden(self.emu.forbidden_user, verb, rt)
        if rt is None or rt.resource.plural in self.emu.unserved:
            self._serve_non_resource(path)
            return
        if query.get("dryRun"):
            raise bad_request("apiemu does not implement dryRun")
        handler = {
            "get": self._get,
            "list": self._list,
            "watch": self._watch,
            "create": self._create,
            "update": self._update,
            "patch": self._patch,
            "delete": self._delete,
        }.get(verb)
        if handler is None:
            raise _not_allowed()
        handler(rt, query)

    def _serve_non_resource(self, path: str) -> None:
        if self.command != "GET":
            raise _not_allowed()
        if path.rstrip("/") in ("/healthz", "/livez", "/readyz"):
            self._send_text(200, "ok")
            return
        doc = _discovery(path, f"{self.server.server_name}:{self.server.server_port}")
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        self._send_json(200, doc)

    # Verbs

    def _get(self, rt: Route, query: Mapping[str, str]) -> None:
        assert rt.name is not None
        obj = self.emu.store.get(rt.resource, rt.namespace, rt.name)
        self._send_json(200, rt.resource.typed(obj))

    def _list(self, rt: Route, query: Mapping[str, str]) -> None:
        flt = Filter.parse(
            rt.resource, rt.namespace, query.get("labelSelector"), query.get("fieldSelector")
        )
        self._wait_for_requested_rv(query.get("resourceVersion"))
        limit = _int_param(query, "limit")
        token = query.get("continue") or None
        result = self.emu.store.list_objects(flt, limit=limit, continue_token=token)
        meta: Obj = {"resourceVersion": result.resource_version}
        if result.continue_token:
            meta["continue"] = result.continue_token
        if result.remaining is not None:
            meta["remainingItemCount"] = result.remaining
        # Items carry no kind/apiVersion, exactly like the real server's typed lists.
        body = {
            "kind": rt.resource.list_kind,
            "apiVersion": rt.resource.api_version,
            "metadata": meta,
            "items": result.items,
        }
        self._send_json(200, body)

    def _wait_for_requested_rv(self, raw: str | None) -> None:
        wanted = _parse_rv(raw)
        if wanted is None:
            return
        store = self.emu.store
        if not store.wait_for_rv(wanted, self.emu.too_large_rv_wait):
            raise too_large_rv(wanted, store.resource_version)

    def _create(self, rt: Route, query: Mapping[str, str]) -> None:
        if rt.name is not None:
            raise _not_allowed()
        obj = self.emu.store.create(rt.resource, rt.namespace, self._json_body(True), http=True)
        self._send_json(201, rt.resource.typed(obj))

    def _update(self, rt: Route, query: Mapping[str, str]) -> None:
        assert rt.name is not None
        body = self._json_body(True)
        created, obj = self.emu.store.replace(
            rt.resource, rt.namespace, rt.name, body, http=True, subresource=rt.subresource
        )
        self._send_json(201 if created else 200, rt.resource.typed(obj))

    def _patch(self, rt: Route, query: Mapping[str, str]) -> None:
        assert rt.name is not None
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip()
        body = self._json_body(True)
        obj = self.emu.store.patch(
            rt.resource, rt.namespace, rt.name, content_type, body, subresource=rt.subresource
        )
        self._send_json(200, rt.resource.typed(obj))

    def _delete(self, rt: Route, query: Mapping[str, str]) -> None:
        assert rt.name is not None
        if rt.subresource:
            raise _not_allowed()
        options = self._json_body(False) or {}
        pre = options.get("preconditions") if isinstance(options, dict) else None
        obj = self.emu.store.delete(rt.resource, rt.namespace, rt.name, pre)
        if rt.resource.returns_deleted_object:
            self._send_json(200, rt.resource.typed(obj))
            return
        details: Obj = {"name": rt.name}
        if rt.resource.group:
            details["group"] = rt.resource.group
        details |= {"kind": rt.resource.plural, "uid": obj["metadata"]["uid"]}
        self._send_json(
            200,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": details,
            },
        )

    # Watch

    def _watch(self, rt: Route, query: Mapping[str, str]) -> None:
        fields = query.get("fieldSelector")
        if rt.name is not None:  # legacy /watch/.../{name}: a watch on one object
            term = f"metadata.name={rt.name}"
            fields = f"{fields},{term}" if fields else term
        flt = Filter.parse(rt.resource, rt.namespace, query.get("labelSelector"), fields)
        opts = self._watch_options(query)
        if opts.send_initial:  # "NotOlderThan" the given RV: the snapshot must have reached it
            self._wait_for_requested_rv(query.get("resourceVersion"))
        watcher = Watcher(flt, self.emu.watch_queue_size, self.connection)
        stream = _WatchStream(self, watcher, opts)
        stream.serve()

    def _watch_options(self, query: Mapping[str, str]) -> _WatchOptions:
        send_initial = query.get("sendInitialEvents") in _TRUE
        if send_initial and not self.emu.watch_list:
            raise ApiError(422, "Invalid", "sendInitialEvents: Forbidden: sendInitialEvents is "
                           "forbidden for watch unless the WatchList feature gate is enabled")
        bookmarks = query.get("allowWatchBookmarks") in _TRUE
        if send_initial and (query.get("resourceVersionMatch") != "NotOlderThan" or not bookmarks):
            raise ApiError(
                422,
                "Invalid",
                "sendInitialEvents requires resourceVersionMatch=NotOlderThan "
                "and allowWatchBookmarks=true",
            )
        timeout = _int_param(query, "timeoutSeconds")
        return _WatchOptions(
            since=None if send_initial else _parse_rv(query.get("resourceVersion")),
            timeout=float(timeout) if timeout else self.emu.default_watch_timeout,
            bookmarks=bookmarks,
            send_initial=send_initial,
        )


def _int_param(query: Mapping[str, str], name: str) -> int | None:
    raw = query.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw or "")
    except ValueError as exc:
        raise bad_request(f"{name}: Invalid value: {raw!r}: must be an integer") from exc


def _parse_rv(raw: str | None) -> int | None:
    """resourceVersion query value: absent/""/"0" mean "any" (None); else a positive integer."""
    if raw in (None, "", "0"):
        return None
    try:
        value = int(raw or "")
    except ValueError as exc:
        raise bad_request(f'resourceVersion: Invalid value: "{raw}": must be an integer') from exc
    if value < 0:
        raise bad_request(f'resourceVersion: Invalid value: "{raw}": must be non-negative')
    return value


class _WatchStream:
    """Writes one watch: chunked 200 response, initial events, then live events/bookmarks.

    Ends in one of three ways: cleanly (terminating chunk; timeoutSeconds, queue overflow),
    abruptly (`drop_connections`, `set_available(False)`, `stop`), or because the client went
    away (noticed on a failed write or an EOF on the socket while idle).
    """

    def __init__(self, handler: _Handler, watcher: Watcher, opts: _WatchOptions) -> None:
        self.h = handler
        self.emu = handler.emu
        self.watcher = watcher
        self.opts = opts
        self.res = watcher.resource
        # A protobuf watch, as the API server answers one that asks (for the kinds the
        # tests' encoder writes: testkit/protoenc.py); JSON otherwise.
        accept = handler.headers.get("Accept") or ""
        self.protobuf = (accept.startswith(_PROTOBUF) and self.res.kind in protoenc.ENCODERS)

    def serve(self) -> None:
        try:
            initial, snapshot_rv = self._start()
        except ApiError as err:
            # After parameters are accepted, upstream reports even 410/504 as an ERROR event
            # inside a 200 stream (the client library depends on this).
            self._begin()
            self._write({"type": "ERROR", "object": err.status()})
            self._end()
            return
        try:
            self._begin()
            outcome = self._pump(initial, snapshot_rv)
        except OSError:
            outcome = "gone"
        finally:
            self.emu.store.stop_watch(self.watcher)
        if outcome == "end":
            with contextlib.suppress(OSError):
                self._end()
        else:
            self.h.close_connection = True
            with contextlib.suppress(OSError):
                self.h.connection.shutdown(socket.SHUT_RDWR)

    def _start(self) -> tuple[list[tuple[str, Obj]], int]:
        since = self.opts.since
        store = self.emu.store
        too_new = since is not None and since > store.resource_version
        if too_new and not store.wait_for_rv(since or 0, self.emu.too_large_rv_wait):
            raise too_large_rv(since or 0, store.resource_version)
        started = store.start_watch(self.watcher, since)
        self.emu._check_watch_allowed(self.watcher)
        return started

    def _begin(self) -> None:
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type",
                      f"{_PROTOBUF};stream=watch" if self.protobuf else "application/json")
        h.send_header("Cache-Control", "no-cache, private")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

    def _write(self, event: Obj) -> None:
        if self.protobuf:
            data = protoenc.event_frame(event, self.res.api_version, self.res.kind)
        else:
            data = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _end(self) -> None:
        self.h.wfile.write(b"0\r\n\r\n")

    def _event(self, etype: str, obj: Obj) -> Obj:
        return {"type": etype, "object": self.res.typed(obj)}

    def _bookmark(self, rv: int, initial_end: bool = False) -> Obj:
        meta: Obj = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        obj = {"kind": self.res.kind, "apiVersion": self.res.api_version, "metadata": meta}
        return {"type": "BOOKMARK", "object": obj}

    def _stopped(self) -> bool:
        return self.watcher.aborted.is_set() or self.emu._stopping.is_set()

    def _hold_while_stalled(self) -> bool:
        """Block while watches are stalled; False if the stream was aborted meanwhile."""
        while self.emu.stalled:
            if self._stopped():
                return False
            time.sleep(self.emu.poll_interval)
        return not self._stopped()

    def _send(self, event: Obj) -> bool:
        if not self._hold_while_stalled():
            return False
        self._write(event)
        return True

    def _pump(self, initial: list[tuple[str, Obj]], snapshot_rv: int) -> str:
        for etype, obj in initial:
            if not self._send(self._event(etype, obj)):
                return "abort"
        if self.opts.send_initial and not self._send(self._bookmark(snapshot_rv, initial_end=True)):
            return "abort"
        return self._live()

    def _live(self) -> str:
        interval = self.emu.bookmark_interval
        deadline = time.monotonic() + self.opts.timeout if self.opts.timeout else None
        next_bookmark = time.monotonic() + interval
        while True:
            if not self._hold_while_stalled():
                return "abort"
            now = time.monotonic()
            if self.watcher.overflowed.is_set() or (deadline is not None and now >= deadline):
                return "end"
            if self.opts.bookmarks and now >= next_bookmark:
                rv = self.emu.store.bookmark_rv(self.watcher)
                if rv is not None:
                    self._write(self._bookmark(rv))
                    next_bookmark = now + interval
            wait = self.emu.poll_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - now))
            try:
                event = self.watcher.queue.get(timeout=wait)
            except queue.Empty:  # idle tick
                if self._client_gone():
                    return "gone"
                continue
            translated = self.watcher.translate(event)
            if translated is not None and not self._send(self._event(*translated)):
                return "abort"

    def _client_gone(self) -> bool:
        """An idle watch only learns that the client hung up by seeing EOF on the socket."""
        sock = self.h.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if isinstance(sock, ssl.SSLSocket):  # no peeking under TLS; a watch's client
                return bool(readable)            # sends nothing but its close
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


# --- the server ------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with tracked (joinable) connection threads and no reverse DNS."""

    daemon_threads = True
    block_on_close = False  # ApiEmulator.stop joins the threads itself, with a deadline

    def __init__(self, address: tuple[str, int], emulator: ApiEmulator) -> None:
        self.emulator = emulator
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse lookup that can hang offline.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def get_request(self) -> tuple[Any, Any]:
        request, client_address = super().get_request()
        if self.emulator.tls is not None:
            # The handshake is the connection thread's (a client that fails it must not
            # hold up the accepting one).
            request = self.emulator.tls.wrap_socket(request, server_side=True,
                                                    do_handshake_on_connect=False)
        return request, client_address

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if self.emulator._unavailable_mode == "reset":
            # Abortive close: linger 0 makes close() send RST, as a crashing server would.
            request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.emulator._rejected += 1
            return False
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name=f"apiemu-conn-{client_address[1]}",
            daemon=True,
        )
        self.emulator._track_thread(thread, add=True)
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            if isinstance(request, ssl.SSLSocket):
                request.do_handshake()  # a client refusing the certificate ends it here
            self.finish_request(request, client_address)
        except (ConnectionError, OSError):
            pass  # the client or a test hook closed the socket
        except Exception as exc:
            self.emulator._note_error(exc)
        finally:
            self.shutdown_request(request)
            self.emulator._track_thread(threading.current_thread(), add=False)


# --- the public object -----------------------------------------------------------------------


@dataclass
class _Counters:
    records: deque[RequestRecord]
    by_key: Counter[tuple[str, str | None]] = field(default_factory=Counter)


class ApiEmulator:
    """An in-process kube-apiserver for Services, Nodes, EndpointSlices and ServiceCIDRs.

    Use as a context manager (``with ApiEmulator() as api:``) or call `start`/`stop`.
    State can be changed over HTTP with any client, or in-process with `create`, `update`,
    `patch`, `delete`, `apply` (same store, same resourceVersions, same watch events).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        history_size: int = 1000,
        watch_queue_size: int = 10000,
        bookmark_interval: float = 1.0,
        default_watch_timeout: float | None = None,
        too_large_rv_wait: float = 3.0,
        initial_resource_version: int = 1,
        service_cidr: str = "10.96.0.0/16",
        poll_interval: float = 0.05,
        join_timeout: float = 5.0,
        request_log_size: int = 100_000,
        unserved: Iterable[str] = (),
        watch_list: bool = True,
        tls: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
    ) -> None:
        # (certificate, key): serve HTTPS with them (a client that does not trust their
        # CA fails its handshake, as with a real API server).
        self.tls: ssl.SSLContext | None = None
        if tls is not None:
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(*tls)
        # Set: every resource request is answered 403 Forbidden for this user, as RBAC
        # answers a service account without the rights (`forbid`).
        self.forbidden_user: str | None = None
        self._flow_schema_uid = str(uuid.uuid4())
        self._priority_level_uid = str(uuid.uuid4())
        # False: refuse sendInitialEvents as a server with the WatchList feature off does.
        self.watch_list = watch_list
        # Resources (plurals) answered 404 like an API the server does not have (an older
        # server without ServiceCIDRs). Discovery still lists them.
        self.unserved = frozenset(unserved)
        self.store = Store(
            history_size=history_size,
            watch_queue_size=watch_queue_size,
            initial_resource_version=initial_resource_version,
            service_cidr=service_cidr,
        )
        self._address = (host, port)
        self.watch_queue_size = watch_queue_size
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.too_large_rv_wait = too_large_rv_wait
        self.poll_interval = poll_interval
        self.join_timeout = join_timeout
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._connections: set[socket.socket] = set()
        self._counters = _Counters(deque(maxlen=request_log_size))
        self._stopping = threading.Event()
        self._stalled = False
        self._unavailable_mode: UnavailableMode | None = None
        self._rejected = 0
        self._gzipped = 0  # responses sent gzipped (the client asked, and they were big)
        self.errors: list[str] = []  # tracebacks of emulator bugs (tests may assert it is empty)

    # --- lifecycle

    def start(self) -> ApiEmulator:
        if self._server is not None:
            raise RuntimeError("ApiEmulator already started")
        self._stopping.clear()
        self._listen()
        return self

    def _listen(self) -> None:
        self._server = _Server(self._address, self)
        # Remember the real port so `set_available(True)` after "refuse" rebinds the same URL.
        self._address = (self._address[0], self._server.server_port)
        self._serve_thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": self.poll_interval},
            name="apiemu-accept",
            daemon=True,
        )
        self._serve_thread.start()

    def _close_listener(self) -> None:
        server, thread = self._server, self._serve_thread
        self._server = self._serve_thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(self.join_timeout)

    def stop(self, *, check_leaks: bool = True) -> None:
        """Stop serving, cut every connection and join all threads (bounded by join_timeout).

        Raises RuntimeError if a thread outlives the deadline and ``check_leaks`` is set.
        """
        self._stopping.set()
        self._close_listener()
        self._cut_everything()
        deadline = time.monotonic() + self.join_timeout
        for thread in self._snapshot_threads():
            thread.join(max(0.0, deadline - time.monotonic()))
        leaked = [t.name for t in self._snapshot_threads() if t.is_alive()]
        if leaked and check_leaks:
            raise RuntimeError(f"apiemu threads still alive after stop(): {leaked}")

    def __enter__(self) -> ApiEmulator:
        return self.start() if self._server is None else self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.stop(check_leaks=exc_type is None)

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        return self._address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    # --- test hooks

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion (what a list would return now)."""
        return str(self.store.resource_version)

    def compact(self) -> None:
        """Forget all watch history: any resourceVersion older than now gets 410 Expired."""
        self.store.compact()

    def drop_connections(self) -> None:
        """Abruptly close every open watch stream (no terminating chunk)."""
        for watcher in self.store.watchers():
            watcher.abort()

    def stall_watches(self, stalled: bool = True) -> None:
        """While stalled, watch streams stay open but send nothing (no events, no bookmarks,
        and no timeoutSeconds close either — a hung server does not honour it). Events are
        kept queued and flow again on un-stall."""
        self._stalled = stalled

    @property
    def stalled(self) -> bool:
        return self._stalled

    def set_available(self, available: bool, mode: UnavailableMode = "503") -> None:
        """Simulate the API server going away (and coming back).

        Every mode drops open watch streams. Then new requests get:
        ``"503"``: a 503 ServiceUnavailable Status (the server is up but refuses);
        ``"reset"``: the TCP connection is accepted and reset, no HTTP response;
        ``"refuse"``: connection refused (the listening socket is closed, the port kept for
        coming back with `set_available(True)`).
        """
        if available:
            mode_was = self._unavailable_mode
            self._unavailable_mode = None
            if mode_was == "refuse" and not self._stopping.is_set():
                self._listen()
            return
        self._unavailable_mode = mode
        if mode == "refuse":
            self._close_listener()
        if mode == "503":
            self.drop_connections()
        else:
            self._cut_everything()

    @property
    def available(self) -> bool:
        return self._unavailable_mode is None

    def forbid(self, user: str | None = "system:serviceaccount:kube-system:pyproxy") -> None:
        """Answer every resource request 403 Forbidden with RBAC's message for `user` (None:
        serve again). Open watches are dropped: their next try meets the refusal."""
        self.forbidden_user = user
        if user is not None:
            self.drop_connections()

    @property
    def rejected_connections(self) -> int:
        """Connections reset while unavailable in "reset" mode."""
        return self._rejected

    @property
    def gzipped_responses(self) -> int:
        """Responses sent gzipped (above 128 KiB, to a client that accepts gzip)."""
        return self._gzipped

    # --- request accounting

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._counters.records)

    def count(
        self,
        verb: str | None = None,
        resource: str | None = None,
        *,
        method: str | None = None,
        path: str | None = None,
        status: int | None = None,
    ) -> int:
        """Number of recorded requests matching every given criterion (resource accepts
        any alias: "svc", "Service", "services"...)."""
        plural = _resolve(resource).plural if resource else None
        with self._lock:
            fast = method is None and path is None and status is None
            if fast and verb is not None and plural is not None:
                return self._counters.by_key[(verb, plural)]
            return sum(
                1
                for r in self._counters.records
                if (verb is None or r.verb == verb)
                and (plural is None or r.resource == plural)
                and (method is None or r.method == method)
                and (path is None or r.path == path)
                and (status is None or r.status == status)
            )

    def count_lists(self, resource: str) -> int:
        """Complete lists asked for: first pages of paged lists and streamed lists (watches
        with sendInitialEvents), what a reflector does once per (re)list."""
        plural = _resolve(resource).plural
        with self._lock:
            return sum(
                1
                for r in self._counters.records
                if r.resource == plural
                and ((r.verb == "list" and not r.query.get("continue"))
                     or (r.verb == "watch" and r.query.get("sendInitialEvents") in _TRUE))
            )

    def reset_counters(self) -> None:
        with self._lock:
            self._counters.records.clear()
            self._counters.by_key.clear()

    def active_watches(self, resource: str | None = None) -> int:
        res = _resolve(resource) if resource else None
        return len(self.store.watchers(res))

    def wait_for_watches(
        self, n: int = 1, resource: str | None = None, timeout: float = 5.0
    ) -> None:
        """Block until at least ``n`` watches are registered (so a test can mutate state
        knowing the watch will see it). Raises TimeoutError."""
        what = f"{n} watch(es) on {resource}"
        self._wait(lambda: self.active_watches(resource) >= n, timeout, what)

    def wait_for_requests(
        self, n: int, verb: str | None = None, resource: str | None = None, timeout: float = 5.0
    ) -> None:
        what = f"{n} {verb} {resource} request(s)"
        self._wait(lambda: self.count(verb, resource) >= n, timeout, what)

    @staticmethod
    def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"apiemu: timed out waiting for {what}")
            time.sleep(0.01)

    # --- in-process state access (no HTTP; objects come back with kind/apiVersion)

    def create(self, resource: str, obj: Obj, namespace: str | None = None) -> Obj:
        res = _resolve(resource)
        created = self.store.create(res, self._ns(res, obj, namespace), obj, http=False)
        return self._out(res, created)

    def update(self, resource: str, obj: Obj, namespace: str | None = None) -> Obj:
        """Replace; unconditional unless ``obj`` carries a resourceVersion (then 409 on stale)."""
        res = _resolve(resource)
        name = obj.get("metadata", {}).get("name", "")
        _, out = self.store.replace(res, self._ns(res, obj, namespace), name, obj, http=False)
        return self._out(res, out)

    def apply(self, resource: str, obj: Obj, namespace: str | None = None) -> Obj:
        """Create or unconditionally replace (a test convenience, not server-side apply)."""
        res = _resolve(resource)
        ns = self._ns(res, obj, namespace)
        name = obj.get("metadata", {}).get("name", "")
        meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "resourceVersion"}
        body = {**obj, "metadata": meta}
        with self.store.lock:  # exists-then-write must be atomic
            try:
                self.store.get(res, ns, name)
            except ApiError:
                return self.create(resource, body, ns)
            return self.update(resource, body, ns)

    def patch(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> Obj:
        res = _resolve(resource)
        ns = (namespace or "default") if res.namespaced else None
        return self._out(res, self.store.patch(res, ns, name, content_type, patch))

    def delete(self, resource: str, name: str, namespace: str | None = None) -> Obj:
        res = _resolve(resource)
        ns = (namespace or "default") if res.namespaced else None
        return self._out(res, self.store.delete(res, ns, name))

    def get(self, resource: str, name: str, namespace: str | None = None) -> Obj:
        res = _resolve(resource)
        ns = (namespace or "default") if res.namespaced else None
        return self._out(res, self.store.get(res, ns, name))

    def list_objects(
        self,
        resource: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[Obj]:
        res = _resolve(resource)
        flt = Filter.parse(res, namespace, label_selector, field_selector)
        return [self._out(res, o) for o in self.store.list_objects(flt).items]

    @staticmethod
    def _ns(res: R.ResourceDef, obj: Obj, namespace: str | None) -> str | None:
        if not res.namespaced:
            return None
        return namespace or obj.get("metadata", {}).get("namespace") or "default"

    @staticmethod
    def _out(res: R.ResourceDef, obj: Obj) -> Obj:
        copied: Obj = json.loads(json.dumps(res.typed(obj)))  # a private copy for the caller
        return copied

    # --- clients

    def client_configuration(self) -> Configuration:
        """A `kubernetes.client.Configuration` for this server: plain HTTP, no auth."""
        from kubernetes.client import Configuration

        config = Configuration(host=self.url)
        config.verify_ssl = False
        return config

    def api_client(self) -> ApiClient:
        """A fresh `kubernetes.client.ApiClient`; close it (or use ``with``) when done."""
        from kubernetes.client import ApiClient

        return ApiClient(self.client_configuration())

    def write_kubeconfig(self, path: str | os.PathLike[str], namespace: str = "default") -> Path:
        """Write a kubeconfig (JSON, which is valid YAML) pointing at this server."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "apiemu", "cluster": {"server": self.url}}],
            "users": [{"name": "apiemu", "user": {}}],
            "contexts": [
                {
                    "name": "apiemu",
                    "context": {"cluster": "apiemu", "user": "apiemu", "namespace": namespace},
                }
            ],
            "current-context": "apiemu",
            "preferences": {},
        }
        target = Path(path)
        target.write_text(json.dumps(config, indent=2))
        return target

    # --- internals used by the server side

    def _track_thread(self, thread: threading.Thread, add: bool) -> None:
        with self._lock:
            (self._threads.add if add else self._threads.discard)(thread)

    def _snapshot_threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)

    def _track_connection(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(sock)

    def _check_watch_allowed(self, watcher: Watcher) -> None:
        # A watch registered while stop()/set_available(False) ran must not outlive them.
        if self._stopping.is_set() or not self.available:
            watcher.abort()

    def _cut_everything(self) -> None:
        self.drop_connections()
        with self._lock:
            sockets = list(self._connections)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _log_request(self, record: RequestRecord) -> None:
        with self._lock:
            self._counters.records.append(record)
            self._counters.by_key[(record.verb, record.resource)] += 1

    def _note_error(self, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(exc))
        with self._lock:
            self.errors.append(text)
        print(f"apiemu internal error:\n{text}", file=sys.stderr)


def _not_allowed() -> ApiError:
    return ApiError(
        405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
    )


def _resolve(resource: str | R.ResourceDef) -> R.ResourceDef:
    if isinstance(resource, R.ResourceDef):
        return resource
    wanted = resource.lower()
    for res in R.RESOURCES.values():
        if wanted in (res.plural, res.singular, res.kind.lower(), *res.short_names):
            return res
    raise KeyError(f"apiemu does not emulate {resource!r}; known: {sorted(R.RESOURCES)}")


def _forbidden(user: str, verb: str, rt: Route) -> ApiError:
    """RBAC's refusal, worded as kube-apiserver words it (a 403 Status)."""
    res = rt.resource
    name = f' "{rt.name}"' if rt.name else ""
    scope = f'in the namespace "{rt.namespace}"' if rt.namespace else "at the cluster scope"
    message = (f'{res.plural}{name} is forbidden: User "{user}" cannot {verb} resource '
               f'"{res.plural}" in API group "{res.group}" {scope}')
    details: Obj = {"kind": res.plural}
    if rt.name:
        details["name"] = rt.name
    if res.group:
        details["group"] = res.group
    return ApiError(403, "Forbidden", message, details)
