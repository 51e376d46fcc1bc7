"""Property tests: random (valid and broken) Services and EndpointSlices never crash conversion
or selection, and the selection invariants always hold."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyproxy.cluster.resources import SLICE_CODEC
from pyproxy.cluster.snapshot import build_state
from pyproxy.core.convert import convert_service
from pyproxy.core.convert_endpoints import convert_endpoint_slice
from pyproxy.core.model import Skipped
from pyproxy.core.topology import select_all

NODES = ["node-a", "node-b", "node-c"]
ZONES = ["zone-1", "zone-2"]
junk = st.one_of(st.none(), st.integers(), st.text(max_size=8), st.booleans(),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                      st.integers(), max_size=2))


def maybe_broken(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the valid value, sometimes junk of any type."""
    return st.one_of(valid, valid, valid, valid, junk)


ipv4 = st.builds(lambda a, b: f"10.244.{a}.{b}", st.integers(0, 3), st.integers(1, 20))
port_name = st.sampled_from(["http", "dns", ""])
protocol = st.sampled_from(["TCP", "UDP", "SCTP"])


@st.composite
def services(draw: st.DrawFn) -> dict[str, Any]:
    ports = draw(st.lists(st.fixed_dictionaries({
        "name": maybe_broken(port_name), "port": maybe_broken(st.integers(1, 65535)),
        "protocol": maybe_broken(protocol),
        "nodePort": maybe_broken(st.integers(30000, 32767))}), min_size=0, max_size=3))
    spec = {
        "type": maybe_broken(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"])),
        "clusterIP": maybe_broken(st.sampled_from(["10.96.0.1", "fd00:96::1", "None", ""])),
        "ports": ports,
        "internalTrafficPolicy": maybe_broken(st.sampled_from(["Cluster", "Local"])),
        "externalTrafficPolicy": maybe_broken(st.sampled_from(["Cluster", "Local"])),
        "externalIPs": maybe_broken(st.lists(st.sampled_from(["192.0.2.1", "bad"]), max_size=2)),
        "topologyKeys": maybe_broken(st.lists(st.sampled_from(
            ["kubernetes.io/hostname", "topology.kubernetes.io/zone", "*"]), max_size=3,
            unique=True)),
        "sessionAffinity": maybe_broken(st.sampled_from(["None", "ClientIP"])),
    }
    spec = {k: v for k, v in spec.items() if draw(st.booleans()) or k in ("clusterIP", "ports")}
    return {"kind": "Service", "metadata": {"namespace": "ns", "name": draw(maybe_broken(
        st.sampled_from(["svc", "svc2"])))}, "spec": spec}


@st.composite
def slices(draw: st.DrawFn, valid: bool = False) -> dict[str, Any]:
    maybe = (lambda strategy: strategy) if valid else maybe_broken
    endpoints = draw(st.lists(st.fixed_dictionaries({
        "addresses": maybe(st.lists(ipv4, min_size=1, max_size=1)),
        "conditions": st.fixed_dictionaries({}, optional={
            "ready": maybe(st.booleans()), "serving": st.booleans(),
            "terminating": st.booleans()}),
        "nodeName": maybe(st.sampled_from(NODES)),
        "zone": st.sampled_from(ZONES),
        "hints": st.fixed_dictionaries({}, optional={
            "forZones": st.lists(st.fixed_dictionaries({"name": st.sampled_from(ZONES)}),
                                 max_size=2),
            "forNodes": st.lists(st.fixed_dictionaries({"name": st.sampled_from(NODES)}),
                                 max_size=1)}),
    }), max_size=6))
    return {
        "kind": "EndpointSlice",
        "metadata": {"namespace": "ns", "name": draw(st.sampled_from(["s1", "s2"])),
                     "labels": {"kubernetes.io/service-name": draw(st.sampled_from(
                         ["svc", "svc2"]))}},
        "addressType": draw(maybe(st.just("IPv4"))),
        "ports": draw(st.lists(st.fixed_dictionaries({
            "name": maybe(port_name), "port": maybe(st.integers(1, 65535)),
            "protocol": protocol}), max_size=2)),
        "endpoints": endpoints,
    }


@given(junk | services())
@settings(max_examples=300)
def test_service_conversion_never_raises(obj: Any) -> None:
    result = convert_service(obj)
    assert isinstance(result, Skipped | tuple)


@given(junk | slices())
@settings(max_examples=300)
def test_slice_conversion_never_raises(obj: Any) -> None:
    convert_endpoint_slice(obj)


@given(slices() | slices(valid=True), st.sampled_from(["event", "page"]))
@settings(max_examples=300)
def test_a_slice_decoded_typed_converts_as_its_dicts_do(obj: Any, how: str) -> None:
    """The API's EndpointSlices are decoded by msgspec (pyproxy/core/wire.py); snapshot
    files and what does not fit the types come as dicts. Both give the same model, or the
    same reason to skip."""
    if how == "event":
        data = json.dumps({"type": "ADDED", "object": obj}).encode()
        typed = SLICE_CODEC.event(data)[1]
    else:
        data = json.dumps({"metadata": {}, "items": [obj]}).encode()
        typed = SLICE_CODEC.page(data)[1][0]
    assert convert_endpoint_slice(typed) == convert_endpoint_slice(obj)


@given(st.lists(services(), max_size=3), st.lists(slices(), max_size=4), st.sampled_from(NODES))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_selection_invariants(svcs: list[Any], eps: list[Any], node: str) -> None:
    nodes = [{"kind": "Node", "metadata": {"name": n, "labels": {
        "topology.kubernetes.io/zone": ZONES[i % 2]}}} for i, n in enumerate(NODES)]
    state = build_state([*nodes, *svcs, *eps])
    for ps in select_all(state, node):
        known = {e.key: e for e in state.endpoints(ps.port.name, ps.family)}
        sel = ps.selection
        cluster, local = sel.cluster or (), sel.local or ()
        reachable = {e.key for e in sel.all_reachable}
        for e in (*cluster, *local):
            assert e.key in known, "chosen ⊆ known endpoints"
            assert e.key in reachable, "every chosen endpoint is reachable"
        assert all(e.node_name == node for e in local), "local ⊆ endpoints on this node"
        if any(e.ready for e in known.values()):
            assert all(e.ready for e in cluster), "unready never chosen while one is ready"
        if any(e.ready and e.node_name == node for e in known.values()):
            assert all(e.ready for e in local)
        assert all(e.ready or (e.serving and e.terminating) for e in (*cluster, *local))
        if not sel.has_any_endpoints:
            assert not cluster and not local
        assert sel.reasons, "every decision is explained"
