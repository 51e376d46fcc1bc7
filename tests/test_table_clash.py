"""Nothing in pyproxy's own table can strand a node (issue 35, point 1): whatever a sync finds
under our table's name — a set where a map was, another key type, other flags, a base chain
of another kind, a clashing set that another chain refers to, a half-written table, an older
release's whole layout — it ends with exactly the table a fresh node gets, within that one
sync, at start and while running. In a namespace's kernel.

The two ways there (pyproxy/sync/applier.py): a table recording another layout than ours (its
comment) is replaced whole without trying to patch it; a table recording ours that a full
sync still cannot patch is replaced whole after the kernel refused the patch."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pyproxy.cluster.snapshot import build_state
from pyproxy.core.model import IPFamily
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope, SyncPlan
from pyproxy.render.objects import TABLE_COMMENT
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.netlab import Lab, Netns
from testkit.nftns import libnft_in, listing

pytestmark = [pytest.mark.netns, requires_netns]

CONFIG = NodeConfig("node-a", node_ips=("192.168.50.1",), cluster_cidrs=("10.244.0.0/16",))
OBJECTS = [
    make_node("node-a", "zone-1"),
    make_service("ns", "web", lambda s: (s["spec"].update(type="NodePort"),
                                         s["spec"]["ports"][0].update(nodePort=30080))),
    make_slice("ns", "web", [ep("10.244.1.1", "node-a"), ep("10.244.2.1", "node-b")]),
    make_service("ns", "db", ip="10.96.0.20"),
    make_slice("ns", "db", [ep("10.244.1.2", "node-a")]),
]
REPAIR = SyncPlan(Scope.FULL, Cause.REPAIR)
# The ruleset release 0.1.0 wrote at f78361a (before the layout was recorded; rendered by
# that commit's `pyproxy render -f examples/cluster.yaml --node node-a`): no service CIDRs,
# connection counters or localhost NodePort objects, a table comment of its own.
OLD_LAYOUT = Path(__file__).parent / "data" / "layout-f78361a.nft"

_ours = f'add table ip pyproxy {{ comment "{TABLE_COMMENT}"; }}'
_made_anew = "delete table ip pyproxy\nadd table ip pyproxy\n"
# What each clash leaves in the kernel, loaded with `nft -f` over whatever is there.
CLASHES: dict[str, str] = {
    "a set where a map was":
        _made_anew + "add set ip pyproxy service-ips "
                     "{ type ipv4_addr . inet_proto . inet_service; }",
    "a map where a set was":
        _made_anew + "add map ip pyproxy cluster-ips { type ipv4_addr : verdict; }",
    "another key type":  # the issue's own
        _made_anew + "add set ip pyproxy cluster-ips { type ipv4_addr . inet_service; }",
    "other flags":
        _made_anew + "add set ip pyproxy cluster-ips { type ipv4_addr; flags interval; }",
    "a base chain of another kind":
        _made_anew + "add chain ip pyproxy nat-prerouting "
                     "{ type filter hook prerouting priority 0; policy accept; }",
    "a clashing set another chain refers to":
        _made_anew + "add set ip pyproxy cluster-ips { type ipv4_addr . inet_service; }\n"
                     "add chain ip pyproxy old-check\n"
                     "add rule ip pyproxy old-check ip daddr . tcp dport @cluster-ips drop",
    # Our layout's comment, so patched first: the kernel refuses the patch, and the table is
    # then replaced within the same sync.
    "a half-written table of our layout":
        "delete table ip pyproxy\n" + _ours + "\n"
        "add set ip pyproxy cluster-ips { type ipv4_addr . inet_service; }\n"
        "add chain ip pyproxy services",
    "an older release's whole layout": "delete table ip pyproxy\n" + OLD_LAYOUT.read_text(),
}

_ids = itertools.count()


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab() as the_lab:
        yield the_lab


def _namespace(lab: Lab) -> Netns:
    return lab.add_ns(f"c{next(_ids)}")


@pytest.fixture
def ns(lab: Lab) -> Iterator[Netns]:
    created = _namespace(lab)
    yield created
    lab.del_ns(created)


@pytest.fixture(scope="module")
def fresh(lab: Lab) -> dict[str, Any]:
    """The table a node with nothing in its kernel gets."""
    created = _namespace(lab)
    try:
        proxier(created).sync(build_state(OBJECTS))
        return listing(created)
    finally:
        lab.del_ns(created)


def proxier(ns: Netns) -> FamilyProxier:
    return FamilyProxier(IPFamily.IPv4, CONFIG, libnft_in(ns.full))


def load(ns: Netns, clash: str) -> None:
    # `delete table` of a table that is not there fails the whole script: declared first
    ns.run(["nft", "-f", "-"], input="add table ip pyproxy\n" + clash + "\n")


@pytest.mark.parametrize("kind", list(CLASHES))
def test_at_start_the_first_sync_replaces_what_it_finds(ns: Netns, fresh: dict[str, Any],
                                                        kind: str) -> None:
    load(ns, CLASHES[kind])
    result = proxier(ns).sync(build_state(OBJECTS))
    assert result.replaced
    assert listing(ns) == fresh
    assert TABLE_COMMENT in ns.run(["nft", "list", "table", "ip", "pyproxy"]).stdout


@pytest.mark.parametrize("kind", list(CLASHES))
def test_while_running_the_repair_replaces_what_it_finds(ns: Netns, fresh: dict[str, Any],
                                                         kind: str) -> None:
    running = proxier(ns)
    state = build_state(OBJECTS)
    running.sync(state)
    load(ns, CLASHES[kind])
    result = running.sync(state, plan=REPAIR)  # what the change events ask for
    assert result.replaced
    assert listing(ns) == fresh
    assert running.applier.diff() == []
    # and the table is patched again from then on: a change is a partial sync
    changed = build_state([*OBJECTS[:-1], make_slice("ns", "db", [ep("10.244.1.3", "node-a")])])
    after = running.sync(changed)
    assert not after.full and after.replaced is None


def test_a_table_of_our_layout_is_patched_not_replaced(ns: Netns) -> None:
    """A restart finds its own table: patched, so that what packets filled in (affinity,
    connection counters) survives; only another layout's table is replaced."""
    proxier(ns).sync(build_state(OBJECTS))
    again = proxier(ns).sync(build_state(OBJECTS))
    assert again.full and again.replaced is None


def test_the_reason_names_the_layout_found_or_the_refusal(ns: Netns) -> None:
    load(ns, CLASHES["an older release's whole layout"])
    first = proxier(ns).sync(build_state(OBJECTS))
    assert first.replaced == "the table records another layout: 'rules for pyproxy'"
    load(ns, CLASHES["a half-written table of our layout"])
    second = proxier(ns).sync(build_state(OBJECTS))
    assert second.replaced is not None and "\n" not in second.replaced
    # libnftables' words: here its own evaluation against the set it found ("datatype
    # mismatch"), for other clashes the kernel's ("Could not process rule: File exists")
    assert second.replaced.startswith("the kernel refused a full sync: Error: ")
