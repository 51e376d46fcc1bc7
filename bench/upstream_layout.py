"""The baseline: kube-proxy's nftables layout up to 1.35 (a chain per service and per endpoint,
endpoint choice by an anonymous `numgen random mod N vmap { … }`), loaded the way a chunked
loader would (500 services per transaction), and updated one service at a time by flushing
and rewriting the service chain.

Rendered from the same ClusterState and endpoint selection as pyproxy (so both program the
same services and endpoints). Simplifications, all in the baseline's favour: every service
port gets upstream's ClusterIP shape (external IPs, LoadBalancer IPs and NodePorts dispatch
straight to the service chain, without upstream's external-* chains and firewall), and
session affinity is ignored.

Shape of one service port (names as upstream: hash + ns/name/proto/port):
  service-ips element:  VIP . tcp . 80 : goto service-H-ns/name/tcp/http
  chain service-H-ns/name/tcp/http {
    ip daddr VIP tcp dport 80 ip saddr != CLUSTER_CIDR jump mark-for-masquerade
    numgen random mod N vmap { 0 : goto endpoint-H1-…, 1 : goto endpoint-H2-…, … }
  }
  chain endpoint-H1-ns/name/tcp/http__10.128.0.1/8080 {
    ip saddr 10.128.0.1 jump mark-for-masquerade
    meta l4proto tcp dnat to 10.128.0.1:8080
  }
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pyproxy.core.model import (
    ClusterState,
    IPFamily,
    ServiceKey,
    ServicePort,
    ServicePortName,
    TrafficPolicy,
)
from pyproxy.core.topology import select_all
from pyproxy.render.skeleton import endpoint_base_name, service_base_name

T = "ip kube-proxy"
MASQ = "0x00004000"
CHUNK = 500


_BASE = (("nat-prerouting", "nat hook prerouting priority -100", "jump services"),
         ("nat-output", "nat hook output priority -100", "jump services"),
         ("nat-postrouting", "nat hook postrouting priority 100", "jump masquerading"),
         ("filter-forward", "filter hook forward priority -110",
          "ct state new jump service-endpoints-check"),
         ("filter-output", "filter hook output priority -110",
          "ct state new jump service-endpoints-check"),
         ("filter-input", "filter hook input priority -110",
          "ct state new jump service-endpoints-check"))
_KEY3 = "ipv4_addr . inet_proto . inet_service"


def skeleton() -> str:
    base = "".join(f"  chain {name} {{ type {hook}; policy accept; {rule}; }}\n"
                   for name, hook, rule in _BASE)
    return f"""table {T} {{
  map service-ips {{ type {_KEY3} : verdict; }}
  map service-nodeports {{ type inet_proto . inet_service : verdict; }}
  map no-endpoint-services {{ type {_KEY3} : verdict; }}
  set cluster-ips {{ type ipv4_addr; }}
{base}  chain service-endpoints-check {{
    ip daddr . meta l4proto . th dport vmap @no-endpoint-services
  }}
  chain reject-chain {{ reject; }}
  chain mark-for-masquerade {{ meta mark set meta mark | {MASQ}; }}
  chain masquerading {{
    meta mark & {MASQ} == 0 return
    meta mark set meta mark ^ {MASQ}
    masquerade fully-random
  }}
  chain services {{
    ip daddr . meta l4proto . th dport vmap @service-ips
    fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports
  }}
}}
"""


@dataclass
class Rendered:
    """What one service port owns in the baseline table."""

    chain: str
    rules: list[str]
    endpoint_chains: dict[str, list[str]]  # name -> rules
    elements: list[tuple[str, str, str]]  # (map/set, key, value-with-colon or "")


def render_port(port: ServicePort, endpoints: Iterable, cidr: str) -> Rendered:
    proto = port.protocol.lower()
    vip = port.cluster_ip(IPFamily.IPv4)
    eps = list(endpoints)
    chain = f"service-{service_base_name(port)}"
    rules = [f"ip daddr {vip} {proto} dport {port.port} ip saddr != {cidr} "
             f"jump mark-for-masquerade"]
    ep_chains: dict[str, list[str]] = {}
    for ep in eps:
        name = f"endpoint-{endpoint_base_name(port, ep)}"
        ep_chains[name] = [f"ip saddr {ep.ip} jump mark-for-masquerade",
                           f"meta l4proto {proto} dnat to {ep.ip}:{ep.port}"]
    elements: list[tuple[str, str, str]] = [("cluster-ips", vip, "")]
    if eps:
        vmap = ", ".join(f"{n} : goto {name}" for n, name in enumerate(ep_chains))
        rules.append(f"numgen random mod {len(eps)} vmap {{ {vmap} }}")
        dispatch = [("service-ips", f"{vip} . {proto} . {port.port}")]
        dispatch += [("service-ips", f"{a} . {proto} . {port.port}")
                     for a in (*port.external_ips_of(IPFamily.IPv4),
                               *port.load_balancer_vips(IPFamily.IPv4))]
        if port.node_port:
            dispatch.append(("service-nodeports", f"{proto} . {port.node_port}"))
        elements += [(m, k, f" : goto {chain}") for m, k in dispatch]
    else:
        elements.append(("no-endpoint-services", f"{vip} . {proto} . {port.port}",
                         " : goto reject-chain"))
    return Rendered(chain, rules, ep_chains, elements)


def render_services(state: ClusterState, node: str, cidr: str,
                    services: Iterable[ServiceKey] | None = None
                    ) -> dict[ServicePortName, Rendered]:
    out: dict[ServicePortName, Rendered] = {}
    for ps in select_all(state, node, services):
        if ps.family is not IPFamily.IPv4:
            continue
        sel = ps.selection
        eps = (sel.local if ps.port.internal_policy is TrafficPolicy.LOCAL else sel.cluster) or ()
        out[ps.port.name] = render_port(ps.port, eps, cidr)
    return out


def _add(r: Rendered) -> tuple[list[str], list[str]]:
    """Commands adding `r` (chains and rules; elements returned separately for batching)."""
    cmds = []
    for name, rules in r.endpoint_chains.items():
        cmds.append(f"add chain {T} {name}")
        cmds += [f"add rule {T} {name} {rule}" for rule in rules]
    cmds.append(f"add chain {T} {r.chain}")
    cmds += [f"add rule {T} {r.chain} {rule}" for rule in r.rules]
    return cmds, [f"{m}\0{k}{v}" for m, k, v in r.elements]


def _elements(verb: str, packed: list[str]) -> list[str]:
    by: dict[str, list[str]] = {}
    for p in packed:
        m, e = p.split("\0")
        by.setdefault(m, []).append(e)
    return [f"{verb} element {T} {m} {{ {', '.join(es)} }}" for m, es in by.items()]


def cold_chunks(rendered: dict[ServicePortName, Rendered], chunk: int = CHUNK) -> Iterable[str]:
    """The cold load: the skeleton, then one transaction per `chunk` services."""
    yield skeleton()
    by_service: dict[ServiceKey, list[Rendered]] = {}
    for name, r in rendered.items():
        by_service.setdefault(name.service, []).append(r)
    keys = list(by_service)
    for start in range(0, len(keys), chunk):
        cmds: list[str] = []
        elems: list[str] = []
        for key in keys[start:start + chunk]:
            for r in by_service[key]:
                c, e = _add(r)
                cmds += c
                elems += e
        yield "\n".join(cmds + _elements("add", elems)) + "\n"


def update(old: dict[ServicePortName, Rendered], new: dict[ServicePortName, Rendered]) -> str:
    """One service's update: new endpoint chains, the service chain flushed and rewritten, the
    dispatch element deleted and re-added, removed chains flushed and deleted."""
    cmds: list[str] = []
    dels: list[str] = []
    adds: list[str] = []
    tail: list[str] = []
    for name in sorted(set(old) | set(new)):
        o, n = old.get(name), new.get(name)
        if n is None:
            assert o is not None
            dels += [f"{m}\0{k}" for m, k, _ in o.elements]
            for chain in [o.chain, *o.endpoint_chains]:
                tail += [f"flush chain {T} {chain}", f"delete chain {T} {chain}"]
            continue
        if o is None:
            c, e = _add(n)
            cmds += c
            adds += e
            continue
        for chain, rules in n.endpoint_chains.items():
            if chain not in o.endpoint_chains:
                cmds.append(f"add chain {T} {chain}")
                cmds += [f"add rule {T} {chain} {rule}" for rule in rules]
        cmds.append(f"flush chain {T} {n.chain}")
        cmds += [f"add rule {T} {n.chain} {rule}" for rule in n.rules]
        dels += [f"{m}\0{k}" for m, k, v in o.elements if v]
        adds += [f"{m}\0{k}{v}" for m, k, v in n.elements if v]
        for chain in o.endpoint_chains:
            if chain not in n.endpoint_chains:
                tail += [f"flush chain {T} {chain}", f"delete chain {T} {chain}"]
    return "\n".join(cmds + _elements("delete", dels) + _elements("add", adds) + tail) + "\n"
