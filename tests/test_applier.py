"""The applier against the stateful fake kernel (testkit/fakes.py): tamper repair, `diff`,
`trace --verify` and the drills' fault injection, without a namespace. The same behaviours
against the real kernel: tests/test_live.py, tests/test_nft_kernel.py."""

from __future__ import annotations

from typing import Any

import pytest

from pyproxy.cluster.cache import ClusterCache
from pyproxy.core.model import IPFamily, NodeConfig
from pyproxy.core.plan import Cause, Scope, SyncPlan
from pyproxy.kernel.libnftables import NftError
from pyproxy.kernel.nft import Applier, FaultyKernel, inject_faults, pending_faults
from pyproxy.serve.live import trace_in
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


def test_the_fake_kernel_applies_a_transaction_whole_or_not_at_all() -> None:
    nft = FakeKernel()
    nft.run("add table ip pyproxy\nadd set ip pyproxy s { type ipv4_addr; }\n"
            "add element ip pyproxy s { 10.0.0.1, 10.0.0.2 }\n")
    with pytest.raises(NftError, match="No such file or directory"):
        nft.run("add element ip pyproxy s { 10.0.0.3 }\nadd element ip pyproxy t { 10.0.0.4 }\n")
    assert nft.list_elements("ip", "set", "s") == ["10.0.0.1", "10.0.0.2"]
    assert nft.list_elements("ip", "set", "t") is None
    with pytest.raises(NftError, match="No such file or directory"):
        nft.run("delete element ip pyproxy s { 10.0.0.9 }\n")


def test_the_fake_kernel_refuses_what_the_kernel_refuses() -> None:
    nft = FakeKernel()
    nft.run("add table ip pyproxy\nadd chain ip pyproxy a\nadd chain ip pyproxy b\n"
            "add rule ip pyproxy a goto b\n"
            "add map ip pyproxy m { type ipv4_addr : verdict; }\n"
            "add element ip pyproxy m { 10.0.0.1 : goto b }\n"
            "add chain ip pyproxy nat-prerouting { type nat hook prerouting priority -100; }\n")
    refused = {
        "delete chain ip pyproxy b\n": "still referenced",  # by a rule and a map value
        "add element ip pyproxy m { 10.0.0.1 : goto a }\n": "Device or resource busy",
        "add chain ip pyproxy nat-prerouting { type nat hook prerouting priority 0; }\n":
            "Device or resource busy",  # a base chain's priority cannot change in place
        "flush chain ip pyproxy c\n": "No such file",
        "add rule ip pyproxy c counter\n": "No such file",
    }
    for script, error in refused.items():
        with pytest.raises(NftError, match=error):
            nft.run(script)
    nft.run("flush chain ip pyproxy a\ndelete element ip pyproxy m { 10.0.0.1 }\n"
            "delete chain ip pyproxy b\n")
    assert nft.list_names("ip") == (["a", "nat-prerouting"], ["m"])
    assert nft.get_element("ip", "m", "10.0.0.1") is None


# --- tamper repair, diff, verify ---------------------------------------------------------------


def test_a_fresh_table_is_intact_and_identical() -> None:
    proxier, nft = synced()
    assert applier(proxier).structure_intact()
    assert applier(proxier).diff() == []
    assert nft.list_structure("ip") is not None


@pytest.mark.parametrize("tamper, reported", [
    ("delete table ip pyproxy\n", "table ip pyproxy is missing"),
    ("flush chain ip pyproxy services\n", "chain services:"),
    ("add chain ip pyproxy intruder\n", "chain intruder: unexpected"),
    ("add set ip pyproxy intruder { type ipv4_addr; }\n", "set or map intruder: unexpected"),
])
def test_someone_elses_change_to_the_structure_is_found_and_repaired(tamper: str,
                                                                     reported: str) -> None:
    proxier, nft = synced()
    nft.run(tamper)
    assert not applier(proxier).structure_intact()
    assert any(reported in line for line in applier(proxier).diff()), applier(proxier).diff()
    proxier.table_changed(f"ip pyproxy: {tamper.strip()}")
    proxier.sync()
    assert proxier.history[-1].cause is Cause.REPAIR and proxier.history[-1].full
    assert applier(proxier).structure_intact() and applier(proxier).diff() == []
    assert proxier.damage() is None


def test_a_deleted_element_shows_in_diff_and_a_full_sync_puts_it_back() -> None:
    proxier, nft = synced()
    nft.run(f"delete element ip pyproxy cluster-ips {{ {VIP} }}\n")
    assert applier(proxier).structure_intact()  # elements are not part of the structure
    assert applier(proxier).diff() == [f"set cluster-ips: missing element {VIP}"]
    nft.run("add element ip pyproxy cluster-ips { 10.96.0.99 }\n")
    assert "set cluster-ips: unexpected element 10.96.0.99" in applier(proxier).diff()
    proxier.proxiers[0].sync(proxier.cache.state(), plan=SyncPlan(Scope.FULL, Cause.PERIODIC))
    assert applier(proxier).diff() == []


def test_trace_verify_compares_the_answer_with_the_kernel() -> None:
    proxier, nft = synced()
    query = {"src": "192.168.50.9", "dst": f"{VIP}:80/tcp", "verify": "1"}
    answer = trace_in(proxier.proxiers, query)
    assert answer["verified"] == [] and answer["candidates"]
    nft.run(f"delete element ip pyproxy endpoints-tcp {{ {VIP} . 80 . 0 }}\n")
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
    # when the kernel refuses a full sync (kernel/nft.py)
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
    assert nft.get_element("ip", "cluster-ips", "10.96.0.20") == "10.96.0.20"


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
    assert family.applier.state is family.state and len(family.state) > 0
    family.applier.cleanup()
    assert family.applier.state is family.state and len(family.state) == 0
    assert nft.list_names("ip") == ([], [])
