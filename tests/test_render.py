"""Rendering and the slot store, without a kernel: which objects each service shape produces,
how shared pick chains are reference-counted, and what an incremental change emits."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.render import ops
from pyproxy.render.objects import (
    BASE_CHAIN_RULES,
    Fragment,
    Item,
    Kind,
    SetRef,
    Verdict,
    key_text,
    rule,
    value_text,
)
from pyproxy.render.ruleset import (
    Change,
    DesiredState,
    _block_difference,
    full_commands,
    incremental_commands,
)
from pyproxy.sync.proxier import SKELETON, fragments
from testkit.builders import ep, make_node, make_service, make_slice

CONFIG = NodeConfig("node-a", node_ips=("192.168.50.1",), cluster_cidrs=("10.244.0.0/16",))
NODES = [make_node("node-a", "zone-1"), make_node("node-b", "zone-1")]
A1, A2, B1 = "10.244.1.1", "10.244.1.2", "10.244.2.1"


def frag(tweak: Callable[[dict[str, Any]], None] | None, endpoints: list[dict[str, Any]],
         config: NodeConfig = CONFIG, family: IPFamily = IPFamily.IPv4) -> set[Item]:
    state = build_state([*NODES, make_service("ns", "svc", tweak),
                         make_slice("ns", "svc", endpoints)])
    assert not state.skipped, state.skipped
    out = fragments(state, config, family)
    return set(out[next(k for k in out if k != SKELETON)].items)


def elements(items: set[Item], container: str) -> dict[str, str]:
    """A container's elements as nft writes them: key → what follows the key."""
    return {key_text(i.key): value_text(i.value) for i in items
            if i.kind is Kind.ELEMENT and i.container == container}


def chains(items: set[Item]) -> dict[str, list[str]]:
    return {i.container: [r.text() for r in i.value] for i in items  # type: ignore[union-attr]
            if i.kind is Kind.CHAIN}


def lines(operations: list[ops.Op]) -> list[str]:
    """Operations as the nft commands they write."""
    return [ops.line("ip", op) for op in operations]


def spec(**kw: Any) -> Callable[[dict[str, Any]], None]:
    return lambda svc: svc["spec"].update(kw)


def on(ip: str, node: str, **kw: Any) -> dict[str, Any]:
    return ep(ip, node, "zone-1", **kw)


def test_cluster_ip_with_endpoints() -> None:
    items = frag(None, [on(A1, "node-a"), on(B1, "node-b")])
    assert elements(items, "service-ips") == {
        "10.96.0.10 . tcp . 80": ' comment "ns/svc:http" : goto cluster-tcp-2'}
    assert elements(items, "endpoints-tcp") == {
        "10.96.0.10 . 80 . 0": f" : {A1} . 8080", "10.96.0.10 . 80 . 1": f" : {B1} . 8080"}
    assert chains(items) == {"cluster-tcp-2": [
        "ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x00004000",
        "dnat ip to ip daddr . tcp dport . numgen random mod 2 map @endpoints-tcp"]}
    assert elements(items, "cluster-ips") == {"10.96.0.10": ""}
    # only this node's endpoints can reach themselves through it (as kube-proxy's set)
    assert set(elements(items, "hairpin")) == {f"{A1} . {A1}"}
    assert not elements(items, "no-endpoint-services")


def test_no_endpoints_rejects_every_entry() -> None:
    items = frag(spec(type="LoadBalancer", externalIPs=["192.0.2.1"],
                      ports=[{"name": "http", "port": 80, "nodePort": 30080}]), [])
    verdict = ' comment "ns/svc:http" : goto reject-chain'
    assert elements(items, "no-endpoint-services") == {
        "10.96.0.10 . tcp . 80": verdict, "192.0.2.1 . tcp . 80": verdict}
    assert elements(items, "no-endpoint-nodeports") == {"tcp . 30080": verdict}
    assert not chains(items) and not elements(items, "service-ips")


def test_internal_local_without_local_endpoints_drops() -> None:
    items = frag(spec(internalTrafficPolicy="Local"), [on(B1, "node-b")])
    assert elements(items, "no-endpoint-services") == {
        "10.96.0.10 . tcp . 80": ' comment "ns/svc:http" : drop'}
    assert not elements(items, "service-ips")


def test_internal_local_uses_local_endpoints() -> None:
    items = frag(spec(internalTrafficPolicy="Local"), [on(A1, "node-a"), on(B1, "node-b")])
    assert elements(items, "endpoints-tcp") == {"10.96.0.10 . 80 . 0": f" : {A1} . 8080"}


def test_external_cluster_policy_masquerades() -> None:
    items = frag(spec(type="NodePort", externalIPs=["192.0.2.1"],
                      ports=[{"name": "http", "port": 80, "nodePort": 30080}]),
                 [on(A1, "node-a"), on(B1, "node-b")])
    assert elements(items, "service-ips")["192.0.2.1 . tcp . 80"].endswith("goto external-tcp-2")
    assert elements(items, "service-nodeports")["tcp . 30080"].endswith("goto nodeport-tcp-2")
    assert elements(items, "nodeport-endpoints-tcp") == {
        "30080 . 0": f" : {A1} . 8080", "30080 . 1": f" : {B1} . 8080"}
    assert chains(items)["nodeport-tcp-2"] == [
        "meta mark set meta mark | 0x00004000",
        "dnat ip to tcp dport . numgen random mod 2 map @nodeport-endpoints-tcp"]


def test_external_local_policy_layout() -> None:
    items = frag(spec(type="NodePort", externalTrafficPolicy="Local",
                      ports=[{"name": "http", "port": 80, "nodePort": 30080}]),
                 [on(A1, "node-a"), on(A2, "node-a", ready=False), on(B1, "node-b")])
    # local endpoints first (index 0..L-1), then the cluster list from index L
    assert elements(items, "nodeport-endpoints-tcp") == {
        "30080 . 0": f" : {A1} . 8080", "30080 . 1": f" : {A1} . 8080",
        "30080 . 2": f" : {B1} . 8080"}
    assert chains(items)["nodeport-local-tcp-1-2"] == [
        "ip saddr 10.244.0.0/16 dnat ip to tcp dport . numgen random mod 2 offset 1 "
        "map @nodeport-endpoints-tcp",
        "fib saddr type local meta mark set meta mark | 0x00004000 dnat ip to tcp dport . "
        "numgen random mod 2 offset 1 map @nodeport-endpoints-tcp",
        "dnat ip to tcp dport . numgen random mod 1 map @nodeport-endpoints-tcp"]
    assert not elements(items, "no-endpoint-nodeports")


def test_external_local_without_local_endpoints_drops_outside_traffic() -> None:
    items = frag(spec(type="NodePort", externalTrafficPolicy="Local",
                      ports=[{"name": "http", "port": 80, "nodePort": 30080}]),
                 [on(B1, "node-b")])
    assert elements(items, "no-endpoint-nodeports") == {
        "tcp . 30080": ' comment "ns/svc:http" : drop'}
    rules = chains(items)["nodeport-local-tcp-0-1"]
    assert len(rules) == 2 and all("mod 1 offset" not in r for r in rules)


def test_load_balancer_source_ranges() -> None:
    def lb(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="LoadBalancer", loadBalancerSourceRanges=["203.0.113.0/24"],
                           ports=[{"name": "http", "port": 80, "nodePort": 30080}])
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"},
                                                      {"ip": "198.51.100.2", "ipMode": "Proxy"}]}}

    items = frag(lb, [on(A1, "node-a")])
    assert elements(items, "firewall-ips") == {"198.51.100.1 . tcp . 80": ""}
    assert set(elements(items, "firewall-allow")) == {"198.51.100.1 . tcp . 80 . 203.0.113.0/24"}
    assert "198.51.100.2 . tcp . 80" not in elements(items, "service-ips")  # ipMode Proxy
    # a source range holding the node's own address also allows the VIP as source
    node_in_range = NodeConfig("node-a", node_ips=("203.0.113.9",))
    items = frag(lb, [on(A1, "node-a")], config=node_in_range)
    assert "198.51.100.1 . tcp . 80 . 198.51.100.1" in elements(items, "firewall-allow")


def test_session_affinity_uses_per_service_chains() -> None:
    items = frag(spec(sessionAffinity="ClientIP",
                      sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
                 [on(A1, "node-a"), on(B1, "node-b")])
    (chain,) = chains(items)
    assert chain.startswith("service-") and chain.endswith("-ns/svc/tcp/http")
    rules = chains(items)[chain]
    assert rules[0] == "ip daddr 10.96.0.10 tcp dport 80 ip saddr != 10.244.0.0/16 meta mark " \
                       "set meta mark | 0x00004000"
    sets = [i for i in items if i.kind is Kind.SET]
    assert len(sets) == 2 and all(s.value.timeout == 60 for s in sets)
    assert rules[1].startswith("ip saddr @affinity-") and rules[1].endswith(
        f"dnat ip to {A1}:8080")
    assert rules[3].startswith("numgen random mod 2 == 0 update @affinity-")
    assert rules[4].startswith("update @affinity-") and rules[4].endswith(f"to {B1}:8080")


def test_ipv6() -> None:
    def dual(svc: dict[str, Any]) -> None:
        svc["spec"].update(clusterIPs=["10.96.0.10", "fd00:96::10"], ipFamilies=["IPv4", "IPv6"])

    state = build_state([*NODES, make_service("ns", "svc", dual),
                         make_slice("ns", "svc", [ep("fd00:244::1", "node-a")], family="IPv6")])
    cfg = NodeConfig("node-a", node_ips=("fd00:50::1",), cluster_cidrs=("fd00:244::/48",))
    out = fragments(state, cfg, IPFamily.IPv6)
    items = set(out[next(k for k in out if k != SKELETON)].items)
    assert elements(items, "endpoints-tcp") == {"fd00:96::10 . 80 . 0": " : fd00:244::1 . 8080"}
    assert chains(items)["cluster-tcp-1"][0].startswith("ip6 saddr != fd00:244::/48")
    skeleton_text = str(out[SKELETON])
    assert "ipv6_addr" in skeleton_text and "ip6 daddr" in skeleton_text


def test_protocols_get_their_own_maps() -> None:
    items = frag(spec(ports=[{"name": "dns", "port": 53, "protocol": "UDP"}]),
                 [on(A1, "node-a")],)
    assert not elements(items, "endpoints-udp")  # slice port is "http"/TCP: no endpoints
    items = frag(spec(ports=[{"name": "http", "port": 53, "protocol": "SCTP"}]), [])
    assert "10.96.0.10 . sctp . 53" in elements(items, "no-endpoint-services")


# --- counting new connections -----------------------------------------------------------------


def skeleton_of(config: NodeConfig, family: IPFamily) -> set[Item]:
    return set(fragments(build_state(NODES), config, family)[SKELETON].items)


def test_new_connections_are_counted_after_dnat_in_dynamic_sets() -> None:
    items = skeleton_of(CONFIG, IPFamily.IPv4)
    sets = {i.container: i.value for i in items if i.kind is Kind.SET
            and i.container.startswith("new-connections-")}
    assert sorted(sets) == [f"new-connections-{n}" for n in range(8)]
    assert all(v.body().startswith("type ipv4_addr . inet_proto . inet_service . ipv4_addr . "
                                   "inet_service; size 131072; flags dynamic;")
               and v.kind == "set" and v.dynamic for v in sets.values())
    rules = chains(items)["count-new-connections"]
    assert len(rules) == 3 * 8
    assert rules[3] == (
        "meta l4proto tcp ip daddr & 0.0.0.7 == 0.0.0.3 update @new-connections-3 { ct original "
        "ip daddr . meta l4proto . ct original proto-dst . ip daddr . th dport counter }")
    assert rules[8].startswith("meta l4proto udp ip daddr & 0.0.0.7 == 0.0.0.0 ")
    # reached from every hook after DNAT, by the first packet of a DNATed connection only
    jump = "ct status & (dnat | confirmed) == dnat jump count-new-connections"
    for chain in ("filter-input", "filter-forward", "filter-output-post-dnat"):
        assert BASE_CHAIN_RULES[chain][-1].text() == jump
    assert not any(jump in r.text() for c in ("filter-prerouting", "filter-output",
                                              "nat-prerouting", "nat-output", "nat-postrouting")
                   for r in BASE_CHAIN_RULES[c])


def test_new_connection_counters_in_ipv6_and_without_the_feature() -> None:
    six = NodeConfig("node-a", node_ips=("fd00:50::1",))
    rules = chains(skeleton_of(six, IPFamily.IPv6))["count-new-connections"]
    assert rules[5].startswith("meta l4proto tcp ip6 daddr & ::7 == ::5 update "
                               "@new-connections-5 { ct original ip6 daddr . meta l4proto")
    off = skeleton_of(replace(CONFIG, count_connections=False), IPFamily.IPv4)
    assert chains(off)["count-new-connections"] == []  # empty: the base chains still jump to it
    assert not any(i.container.startswith("new-connections-") for i in off)


def test_a_full_sync_does_not_flush_the_counters() -> None:
    state = DesiredState()
    state.set(SKELETON, fragments(build_state(NODES), CONFIG, IPFamily.IPv4)[SKELETON])
    text = full_commands("ip", state).text()
    assert "add set ip pyproxy new-connections-0 {" in text
    assert "flush set ip pyproxy new-connections" not in text
    assert "flush set ip pyproxy hairpin" in text  # the others are


# --- the slot store ---------------------------------------------------------------------------


def _frag(*items: Item) -> Fragment:
    return Fragment(tuple(items))


def test_shared_slots_are_reference_counted() -> None:
    chain = Item(Kind.CHAIN, "cluster-tcp-2", "", (rule("rule"),))
    state = DesiredState()
    change = Change()
    state.set("a", _frag(chain), change)
    state.set("b", _frag(chain), change)
    assert lines(incremental_commands("ip", change).rules) == [
        "add rule ip pyproxy cluster-tcp-2 rule"]
    change = Change()
    state.set("a", Fragment(), change)
    assert not incremental_commands("ip", change)  # b still uses it
    change = Change()
    state.set("b", Fragment(), change)
    cmds = incremental_commands("ip", change)
    assert lines(cmds.flush) == ["flush chain ip pyproxy cluster-tcp-2"]
    assert cmds.stale_chains == ["cluster-tcp-2"]


def test_an_item_twice_in_a_fragment_is_one_slot_of_one_owner() -> None:
    # e.g. the hairpin element of an endpoint IP serving two target ports
    hairpin = Item(Kind.ELEMENT, "hairpin", ("10.244.1.1", "10.244.1.1"), ())
    other = Item(Kind.ELEMENT, "hairpin", ("10.244.1.2", "10.244.1.2"), ())
    assert _frag(hairpin, other, hairpin).items == (hairpin, other)
    state = DesiredState()
    state.set("a", _frag(hairpin, other, hairpin), Change())
    state.set("a", _frag(other, hairpin), Change())
    change = Change()
    state.set("a", Fragment(), change)
    # counted twice, it would outlive its only owner
    assert state.value(hairpin[:3]) is None and len(state) == 0
    assert lines(incremental_commands("ip", change).delete_elements) == [
        "delete element ip pyproxy hairpin { 10.244.1.1 . 10.244.1.1, 10.244.1.2 . 10.244.1.2 }"]


def test_an_owner_changed_again_and_again_keeps_one_copy_of_its_fields() -> None:
    def fragment(generation: int) -> Fragment:
        # fresh string and tuple objects every time, as every render makes them
        stable = [Item(Kind.ELEMENT, "endpoints-tcp", (f"10.96.0.{1}", 80, i),
                       (f"10.244.{i // 250}.{i % 250}", 8080)) for i in range(2000)]
        return _frag(*stable, Item(Kind.ELEMENT, "m", ("k",), (generation,)))

    state = DesiredState()
    tracemalloc.start()
    try:
        state.set("a", fragment(0), Change())
        # measured from the second change on: the first fills CPython's free lists of
        # small tuples (up to 2,000 of each size), which tracemalloc counts as still in use
        state.set("a", fragment(1), Change())
        before, _ = tracemalloc.get_traced_memory()
        for generation in range(2, 6):
            state.set("a", fragment(generation), Change())
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A second copy of the 2,000 unchanged elements' fields would be ~350 kB.
    assert after - before < 50_000, after - before


def test_changed_element_value_is_deleted_and_added() -> None:
    state = DesiredState()
    state.set("a", _frag(Item(Kind.ELEMENT, "m", ("k",), Verdict("goto", "x"))), Change())
    change = Change()
    state.set("a", _frag(Item(Kind.ELEMENT, "m", ("k",), Verdict("goto", "y"))), change)
    cmds = incremental_commands("ip", change)
    assert lines(cmds.delete_elements) == ["delete element ip pyproxy m { k }"]
    assert lines(cmds.add_elements) == ["add element ip pyproxy m { k : goto y }"]
    assert cmds.text().index("delete element") < cmds.text().index("add element")


def test_conflicting_owners_resolve_deterministically() -> None:
    state = DesiredState()
    state.set("b", _frag(Item(Kind.ELEMENT, "m", ("k",), Verdict("goto", "y"))), Change())
    state.set("a", _frag(Item(Kind.ELEMENT, "m", ("k",), Verdict("goto", "x"))), Change())
    assert state.value((Kind.ELEMENT, "m", ("k",))) == Verdict("goto", "x")
    change = Change()
    state.set("a", Fragment(), change)
    assert change.after[(Kind.ELEMENT, "m", ("k",))] == Verdict("goto", "y")


def test_one_service_change_touches_only_its_slots() -> None:
    objs: list[dict[str, Any]] = [*NODES]
    for i in range(200):
        objs.append(make_service("ns", f"s{i}", ip=f"10.96.{i // 250}.{i % 250 + 1}"))
        objs.append(make_slice("ns", f"s{i}", [on(f"10.244.{i // 200}.{i % 200 + 1}", "node-b"),
                                               on(f"10.245.{i // 200}.{i % 200 + 1}", "node-b")]))
    state = DesiredState()
    for owner, f in fragments(build_state(objs), CONFIG, IPFamily.IPv4).items():
        state.set(owner, f, Change())
    objs[-1] = make_slice("ns", "s199", [on("10.244.9.9", "node-b"), on("10.244.9.8", "node-b"),
                                         on("10.244.9.7", "node-b")])
    new = fragments(build_state(objs), CONFIG, IPFamily.IPv4)
    change = Change()
    for owner, f in new.items():
        state.set(owner, f, change)
    cmds = incremental_commands("ip", change)
    text = cmds.text()
    assert "add chain ip pyproxy cluster-tcp-3" in text
    assert text.count("\n") <= 12, text
    assert "10.96.0.200 . tcp . 80" in text


def test_full_commands_declare_everything_once() -> None:
    state = DesiredState()
    out = fragments(build_state([*NODES, make_service("ns", "svc"),
                                 make_slice("ns", "svc", [on(A1, "node-a")])]), CONFIG,
                    IPFamily.IPv4)
    for owner, f in out.items():
        state.set(owner, f, Change())
    text = full_commands("ip", state).text()
    assert text.startswith("add table ip pyproxy")
    assert text.count("add chain ip pyproxy nat-prerouting {") == 1
    assert "flush map ip pyproxy service-ips" in text
    stale = full_commands("ip", state, existing_chains=["cluster-tcp-9", "services"])
    assert stale.stale_chains == ["cluster-tcp-9"]


def test_source_ranges_are_collapsed_and_a_catch_all_means_no_firewall() -> None:
    def lb(*ranges: str) -> Callable[[dict[str, Any]], None]:
        def apply(svc: dict[str, Any]) -> None:
            svc["spec"].update(type="LoadBalancer", loadBalancerSourceRanges=list(ranges),
                               ports=[{"name": "http", "port": 80, "nodePort": 30080}])
            svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}
        return apply

    items = frag(lb("10.0.0.0/8", "10.1.0.0/16"), [on(A1, "node-a")])
    assert set(elements(items, "firewall-allow")) == {"198.51.100.1 . tcp . 80 . 10.0.0.0/8"}
    assert not elements(frag(lb("0.0.0.0/0"), [on(A1, "node-a")]), "firewall-ips")


def test_node_port_with_no_cluster_endpoints_for_this_node_rejects() -> None:
    # iTP=Local keeps the service alive; topology keys leave no cluster endpoint here
    items = frag(spec(type="NodePort", internalTrafficPolicy="Local",
                      topologyKeys=["kubernetes.io/hostname"],
                      ports=[{"name": "http", "port": 80, "nodePort": 30080}]),
                 [ep(B1, "node-b", "zone-2")])
    assert elements(items, "no-endpoint-nodeports") == {
        "tcp . 30080": ' comment "ns/svc:http" : goto reject-chain'}
    assert not any(name.endswith("-0") for name in chains(items))


def test_a_range_holding_the_node_and_the_vip_is_one_interval() -> None:
    def lb(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="LoadBalancer", loadBalancerSourceRanges=["192.168.50.0/24"],
                           ports=[{"name": "http", "port": 80, "nodePort": 30080}])
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": "192.168.50.200"}]}}

    items = frag(lb, [on(A1, "node-a")])  # the node is 192.168.50.1
    assert set(elements(items, "firewall-allow")) == {
        "192.168.50.200 . tcp . 80 . 192.168.50.0/24"}


# --- a big owner's change, compared block by block ---------------------------------------------

CONTAINERS = [(Kind.ELEMENT, "hairpin"), (Kind.SET, "endpoints-tcp-1"),
              (Kind.CHAIN, "cluster-tcp-2"), (Kind.ELEMENT, "service-ips"),
              (Kind.ELEMENT, "endpoints-tcp-1")]


@st.composite
def big_owner_change(draw: st.DrawFn) -> tuple[list[Item], list[Item]]:
    """A big owner's items (runs per container, as a rendered service port) and a change of
    them: items removed, added anywhere, values changed, whole runs gone or new."""
    sizes = draw(st.lists(st.integers(0, 400), min_size=len(CONTAINERS),
                          max_size=len(CONTAINERS)))
    old = [Item(kind, container, f"k{i}", f"v{i}")
           for (kind, container), size in zip(CONTAINERS, sizes, strict=True)
           for i in range(size)]
    new = list(old)
    for _ in range(draw(st.integers(0, 6))):
        edit = draw(st.sampled_from(["remove", "add", "value", "run"]))
        at = draw(st.integers(0, max(0, len(new) - 1)))
        if edit == "remove" and new:
            del new[at]
        elif edit == "add":
            kind, container = new[at][:2] if new else CONTAINERS[0]
            new.insert(at, Item(kind, container, f"n{draw(st.integers(0, 10**6))}", "v"))
        elif edit == "value" and new:
            new[at] = new[at]._replace(value=new[at].value + "'")
        elif edit == "run":
            gone = draw(st.sampled_from(CONTAINERS))
            new = [item for item in new if item[:2] != gone]
    # rendered again: equal strings, other objects
    return old, [Item(kind, *((text + ".")[:-1] for text in rest))
                 for kind, *rest in dict.fromkeys(new)]


@given(big_owner_change())
@settings(max_examples=200)
def test_a_big_owners_change_is_what_the_item_by_item_comparison_finds(
        change: tuple[list[Item], list[Item]]) -> None:
    old, new = change
    flat_old, flat_new = tuple(itertools.chain.from_iterable(old)), tuple(
        itertools.chain.from_iterable(new))
    removed, added, stored = _block_difference(flat_old, flat_new)
    assert set(removed) == set(old) - set(new) and len(removed) == len(set(removed))
    assert set(added) == set(new) - set(old) and len(added) == len(set(added))
    assert stored == flat_new
    # An item that stays keeps the strings already stored.
    position = {item: i for i, item in enumerate(old)}
    for i, item in enumerate(new):
        if item in position:
            assert all(stored[4 * i + f] is flat_old[4 * position[item] + f] for f in range(4))


def test_a_big_owners_change_goes_through_the_store_as_a_small_ones() -> None:
    """One endpoint more in a 1,000-slot map: the store and the commands are those of the
    same change compared item by item."""
    slots = [Item(Kind.ELEMENT, "endpoints-tcp-1", ("10.96.0.1", 80, i),
                  (f"10.244.{i // 250}.{i % 250}", 8080)) for i in range(1000)]
    chain_item = Item(Kind.CHAIN, "cluster-tcp-1000", "", (rule("numgen random mod 1000 vmap",
                                                                SetRef("m")),))
    before = _frag(chain_item, *slots)
    after = _frag(chain_item._replace(container="cluster-tcp-1001", value=(rule("mod 1001"),)),
                  *slots,
                  Item(Kind.ELEMENT, "endpoints-tcp-1", ("10.96.0.1", 80, 1000),
                       ("10.244.9.9", 8080)))
    state, small = DesiredState(), DesiredState()
    state.set("big", before)
    for item in before.items:  # the same slots, each its own small owner
        small.set(item, _frag(item))
    change = Change()
    state.set("big", after, change)
    assert incremental_commands("ip", change).text() == (
        "add chain ip pyproxy cluster-tcp-1001\n"
        "flush chain ip pyproxy cluster-tcp-1000\n"
        "add rule ip pyproxy cluster-tcp-1001 mod 1001\n"
        "add element ip pyproxy endpoints-tcp-1 { 10.96.0.1 . 80 . 1000 : 10.244.9.9 . 8080 }\n")
    fresh = DesiredState()
    fresh.set("big", after)
    assert sorted(state.slots()) == sorted(fresh.slots())
