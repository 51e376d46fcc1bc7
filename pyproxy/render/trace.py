"""`pyproxy trace`: where a new connection goes through the rules this node programmed,
computed from the committed state (the slot store), not from the kernel.

Like upstream's test tracer, this walks only the rule shapes `pyproxy.render` emits, so the two
change together (tests compare its answers with real packets).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network

from pyproxy.core.balancing import flow_key, hash_index
from pyproxy.core.nodeconfig import LocalhostNodePorts
from pyproxy.render.objects import (
    CLUSTER_IPS_SET,
    FIREWALL_ALLOW_SET,
    FIREWALL_IPS_SET,
    HAIRPIN_SET,
    LOCALHOST_NODEPORT_REJECT_MAP,
    NO_ENDPOINT_NODEPORTS_MAP,
    NO_ENDPOINT_SERVICES_MAP,
    NODEPORT_IPS_SET,
    REJECT_CHAIN,
    SERVICE_CIDRS_SET,
    SERVICE_IPS_MAP,
    SERVICE_NODEPORTS_MAP,
    ElementValue,
    Key,
    Rules,
    Verdict,
    key_text,
    value_text,
)
from pyproxy.render.ruleset import DesiredState
from pyproxy.render.skeleton import RenderConfig

_INDEX = re.compile(
    r"dnat ip6? to .+? \. (?:numgen (?P<ng>random|inc) mod (?P<n1>\d+)"
    r"|jhash (?P<hk>.+?) mod (?P<n2>\d+) seed (?P<seed>0x[0-9a-f]+))"
    r"(?: offset (?P<off>\d+))? map @(?P<map>\S+)$")
_DNAT = re.compile(r"dnat ip6? to \[?([0-9a-fA-F.:]+?)\]?:(\d+)$")


@dataclass
class Trace:
    """The answer. `verdict`: DNAT, REJECT, DROP or NONE (pyproxy does not touch it)."""

    src: str
    dst: str
    port: int
    protocol: str
    verdict: str = "NONE"
    service: str | None = None
    steps: list[str] = field(default_factory=list)
    # (endpoint "IP:port", probability)
    candidates: list[tuple[str, float]] = field(default_factory=list)
    masquerade: bool = False
    # Every element the answer relied on, (set or map, key, value), so that `--verify` can
    # check them against the kernel.
    consulted: list[tuple[str, Key, ElementValue]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "src": self.src, "dst": f"{_endpoint(self.dst, str(self.port))}/{self.protocol}",
            "verdict": self.verdict, "service": self.service, "steps": self.steps,
            "candidates": [{"endpoint": ep, "probability": round(p, 4)}
                           for ep, p in self.candidates],
            "masquerade": self.masquerade,
        }


def trace(desired: DesiredState, cfg: RenderConfig, src: str, dst: str, port: int,
          protocol: str, from_node: bool = False, sport: int | None = None) -> Trace:
    """A new connection from `src` to `dst:port/protocol`. `from_node`: sent by a process on
    the node itself (the output hook) rather than arriving from outside or from a pod."""
    proto = protocol.lower()
    src, dst = str(ip_address(src)), str(ip_address(dst))
    out = Trace(src, dst, port, proto)
    walker = _Walker(desired, cfg, out, from_node, sport)
    if walker.firewall_drops():
        return out
    verdict = walker.dispatch()
    if verdict is not None and verdict.code == "goto" and walker.follow(verdict.chain):
        return out
    walker.no_dnat()
    return out


@dataclass
class _Walker:
    desired: DesiredState
    cfg: RenderConfig
    out: Trace
    from_node: bool
    sport: int | None = None

    def element(self, container: str, key: Key) -> ElementValue | None:
        value = self.desired.element(container, key)
        if value is not None:
            self.out.consulted.append((container, key, value))
        return value

    def elements(self, container: str) -> Iterator[tuple[Key, ElementValue]]:
        """Every element of `container` (for the interval sets: no exact-key lookup)."""
        for name, entries in self.desired.elements():
            if name == container:
                yield from entries

    def destination(self) -> Key:
        """The packet's destination as the service-ips and firewall sets key it."""
        return (self.out.dst, self.out.protocol, self.out.port)

    def node_port(self) -> Key:
        """The packet's destination port as the node port maps key it."""
        return (self.out.protocol, self.out.port)

    def note(self, text: str) -> None:
        self.out.steps.append(text)

    def set_service(self, value: Verdict) -> None:
        if value.comment and not self.out.service:
            self.out.service = value.comment

    # -- filter prerouting / output: LoadBalancer source ranges -------------------------------

    def firewall_drops(self) -> bool:
        if self.element(FIREWALL_IPS_SET, self.destination()) is None:
            return False
        destination = self.destination()
        allowed = [str(key[-1]) for key, _ in self.elements(FIREWALL_ALLOW_SET)
                   if key[:-1] == destination]
        src = ip_address(self.out.src)
        if any(src in ip_network(a, strict=False) for a in allowed):
            self.note(f"firewall-check: source allowed by {', '.join(allowed)}")
            return False
        self.note(f"firewall-check: source not in loadBalancerSourceRanges ({', '.join(allowed)})")
        self.out.verdict = "DROP"
        return True

    # -- nat: services ---------------------------------------------------------------------------

    def dispatch(self) -> Verdict | None:
        value = self.element(SERVICE_IPS_MAP, self.destination())
        if isinstance(value, Verdict):
            self.set_service(value)
            self.note(f"services: {key_text(self.destination())} in @{SERVICE_IPS_MAP}"
                      f"{value_text(value)}")
            return value
        if self.is_nodeport_address():
            key = self.node_port()
            value = self.element(SERVICE_NODEPORTS_MAP, key)
            if isinstance(value, Verdict):
                self.set_service(value)
                self.note(f"services: node port {key_text(key)} in @{SERVICE_NODEPORTS_MAP}"
                          f"{value_text(value)}")
                return value
        self.note("services: no service address or node port matches")
        return None

    def is_nodeport_address(self) -> bool:
        if self.cfg.nodeport_ips is None:
            # every local address: for a trace, the node's known addresses
            return self.out.dst in self.cfg.nodeport_addresses
        return self.element(NODEPORT_IPS_SET, (self.out.dst,)) is not None

    def follow(self, chain: str) -> bool:
        """Walk the chain a verdict goes to; True when it DNATs."""
        rules = self.desired.rules(chain)
        if rules is None:
            self.note(f"{chain}: chain not found")
            return False
        if any("update @" in rule or "goto " in rule for rule in rules):
            return self.per_service_chain(chain, rules)
        return self.pick_chain(chain, rules)

    def pick_chain(self, chain: str, rules: Rules) -> bool:
        """A shared pick chain: optional masquerade rules, then DNATs through the endpoints
        map, each guarded by the source kind it applies to (pyproxy.render's shapes)."""
        mark = f"meta mark set meta mark | {self.cfg.mark}"
        for rule in rules:
            applies, rest, why = self.condition(rule)
            if not applies:
                continue
            if rest.startswith(mark):
                self.out.masquerade = True
                self.note(f"{chain}: masquerade ({why})")
                rest = rest[len(mark):].strip()
            if rest.startswith("dnat "):
                if why == "always" and "-local-" in chain:
                    why = "externalTrafficPolicy: Local: local endpoints, client IP preserved"
                if why != "always":
                    self.note(f"{chain}: {why}")
                return self.pick(chain, rest)
        self.note(f"{chain}: no rule DNATs this connection")
        return False

    def condition(self, rule: str) -> tuple[bool, str, str]:
        """(does the rule apply to this source, the rest of the rule, why)."""
        not_pods, pods = self.cfg.local_match(negate=True), self.cfg.local_match()
        if not_pods and rule.startswith(not_pods + " "):
            return not self.from_pod(), rule[len(not_pods) + 1:], "source is not a local pod"
        if pods and rule.startswith(pods + " "):
            return (self.from_pod(), rule[len(pods) + 1:],
                    "pod traffic short-circuits to the cluster list")
        if rule.startswith("fib saddr type local "):
            return (self.from_node, rule[len("fib saddr type local "):],
                    "traffic from the node itself uses the cluster list")
        if rule.startswith("meta mark set"):
            return True, rule, "external traffic under externalTrafficPolicy: Cluster"
        return True, rule, "always"

    def from_pod(self) -> bool:
        value = self.cfg.local_value
        if self.cfg.local_match() is None or "/" not in value:
            return False  # interface-based detection cannot be decided from an address
        return ip_address(self.out.src) in ip_network(value)

    def dnat(self, targets: list[str]) -> bool:
        if not targets:
            return False
        self.out.verdict = "DNAT"
        counts: dict[str, int] = {}
        for target in targets:
            counts[target] = counts.get(target, 0) + 1
        self.out.candidates = [(t, n / len(targets)) for t, n in counts.items()]
        if any(_address(t) == self.out.src for t in counts) and self.hairpin(self.out.src):
            self.note("hairpin: an endpoint of this node reaching itself is masqueraded")
            if len(counts) == 1:
                self.out.masquerade = True
        return True

    def hairpin(self, address: str) -> bool:
        return self.desired.element(HAIRPIN_SET, (address, address)) is not None

    def pick(self, chain: str, rule: str) -> bool:
        match = _INDEX.search(rule)
        if match is None:
            self.note(f"{chain}: unrecognised rule {rule!r}")
            return False
        count = int(match["n1"] or match["n2"])
        offset = int(match["off"] or 0)
        container = match["map"]
        prefix: Key
        if container.startswith("nodeport-"):
            prefix = (self.out.port,)
        else:
            prefix = (self.out.dst, self.out.port)
        slots = []
        for i in range(offset, offset + count):
            value = self.element(container, (*prefix, i))
            if value is not None:
                address, target_port = value
                slots.append(_endpoint(str(address), str(target_port)))
        if match["ng"]:
            how = "at random" if match["ng"] == "random" else "in turn (round robin)"
            self.note(f"{chain}: one of {count} slots of @{container} {how}")
            return self.dnat(slots)
        return self.hashed(chain, match, slots, offset, container)

    def hashed(self, chain: str, match: re.Match[str], slots: list[str], offset: int,
               container: str) -> bool:
        count, seed = len(slots), int(match["seed"], 16)
        with_port = " sport" in match["hk"]
        algorithm = "Maglev" if with_port else "source hash"
        if with_port and self.sport is None:
            self.note(f"{chain}: {algorithm} over {count} slots of @{container}; give "
                      "--sport to see where this flow goes")
            return self.dnat(slots)
        key = flow_key(ip_address(self.out.src).packed, self.sport if with_port else None)
        slot = hash_index(key, seed, count)
        self.note(f"{chain}: {algorithm}: jhash({match['hk']}) mod {count} seed "
                  f"0x{seed:08x} = slot {offset + slot} of @{container}")
        return self.dnat([slots[slot]])

    def per_service_chain(self, chain: str, rules: Rules) -> bool:
        """Upstream-shaped chains (session affinity services): `external-…` decides the
        masquerade and goes on to `service-…`/`local-…`, which pick an endpoint."""
        mark = f"meta mark set meta mark | {self.cfg.mark}"
        local_pods = self.cfg.local_match()
        targets: list[str] = []
        for rule in rules:
            if rule == mark:
                self.out.masquerade = True
                self.note(f"{chain}: external traffic: masquerade")
            elif rule.startswith("goto "):
                self.note(f"{chain}: {rule}")
                return self.follow(rule.split(" ", 1)[1])
            elif local_pods and rule.startswith(f"{local_pods} goto ") and self.from_pod():
                self.note(f"{chain}: pod traffic short-circuits to the cluster chain")
                return self.follow(rule[len(local_pods) + 1:].split(" ", 1)[1])
            elif rule.startswith("fib saddr type local") and self.from_node:
                if mark in rule:
                    self.out.masquerade = True
                if " goto " in rule:
                    self.note(f"{chain}: traffic from the node: {rule}")
                    return self.follow(rule.split(" goto ", 1)[1])
            elif " daddr " in rule and mark in rule:
                if "saddr !=" not in rule or not self.from_pod():
                    self.out.masquerade = True
                    self.note(f"{chain}: masquerade ({rule.split(mark)[0].strip()})")
            elif "update @" in rule and not rule.startswith(f"{self.cfg.ip} saddr @"):
                # A new client's pick (a returning client's rule renews its own element).
                match = _DNAT.search(rule)
                if match:
                    targets.append(_endpoint(match.group(1), match.group(2)))
        self.note(f"{chain}: session affinity: a returning client keeps its endpoint")
        return self.dnat(targets)

    # -- filter: no endpoints, invalid ports ------------------------------------------------------

    def no_dnat(self) -> None:
        value = self.element(NO_ENDPOINT_SERVICES_MAP, self.destination())
        if value is None and self.is_nodeport_address():
            value = self.element(NO_ENDPOINT_NODEPORTS_MAP, self.node_port())
        if isinstance(value, Verdict):
            self.set_service(value)
            self.out.verdict = "REJECT" if value.chain == REJECT_CHAIN else "DROP"
            why = ("no usable endpoints" if self.out.verdict == "REJECT"
                   else "Local traffic policy and no local endpoint")
            self.note(f"service-endpoints-check: {why}: {self.out.verdict}")
            return
        if ip_address(self.out.dst).is_loopback and self.localhost_node_port():
            return
        if self.element(CLUSTER_IPS_SET, (self.out.dst,)) is not None:
            self.out.verdict = "REJECT"
            self.note("cluster-ips-check: a ClusterIP on a port no service uses: REJECT")
            return
        cidr = self.service_cidr()
        if cidr is not None:
            self.out.verdict = "DROP"
            self.note(f"cluster-ips-check: in ServiceCIDR {cidr} but no ClusterIP: DROP")
            return
        self.out.verdict = "NONE"
        self.note("not a service address: pyproxy leaves this connection alone")


    def localhost_node_port(self) -> bool:
        """A NodePort on loopback (KEP-6032): rejected where the map says so; TCP otherwise
        goes to the userspace proxy's listener, if there is one (not in the ruleset)."""
        key = self.node_port()
        value = self.element(LOCALHOST_NODEPORT_REJECT_MAP, key)
        if value is not None:
            self.out.verdict = "REJECT"
            self.note(f"nodeport-endpoints-check: localhost NodePort {key_text(key)} in "
                      f"@{LOCALHOST_NODEPORT_REJECT_MAP}{value_text(value)}: REJECT")
            return True
        if self.out.protocol == "tcp" and self.cfg.localhost_nodeports is (
                LocalhostNodePorts.PROXY) and self.element(SERVICE_NODEPORTS_MAP, key):
            self.note(f"localhost NodePort {key_text(key)}: to pyproxy's userspace proxy "
                      f"listening on {self.out.dst}:{self.out.port}, which connects to an "
                      "endpoint itself")
            return True
        return False

    def service_cidr(self) -> str | None:
        """The element of @service-cidrs holding the destination (an interval set: no
        exact-key lookup)."""
        dst = ip_address(self.out.dst)
        for key, value in self.elements(SERVICE_CIDRS_SET):
            if dst in ip_network(str(key[0]), strict=False):
                self.out.consulted.append((SERVICE_CIDRS_SET, key, value))
                return str(key[0])
        return None


def _endpoint(address: str, port: str) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _address(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[0].strip("[]")
