"""Go 1.16's address parsers, which Kubernetes kept for objects stored before the API server
refused leading zeros (pyproxy/core/fields.py reads addresses with them)."""

from __future__ import annotations

import ipaddress
import socket

#
# Go 1.17 began refusing IPv4 octets with leading zeros (other tools read `010` as octal 8).
# Objects stored before the API server refused them still exist, so Kubernetes kept Go 1.16's
# parser as netutils.ParseIPSloppy/ParseCIDRSloppy, and kube-proxy reads every Service and
# EndpointSlice address with it. The functions below are that parser, step for step: every
# octet decimal, any number of leading zeros, value <= 255; IPv6 groups likewise hex.

_GO_BIG = 0xFFFFFF  # Go's dtoi/xtoi give up at this value, however many digits are left
_DECIMAL = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")


def parse_ip_sloppy(text: str) -> str | None:
    """The canonical form of what kube-proxy's ParseIPSloppy reads in `text` (`10.96.0.010` is
    10.96.0.10, not octal), or None when it reads nothing. As Go's parser, the first '.' or
    ':' decides the family."""
    for char in text:
        if char == ".":
            v4 = _go_ipv4(text)
            return None if v4 is None else socket.inet_ntop(socket.AF_INET, v4)
        if char == ":":
            v6 = _go_ipv6(text)
            return None if v6 is None else socket.inet_ntop(socket.AF_INET6, v6)
    return None


def parse_cidr_sloppy(text: str) -> str | None:
    """The canonical network of what kube-proxy's ParseCIDRSloppy reads in `text` (address
    as `parse_ip_sloppy`, prefix length in decimal digits), or None."""
    address, slash, prefix = text.partition("/")
    if not slash:
        return None
    packed = _go_ipv4(address)
    if packed is None:
        packed = _go_ipv6(address)
    bits = _go_number(prefix, 0, 10, _DECIMAL)
    if packed is None or bits is None or bits[1] != len(prefix) or bits[0] > 8 * len(packed):
        return None
    return str(ipaddress.ip_network((packed, bits[0]), strict=False))


def _go_number(text: str, pos: int, base: int, digits: frozenset[str]) -> tuple[int, int] | None:
    """Go's dtoi/xtoi from `pos`: (value, end) of the run of digits there, or None when there
    is none or it reaches 0xFFFFFF."""
    value, end = 0, pos
    while end < len(text) and text[end] in digits:
        value = value * base + int(text[end], base)
        if value >= _GO_BIG:
            return None
        end += 1
    return (value, end) if end > pos else None


def _go_ipv4(text: str) -> bytes | None:
    octets = bytearray()
    pos = 0
    for i in range(4):
        if i:
            if text[pos:pos + 1] != ".":
                return None
            pos += 1
        number = _go_number(text, pos, 10, _DECIMAL)
        if number is None or number[0] > 0xFF:
            return None
        octets.append(number[0])
        pos = number[1]
    return bytes(octets) if pos == len(text) else None


def _go_ipv6(text: str) -> bytes | None:
    address = bytearray(16)
    ellipsis = -1  # where "::" stands, in bytes
    pos = 0
    if text.startswith("::"):
        ellipsis, pos = 0, 2
        if pos == len(text):
            return bytes(address)
    i = 0
    while i < 16:
        number = _go_number(text, pos, 16, _HEX)
        if number is None or number[0] > 0xFFFF:
            return None
        group, end = number
        if text[end:end + 1] == ".":  # an IPv4 address in the last 32 bits
            if (ellipsis < 0 and i != 12) or i + 4 > 16:
                return None
            v4 = _go_ipv4(text[pos:])
            if v4 is None:
                return None
            address[i:i + 4] = v4
            pos, i = len(text), i + 4
            break
        address[i:i + 2] = group.to_bytes(2, "big")
        i, pos = i + 2, end
        if pos == len(text):
            break
        if text[pos] != ":" or pos + 1 == len(text):
            return None
        pos += 1
        if text[pos] == ":":
            if ellipsis >= 0:
                return None
            ellipsis, pos = i, pos + 1
            if pos == len(text):
                break
    if pos != len(text):
        return None
    if i < 16:
        if ellipsis < 0:
            return None
        address[ellipsis:] = bytes(16 - i) + address[ellipsis:i]
    elif ellipsis >= 0:
        return None  # "::" must stand for at least one group
    return bytes(address)


