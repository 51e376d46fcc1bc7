"""ServiceCIDRs without a kernel: reading the objects, the cache and the sync core following
them, the rule and set they render, trace and explain, and the watch against the API
emulator (also one that does not serve them). Real packets: test_datapath.py and
test_daemon_e2e.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from pyproxy.cluster.cache import ClusterCache
from pyproxy.cluster.resources import service_cidrs_resource
from pyproxy.cluster.snapshot import build_state
from pyproxy.cluster.watch import Reflector
from pyproxy.core.convert import convert_service_cidr
from pyproxy.core.explain import explain_report, format_table
from pyproxy.core.model import IPFamily, Skipped
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.render.objects import Kind, SetDecl, key_text
from pyproxy.render.skeleton import render_config
from pyproxy.render.trace import trace
from pyproxy.sync.node import NodeProxier
from pyproxy.sync.proxier import SKELETON, desired_state, fragments
from testkit.apiemu import ApiEmulator
from testkit.builders import ep, make_node, make_service, make_service_cidr, make_slice
from testkit.fakes import FakeNft, fake_node_proxier

CONFIG = NodeConfig("node-a", node_ips=("192.168.50.1", "fd00:50::1"),
                    cluster_cidrs=("10.244.0.0/16",))
KUBERNETES = make_service_cidr("kubernetes", "10.96.0.0/16", "fd00:96::/108")


def deleting(obj: dict[str, Any]) -> None:
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"


# --- reading the objects -------------------------------------------------------------------


def test_a_service_cidr_is_its_cidrs_in_canonical_form() -> None:
    assert convert_service_cidr(KUBERNETES) == ("10.96.0.0/16", "fd00:96::/108")
    # written with host bits or uncompressed: the network, as nft will print it back
    odd = make_service_cidr("odd", "10.96.1.1/24", "FD00:0096:0:0::/108")
    assert convert_service_cidr(odd) == ("10.96.1.0/24", "fd00:96::/108")
    # one being deleted still counts until it is gone: its ClusterIPs may still be in use
    assert convert_service_cidr(make_service_cidr("old", "10.97.0.0/16", tweak=deleting)) == (
        "10.97.0.0/16",)
    assert convert_service_cidr(make_service_cidr("empty")) == ()


@pytest.mark.parametrize(("obj", "reason"), [
    (make_service_cidr("bad", "10.96.0.0/33"), "spec.cidrs[0]: '10.96.0.0/33' is not a CIDR"),
    (make_service_cidr("bad", "10.96.0.0/16", "fd00::%eth0/64"), "spec.cidrs[1]"),
    (make_service_cidr("bad", "0.0.0.0/0"), "covers every address"),
    (make_service_cidr("bad", "10.96.0.0/16", "fd00::/108", "10.97.0.0/16"), "limit of 2"),
    (make_service_cidr("bad", tweak=lambda o: o["spec"].update(cidrs="10.96.0.0/16")),
     "spec.cidrs: expected a list"),
    (make_service_cidr("Not_A_Name", "10.96.0.0/16"), "metadata.name"),
])
def test_a_bad_service_cidr_is_skipped_with_the_field_at_fault(obj: dict[str, Any],
                                                               reason: str) -> None:
    skipped = convert_service_cidr(obj)
    assert isinstance(skipped, Skipped) and skipped.invalid, skipped
    assert skipped.kind == "ServiceCIDR" and skipped.namespace == ""
    assert reason in skipped.reason
    assert isinstance(convert_service_cidr("not an object"), Skipped)


def test_a_snapshot_holds_service_cidrs() -> None:
    state = build_state([
        KUBERNETES, make_service_cidr("extra", "10.97.0.0/24", "10.96.0.0/16"),
        make_service_cidr("bad", "nope"), make_service("ns", "web")])
    assert state.service_cidrs == ("10.96.0.0/16", "10.97.0.0/24", "fd00:96::/108")
    assert [(s.object, s.invalid) for s in state.skipped] == [("ServiceCIDR bad", True)]


# --- the cache and the sync core -------------------------------------------------------------


def test_the_cache_follows_service_cidrs() -> None:
    cache = ClusterCache("node-a")
    assert cache.set_service_cidr("kubernetes", KUBERNETES) is None
    assert cache.has_pending()
    out = cache.checkout()
    assert out.service_cidrs_changed and not out.services
    assert cache.state().service_cidrs == ("10.96.0.0/16", "fd00:96::/108")
    cache.set_service_cidr("kubernetes", KUBERNETES)  # a relist: nothing changed
    assert not cache.has_pending()
    # another object with a CIDR already known changes nothing either
    cache.set_service_cidr("twin", make_service_cidr("twin", "10.96.0.0/16"))
    assert not cache.has_pending()
    # an invalid update keeps the last valid CIDRs in force, and is reported
    skipped = cache.set_service_cidr("kubernetes", make_service_cidr("kubernetes", "x"))
    assert isinstance(skipped, Skipped)
    assert cache.state().service_cidrs == ("10.96.0.0/16", "fd00:96::/108")
    assert [s.object for s in cache.state().skipped] == ["ServiceCIDR kubernetes"]
    cache.set_service_cidr("kubernetes", None)
    assert cache.has_pending() and cache.checkout().service_cidrs_changed
    assert cache.state().service_cidrs == ("10.96.0.0/16",)  # the twin's
    assert not cache.state().skipped
    cache.set_service_cidr("twin", None)
    assert cache.state().service_cidrs == ()


def make_proxier() -> tuple[NodeProxier, FakeNft, list[int]]:
    proxier, nft, requests = fake_node_proxier()
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    return proxier, nft, requests


def test_a_service_cidr_change_is_a_small_sync_of_its_elements() -> None:
    proxier, nft, requests = make_proxier()
    proxier.on_service(("ns", "web"), make_service("ns", "web"))
    proxier.on_slice(("ns", "web"), make_slice("ns", "web", [ep("10.244.1.1", "node-b")]))
    proxier.sync()
    assert "add set ip pyproxy service-cidrs" in nft.last  # declared, empty
    assert "add element ip pyproxy service-cidrs" not in nft.last
    asked = len(requests)
    proxier.on_service_cidr(("", "kubernetes"), KUBERNETES)
    assert len(requests) > asked  # a sync is requested
    proxier.sync()
    record = proxier.history[-1]
    assert not record.full and record.error is None
    assert nft.last.strip() == "add element ip pyproxy service-cidrs { 10.96.0.0/16 }"
    proxier.on_service_cidr(("", "wider"), make_service_cidr("wider", "10.96.0.0/15"))
    proxier.sync()
    # the old interval goes before the new one that covers it arrives
    assert nft.last.index("delete element ip pyproxy service-cidrs { 10.96.0.0/16 }") < \
        nft.last.index("add element ip pyproxy service-cidrs { 10.96.0.0/15 }")
    scripts = len(nft.scripts)
    proxier.on_service_cidr(("", "kubernetes"), KUBERNETES)  # a relist: nothing to do
    proxier.sync()
    assert len(nft.scripts) == scripts


def test_invalid_service_cidrs_are_counted_like_other_objects() -> None:
    proxier, _, _ = make_proxier()
    proxier.on_service_cidr(("", "bad"), make_service_cidr("bad", "10.96.0.0/99"))
    assert proxier.skipped_total == {"ServiceCIDR": 1}


# --- rendering, trace, explain -----------------------------------------------------------------


def objects(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [make_node("node-a", "zone-1"), make_service("ns", "web"),
            make_slice("ns", "web", [ep("10.244.1.1", "node-b")]), *extra]


def skeleton_items(family: IPFamily, *extra: dict[str, Any]) -> dict[tuple[Kind, str], list[str]]:
    items = fragments(build_state(objects(*extra)), CONFIG, family)[SKELETON].items
    out: dict[tuple[Kind, str], list[str]] = {}
    for item in items:
        out.setdefault((item.kind, item.container), []).append(
            key_text(item.key) if item.kind is Kind.ELEMENT else item.value)
    return out


def test_each_family_drops_its_own_cidrs_after_the_cluster_ip_check() -> None:
    extra = make_service_cidr("extra", "10.97.0.0/16", "10.96.0.0/24")  # inside kubernetes'
    v4 = skeleton_items(IPFamily.IPv4, KUBERNETES, extra)
    v6 = skeleton_items(IPFamily.IPv6, KUBERNETES, extra)
    # collapsed: the interval set refuses overlapping elements; 10.96/16 + 10.97/16 is a /15
    assert v4[(Kind.ELEMENT, "service-cidrs")] == ["10.96.0.0/15"]
    assert v6[(Kind.ELEMENT, "service-cidrs")] == ["fd00:96::/108"]
    assert v4[(Kind.SET, "service-cidrs")] == [
        SetDecl(("ipv4_addr",), flags=("interval",), comment="ServiceCIDRs")]
    assert [r.text() for r in v4[(Kind.CHAIN, "cluster-ips-check")][0]] == [
        'ip daddr @cluster-ips reject comment "invalid port of a ClusterIP"',
        'ip daddr @service-cidrs drop comment "unallocated ClusterIP"']
    # none known: the set stays empty, nothing is dropped
    assert (Kind.ELEMENT, "service-cidrs") not in skeleton_items(IPFamily.IPv4)


Traced = Callable[..., Any]


def tracer(*extra: dict[str, Any]) -> Traced:
    state = desired_state(build_state(objects(*extra)), CONFIG, IPFamily.IPv4)
    cfg = render_config(CONFIG, IPFamily.IPv4)
    return lambda dst, port=80, **kw: trace(state, cfg, "192.168.50.2", dst, port, "tcp", **kw)


def test_trace_drops_unallocated_addresses_of_service_cidrs() -> None:
    known = tracer(KUBERNETES)
    answer = known("10.96.0.99")
    assert answer.verdict == "DROP", answer
    assert "in ServiceCIDR 10.96.0.0/16 but no ClusterIP" in answer.steps[-1]
    assert ("service-cidrs", ("10.96.0.0/16",), ()) in answer.consulted  # for --verify
    assert known("10.96.0.10", 81).verdict == "REJECT"  # a ClusterIP's other port
    assert known("10.96.0.10").verdict == "DNAT"
    assert known("10.99.0.1").verdict == "NONE"  # outside every ServiceCIDR
    assert tracer()("10.96.0.99").verdict == "NONE"  # no ServiceCIDR known


def test_explain_lists_the_service_cidrs() -> None:
    report = explain_report(build_state(objects(KUBERNETES)), "node-a")
    assert report["serviceCIDRs"] == ["10.96.0.0/16", "fd00:96::/108"]
    assert not report["skipped"]  # no longer a "kind not used"
    assert "service CIDRs: 10.96.0.0/16, fd00:96::/108" in format_table(report)
    assert explain_report(build_state(objects()), "node-a")["serviceCIDRs"] == []


# --- the watch -------------------------------------------------------------------------------


def watching(emu: ApiEmulator) -> tuple[Reflector, dict[tuple[str, str], Any],
                                         threading.Event, threading.Event]:
    seen: dict[tuple[str, str], Any] = {}
    synced, stop = threading.Event(), threading.Event()

    def handle(key: tuple[str, str], obj: Any) -> None:
        if obj is None:
            seen.pop(key, None)
        else:
            seen[key] = obj

    refl = Reflector(emu.api_client(), service_cidrs_resource(), handle, synced.set, stop,
                     watch_timeout=30, read_timeout=5.0)
    refl._backoff.initial, refl._backoff.cap = 0.05, 0.2  # fast retries in tests
    threading.Thread(target=refl.run, daemon=True).start()
    return refl, seen, synced, stop


def wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_service_cidrs_are_listed_and_watched() -> None:
    with ApiEmulator(bookmark_interval=0.2) as emu:
        emu.create("ServiceCIDR", KUBERNETES)
        refl, seen, synced, stop = watching(emu)
        try:
            assert synced.wait(10)
            assert set(seen) == {("", "kubernetes")}
            emu.create("ServiceCIDR", make_service_cidr("extra", "10.97.0.0/16"))
            wait(lambda: ("", "extra") in seen)
            emu.delete("ServiceCIDR", "kubernetes")
            wait(lambda: ("", "kubernetes") not in seen)
            assert refl.status.errors == 0
        finally:
            stop.set()
            emu.drop_connections()


def test_a_server_without_the_api_means_none_known() -> None:
    # 404 (before Kubernetes 1.33): synced at once with nothing, no error retried in a loop;
    # the watch that follows stays quiet and asks again only when it times out.
    with ApiEmulator(bookmark_interval=0.2, unserved=("servicecidrs",)) as emu:
        refl, seen, synced, stop = watching(emu)
        try:
            assert synced.wait(10)
            wait(lambda: refl.status.watches >= 1)
            time.sleep(0.5)
            assert not seen and refl.status.errors == 0
            assert emu.count("list", "servicecidrs") == 1
            assert emu.count("watch", "servicecidrs") == 1
        finally:
            stop.set()
