"""The reflector against the API emulator: the real `kubernetes` client over a socket."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyproxy.cluster import watch as watch_module
from pyproxy.cluster.codec import JSON
from pyproxy.cluster.resources import (
    JSON_MEDIA_TYPE,
    PROTOBUF_MEDIA_TYPE,
    SLICE_CODEC,
    Resource,
    endpoint_slices_resource,
    services_resource,
)
from pyproxy.cluster.watch import (
    MIN_WATCH_TIMEOUT,
    WATCH_READ_MARGIN,
    Expired,
    Handler,
    Reflector,
    _lines,
)
from pyproxy.cluster.watchstate import Backoff
from pyproxy.core.convert_endpoints import convert_endpoint_slice
from pyproxy.core.model import Skipped, SliceEndpoints
from pyproxy.core.wire import SliceDoc
from testkit.apiemu import ApiEmulator


class Recorder:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any] | None] = {}
        self.events = 0
        self.synced = threading.Event()
        self.lock = threading.Lock()

    def handle(self, key: tuple[str, str], obj: dict[str, Any] | None) -> None:
        with self.lock:
            self.events += 1
            if obj is None:
                self.objects.pop(key, None)
            else:
                self.objects[key] = obj

    def names(self) -> set[str]:
        with self.lock:
            return {name for _, name in self.objects}


def wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def service(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels},
            "spec": {"ports": [{"name": "http", "port": 80}]}}


# What the reflectors of the running test ask their watches for: every test against the
# emulator runs with both (the emulator answers a protobuf watch in protobuf, as the API
# server does: testkit/protoenc.py). Set by the `emu` fixture.
CONTENT_TYPE = {"asked": JSON_MEDIA_TYPE}


@pytest.fixture(params=[JSON_MEDIA_TYPE, PROTOBUF_MEDIA_TYPE], ids=["json", "protobuf"])
def emu(request: pytest.FixtureRequest) -> Iterator[ApiEmulator]:
    CONTENT_TYPE["asked"] = request.param
    try:
        with ApiEmulator(bookmark_interval=0.2) as server:
            yield server
    finally:
        CONTENT_TYPE["asked"] = JSON_MEDIA_TYPE


@pytest.fixture
def reflector(emu: ApiEmulator) -> Iterator[tuple[Reflector, Recorder]]:
    recorder = Recorder()
    stop = threading.Event()
    refl = Reflector(emu.api_client(), services_resource(), recorder.handle,
                     recorder.synced.set, stop, watch_timeout=30, read_timeout=2.0,
                     content_type=CONTENT_TYPE["asked"])
    refl._backoff.initial, refl._backoff.cap = 0.05, 0.2  # fast retries in tests
    thread = threading.Thread(target=refl.run, daemon=True)
    emu.create("services", service("before"))
    thread.start()
    yield refl, recorder
    stop.set()
    emu.drop_connections()
    thread.join(5)
    assert not thread.is_alive()


def test_list_then_watch(emu: ApiEmulator, reflector: tuple[Reflector, Recorder]) -> None:
    refl, rec = reflector
    assert rec.synced.wait(5)
    assert rec.names() == {"before"}
    emu.wait_for_watches(1, "services")
    emu.create("services", service("added"))
    emu.create("services", service("other-proxy", **{
        "service.kubernetes.io/service-proxy-name": "x"}))
    emu.create("services", {**service("headless"), "spec": {"clusterIP": "None", "ports": [
        {"name": "http", "port": 80}]}})
    emu.delete("services", "before", "ns")
    wait(lambda: rec.names() == {"added"})
    # bookmarks move the position on without events
    version = emu.resource_version
    wait(lambda: refl.status.resource_version == str(version))
    # the watch came as asked; its objects are the same documents either way
    protobuf_asked = CONTENT_TYPE["asked"] == PROTOBUF_MEDIA_TYPE
    assert refl.status.watch_encoding == ("protobuf" if protobuf_asked else "json")
    added = rec.objects[("ns", "added")]
    assert added is not None
    assert added["spec"]["ports"] == [{"name": "http", "protocol": "TCP", "port": 80,
                                       "targetPort": 80}]


def test_relist_after_410_reconciles_deletes(emu: ApiEmulator,
                                             reflector: tuple[Reflector, Recorder]) -> None:
    refl, rec = reflector
    assert rec.synced.wait(5)
    emu.wait_for_watches(1, "services")
    emu.stall_watches(True)
    emu.delete("services", "before", "ns")
    emu.create("services", service("meanwhile"))
    emu.compact()
    emu.stall_watches(False)
    emu.drop_connections()  # the next watch resumes from an expired position → 410
    wait(lambda: rec.names() == {"meanwhile"})
    assert refl.status.lists >= 2


def test_a_broken_stream_resumes_after_the_last_event_it_delivered(
        emu: ApiEmulator, reflector: tuple[Reflector, Recorder]) -> None:
    """Not from where that watch started: with a restarted API server (its watch cache
    starts at its own list) or a history the server has compacted since, that position is
    gone and every dropped connection would cost a full relist."""
    refl, rec = reflector
    assert rec.synced.wait(5)
    emu.wait_for_watches(1, "services")
    for name in ("one", "two", "three"):
        emu.create("services", service(name))
    wait(lambda: {"one", "two", "three"} <= rec.names())
    delivered = refl.status.resource_version
    emu.compact()  # the watch's start is history now; the last event is not
    watches = emu.count("watch", "services")
    emu.drop_connections()
    emu.wait_for_requests(watches + 1, "watch", "services")
    resumed = [r for r in emu.requests if r.verb == "watch"][-1]
    assert resumed.query.get("resourceVersion") == delivered
    emu.create("services", service("after"))
    wait(lambda: "after" in rec.names())
    assert refl.status.lists == 1


class RecordingBackoff(Backoff):
    """client-go's policy, fast and without jitter (every wait exactly its step), keeping
    the waits it drew."""

    def __init__(self, initial: float = 0.05, cap: float = 0.4) -> None:
        super().__init__(initial=initial, cap=cap, rand=lambda: 0.0)
        self.drawn: list[float] = []

    def next(self) -> float:
        self.drawn.append(round(super().next(), 6))
        return self.drawn[-1]


def test_a_410_relists_after_a_backoff_step(emu: ApiEmulator) -> None:
    """A step of client-go's backoff before a relist: nodes that a restarted API server
    answers with 410 at once do not all list in the same instant."""
    recorder, stop = Recorder(), threading.Event()
    refl = Reflector(emu.api_client(), services_resource(), recorder.handle,
                     recorder.synced.set, stop, watch_timeout=30, read_timeout=2.0,
                     content_type=CONTENT_TYPE["asked"])
    refl._backoff = RecordingBackoff(initial=0.5, cap=0.5)
    thread = threading.Thread(target=refl.run, daemon=True)
    thread.start()
    try:
        assert recorder.synced.wait(5)
        emu.wait_for_watches(1, "services")
        emu.stall_watches(True)
        emu.create("services", service("meanwhile"))
        emu.compact()
        emu.stall_watches(False)
        emu.drop_connections()  # resumes from before the compaction: 410
        emu.wait_for_requests(1, "watch", "services", timeout=5)
        gone = time.monotonic()
        wait(lambda: emu.count_lists("services") == 2)
        assert time.monotonic() - gone >= 0.4
        wait(lambda: "meanwhile" in recorder.names())
    finally:
        stop.set()
        emu.drop_connections()
        thread.join(5)


def test_a_relist_is_one_streamed_request_that_goes_on_as_the_watch(
        emu: ApiEmulator) -> None:
    """After a 410 (every node gets one from a restarted API server) even a small list is
    streamed: no start waits for it, and it is one request instead of a list and a watch,
    whose events the server gzips."""
    emu.create("services", service("before"))
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, watch_list=True) as refl:
        assert rec.synced.wait(5)
        emu.wait_for_watches(1, "services")
        assert emu.count_lists("services") == 1 and emu.count("list", "services") == 1
        emu.stall_watches(True)
        emu.create("services", service("meanwhile"))
        emu.compact()
        emu.stall_watches(False)
        watches = emu.count("watch", "services")
        emu.drop_connections()  # resumes into 410, then lists again
        wait(lambda: "meanwhile" in rec.names())
        assert emu.count("list", "services") == 1  # the relist was streamed
        assert emu.count_lists("services") == 2
        emu.create("services", service("after"))
        wait(lambda: "after" in rec.names())
        # the resumed watch (410), then the streamed list that is the watch now
        assert emu.count("watch", "services") == watches + 2
        assert refl.status.lists == 2


def test_api_away_and_back(emu: ApiEmulator, reflector: tuple[Reflector, Recorder]) -> None:
    refl, rec = reflector
    assert rec.synced.wait(5)
    emu.wait_for_watches(1, "services")
    emu.set_available(False, mode="refuse")
    wait(lambda: refl.status.errors >= 2)
    assert rec.names() == {"before"}  # nothing is forgotten while the API is away
    emu.create("services", service("while-away"))
    emu.delete("services", "before", "ns")
    emu.set_available(True)
    wait(lambda: rec.names() == {"while-away"})
    assert refl.status.connected


def test_after_a_restart_the_relist_waits_the_next_step_of_the_refused_tries(
        emu: ApiEmulator) -> None:
    """client-go's reflector has one backoff for all its retries, started again only every
    2 minutes, not on a success: the watch tries an away API server refuses wait 0.8, 1.6,
    3.2 s… and the relist after the 410 a restarted one answers waits the step after
    those. So a fleet's relists come in a second wave, spread over a window as wide as that
    step (pyproxy drew a fixed 0.8-1.6 s there, and started its steps again on every
    connection: 50 nodes' 400 requests came within 6 s, docs/fleet.md)."""
    rec = Recorder()
    with running(emu, rec.handle, rec.synced) as refl:
        assert rec.synced.wait(5)
        emu.wait_for_watches(1, "services")
        emu.set_available(False, mode="refuse")
        wait(lambda: refl.status.errors >= 3)
        emu.create("services", service("meanwhile"))
        emu.compact()  # the restarted API server's cache begins after our position
        emu.set_available(True)
        wait(lambda: emu.count_lists("services") == 2)
        backoff = refl._backoff
        assert isinstance(backoff, RecordingBackoff)
        # one draw per refused try, then one for the relist: steps of one sequence
        assert len(backoff.drawn) == refl.status.errors + 1
        assert backoff.drawn == [min(0.4, 0.05 * 2 ** i) for i in range(len(backoff.drawn))]
        wait(lambda: "meanwhile" in rec.names())


def test_a_410_after_a_retry_that_followed_a_403_or_5xx_lists_at_once(
        emu: ApiEmulator) -> None:
    """A restarted API server answers 403 for its first second (its authorizer's caches
    are not synced) and 5xx while it is not ready. client-go's reflector does not retry a
    watch on those: it lists again after one step. pyproxy tries the watch after that step
    (it may resume), so a 410 there lists at once: its relist is never later than
    client-go's (it was a step later: 25 s more in a fleet run, bench-fleet --mixed)."""
    rec = Recorder()
    with running(emu, rec.handle, rec.synced) as refl:
        assert rec.synced.wait(5)
        emu.wait_for_watches(1, "services")
        emu.set_available(False, mode="503")
        wait(lambda: refl.status.errors >= 3)
        emu.create("services", service("meanwhile"))
        emu.compact()
        emu.set_available(True)
        wait(lambda: emu.count_lists("services") == 2)
        backoff = refl._backoff
        assert isinstance(backoff, RecordingBackoff)
        assert len(backoff.drawn) == refl.status.errors  # none for the relist
        wait(lambda: "meanwhile" in rec.names())


def test_stalled_watch_is_detected_and_resumed(emu: ApiEmulator,
                                               reflector: tuple[Reflector, Recorder]) -> None:
    refl, rec = reflector
    assert rec.synced.wait(5)
    emu.wait_for_watches(1, "services")
    watches = refl.status.watches
    emu.stall_watches(True)
    wait(lambda: refl.status.errors >= 1, timeout=10)  # read timeout (2 s) fires
    emu.stall_watches(False)
    emu.create("services", service("after-stall"))
    wait(lambda: "after-stall" in rec.names())
    # The relist after the timeout may deliver the object before the new watch starts.
    wait(lambda: refl.status.watches > watches)


def test_a_watch_is_read_for_longer_than_the_server_keeps_it_open() -> None:
    """A real API server may send nothing on a healthy watch of a kind nobody changes until
    it ends the watch at its timeoutSeconds (cluster/watch.py's docstring): the client's read
    timeout must not run out first. A fixed 150 s did, against timeoutSeconds of 300-600 s:
    a warning and an error every 150 s for a quiet ServiceCIDR watch (and a flaky
    test_quiet_watch_relists_zero_times). An explicit read_timeout stays as given."""
    end = (b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"7",'
           b'"annotations":{"k8s.io/initial-events-end":"true"}}}}\n')
    asked: list[dict[str, Any]] = []

    def watch(**kwargs: Any) -> Response:
        asked.append(kwargs)
        return Response([end])

    for fixed in (None, 2.0):
        asked.clear()
        given = {} if fixed is None else {"read_timeout": fixed}  # the default, or fixed
        refl = Reflector(None, Resource("Service", lambda _api: watch), Recorder().handle,
                         lambda: None, threading.Event(), **given)
        for _ in range(20):
            refl._watch("1")  # a plain watch
            refl._stream_list()  # a streamed list, read on as the watch
            refl._held = None
        for call in asked:
            seconds, (_connect, read) = call["timeout_seconds"], call["_request_timeout"]
            assert MIN_WATCH_TIMEOUT <= seconds < 2 * MIN_WATCH_TIMEOUT
            assert read == (fixed or seconds + WATCH_READ_MARGIN)
        assert len({call["timeout_seconds"] for call in asked}) > 1  # still jittered


def test_a_silent_watch_is_ended_by_the_server_and_a_hung_one_by_the_read_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No bookmarks (a quiet kind on a real API server): every watch is silent until the
    server ends it at its timeoutSeconds (2 or 3 s here), and none is given up by the client
    before. A server that hangs with the connection open (stalled) is still left: at the
    watch's timeoutSeconds + the margin (2 s here), then resumed, not relisted."""
    monkeypatch.setattr(watch_module, "WATCH_READ_MARGIN", 2.0)
    recorder, stop = Recorder(), threading.Event()
    with ApiEmulator(bookmark_interval=3600.0) as emu:
        emu.create("services", service("quiet"))
        refl = Reflector(emu.api_client(), services_resource(), recorder.handle,
                         recorder.synced.set, stop, watch_timeout=2)
        refl._backoff.initial, refl._backoff.cap = 0.05, 0.2  # fast retries in tests
        thread = threading.Thread(target=refl.run, daemon=True)
        thread.start()
        try:
            assert recorder.synced.wait(5)
            # two whole silent watches, each ended by the server, and a third one
            wait(lambda: emu.count("watch", "services") >= 3, timeout=15)
            assert refl.status.errors == 0, refl.status.last_error
            assert refl.status.events == 0  # silent: no event, no bookmark
            emu.stall_watches(True)  # now the server hangs: its watches never end
            stalled = time.monotonic()
            wait(lambda: refl.status.errors >= 1, timeout=15)
            # left at its timeoutSeconds + the margin (4 or 5 s) after its last byte, which
            # came before the stall began (3 s of slack for a busy machine)
            assert time.monotonic() - stalled <= 5.0 + 3.0
            assert "timed out" in refl.status.last_error, refl.status.last_error
            emu.stall_watches(False)
            emu.create("services", service("after"))
            wait(lambda: "after" in recorder.names())
            assert refl.status.lists == 1  # resumed from its position
        finally:
            stop.set()
            emu.stall_watches(False)
            emu.drop_connections()
            thread.join(5)
    assert not thread.is_alive()


def test_every_watch_connection_of_the_daemons_client_has_tcp_keepalive() -> None:
    """A peer gone without a word (its host, a route, a load balancer's state) is found by
    TCP keepalive as client-go's (30 s idle, 15 s apart, 9 probes), not by the read timeout,
    which waits for the server's own end of the watch. The `kubernetes` client leaves it off
    unless asked."""
    import socket

    from pyproxy.cluster.apiconnection import ApiConnection
    from pyproxy.cluster.apiserver import client_for
    from pyproxy.config import ProxyConfig

    with ApiEmulator() as emu:
        api = client_for(ApiConnection(server=emu.url, source="test"), ProxyConfig())
        try:
            response = services_resource().list_function(api)(
                watch=True, timeout_seconds=1, _request_timeout=(10, 10))
            sock = response.connection.sock
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            assert [sock.getsockopt(socket.IPPROTO_TCP, option) for option in (
                socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)] == [30, 15, 9]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # urllib3's own
            response.close()
            response.release_conn()
        finally:
            api.close()


@pytest.mark.parametrize("content_type", [JSON_MEDIA_TYPE, PROTOBUF_MEDIA_TYPE],
                         ids=["json", "protobuf"])
def test_close_ends_a_quiet_watch_at_once(content_type: str) -> None:
    """A watch with nothing to say (no event, no bookmark for an hour) ends at close(): not at
    its next event or the server's timeout, and not as a failure of the API."""
    with ApiEmulator(bookmark_interval=3600) as emu:
        rec = Recorder()
        refl = Reflector(emu.api_client(), services_resource(), rec.handle, rec.synced.set,
                         threading.Event(), watch_timeout=300, content_type=content_type)
        thread = threading.Thread(target=refl.run, daemon=True)
        thread.start()
        assert rec.synced.wait(5)
        emu.wait_for_watches(1, "services")
        refl.close()
        thread.join(10)  # without the shutdown: until the server ends it, 5 to 10 min
        assert not thread.is_alive()
        assert (refl.status.errors, refl.status.last_error) == (0, "")


def test_field_selector_limits_to_one_node(emu: ApiEmulator) -> None:
    from pyproxy.cluster.resources import nodes_resource

    for name in ("node-a", "node-b"):
        emu.create("nodes", {"metadata": {"name": name, "labels": {"zone": name}}})
    rec = Recorder()
    stop = threading.Event()
    refl = Reflector(emu.api_client(), nodes_resource("node-a"), rec.handle, rec.synced.set,
                     stop, content_type=CONTENT_TYPE["asked"])
    thread = threading.Thread(target=refl.run, daemon=True)
    thread.start()
    try:
        assert rec.synced.wait(5)
        assert rec.names() == {"node-a"}
    finally:
        stop.set()
        emu.drop_connections()
        thread.join(5)


@contextlib.contextmanager
def running(emu: ApiEmulator, handle: Handler, synced: threading.Event,
            page_size: int = 500, watch_list: bool = False,
            small_list: int = 2000, resource: Resource | None = None) -> Iterator[Reflector]:
    stop = threading.Event()
    refl = Reflector(emu.api_client(), resource or services_resource(), handle, synced.set, stop,
                     page_size=page_size, watch_list=watch_list, small_list=small_list,
                     content_type=CONTENT_TYPE["asked"])
    refl._backoff = RecordingBackoff()  # fast retries in tests
    thread = threading.Thread(target=refl.run, daemon=True)
    thread.start()
    try:
        yield refl
    finally:
        stop.set()
        emu.drop_connections()
        thread.join(5)
        assert not thread.is_alive()


def test_lists_are_read_in_pages(emu: ApiEmulator) -> None:
    for i in range(5):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, page_size=2) as refl:
        assert rec.synced.wait(5)
        assert rec.names() == {f"svc-{i}" for i in range(5)}
        assert emu.count("list", "services") == 3  # 2 + 2 + 1
        assert refl.status.lists == 1
        # The watch resumes from the list's version: nothing missed, nothing repeated.
        emu.wait_for_watches(1, "services")
        emu.create("services", service("later"))
        wait(lambda: "later" in rec.names())
        assert rec.events == 6


def test_a_big_list_page_comes_gzipped_and_is_read_as_it_was(emu: ApiEmulator) -> None:
    """pyproxy accepts gzip, as kube-proxy does: the API server compresses a response above
    128 KiB (a list page of 500 Services is ~0.75 MB of JSON)."""
    for n in range(1200):
        emu.create("services", {**service(f"s{n}"), "metadata": {
            "name": f"s{n}", "namespace": "ns", "annotations": {"pad": "x" * 120}}})
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, page_size=500, watch_list=False):
        assert rec.synced.wait(10)
    assert len(rec.objects) == 1200
    assert rec.objects[("ns", "s7")]["metadata"]["annotations"]["pad"] == "x" * 120
    assert emu.gzipped_responses >= 2


def test_a_small_list_is_one_request(emu: ApiEmulator) -> None:
    for i in range(5):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, watch_list=True, small_list=10) as refl:
        assert rec.synced.wait(5)
        assert rec.names() == {f"svc-{i}" for i in range(5)}
        assert emu.count("list", "services") == 1 and refl.status.lists == 1
        emu.wait_for_watches(1, "services")
        assert emu.count("watch", "services") == 1  # no streamed list: the watch only


def test_a_bigger_list_is_streamed_through_one_watch(emu: ApiEmulator) -> None:
    for i in range(5):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, watch_list=True, small_list=2) as refl:
        assert rec.synced.wait(5)
        assert rec.names() == {f"svc-{i}" for i in range(5)}
        # One page of 2 says the list is bigger; the rest comes in one streamed list.
        assert emu.count("list", "services") == 1
        assert refl.status.lists == 1 and refl.watch_list
        # The stream goes on as the watch from the end bookmark's version, as client-go's
        # (the server gzips a streamed list's events): no second request.
        emu.create("services", service("later"))
        wait(lambda: "later" in rec.names())
        assert emu.count("watch", "services") == 1 and refl.status.watches == 1


def once_handed(rec: Recorder, name: str, action: Callable[[], object]) -> Handler:
    """A handler recording into `rec` that runs `action` once, when `name` is first handed
    over: with small_list=2 and svc-0/svc-1, between the first page and the streamed list."""
    done = threading.Event()

    def handle(key: tuple[str, str], obj: dict[str, Any] | None) -> None:
        rec.handle(key, obj)
        if key[1] == name and obj is not None and not done.is_set():
            done.set()
            action()

    return handle


def test_the_first_page_is_not_handed_over_again_by_the_stream(emu: ApiEmulator) -> None:
    """The streamed list repeats the first page's objects: only a changed one (a newer
    resourceVersion) reaches the handler a second time."""
    for i in range(5):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    handle = once_handed(rec, "svc-1", lambda: emu.patch(
        "services", "svc-1", {"metadata": {"labels": {"v": "2"}}}, "ns"))
    with running(emu, handle, rec.synced, watch_list=True, small_list=2):
        assert rec.synced.wait(5)
        assert rec.names() == {f"svc-{i}" for i in range(5)}
        assert rec.events == 6  # 2 from the page, 3 new and the changed svc-1 from the stream
        svc1 = rec.objects[("ns", "svc-1")]
        assert svc1 is not None and svc1["metadata"].get("labels") == {"v": "2"}


def test_an_object_of_the_first_page_gone_from_the_stream_is_deleted(
        emu: ApiEmulator) -> None:
    for i in range(4):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    handle = once_handed(rec, "svc-0", lambda: emu.delete("services", "svc-0", "ns"))
    with running(emu, handle, rec.synced, watch_list=True, small_list=2):
        assert rec.synced.wait(5)
        wait(lambda: rec.names() == {"svc-1", "svc-2", "svc-3"})


def test_a_streamed_relist_reconciles_deletions(emu: ApiEmulator) -> None:
    for i in range(3):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, watch_list=True, small_list=1) as refl:
        assert rec.synced.wait(5)
        emu.wait_for_watches(1, "services")
        # The deletion and the compaction before the watch can resume (it retries ~0.5 s
        # after the drop; a test thread slower than that let it resume before the
        # compaction and never relist): stalled, as the paged relist test does it.
        emu.stall_watches(True)
        emu.delete("services", "svc-0", "ns")
        emu.compact()
        emu.stall_watches(False)
        emu.drop_connections()  # the watch resumes into 410 Gone: a streamed list again
        wait(lambda: refl.status.lists == 2)
        wait(lambda: rec.names() == {"svc-1", "svc-2"})


def test_a_server_without_streamed_lists_is_listed_in_pages() -> None:
    with ApiEmulator(bookmark_interval=0.2, watch_list=False) as emu:
        for i in range(3):
            emu.create("services", service(f"svc-{i}"))
        rec = Recorder()
        with running(emu, rec.handle, rec.synced, page_size=2, watch_list=True,
                     small_list=2) as refl:
            assert rec.synced.wait(5)
            assert rec.names() == {"svc-0", "svc-1", "svc-2"}
            # The first page, the refused stream, then the list in pages from the start.
            assert emu.count("list", "services") == 3
            assert not refl.watch_list  # asked once, then pages only


def test_list_snapshot_expiring_between_pages_lists_again_in_one_piece(
        emu: ApiEmulator) -> None:
    for i in range(5):
        emu.create("services", service(f"svc-{i}"))
    rec = Recorder()
    changed = threading.Event()

    def handle(key: tuple[str, str], obj: dict[str, Any] | None) -> None:
        rec.handle(key, obj)
        if key[1] == "svc-1" and not changed.is_set():
            # Between the first and the second page: the cluster changes and the server
            # forgets the snapshot the continue token points into.
            changed.set()
            emu.delete("services", "svc-4", "ns")
            emu.create("services", service("svc-5"))
            emu.compact()

    with running(emu, handle, rec.synced, page_size=2) as refl:
        assert rec.synced.wait(5)
        assert changed.is_set()
        assert rec.names() == {"svc-0", "svc-1", "svc-2", "svc-3", "svc-5"}
        assert emu.count("list", "services", status=410) == 1
        assert refl.status.errors == 0  # part of listing, not an API failure


def test_resource_is_plain_data() -> None:
    assert isinstance(services_resource(), Resource)


# ---- EndpointSlices: decoded into typed documents -------------------------------------------


def endpoint_slice(name: str, *ready: object) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [f"10.0.{int(name[-1])}.{i}"],
                           "conditions": {"ready": r}, "nodeName": "node-a",
                           "targetRef": {"kind": "Pod", "name": f"{name}-{i}"}}
                          for i, r in enumerate(ready, 1)]}


@pytest.mark.parametrize("small_list", [2, 10], ids=["first page, then streamed", "one page"])
def test_endpoint_slices_are_handed_over_typed_and_a_misfit_as_it_came(
        emu: ApiEmulator, small_list: int) -> None:
    """Slices arrive as SliceDoc from a list page, the streamed list and the watch; one whose
    condition is not a boolean arrives as the dicts the API sent (with a page, its whole
    page does), and its conversion names the field."""
    for i in range(4):
        emu.create("endpointslices", endpoint_slice(f"s{i}", True, False))
    emu.create("endpointslices", endpoint_slice("s4", True, "yes"))
    rec = Recorder()
    with running(emu, rec.handle, rec.synced, watch_list=True, small_list=small_list,
                 resource=endpoint_slices_resource()):
        assert rec.synced.wait(5)
        emu.wait_for_watches(1, "endpointslices")
        emu.create("endpointslices", endpoint_slice("s5", False))
        wait(lambda: "s5" in rec.names())
    objects = {name: obj for (_, name), obj in rec.objects.items()}
    assert type(objects["s4"]) is dict
    assert type(objects["s5"]) is SliceDoc  # from the watch
    if small_list == 2:  # the stream hands each over on its own
        assert {n for n, o in objects.items() if type(o) is SliceDoc} == {
            "s0", "s1", "s2", "s3", "s5"}
    converted = {name: convert_endpoint_slice(obj) for name, obj in objects.items()}
    bad = converted.pop("s4")
    assert isinstance(bad, Skipped) and bad.reason.startswith("endpoints[1].conditions.ready:")
    for name, piece in converted.items():
        assert isinstance(piece, SliceEndpoints), (name, piece)
        assert piece == convert_endpoint_slice(emu.get("endpointslices", name, "ns"))


def test_slice_codec_reads_bookmarks_and_errors_as_dicts() -> None:
    bookmark = (b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"7",'
                b'"annotations":{"k8s.io/initial-events-end":"true"}}}}')
    error = b'{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old"}}'
    for line in (bookmark, error):
        assert SLICE_CODEC.event(line) == JSON.event(line)
    kind, obj = SLICE_CODEC.event(error)
    assert kind == "ERROR" and obj["code"] == 410


@pytest.mark.parametrize("codec", [JSON, SLICE_CODEC], ids=["plain", "slices"])
def test_what_msgspec_refuses_is_read_as_json_loads_reads_it(codec: Any) -> None:
    """NaN, a number beyond a double and a lone surrogate escape: json.loads reads them,
    msgspec does not; the watch must not stop on them (the conversion judges the object)."""
    for value in (b"NaN", b"1e400", b'"\\ud800"'):
        obj_text = b'{"metadata":{"name":"x","annotations":{"odd":' + value + b"}}}"
        kind, obj = codec.event(b'{"type":"ADDED","object":' + obj_text + b"}")
        assert kind == "ADDED" and repr(obj) == repr(json.loads(obj_text))
        _meta, items = codec.page(b'{"metadata":{},"items":[' + obj_text + b"]}")
        assert repr(items) == repr([json.loads(obj_text)])


class Chunks:
    """A response whose stream yields the given chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def stream(self, amt: int = 0, decode_content: bool = True) -> Iterator[bytes]:
        yield from self.chunks


@given(st.lists(st.binary(min_size=1, max_size=30).filter(lambda b: b"\n" not in b
                                                          and b.strip()),
                max_size=8),
       st.lists(st.integers(0, 300), max_size=6), st.booleans())
def test_watch_lines_survive_any_chunking(lines: list[bytes], cuts: list[int],
                                          final_newline: bool) -> None:
    data = b"\n\n".join(lines) + (b"\n" if final_newline else b"")
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in itertools.pairwise(points)]
    assert list(_lines(Chunks(chunks), threading.Event())) == lines


class Response(Chunks):
    """A streamed response that says whether it went back to the pool unread."""

    def __init__(self, chunks: list[bytes]) -> None:
        super().__init__(chunks)
        self.closed = False
        self.pooled_unread = False

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        self.pooled_unread = not self.closed


def test_a_watch_left_before_its_end_does_not_pool_its_connection() -> None:
    """A 410 ERROR event ends the watch before the server's terminating chunk is read: the
    connection went back to the pool with it unread, and the relist that took it read that
    chunk as its status line; urllib3 sent it again, so the server served two lists
    (test_a_410_relists_after_a_jittered_pause failed so once on a busy machine: it counted
    three lists, not two)."""
    gone = Response([b'{"type":"ERROR","object":{"kind":"Status","code":410,'
                     b'"reason":"Expired","message":"too old resource version: 1 (3)"}}\n'])
    refl = Reflector(None, Resource("Service", lambda _api: lambda **_kw: gone),
                     Recorder().handle, lambda: None, threading.Event())
    with pytest.raises(Expired, match="too old resource version"):
        refl._watch("1")
    assert gone.closed and not gone.pooled_unread
    # read to its end (the server closed it on timeoutSeconds): the connection is reusable
    ended = Response([b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"7"}}}\n'])
    refl = Reflector(None, Resource("Service", lambda _api: lambda **_kw: ended),
                     Recorder().handle, lambda: None, threading.Event())
    assert refl._watch("1") == "7"
    assert not ended.closed
