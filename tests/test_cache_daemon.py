"""The cache's change tracking and the sync core, with a fake libnftables."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from pyproxy.cluster.cache import ClusterCache
from pyproxy.cluster.resources import endpoint_slices_resource
from pyproxy.config import ProxyConfig
from pyproxy.core import protobuf
from pyproxy.core.model import IPFamily, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause
from pyproxy.core.wire import Unreadable
from pyproxy.kernel.libnftables import NftError, structure_of
from pyproxy.render import ops
from pyproxy.render.objects import Fragment, Item, Kind, SetDecl
from pyproxy.render.ruleset import Shape, Structure
from pyproxy.run import build_daemon
from pyproxy.sync.applier import Applier
from pyproxy.sync.node import NodeProxier
from pyproxy.sync.proxier import FamilyProxier
from testkit import protoenc
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fakes import FakeClock, FakeNft, fake_node_proxier

WEB = ServiceKey("ns", "web")


def svc(name: str = "web", **spec: Any) -> dict[str, Any]:
    return make_service("ns", name, lambda s: s["spec"].update(spec))


def eps(*ips: str, name: str = "web", slice_name: str | None = None) -> dict[str, Any]:
    return make_slice("ns", name, [ep(ip, "node-b") for ip in ips], name=slice_name)


def test_add_then_delete_costs_nothing() -> None:
    cache = ClusterCache("node-a")
    cache.set_service(("ns", "web"), svc())
    cache.set_service(("ns", "web"), None)
    assert cache.checkout().services == frozenset()


def test_update_and_revert_costs_nothing_but_a_real_change_counts() -> None:
    cache = ClusterCache("node-a")
    cache.set_service(("ns", "web"), svc())
    cache.set_slice(("ns", "web-1"), eps("10.244.1.1", slice_name="web-1"))
    assert cache.checkout().services == {WEB}
    cache.set_slice(("ns", "web-1"), eps("10.244.1.2", slice_name="web-1"))
    cache.set_slice(("ns", "web-1"), eps("10.244.1.1", slice_name="web-1"))
    assert not cache.checkout().services
    cache.set_slice(("ns", "web-1"), eps("10.244.1.3", slice_name="web-1"))
    out = cache.checkout()
    assert out.services == {WEB} and out.endpoint_changes == 1 and out.service_changes == 0


def test_invalid_update_keeps_the_last_valid_version() -> None:
    cache = ClusterCache("node-a")
    cache.set_service(("ns", "web"), svc())
    cache.checkout()
    skipped = cache.set_service(("ns", "web"), svc(clusterIP="10.96.0.999",
                                                   clusterIPs=["10.96.0.999"]))
    assert skipped is not None and skipped.invalid
    assert [str(p.name) for p in cache.state().ports] == ["ns/web:http"]
    assert not cache.checkout().services
    assert [s.object for s in cache.state().skipped] == ["Service ns/web"]
    cache.set_service(("ns", "web"), svc())
    assert not cache.state().skipped


def test_service_becoming_headless_is_removed() -> None:
    cache = ClusterCache("node-a")
    cache.set_service(("ns", "web"), svc())
    cache.set_service(("ns", "web"), svc(clusterIP="None", clusterIPs=["None"]))
    assert not cache.state().ports


def test_slices_merge_and_move_between_services() -> None:
    cache = ClusterCache("node-a")
    cache.set_slice(("ns", "s1"), eps("10.244.1.1", slice_name="s1"))
    cache.set_slice(("ns", "s2"), eps("10.244.1.2", slice_name="s2"))
    assert len(cache.state().slices[WEB]) == 2
    cache.checkout()
    cache.set_slice(("ns", "s2"), eps("10.244.1.2", name="other", slice_name="s2"))
    out = cache.checkout()
    assert out.services == {WEB, ServiceKey("ns", "other")}
    cache.set_slice(("ns", "s1"), None)
    assert WEB not in cache.state().slices


def test_node_labels() -> None:
    cache = ClusterCache("node-a")
    cache.set_service(("ns", "keys"), svc("keys", topologyKeys=["topology.kubernetes.io/zone"]))
    cache.set_service(("ns", "plain"), svc("plain"))
    cache.checkout()
    cache.set_node("node-a", make_node("node-a", "zone-1"))
    assert cache.checkout().topology_changed
    cache.set_node("node-a", make_node("node-a", "zone-1"))  # unchanged labels
    assert not cache.checkout().topology_changed
    cache.set_node("node-b", make_node("node-b", "zone-2"))
    out = cache.checkout()
    # Another node's labels decide which endpoints the keys service uses: select it again
    # (its ports and slices did not change, so only this can tell); the plain one is left.
    assert not out.topology_changed and out.services == {ServiceKey("ns", "keys")}
    assert cache.uses_node_labels()
    assert cache.checkout().services == frozenset()


def test_spillover_needs_other_nodes_labels() -> None:
    # Its region level reads other nodes' region labels: all Nodes are watched, and a
    # region label change there selects the service again.
    cache = ClusterCache("node-a")
    cache.set_service(("ns", "plain"), svc("plain"))
    assert not cache.uses_node_labels()
    spill = make_service("ns", "web", lambda s: s["metadata"].update(
        annotations={"service.pyproxy.io/topology-min-endpoints": "2"}))
    cache.set_service(("ns", "web"), spill)
    assert cache.uses_node_labels()
    cache.checkout()
    cache.set_node("node-b", make_node("node-b", "zone-2", **{
        "topology.kubernetes.io/region": "region-1"}))
    assert cache.has_pending() and cache.checkout().services == {WEB}


def test_an_unusable_annotation_is_warned_once_not_on_every_update() -> None:
    proxier, _, _ = make_proxier()

    def bad(**spec: Any) -> dict[str, Any]:
        return make_service("ns", "web", lambda s: (s["metadata"].update(
            annotations={"service.pyproxy.io/topology-min-endpoints": "lots"}),
            s["spec"].update(spec)))

    with capture_logs() as logs:
        proxier.on_service(("ns", "web"), bad())
        proxier.on_service(("ns", "web"), bad())  # a relist
        proxier.on_service(("ns", "web"), bad(sessionAffinity="ClientIP"))  # another change
    warnings = [e for e in logs if e["event"] == "service_annotation_ignored"]
    assert len(warnings) == 1, logs
    assert warnings[0]["service"] == "ns/web" and "'lots'" in warnings[0]["reason"]
    assert warnings[0]["log_level"] == "warning"
    assert proxier.cache.services()[WEB][0].topology_min_endpoints == 0  # ignored, not fatal


# --- the sync core ---------------------------------------------------------------------------


def make_proxier() -> tuple[NodeProxier, FakeNft, list[int]]:
    return fake_node_proxier()


def test_nothing_is_written_before_every_initial_list() -> None:
    proxier, nft, _ = make_proxier()
    proxier.on_service(("ns", "web"), svc())
    proxier.source_synced("Service")
    proxier.sync()
    assert not nft.scripts
    proxier.source_synced("EndpointSlice")
    proxier.sync()
    assert "add table ip pyproxy" in nft.last
    assert proxier.history[-1].full


def test_partial_sync_writes_only_the_change_and_failure_forces_full() -> None:
    proxier, nft, _ = make_proxier()
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.on_service(("ns", "web"), svc())
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.1", slice_name="web-1"))
    proxier.on_service(("ns", "db"), svc("db", clusterIP="10.96.0.20", clusterIPs=["10.96.0.20"]))
    proxier.sync()
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.2", slice_name="web-1"))
    proxier.sync()
    record = proxier.history[-1]
    assert not record.full and record.endpoints_changed == 1
    assert "10.244.1.2 . 8080" in nft.last and "10.96.0.20" not in nft.last
    nft.fail_next = 1
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.3", slice_name="web-1"))
    with pytest.raises(NftError):
        proxier.sync()
    assert proxier.history[-1].error
    proxier.sync()
    assert proxier.history[-1].full and "10.244.1.3 . 8080" in nft.last


def test_updates_failing_half_way_force_a_full_sync() -> None:
    # What a bug in selection or rendering looks like to the applier: some fragments are
    # already in its store when the stream raises, and the kernel was not written.
    nft = FakeNft()
    applier = Applier("ip", nft)
    applier.sync({"declared": _CLUSTER_IPS, "a": _elements("10.96.0.1")})
    assert applier.in_step

    def broken() -> Iterator[tuple[Hashable, Fragment]]:
        yield "a", _elements("10.96.0.2")
        raise RuntimeError("render bug")

    scripts = len(nft.scripts)
    with pytest.raises(RuntimeError):
        applier.sync(broken())
    assert len(nft.scripts) == scripts and not applier.in_step
    result = applier.sync({"b": _elements("10.96.0.3")})
    assert result.full and "10.96.0.2" in nft.last and "10.96.0.3" in nft.last


_CLUSTER_IPS = Fragment((Item(Kind.SET, "cluster-ips", "", SetDecl(("ipv4_addr",))),))


def _elements(*ips: str) -> Fragment:
    return Fragment(tuple(Item(Kind.ELEMENT, "cluster-ips", (ip,), ()) for ip in ips))


def test_periodic_sync_without_changes_writes_nothing() -> None:
    proxier, nft, _ = make_proxier()
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.sync()
    count = len(nft.scripts)
    proxier.sync()
    assert len(nft.scripts) == count


def test_invalid_objects_are_counted() -> None:
    proxier, _, _ = make_proxier()
    proxier.on_service(("ns", "bad"), svc("bad", ports=[{"name": "http", "port": "eighty"}]))
    assert proxier.skipped_total == {"Service": 1}


def test_an_undecodable_protobuf_object_is_skipped_as_a_malformed_json_one_is() -> None:
    """The same log line and the same count: an object cut short in a protobuf watch (an
    Unreadable) and a JSON one with a field of the wrong type."""
    proxier, _, _ = make_proxier()
    whole = protoenc.endpoint_slice(make_slice("ns", "web", [ep("10.244.1.1", "node-b")],
                                               name="web-1"))
    message = protobuf.unwrap(whole)
    cut = protoenc.envelope("discovery.k8s.io/v1", "EndpointSlice",
                            whole[message.start:message.end - 12])
    _, unreadable = endpoint_slices_resource().protobuf.event(  # type: ignore[union-attr]
        protoenc.watch_frame("ADDED", cut)[4:])
    assert type(unreadable) is Unreadable
    with capture_logs() as logs:
        proxier.on_slice(("ns", "web-1"), unreadable)
        proxier.on_slice(("ns", "web-2"), make_slice(
            "ns", "web", [ep("10.244.1.999", "node-b")], name="web-2"))
    assert proxier.skipped_total == {"EndpointSlice": 2}
    skipped = [(e["event"], e["object"]) for e in logs if e["log_level"] == "warning"]
    assert skipped == [("invalid_object_skipped", "EndpointSlice ns/web-1"),
                       ("invalid_object_skipped", "EndpointSlice ns/web-2")]


def test_an_unchanged_slice_event_is_not_a_change() -> None:
    cache = ClusterCache("node-a")
    piece = eps("10.244.1.1", slice_name="web-1")
    piece["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"}
    cache.set_slice(("ns", "web-1"), piece)
    assert cache.checkout().trigger_times == ("2026-01-01T00:00:00Z",)
    cache.set_slice(("ns", "web-1"), piece)  # a relist replays it
    out = cache.checkout()
    assert not out.services and not out.trigger_times


# --- the first sync ----------------------------------------------------------------------------


def test_only_the_last_initial_list_asks_for_the_first_sync() -> None:
    proxier, nft, requests = make_proxier()
    proxier.source_synced("Service")
    assert requests == []  # a sync now would find the cluster half-known
    assert proxier.sync() is False and not nft.scripts  # declined: nothing written
    proxier.source_synced("EndpointSlice")
    assert requests == [1]
    assert proxier.sync() is True and "add table ip pyproxy" in nft.last


def test_the_first_sync_runs_when_the_last_list_completes_not_min_sync_period_later() -> None:
    """upstream's OnServicesSynced/OnEndpointSlicesSynced: the first sync runs at once. Here
    the runner's periodic run at t=1 finds an initial list missing and declines; the last
    list completes at 1.25 and the first sync starts then, not at 2 (1 + minSyncPeriod)."""
    clock = FakeClock()
    nft = FakeNft()
    config = ProxyConfig(snapshot="unused.yaml", hostname_override="node-a",
                         min_sync_period=1.0, sync_period=1.0)
    daemon = build_daemon(config, interface_ips=("192.168.50.1",), kernel=lambda family: nft,
                          clock=clock)
    proxier, runner = daemon.proxier, daemon.runner
    for source in ("Service", "EndpointSlice"):
        proxier.expect(source)
    clock.at(0.5, lambda: proxier.source_synced("Service"))
    clock.at(1.25, lambda: proxier.source_synced("EndpointSlice"))
    stop = threading.Event()
    clock.at(1.75, stop.set)
    runner.loop(proxier.sync, stop)  # what the daemon's sync thread runs
    assert [r.cause for r in proxier.history] == [Cause.START]
    assert runner.stats().runs == 2  # the declined one at t=1, then the sync
    assert runner.stats().last_started == 1.25
    assert len(nft.scripts) == 1


def test_a_sync_record_ends_when_the_sync_returned_not_after_its_three_parts() -> None:
    """`seconds` adds up render, diff and kernel; what runs around them (the commit's wait,
    the housekeeping after it) is in `finished`, which the benches count to."""
    wall = [100.0]

    class SlowKernel(FakeNft):
        def apply(self, family: str, transaction: Sequence[ops.Op]) -> str:
            wall[0] += 2.0  # the kernel's answer takes two seconds of the wall clock
            return super().apply(family, transaction)

    proxier = NodeProxier(
        ClusterCache("node-a"),
        [FamilyProxier(IPFamily.IPv4, NodeConfig("node-a", node_ips=("192.168.50.1",)),
                       SlowKernel())],
        wall_clock=lambda: wall[0])
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.on_service(("ns", "web"), svc())
    proxier.sync()
    record = proxier.history[-1]
    assert record.started == 100.0 and record.finished >= 102.0
    assert record.seconds < 1.0  # the applier's own clock, not the fake wall clock


# --- someone else's changes to our tables --------------------------------------------------------


def initialized() -> tuple[NodeProxier, FakeNft, list[int]]:
    proxier, nft, requests = make_proxier()
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.on_service(("ns", "web"), svc())
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.1", slice_name="web-1"))
    proxier.sync()
    requests.clear()
    return proxier, nft, requests


def test_someone_elses_change_is_repaired_at_once_and_is_damage_until_then() -> None:
    proxier, nft, requests = initialized()
    assert proxier.damage() is None
    proxier.table_changed("ip pyproxy: chain services deleted")
    assert requests == [1]  # a sync, now
    assert proxier.damage() == ("table changed by someone else: ip pyproxy: chain services "
                                "deleted")
    proxier.sync()
    record = proxier.history[-1]
    assert record.full and record.cause is Cause.REPAIR and record.error is None
    assert "add table ip pyproxy" in nft.last
    assert proxier.damage() is None


def test_a_repair_the_kernel_refuses_stays_damage_and_says_why() -> None:
    proxier, nft, _ = initialized()
    proxier.table_changed("ip pyproxy: table deleted")
    nft.fail_next = 2  # the repair (a full sync), and the table replacement it then tries
    with pytest.raises(NftError):
        proxier.sync()
    assert proxier.damage() == ("table changed by someone else: ip pyproxy: table deleted; the "
                                "repair failed: Error: Could not process rule: Invalid argument "
                                "(injected)")
    proxier.sync()
    assert proxier.history[-1].full and proxier.damage() is None


class TamperedDuringCommit(FakeNft):
    """Someone changes the table while our commit runs: the report reaches the proxier
    after that sync started, so that sync cannot have repaired it."""

    def __init__(self) -> None:
        super().__init__()
        self.during_next_commit: list[Callable[[], None]] = []

    def apply(self, family: str, transaction: Sequence[ops.Op]) -> str:
        while self.during_next_commit:
            self.during_next_commit.pop()()
        return super().apply(family, transaction)


def test_a_change_reported_during_a_sync_is_repaired_by_the_next_one() -> None:
    nft = TamperedDuringCommit()
    requests: list[int] = []
    proxier = NodeProxier(ClusterCache("node-a"), [FamilyProxier(
        IPFamily.IPv4, NodeConfig("node-a", node_ips=("192.168.50.1",)), nft)],
        request_sync=lambda: requests.append(1))
    proxier.expect("Service")
    proxier.source_synced("Service")
    proxier.sync()
    proxier.table_changed("ip pyproxy: chain services deleted")
    nft.during_next_commit.append(lambda: proxier.table_changed("ip pyproxy: table deleted"))
    proxier.sync()  # repairs the first change; the second happened after it started
    assert proxier.damage() == "table changed by someone else: ip pyproxy: table deleted"
    proxier.sync()
    assert [r.cause for r in list(proxier.history)[-2:]] == [Cause.REPAIR, Cause.REPAIR]
    assert proxier.damage() is None


def test_a_change_before_the_first_sync_is_not_damage() -> None:
    proxier, _, requests = make_proxier()
    proxier.table_changed("ip pyproxy: table deleted")  # the previous run's table, say
    assert proxier.damage() is None and requests == []
    for source in ("Service", "EndpointSlice"):
        proxier.source_synced(source)
    proxier.sync()
    assert proxier.history[-1].cause is Cause.START


class KernelListing(FakeNft):
    """A fake that lists the table's structure as a terse `nft -j list ruleset` does, from
    the shape the applier expects, unless `tampered` says otherwise; it counts the reads."""

    def __init__(self) -> None:
        super().__init__()
        self.applier: Applier | None = None
        self.reads = 0
        self.tampered: Shape | None = None

    def list_structure(self, family: str) -> Structure | None:
        self.reads += 1
        assert self.applier is not None
        return terse_listing(family, self.tampered or self.applier.expected_shape())


def terse_listing(family: str, shape: Shape) -> Structure | None:
    where = {"family": family, "table": "pyproxy"}
    objects: list[dict[str, Any]] = [{"table": {"family": family, "name": "pyproxy"}}]
    for name in sorted(shape.sets):
        objects.append({"set": {**where, "name": name, "type": "ipv4_addr"}})
    for name, rules in sorted(shape.chains.items()):
        objects.append({"chain": {**where, "name": name}})
        objects += [{"rule": {**where, "chain": name, "expr": [{"counter": n}]}}
                    for n in range(rules)]
    return structure_of({"nftables": objects}, family)


def listing_proxier() -> tuple[NodeProxier, KernelListing, list[float]]:
    nft = KernelListing()
    now = [0.0]
    family = FamilyProxier(IPFamily.IPv4, NodeConfig("node-a", node_ips=("192.168.50.1",)), nft)
    nft.applier = family.applier
    family.applier.clock = lambda: now[0]
    proxier = NodeProxier(ClusterCache("node-a"), [family], clock=lambda: now[0], verify_period=30)
    proxier.expect("Service")
    proxier.source_synced("Service")
    proxier.on_service(("ns", "web"), svc())
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.1", slice_name="web-1"))
    proxier.sync()
    return proxier, nft, now


def test_the_structure_is_read_at_the_periodic_check_not_after_our_own_commits() -> None:
    proxier, nft, now = listing_proxier()
    reads = nft.reads
    # A service reaching an endpoint count no other has: a new shared pick chain.
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.1", "10.244.1.2", slice_name="web-1"))
    now[0] += 1
    proxier.sync()
    assert "add chain ip pyproxy cluster-tcp-2" in nft.last
    now[0] += 2  # past the grace period: our own deletion of cluster-tcp-1 (with a change,
    # so that this sync is not the periodic check's)
    proxier.on_service(("ns", "db"), svc("db", clusterIP="10.96.0.20", clusterIPs=["10.96.0.20"]))
    proxier.sync()
    assert "delete chain ip pyproxy cluster-tcp-1" in nft.scripts[-2]  # its own transaction
    assert nft.reads == reads  # neither commit read the structure back
    now[0] += 30  # the periodic check: one read, no repair
    proxier.sync()
    assert nft.reads == reads + 1
    assert proxier.history[-1].cause is Cause.CHANGES and proxier.damage() is None


def test_the_periodic_check_finds_tampering_after_our_own_structure_changes() -> None:
    proxier, nft, now = listing_proxier()
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.1", "10.244.1.2", slice_name="web-1"))
    proxier.sync()
    expected = proxier.proxiers[0].applier.expected_shape()
    nft.tampered = Shape({**expected.chains, "services": expected.chains["services"] - 1},
                         expected.sets)  # a rule deleted
    assert len(proxier.proxiers[0].applier.diff()) == 1
    assert proxier.proxiers[0].applier.diff()[0].startswith("chain services: ")
    now[0] += 30
    proxier.sync()
    assert proxier.history[-1].cause is Cause.REPAIR


def test_lost_events_check_the_structure_at_the_next_sync_even_with_changes() -> None:
    proxier, nft, now = listing_proxier()
    nft.tampered = Shape({}, frozenset())  # an empty table
    proxier.events_lost()
    proxier.on_slice(("ns", "web-1"), eps("10.244.1.3", slice_name="web-1"))  # pending
    now[0] += 1  # well within verify_period
    proxier.sync()
    assert proxier.history[-1].cause is Cause.REPAIR
    assert proxier.history[-1].full and "10.244.1.3" in nft.last


def test_a_node_event_reaches_the_node_hooks_without_a_sync() -> None:
    """The ToBeDeletedByClusterAutoscaler taint means no new rules, so no sync follows it:
    /healthz (health.set_node is such a hook) must learn it from the event itself."""
    proxier, nft, _ = make_proxier()
    seen: list[Any] = []
    proxier.on_node_change.append(seen.append)
    proxier.on_node(("", "node-a"), {"metadata": {"name": "node-a"}, "spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}]}})
    assert [n.taints for n in seen] == [("ToBeDeletedByClusterAutoscaler",)]
    assert not nft.scripts and not proxier.history  # no sync was needed for it
    proxier.on_node(("", "node-a"), None)
    assert seen[-1] is None
