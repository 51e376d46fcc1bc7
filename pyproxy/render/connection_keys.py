"""The keys of the `new-connections-N` sets, as the kernel stores them: service address .
protocol . service port (the node port for a NodePort) . endpoint address . endpoint port,
each field padded to 4 bytes, addresses and ports in network order.

One place for the layout the rules declare (render/objects.py) and everything that handles
the keys relies on: the ledger that labels them (serve/connections.py) and the netlink reader
and garbage collector (kernel/nlsets.py)."""

from __future__ import annotations

import ipaddress
import socket

from pyproxy.core.model import Protocol
from pyproxy.render.objects import CONNECTION_SHARDS

PROTOCOL_NUMBERS = {Protocol.TCP: 6, Protocol.UDP: 17, Protocol.SCTP: 132}
_PROTOCOL_NAMES = {number: str(proto).lower() for proto, number in PROTOCOL_NUMBERS.items()}


def _packed(address: str) -> bytes:
    # inet_pton: ten times faster than ipaddress, and this runs for every endpoint
    return socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)


def _port(port: int) -> bytes:
    return port.to_bytes(2, "big") + b"\0\0"


def service_part(address: str, protocol: int, port: int) -> bytes:
    return _packed(address) + node_port_part(protocol, port)


def node_port_part(protocol: int, port: int) -> bytes:
    return bytes((protocol, 0, 0, 0)) + _port(port)


def endpoint_part(address: str, port: int) -> bytes:
    return _packed(address) + _port(port)


def _address_size(key: bytes) -> int:
    return 4 if len(key) == 20 else 16  # IPv4 keys are 20 bytes, IPv6 ones 44


def element_text(key: bytes) -> str:
    """The key in nft syntax (`10.96.0.10 . tcp . 80 . 10.244.1.2 . 8080`)."""
    size = _address_size(key)
    service = ipaddress.ip_address(key[:size])
    protocol = _PROTOCOL_NAMES.get(key[size], str(key[size]))
    port = int.from_bytes(key[size + 4:size + 6], "big")
    endpoint = ipaddress.ip_address(key[size + 8:2 * size + 8])
    endpoint_port = int.from_bytes(key[2 * size + 8:2 * size + 10], "big")
    return f"{service} . {protocol} . {port} . {endpoint} . {endpoint_port}"


def shard_of(key: bytes) -> int:
    """The shard set of an element key: the endpoint address's low bits (its last byte,
    just before the endpoint port's 4 bytes), as `objects.connection_shard` gives it."""
    return key[-5] % CONNECTION_SHARDS
