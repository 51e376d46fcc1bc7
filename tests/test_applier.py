"""The applier against the stateful fake kernel (testkit/fakes.py): tamper repair, `diff`,
`trace --verify` and the drills' fault injection, without a namespace. The same behaviours
against the real kernel: tests/test_live.py, tests/test_nft_kernel.py."""

from __future__ import annotations

from typing import Any

import pytest

from pyproxy.cluster.cache import ClusterCache
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope, SyncPlan
from pyproxy.kernel.libnftables import NftError
from pyproxy.kernel.nft import FaultyKernel
from pyproxy.render import ops
from pyproxy.render.objects import VERDICT, Element, SetDecl, Verdict, rule
from pyproxy.serve.live import trace_in
from pyproxy.sync.applier import Applier, element_edits, inject_faults, pending_faults
from pyproxy.sync.node import NodeProxier
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_service, make_slice
from testkit.fakes import FakeKernel, FakeNft

VIP = "10.96.0.10"


def svc(name: str = "web", ip: str = VIP) -> dict[str, Any]:
    return make_service("ns", name, ip=ip)


def synced(nft: FakeKernel | None = None) -> tuple[NodeProxier, FakeKernel]:
    """A proxier with ns/web (one endpoint) committed to a fake kernel."""
    nft = nft or FakeNft()
    proxier = NodeProxier(ClusterCache("node-a"), [FamilyProxier(
        IPFamily.IPv4, NodeConfig("node-a", node_ips=("192.168.50.1",)), nft)])
    for source in ("Service", "EndpointSlice"):
        proxier.expect(source)
        proxier.source_synced(source)
    proxier.on_service(("ns", "web"), svc())
    proxier.on_slice(("ns", "web-1"), make_slice("ns", "web", [ep("10.244.1.1", "node-b")],
                                                 name="web-1"))
    proxier.sync()
    return proxier, nft


def applier(proxier: NodeProxier) -> Applier:
    return proxier.proxiers[0].applier


# --- the fake kernel itself ------------------------------------------------------------------


def _elements(*addresses: str) -> list[Element]:
    """Set elements, one address each."""
    return [((address,), ()) for address in addresses]


def _addresses(name: str, *addresses: str) -> ops.Elements:
    return ops.Elements(name, tuple(_elements(*addresses)))


def test_the_fake_kernel_applies_a_transaction_whole_or_not_at_all() -> None:
    nft = FakeKernel()
    nft.apply("ip", [ops.add(ops.Table()), ops.add(ops.Set("s", SetDecl(("ipv4_addr",)))),
                     ops.add(_addresses("s", "10.0.0.1", "10.0.0.2"))])
    with pytest.raises(NftError, match="No such file or directory"):
        nft.apply("ip", [ops.add(_addresses("s", "10.0.0.3")),
                         ops.add(_addresses("t", "10.0.0.4"))])
    assert nft.list_elements("ip", "set", "s") == _elements("10.0.0.1", "10.0.0.2")
    assert nft.list_elements("ip", "set", "t") is None
    with pytest.raises(NftError, match="No such file or directory"):
        nft.apply("ip", [ops.delete(_addresses("s", "10.0.0.9"))])


def test_the_fake_kernel_refuses_what_the_kernel_refuses() -> None:
    nft = FakeKernel()
    nat = ops.Chain("nat-prerouting", ("nat", "prerouting", -100))
    to_b = ops.Elements("m", ((("10.0.0.1",), Verdict("goto", "b")),))
    nft.apply("ip", [ops.add(ops.Table()), ops.add(ops.Chain("a")), ops.add(ops.Chain("b")),
                     ops.add(ops.Rule("a", rule(Verdict("goto", "b")))),
                     ops.add(ops.Set("m", SetDecl(("ipv4_addr",), VERDICT))), ops.add(to_b),
                     ops.add(nat)])
    refused = {
        ops.delete(ops.Chain("b")): "still referenced",  # by a rule and a map value
        ops.add(to_b._replace(elements=((("10.0.0.1",), Verdict("goto", "a")),))):
            "Device or resource busy",
        ops.add(nat._replace(base=("nat", "prerouting", 0))):
            "Device or resource busy",  # a base chain's priority cannot change in place
        ops.add(ops.Set("m", SetDecl(("ipv4_addr",), VERDICT, flags=("interval",)))):
            "File exists",  # a declaration cannot change in place
        ops.flush(ops.Chain("c")): "No such file",
        ops.add(ops.Rule("c", rule("counter"))): "No such file",
    }
    for op, error in refused.items():
        with pytest.raises(NftError, match=error):
            nft.apply("ip", [op])
    nft.apply("ip", [ops.flush(ops.Chain("a")), ops.delete(to_b), ops.delete(ops.Chain("b"))])
    assert nft.list_names("ip") == (["a", "nat-prerouting"], ["m"])
    assert nft.list_elements("ip", "map", "m") == []


# --- tamper repair, diff, verify ---------------------------------------------------------------


def test_a_fresh_table_is_intact_and_identical() -> None:
    proxier, nft = synced()
    assert applier(proxier).structure_intact()
    assert applier(proxier).diff() == []
    assert nft.list_structure("ip") is not None


@pytest.mark.parametrize("tamper, reported", [
    (ops.delete(ops.Table()), "table ip pyproxy is missing"),
    (ops.flush(ops.Chain("services")), "chain services:"),
    (ops.add(ops.Chain("intruder")), "chain intruder: unexpected"),
    (ops.add(ops.Set("intruder", SetDecl(("ipv4_addr",)))), "set or map intruder: unexpected"),
])
def test_someone_elses_change_to_the_structure_is_found_and_repaired(tamper: ops.Op,
                                                                     reported: str) -> None:
    proxier, nft = synced()
    nft.apply("ip", [tamper])
    assert not applier(proxier).structure_intact()
    assert any(reported in line for line in applier(proxier).diff()), applier(proxier).diff()
    proxier.table_changed(f"ip pyproxy: {ops.line('ip', tamper)}")
    proxier.sync()
    assert proxier.history[-1].cause is Cause.REPAIR and proxier.history[-1].full
    assert applier(proxier).structure_intact() and applier(proxier).diff() == []
    assert proxier.damage() is None


def test_a_deleted_element_shows_in_diff_and_a_full_sync_puts_it_back() -> None:
    proxier, nft = synced()
    nft.apply("ip", [ops.delete(_addresses("cluster-ips", VIP))])
    assert applier(proxier).structure_intact()  # elements are not part of the structure
    assert applier(proxier).diff() == [f"set cluster-ips: missing element {VIP}"]
    nft.apply("ip", [ops.add(_addresses("cluster-ips", "10.96.0.99"))])
    assert "set cluster-ips: unexpected element 10.96.0.99" in applier(proxier).diff()
    proxier.proxiers[0].sync(proxier.cache.state(), plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    assert applier(proxier).diff() == []


def test_trace_verify_compares_the_answer_with_the_kernel() -> None:
    proxier, nft = synced()
    query = {"src": "192.168.50.9", "dst": f"{VIP}:80/tcp", "verify": "1"}
    answer = trace_in(proxier.proxiers, query)
    assert answer["verified"] == [] and answer["candidates"]
    nft.apply("ip", [ops.delete(ops.Elements("endpoints-tcp", (((VIP, 80, 0), ()),)))])
    problems = trace_in(proxier.proxiers, query)["verified"]
    assert len(problems) == 1 and problems[0].startswith("endpoints-tcp: expected "), problems
    assert problems[0].endswith("kernel has None")


def test_the_stale_chain_of_a_removed_service_is_deleted_after_the_grace() -> None:
    proxier, nft = synced()
    now = [0.0]
    applier(proxier).clock = lambda: now[0]
    proxier.on_service(("ns", "web"), None)
    proxier.sync()  # the shared pick chain of one endpoint is used by no one now
    assert "cluster-tcp-1" in nft.list_names("ip")[0]  # flushed, kept for the grace
    assert applier(proxier).structure_intact() and applier(proxier).diff() == []
    now[0] += 2
    proxier.proxiers[0].sync(proxier.cache.state(), plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    assert "cluster-tcp-1" not in nft.list_names("ip")[0]
    assert applier(proxier).structure_intact() and applier(proxier).diff() == []


# --- fault injection (the debug socket's /fault) -----------------------------------------------


def test_injected_faults_refuse_sync_transactions_and_then_stop() -> None:
    proxier, nft = synced()
    one = applier(proxier)
    assert pending_faults(one) == 0 and not isinstance(one.nft, FaultyKernel)
    # three: the partial sync's, then the full sync's and the table replacement it tries
    # when the kernel refuses a full sync (sync/applier.py)
    inject_faults(one, 3)
    assert isinstance(one.nft, FaultyKernel) and pending_faults(one) == 3
    before = nft.list_ruleset()
    proxier.on_service(("ns", "db"), svc("db", "10.96.0.20"))
    for _ in range(2):
        with pytest.raises(NftError, match="injected fault"):
            proxier.sync()
    assert nft.list_ruleset() == before and pending_faults(one) == 0
    proxier.sync()
    assert proxier.history[-1].full and proxier.history[-1].error is None
    assert (("10.96.0.20",), ()) in (nft.list_elements("ip", "set", "cluster-ips") or [])


def test_an_injected_fault_is_kept_for_a_sync_not_taken_by_a_stale_chain_cleanup() -> None:
    proxier, nft = synced()
    now = [0.0]
    applier(proxier).clock = lambda: now[0]
    proxier.on_service(("ns", "web"), None)
    proxier.sync()  # cluster-tcp-1 flushed, to be deleted after the grace
    now[0] += 2
    inject_faults(applier(proxier), 1)
    proxier.on_service(("ns", "db"), svc("db", "10.96.0.20"))
    with pytest.raises(NftError, match="injected fault"):
        proxier.sync()
    assert "cluster-tcp-1" not in nft.list_names("ip")[0]


def test_the_slot_store_is_the_proxiers_and_cleanup_empties_it_in_place() -> None:
    proxier, nft = synced()
    family = proxier.proxiers[0]
    assert family.applier.desired is family.desired and len(family.desired) > 0
    family.applier.cleanup()
    assert family.applier.desired is family.desired and len(family.desired) == 0
    assert nft.list_names("ip") == ([], [])


def test_a_partial_sync_of_element_edits_only_goes_to_apply_elements() -> None:
    """The endpoint replaced (a pod restarted): only the endpoints map's slot changes, and
    the transaction goes to the kernel's element path (raw netlink, in production) with the
    sets' declarations; one that flushes a chain goes to `apply`."""
    nft = FakeNft()
    proxier, _ = synced(nft)
    proxier.on_slice(("ns", "web-1"), make_slice("ns", "web", [ep("10.244.1.2", "node-b")],
                                                 name="web-1"))
    proxier.sync()
    assert nft.element_transactions == 1
    assert all(" element " in line for line in nft.last.splitlines()), nft.last
    assert nft.list_elements("ip", "map", "endpoints-tcp") == [
        (("10.96.0.10", 80, 0), ("10.244.1.2", 8080))]
    proxier.on_service(("ns", "web"), None)  # its pick chain, now unused, is flushed
    proxier.sync()
    assert nft.element_transactions == 1 and "flush chain" in nft.last


def test_element_edits_are_only_additions_and_deletions_of_declared_sets() -> None:
    proxier, _ = synced()
    desired = applier(proxier).desired
    edit = ops.delete(ops.Elements("endpoints-tcp", ((("10.96.0.10", 80, 0), ()),)))
    assert element_edits([edit], desired) == {
        "endpoints-tcp": desired.declaration("endpoints-tcp")}
    assert element_edits([edit, ops.flush(ops.Chain("services"))], desired) is None
    assert element_edits([ops.add(ops.Elements("nowhere", ()))], desired) is None
    assert element_edits([], desired) is None
