"""Connections in flight per endpoint, from conntrack's per-flow counts (pure).

The kernel part (pyproxy/kernel/nlconntrack.py) dumps the DNATed TCP entries and counts them
per flow: (original destination, its port, reply source, its port) → [ESTABLISHED, in any
other state]. A flow is a Service's when its original destination is one of the service
port's addresses (ClusterIP, external IP, LoadBalancer VIP) and port, or its NodePort; the
reply source is who answers, the endpoint the rules DNATed it to. Here those counts are given
to the service ports and endpoints in force on this node:

- `Load`: an endpoint's ESTABLISHED entries (`established`: the connections in flight) and
  those in any other state (`other`: half-open, closing, TIME_WAIT: IPVS's "inactive").
- `FlowIndex`: frontend → service port → its endpoints, ready or terminating, from the
  selections in force and the endpoints of their EndpointSlices. Only those endpoints are
  counted (cardinality bounded by the cluster's own objects); a flow of a service port
  answered by no endpoint of it (its pod deleted, conntrack still holding the flow) counts
  in the port's `gone`.
- `exported`: the series of the metric, bounded: endpoints with established connections
  and every terminating endpoint (0 included: a drain that has finished shows 0), at most
  `cap` of them, largest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pyproxy.core.model import Endpoint, IPFamily, Protocol, ServicePortName
from pyproxy.core.topology import PortSelection

# Endpoint series the metric exports at most (largest first): a node serving 10k services of
# 10 endpoints each would otherwise export 100k gauges, nearly all 0.
MAX_SERIES = 5000

Flow = tuple[str, int, str, int]  # as pyproxy.kernel.nlconntrack.Flow: dst, dport, src, sport
PortKey = tuple[ServicePortName, IPFamily]


class Load(NamedTuple):
    established: int = 0
    other: int = 0

    def plus(self, more: Load) -> Load:
        return Load(self.established + more.established, self.other + more.other)


@dataclass(frozen=True, slots=True)
class EndpointInFlight:
    endpoint: str  # IP:port, IPv6 in brackets
    load: Load
    terminating: bool


@dataclass
class PortInFlight:
    """One service port's (and family's) connections, per endpoint of its EndpointSlices."""

    endpoints: dict[str, EndpointInFlight] = field(default_factory=dict)
    gone: Load = field(default_factory=Load)  # answered by no endpoint the port has now

    @property
    def established(self) -> int:
        return sum(e.load.established for e in self.endpoints.values())

    @property
    def draining(self) -> int:
        """Established connections to terminating endpoints: what a drain waits for."""
        return sum(e.load.established for e in self.endpoints.values() if e.terminating)

    def as_dict(self) -> dict[str, object]:
        return {
            "established": self.established,
            "draining": self.draining,
            "gone": self.gone.established,
            "endpoints": [
                {"endpoint": e.endpoint, "established": e.load.established,
                 "other": e.load.other, "terminating": e.terminating}
                for e in sorted(self.endpoints.values(), key=lambda e: e.endpoint)],
        }


class _Port:
    __slots__ = ("endpoints", "key", "terminating")

    def __init__(self, ps: PortSelection, endpoints: Sequence[Endpoint]) -> None:
        self.key: PortKey = (ps.port.name, ps.family)
        # model IPs are spelled as the kernel's (inet_ntop: fields.read_ip)
        self.endpoints = {(ep.ip, ep.port): ep.key for ep in endpoints}
        self.terminating = {ep.key for ep in endpoints if ep.terminating}


@dataclass
class FlowIndex:
    """Frontend (address, port) and NodePort → the TCP service ports behind them."""

    by_address: dict[tuple[str, int], list[_Port]] = field(default_factory=dict)
    by_node_port: dict[int, list[_Port]] = field(default_factory=dict)
    ports: list[_Port] = field(default_factory=list)
    by_key: dict[PortKey, _Port] = field(default_factory=dict)

    @classmethod
    def of(cls, ports: Iterable[tuple[PortSelection, Sequence[Endpoint]]]) -> FlowIndex:
        """From each selection in force and its port's endpoints of that family (ready or
        terminating: `ClusterState.endpoints`)."""
        index = cls()
        for ps, endpoints in ports:
            port = ps.port
            if port.protocol is not Protocol.TCP:
                continue
            entry = _Port(ps, endpoints)
            index.ports.append(entry)
            index.by_key[entry.key] = entry
            cluster_ip = port.cluster_ip(ps.family)
            for address in (*([cluster_ip] if cluster_ip else []),
                            *port.external_ips_of(ps.family),
                            *port.load_balancer_vips(ps.family)):
                index.by_address.setdefault((address, port.port), []).append(entry)
            if port.node_port:
                index.by_node_port.setdefault(port.node_port, []).append(entry)
        return index


@dataclass
class InFlight:
    """Every TCP service port's connections in flight, from one read of conntrack. `ports`
    holds the ports with connections (or terminating endpoints); `of` answers for the others
    too, all at 0 (at 10k services of 10 endpoints, building 100k zeros took 0.25 s)."""

    ports: dict[PortKey, PortInFlight] = field(default_factory=dict)
    index: FlowIndex | None = None
    read_at: float = 0.0  # the clock's time of the read (monotonic)
    seconds: float = 0.0  # what the read cost
    entries: int = 0  # the DNATed TCP entries it read

    def of(self, name: ServicePortName, family: IPFamily) -> PortInFlight | None:
        found = self.ports.get((name, family))
        if found is not None or self.index is None:
            return found
        port = self.index.by_key.get((name, family))
        return None if port is None else _port_in_flight(port, {}, Load())


def _port_in_flight(port: _Port, loads: Mapping[str, Load], gone: Load) -> PortInFlight:
    return PortInFlight(
        {key: EndpointInFlight(key, loads.get(key, Load()), key in port.terminating)
         for key in port.endpoints.values()}, gone)


def count(flows: Mapping[Flow, Sequence[int]], index: FlowIndex) -> InFlight:
    """The connections of every TCP service port in `index`, from per-flow counts
    ([established, other]); a port's endpoints without a flow at 0. A flow to an address
    shared by several ports (an external IP two Services claim) is the one's whose endpoint
    answered; to a NodePort, only when an endpoint of it answered (the port alone says
    nothing of the address it was sent to)."""
    loads: dict[PortKey, dict[str, Load]] = {}
    gone: dict[PortKey, Load] = {}
    for (dst, dport, src, sport), (established, other) in flows.items():
        load = Load(established, other)
        candidates = index.by_address.get((dst, dport))
        by_address = candidates is not None
        if candidates is None:
            candidates = index.by_node_port.get(dport)
            if candidates is None:
                continue
        for port in candidates:
            endpoint = port.endpoints.get((src, sport))
            if endpoint is not None:
                mine = loads.setdefault(port.key, {})
                mine[endpoint] = mine.get(endpoint, Load()).plus(load)
                break
        else:
            if by_address:
                key = candidates[0].key
                gone[key] = gone.get(key, Load()).plus(load)
    out = {port.key: _port_in_flight(port, loads.get(port.key, {}), gone.get(port.key, Load()))
           for port in index.ports
           if port.key in loads or port.key in gone or port.terminating}
    return InFlight(out, index)


class Row(NamedTuple):
    """One exported gauge: its labels and value."""

    service: str
    port: str
    endpoint: str
    terminating: str  # "true" | "false"
    established: int


def exported(in_flight: InFlight, cap: int = MAX_SERIES) -> tuple[list[Row], int]:
    """The metric's series: endpoints with established connections, and terminating ones
    whatever their count, the `cap` largest; and how many were left out."""
    rows = [Row(str(name.service), name.port, e.endpoint, "true" if e.terminating else "false",
                e.load.established)
            for (name, _), port in in_flight.ports.items() for e in port.endpoints.values()
            if e.load.established or e.terminating]
    if len(rows) <= cap:
        return rows, 0
    rows.sort(key=lambda r: r.established, reverse=True)
    return rows[:cap], len(rows) - cap


def in_flight_text(port: Mapping[str, object]) -> str:
    """A port's `inFlight` (PortInFlight.as_dict) in a table cell: "12", "12 (draining: 3
    left)"."""
    text = str(port["established"])
    if port["draining"]:
        text += f" (draining: {port['draining']} left)"
    return text


def endpoint_lines(port: Mapping[str, object]) -> list[str]:
    """A port's `inFlight` as explain's lines, one per endpoint with connections or
    terminating."""
    out = []
    endpoints = port["endpoints"]
    assert isinstance(endpoints, list)
    for e in endpoints:
        if e["terminating"]:
            out.append(f"in flight: {e['endpoint']} terminating, draining: "
                       f"{e['established']} left")
        elif e["established"] or e["other"]:
            out.append(f"in flight: {e['endpoint']} {e['established']} established"
                       + (f", {e['other']} opening or closing" if e["other"] else ""))
    if port["gone"]:
        out.append(f"in flight: {port['gone']} established to endpoints no longer in the "
                   "service")
    return out
