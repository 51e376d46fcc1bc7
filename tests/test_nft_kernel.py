"""pyproxy's rulesets against a real kernel (in throwaway namespaces), without traffic:
every rendered ruleset loads, incremental syncs end where a fresh full load ends, a restart
adopts the existing table without losing affinity state, stale chains are removed, and the
elements a staged full sync adds over raw netlink (pyproxy/kernel/nlelements.py) are what
libnftables would have added."""

from __future__ import annotations

import itertools
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import IPFamily, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope, SyncPlan
from pyproxy.kernel import nlelements as nle
from pyproxy.kernel import nlsets
from pyproxy.kernel.libnftables import LibNftables, NftError, OwnSockets
from pyproxy.render import ops, staging
from pyproxy.render.objects import TABLE, ElementValue, Key, SetDecl
from pyproxy.render.ruleset import Structure
from pyproxy.render.staging import ElementChunk
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.inproc import call_in_netns
from testkit.netlab import Lab, Netns
from testkit.nftns import libnft_in, listing, render_script

pytestmark = [pytest.mark.netns, requires_netns]

CONFIG = NodeConfig("node-a", node_ips=("192.168.50.1", "fd00:50::1"),
                    cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"))
NODES = [make_node("node-a", "zone-1"), make_node("node-b", "zone-2")]


_ids = itertools.count()


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab() as the_lab:
        yield the_lab


@pytest.fixture
def ns(lab: Lab) -> Iterator[Netns]:
    created = lab.add_ns(f"k{next(_ids)}")
    yield created
    lab.del_ns(created)


# --- random snapshots always load ------------------------------------------------------------

ips = st.integers(1, 40).map(lambda i: f"10.244.{i % 3}.{i}")


@st.composite
def snapshots(draw: st.DrawFn) -> list[dict[str, Any]]:
    objs: list[dict[str, Any]] = [*NODES]
    for i in range(draw(st.integers(1, 5))):
        spec: dict[str, Any] = {
            "type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"])),
            "internalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local"])),
            "externalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local"])),
            "sessionAffinity": draw(st.sampled_from(["None", "ClientIP"])),
            "ports": [{"name": "http", "port": 80, "nodePort": 30000 + i,
                       "protocol": draw(st.sampled_from(["TCP", "UDP", "SCTP"]))}],
        }
        if draw(st.booleans()):
            spec["externalIPs"] = [f"192.0.2.{i + 1}"]
        if draw(st.booleans()):
            spec["loadBalancerSourceRanges"] = ["203.0.113.0/24", "192.168.50.0/24"]
        if draw(st.booleans()):
            spec["clusterIPs"] = [f"10.96.0.{i + 1}", f"fd00:96::{i + 1:x}"]
            spec["ipFamilies"] = ["IPv4", "IPv6"]

        def tweak(svc: dict[str, Any], spec: dict[str, Any] = spec, i: int = i) -> None:
            svc["spec"].update(spec)
            svc["status"] = {"loadBalancer": {"ingress": [{"ip": f"198.51.100.{i + 1}"}]}}

        objs.append(make_service("ns", f"s{i}", tweak, ip=f"10.96.0.{i + 1}"))
        eps = [ep(ip, draw(st.sampled_from(["node-a", "node-b"])), ready=draw(st.booleans()),
                  serving=True, terminating=draw(st.booleans()))
               for ip in draw(st.lists(ips, max_size=6, unique=True))]
        protocol = spec["ports"][0]["protocol"]
        objs.append(make_slice("ns", f"s{i}", eps, lambda s, p=protocol: s.update(
            ports=[{"name": "http", "port": 8080, "protocol": p}])))
    return objs


def render_text(objs: list[dict[str, Any]]) -> str:
    return render_script(build_state(objs), CONFIG, (IPFamily.IPv4, IPFamily.IPv6))


@given(snapshots())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_every_rendered_ruleset_is_accepted_by_nft_check(ns: Netns,
                                                         objs: list[dict[str, Any]]) -> None:
    result = ns.run(["nft", "-c", "-f", "-"], input=render_text(objs), check=False)
    assert result.returncode == 0, result.stderr


def test_example_snapshot_renders_and_loads(ns: Netns) -> None:
    from pathlib import Path

    from pyproxy.cluster.snapshot import load_snapshot

    state = load_snapshot(Path(__file__).parent.parent / "examples" / "cluster.yaml")
    ns.run(["nft", "-f", "-"], input=render_script(state, CONFIG,
                                                    (IPFamily.IPv4, IPFamily.IPv6)))
    assert "service-ips" in ns.run(["nft", "list", "table", "ip6", "pyproxy"]).stdout


# --- incremental == full -----------------------------------------------------------------


@given(st.lists(snapshots(), min_size=2, max_size=4))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_incremental_syncs_end_where_a_full_load_ends(lab: Lab,
                                                      steps: list[list[dict[str, Any]]]) -> None:
    a, b = lab.add_ns(f"inc-a{next(_ids)}"), lab.add_ns(f"inc-b{next(_ids)}")
    try:
        clock = [0.0]
        proxier = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(a.full))
        proxier.applier.clock = lambda: clock[0]
        proxier.sync(build_state(steps[0]))
        for objs in steps[1:]:
            state = build_state(objs)
            changed = {ServiceKey("ns", f"s{i}") for i in range(6)}
            result = proxier.sync(state, changed=changed)
            assert not result.full
            # our own commits never look like tampering (the store predicts the shape)
            assert proxier.applier.structure_intact()
        clock[0] += 10  # past the grace period: the flushed stale chains go now
        proxier.sync(state, changed=set())
        assert proxier.applier.structure_intact()
        fresh = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(b.full))
        # Endpoints keep their slots across changes (balancing.keep_slots): the full load
        # starts from the slot order the changes left.
        fresh.slot_orders = dict(proxier.slot_orders)
        fresh.selections = dict(proxier.selections)
        fresh.sync(build_state(steps[-1]))
        got, want = listing(a)["objects"], listing(b)["objects"]
        assert sorted(set(got) ^ set(want)) == []
    finally:
        lab.del_ns(a)
        lab.del_ns(b)


# --- restarts and stale chains -----------------------------------------------------------------


def affinity_objects(pods: list[str]) -> list[dict[str, Any]]:
    svc = make_service("ns", "sticky", lambda s: s["spec"].update(sessionAffinity="ClientIP"))
    return [*NODES, svc, make_slice("ns", "sticky", [ep(ip, "node-b") for ip in pods])]


def test_restart_adopts_the_table_and_keeps_affinity(ns: Netns) -> None:
    first = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(ns.full))
    first.sync(build_state(affinity_objects(["10.244.1.1", "10.244.1.2"])))
    (aff,) = [line.split()[1] for line in ns.run(["nft", "list", "sets", "ip"]).stdout.splitlines()
              if "affinity-" in line and "10.244.1.1" in line]
    ns.run(["nft", "add", "element", "ip", "pyproxy", aff, "{ 203.0.113.7 }"])
    # a new process (new applier, nothing in memory) takes over the same table
    second = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(ns.full))
    result = second.sync(build_state(affinity_objects(["10.244.1.1", "10.244.1.3"])))
    assert result.full
    assert "203.0.113.7" in ns.run(["nft", "list", "set", "ip", "pyproxy", aff]).stdout
    sets = ns.run(["nft", "list", "sets", "ip"]).stdout
    assert "10.244.1.2" not in sets and "10.244.1.3" in sets  # stale affinity set removed


def test_stale_chains_are_flushed_then_deleted(ns: Netns) -> None:
    clock = [100.0]
    proxier = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(ns.full))
    proxier.applier.clock = lambda: clock[0]
    objs = [*NODES, make_service("ns", "web"), make_slice("ns", "web", [ep("10.244.1.1")])]
    proxier.sync(build_state(objs))
    assert "cluster-tcp-1" in ns.run(["nft", "list", "chains", "ip"]).stdout
    objs[-1] = make_slice("ns", "web", [ep("10.244.1.1"), ep("10.244.1.2")])
    proxier.sync(build_state(objs), changed={ServiceKey("ns", "web")})
    chains = ns.run(["nft", "list", "chains", "ip"]).stdout
    assert "cluster-tcp-1" in chains and "cluster-tcp-2" in chains  # flushed, kept a while
    assert not ns.run(["nft", "list", "chain", "ip", "pyproxy", "cluster-tcp-1"]).stdout.count(
        "dnat")
    clock[0] += 2
    proxier.sync(build_state(objs), changed=set())
    assert "cluster-tcp-1" not in ns.run(["nft", "list", "chains", "ip"]).stdout


# --- the tamper check's reference: kept from our own commits, read only when checking ----------


class CountingReads(LibNftables):
    """libnftables in a namespace, counting the structure listings."""

    def __init__(self, netns: str) -> None:
        inner = libnft_in(netns)
        super().__init__(inner._factory)
        self.reads = 0

    def list_structure(self, family: str) -> Structure | None:
        self.reads += 1
        return super().list_structure(family)


def example_state() -> Any:
    """The example cluster, and a service for each balancing algorithm and weights."""
    from pathlib import Path

    from pyproxy.cluster.snapshot import parse_objects

    text = (Path(__file__).parent.parent / "examples" / "cluster.yaml").read_text()
    objs = parse_objects(text)
    pods = [ep(f"10.244.{n % 3}.{n}", "node-b") for n in range(1, 5)]
    for n, (algorithm, weights) in enumerate([("maglev", ""), ("round-robin", ""),
                                              ("source-hash", "10.244.1.1=3"),
                                              ("random", "10.244.2.2=0")]):
        def annotate(svc: dict[str, Any], a: str = algorithm, w: str = weights,
                     n: int = n) -> None:
            svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": a}
            if w:
                svc["metadata"]["annotations"]["service.pyproxy.io/endpoint-weights"] = w
            svc["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
            svc["spec"]["clusterIPs"] = [f"10.96.7.{n + 1}", f"fd00:96::7:{n + 1}"]
        objs += [make_service("bal", algorithm, annotate, ip=f"10.96.7.{n + 1}"),
                 make_slice("bal", algorithm, pods)]
    state = build_state(objs)
    assert {x.name for x in state.skipped if x.invalid} == {"broken"}  # the example's own
    return state


@pytest.mark.parametrize("family", [IPFamily.IPv4, IPFamily.IPv6])
def test_the_store_predicts_how_nft_lists_the_table(ns: Netns, family: IPFamily) -> None:
    """Every kind of chain and set there is (affinity, source ranges, eTP=Local, NodePorts,
    Maglev, round robin, …): the shape the check compares with after our own commits."""
    proxier = FamilyProxier(family, CONFIG, libnft_in(ns.full))
    proxier.sync(example_state())
    listed = proxier.applier.nft.list_structure(family.nft_family)
    assert listed is not None
    assert listed.shape == proxier.applier.expected_shape()
    # every element of every kind, listed as JSON, is the one the store holds
    assert proxier.applier.diff() == []


def test_our_own_commits_do_not_read_the_structure_back(ns: Netns) -> None:
    clock = [100.0]
    nft = CountingReads(ns.full)
    proxier = FamilyProxier(IPFamily.IPv4, CONFIG, nft)
    proxier.applier.clock = lambda: clock[0]
    objs = [*NODES, make_service("ns", "web"), make_slice("ns", "web", [ep("10.244.1.1")])]
    proxier.sync(build_state(objs))
    reads = nft.reads  # the full sync's names of leftover chains, nothing after the commit
    objs[-1] = make_slice("ns", "web", [ep("10.244.1.1"), ep("10.244.1.2")])
    proxier.sync(build_state(objs), changed={ServiceKey("ns", "web")})
    assert "add chain ip pyproxy cluster-tcp-2" in proxier.applier.last_script  # a new chain
    clock[0] += 2
    proxier.sync(build_state(objs), changed=set())  # our deletion of cluster-tcp-1
    assert "cluster-tcp-1" not in ns.run(["nft", "list", "chains", "ip"]).stdout
    assert nft.reads == reads
    assert proxier.applier.structure_intact()  # the check reads once, and keeps the listing
    assert nft.reads == reads + 1
    assert proxier.applier.committed_structure is not None
    assert not proxier.applier.structure_changed


def test_tampering_after_our_own_structure_change_is_found(ns: Netns) -> None:
    proxier = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(ns.full))
    objs = [*NODES, make_service("ns", "web"), make_slice("ns", "web", [ep("10.244.1.1")])]
    proxier.sync(build_state(objs))
    objs[-1] = make_slice("ns", "web", [ep("10.244.1.1"), ep("10.244.1.2")])
    proxier.sync(build_state(objs), changed={ServiceKey("ns", "web")})
    assert proxier.applier.structure_changed  # not read back
    ns.run(["nft", "flush", "chain", "ip", "pyproxy", "cluster-tcp-2"])
    assert not proxier.applier.structure_intact()
    assert proxier.applier.diff()[:1] == ["chain cluster-tcp-2: 0 rule(s), expected 2"]
    proxier.sync(build_state(objs), plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    proxier.applier.adopt_structure()
    ns.run(["nft", "add", "chain", "ip", "pyproxy", "intruder"])
    assert not proxier.applier.structure_intact()  # the exact comparison, as before


# --- elements over raw netlink ---------------------------------------------------------------


def raw_elements(netns: str, family: IPFamily, name: str) -> list[bytes]:
    """Every element of one set as the kernel dumps it (its attributes' bytes), sorted."""
    sock = call_in_netns(netns, nle.netlink_socket)
    out: list[bytes] = []
    with sock:
        sock.send(nlsets.dump_request(family, TABLE, name, 7))
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset < len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == nle.NLMSG_DONE:
                    return sorted(out)
                assert kind != nle.NLMSG_ERROR, f"dump of {name} refused"
                for attr, a, b in nle.attributes(data, offset + 20, offset + length):
                    if attr == nle.NFTA_SET_ELEM_LIST_ELEMENTS:
                        out += [data[x:y] for _, x, y in nle.attributes(data, a, b)]
                offset += (length + 3) & ~3


def loads_of(proxier: FamilyProxier) -> list[tuple[str, str, tuple[str, ...]]]:
    """Each static set of the proxier's store with its elements (what a staged sync loads)."""
    chunks = [t for t in staging.transactions(proxier.family.nft_family, proxier.desired,
                                              proxier.applier._commands(None), False,
                                              chunk=10**9)
              if isinstance(t, ElementChunk)]
    return [load for chunk in chunks for load in chunk.loads]


@pytest.mark.parametrize("family", [IPFamily.IPv4, IPFamily.IPv6])
def test_the_kernel_holds_what_libnftables_would_have_added(ns: Netns,
                                                            family: IPFamily) -> None:
    """Every kind of set and map the example renders (affinity, source ranges, eTP=Local,
    NodePorts, Maglev, …): loaded into an empty twin of each set by each way, the kernel's
    dumps are the same bytes (keys, data, verdicts, comments)."""
    nft = libnft_in(ns.full)
    proxier = FamilyProxier(family, CONFIG, nft)
    proxier.sync(example_state())
    fam = family.nft_family
    loads = loads_of(proxier)
    encoded, left = nle.encode_loads(loads)
    # everything but the interval sets (source ranges, ServiceCIDRs) goes over netlink
    assert {name for name, _, _ in left} <= {"firewall-allow", "service-cidrs"}
    assert {"service-ips", "endpoints-tcp", "hairpin", "cluster-ips"} <= {n for n, _ in encoded}
    nft.apply(fam, [ops.add(ops.Set(f"{name}-twin", decl))
                    for name, decl, _ in loads if name not in {n for n, _, _ in left}])
    nle.commit(call_in_netns(ns.full, nle.netlink_socket),
               nle.build_batch(fam, TABLE, [(f"{name}-twin", p) for name, p in encoded]))
    for name, _ in encoded:
        text_way = raw_elements(ns.full, family, name)
        assert text_way, name
        assert raw_elements(ns.full, family, f"{name}-twin") == text_way, name


@given(snapshots())
@settings(max_examples=15, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_a_staged_sync_over_netlink_lists_as_the_text_sync(lab: Lab,
                                                            objs: list[dict[str, Any]]) -> None:
    a, b = lab.add_ns(f"stg-a{next(_ids)}"), lab.add_ns(f"stg-b{next(_ids)}")
    try:
        state = build_state(objs)
        for family in (IPFamily.IPv4, IPFamily.IPv6):
            staged = FamilyProxier(family, CONFIG, libnft_in(a.full))
            staged.applier.stage_chunk = 3  # every few elements a transaction of their own
            staged.sync(state)
            assert "staged full sync" in staged.applier.last_script
            text = FamilyProxier(family, CONFIG, libnft_in(b.full, raw_elements=False))
            text.applier.stage_chunk = text.applier.stage_fresh = 10**9
            text.sync(state)
            got = listing(a, family.nft_family)["objects"]
            want = listing(b, family.nft_family)["objects"]
            assert sorted(set(got) ^ set(want)) == []
    finally:
        lab.del_ns(a)
        lab.del_ns(b)


def test_a_refused_batch_adds_nothing(ns: Netns) -> None:
    nft = libnft_in(ns.full)
    proxier = FamilyProxier(IPFamily.IPv4, CONFIG, nft)
    proxier.sync(example_state())
    nft.run("add set ip pyproxy spare { type ipv4_addr; }\n")
    chunk = ElementChunk((("spare", SetDecl(("ipv4_addr",)), _addresses("10.0.0.1", "10.0.0.2")),
                          ("no-such-set", SetDecl(("ipv4_addr",)), _addresses("10.0.0.3"))))
    encoded, _ = nle.encode_loads(chunk.loads)
    with pytest.raises(nle.BatchRefused, match="no-such-set: ENOENT"):
        nle.commit(call_in_netns(ns.full, nle.netlink_socket),
                   nle.build_batch("ip", TABLE, encoded))
    assert nft.list_elements("ip", "set", "spare") == []
    # the applier's kernel hands a refused chunk to libnftables, which refuses it in its words
    with capture_logs() as logs, pytest.raises(NftError, match="No such file"):
        nft.add_elements("ip", chunk)
    assert nft.list_elements("ip", "set", "spare") == []
    assert [e["event"] for e in logs] == ["raw_netlink_batch_refused"]
    assert nft._netlink is not None  # still used: the kernel, not the socket, said no
    # an accepted one adds everything, over netlink and (for what the encoder does not
    # understand) through libnftables
    nft.run("add set ip pyproxy ranges { type ipv4_addr; flags interval; }\n")
    nft.add_elements("ip", ElementChunk((
        ("spare", SetDecl(("ipv4_addr",)), _addresses("10.0.0.1", "10.0.0.2")),
        ("ranges", SetDecl(("ipv4_addr",), flags=("interval",)), _addresses("10.1.0.0/16")))))
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1", "10.0.0.2")
    assert nft.list_elements("ip", "set", "ranges") == _elements("10.1.0.0/16")


def test_a_failing_socket_leaves_the_elements_to_libnftables(ns: Netns) -> None:
    nft = libnft_in(ns.full)
    nft.run("add table ip pyproxy\nadd set ip pyproxy spare { type ipv4_addr; }\n")
    assert nft._netlink is not None
    nft._netlink.close()  # sending on it fails: EBADF
    with capture_logs() as logs:
        nft.add_elements("ip", _spare("10.0.0.1"))
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1")
    assert [e["event"] for e in logs] == ["raw_netlink_elements_off"]
    assert nft._netlink is None  # libnftables from now on
    nft.add_elements("ip", _spare("10.0.0.2"))
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1", "10.0.0.2")


class _HeldSocket:
    """The raw netlink socket, its sends held until `release` is set (a kernel that takes
    its time over a batch)."""

    def __init__(self, sock: Any, release: threading.Event) -> None:
        self.sock, self.release = sock, release

    def send(self, data: bytes) -> int:
        assert self.release.wait(30)
        return int(self.sock.send(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _spare_set(nft: LibNftables) -> None:
    nft.run("add table ip pyproxy\nadd set ip pyproxy spare { type ipv4_addr; }\n")


def _spare(*addresses: str, name: str = "spare") -> ElementChunk:
    return ElementChunk(((name, SetDecl(("ipv4_addr",)), _addresses(*addresses)),))


def _addresses(*addresses: str) -> tuple[tuple[Key, ElementValue], ...]:
    """Set elements, one address each."""
    return tuple(((address,), ()) for address in addresses)


def _elements(*addresses: str) -> list[tuple[Key, ElementValue]]:
    return list(_addresses(*addresses))


def test_in_a_bulk_the_next_chunk_is_made_while_the_kernel_takes_the_last(ns: Netns) -> None:
    """Inside a bulk (a staged full sync) add_elements hands the batch to a thread and
    returns: the caller encodes the next chunk while the kernel works. The answers are all
    in when the bulk ends, and transactions keep their order."""
    nft = libnft_in(ns.full)
    _spare_set(nft)
    release = threading.Event()
    nft._netlink = _HeldSocket(nft._netlink, release)  # type: ignore[assignment]
    threading.Timer(1.0, release.set).start()
    with nft.bulk():
        nft.add_elements("ip", _spare("10.0.0.1"))
        returned_while_held = not release.is_set()
        # the next chunk waits for the last one's answer before its own batch goes out
        nft.add_elements("ip", _spare("10.0.0.2"))
        assert release.is_set()
    assert returned_while_held
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1", "10.0.0.2")
    assert not [t for t in threading.enumerate() if t.name == "netlink-commit"]
    # outside a bulk: answered before it returns
    release.clear()
    threading.Timer(0.5, release.set).start()
    nft.add_elements("ip", _spare("10.0.0.3"))
    assert release.is_set()
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1", "10.0.0.2", "10.0.0.3")


def test_a_batch_refused_in_the_background_is_handled_as_one_refused_at_once(
        ns: Netns) -> None:
    nft = libnft_in(ns.full)
    _spare_set(nft)
    with capture_logs() as logs, pytest.raises(NftError, match="No such file"), nft.bulk():
        nft.add_elements("ip", _spare("10.0.0.1", name="no-such-set"))
        # the refusal is taken by the next call: libnftables refuses it in its words
        nft.run("add element ip pyproxy spare { 10.0.0.9 }\n")
    assert [e["event"] for e in logs] == ["raw_netlink_batch_refused"]
    assert nft.list_elements("ip", "set", "spare") == []
    # the socket failing in the background: libnftables adds that chunk and the rest
    nft._netlink.close()  # type: ignore[union-attr]
    with capture_logs() as logs, nft.bulk():
        nft.add_elements("ip", _spare("10.0.0.1"))
        nft.add_elements("ip", _spare("10.0.0.2"))
    assert [e["event"] for e in logs] == ["raw_netlink_elements_off"]
    assert nft._netlink is None
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1", "10.0.0.2")


def test_a_bulk_that_fails_waits_for_its_batch_in_flight(ns: Netns) -> None:
    """Nothing of a failed staged sync may reach the kernel after the failure is raised."""
    nft = libnft_in(ns.full)
    _spare_set(nft)
    release = threading.Event()
    nft._netlink = _HeldSocket(nft._netlink, release)  # type: ignore[assignment]
    threading.Timer(0.5, release.set).start()
    with pytest.raises(RuntimeError, match="render failed"), nft.bulk():
        nft.add_elements("ip", _spare("10.0.0.1"))
        raise RuntimeError("render failed")
    assert release.is_set()
    assert nft.list_elements("ip", "set", "spare") == _elements("10.0.0.1")


def test_its_commits_are_our_own(ns: Netns) -> None:
    """The change events of the netlink batches carry a port id the proxier knows as its
    own, or each staged sync would look like someone else's change to the table."""
    sockets = OwnSockets()
    nft = libnft_in(ns.full, sockets)
    assert nft._netlink is not None
    assert int(nft._netlink.getsockname()[0]) in sockets.current()
    nft.renew()
    assert int(nft._netlink.getsockname()[0]) in sockets.current()


def test_a_service_with_the_longest_names_loads(ns: Netns) -> None:
    """`ns/name:port` of a 63-character namespace and name and a 15-character port name is
    143 bytes; the kernel takes at most 128 in a comment (NFT_USERDATA_MAXLEN) and refuses the
    whole transaction otherwise (kubernetes#139515). Cut, the element loads (kubernetes#139516)."""
    namespace, name = "n" * 63, "s" * 63

    def tweak(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="NodePort", externalIPs=["192.0.2.9"],
                           ports=[{"name": "p" * 15, "port": 80, "nodePort": 30080,
                                   "protocol": "UDP"}])

    slice_ = make_slice(namespace, name, [ep("10.244.1.5", "node-a")], lambda s: s.update(
        ports=[{"name": "p" * 15, "port": 8080, "protocol": "UDP"}]))
    objs = [*NODES, make_service(namespace, name, tweak), slice_]
    ns.run(["nft", "-f", "-"], input=render_text(objs))
    listed = ns.run(["nft", "list", "map", "ip", "pyproxy", "service-ips"]).stdout
    assert f'comment "{namespace}/{name}:"' in listed  # 128 bytes: the port name is cut
