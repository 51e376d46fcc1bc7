"""Conversion of API objects into the model: valid objects, objects that are not proxied, and
bad input (skipped with a reason, never raised)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from structlog.testing import capture_logs

from pyproxy.core.convert import convert_service
from pyproxy.core.convert_endpoints import convert_endpoint_slice, convert_node
from pyproxy.core.goip import parse_cidr_sloppy, parse_ip_sloppy
from pyproxy.core.model import (
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    Skipped,
    SliceEndpoints,
    TrafficPolicy,
)
from testkit.builders import ep, make_node, make_service, make_slice, terminating

Obj = dict[str, Any]


def ports_of(svc: Obj) -> tuple[ServicePort, ...]:
    result = convert_service(svc)
    assert not isinstance(result, Skipped), result
    return result


def test_service_port_fields() -> None:
    def full(svc: Obj) -> None:
        svc["spec"].update(
            type="LoadBalancer",
            clusterIPs=["10.96.0.10", "fd00:96::a"],
            ipFamilies=["IPv4", "IPv6"],
            externalIPs=["192.0.2.1"],
            loadBalancerSourceRanges=[" 203.0.113.0/24 ", "2001:db8::/32"],
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
            externalTrafficPolicy="Local",
            internalTrafficPolicy="Cluster",
            healthCheckNodePort=32000,
            trafficDistribution="PreferClose",
            ports=[
                {"name": "http", "port": 80, "nodePort": 30080},
                {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
            ],
        )
        svc["status"] = {"loadBalancer": {"ingress": [
            {"ip": "198.51.100.1"}, {"ip": "198.51.100.2", "ipMode": "Proxy"},
            {"hostname": "lb.example.com"}]}}
        svc["metadata"]["annotations"] = {"service.kubernetes.io/topology-mode": "Auto"}

    http, dns = ports_of(make_service("ns", "svc", full))
    assert http.name == ServicePortName("ns", "svc", "http", Protocol.TCP)
    assert str(http.name) == "ns/svc:http"
    assert dns.protocol is Protocol.UDP and dns.node_port == 30053
    assert http.cluster_ips == ("10.96.0.10", "fd00:96::a")
    assert http.families() == (IPFamily.IPv4, IPFamily.IPv6)
    assert http.cluster_ip(IPFamily.IPv6) == "fd00:96::a"
    assert http.external_ips_of(IPFamily.IPv4) == ("192.0.2.1",)
    assert http.external_ips_of(IPFamily.IPv6) == ()
    assert http.load_balancer_vips(IPFamily.IPv4) == ("198.51.100.1",)  # Proxy mode left out
    assert http.source_ranges_of(IPFamily.IPv4) == ("203.0.113.0/24",)  # whitespace trimmed
    assert http.session_affinity and http.affinity_timeout == 60
    assert http.external_policy is TrafficPolicy.LOCAL
    assert http.health_check_node_port == 32000
    assert http.traffic_distribution == "PreferClose"
    assert http.topology_mode_annotation == "Auto"
    assert http.externally_accessible(IPFamily.IPv4)


def test_defaults() -> None:
    (port,) = ports_of(make_service("ns", "svc", lambda s: s["spec"]["ports"][0].pop("protocol")))
    assert port.protocol is Protocol.TCP
    assert not port.session_affinity and port.affinity_timeout == 10800
    assert port.internal_policy is TrafficPolicy.CLUSTER
    assert port.node_port == 0 and port.health_check_node_port == 0


def test_health_check_node_port_only_for_local_load_balancers() -> None:
    def tweak(svc: Obj) -> None:
        svc["spec"].update(
            type="NodePort", externalTrafficPolicy="Local", healthCheckNodePort=32000
        )

    (port,) = ports_of(make_service("ns", "svc", tweak))
    assert port.health_check_node_port == 0


def test_unnamed_single_port_and_client_ip_only_cluster_ip_field() -> None:
    def tweak(svc: Obj) -> None:
        del svc["spec"]["clusterIPs"]
        svc["spec"]["ports"] = [{"port": 80}]

    (port,) = ports_of(make_service("ns", "svc", tweak))
    assert port.name.port == "" and str(port.name) == "ns/svc"
    assert port.cluster_ips == ("10.96.0.10",)


def test_client_model_objects_convert_like_dicts() -> None:
    from kubernetes import client

    svc = client.V1Service(
        metadata=client.V1ObjectMeta(name="svc", namespace="ns"),
        spec=client.V1ServiceSpec(
            cluster_ip="10.96.0.10",
            cluster_ips=["10.96.0.10"],
            internal_traffic_policy="Local",
            ports=[client.V1ServicePort(name="http", port=80, protocol="TCP")],
        ),
    )
    (port,) = ports_of(svc)  # type: ignore[arg-type]
    assert port.internal_policy is TrafficPolicy.LOCAL
    eps = client.V1EndpointSlice(
        address_type="IPv4",
        metadata=client.V1ObjectMeta(
            name="svc-1", namespace="ns", labels={"kubernetes.io/service-name": "svc"}
        ),
        ports=[client.DiscoveryV1EndpointPort(name="http", port=8080, protocol="TCP")],
        endpoints=[
            client.V1Endpoint(
                addresses=["10.244.1.1"],
                node_name="node-a",
                conditions=client.V1EndpointConditions(ready=False, serving=True, terminating=True),
                hints=client.V1EndpointHints(for_zones=[client.V1ForZone(name="zone-1")]),
            )
        ],
    )
    piece = convert_endpoint_slice(eps)
    assert isinstance(piece, SliceEndpoints)
    (e,) = piece.endpoints
    assert (e.ready, e.serving, e.terminating) == (False, True, True)
    assert e.zone_hints == frozenset({"zone-1"})


NOT_PROXIED: list[tuple[str, Callable[[Obj], None], str]] = [
    ("headless", lambda s: s["spec"].update(clusterIP="None", clusterIPs=["None"]), "headless"),
    ("ExternalName", lambda s: s["spec"].update(type="ExternalName"), "ExternalName"),
    ("no cluster IP", lambda s: s["spec"].update(clusterIP="", clusterIPs=[]), "no cluster IP"),
    ("other proxy", lambda s: s["metadata"].update(
        labels={"service.kubernetes.io/service-proxy-name": "other"}), "another proxy"),
]


@pytest.mark.parametrize(("name", "tweak", "reason"), NOT_PROXIED, ids=[c[0] for c in NOT_PROXIED])
def test_services_not_proxied(name: str, tweak: Callable[[Obj], None], reason: str) -> None:
    result = convert_service(make_service("ns", "svc", tweak))
    assert isinstance(result, Skipped)
    assert not result.invalid
    assert reason in result.reason


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    def apply(obj: Obj) -> None:
        parts = path.split(".")
        target: Any = obj
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        last = parts[-1]
        if last.isdigit():
            target[int(last)] = value
        else:
            target[last] = value

    return apply


BAD_SERVICES: list[tuple[str, Callable[[Obj], None], str]] = [
    ("invalid cluster IP", _set("spec.clusterIPs", ["10.96.0.999"]), "spec.clusterIPs[0]"),
    ("cluster IP not a string", _set("spec.clusterIPs", [42]), "spec.clusterIPs[0]"),
    ("port out of range", _set("spec.ports.0.port", 70000), "spec.ports[0].port"),
    ("port missing", lambda s: s["spec"]["ports"][0].pop("port"), "spec.ports[0].port"),
    ("port is a string", _set("spec.ports.0.port", "80"), "spec.ports[0].port"),
    ("port is a bool", _set("spec.ports.0.port", True), "spec.ports[0].port"),
    ("unknown protocol", _set("spec.ports.0.protocol", "ICMP"), "unknown protocol"),
    ("ports not a list", _set("spec.ports", {"port": 80}), "spec.ports"),
    ("port entry not an object", _set("spec.ports", ["80"]), "spec.ports[0]"),
    ("two unnamed ports", _set("spec.ports", [{"port": 80}, {"port": 81}]), "required"),
    ("duplicate port names", _set("spec.ports", [{"name": "a", "port": 80},
                                                  {"name": "a", "port": 81}]), "duplicate"),
    ("port name with nft syntax", _set("spec.ports.0.name", 'x"; flush ruleset'), "port name"),
    ("name with nft syntax", _set("metadata.name", "a} ; flush ruleset"), "metadata.name"),
    ("namespace uppercase", _set("metadata.namespace", "NS"), "metadata.namespace"),
    ("name too long", _set("metadata.name", "a" * 64), "metadata.name"),
    ("invalid external IP", _set("spec.externalIPs", ["192.0.2.1/24"]), "spec.externalIPs[0]"),
    ("invalid source range", _set("spec.loadBalancerSourceRanges", ["1.2.3.4/33"]),
     "loadBalancerSourceRanges[0]"),
    ("unknown traffic policy", _set("spec.externalTrafficPolicy", "Nearest"),
     "externalTrafficPolicy"),
    ("unknown affinity", _set("spec.sessionAffinity", "Cookie"), "sessionAffinity"),
    ("affinity timeout too long", lambda s: s["spec"].update(
        sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 86401}}),
     "timeoutSeconds"),
    ("two IPv4 cluster IPs", _set("spec.clusterIPs", ["10.96.0.1", "10.96.0.2"]), "same family"),
    ("family mismatch", _set("spec.ipFamilies", ["IPv6"]), "ipFamilies[0]"),
    ("unknown type", _set("spec.type", "Magic"), "spec.type"),
    ("spec not an object", _set("spec", "nope"), "spec"),
    ("too many topology keys", _set("spec.topologyKeys", [f"k{i}" for i in range(17)]),
     "at most 16"),
    ("* not last", _set("spec.topologyKeys", ["*", "kubernetes.io/hostname"]), "last"),
    ("invalid topology key", _set("spec.topologyKeys", ["bad key!"]), "label key"),
    ("invalid annotation key", _set("metadata.annotations",
                                    {"service.pyproxy.io/topology-keys": "zone,\"}"}), "label key"),
    ("oversized port list", _set("spec.ports", [{"name": f"p{i}", "port": 1 + i}
                                                for i in range(1001)]), "limit"),
    ("labels with invalid value", _set("metadata.labels", {"a": "x y"}), "label value"),
]


@pytest.mark.parametrize(("name", "tweak", "field"), BAD_SERVICES, ids=[c[0] for c in BAD_SERVICES])
def test_bad_services_are_skipped_with_a_reason(
    name: str, tweak: Callable[[Obj], None], field: str
) -> None:
    result = convert_service(make_service("ns", "svc", tweak))
    assert isinstance(result, Skipped), result
    assert result.invalid
    assert field in result.reason
    assert result.object.startswith("Service ")


def test_non_object_inputs_never_raise() -> None:
    for junk in (None, 42, "text", [], {"metadata": 5}, {"spec": []}):
        assert isinstance(convert_service(junk), Skipped)
        assert isinstance(convert_endpoint_slice(junk), Skipped)
        assert isinstance(convert_node(junk), Skipped)


# --- EndpointSlices ------------------------------------------------------------------------


def test_slice_fields_and_defaults() -> None:
    piece = convert_endpoint_slice(make_slice("ns", "svc", [
        {"addresses": ["10.244.1.1"]},
        ep("10.244.1.2", "node-a", "zone-1", zones=["zone-1"], nodes=["node-a"]),
        terminating("10.244.1.3", "node-b"),
    ]))
    assert isinstance(piece, SliceEndpoints)
    plain, hinted, term = piece.endpoints
    # API defaults for absent conditions: ready and serving true, terminating false.
    assert (plain.ready, plain.serving, plain.terminating) == (True, True, False)
    assert plain.node_name is None
    assert hinted.zone == "zone-1" and hinted.node_hints == frozenset({"node-a"})
    assert (term.ready, term.serving, term.terminating) == (False, True, True)
    assert piece.ports == (("http", Protocol.TCP, 8080),)


def test_slice_port_without_number_is_ignored() -> None:
    piece = convert_endpoint_slice(make_slice(
        "ns", "svc", [ep("10.244.1.1")],
        lambda s: s.update(ports=[{"name": "http"}, {"name": "x", "port": 9}])))
    assert isinstance(piece, SliceEndpoints)
    assert piece.ports == (("x", Protocol.TCP, 9),)


SLICES_NOT_USED: list[tuple[str, Callable[[Obj], None], str]] = [
    ("FQDN", lambda s: s.update(addressType="FQDN"), "FQDN"),
    ("no service label", lambda s: s["metadata"].update(labels={}), "service-name"),
    ("headless", lambda s: s["metadata"]["labels"].update(
        {"service.kubernetes.io/headless": ""}), "headless"),
]


@pytest.mark.parametrize(("name", "tweak", "reason"), SLICES_NOT_USED,
                         ids=[c[0] for c in SLICES_NOT_USED])
def test_slices_not_used(name: str, tweak: Callable[[Obj], None], reason: str) -> None:
    result = convert_endpoint_slice(make_slice("ns", "svc", [ep("10.244.1.1")], tweak))
    assert isinstance(result, Skipped) and not result.invalid
    assert reason in result.reason


BAD_SLICES: list[tuple[str, Callable[[Obj], None], str]] = [
    ("address of the wrong family", lambda s: s.update(addressType="IPv6"), "not an IPv6"),
    ("invalid address", _set("endpoints.0.addresses", ["10.244.1.300"]), "addresses[0]"),
    ("empty addresses", _set("endpoints.0.addresses", []), "empty"),
    ("ready not a bool", _set("endpoints.0.conditions", {"ready": "yes"}), "conditions.ready"),
    ("unknown address type", lambda s: s.update(addressType="IPX"), "addressType"),
    ("bad port protocol", _set("ports.0.protocol", "GRE"), "protocol"),
    ("bad port name", _set("ports.0.name", "a b"), "port name"),
    ("bad node name", _set("endpoints.0.nodeName", "Node A"), "nodeName"),
    ("bad zone hint", _set("endpoints.0.hints", {"forZones": [{"name": "z z"}]}), "forZones"),
    ("bad service label", _set("metadata.labels", {"kubernetes.io/service-name": "a;b"}),
     "service-name"),
    ("oversized endpoint list", _set("endpoints", [ep(f"10.1.{i // 250}.{i % 250}")
                                                   for i in range(1001)]), "limit"),
]


@pytest.mark.parametrize(("name", "tweak", "field"), BAD_SLICES, ids=[c[0] for c in BAD_SLICES])
def test_bad_slices_are_skipped_with_a_reason(
    name: str, tweak: Callable[[Obj], None], field: str
) -> None:
    result = convert_endpoint_slice(make_slice("ns", "svc", [ep("10.244.1.1", "node-a")], tweak))
    assert isinstance(result, Skipped), result
    assert result.invalid and field in result.reason


PORT_ERRORS: list[tuple[str, Callable[[Obj], None], str]] = [
    ("Service", _set("spec.ports", [{"name": "a", "port": 80}, {"port": 81}]),
     "spec.ports[1].name: required when a Service has several ports"),
    ("Service", _set("spec.ports", [{"name": "a", "port": 80}, "81"]),
     "spec.ports[1]: expected an object, got str"),
    ("Service", _set("spec.ports.0.nodePort", 70000), "spec.ports[0].nodePort: 70000 is "
     "outside 0..65535"),
    ("Service", _set("spec.ports.0.protocol", "GRE"),
     "spec.ports[0].protocol: unknown protocol 'GRE' (TCP, UDP or SCTP)"),
    ("EndpointSlice", _set("ports", [{"port": 80}, {"name": "a b", "port": 81}]),
     "ports[1].name: 'a b' is not a valid port name"),
    ("EndpointSlice", _set("ports", [7]), "ports[0]: expected an object, got int"),
]


@pytest.mark.parametrize(("kind", "tweak", "reason"), PORT_ERRORS)
def test_a_bad_port_entry_is_named_by_its_whole_path(
        kind: str, tweak: Callable[[Obj], None], reason: str) -> None:
    result = (convert_service(make_service("ns", "svc", tweak)) if kind == "Service" else
              convert_endpoint_slice(make_slice("ns", "svc", [ep("10.244.1.1")], tweak)))
    assert isinstance(result, Skipped)
    assert result.reason == reason


def test_nodes() -> None:
    node = convert_node(make_node("node-a", "zone-1"))
    assert not isinstance(node, Skipped)
    assert node.zone == "zone-1" and not node.deleting
    obj = make_node("node-b")
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj["spec"] = {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}
    node = convert_node(obj)
    assert not isinstance(node, Skipped)
    assert node.deleting and node.taints == ("ToBeDeletedByClusterAutoscaler",)
    bad = convert_node({"kind": "Node", "metadata": {"name": "n", "labels": {"k": 1}}})
    assert isinstance(bad, Skipped) and "labels" in bad.reason


@pytest.mark.parametrize("tweak", [
    _set("metadata.name", "svc\n"), _set("spec.ports.0.name", "http\n"),
    _set("spec.loadBalancerSourceRanges", ["fd00:203::%pwn/64"]),
], ids=["newline in name", "newline in port name", "zone index in a CIDR"])
def test_what_the_api_server_refuses_is_refused(tweak: Callable[[Obj], None]) -> None:
    assert isinstance(convert_service(make_service("ns", "svc", tweak)), Skipped)


# --- Addresses written with leading zeros (kube-proxy's ParseIPSloppy) ----------------------

SLOPPY_ACCEPTED = [
    ("172.30.0.041", "172.30.0.41"),
    ("10.180.00.001", "10.180.0.1"),
    ("010.096.000.010", "10.96.0.10"),  # decimal: 010 is ten, never octal eight
    ("127.007.008.009", "127.7.8.9"),  # 8 and 9 are not octal digits: decimal throughout
    ("0000000000001.2.3.4", "1.2.3.4"),  # any number of zeros, as Go's dtoi
    ("::ffff:127.001.002.003", "::ffff:127.1.2.3"),
    ("0:0:0:0:000000:ffff:127.1.2.3", "::ffff:127.1.2.3"),
    ("fd00:96:0000:0000:0000:0000:0000:000a", "fd00:96::a"),
]
SLOPPY_REFUSED = ["10.96.0.999", "10.96.0.256", "1.2.3", "1.2.3.4.5", "10..0.1", "10.96.0.",
                  ".10.96.0.1", "10.96.0.1a", "0x0a.0.0.1", "-0.0.0.0", " 10.96.0.1",
                  "10.96.0.1 ", "1.2.3.4:80", "\u0661.2.3.4", "", "fe80::1%lo0",
                  "1:2:3:4:5:6:7:8:9", "1::2::3", "1:2:3:4:5:6:7:8::", "12345::", "::1.2.3"]


@pytest.mark.parametrize(("written", "address"), SLOPPY_ACCEPTED)
def test_the_lenient_reading_is_go_1_16s(written: str, address: str) -> None:
    assert parse_ip_sloppy(written) == address


@pytest.mark.parametrize("written", SLOPPY_REFUSED)
def test_the_lenient_reading_refuses_what_go_1_16_refused(written: str) -> None:
    assert parse_ip_sloppy(written) is None


@pytest.mark.parametrize(("written", "network"), [
    ("10.244.01.0/024", "10.244.1.0/24"), ("010.0.0.0/8", "10.0.0.0/8"),
    ("fd00:0203::/0064", "fd00:203::/64")])
def test_the_lenient_cidr_reading(written: str, network: str) -> None:
    assert parse_cidr_sloppy(written) == network
    for bad in ("10.0.0.1", "10.0.0.0/33", "10.0.0.0/", "10.0.0.0/+8", "10.0.0.999/8"):
        assert parse_cidr_sloppy(bad) is None


def test_service_addresses_with_leading_zeros_are_read_as_kube_proxy_reads_them() -> None:
    def legacy(svc: Obj) -> None:
        svc["spec"].update(type="LoadBalancer", clusterIP="10.96.0.010",
                           clusterIPs=["10.96.0.010", "fd00:96::0000a"],
                           ipFamilies=["IPv4", "IPv6"], externalIPs=["192.0.2.001"],
                           loadBalancerSourceRanges=["203.0.113.000/24"])
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.007"}]}}

    with capture_logs() as logs:
        (port,) = ports_of(make_service("ns", "legacy", legacy))
        ports_of(make_service("ns", "legacy", legacy))  # the same object again: logged once
    assert port.cluster_ips == ("10.96.0.10", "fd00:96::a")
    assert port.external_ips == ("192.0.2.1",)
    assert port.load_balancer_vips(IPFamily.IPv4) == ("198.51.100.7",)
    assert port.source_ranges == ("203.0.113.0/24",)
    warned = {(e["field"], e["written"], e["address"]) for e in logs
              if e["log_level"] == "warning"}
    assert warned == {
        ("spec.clusterIPs[0]", "10.96.0.010", "10.96.0.10"),
        ("spec.clusterIP", "10.96.0.010", "10.96.0.10"),
        ("spec.clusterIPs[1]", "fd00:96::0000a", "fd00:96::a"),
        ("spec.externalIPs[0]", "192.0.2.001", "192.0.2.1"),
        ("spec.loadBalancerSourceRanges[0]", "203.0.113.000/24", "203.0.113.0/24"),
        ("status.loadBalancer.ingress[0].ip", "198.51.100.007", "198.51.100.7"),
    }
    assert len([e for e in logs if e["log_level"] == "warning"]) == len(warned)
    assert {e["object"] for e in logs} == {"Service ns/legacy"}


def test_endpoint_addresses_with_leading_zeros_are_read_as_kube_proxy_reads_them() -> None:
    with capture_logs() as logs:
        piece = convert_endpoint_slice(make_slice("ns", "legacy", [
            ep("10.244.001.002", "node-a"), ep("10.244.1.3", "node-a")]))
    assert isinstance(piece, SliceEndpoints)
    assert [e.ip for e in piece.endpoints] == ["10.244.1.2", "10.244.1.3"]
    assert [(e["object"], e["field"]) for e in logs] == [
        ("EndpointSlice ns/legacy-ipv4", "endpoints[0].addresses[0]")]


@pytest.mark.parametrize("written", ["10.96.0.999", "1.2.3", "10.96..1", "10.96.0.01x"])
def test_malformed_addresses_are_still_refused(written: str) -> None:
    svc = convert_service(make_service("ns", "svc", _set("spec.clusterIPs", [written])))
    assert isinstance(svc, Skipped) and "spec.clusterIPs[0]" in svc.reason
    piece = convert_endpoint_slice(make_slice("ns", "svc", [ep(written)]))
    assert isinstance(piece, Skipped) and "endpoints[0].addresses[0]" in piece.reason


def test_endpoint_init_sets_every_field_in_order() -> None:
    """Endpoint's hand-written __init__ (fast construction) must match its fields."""
    import dataclasses

    from pyproxy.core.model import Endpoint

    names = [f.name for f in dataclasses.fields(Endpoint)]
    assert list(Endpoint.__init__.__code__.co_varnames[1:len(names) + 1]) == names
    values = ("10.0.0.1", 80, False, False, True, "n", "z", frozenset({"z"}),
              frozenset({"n"}), (("k", "v"),), 3)
    ep = Endpoint(*values)
    assert tuple(getattr(ep, n) for n in names) == values
    assert ep == Endpoint(**dict(zip(names, values, strict=True)))
    assert Endpoint("10.0.0.1", 80) == Endpoint("10.0.0.1", 80, True, True, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ep.ip = "10.0.0.2"  # type: ignore[misc]
