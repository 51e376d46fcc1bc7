"""List + watch of one API resource with the official `kubernetes` client (the I/O shell).

The client's model deserialization is 4 to 10 times slower than `json.loads` on the same bytes (10k
Services: ~2 s against ~0.3 s), and its `Watch.stream(deserialize=False)` crashes on ERROR
events, so the reflector asks the client for raw responses (`_preload_content=False`) and
reads the watch stream's lines itself.

Behaviour, as a Kubernetes informer's:
- list, hand every object to the handler, report "synced" once;
- watch from the list's resourceVersion with bookmarks; every event moves the position on;
- a stream that ends (server timeout, dropped connection, nothing read for the read
  timeout) is resumed from the last position it delivered (an event's or a bookmark's, not
  the one the watch started from): only 410 Gone (history compacted, or an API server
  restarted since) lists again, after the backoff's next step (below), and reconciles
  (objects gone meanwhile are reported deleted);
- the server ends each watch after timeoutSeconds, drawn between 5 and 10 minutes as
  client-go does so that many nodes do not reconnect in step. Until then a healthy watch of
  a kind nobody changes may stay silent: the watch cache sends a bookmark only with a
  resourceVersion newer than the watch's (k8s.io/apiserver v0.37.2,
  storage/cacher/cache_watcher.go `process`; the "about once a minute" of its bookmark
  timer is when it may, not when it will), and the cache of such a kind learns of newer
  etcd revisions only from a progress notification on its own etcd watch (every resource's
  storage has its own etcd client): requested when a consistent list of that kind waits for
  it, or etcd's own every 10 minutes. So the read timeout of a watch is its timeoutSeconds +
  WATCH_READ_MARGIN: a quiet but healthy watch is ended by the server, never by the client
  (the fixed 150 s this had ended the ServiceCIDR watch of a quiet cluster, or any quiet
  kind's, with a read timeout: a warning and an error counted every 150 s); an API server
  that hangs with the connection open is still left after that long. A peer that is gone
  (its host, a route, a load balancer's state) is found sooner by TCP keepalive, which
  every connection of pyproxy's client has (cluster/apiconnection.py: client-go's 30 s,
  ~165 s to give up). client-go has no read timeout on a watch at all: it relies on the
  same server timeout and HTTP/2 pings;
- lists are read in pages (`limit`/`continue`, client-go's 500): a 10k-object list in one
  piece decodes into ~300 MB of dicts at once, and the converted objects scattered among
  them keep that memory from going back; page by page the peak is one page. A continue
  token that expired mid-list (410) restarts the list in one piece, as client-go's pager;
- errors (connection refused, a dropped stream, 403, 429, 5xx) → the watch is tried again
  from the same position, after client-go's backoff (`Backoff`: 0.8 s doubling to 30 s,
  each wait jittered to [d, 2d], one sequence per reflector that starts over only 2 minutes
  after it last did), which also paces the relist after a 410 (but for a 410 on the try
  after a 403 or 5xx, where client-go would have listed instead of trying: that lists at
  once). Nothing is ever cleared because the API went away: the handler simply hears
  nothing until it comes back.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog

from pyproxy.cluster.apirequest import REASON_LIMIT, describe_error
from pyproxy.cluster.codec import Codec
from pyproxy.cluster.resources import JSON_MEDIA_TYPE, PROTOBUF_MEDIA_TYPE, Resource
from pyproxy.cluster.watchstate import Backoff, WatchStatus
from pyproxy.core import protobuf
from pyproxy.core.model import ObjectKey
from pyproxy.core.wire import metadata
from pyproxy.memory import gc_paused

log = structlog.get_logger(__name__)

# Objects per list page (client-go's default chunk size).
LIST_PAGE_SIZE = 500
# client-go's reflector asks for timeoutSeconds = minWatchTimeout × (1 + rand), 5 to 10 min.
MIN_WATCH_TIMEOUT = 300
# A watch's read timeout is its timeoutSeconds + this (the module's docstring says why): the
# server ends a healthy watch at timeoutSeconds from its start, which is before the client's
# read timeout, counted from the last byte read, can run out; the margin is for a loaded
# server or node finishing the response late. Only a stream silent past it is stalled.
WATCH_READ_MARGIN = 30.0
# The connect timeout of every request.
CONNECT_TIMEOUT = 10.0
# handler(key, object or None for a deletion); the object as the resource's codec decodes it
Handler = Callable[[ObjectKey, Any | None], None]

# A protobuf watch, JSON where the server cannot (an aggregated API, the emulator), as
# client-go's Accept lists both. The response's Content-Type says which it is.
_PROTOBUF_WATCH = f"{PROTOBUF_MEDIA_TYPE};stream=watch, {JSON_MEDIA_TYPE}"


class Expired(Exception):
    """The watch position is older than the server's history (410 Gone)."""


class WatchListRefused(Exception):
    """The server does not stream lists (sendInitialEvents): list in pages instead."""


class _Bigger(Exception):
    """The list has more than one page: stream it (seen: the first page's objects, each
    with its resourceVersion)."""

    def __init__(self, seen: dict[ObjectKey, str]) -> None:
        super().__init__(f"{len(seen)} objects and more")
        self.seen = seen


# A list of up to this many objects is one request (decoded at once, ~6 MB of dicts per
# 1,000 Services); a longer one is streamed. Streamed lists cost a bookmark tick (about a
# second) at the end, pages a token of the qps/burst bucket each.
SMALL_LIST = 2000


# The annotation of the bookmark that ends a streamed list's initial events.
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


class Reflector:
    def __init__(self, api_client: Any, resource: Resource, handler: Handler,
                 on_synced: Callable[[], None], stop: threading.Event,
                 watch_timeout: int = MIN_WATCH_TIMEOUT,
                 read_timeout: float | None = None,
                 page_size: int = LIST_PAGE_SIZE, watch_list: bool = True,
                 small_list: int = SMALL_LIST, content_type: str = JSON_MEDIA_TYPE) -> None:
        self.api_client = api_client
        self.resource = resource
        self.handler = handler
        self.on_synced = on_synced
        self.stop = stop
        # The server closes a watch after this to twice this (jittered per watch); a fresh one
        # resumes from the last position.
        self.watch_timeout = watch_timeout
        # A watch silent for longer (not even a bookmark) is considered stalled. None: each
        # watch's timeoutSeconds + WATCH_READ_MARGIN (a fixed one is for tests and drills of
        # stall detection).
        self.read_timeout = read_timeout
        self.page_size = page_size
        # Ask for a streamed list first; False once the server has refused one.
        self.watch_list = watch_list
        self.small_list = small_list
        # clientConnection.contentType. Protobuf is asked for on plain watches only: there a
        # change is half its JSON's bytes (docs/fleet.md: 1,718 against 3,344 B), and
        # decoding it costs ~34 µs against ~4 µs for msgspec's JSON, nothing beside a
        # change's ~1 ms sync. Lists and streamed lists stay JSON: gzipped, protobuf is only
        # 8-10 % smaller, and decoding it in Python would add ~0.37 s to a start at 10k × 10.
        self.protobuf_watch = (content_type == PROTOBUF_MEDIA_TYPE
                               and resource.protobuf is not None)
        self.status = WatchStatus(resource.kind)
        self._known: set[ObjectKey] = set()
        self._backoff = Backoff()  # every retry's pause, client-go's
        # The last position a watch delivered: where a broken stream resumes.
        self._position = ""
        # A streamed list's stream after its initial events: the next watch reads it on.
        self._held: tuple[Any, Codec, Iterator[bytes]] | None = None
        # The stream being read (a watch's or a streamed list's): what close() wakes.
        self._streaming: Any = None

    def close(self) -> None:
        """Stop now. `stop` alone is seen between two reads, and a quiet watch's read lasts
        until the next event or bookmark, or the server's timeout (minutes): its socket is
        shut down as well, so the thread ends at once (three reflectors waiting out a quiet
        watch made 114 s of one test's teardown)."""
        self.stop.set()
        _shut_down(self._streaming)

    def run(self) -> None:
        """The reflector's thread: until stop is set. Lists once, then watches from the last
        position it has seen; lists again only when that position has expired (410)."""
        version: str | None = None  # None: there is no position to resume from yet
        # The last failure was an answer of the server that client-go's reflector does not
        # retry as a watch (403 while a restarted API server's authorizer warms up, 5xx):
        # it lists again after one step instead. pyproxy tries the watch after that step
        # (it may resume), so a 410 on that try lists at once, not a step later still.
        answered = False
        while not self.stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                answered = False
            except Expired as err:
                # client-go's reflector returns from ListAndWatch and lists again after its
                # backoff's next step: after the refused tries of a restart, a wider one
                delay = 0.0 if answered else self._backoff.next()
                answered = False
                log.info("watch_expired_listing_again", kind=self.resource.kind,
                         version=self._position or version, reason=str(err)[:REASON_LIMIT],
                         list_in=round(delay, 2))
                version = None
                self.stop.wait(delay)
            except Exception as err:  # connection refused, timeouts, HTTP errors…
                if self.stop.is_set():
                    break  # close() shut the stream down: not the API's failure
                if version is not None:  # resume after the last event the stream delivered
                    version = self._position or version
                status = getattr(err, "status", None)
                answered = isinstance(status, int) and status != 429
                self.status.set_connected(False)
                self.status.errors += 1
                # The reason whole (a 403's Status message, a TLS failure), not the
                # client's text, which starts with every response header or the URL.
                self.status.last_error = describe_error(err)
                delay = self._backoff.next()
                log.warning("api_unavailable_retrying", kind=self.resource.kind,
                            error=self.status.last_error, retry_in=round(delay, 2),
                            resume="list" if version is None else "watch")
                self.stop.wait(delay)

    def _call(self, **kwargs: Any) -> Any:
        fn = self.resource.list_function(self.api_client)
        if self.resource.label_selector:
            kwargs["label_selector"] = self.resource.label_selector
        if self.resource.field_selector:
            kwargs["field_selector"] = self.resource.field_selector
        return fn(_preload_content=False, **kwargs)

    def _watch_timeouts(self) -> dict[str, Any]:
        """The timeouts of the next watch: timeoutSeconds as client-go's reflector draws it,
        and the client's (connect, read) timeout, the read one above timeoutSeconds."""
        seconds = int(self.watch_timeout * (1 + random.random()))
        read = self.read_timeout
        if read is None:
            read = seconds + WATCH_READ_MARGIN
        return {"timeout_seconds": seconds, "_request_timeout": (CONNECT_TIMEOUT, read)}

    def _reading(self, response: Any) -> tuple[Codec, Iterator[bytes]]:
        """How to read a watch response, by its Content-Type: JSON lines, or the
        length-prefixed frames of a protobuf watch."""
        if self.resource.protobuf is not None and _is_protobuf(response):
            self.status.watch_encoding = "protobuf"
            return self.resource.protobuf, _frames(response, self.stop)
        self.status.watch_encoding = "json"
        return self.resource.codec, _lines(response, self.stop)

    def _list(self) -> str:
        """The whole state in the fewest requests: a list that fits in one page of
        small_list objects is that one request; a bigger one is streamed through one watch
        (the server's watch-list) where it is served, otherwise read in pages."""
        if self.watch_list:
            first_page: dict[ObjectKey, str] = {}
            if not self.status.synced:
                try:
                    return self._paged_list(stream_beyond_first_page=True)
                except _Bigger as bigger:
                    first_page = bigger.seen
            # A relist (after a 410: a restarted API server answers every node so) is
            # streamed whatever its size: one request that goes on as the watch, its events
            # gzipped by the server, as client-go's; no start is waiting for it.
            try:
                return self._stream_list(first_page)
            except WatchListRefused as err:
                # An API server before 1.27, or with the WatchList feature off, refuses the
                # parameters (400/422); it is asked once per reflector.
                self.watch_list = False
                log.info("streaming_list_not_served",
                         kind=self.resource.kind, reason=str(err)[:REASON_LIMIT])
        return self._paged_list()

    def _stream_list(self, first_page: Mapping[ObjectKey, str] | None = None) -> str:
        """client-go's watch-list: one watch with sendInitialEvents streams every object as
        ADDED, then a bookmark marked k8s.io/initial-events-end carrying the snapshot's
        resourceVersion. One request however big the list (the token bucket of
        clientConnection.qps/burst is not spent on pages), and one object in memory at a time
        instead of a page of 500. The API server sends the end bookmark on its next
        bookmark tick (about a second), which is why small lists are read as one page.
        first_page: objects a first page already handed over (key → resourceVersion); the
        stream's copy of one is not handed over again when its version is the same (at 10k
        objects the first page was a fifth of the list converted twice), and those the
        stream does not have were deleted meanwhile."""
        first_page = first_page or {}
        started = time.monotonic()
        try:
            response = self._call(
                watch=True, send_initial_events=True, resource_version_match="NotOlderThan",
                allow_watch_bookmarks=True, **self._watch_timeouts())
        except Exception as err:
            if getattr(err, "status", None) in (400, 422):
                raise WatchListRefused(describe_error(err)) from err
            raise
        self.status.set_connected(True)
        seen: set[ObjectKey] = set()
        version: str | None = None
        handling = 0.0
        codec, lines = self._reading(response)
        self._streaming = response
        try:
            # as for a page: conversion makes many objects without cycles, kept in the cache
            with gc_paused(keep=True):
                for line in lines:
                    kind, obj = codec.event(line)
                    meta = metadata(obj)
                    if kind == "BOOKMARK":
                        if (meta.get("annotations") or {}).get(INITIAL_EVENTS_END) == "true":
                            version = str(meta.get("resourceVersion") or "")
                            break
                        continue
                    if kind == "ERROR":
                        self._handle(kind, obj, "")  # raises
                    key = _key(meta)
                    if first_page and kind == "ADDED" and _unchanged(first_page, key, meta):
                        seen.add(key)
                        continue
                    began = time.monotonic()
                    if kind == "DELETED":
                        seen.discard(key)
                        self.handler(key, None)
                    else:
                        seen.add(key)
                        self.handler(key, obj)
                    handling += time.monotonic() - began
            if version is not None and not self.stop.is_set():
                # The stream goes on as the watch from the end bookmark's version (client-go
                # reads it on too): no second request, and the server keeps gzipping its
                # events, a change a third of its JSON (docs/fleet.md).
                self._held = (response, codec, lines)
        finally:
            if self._held is None:
                self._streaming = None
                response.close()  # not drained: the connection cannot go back to the pool
                response.release_conn()
        if version is None:
            if self.stop.is_set():
                return ""
            raise RuntimeError("the streamed list ended before its initial-events-end bookmark")
        elapsed = time.monotonic() - started
        # Waiting for the server and decoding are interleaved in a stream: reported together.
        self._known |= first_page.keys() - seen
        self._listed(seen, version, started, elapsed - handling, 0.0)
        return version

    def _paged_list(self, stream_beyond_first_page: bool = False) -> str:
        """The list in pages of page_size (the first of small_list when a bigger list is to
        be streamed instead: _Bigger then says so, after handing that page over)."""
        seen: set[ObjectKey] = set()
        version = ""
        limit, token = (self.small_list if stream_beyond_first_page else self.page_size), ""
        started, waited, decoding = time.monotonic(), 0.0, 0.0
        while True:
            try:
                meta, items, fetch_seconds, decode_seconds = self._page(limit, token)
                waited += fetch_seconds
                decoding += decode_seconds
            except Exception as err:
                if token and getattr(err, "status", None) == 410:
                    log.info("list_expired_between_pages", kind=self.resource.kind)
                    limit, token, version = 0, "", ""
                    continue
                raise
            # The first page's version: a real server gives every page the snapshot's; one
            # that does not (the emulator) may only make the watch replay events we have.
            version = version or str(meta.get("resourceVersion", ""))
            # Converting allocates many small objects without cycles; the cyclic GC would
            # walk all of them again and again (~20 % of a cold start). The cache keeps them.
            versions: dict[ObjectKey, str] = {}
            with gc_paused(keep=True):
                for item in items:
                    item_meta = metadata(item)
                    key = _key(item_meta)
                    seen.add(key)
                    self.handler(key, item)
                    if stream_beyond_first_page:
                        versions[key] = str(item_meta.get("resourceVersion") or "")
            token = str(meta.get("continue") or "")
            del items
            if not token:
                break
            if stream_beyond_first_page:
                raise _Bigger(versions)
        self._listed(seen, version, started, waited, decoding)
        return version

    def _listed(self, seen: set[ObjectKey], version: str, started: float, waited: float,
                decoding: float) -> None:
        """A complete list: status, reconciliation, and "synced" the first time."""
        self.status.lists += 1
        self.status.set_connected(True)
        self.status.last_list_seconds = round(time.monotonic() - started, 3)
        self.status.last_list_server_seconds = round(waited, 3)
        self.status.last_list_decode_seconds = round(decoding, 3)
        # Reconcile: whatever we knew and the list no longer has was deleted meanwhile.
        for key in self._known - seen:
            self.handler(key, None)
        self._known = seen
        self.status.resource_version = version
        if not self.status.synced:
            self.status.synced = True
            self.on_synced()

    def _page(self, limit: int,
              token: str) -> tuple[Mapping[str, Any], list[Any], float, float]:
        """One page (its metadata and items), the seconds spent waiting for it (request and
        transfer) and those spent decoding it."""
        kwargs: dict[str, Any] = {"_request_timeout": (CONNECT_TIMEOUT, 120)}
        if limit:
            kwargs["limit"] = limit
        if token:
            kwargs["_continue"] = token
        started = time.monotonic()
        response = self._call(**kwargs)
        try:
            data = response.data
            waited = time.monotonic() - started
            codec = self.resource.protobuf if _is_protobuf(response) else None
            with gc_paused():
                meta, items = (codec or self.resource.codec).page(data)
            decoded = time.monotonic() - started - waited
        finally:
            response.release_conn()
        self.status.set_connected(True)
        return meta, items, waited, decoded

    def _watch(self, version: str) -> str:
        self._position = version
        held, self._held = self._held, None
        if held is not None:  # a streamed list's stream, read on from its end bookmark
            response, codec, lines = held
        else:
            # Accept only when protobuf is asked for: JSON is every list function's
            # default, and a resource's function may be the official client's own
            # (it takes no `_accept`).
            accept = {"_accept": _PROTOBUF_WATCH} if self.protobuf_watch else {}
            try:
                response = self._call(
                    watch=True, resource_version=version, allow_watch_bookmarks=True,
                    **self._watch_timeouts(), **accept,
                )
            except Exception as err:
                # A server whose watch cache starts after our position (restarted, or
                # history compacted) refuses the watch with 410 instead of an ERROR event.
                if getattr(err, "status", None) == 410:
                    raise Expired(describe_error(err)) from err
                raise
            codec, lines = self._reading(response)
        self._streaming = response
        if self.stop.is_set():  # close() came before the stream was known
            _shut_down(response)
        self.status.watches += 1
        self.status.set_connected(True)
        drained = False
        try:
            for line in lines:
                kind, obj = codec.event(line)
                version = self._position = self._handle(kind, obj, version)
            drained = not self.stop.is_set()  # _lines stops early once stop is set
        finally:
            if not drained:
                # Left before its end (a 410 ERROR event, a handler's error, stop): the rest
                # of the response (at least the terminating chunk) is unread, so the
                # connection must not go back to the pool. It did: the relist after a 410
                # then took it while the server's terminating chunk was still on its way (a
                # busy machine), read that chunk as its status line, and urllib3 sent the
                # relist again on another connection: the server served two lists (a test
                # counting relists saw three lists instead of two).
                response.close()
            self._streaming = None
            response.release_conn()
        return version

    def _handle(self, kind: Any, obj: Any, version: str) -> str:
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Expired(obj.get("message", "410 Gone"))
            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
        meta = metadata(obj)
        new_version = str(meta.get("resourceVersion") or version)
        if kind == "BOOKMARK":
            self.status.resource_version = new_version
            return new_version
        key = _key(meta)
        self.status.events += 1
        if kind == "DELETED":
            self._known.discard(key)
            self.handler(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._known.add(key)
            self.handler(key, obj)
        self.status.resource_version = new_version
        return new_version


def _shut_down(response: Any) -> None:
    """Wake a read blocked on the response (urllib3's shutdown: the socket, not the pool's
    connection object); nothing when there is none or it has ended meanwhile."""
    with contextlib.suppress(Exception):
        getattr(response, "shutdown", lambda: None)()


def _unchanged(first_page: Mapping[ObjectKey, str], key: ObjectKey,
               meta: Mapping[str, Any]) -> bool:
    """The streamed object is the version the first page handed over."""
    version = first_page.get(key)
    return bool(version) and version == str(meta.get("resourceVersion") or "")


def _key(meta: Mapping[str, Any]) -> ObjectKey:
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _lines(response: Any, stop: threading.Event) -> Iterator[bytes]:
    """The lines of a chunked watch response (one JSON event each)."""
    rest = b""
    for chunk in response.stream(65536, decode_content=True):
        # Split each chunk once: splitting one line off at a time copied the rest of the
        # buffer for every line (a 64 KiB chunk holds ~30 events of a 10-endpoint slice).
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if stop.is_set():
            return
    if rest.strip():
        yield rest


def _is_protobuf(response: Any) -> bool:
    """The response is Kubernetes protobuf (a list's, or a watch's `;stream=watch`)."""
    headers = getattr(response, "headers", None) or {}
    return str(headers.get("Content-Type", "")).startswith(PROTOBUF_MEDIA_TYPE)


def _frames(response: Any, stop: threading.Event) -> Iterator[bytes]:
    """The frames of a protobuf watch response: each a 4-byte big-endian length, then that
    many bytes (a WatchEvent). A stream that ends inside a frame is an error, as a JSON
    stream's last line cut short is (the watch resumes from the last event delivered)."""
    buffer, pos = b"", 0
    for chunk in response.stream(65536, decode_content=True):
        buffer = buffer[pos:] + chunk if pos < len(buffer) else chunk
        pos = 0
        while len(buffer) - pos >= 4:
            end = pos + 4 + int.from_bytes(buffer[pos:pos + 4], "big")
            if end > len(buffer):
                break
            yield buffer[pos + 4:end]
            pos = end
        if stop.is_set():
            return
    if pos < len(buffer):
        raise protobuf.Malformed(f"the watch stream ended inside a frame "
                                 f"({len(buffer) - pos} bytes)")
