"""What the daemon answers on its debug socket: status, services, explain, trace, diff and
history, computed from the live state under the sync lock; and /fault, the drills' kernel
fault injection (docs/drills.md)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pyproxy.core.coexistence import Finding
from pyproxy.core.explain import explain_report, port_entry
from pyproxy.core.inflight import InFlight, exported
from pyproxy.core.least import LeastSlots
from pyproxy.core.model import IPFamily, Protocol, ServiceKey, ServicePortName, ip_family
from pyproxy.core.outliers import PortOutliers
from pyproxy.core.topology import PortSelection
from pyproxy.kernel.nlsets import KernelCounters
from pyproxy.render.objects import Element, ElementValue, Key, element_text
from pyproxy.render.skeleton import render_config
from pyproxy.render.trace import trace
from pyproxy.serve.connections import (
    ConnectionCounters,
    CountingContext,
    Kernel,
    Series,
    endpoint_family,
)
from pyproxy.serve.debug import Handler
from pyproxy.serve.health import ProxyHealth
from pyproxy.serve.metrics import Metrics, gauge_family
from pyproxy.sync.applier import inject_faults, pending_faults
from pyproxy.sync.inflight import InFlightReader, kernel_reader
from pyproxy.sync.least import LeastConnections
from pyproxy.sync.proxier import FamilyProxier, disputes_report
from pyproxy.sync.runner import BoundedFrequencyRunner

from pyproxy.sync.node import NodeProxier, SyncRecord  # isort: skip

log = structlog.get_logger(__name__)


def record_dict(record: SyncRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    out = dataclasses.asdict(record)
    # `cause` by its name (what a script compares), `reason` as history prints it
    out.update(scope=record.scope.name.lower(), full=record.full,
               cause=record.cause.name.lower(), reason=record.cause.value,
               seconds=record.seconds)
    return out


def parse_destination(text: str) -> tuple[str, int, str]:
    """"IP:PORT/PROTO" (IPv6 as "[IP]:PORT/PROTO"; PROTO defaults to tcp). Raises ValueError
    for a port outside 1..65535 or an address that is not an IP."""
    address, _, proto = text.partition("/")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"destination {text!r}: expected IP:PORT[/PROTO]")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"destination {text!r}: port {int(port)} is outside 1..65535")
    proto = (proto or "tcp").lower()
    if proto not in ("tcp", "udp", "sctp"):
        raise ValueError(f"destination {text!r}: protocol must be tcp, udp or sctp")
    host = host.strip("[]")
    try:
        return str(ip_address(host)), int(port), proto
    except ValueError:
        raise ValueError(f"destination {text!r}: {host!r} is not an IP address") from None


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One connection to trace, checked: the addresses of one family, ports in 1..65535."""

    src: str
    dst: str
    port: int
    protocol: str
    sport: int | None


def trace_request(src: str, dst: str, sport: str | int | None) -> TraceRequest:
    """A trace's inputs as `pyproxy trace` takes them (--src, --dst, --sport), checked by the
    CLI before it asks (offline or live) and by the daemon; each error names the flag."""
    try:
        source = ip_address(src)
    except ValueError:
        raise ValueError(f"--src: {src!r} is not an IP address") from None
    try:
        address, port, proto = parse_destination(dst)
    except ValueError as err:
        raise ValueError(f"--dst: {err}") from None
    if ip_address(address).version != source.version:
        raise ValueError(f"--src {source} is IPv{source.version} and --dst {address} is "
                         f"IPv{ip_address(address).version}: a connection has one family")
    if sport is not None and not (str(sport).isdigit() and 1 <= int(sport) <= 65535):
        raise ValueError(f"--sport: expected a port in 1..65535, got {str(sport)[:20]!r}")
    return TraceRequest(str(source), address, port, proto,
                        int(sport) if sport is not None else None)


MAX_FAULTS = 1_000_000


def parse_fault_count(text: str) -> int:
    """The N of `/fault?fail=N`: a whole number, 0 to MAX_FAULTS."""
    if not text.isdigit() or int(text) > MAX_FAULTS:
        raise ValueError(f"fail: expected a whole number 0..{MAX_FAULTS}, got {text[:40]!r}")
    return int(text)


def service_key(text: str) -> ServiceKey:
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name:
        raise ValueError(f"expected NAMESPACE/NAME, got {text!r}")
    return ServiceKey(namespace, name)


def trace_in(proxiers: list[FamilyProxier], query: Mapping[str, str]) -> dict[str, Any]:
    request = trace_request(query.get("src") or "", query.get("dst", ""),
                            query.get("sport") or None)
    family = ip_family(request.dst)
    for proxier in proxiers:
        if proxier.family is family:
            cfg = render_config(proxier.config, family)
            result = trace(proxier.desired, cfg, request.src, request.dst, request.port,
                           request.protocol, from_node=query.get("from_node") == "1",
                           sport=request.sport)
            answer = result.as_dict()
            if query.get("verify") == "1":
                answer["verified"] = verify(proxier, result.consulted)
            return answer
    raise ValueError(f"this node does not proxy {family}")


def verify(proxier: FamilyProxier, consulted: list[tuple[str, Key, ElementValue]],
           ) -> list[str]:
    """Check every element the trace relied on against the kernel: the answer holds for
    the kernel only if each is there with the same value. Each set or map is read once, as
    nft's JSON listing. Returns the mismatches."""
    problems = []
    held: dict[str, dict[Key, ElementValue]] = {}
    for container, key, value in consulted:
        if container not in held:
            held[container] = dict(kernel_elements(proxier, container))
        found = held[container].get(key)
        if found != value:
            has = None if found is None else element_text(key, found)
            problems.append(f"{container}: expected {element_text(key, value)!r}, kernel "
                            f"has {has!r}")
    return problems


def kernel_elements(proxier: FamilyProxier, container: str) -> list[Element]:
    """The elements the kernel holds in one of the table's sets or maps (none: no such)."""
    declaration = proxier.desired.declaration(container)
    kind = "set" if declaration is None else declaration.kind
    applier = proxier.applier
    return applier.nft.list_elements(applier.family, kind, container) or []


def with_other_tables(report: dict[str, Any], found: tuple[Finding, ...]) -> dict[str, Any]:
    """A live explain report with the other tables' chains that may drop what it explains:
    `otherTables` and a warning each (only when there are any, so a live report without
    them equals the offline one)."""
    if not found:
        return report
    return {**report, "warnings": [*report.get("warnings", ()), *(f.text() for f in found)],
            "otherTables": [f.as_dict() for f in found]}


def connection_counters(proxier: NodeProxier) -> ConnectionCounters:
    """The new-connection counters of the proxier's families, read from the kernel's
    counting sets (`pyproxy status` and the metrics)."""
    counters = KernelCounters()
    return ConnectionCounters(proxier.families, functools.partial(counting_context, proxier),
                              Kernel(counters.read, counters.delete))


@dataclass(frozen=True)
class ConnectionViews:
    """What the daemon shows of the connections through it: new connections per endpoint
    (the kernel's counters) and the connections in flight (conntrack, read at most every
    `interval`; None when inFlightInterval is 0)."""

    new: ConnectionCounters
    in_flight: InFlightReader | None = None
    interval: float = 10.0

    def in_flight_now(self) -> InFlight | None:
        return None if self.in_flight is None else self.in_flight.current(self.interval)


class InFlightCollector(Collector):
    """Connections in flight per endpoint, read from conntrack at scrape time (at most every
    inFlightInterval; sync/inflight.py)."""

    NAMES = ("pyproxy_endpoint_connections_in_flight", "pyproxy_connections_in_flight_omitted",
             "pyproxy_connections_in_flight_read_seconds", "pyproxy_connections_in_flight_entries")

    def __init__(self, current: Callable[[], InFlight | None]) -> None:
        self.current = current

    def describe(self) -> Iterator[Metric]:
        # without it, registering would call collect(): a conntrack read before the first sync
        for name in self.NAMES:
            yield gauge_family(name)

    def collect(self) -> Iterator[Metric]:
        per_endpoint, omitted, seconds, entries = (gauge_family(n) for n in self.NAMES)
        try:
            in_flight = self.current()
        except Exception as err:  # the rest of /metrics must still answer
            log.warning("connections_in_flight_not_read", error=str(err))
            in_flight = None
        if in_flight is not None:
            rows, left_out = exported(in_flight)
            for row in rows:
                per_endpoint.add_metric(list(row[:4]), row.established)
            omitted.add_metric([], left_out)
            seconds.add_metric([], in_flight.seconds)
            entries.add_metric([], in_flight.entries)
        yield from (per_endpoint, omitted, seconds, entries)


def connection_views(proxier: NodeProxier, metrics: Metrics, in_flight_interval: float,
                     least: LeastConnections | None = None) -> ConnectionViews:
    """Both views of the daemon's proxier, their metrics registered. Least-connection
    balancing (`least`) reads the same dumps as the view: one conntrack read serves both,
    within one duty cycle (with inFlightInterval 0 it keeps a reader of its own)."""
    views = ConnectionViews(connection_counters(proxier),
                            kernel_reader(proxier) if in_flight_interval else None,
                            in_flight_interval)
    metrics.watch_connections(views.new.totals)
    if views.in_flight is not None:
        metrics.registry.register(InFlightCollector(views.in_flight_now))
        if least is not None:
            least.reader = views.in_flight
    return views


def with_in_flight(entries: list[dict[str, Any]],
                   in_flight: InFlight | None) -> list[dict[str, Any]]:
    """Each TCP service port entry (`services`, `explain`) with `inFlight`: its established
    connections per endpoint (core/inflight.py's PortInFlight.as_dict)."""
    if in_flight is None:
        return entries
    out = []
    for e in entries:
        namespace, _, name = e["service"].partition("/")
        port = None if e["protocol"] != "TCP" else in_flight.of(
            ServicePortName(namespace, name, e["port"], Protocol.TCP), IPFamily(e["ipFamily"]))
        out.append(e if port is None else {**e, "inFlight": port.as_dict()})
    return out


def counting_context(proxier: NodeProxier) -> CountingContext:
    """What the connection counters' labels need, copied under the sync lock."""
    with proxier.lock:
        state = proxier.cache.state()
        return CountingContext(
            tuple(ps for p in proxier.proxiers for ps in p.selections.values()),
            state.node(proxier.cache.node_name), state.node_labels())


def with_connections(entries: list[dict[str, Any]],
                     totals: Mapping[Series, int]) -> list[dict[str, Any]]:
    """Each `services` entry with `newConnections`: per endpoint of that service port and
    family that has counted any (endpoints gone from it too, while their count is kept)."""
    by_port: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for series, count in sorted(totals.items()):
        by_port.setdefault((series.service, series.port, str(endpoint_family(series))), []).append(
            {"endpoint": series.endpoint, "scope": series.scope, "count": count})
    return [{**e, "newConnections": by_port.get((e["service"], e["port"], e["ipFamily"]), [])}
            for e in entries]


def handlers(proxier: NodeProxier, health: ProxyHealth, runner: BoundedFrequencyRunner,
             source_status: Callable[[], Any],
             connections: ConnectionViews | None = None,
             other_tables: Callable[[], tuple[Finding, ...]] = lambda: ()
             ) -> dict[str, Handler]:
    def locked(fn: Callable[[Mapping[str, str]], Any]) -> Handler:
        def handle(query: Mapping[str, str]) -> tuple[int, Any]:
            with proxier.lock:
                return 200, fn(query)
        return handle

    def status(query: Mapping[str, str]) -> Any:
        history = list(proxier.history)
        ok = [r for r in history if r.error is None]
        services, endpoints = proxier.cache.pending()
        stats = runner.stats()
        return {
            "node": proxier.cache.node_name,
            "families": [str(p.family) for p in proxier.proxiers],
            "initialized": proxier.initialized,
            "sources": proxier.sources(),
            "healthy": health.healthy(),
            "nodeEligible": health.node_eligible(),
            "services": len(proxier.cache.services()),
            "servicePorts": sum(len(p.selections) for p in proxier.proxiers),
            "pendingChanges": {"services": services, "endpoints": endpoints},
            "invalidObjects": dict(proxier.skipped_total),
            "syncs": stats.runs, "syncFailures": stats.failures,
            "lastSync": record_dict(history[-1] if history else None),
            "lastFullSync": record_dict(next((r for r in reversed(ok) if r.full), None)),
            "lastPartialSync": record_dict(next((r for r in reversed(ok) if not r.full),
                                                None)),
            "source": source_status(),
            "otherTables": [f.as_dict() for f in other_tables()],
        }

    def services(query: Mapping[str, str]) -> Any:
        wanted = service_key(query["service"]) if query.get("service") else None
        entries = [port_entry(ps) for p in proxier.proxiers for ps in p.selections.values()
                   if wanted is None or ps.port.name.service == wanted]
        return sorted(entries, key=lambda e: (e["service"], e["port"], e["ipFamily"]))

    def services_handler(query: Mapping[str, str]) -> tuple[int, Any]:
        code, entries = locked(services)(query)
        # the kernel read outside the sync lock: at 10k services, a fraction of a second
        if query.get("connections") == "1" and connections is not None:
            entries = with_connections(entries, connections.new.totals())
        if query.get("inflight") == "1" and connections is not None:
            entries = with_in_flight(entries, connections.in_flight_now())
        return code, entries

    def explain(query: Mapping[str, str]) -> Any:
        wanted = service_key(query["service"]) if query.get("service") else None
        in_force = {(ps.port.name, ps.family): ps.selection
                    for p in proxier.proxiers for ps in p.selections.values()}

        def outliers(ps: PortSelection) -> PortOutliers | None:
            sel = in_force.get((ps.port.name, ps.family))
            return None if sel is None else sel.outliers

        def least(ps: PortSelection) -> LeastSlots | None:
            sel = in_force.get((ps.port.name, ps.family))
            return None if sel is None else sel.least

        report = explain_report(proxier.cache.state(), proxier.cache.node_name, wanted,
                                outliers, least)
        report["conflicts"] = disputes_report(((p.family, p.desired) for p in proxier.proxiers),
                                              wanted)
        return with_other_tables(report, other_tables())

    def explain_handler(query: Mapping[str, str]) -> tuple[int, Any]:
        code, report = locked(explain)(query)
        if query.get("inflight") == "1" and connections is not None:
            report["services"] = with_in_flight(report["services"],
                                                connections.in_flight_now())
        return code, report

    def trace_handler(query: Mapping[str, str]) -> Any:
        return trace_in(proxier.proxiers, query)

    def diff(query: Mapping[str, str]) -> Any:
        return {p.applier.family: p.applier.diff() for p in proxier.proxiers}

    def history(query: Mapping[str, str]) -> Any:
        count = int(query.get("n") or 20)
        return [record_dict(r) for r in list(proxier.history)[-count:]]

    def fault(query: Mapping[str, str]) -> Any:
        """Drills: `?fail=N` makes the next N transactions of each family (or only of
        `family=ip|ip6`) fail as if the kernel refused them; 0 stops it. Answers the
        failures still to come, per family."""
        appliers = [p.applier for p in proxier.proxiers]
        if query.get("family"):
            appliers = [a for a in appliers if a.family == query["family"]]
            if not appliers:
                raise ValueError(f"family: this node has no {query['family'][:10]!r} table")
        if "fail" in query:
            count = parse_fault_count(query["fail"])
            for applier in appliers:
                inject_faults(applier, count)
            log.warning("fault_injection_armed", fail_next=count,
                        families=[a.family for a in appliers])
        return {"failNext": {p.applier.family: pending_faults(p.applier)
                             for p in proxier.proxiers}}

    return {
        "/status": locked(status), "/services": services_handler, "/explain": explain_handler,
        "/trace": locked(trace_handler), "/diff": locked(diff), "/history": locked(history),
        "/fault": locked(fault),
    }
