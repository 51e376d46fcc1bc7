"""A partial sync that only adds and deletes elements goes to the kernel over raw netlink
(LibNftables.apply_elements, pyproxy/kernel/nlelements.py), in a real kernel (throwaway
namespaces): the table then lists as libnftables would have left it, a refused batch applies
nothing and is mended by the full sync that follows, as a refused libnftables one is."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import ClusterState, IPFamily, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.kernel.libnftables import LibNftables, NftError
from pyproxy.render import ops
from pyproxy.render.objects import VERDICT, SetDecl, Verdict, key_text
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.netlab import Lab, Netns
from testkit.nftns import libnft_in, listing

pytestmark = [pytest.mark.netns, requires_netns]

CONFIG = NodeConfig("node-a", node_ips=("192.168.50.1", "fd00:50::1"),
                    cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"))
NODES = [make_node("node-a", "zone-1"), make_node("node-b", "zone-2")]
SERVICES = {ServiceKey("ns", "web"), ServiceKey("ns", "dns")}
# The endpoints of both Services at each step: replaced (a pod restarted), one added, one
# gone, all gone, back. A step that changes how many there are also writes the pick chain of
# the new count (a chain shared by the Services with that many), through libnftables.
STEPS = [[1, 2, 3], [1, 2, 4], [5, 2, 4], [5, 6, 7], [5, 6, 7, 8], [5, 6, 8, 9], [6, 8, 9],
         [], [2], [3]]

_ids = itertools.count()


class Recording(LibNftables):
    """The kernel shell, keeping every script libnftables committed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.scripts: list[str] = []
        super().__init__(*args, **kwargs)

    def run(self, script: str) -> str:
        self.scripts.append(script)
        return super().run(script)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab() as the_lab:
        yield the_lab


@pytest.fixture
def twins(lab: Lab) -> Iterator[tuple[Netns, Netns]]:
    a, b = lab.add_ns(f"nlp-a{next(_ids)}"), lab.add_ns(f"nlp-b{next(_ids)}")
    yield a, b
    lab.del_ns(a)
    lab.del_ns(b)


def dual_stack(svc: dict[str, Any], v6: str, tweak: dict[str, Any]) -> None:
    svc["spec"].update(ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack",
                       clusterIPs=[svc["spec"]["clusterIP"], v6], **tweak)


def state(pods: list[int]) -> ClusterState:
    """A dual-stack NodePort Service (TCP, the endpoints map's concatenated keys and the
    NodePort verdict map) and a UDP one with an externalIP, both on the same pods."""
    objs: list[dict[str, Any]] = list(NODES)
    for name, ip, v6, tweak in [
            ("web", "10.96.0.10", "fd00:96::10", {"type": "NodePort"}),
            ("dns", "10.96.0.53", "fd00:96::53", {"externalIPs": ["192.0.2.53"]})]:
        svc = make_service("ns", name, lambda s, v=v6, t=tweak: dual_stack(s, v, t), ip=ip)
        if name == "dns":
            svc["spec"]["ports"][0]["protocol"] = "UDP"
        objs.append(svc)
        for family, address in (("IPv4", "10.244.1.{}"), ("IPv6", "fd00:244::{}")):
            eps = [ep(address.format(n), "node-b" if n % 2 else "node-a") for n in pods]
            objs.append(make_slice("ns", name, eps, family=family,
                                   tweak=(lambda s: s["ports"][0].update(protocol="UDP"))
                                   if name == "dns" else None))
    return build_state(objs)


@pytest.mark.parametrize("family", [IPFamily.IPv4, IPFamily.IPv6])
def test_element_only_partial_syncs_list_as_libnftables_leaves_them(
        twins: tuple[Netns, Netns], family: IPFamily) -> None:
    """Each step synced both ways (b: everything through libnftables): the two tables list
    alike after every step, and the steps that only edit elements sent no script to
    libnftables (the endpoints maps, the verdict maps, IPv4 and IPv6)."""
    a, b = twins
    nl = libnft_in(a.full, kind=Recording)
    assert isinstance(nl, Recording)
    over_netlink = FamilyProxier(family, CONFIG, nl)
    text = FamilyProxier(family, CONFIG, libnft_in(b.full, raw_elements=False))
    for proxier in (over_netlink, text):
        proxier.applier.clock = lambda: 0.0  # no stale chain deletions meanwhile
        proxier.sync(state(STEPS[0]))
    fam = family.nft_family
    element_only = 0
    for pods in STEPS[1:]:
        before = len(nl.scripts)
        for proxier in (over_netlink, text):
            result = proxier.sync(state(pods), changed=SERVICES)
            assert not result.full
        script = over_netlink.applier.last_script
        assert script == text.applier.last_script
        edits_only = all(" element " in line for line in script.splitlines())
        # nothing through libnftables exactly when the transaction only edits elements
        assert (len(nl.scripts) == before) == edits_only, script
        element_only += edits_only
        assert listing(a, fam) == listing(b, fam), pods
    assert element_only >= 5, element_only


def test_a_refused_batch_is_mended_by_the_next_full_sync(twins: tuple[Netns, Netns]) -> None:
    """An element deleted behind our back: the partial sync that deletes it is refused
    (ENOENT) as a whole, its additions not applied, and the full sync that follows a refused
    sync brings the table to where libnftables alone brings its twin."""
    a, b = twins
    nl = libnft_in(a.full, kind=Recording)
    proxier = FamilyProxier(IPFamily.IPv4, CONFIG, nl)
    proxier.sync(state([1, 2]))
    # the endpoints map's element (a slot) that holds 10.244.1.2, which the next step
    # replaces (deleted, then added with 10.244.1.3)
    name, key = next((name, key) for name, entries in proxier.desired.elements()
                     for key, value in entries
                     if not isinstance(value, Verdict) and "10.244.1.2" in value)
    a.run(["nft", f"delete element ip pyproxy {name} {{ {key_text(key)} }}"])
    before = listing(a)
    scripts = len(nl.scripts)
    with pytest.raises(NftError, match="ENOENT"):
        proxier.sync(state([1, 3]), changed=SERVICES)  # deletes 10.244.1.2, adds 10.244.1.3
    assert len(nl.scripts) == scripts  # refused over netlink, not through libnftables
    assert listing(a) == before  # all or nothing: 10.244.1.3 was not added either
    assert not proxier.applier.in_step
    assert proxier.sync(state([1, 3])).full
    twin = FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(b.full, raw_elements=False))
    twin.slot_orders = dict(proxier.slot_orders)
    twin.selections = dict(proxier.selections)
    twin.sync(state([1, 3]))
    assert listing(a) == listing(b)


def test_a_batch_is_all_or_nothing(twins: tuple[Netns, Netns]) -> None:
    a, _ = twins
    nft = libnft_in(a.full)
    nft.run("add table ip pyproxy\nadd set ip pyproxy spare { type ipv4_addr; }\n"
            "add map ip pyproxy pairs { type ipv4_addr . inet_service : verdict; }\n"
            "add chain ip pyproxy target\n")
    spare = SetDecl(("ipv4_addr",))
    pairs = SetDecl(("ipv4_addr", "inet_service"), VERDICT)
    declarations = {"spare": spare, "pairs": pairs}
    good = [ops.add(ops.Elements("spare", ((("10.0.0.1",), ()),))),
            ops.add(ops.Elements("pairs", ((("10.0.0.1", 80), Verdict("goto", "target")),)))]
    nft.apply_elements("ip", good, declarations)
    assert nft.list_elements("ip", "set", "spare") == [(("10.0.0.1",), ())]
    with pytest.raises(NftError, match="deleting elements from spare: ENOENT"):
        nft.apply_elements("ip", [
            ops.add(ops.Elements("spare", ((("10.0.0.2",), ()),))),
            ops.delete(ops.Elements("pairs", ((("10.0.0.1", 80), ()),))),
            ops.delete(ops.Elements("spare", ((("10.0.0.9",), ()),)))], declarations)
    assert nft.list_elements("ip", "set", "spare") == [(("10.0.0.1",), ())]
    assert len(nft.list_elements("ip", "map", "pairs") or ()) == 1
    nft.apply_elements("ip", [ops.delete(ops.Elements("pairs", ((("10.0.0.1", 80), ()),))),
                              ops.delete(ops.Elements("spare", ((("10.0.0.1",), ()),)))],
                       declarations)
    assert nft.list_elements("ip", "set", "spare") == []
    assert nft.list_elements("ip", "map", "pairs") == []

