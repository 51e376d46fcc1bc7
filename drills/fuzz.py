"""Services and EndpointSlices generated with hypothesis, valid and broken, with the oracle
of what pyproxy must do with each: program the valid services, skip and count the broken
objects (naming the field at fault).

Hypothesis draws the *shape* of each case (types, ports, policies, endpoints, which field is
broken and with what); identities that must be unique across the snapshot (names, cluster
IPs, node ports, external IPs) are assigned by index afterwards, so that valid services never
conflict with each other, as the API server guarantees.

The input classes of the bugs the drills found and that were fixed (trailing newlines in
names, IPv6 zone indexes, overlapping source ranges, 0.0.0.0/0, topology keys leaving a
NodePort without endpoints) are always generated. `known_bugs=True` adds the classes of the
bugs still open (docs/drills.md, "Bugs found"), which the CI drill keeps away from.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from drills.inputs import Expectation
from pyproxy.core.goip import parse_cidr_sloppy, parse_ip_sloppy

Obj = dict[str, Any]
ROOT = Path(__file__).resolve().parents[1]

# What the API server accepts (fullmatch: no trailing newline).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")

NASTY = ['"', "'", "{", "}", ";", "#", "\n", "\r", "\\", " ", "\t", "/", ".", ":", "%", "*",
         ",", "@", "$", "`", "\x00", "é", "A", "-", "_"]
PAYLOADS = ['x"; flush ruleset; #', "x } ; add table ip pwn", "x\nadd table ip pwn", "x#c",
            "web\n", "fd00::1%eth0", "10.0.0.1; drop", "a{b}", "${x}", "$(reboot)"]


def _strict_ok(pattern: re.Pattern[str], text: str, max_len: int = 63) -> bool:
    return 0 < len(text) <= max_len and pattern.fullmatch(text) is not None


def junk_text(pattern: re.Pattern[str], max_len: int = 63) -> st.SearchStrategy[Any]:
    """Anything that is not a valid value of this kind: text with nasty characters, payloads,
    over-long names, non-strings."""
    text = st.one_of(
        st.text(st.sampled_from(NASTY) | st.characters(codec="utf-8"), min_size=0,
                max_size=20),
        st.sampled_from(PAYLOADS),
        st.builds(lambda a, b: a + b, st.from_regex(r"[a-z]{1,8}", fullmatch=True),
                  st.sampled_from(NASTY)),
        st.just("a" * (max_len + 1)),
    )
    # A valid value and a newline ('$' matches before it: bug 1, fixed).
    text = text | st.sampled_from(["web\n", "a-b\n", "zone-1\n", "x.example.com\n"])
    strings = text.filter(lambda t: not _strict_ok(pattern, t, max_len))
    return st.one_of(strings, st.integers(-5, 5), st.lists(st.just("a"), max_size=2),
                     st.just({"a": 1}), st.booleans(), st.floats(allow_nan=False))


def junk_ip(cidr: bool = False) -> st.SearchStrategy[Any]:
    zoned = st.sampled_from(["fd00::%1/64", "fd00::%x}/64"] if cidr else
                            ["fd00::1%eth0", "fd00:244::2%x}"])
    base = st.one_of(
        zoned,  # IPv6 zone indexes (bug 2, fixed)
        st.sampled_from(["10.0.0.256", "10.0.0", "1.2.3.4.5", "::g", "10.0.0.1/33", "",
                         "10.96.0.1 ", " 10.96.0.1", "10.96.0.1\n", "0x0a.0.0.1",
                         "fd00::1%eth0", "fd00::%x}/64", "10.0.0.1}", "10.0.0.1;",
                         "2001:db8::1::2", "1e1.0.0.1"]),
        st.text(st.sampled_from([*NASTY, "1", "0", "."]), max_size=16),
        st.integers(0, 2**32), st.none().map(lambda _: ["10.0.0.1"]),
    )

    def invalid(value: Any) -> bool:
        if not isinstance(value, str):
            return True
        text = value.strip() if cidr else value
        # Leading zeros are no junk: kube-proxy reads them (decimal), and so does pyproxy.
        if (parse_cidr_sloppy(text) if cidr else parse_ip_sloppy(text)) is not None:
            return False
        try:
            if cidr:
                ipaddress.ip_network(text, strict=False)
            else:
                ipaddress.ip_address(text)
        except ValueError:
            return True
        return "%" in value  # valid for Python, but no API server would accept it

    return base.filter(invalid)


BAD_TOPOLOGY_KEYS = ["*,kubernetes.io/hostname", ",".join(f"k{i}" for i in range(17)),
                     "kubernetes.io/hostname,kubernetes.io/hostname", "bad key", 'a"b',
                     "x/y/z", "-a", "a/", "/a", "a" * 64, "UPPER.example.com/a", "*,*",
                     "kubernetes.io/hostname;*", "kubernetes.io/hostname\\n*"]
KEY_JUNK_CHARS = ['"', "'", "{", "}", ";", "#", " ", "%", "@", "$", "`", "é", "\\"]


def junk_key(char: str, tail: str) -> str:
    """A topology-keys annotation whose second key holds `char`. Whitespace is junk only
    inside a key: the annotation is a comma-separated list and the whitespace around a key is
    ignored (docs/services.md), so "kubernetes.io/hostname,k " is the valid key "k". The oracle once
    called it broken and pyproxy rightly programmed it (ns9/cache-0-604, `make chaos` run 4
    of issue 31, docs/drills.md)."""
    if char.isspace() and not tail:
        tail = "x"
    return f"kubernetes.io/hostname,k{char}{tail}"


VALID_WORDS = {"TCP", "UDP", "SCTP", "ClusterIP", "NodePort", "LoadBalancer", "ExternalName",
               "None", "ClientIP", "Cluster", "Local", "IPv4", "IPv6", "FQDN"}

SERVICE_MUTATIONS = {
    # name: (hint the skip reason must contain)
    "name": "metadata.name", "namespace": "metadata.namespace", "clusterIP": "spec.clusterIP",
    "ports-type": "spec.ports", "port-number": "spec.ports[", "protocol": "spec.ports[",
    "port-name": "spec.ports[", "duplicate-port": "spec.ports[", "unnamed-port": "spec.ports[",
    "node-port": "spec.ports[", "type": "spec.type", "affinity": "spec.sessionAffinity",
    "affinity-timeout": "spec.sessionAffinityConfig", "external-ips": "spec.externalIPs",
    "source-ranges": "spec.loadBalancerSourceRanges", "itp": "spec.internalTrafficPolicy",
    "etp": "spec.externalTrafficPolicy", "topology-keys": "topology",
    "label": "metadata.labels", "spec-type": "spec", "ip-families": "spec.ipFamilies",
    "two-same-family": "spec.clusterIPs", "hcnp": "spec.healthCheckNodePort",
    "traffic-distribution": "spec.trafficDistribution", "lb-ingress": "status.loadBalancer",
}
SLICE_MUTATIONS = {
    "name": "metadata.name", "address-type": "addressType", "address": "endpoints[",
    "wrong-family": "endpoints[", "no-address": "endpoints[", "ready": "endpoints[",
    "node-name": "endpoints[", "zone": "endpoints[", "hints": "endpoints[",
    "port-number": "ports[", "port-name": "ports[", "protocol": "ports[",
    "service-label": "metadata.labels", "endpoints-type": "endpoints",
    "too-many-endpoints": "endpoints",
}


_JUNK: dict[str, st.SearchStrategy[Any]] = {}


def _junk() -> dict[str, st.SearchStrategy[Any]]:
    """The junk strategies, built once (building them per draw is what costs the time)."""
    if not _JUNK:
        _JUNK.update({
            "junk_label": junk_text(DNS_LABEL),
            "junk_subdomain": junk_text(DNS_SUBDOMAIN, 253),
            "junk_value": junk_text(LABEL_VALUE),
            "junk_ip": junk_ip(),
            "junk_cidr": junk_ip(cidr=True),
            "junk_port": st.one_of(st.integers(65536, 2**40), st.integers(-2**40, -1),
                                   st.sampled_from(["80", True, 80.0, None, [80]])),
            "junk_timeout": st.one_of(st.integers(86401, 2**40), st.integers(-2**40, 0),
                                      st.sampled_from(["80", True, 80.0, [80]])),
            "junk_keys": st.sampled_from(BAD_TOPOLOGY_KEYS) | st.builds(
                junk_key, st.sampled_from(KEY_JUNK_CHARS),
                st.from_regex(r"[a-z]{0,4}", fullmatch=True)),
            "junk_word": st.one_of(junk_text(re.compile(r"(?!)")),
                                   st.sampled_from(["tcp", "Tcp", "ICMP", "Cluster ", "local",
                                                    "ClientIp", "None "])),
        })
    return _JUNK


# Which junk each mutation uses (only that one is drawn).
_USES = {"name": "junk_label", "namespace": "junk_label", "clusterIP": "junk_ip",
         "ports-type": "junk_word", "port-number": "junk_port", "protocol": "junk_word",
         "port-name": "junk_label", "node-port": "junk_port", "type": "junk_word",
         "affinity": "junk_word", "affinity-timeout": "junk_timeout", "external-ips": "junk_ip",
         "source-ranges": "junk_cidr", "itp": "junk_word", "etp": "junk_word",
         "topology-keys": "junk_keys", "label": "junk_value", "lb-ingress": "junk_ip",
         "address-type": "junk_word", "address": "junk_ip", "node-name": "junk_subdomain",
         "zone": "junk_value", "hints": "junk_value", "service-label": "junk_value"}
_SLICE_USES = {"name": "junk_subdomain", "port-name": "junk_label"}


class _Bits:
    """Choices decoded from a few drawn integers, round-robin: one hypothesis draw per
    object part instead of one per field keeps generation fast (hypothesis costs ~0.2 ms a
    draw), and hypothesis still controls (and can shrink) every choice."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.i = 0

    def pick(self, options: list[Any] | tuple[Any, ...]) -> Any:
        slot = self.i % len(self.values)
        self.i += 1
        self.values[slot], index = divmod(self.values[slot], len(options))
        return options[index]

    def int(self, lo: int, hi: int) -> int:
        return int(self.pick(range(lo, hi + 1)))


_PREFIXES = ["web", "api", "db", "a", "cache-0", "x1", "long-name-for-a-service", "dns",
             "metrics", "q"]
_LABEL_SETS: list[dict[str, str]] = [{}, {"app": "web"}, {"example.com/tier": ""},
                                     {"x.y/z": "a.b_c-d", "app": "x"}]
_TOPOLOGIES: list[list[str] | None] = [
    None, None, ["kubernetes.io/hostname", "*"], ["topology.kubernetes.io/zone"],
    ["kubernetes.io/hostname", "topology.kubernetes.io/zone", "*"],
    ["example.com/rack", "topology.kubernetes.io/region"]]
# Ranges holding the node's address (192.168.50.1) make the renderer allow the VIPs as
# sources too; 0.0.0.0/0 and overlapping ranges were bug 3 (fixed).
_RANGE_SETS = [[], ["10.0.0.0/8"], ["203.0.113.0/24", "192.168.50.0/24"],
               ["10.0.0.0/8", "192.168.0.0/16"], ["0.0.0.0/0"], ["10.0.0.0/8", "10.1.0.0/16"],
               ["0.0.0.0/0", "10.0.0.0/8"]]
# Open bug 3b (docs/drills.md): a range holding the node's address and a VIP (the
# LoadBalancer IPs are 172.20.x.y): the VIP's own entry overlaps the range.
_RANGE_SETS_BUGS = [["172.16.0.0/12", "192.168.50.0/24"]]
_SHAPE = st.lists(st.integers(0, 2**32 - 1), min_size=12, max_size=12)
_ENDPOINTS = st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=3, max_size=3), max_size=5)
_PORT_NUMBERS = [st.lists(st.integers(1, 65535), min_size=n, max_size=n, unique=True)
                 for n in range(5)]
_BROKEN = st.sampled_from([None, None, "Service", "EndpointSlice"])
_SERVICE_WHAT = st.sampled_from(sorted(SERVICE_MUTATIONS))
_SLICE_WHAT = st.sampled_from(sorted(SLICE_MUTATIONS))


@st.composite
def case(draw: st.DrawFn, known_bugs: bool) -> dict[str, Any]:
    """One Service and its EndpointSlice (shape only), maybe with one field broken."""
    bits = _Bits(draw(_SHAPE))
    nports = bits.int(1, 4)
    numbers = draw(_PORT_NUMBERS[nports])
    targets = draw(_PORT_NUMBERS[nports])
    ports = [{"name": "" if nports == 1 and bits.pick([True, False]) else f"p{k}",
              "port": numbers[k],
              "protocol": bits.pick(["TCP", "UDP", "SCTP"]),
              "targetPort": targets[k]} for k in range(nports)]
    shape = {
        "prefix": bits.pick(_PREFIXES),
        "type": bits.pick(["ClusterIP", "NodePort", "LoadBalancer"]),
        "dual": bits.int(0, 9) == 0,
        "ipv6": bits.int(0, 9) == 0,
        "ports": ports,
        "affinity": bits.pick([None, None, 1, 10800, 86400, 37]),
        "itp": bits.pick([None, "Cluster", "Local"]),
        "etp": bits.pick([None, "Cluster", "Local"]),
        "external_ips": bits.int(0, 2),
        "source_ranges": bits.pick(_RANGE_SETS + (_RANGE_SETS_BUGS if known_bugs else [])),
        "topology": bits.pick(_TOPOLOGIES),
        "distribution": bits.pick([None, "PreferClose"]),
        "labels": bits.pick(_LABEL_SETS),
        "endpoints": [],
    }
    for value in draw(_ENDPOINTS):
        e = _Bits(value)
        shape["endpoints"].append({
            "octets": (e.int(0, 255), e.int(1, 254)),
            "ready": e.pick([None, True, False]),
            "serving": e.pick([None, True, False]),
            "terminating": e.pick([None, True, False]),
            "node": e.pick([None, "node-a", "node-b", "node-c"]),
            "zone": e.pick([None, "zone-1", "zone-2"]),
            "hint": e.pick([None, "zone-1", "zone-2"]),
        })
    broken = draw(_BROKEN)
    what = (draw(_SERVICE_WHAT) if broken == "Service"
            else draw(_SLICE_WHAT) if broken == "EndpointSlice" else None)
    shape["broken"] = (broken, what)
    if what is not None:
        uses = (_SLICE_USES.get(what) if broken == "EndpointSlice" else None) or _USES.get(what)
        if uses:
            shape[uses] = draw(_junk()[uses])
    return shape


class _Ids:
    """Unique identities, assigned in order."""

    def __init__(self) -> None:
        self.node_port = 20000
        self.external = 0

    def next_node_port(self) -> int:
        self.node_port += 1
        return self.node_port

    def next_external(self, base: str) -> str:
        self.external += 1
        return str(ipaddress.ip_address(base) + self.external)


def build(index: int, shape: dict[str, Any], ids: _Ids) -> tuple[Obj, Obj, str | None,
                                                                     str | None, str]:
    """The Service and EndpointSlice of one case: (service, slice, broken kind, hint,
    service key)."""
    name = f"{shape['prefix']}-{index}"
    namespace = f"ns{index % 17}"
    v6 = shape["ipv6"]
    ip4 = str(ipaddress.ip_address("10.96.100.0") + index)
    ip6 = str(ipaddress.ip_address("fd00:96::1:0") + index)
    cluster_ips = [ip6 if v6 else ip4]
    if shape["dual"]:
        cluster_ips.append(ip4 if v6 else ip6)
    svc_type = shape["type"]
    ports = [dict(p) for p in shape["ports"]]
    for p in ports:
        if svc_type != "ClusterIP":
            p["nodePort"] = ids.next_node_port()
    spec: Obj = {"type": svc_type, "clusterIP": cluster_ips[0], "clusterIPs": cluster_ips,
                 "ipFamilies": ["IPv6" if ":" in ip else "IPv4" for ip in cluster_ips],
                 "ports": ports}
    if shape["affinity"] is not None:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": shape["affinity"]}}
    itp = shape["itp"]
    if itp:
        spec["internalTrafficPolicy"] = itp
    if shape["etp"] and svc_type != "ClusterIP":
        spec["externalTrafficPolicy"] = shape["etp"]
    if shape["external_ips"]:
        spec["externalIPs"] = [ids.next_external("172.16.0.0")
                               for _ in range(shape["external_ips"])]
    if shape["distribution"]:
        spec["trafficDistribution"] = shape["distribution"]
    meta: Obj = {"namespace": namespace, "name": name, "labels": dict(shape["labels"])}
    if shape["topology"]:
        meta["annotations"] = {"service.pyproxy.io/topology-keys": ",".join(shape["topology"])}
    service: Obj = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}
    if svc_type == "LoadBalancer":
        spec["loadBalancerSourceRanges"] = list(shape["source_ranges"])
        service["status"] = {"loadBalancer": {"ingress": [
            {"ip": ids.next_external("172.20.0.0")}]}}
        if spec.get("externalTrafficPolicy") == "Local":
            spec["healthCheckNodePort"] = ids.next_node_port()

    family = "IPv6" if v6 else "IPv4"
    endpoints = []
    for e in shape["endpoints"]:
        a, b = e["octets"]
        address = f"fd00:244:0:{a:x}::{b:x}" if v6 else f"10.244.{a}.{b}"
        out: Obj = {"addresses": [address], "conditions": {}}
        for cond in ("ready", "serving", "terminating"):
            if e[cond] is not None:
                out["conditions"][cond] = e[cond]
        if e["node"]:
            out["nodeName"] = e["node"]
        if e["zone"]:
            out["zone"] = e["zone"]
        if e["hint"]:
            out["hints"] = {"forZones": [{"name": e["hint"]}]}
        endpoints.append(out)
    slice_: Obj = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": namespace, "name": f"{name}-{family.lower()}",
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": family,
        "ports": [{"name": p["name"], "port": p["targetPort"], "protocol": p["protocol"]}
                  for p in shape["ports"]],
        "endpoints": endpoints,
    }
    kind, what = shape["broken"]
    hint = None
    if kind == "Service":
        hint = SERVICE_MUTATIONS[what]
        _break_service(service, what, shape, index)
    elif kind == "EndpointSlice":
        hint = SLICE_MUTATIONS[what]
        _break_slice(slice_, what, shape, index)
    return service, slice_, kind, hint, f"{namespace}/{name}"


def _break_service(svc: Obj, what: str, shape: dict[str, Any], index: int) -> None:
    spec, meta = svc["spec"], svc["metadata"]
    ports = spec["ports"]
    if what == "name":
        meta["namespace"] = f"bad-{index}"  # the snapshot keys objects by namespace/name
        meta["name"] = shape["junk_label"]
    elif what == "namespace":
        meta["namespace"] = shape["junk_label"]
    elif what == "clusterIP":
        spec["clusterIP"] = shape["junk_ip"]
        spec["clusterIPs"] = [shape["junk_ip"], *spec["clusterIPs"][1:]]
        if shape["junk_ip"] in (None, "", "None") or not isinstance(shape["junk_ip"], str):
            spec["clusterIPs"][0] = "10.0.0.256"
            spec["clusterIP"] = "10.0.0.256"
    elif what == "ports-type":
        spec["ports"] = shape["junk_word"] if shape["junk_word"] not in ([], None, "", 0,
                                                                        False) else "x"
        if isinstance(spec["ports"], list):
            spec["ports"] = {"a": 1}
    elif what == "port-number":
        ports[0]["port"] = shape["junk_port"] if shape["junk_port"] is not None else 0
    elif what == "protocol":
        ports[0]["protocol"] = _word(shape["junk_word"], "ICMP")
    elif what == "port-name":
        ports.append({"name": "zz", "port": 1, "protocol": "TCP"})
        ports[0]["name"] = shape["junk_label"] if shape["junk_label"] != "" else "UPPER"
    elif what == "duplicate-port":
        ports.append({**ports[0], "name": ports[0]["name"] or "p0"})
        ports[0]["name"] = ports[-1]["name"]
    elif what == "unnamed-port":
        ports.append({"port": 1, "protocol": "TCP"})
        ports[0]["name"] = ""
    elif what == "node-port":
        spec["type"] = "NodePort"
        ports[0]["nodePort"] = shape["junk_port"] if shape["junk_port"] is not None else -1
    elif what == "type":
        spec["type"] = _word(shape["junk_word"], "Foo")
    elif what == "affinity":
        spec["sessionAffinity"] = _word(shape["junk_word"], "Sticky")
    elif what == "affinity-timeout":
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": shape["junk_timeout"]}}
    elif what == "external-ips":
        spec["externalIPs"] = [shape["junk_ip"]]
    elif what == "source-ranges":
        spec["loadBalancerSourceRanges"] = [shape["junk_cidr"]]
    elif what in ("itp", "etp"):
        key = "internalTrafficPolicy" if what == "itp" else "externalTrafficPolicy"
        spec[key] = _word(shape["junk_word"], "Global")
    elif what == "topology-keys":
        meta["annotations"] = {"service.pyproxy.io/topology-keys": shape["junk_keys"]}
    elif what == "label":
        meta["labels"] = {"app": shape["junk_value"] if shape["junk_value"] not in ("", None)
                          else "-bad-"}
        if not isinstance(meta["labels"]["app"], str) or _strict_ok(
                LABEL_VALUE, meta["labels"]["app"]):
            meta["labels"]["app"] = "-bad-"
    elif what == "spec-type":
        svc["spec"] = ["not", "a", "mapping"]
    elif what == "ip-families":
        spec["ipFamilies"] = ["IPv6" if f == "IPv4" else "IPv4" for f in spec["ipFamilies"]]
    elif what == "two-same-family":
        first = spec["clusterIPs"][0]
        spec["clusterIPs"] = [first, str(ipaddress.ip_address(first) + 200000)]
        spec.pop("ipFamilies")
    elif what == "hcnp":
        spec["healthCheckNodePort"] = 70000 + index
    elif what == "traffic-distribution":
        spec["trafficDistribution"] = 42
    elif what == "lb-ingress":
        spec["type"] = "LoadBalancer"
        for p in ports:
            p.setdefault("nodePort", 0)
        ip = shape["junk_ip"] if isinstance(shape["junk_ip"], str) and shape["junk_ip"] \
            else "1.2.3.999"
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": ip}]}}


def _break_slice(sl: Obj, what: str, shape: dict[str, Any], index: int) -> None:
    v6 = sl["addressType"] == "IPv6"
    if not sl["endpoints"] and what in ("address", "wrong-family", "no-address", "ready",
                                        "node-name", "zone", "hints"):
        sl["endpoints"] = [{"addresses": ["fd00:244::9" if v6 else "10.244.9.9"]}]
    first = sl["endpoints"][0] if sl["endpoints"] else None
    if what == "name":
        sl["metadata"]["namespace"] = f"bad-{index}"
        sl["metadata"]["name"] = shape["junk_subdomain"]
    elif what == "address-type":
        sl["addressType"] = _word(shape["junk_word"], "IPv5")
    elif what == "address" and first is not None:
        first["addresses"] = [shape["junk_ip"]]
    elif what == "wrong-family" and first is not None:
        first["addresses"] = ["10.244.1.1" if v6 else "fd00:244::1"]
    elif what == "no-address" and first is not None:
        first["addresses"] = []
    elif what == "ready" and first is not None:
        first["conditions"] = {"ready": "true"}
    elif what == "node-name" and first is not None:
        first["nodeName"] = shape["junk_subdomain"] if shape["junk_subdomain"] not in (
            "", None, 0, False, []) else "Node_A"
    elif what == "zone" and first is not None:
        zone = shape["junk_value"]
        first["zone"] = zone if zone not in ("", None, 0, False, []) else "-z-"
    elif what == "hints" and first is not None:
        hint = shape["junk_value"]
        first["hints"] = {"forZones": [{"name": hint if hint != "" else "-z-"}]}
    elif what == "port-number":
        bad = shape["junk_port"]
        sl["ports"] = [{"name": "p0", "port": bad if bad not in (None,) else -1}]
    elif what == "port-name":
        name = shape["junk_label"]
        sl["ports"] = [{"name": name if name != "" else "UPPER", "port": 80}]
    elif what == "protocol":
        sl["ports"] = [{"name": "p0", "port": 80, "protocol": _word(shape["junk_word"], "ICMP")}]
    elif what == "service-label":
        value = shape["junk_value"]
        sl["metadata"]["labels"]["kubernetes.io/service-name"] = (
            value if value not in ("", None) else "-bad-")
        if isinstance(value, str) and _strict_ok(DNS_LABEL, value):
            sl["metadata"]["labels"]["kubernetes.io/service-name"] = "Bad_Name"
    elif what == "endpoints-type":
        sl["endpoints"] = {"not": "a list"}
    elif what == "too-many-endpoints":
        one = {"addresses": ["fd00:244::9" if v6 else "10.244.9.9"]}
        sl["endpoints"] = [one] * 1001


def _word(value: Any, fallback: str) -> Any:
    """A broken enum value: the drawn junk, unless it is empty (the field's default) or
    happens to be a valid word."""
    if value is None or value == "" or value is False or value == 0 or value == []:
        return fallback
    if isinstance(value, str) and value in VALID_WORDS:
        return fallback
    return value


def draw_shapes(wanted: int, seed_value: int, known_bugs: bool) -> list[dict[str, Any]]:
    """`wanted` cases drawn by hypothesis in this process (generate() calls it in a fresh
    interpreter, see there)."""
    shapes: list[dict[str, Any]] = []
    attempt = 0
    while len(shapes) < wanted and attempt < 20:
        @settings(max_examples=wanted - len(shapes), database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @seed(seed_value + attempt)
        @given(case(known_bugs))
        def collect(shape: dict[str, Any]) -> None:
            shapes.append(shape)

        collect()
        attempt += 1
    return shapes[:wanted]


def _fresh_draw(wanted: int, seed_value: int, known_bugs: bool) -> list[dict[str, Any]]:
    """draw_shapes in a fresh interpreter that loads only this module and what it imports.

    Hypothesis mixes into its draws constants read from the source of every local module
    loaded in the process ("local constants", checked with hypothesis 6.170), so one seed
    drew other cases under `make chaos` (drills.chaos as __main__, the migration drill,
    pyproxy.cluster.watch loaded by an earlier drill) than in a shell or under pytest, and a
    failing case could not be regenerated (issue 31: seed 69048). In a fresh interpreter a
    seed names the same objects wherever it runs, at a given commit (the constants are the
    code's)."""
    code = ("import pickle, sys\n"
            "from drills.fuzz import draw_shapes\n"
            f"sys.stdout.buffer.write(pickle.dumps(draw_shapes({wanted}, {seed_value}, "
            f"{known_bugs})))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          env={**os.environ, "PYTHONHASHSEED": "0"}, check=False)
    if done.returncode:
        raise RuntimeError(f"drawing the cases failed: {done.stderr.decode()[-2000:]}")
    shapes: list[dict[str, Any]] = pickle.loads(done.stdout)  # our own child's output
    return shapes


def generate(count: int, seed_value: int,
             known_bugs: bool) -> tuple[list[Obj], Expectation, list[str | None]]:
    """`count` objects (a Service and an EndpointSlice per case), the oracle, and per object
    the kind that case broke (None: a valid case). The same for a seed in any process
    (_fresh_draw): `python -m drills.fuzz --seed N --count N --show ns/name` regenerates."""
    wanted = (count + 1) // 2
    shapes = _fresh_draw(wanted, seed_value, known_bugs)
    ids = _Ids()
    objects: list[Obj] = []
    broken_kinds: list[str | None] = []
    expect = Expectation()
    for index, shape in enumerate(shapes[:wanted]):
        service, slice_, kind, hint, key = build(index, shape, ids)
        objects += [service, slice_]
        broken_kinds += [kind, kind]
        if kind is None:
            expect.valid_services.add(key)
            continue
        expect.invalid[kind] += 1
        broken = service if kind == "Service" else slice_
        meta = broken.get("metadata") or {}
        name = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        if isinstance(meta.get("namespace"), str) and isinstance(meta.get("name"), str):
            expect.hints[(kind, name)] = hint or ""
        if kind == "EndpointSlice":
            expect.valid_services.add(key)
    if count % 2:  # an odd count: the last case's slice is left out
        objects, broken_kinds = objects[:count], broken_kinds[:count]
        if broken_kinds[-1] == "EndpointSlice":
            expect.invalid["EndpointSlice"] -= 1
    return objects, expect, broken_kinds


def disagreements(objects: list[Obj], broken: list[str | None]) -> list[tuple[str, Obj]]:
    """Objects on which pyproxy's converter and the oracle disagree (what the drill then
    reports as a failure): for developing the generator, and for the report."""
    from pyproxy.core.convert import convert_service
    from pyproxy.core.convert_endpoints import convert_endpoint_slice
    from pyproxy.core.model import Skipped

    out = []
    for obj, kind in zip(objects, broken, strict=True):
        fn = convert_service if obj["kind"] == "Service" else convert_endpoint_slice
        result = fn(obj)
        invalid = isinstance(result, Skipped) and result.invalid
        if invalid != (kind == obj["kind"]):
            why = result.reason if isinstance(result, Skipped) else "accepted"
            out.append((why, obj))
    return out


def main(argv: list[str] | None = None) -> int:
    """Regenerates the bad-input drill's objects of a seed (its figures name the seed), e.g.
    `python -m drills.fuzz --seed 69048 --show ns9/cache-0-604`, from the repository root."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--count", type=int, default=10000, help="as `make chaos` (10000)")
    parser.add_argument("--known-bugs", action="store_true")
    parser.add_argument("--show", action="append", default=[], metavar="NAMESPACE/NAME",
                        help="print this Service and its EndpointSlice (repeatable)")
    parser.add_argument("--disagreements", action="store_true",
                        help="print the objects the oracle and pyproxy's converter disagree on")
    args = parser.parse_args(argv)
    objects, expect, broken = generate(args.count, args.seed, args.known_bugs)
    print(f"seed {args.seed}: {len(expect.valid_services)} valid services, invalid "
          f"{dict(expect.invalid)}")
    for obj, kind in zip(objects, broken, strict=True):
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
        owner = labels.get("kubernetes.io/service-name", meta.get("name"))
        if f"{meta.get('namespace')}/{owner}" in args.show:
            print(f"{obj['kind']} (case broken: {kind}): {json.dumps(obj)}")
    wrong = disagreements(objects, broken) if args.disagreements else []
    for why, obj in wrong:
        print(f"disagreement ({why}): {json.dumps(obj)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
