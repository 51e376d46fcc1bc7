"""`pyproxy trace`: where a new connection goes through the rules this node programmed,
computed from the committed state (the slot store), not from the kernel.

Like upstream's test tracer, this walks only the rule shapes `pyproxy.render` emits, so the two
change together (tests compare its answers with real packets).
"""

from __future__ import annotations

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
    ClientOf,
    DnatTo,
    Draw,
    ElementValue,
    Key,
    Masquerade,
    PickDnat,
    Remember,
    Rule,
    Rules,
    Source,
    SourceMatch,
    Verdict,
    key_text,
    value_text,
)
from pyproxy.render.ruleset import DesiredState
from pyproxy.render.skeleton import RenderConfig


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
        if any(r.of(Remember) or r.of(Verdict) for r in rules):
            return self.per_service_chain(chain, rules)
        return self.pick_chain(chain, rules)

    def pick_chain(self, chain: str, rules: Rules) -> bool:
        """A shared pick chain: optional masquerade rules, then DNATs through the endpoints
        map, each guarded by the source kind it applies to (pyproxy.render's shapes)."""
        for rule in rules:
            applies, why = self.condition(rule)
            if not applies:
                continue
            if rule.of(Masquerade) is not None:
                self.out.masquerade = True
                self.note(f"{chain}: masquerade ({why})")
            pick = rule.of(PickDnat)
            if pick is not None:
                if why == "always" and "-local-" in chain:
                    why = "externalTrafficPolicy: Local: local endpoints, client IP preserved"
                if why != "always":
                    self.note(f"{chain}: {why}")
                return self.pick(chain, pick)
        self.note(f"{chain}: no rule DNATs this connection")
        return False

    def condition(self, rule: Rule) -> tuple[bool, str]:
        """(does the rule apply to this source, why)."""
        match = rule.of(SourceMatch)
        if match is None:
            if rule.statements and isinstance(rule.statements[0], Masquerade):
                return True, "external traffic under externalTrafficPolicy: Cluster"
            return True, "always"
        if match.source is Source.NOT_LOCAL_POD:
            return not self.from_pod(), "source is not a local pod"
        if match.source is Source.LOCAL_POD:
            return self.from_pod(), "pod traffic short-circuits to the cluster list"
        return self.from_node, "traffic from the node itself uses the cluster list"

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

    def pick(self, chain: str, pick: PickDnat) -> bool:
        prefix: Key
        if pick.map.startswith("nodeport-"):
            prefix = (self.out.port,)
        else:
            prefix = (self.out.dst, self.out.port)
        slots = []
        for i in range(pick.offset, pick.offset + pick.slots):
            value = self.element(pick.map, (*prefix, i))
            if value is not None:
                address, target_port = value
                slots.append(_endpoint(str(address), str(target_port)))
        if pick.draw is not Draw.HASH:
            how = "at random" if pick.draw is Draw.RANDOM else "in turn (round robin)"
            self.note(f"{chain}: one of {pick.slots} slots of @{pick.map} {how}")
            return self.dnat(slots)
        return self.hashed(chain, pick, slots)

    def hashed(self, chain: str, pick: PickDnat, slots: list[str]) -> bool:
        count = len(slots)
        with_port = " sport" in pick.hashed
        algorithm = "Maglev" if with_port else "source hash"
        if with_port and self.sport is None:
            self.note(f"{chain}: {algorithm} over {count} slots of @{pick.map}; give "
                      "--sport to see where this flow goes")
            return self.dnat(slots)
        key = flow_key(ip_address(self.out.src).packed, self.sport if with_port else None)
        slot = hash_index(key, pick.seed, count)
        self.note(f"{chain}: {algorithm}: jhash({pick.hashed}) mod {count} seed "
                  f"0x{pick.seed:08x} = slot {pick.offset + slot} of @{pick.map}")
        return self.dnat([slots[slot]])

    def per_service_chain(self, chain: str, rules: Rules) -> bool:
        """Upstream-shaped chains (session affinity services): `external-…` decides the
        masquerade and goes on to `service-…`/`local-…`, which pick an endpoint."""
        targets: list[str] = []
        for rule in rules:
            match, goto, dnat = rule.of(SourceMatch), rule.of(Verdict), rule.of(DnatTo)
            source = None if match is None else match.source
            if goto is not None and source is None:
                self.note(f"{chain}: {rule.text()}")
                return self.follow(goto.chain)
            if goto is not None and source is Source.LOCAL_POD and self.from_pod():
                self.note(f"{chain}: pod traffic short-circuits to the cluster chain")
                return self.follow(goto.chain)
            if source is Source.NODE and self.from_node:
                if rule.of(Masquerade) is not None:
                    self.out.masquerade = True
                if goto is not None:
                    self.note(f"{chain}: traffic from the node: {rule.text()}")
                    return self.follow(goto.chain)
            elif source is not Source.NODE and rule.of(Masquerade) is not None:
                self.masquerade_rule(chain, rule, source)
            elif dnat is not None and not rule.of(ClientOf):
                # A new client's pick (a returning client's rule renews its own element).
                targets.append(_endpoint(dnat.address, str(dnat.port)))
        self.note(f"{chain}: session affinity: a returning client keeps its endpoint")
        return self.dnat(targets)

    def masquerade_rule(self, chain: str, rule: Rule, source: Source | None) -> None:
        """The external chain's mark (every external connection), or the service chain's
        own (a ClusterIP's connection from outside the pods, or every one)."""
        if len(rule.statements) == 1:
            self.out.masquerade = True
            self.note(f"{chain}: external traffic: masquerade")
        elif source is not Source.NOT_LOCAL_POD or not self.from_pod():
            self.out.masquerade = True
            mark = next(i for i, s in enumerate(rule.statements) if isinstance(s, Masquerade))
            self.note(f"{chain}: masquerade ({Rule(rule.statements[:mark]).text()})")

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
