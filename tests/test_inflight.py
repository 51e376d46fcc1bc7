"""Connections in flight without a kernel: decoding a conntrack dump, counting flows per
endpoint, the metric's bounded series, when the reader reads, and how people see them.
tests/test_inflight_netns.py has the same on real packets."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from pyproxy.cli.formats import format_services
from pyproxy.cluster.snapshot import build_state
from pyproxy.core.explain import explain_report, format_table
from pyproxy.core.inflight import (
    FlowIndex,
    InFlight,
    Load,
    count,
    endpoint_lines,
    exported,
    in_flight_text,
)
from pyproxy.core.model import IPFamily, Protocol, ServicePortName
from pyproxy.core.topology import select_all
from pyproxy.kernel.nlconntrack import DumpParser, FlowCounts, dump_request
from pyproxy.kernel.nlelements import HEADER, NLMSG_DONE
from pyproxy.serve.live import with_in_flight
from pyproxy.sync.inflight import InFlightReader
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.ctfill import entry_message

WEB = ServicePortName("ns", "web", "http", Protocol.TCP)


def done() -> bytes:
    return HEADER.pack(HEADER.size + 4, NLMSG_DONE, 2, 0, 0) + struct.pack("=i", 0)


def test_a_dump_is_counted_per_flow_the_same_by_either_decoding() -> None:
    messages = [
        entry_message("192.168.0.2", 1000 + i, "10.96.0.10", 80, "10.244.1.2", 8080,
                      dumped=True)
        for i in range(5)] + [
        entry_message("192.168.0.2", 2000, "10.96.0.10", 80, "10.244.1.2", 8080, "TIME_WAIT",
                      dumped=True),
        entry_message("fd00::2", 3000, "fd00:96::a", 80, "fd00:244::2", 8080, dumped=True),
    ]
    # the first message of each length is decoded generically, the rest at its offsets:
    # fed one by one (each its own layout) or together, the counts are the same
    together, alone = DumpParser(), DumpParser()
    together.feed(b"".join(messages) + done())
    for message in messages:
        fresh = DumpParser()
        fresh.feed(message + done())
        alone.counts.entries += fresh.counts.entries
        for flow, tally in fresh.result().flows.items():
            got = alone.counts.flows.setdefault(flow, [0, 0])
            got[0], got[1] = got[0] + tally[0], got[1] + tally[1]
    flows = together.result().flows
    assert together.done and together.counts.entries == 7
    assert flows == {
        ("10.96.0.10", 80, "10.244.1.2", 8080): [5, 1],
        ("fd00:96::a", 80, "fd00:244::2", 8080): [1, 0],
    }
    assert alone.counts.flows == flows


def test_a_message_of_a_known_length_laid_out_otherwise_is_decoded_generically() -> None:
    first = entry_message("192.168.0.2", 1000, "10.96.0.10", 80, "10.244.1.2", 8080,
                          dumped=True)
    parser = DumpParser()
    parser.feed(first)
    # the same length, the original tuple's addresses labelled the other way round: at
    # the layout's offset of the destination there is now the source (its header says so)
    body = bytearray(first)
    ip = HEADER.size + 4 + 8  # the original tuple's first address attribute
    assert struct.unpack_from("=HH", body, ip) == (8, 1)  # CTA_IP_V4_SRC
    struct.pack_into("=H", body, ip + 2, 2)
    struct.pack_into("=H", body, ip + 8 + 2, 1)
    parser.feed(bytes(body) + done())
    assert parser.result().flows == {
        ("10.96.0.10", 80, "10.244.1.2", 8080): [1, 0],
        ("192.168.0.2", 80, "10.244.1.2", 8080): [1, 0],  # its destination, read generically
    }


def test_the_request_asks_the_kernel_for_dnated_tcp_or_everything() -> None:
    filtered, everything = dump_request(IPFamily.IPv4, 1), dump_request(IPFamily.IPv4, 1, False)
    assert len(everything) == HEADER.size + 4
    assert len(filtered) > len(everything)
    assert HEADER.unpack_from(filtered)[1] == 0x101  # ctnetlink, IPCTNL_MSG_CT_GET


def state(terminating: tuple[str, ...] = (), **spec: Any) -> Any:
    def tweak(svc: dict[str, Any]) -> None:
        svc["spec"].update(spec)

    return build_state([
        make_node("node-a", "zone-1"),
        make_service("ns", "web", tweak),
        make_slice("ns", "web", [ep(ip, "node-a", ready=ip not in terminating, serving=True,
                                    terminating=ip in terminating)
                                 for ip in ("10.244.1.2", "10.244.1.3")]),
        make_service("ns", "dns", lambda s: s["spec"].update(ports=[
            {"name": "dns", "port": 53, "protocol": "UDP"}]), ip="10.96.0.53"),
    ])


def index(s: Any) -> FlowIndex:
    return FlowIndex.of((ps, s.endpoints(ps.port.name, ps.family))
                        for ps in select_all(s, "node-a"))


def test_flows_are_given_to_their_service_port_and_endpoint() -> None:
    node_port = 30080
    s = state(terminating=("10.244.1.3",), type="NodePort", externalIPs=["192.0.2.7"],
              ports=[{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                      "nodePort": node_port}])
    flows = {
        ("10.96.0.10", 80, "10.244.1.2", 8080): [3, 1],
        ("192.0.2.7", 80, "10.244.1.2", 8080): [1, 0],  # the external IP
        ("192.168.50.1", node_port, "10.244.1.3", 8080): [2, 0],  # the NodePort
        ("10.96.0.10", 80, "10.244.9.9", 8080): [4, 0],  # an endpoint that left
        ("192.168.50.1", node_port, "10.244.9.9", 8080): [7, 0],  # a node port of nobody's
        ("10.96.0.10", 443, "10.244.1.2", 8080): [5, 0],  # another port
        ("10.96.0.53", 53, "10.244.1.2", 53): [1, 0],  # UDP ports are not counted
    }
    result = count(flows, index(s))
    assert set(result.ports) == {(WEB, IPFamily.IPv4)}
    port = result.of(WEB, IPFamily.IPv4)
    assert port is not None
    assert {k: (e.load, e.terminating) for k, e in port.endpoints.items()} == {
        "10.244.1.2:8080": (Load(4, 1), False), "10.244.1.3:8080": (Load(2, 0), True)}
    assert port.gone == Load(4, 0)
    assert (port.established, port.draining) == (6, 2)
    assert port.as_dict() == {
        "established": 6, "draining": 2, "gone": 4,
        "endpoints": [
            {"endpoint": "10.244.1.2:8080", "established": 4, "other": 1, "terminating": False},
            {"endpoint": "10.244.1.3:8080", "established": 2, "other": 0, "terminating": True}]}


def test_an_address_two_services_share_goes_to_the_one_whose_endpoint_answered() -> None:
    objects = [make_node("node-a", "zone-1")]
    for name, ip, pod in (("one", "10.96.0.1", "10.244.1.2"), ("two", "10.96.0.2", "10.244.2.2")):
        objects += [make_service("ns", name, lambda s: s["spec"].update(
                        externalIPs=["192.0.2.7"]), ip=ip),
                    make_slice("ns", name, [ep(pod, "node-a")])]
    result = count({("192.0.2.7", 80, "10.244.2.2", 8080): [2, 0]}, index(build_state(objects)))
    two = result.of(ServicePortName("ns", "two", "http", Protocol.TCP), IPFamily.IPv4)
    one = result.of(ServicePortName("ns", "one", "http", Protocol.TCP), IPFamily.IPv4)
    assert two is not None and one is not None
    assert two.established == 2 and one.established == 0 and one.gone == Load()


def test_the_metric_exports_busy_and_terminating_endpoints_within_a_cap() -> None:
    s = state(terminating=("10.244.1.3",))
    idle = count({}, index(s))
    rows, left_out = exported(idle)
    # the terminating endpoint at 0 (a finished drain); the idle ready one not at all
    assert [(r.endpoint, r.terminating, r.established) for r in rows] == [
        ("10.244.1.3:8080", "true", 0)]
    busy = count({("10.96.0.10", 80, "10.244.1.2", 8080): [9, 0]}, index(s))
    rows, left_out = exported(busy, cap=1)
    assert [(r.endpoint, r.established) for r in rows] == [("10.244.1.2:8080", 9)]
    assert left_out == 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_reader_reads_at_most_every_max_age_and_within_its_duty() -> None:
    s = state()
    clock, reads = Clock(), []

    def read(family: IPFamily) -> FlowCounts:
        reads.append(family)
        return FlowCounts({("10.96.0.10", 80, "10.244.1.2", 8080): [len(reads), 0]}, 1)

    reader = InFlightReader([IPFamily.IPv4], read,
                            lambda: [(ps, s.endpoints(ps.port.name, ps.family))
                                     for ps in select_all(s, "node-a")], clock=clock)
    assert reader.latest() is None
    first = reader.current(10)
    assert reader.current(10) is first and len(reads) == 1
    clock.now += 10
    assert reader.current(10) is not first and len(reads) == 2
    # a read that took 1 s is followed by none for 20 s (5 % of a CPU), whatever is asked
    reader.latest().seconds = 1.0  # type: ignore[union-attr]
    clock.now += 19
    assert reader.current(0) is reader.latest() and len(reads) == 2
    clock.now += 1
    reader.current(0)
    assert len(reads) == 3


def test_services_wide_and_explain_show_the_connections_in_flight() -> None:
    s = state(terminating=("10.244.1.3",))
    in_flight = count({("10.96.0.10", 80, "10.244.1.2", 8080): [4, 0],
                       ("10.96.0.10", 80, "10.244.1.3", 8080): [2, 1]}, index(s))
    report = explain_report(s, "node-a")
    report["services"] = with_in_flight(report["services"], in_flight)
    web = next(e for e in report["services"] if e["service"] == "ns/web")
    dns = next(e for e in report["services"] if e["service"] == "ns/dns")
    assert "inFlight" not in dns  # UDP: no connections to count
    assert in_flight_text(web["inFlight"]) == "6 (draining: 2 left)"
    assert endpoint_lines(web["inFlight"]) == [
        "in flight: 10.244.1.2:8080 4 established",
        "in flight: 10.244.1.3:8080 terminating, draining: 2 left"]
    text = format_table(report)
    assert "  - in flight: 10.244.1.3:8080 terminating, draining: 2 left" in text
    entries = [{**e, "servicePort": 80, "type": "ClusterIP", "nodePort": None,
                "externalIPs": [], "loadBalancerIPs": [], "sessionAffinity": "None"}
               for e in report["services"]]
    table = format_services(entries, wide=True)
    assert "IN-FLIGHT" in table.splitlines()[0]
    assert table.splitlines()[2].endswith("6 (draining: 2 left)")


def test_without_a_read_nothing_is_added() -> None:
    entries = [{"service": "ns/web", "port": "http", "ipFamily": "IPv4", "protocol": "TCP"}]
    assert with_in_flight(entries, None) == entries
    assert with_in_flight(entries, InFlight()) == entries


@pytest.mark.parametrize("draining,text", [(0, "3"), (1, "3 (draining: 1 left)")])
def test_in_flight_text(draining: int, text: str) -> None:
    assert in_flight_text({"established": 3, "draining": draining}) == text
