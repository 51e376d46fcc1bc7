"""Tests of the apiemu kube-apiserver emulator, driven by the real ``kubernetes`` client.

Everything goes over a real socket: the client's own list/watch/write calls and, where the wire
format itself is the point, raw HTTP. Facts about the client (kubernetes 37.x) that pyproxy's
watch layer must design around are asserted here, so a client upgrade that changes them fails
loudly:

- ``Watch.stream`` turns an ERROR event into ``ApiException(status=code)``. For 410 it first
  retries once with the same (expired) resourceVersion, unless ``timeout_seconds`` was given
  (then it raises on the first 410). Either way the caller must relist.
- With ``deserialize=False`` an ERROR event crashes ``Watch.stream`` with ``KeyError('raw_object')``
  instead of ApiException (client bug), so do not use that flag to detect 410.
- BOOKMARK events are *yielded* to the caller (``object`` is the raw dict, not a model) and
  update ``Watch.resource_version``.
- A server that cuts the stream mid-flight surfaces as ``urllib3.exceptions.ProtocolError``; a
  silent server as ``urllib3.exceptions.ReadTimeoutError`` (only with a read timeout in
  ``_request_timeout``); neither is retried by ``Watch.stream``.
"""

# The kubernetes package ships py.typed but most of it is unannotated; strict mypy would flag
# every client call, which says nothing about this file.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import http.client
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from hypothesis import given
from hypothesis import strategies as st
from kubernetes import client, config, dynamic, watch
from kubernetes.client.exceptions import ApiException

from testkit.apiemu import ApiEmulator, parse_field_selector, parse_label_selector
from testkit.apiemu.selection import SelectorError

Obj = dict[str, Any]


def status_of(exc: ApiException) -> Obj:
    """The ``kind: Status`` body the server sent with an error."""
    body: Obj = json.loads(exc.body or "{}")
    return body


# --- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture
def emu() -> Iterator[ApiEmulator]:
    with ApiEmulator(bookmark_interval=0.2, too_large_rv_wait=0.3) as api:
        yield api
        assert api.errors == []  # no emulator bug was hit while serving


@pytest.fixture
def api_client(emu: ApiEmulator) -> Iterator[client.ApiClient]:
    with emu.api_client() as api:
        yield api


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture
def disc(api_client: client.ApiClient) -> client.DiscoveryV1Api:
    return client.DiscoveryV1Api(api_client)


def service(name: str, ns: str = "default", labels: dict[str, str] | None = None) -> Obj:
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80}]},
    }


def node(name: str, labels: dict[str, str] | None = None) -> Obj:
    return {"metadata": {"name": name, "labels": labels or {}}}


def slice_(name: str, svc: str, ips: list[str], extra: dict[str, str] | None = None) -> Obj:
    labels = {"kubernetes.io/service-name": svc, **(extra or {})}
    return {
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


class Collector:
    """Runs ``Watch.stream`` on a thread and collects (type, name, rv) or the exception."""

    def __init__(self, func: Callable[..., Any], **kwargs: Any) -> None:
        self.watch = watch.Watch()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(func, kwargs), daemon=True)
        self._thread.start()

    def _run(self, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        try:
            for event in self.watch.stream(func, **kwargs):
                self.events.put(event)
        except BaseException as exc:
            self.error = exc

    def next(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.events.get(timeout=timeout)

    def next_change(self, timeout: float = 5.0) -> tuple[str, str]:
        """The next non-BOOKMARK event as (type, name)."""
        while True:
            event = self.next(timeout)
            if event["type"] != "BOOKMARK":
                return event["type"], event["raw_object"]["metadata"]["name"]

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "watch stream did not end"


# --- list, get, selectors --------------------------------------------------------------------


def test_list_carries_global_rv_and_kindless_items(emu: ApiEmulator, core: Any) -> None:
    emu.create("services", service("a", "ns1"))
    emu.create("nodes", node("n1"))  # another resource still moves the global RV
    emu.create("services", service("b", "ns2"))

    result = core.list_service_for_all_namespaces()
    assert result.metadata.resource_version == emu.resource_version == "4"
    assert [s.metadata.name for s in result.items] == ["a", "b"]
    assert [s.metadata.namespace for s in result.items] == ["ns1", "ns2"]

    raw = json.loads(core.list_service_for_all_namespaces(_preload_content=False).data)
    assert (raw["kind"], raw["apiVersion"]) == ("ServiceList", "v1")
    assert "kind" not in raw["items"][0] and "apiVersion" not in raw["items"][0]
    assert [s["metadata"]["name"] for s in core.list_namespaced_service("ns2").to_dict()["items"]]


def test_node_field_selector(emu: ApiEmulator, core: Any) -> None:
    for name in ("n1", "n2", "n3"):
        emu.create("nodes", node(name))
    assert [n.metadata.name for n in core.list_node(field_selector="metadata.name=n1").items] == [
        "n1"
    ]
    names = [n.metadata.name for n in core.list_node(field_selector="metadata.name!=n1").items]
    assert names == ["n2", "n3"]
    assert core.read_node("n2").metadata.name == "n2"


def test_unsupported_field_selector_is_400(emu: ApiEmulator, core: Any) -> None:
    with pytest.raises(ApiException) as info:
        core.list_service_for_all_namespaces(field_selector="spec.selector=x")
    body = status_of(info.value)
    assert (info.value.status, body["kind"], body["reason"]) == (400, "Status", "BadRequest")
    assert "field label not supported: spec.selector" in body["message"]
    # ...while the labels upstream supports for Services work (kube-proxy uses spec.clusterIP).
    emu.create("services", service("a"))
    emu.create("services", {**service("h"), "spec": {"clusterIP": "None", "ports": []}})
    names = core.list_service_for_all_namespaces(field_selector="spec.clusterIP!=None").items
    assert [s.metadata.name for s in names] == ["a"]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", ["s1", "s2", "s3"]),
        ("kubernetes.io/service-name=web", ["s1", "s2"]),
        ("kubernetes.io/service-name==web", ["s1", "s2"]),
        ("kubernetes.io/service-name!=web", ["s3"]),
        ("kubernetes.io/service-name in (web, db)", ["s1", "s2", "s3"]),
        ("kubernetes.io/service-name notin (web)", ["s3"]),
        ("tier", ["s2"]),
        ("!tier", ["s1", "s3"]),
        ("kubernetes.io/service-name=web,!tier", ["s1"]),
        ("!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name", ["s1", "s2"]),
    ],
)
def test_endpointslice_label_selectors(
    emu: ApiEmulator, disc: Any, selector: str, expected: list[str]
) -> None:
    emu.create("endpointslices", slice_("s1", "web", ["10.0.0.1"]))
    emu.create("endpointslices", slice_("s2", "web", ["10.0.0.2"], {"tier": "x"}))
    emu.create("endpointslices", slice_("s3", "db", [], {"service.kubernetes.io/headless": ""}))
    found = disc.list_endpoint_slice_for_all_namespaces(label_selector=selector).items
    assert [s.metadata.name for s in found] == expected


def test_bad_label_selector_is_400(core: Any) -> None:
    with pytest.raises(ApiException) as info:
        core.list_node(label_selector="a in ()")
    assert info.value.status == 400


def test_pagination_with_limit_and_continue(emu: ApiEmulator, core: Any) -> None:
    for i in range(5):
        emu.create("nodes", node(f"n{i}"))
    first = core.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n0", "n1"]
    assert first.metadata.remaining_item_count == 3
    second = core.list_node(limit=2, _continue=first.metadata._continue)
    assert [n.metadata.name for n in second.items] == ["n2", "n3"]
    rest = core.list_node(limit=2, _continue=second.metadata._continue)
    assert [n.metadata.name for n in rest.items] == ["n4"] and rest.metadata._continue is None
    emu.create("nodes", node("n9"))
    emu.compact()  # a continue token older than the compaction is as dead as an old RV
    with pytest.raises(ApiException) as info:
        core.list_node(limit=2, _continue=first.metadata._continue)
    assert info.value.status == 410


# --- writes ----------------------------------------------------------------------------------


def test_create_sets_server_fields_and_defaults(core: Any, disc: Any) -> None:
    body = service("web", "prod")
    body["status"] = {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}  # ignored over HTTP
    created = core.create_namespaced_service("prod", body)
    meta = created.metadata
    assert meta.uid and meta.creation_timestamp and meta.resource_version == "2"
    assert meta.namespace == "prod" and meta.generation is None
    assert created.spec.cluster_ip.startswith("10.96.") and created.spec.type == "ClusterIP"
    assert (created.spec.ports[0].protocol, created.spec.ports[0].target_port) == ("TCP", 80)
    assert created.status.load_balancer.ingress is None

    body = slice_("web-1", "web", ["10.0.0.1"])
    del body["metadata"]["namespace"]  # taken from the path
    eps = disc.create_namespaced_endpoint_slice("prod", body)
    assert eps.metadata.generation == 1 and eps.metadata.namespace == "prod"
    eps.endpoints[0].addresses = ["10.0.0.2"]
    replaced = disc.replace_namespaced_endpoint_slice("web-1", "prod", eps)
    assert replaced.metadata.generation == 2


def test_status_is_written_through_the_status_subresource(core: Any) -> None:
    addresses = [{"type": "InternalIP", "address": "192.168.0.10"}]
    body = {**node("n1"), "status": {"addresses": addresses}}
    assert core.create_node(body).status.addresses[0].address == "192.168.0.10"  # kubelet-style
    current = core.read_node("n1")
    current.status.addresses[0].address = "10.9.9.9"
    current.metadata.labels = {"changed": "yes"}
    replaced = core.replace_node("n1", current)  # main resource: status change ignored
    assert replaced.status.addresses[0].address == "192.168.0.10"
    assert replaced.metadata.labels == {"changed": "yes"}
    patch = {"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}}
    patched = core.patch_node_status("n1", patch)
    assert patched.status.addresses[0].address == "10.9.9.9"
    assert patched.metadata.labels == {"changed": "yes"}


def test_create_twice_is_409_already_exists(core: Any) -> None:
    core.create_node(node("n1"))
    with pytest.raises(ApiException) as info:
        core.create_node(node("n1"))
    body = status_of(info.value)
    assert (info.value.status, body["reason"]) == (409, "AlreadyExists")
    assert body["message"] == 'nodes "n1" already exists'
    assert body["details"] == {"name": "n1", "kind": "nodes"}


def test_replace_checks_resource_version(emu: ApiEmulator, core: Any) -> None:
    stale = core.create_node(node("n1"))
    emu.patch("nodes", "n1", {"metadata": {"labels": {"moved": "on"}}})
    stale.metadata.labels = {"x": "y"}
    with pytest.raises(ApiException) as info:
        core.replace_node("n1", stale)
    body = status_of(info.value)
    assert (info.value.status, body["reason"]) == (409, "Conflict")
    assert "the object has been modified" in body["message"]

    fresh = core.read_node("n1")
    fresh.metadata.labels = {"x": "y"}
    assert core.replace_node("n1", fresh).metadata.labels == {"x": "y"}

    with pytest.raises(ApiException) as missing:
        core.replace_node("nope", {"metadata": {"name": "nope"}})
    assert missing.value.status == 404
    assert status_of(missing.value)["message"] == 'nodes "nope" not found'


def test_patch_flavours(emu: ApiEmulator, core: Any) -> None:
    emu.create("services", service("web", labels={"a": "1", "b": "2"}))
    # A dict body goes out as strategic merge patch (client default), a list as JSON patch.
    patched = core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"a": None}}})
    assert patched.metadata.labels == {"b": "2"}
    ops = [{"op": "add", "path": "/metadata/labels/c", "value": "3"}]
    assert core.patch_namespaced_service("web", "default", ops).metadata.labels == {
        "b": "2",
        "c": "3",
    }
    merged = core.patch_namespaced_service(
        "web",
        "default",
        {"spec": {"type": "NodePort"}},
        _content_type="application/merge-patch+json",
    )
    assert merged.spec.type == "NodePort" and 30000 <= merged.spec.ports[0].node_port <= 32767
    stale = {"metadata": {"resourceVersion": "1", "labels": {"z": "z"}}}
    with pytest.raises(ApiException) as info:
        core.patch_namespaced_service("web", "default", stale)
    assert info.value.status == 409
    with pytest.raises(ApiException) as missing:
        core.patch_namespaced_service("nope", "default", {"metadata": {"labels": {}}})
    assert missing.value.status == 404


def test_noop_writes_do_not_bump_resource_version(emu: ApiEmulator, core: Any) -> None:
    emu.create("services", service("web", labels={"a": "1"}))
    before = emu.resource_version
    same = core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"a": "1"}}})
    assert same.metadata.resource_version == before
    current = core.read_namespaced_service("web", "default")
    assert (
        core.replace_namespaced_service("web", "default", current).metadata.resource_version
        == before
    )
    emu.apply("services", service("web", labels={"a": "1"}))  # in-process, also a no-op
    assert emu.resource_version == before
    assert emu.patch("services", "web", {"metadata": {"labels": {"a": "2"}}})["metadata"][
        "resourceVersion"
    ] == str(int(before) + 1)


def test_delete_returns_object_or_status(emu: ApiEmulator, core: Any, disc: Any) -> None:
    emu.create("services", service("web"))
    emu.create("nodes", node("n1"))
    emu.create("endpointslices", slice_("web-1", "web", ["10.0.0.1"]))
    deleted = core.delete_namespaced_service("web", "default")
    assert (
        deleted.metadata.name == "web" and deleted.metadata.resource_version == emu.resource_version
    )
    status = core.delete_node("n1")
    assert status["status"] == "Success" and status["details"]["name"] == "n1"
    status = disc.delete_namespaced_endpoint_slice("web-1", "default")
    assert status["details"]["group"] == "discovery.k8s.io"
    with pytest.raises(ApiException) as info:
        core.delete_node("n1")
    assert info.value.status == 404


def test_in_process_helpers(emu: ApiEmulator) -> None:
    created = emu.create("svc", service("web"))
    assert created["kind"] == "Service" and created["metadata"]["resourceVersion"] == "2"
    created["metadata"]["labels"] = {"mutating": "the copy"}  # returned objects are copies
    assert emu.get("services", "web")["metadata"]["labels"] == {}
    lb = {**service("web"), "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}}
    assert emu.update("services", lb)["status"]["loadBalancer"]["ingress"]  # status settable
    assert [s["metadata"]["name"] for s in emu.list_objects("services", "default")] == ["web"]
    emu.delete("services", "web")
    assert emu.list_objects("services") == []


# --- watch -----------------------------------------------------------------------------------


def test_watch_delivers_added_modified_deleted(emu: ApiEmulator, core: Any) -> None:
    emu.create("services", service("old"))
    rv = core.list_service_for_all_namespaces().metadata.resource_version
    w = Collector(core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=5)
    emu.wait_for_watches(1, "services")
    created = core.create_namespaced_service("default", service("web"))
    core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"v": "2"}}})
    core.delete_namespaced_service("web", "default")

    assert w.next_change() == ("ADDED", "web")
    event = w.next()
    assert event["type"] == "MODIFIED" and isinstance(event["object"], client.V1Service)
    assert event["raw_object"]["kind"] == "Service"  # watch objects carry kind/apiVersion
    event_rv = event["raw_object"]["metadata"]["resourceVersion"]
    assert int(event_rv) > int(created.to_dict()["metadata"]["resource_version"])
    assert w.next_change() == ("DELETED", "web")
    assert w.watch.resource_version == emu.resource_version
    w.watch.stop()


def test_watch_without_rv_starts_with_synthetic_added(emu: ApiEmulator, core: Any) -> None:
    emu.create("nodes", node("n1"))
    emu.create("nodes", node("n2"))
    w = Collector(core.list_node, timeout_seconds=5)
    assert [w.next_change(), w.next_change()] == [("ADDED", "n1"), ("ADDED", "n2")]
    emu.create("nodes", node("n3"))
    assert w.next_change() == ("ADDED", "n3")
    w.watch.stop()


def test_watch_selector_transitions(emu: ApiEmulator, disc: Any) -> None:
    emu.create("endpointslices", slice_("web-1", "web", ["10.0.0.1"]))
    rv = emu.resource_version
    w = Collector(
        disc.list_endpoint_slice_for_all_namespaces,
        resource_version=rv,
        label_selector="kubernetes.io/service-name=web",
        timeout_seconds=5,
    )
    emu.wait_for_watches(1, "endpointslices")
    leave = {"metadata": {"labels": {"kubernetes.io/service-name": "other"}}}
    emu.patch("endpointslices", "web-1", leave)
    event = w.next()
    assert event["type"] == "DELETED"
    # Like the watch cache: previous content, but the resourceVersion of the change.
    assert event["object"].metadata.labels["kubernetes.io/service-name"] == "web"
    assert event["object"].metadata.resource_version == emu.resource_version
    emu.patch(
        "endpointslices", "web-1", {"metadata": {"labels": {"kubernetes.io/service-name": "web"}}}
    )
    assert w.next_change() == ("ADDED", "web-1")
    emu.create("endpointslices", slice_("db-1", "db", ["10.0.0.9"]))  # never matches
    emu.patch("endpointslices", "web-1", {"addressType": "IPv4", "endpoints": None})
    assert w.next_change() == ("MODIFIED", "web-1")
    w.watch.stop()


def test_watch_after_compact_raises_410(emu: ApiEmulator, core: Any) -> None:
    emu.create("nodes", node("n1"))
    rv = core.list_node().metadata.resource_version
    emu.create("nodes", node("n2"))
    emu.compact()
    emu.reset_counters()

    # With timeout_seconds the client does not retry: first ERROR 410 -> ApiException(410).
    with pytest.raises(ApiException) as info:
        list(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=5))
    assert info.value.status == 410
    assert info.value.reason == f"Expired: too old resource version: {rv} (4)"
    assert emu.count("watch", "nodes") == 1

    # Without it, Watch.stream retries once from the same (still expired) RV, then raises.
    with pytest.raises(ApiException) as again:
        list(watch.Watch().stream(core.list_node, resource_version=rv))
    assert again.value.status == 410
    assert emu.count("watch", "nodes") == 3

    # The recovery pyproxy must implement: relist, then watch from the list's RV.
    fresh = core.list_node().metadata.resource_version
    assert emu.count("list", "nodes") == 1
    w = Collector(core.list_node, resource_version=fresh, timeout_seconds=5)
    emu.wait_for_watches(1, "nodes")
    emu.create("nodes", node("n3"))
    assert w.next_change() == ("ADDED", "n3")
    w.watch.stop()


def test_error_event_with_deserialize_false_is_a_client_keyerror(
    emu: ApiEmulator, core: Any
) -> None:
    emu.create("nodes", node("n1"))
    emu.compact()
    emu.create("nodes", node("n2"))
    stream = watch.Watch().stream(
        core.list_node, resource_version="1", timeout_seconds=5, deserialize=False
    )
    with pytest.raises(KeyError, match="raw_object"):
        list(stream)


def test_history_window_evicts_old_rvs(core: Any) -> None:
    with ApiEmulator(history_size=3) as small, small.api_client() as api:
        core = client.CoreV1Api(api)
        for i in range(5):  # RVs 2..6; the window keeps 4..6, so 3 is the oldest usable
            small.create("nodes", node(f"n{i}"))
        events = list(watch.Watch().stream(core.list_node, resource_version="3", timeout_seconds=1))
        assert [e["object"].metadata.name for e in events] == ["n2", "n3", "n4"]
        with pytest.raises(ApiException) as info:
            list(watch.Watch().stream(core.list_node, resource_version="2", timeout_seconds=1))
        assert info.value.status == 410


def test_bookmarks_are_yielded_and_move_the_watch_rv(emu: ApiEmulator, core: Any) -> None:
    emu.create("services", service("web"))
    rv = emu.resource_version
    w = Collector(
        core.list_service_for_all_namespaces,
        resource_version=rv,
        allow_watch_bookmarks=True,
        timeout_seconds=5,
    )
    emu.wait_for_watches(1, "services")
    emu.create("nodes", node("n1"))  # moves the global RV without a Service event
    target = emu.resource_version
    while True:
        event = w.next()
        assert event["type"] == "BOOKMARK"
        if event["object"]["metadata"]["resourceVersion"] == target:
            break
    # The client does not deserialize bookmarks: object is the raw dict.
    assert event["object"] == {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": target},
    }
    assert w.watch.resource_version == target
    w.watch.stop()


def test_no_bookmarks_unless_asked(emu: ApiEmulator, core: Any) -> None:
    events = list(watch.Watch().stream(core.list_node, timeout_seconds=1))
    assert events == []


def test_timeout_seconds_ends_the_stream(emu: ApiEmulator, core: Any) -> None:
    emu.create("nodes", node("n1"))
    start = time.monotonic()
    events = list(watch.Watch().stream(core.list_node, timeout_seconds=1))
    assert 0.9 < time.monotonic() - start < 3
    assert [e["type"] for e in events] == ["ADDED"]
    assert emu.active_watches() == 0


def test_drop_connections_ends_the_stream(emu: ApiEmulator, core: Any) -> None:
    w = Collector(core.list_node)  # no timeout: only the drop can end it
    emu.wait_for_watches(1, "nodes")
    emu.drop_connections()
    w.join()
    assert isinstance(w.error, urllib3.exceptions.ProtocolError)
    assert emu.count("watch", "nodes") == 1  # Watch.stream did not reconnect by itself


def test_stall_makes_the_client_read_time_out(emu: ApiEmulator, core: Any) -> None:
    emu.create("nodes", node("n1"))
    emu.stall_watches(True)
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        list(
            watch.Watch().stream(
                core.list_node,
                allow_watch_bookmarks=True,
                timeout_seconds=1,
                _request_timeout=(2, 0.5),
            )
        )
    assert time.monotonic() - start < 2  # timeoutSeconds is not honoured by a hung server

    # Un-stalling releases what was held back.
    w = Collector(core.list_node, timeout_seconds=5)
    emu.wait_for_watches(1, "nodes")
    time.sleep(0.3)
    assert w.events.empty()
    emu.stall_watches(False)
    assert w.next_change() == ("ADDED", "n1")
    w.watch.stop()


def test_set_available_modes(emu: ApiEmulator, core: Any) -> None:
    w = Collector(core.list_node)
    emu.wait_for_watches(1, "nodes")
    emu.set_available(False)  # "503": the server answers but refuses
    w.join()
    assert isinstance(w.error, urllib3.exceptions.ProtocolError)
    with pytest.raises(ApiException) as info:
        core.list_node()
    assert info.value.status == 503
    assert status_of(info.value)["reason"] == "ServiceUnavailable"

    emu.set_available(True)
    emu.set_available(False, "reset")
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        core.list_node()
    assert emu.rejected_connections >= 1

    emu.set_available(True)
    emu.set_available(False, "refuse")
    with pytest.raises(urllib3.exceptions.MaxRetryError) as refused:
        core.list_node()
    assert isinstance(refused.value.reason, urllib3.exceptions.NewConnectionError)

    emu.set_available(True)  # same port again
    assert core.list_node().items == []


def test_too_large_resource_version(emu: ApiEmulator, core: Any) -> None:
    with pytest.raises(ApiException) as info:
        list(watch.Watch().stream(core.list_node, resource_version="999", timeout_seconds=5))
    assert info.value.status == 504 and "Too large resource version" in info.value.reason
    with pytest.raises(ApiException) as listed:
        core.list_node(resource_version="999")
    assert listed.value.status == 504


# --- raw protocol ----------------------------------------------------------------------------


def _read_chunked(sock: socket.socket, deadline: float) -> tuple[bytes, list[bytes]]:
    """Read one chunked response; returns (head, chunk payloads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    chunks: list[bytes] = []
    while time.monotonic() < deadline:
        while b"\r\n" not in rest:
            rest += sock.recv(65536)
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(rest) < size + 2:
            rest += sock.recv(65536)
        if size == 0:
            return head, chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
    raise AssertionError("stream did not end")


def _raw_get(emu: ApiEmulator, path: str) -> tuple[bytes, list[bytes]]:
    with socket.create_connection((emu.host, emu.port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAccept: application/json\r\n\r\n".encode())
        return _read_chunked(sock, time.monotonic() + 5)


def test_raw_watch_framing_is_one_event_per_chunk_and_line(emu: ApiEmulator) -> None:
    emu.create("nodes", node("n1"))
    emu.patch("nodes", "n1", {"metadata": {"labels": {"a": "b"}}})
    emu.delete("nodes", "n1")
    head, chunks = _raw_get(emu, "/api/v1/nodes?watch=1&resourceVersion=1&timeoutSeconds=1")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"Transfer-Encoding: chunked" in head and b"Content-Type: application/json" in head
    assert all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in chunks)
    events = [json.loads(c) for c in chunks]
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in events] == [
        ("ADDED", "2"),
        ("MODIFIED", "3"),
        ("DELETED", "4"),
    ]
    assert all(e["object"]["kind"] == "Node" and e["object"]["apiVersion"] == "v1" for e in events)


def test_raw_send_initial_events_ends_with_an_annotated_bookmark(emu: ApiEmulator) -> None:
    emu.create("nodes", node("n1"))
    query = "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
    _, chunks = _raw_get(emu, f"/api/v1/nodes?{query}&allowWatchBookmarks=true&timeoutSeconds=1")
    events = [json.loads(c) for c in chunks]
    assert [e["type"] for e in events][:2] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"] == {
        "resourceVersion": emu.resource_version,
        "annotations": {"k8s.io/initial-events-end": "true"},
    }


def test_raw_410_is_an_error_event_in_a_200_stream(emu: ApiEmulator) -> None:
    emu.create("nodes", node("n1"))
    emu.compact()
    head, chunks = _raw_get(emu, "/api/v1/nodes?watch=true&resourceVersion=1")
    assert head.startswith(b"HTTP/1.1 200")
    assert [json.loads(c) for c in chunks] == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 1 (3)",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]


def test_raw_status_bodies(emu: ApiEmulator) -> None:
    conn = http.client.HTTPConnection(emu.host, emu.port, timeout=5)

    def call(
        method: str, path: str, body: Obj | None = None, ctype: str = "application/json"
    ) -> tuple[int, Obj]:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    code, body = call("GET", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/x")
    assert (code, body["kind"], body["reason"], body["code"]) == (404, "Status", "NotFound", 404)
    assert body["details"] == {"name": "x", "group": "discovery.k8s.io", "kind": "endpointslices"}
    assert body["message"] == 'endpointslices.discovery.k8s.io "x" not found'
    code, body = call("POST", "/api/v1/nodes", node("n1"))
    assert code == 201 and body["kind"] == "Node"
    code, body = call("POST", "/api/v1/nodes", node("n1"))
    assert (code, body["reason"]) == (409, "AlreadyExists")
    code, body = call("GET", "/api/v1/nodes?labelSelector=a%20in%20(")
    assert (code, body["reason"]) == (400, "BadRequest")
    code, body = call("PATCH", "/api/v1/nodes/n1", {"metadata": {}}, "application/apply-patch+yaml")
    assert (code, body["reason"]) == (415, "UnsupportedMediaType")
    code, body = call("GET", "/api/v1/pods")
    assert (code, body["kind"], body["reason"]) == (404, "Status", "NotFound")
    code, body = call("POST", "/api/v1/namespaces/a/services", service("x", "b"))
    assert (code, body["reason"]) == (400, "BadRequest")
    conn.close()


# --- discovery and client plumbing -----------------------------------------------------------


def test_kubeconfig_and_discovery(emu: ApiEmulator, tmp_path: Path) -> None:
    emu.create("nodes", node("n1"))
    path = emu.write_kubeconfig(tmp_path / "kubeconfig")
    with config.new_client_from_config(config_file=str(path)) as api:
        assert [
            n.to_dict()["metadata"]["name"] for n in client.CoreV1Api(api).list_node().items
        ] == ["n1"]
        assert client.VersionApi(api).get_code().git_version.startswith("v1.")
        groups = client.ApisApi(api).get_api_versions().groups
        assert [g.name for g in groups] == ["discovery.k8s.io", "events.k8s.io",
                                           "networking.k8s.io"]
        dyn = dynamic.DynamicClient(api)
        slices = dyn.resources.get(api_version="discovery.k8s.io/v1", kind="EndpointSlice")
        assert slices.namespaced and slices.get().items == []
        cidrs = dyn.resources.get(api_version="networking.k8s.io/v1", kind="ServiceCIDR")
        assert not cidrs.namespaced and cidrs.get().items == []


def test_a_resource_can_be_left_unserved() -> None:
    # an API server older than the resource: 404 NotFound, as for any path it does not know
    with ApiEmulator(unserved=("servicecidrs",)) as emu, emu.api_client() as api:
        networking = client.NetworkingV1Api(api)
        with pytest.raises(client.ApiException) as err:
            networking.list_service_cidr()
        assert err.value.status == 404
        assert client.CoreV1Api(api).list_node().items == []  # the others are served


def test_request_counters(emu: ApiEmulator, core: Any) -> None:
    core.list_node()
    core.list_node(field_selector="metadata.name=x")
    core.create_node(node("n1"))
    assert emu.count("list", "nodes") == 2
    assert emu.count("create", "node") == 1
    assert emu.count(method="GET", path="/api/v1/nodes") == 2
    record = emu.requests[1]
    assert record.query == {"fieldSelector": "metadata.name=x"} and record.status == 200


def test_stop_closes_open_watches_and_joins_threads() -> None:
    baseline = threading.active_count()
    emu = ApiEmulator(bookmark_interval=0.1).start()
    api = emu.api_client()
    w = Collector(client.CoreV1Api(api).list_node, allow_watch_bookmarks=True)
    emu.wait_for_watches(1)
    started = time.monotonic()
    emu.stop()  # raises if a thread outlives it
    assert time.monotonic() - started < 2
    w.join()
    api.close()
    assert threading.active_count() <= baseline
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        client.CoreV1Api(emu.api_client()).list_node()


# --- selectors, without a server -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "labels", "expected"),
    [
        ("a=b", {"a": "b"}, True),
        ("a=", {"a": ""}, True),
        ("a!=b", {}, True),
        ("a notin (b)", {}, True),
        ("a in (b,c)", {}, False),
        ("a in (b, c)", {"a": "c"}, True),
        ("a in (b,)", {"a": ""}, True),
        ("!a", {"b": "1"}, True),
        ("a,b", {"a": "1"}, False),
        ("x.io/a>5", {"x.io/a": "7"}, True),
        ("x.io/a<5", {"x.io/a": "seven"}, False),
        (" a = b , c ", {"a": "b", "c": ""}, True),
    ],
)
def test_label_selector_semantics(text: str, labels: dict[str, str], expected: bool) -> None:
    assert parse_label_selector(text).matches(labels) is expected


@pytest.mark.parametrize("text", ["a in ()", "a in (b", "a=b=c", "a b", "=b", "a,", "-a=b", "a>b"])
def test_label_selector_rejects(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_label_selector(text)


def test_field_selector_escapes_and_operators() -> None:
    sel = parse_field_selector(r"metadata.name=a\,b,metadata.namespace!=kube-system")
    assert sel.matches({"metadata.name": "a,b", "metadata.namespace": "default"})
    assert not sel.matches({"metadata.name": "a,b", "metadata.namespace": "kube-system"})
    assert parse_field_selector("metadata.name==x").matches({"metadata.name": "x"})
    with pytest.raises(SelectorError):
        parse_field_selector("metadata.name")


_names = st.sampled_from(["a", "b", "app", "x.io/tier"])
_values = st.sampled_from(["", "1", "web", "db"])


@given(st.dictionaries(_names, _values), _names, _values, _values)
def test_label_selector_algebra(labels: dict[str, str], key: str, v1: str, v2: str) -> None:
    eq = parse_label_selector(f"{key}={v1}").matches(labels)
    assert parse_label_selector(f"{key}!={v1}").matches(labels) is not eq
    either = eq or parse_label_selector(f"{key}={v2}").matches(labels)
    assert parse_label_selector(f"{key} in ({v1},{v2})").matches(labels) is either
    assert parse_label_selector(f"{key} notin ({v1},{v2})").matches(labels) is not either
    assert parse_label_selector(key).matches(labels) is (key in labels)
    assert parse_label_selector(f"!{key}").matches(labels) is (key not in labels)


# --- cost of the client's model deserialization (informs the daemon design) -------------------


@pytest.mark.slow
def test_model_deserialization_cost_vs_raw_json(emu: ApiEmulator, core: Any) -> None:
    """Decoding a big list with the client's models vs. ``_preload_content=False`` + json.

    Size defaults to 10,000 Services (APIEMU_BENCH_SERVICES overrides). Prints the numbers;
    asserts only that raw JSON is clearly cheaper, which holds by a wide margin.
    """
    count = int(os.environ.get("APIEMU_BENCH_SERVICES", "10000"))
    for i in range(count):
        body = service(f"svc-{i}", f"ns-{i % 50}", {"app": f"a{i}"})
        body["spec"]["ports"].append({"name": "dns", "port": 53, "protocol": "UDP"})
        emu.create("services", body)

    # The CPU time of this thread, not the wall clock: the emulator serves from threads of
    # its own, and on a shared 2-core machine the wall clock is mostly the wait for a CPU
    # (best of two wall-clock rounds still failed once so: json.loads of 5.7 MB "took"
    # 0.72 s). This thread's CPU is the decoding work the comparison is about; the server's
    # work is the same list both ways. Best of two rounds, alternated, for a GC pass.
    fetch = raw_decode = model_total = float("inf")
    for _round in range(2):
        started = time.thread_time()
        raw = core.list_service_for_all_namespaces(_preload_content=False).data
        fetched = time.thread_time()
        items = json.loads(raw)["items"]
        decoded = time.thread_time()
        models = core.list_service_for_all_namespaces().items
        modelled = time.thread_time()
        fetch, raw_decode = min(fetch, fetched - started), min(raw_decode, decoded - fetched)
        model_total = min(model_total, modelled - decoded)

    print(
        f"\n{count} Services, {len(raw) / 1e6:.1f} MB, CPU of the client's thread: HTTP fetch "
        f"{fetch:.3f}s, json.loads {raw_decode:.3f}s, client models (fetch + deserialize) "
        f"{model_total:.3f}s"
    )
    assert len(items) == len(models) == count
    assert model_total > 2 * (fetch + raw_decode)
