"""The netlink element encoder (pyproxy/kernel/nlelements.py), without a kernel: what it
understands, what it leaves to libnftables, and that its two ways of encoding agree. Its
bytes against the kernel's are in tests/test_nft_kernel.py."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyproxy.kernel import nlelements as nle
from pyproxy.kernel.nlelements import Layout, Unencodable
from pyproxy.render.objects import VERDICT, ElementValue, Key, SetDecl, Verdict

ENDPOINTS = SetDecl(("ip daddr", "tcp dport", "numgen random mod 1"), ("ip daddr", "tcp dport"),
                    typeof=True)
ENDPOINTS6 = SetDecl(("ip6 daddr", "udp dport", "numgen random mod 1"),
                     ("ip6 daddr", "udp dport"), typeof=True)
SERVICE_IPS = SetDecl(("ipv4_addr", "inet_proto", "inet_service"), VERDICT, comment="x")
HAIRPIN = SetDecl(("ipv4_addr", "ipv4_addr"), comment="endpoint . itself, for hairpin")


def test_layouts_of_the_declarations_pyproxy_renders() -> None:
    assert Layout.of(ENDPOINTS) == Layout(("ipv4_addr", "inet_service", "integer32"),
                                          ("ipv4_addr", "inet_service"))
    assert Layout.of(ENDPOINTS6).data == ("ipv6_addr", "inet_service")
    assert Layout.of(SERVICE_IPS) == Layout(("ipv4_addr", "inet_proto", "inet_service"),
                                            "verdict")
    assert Layout.of(HAIRPIN) == Layout(("ipv4_addr", "ipv4_addr"), None)
    assert Layout.of(SetDecl(("ipv6_addr",), comment="Active ClusterIPs")).key == ("ipv6_addr",)


@pytest.mark.parametrize("declaration", [
    SetDecl(("ipv4_addr",), flags=("interval",), comment="ServiceCIDRs"),
    SetDecl(("ipv4_addr",), flags=("dynamic", "timeout"), timeout=10800),
    SetDecl(("ether_addr",)),
    SetDecl(("ip daddr",), ("meta mark",), typeof=True),
    SetDecl(("ipv4_addr",), ()),  # a map without data
    SetDecl(()),  # no key (the elements of a set nobody declares)
])
def test_what_is_left_to_libnftables(declaration: SetDecl) -> None:
    with pytest.raises(Unencodable):
        Layout.of(declaration)


GOOD = (("10.96.0.9", 80, 1), ("10.244.0.9", 80))


@pytest.mark.parametrize("declaration,element", [
    (ENDPOINTS, (("10.96.0.1", 80, 0), ())),  # a map element without its data
    (ENDPOINTS, (("10.96.0.1", 80), ("10.244.0.1", 8080))),  # a field short
    (ENDPOINTS, (("10.96.0.1", 70000, 0), ("10.244.0.1", 8080))),
    (ENDPOINTS, (("10.96.0.1", "http", 0), ("10.244.0.1", 8080))),
    (ENDPOINTS, (("fd00::1", 80, 0), ("10.244.0.1", 8080))),
    (ENDPOINTS, (("10.96.0.1", 80, 0), Verdict("goto", "x"))),  # a verdict in a value map
    (SERVICE_IPS, (("10.96.0.1", "tcp", 80), Verdict("goto", "x", 'a"b'))),
    (SERVICE_IPS, (("10.96.0.1", "tcp", 80), Verdict("goto", '"x"'))),
    (SERVICE_IPS, (("10.96.0.1", "tcp", 80), Verdict("vmap", "x"))),
    (SERVICE_IPS, (("10.96.0.1", "tcp", 80), ("10.244.0.1", 8080))),  # data, no verdict
    (HAIRPIN, (("10.244.0.0/24", "10.244.0.1"), ())),
])
def test_elements_it_does_not_understand(declaration: SetDecl,
                                         element: tuple[Key, ElementValue]) -> None:
    encoder = Layout.of(declaration).encoder()
    with pytest.raises(Unencodable):
        encoder(element)
    # the whole set goes to libnftables then
    encoded, left = nle.encode_loads([("s", declaration, (GOOD, element))])
    assert encoded == [] and left == [("s", declaration, (GOOD, element))]


def test_an_endpoints_element_byte_by_byte() -> None:
    element = Layout.of(ENDPOINTS).encoder()((("10.96.0.16", 80, 3), ("10.244.0.7", 8080)))
    slot = (3).to_bytes(4, "little" if struct.pack("=H", 1) == b"\1\0" else "big")
    key = bytes([10, 96, 0, 16]) + b"\0\x50\0\0" + slot
    data = bytes([10, 244, 0, 7]) + b"\x1f\x90\0\0"
    nested = 0x8000
    expected = (struct.pack("=HH", 4 + 20 + 16, 1 | nested)
                + struct.pack("=HH", 20, 1 | nested) + struct.pack("=HH", 16, 1) + key
                + struct.pack("=HH", 16, 2 | nested) + struct.pack("=HH", 12, 1) + data)
    assert element == expected


def test_a_verdict_element_with_a_comment() -> None:
    element = Layout.of(SERVICE_IPS).encoder()(
        (("10.96.0.16", "udp", 53), Verdict("goto", "svc-x", "kube-system/dns:dns")))
    assert b"\x00\x14kube-system/dns:dns\x00" in element  # udata: type 0, length, string
    assert struct.pack(">i", -4) in element and b"svc-x\x00" in element  # NFT_GOTO
    assert bytes([10, 96, 0, 16, 17, 0, 0, 0, 0, 53, 0, 0]) in element


addresses = st.integers(0, 2**32 - 1).map(lambda n: ".".join(str(n >> s & 255)
                                                             for s in (24, 16, 8, 0)))
ports = st.integers(1, 65535)
endpoints = st.tuples(addresses, ports, st.integers(0, 5000), addresses, ports).map(
    lambda f: ((f[0], f[1], f[2]), (f[3], f[4])))


@given(st.lists(endpoints, min_size=1, max_size=300))
def test_column_wise_is_element_by_element(elements: list[tuple[Key, ElementValue]]) -> None:
    encoder = Layout.of(ENDPOINTS).encoder()
    payloads = encoder.encode(elements)
    assert b"".join(payloads) == b"".join(encoder(e) for e in elements)
    assert all(len(p) <= nle.MESSAGE_PAYLOAD for p in payloads)


def test_misaligned_elements_are_not_taken_column_wise() -> None:
    """One key a field long and one a field short: element by element says what is
    wrong."""
    encoder = Layout.of(ENDPOINTS).encoder()
    with pytest.raises(Unencodable):
        encoder.encode([(("10.96.0.1", 80, 0, 7), ("10.244.0.1", 80)),
                        (("10.96.0.1", 80), ("10.244.0.1", 80))])


def test_messages_hold_whole_elements_within_the_16_bit_length() -> None:
    elements = [((f"10.96.{i // 250}.{i % 250}", 80, i), (f"10.244.{i // 250}.{i % 250}", 8080))
                for i in range(10_000)]
    payloads = Layout.of(ENDPOINTS).encoder().encode(elements)
    size = len(Layout.of(ENDPOINTS).encoder()(elements[0]))
    assert len(payloads) > 1 and all(len(p) % size == 0 and len(p) <= nle.MESSAGE_PAYLOAD
                                      for p in payloads)
    batch = nle.build_batch("ip", "pyproxy", [("endpoints-tcp", payloads)], seq=10)
    assert batch.begin == 10 and list(batch.sets) == list(range(11, 11 + len(payloads)))
    # begin, one message per payload, end; each fits its 16-bit attribute lengths
    offset, kinds = 0, []
    while offset < len(batch.data):
        length, kind = struct.unpack_from("=IH", batch.data, offset)
        kinds.append(kind)
        offset += length
    assert kinds == [0x10, *[(10 << 8) | 12] * len(payloads), 0x11]


def test_a_deletion_names_the_key_an_addition_wrote() -> None:
    """A deletion's element is the addition's without its data (libnftables sends no data
    with `delete element`), as DELSETELEM messages without NLM_F_CREATE, in the edits'
    order."""
    encoder = Layout.of(SERVICE_IPS).encoder()
    element = (("10.96.0.1", "tcp", 80), Verdict("goto", "cluster-tcp-1", "ns/web:http"))
    added, deleted = encoder(element), encoder.key(element[0])
    # the same key attribute after the element's header; the addition's data follows it
    assert added[4:len(deleted)] == deleted[4:] and len(added) > len(deleted)
    assert struct.unpack_from("=H", deleted)[0] == len(deleted)
    edits = nle.encode_edits([(True, "service-ips", SERVICE_IPS, [element]),
                              (False, "service-ips", SERVICE_IPS, [element])])
    assert edits == [(True, "service-ips", [deleted]), (False, "service-ips", [added])]
    batch = nle.build_edits("ip", "pyproxy", edits)
    headers, offset = [], 0
    while offset < len(batch.data):
        length, kind, flags = struct.unpack_from("=IHH", batch.data, offset)
        headers.append((kind, flags))
        offset += length
    assert headers == [(0x10, 0x1), ((10 << 8) | 14, 0x1 | 0x4),
                       ((10 << 8) | 12, 0x1 | 0x4 | 0x400), (0x11, 0x1)]
    assert list(batch.sets.values()) == ["deleting elements from service-ips",
                                         "adding elements to service-ips"]
    with pytest.raises(Unencodable):  # one set libnftables must write: all of them go there
        nle.encode_edits([(True, "service-ips", SERVICE_IPS, [element]),
                          (False, "cidrs", SetDecl(("ipv4_addr",), flags=("interval",)),
                           [(("10.0.0.0/8",), ())])])

