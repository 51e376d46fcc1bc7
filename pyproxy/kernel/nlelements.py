"""Set and map elements added and deleted over raw nfnetlink: the bulk of a large full sync,
and the partial syncs that only edit elements.

Why: libnftables 1.0.6 parses and evaluates every element of a script in user space before it
sends anything. Loading the 166k elements of a 10k services × 10 endpoints table with `nft -f`
costs 1.18 s of CPU in libnftables and 0.37 s in the kernel (measured). The elements of a
staged full sync (pyproxy/render/staging.py) go into sets and maps that nothing references
yet, one transaction per chunk, so nothing about them needs libnftables: they are encoded
here straight from the store's typed elements (render/objects.py: a Key of fields, a value)
into NFT_MSG_NEWSETELEM messages, one netlink batch (one transaction, all or nothing) per
chunk. A partial sync that only adds and deletes elements (`encode_edits`, `build_edits`) is
one batch too, its deletions NFT_MSG_DELSETELEM messages naming the same key bytes: it skips
libnftables' reload of its view of every set in the table, which a command costs (4 ms of
CPU at 5k services × 50 endpoints, 1,326 sets).

Only what pyproxy renders is understood: sets and maps declared with `type` or `typeof` over
addresses, protocols, ports and `numgen` values, mapping to such values or to a verdict,
elements with an optional comment. Anything else (an interval set, a timeout, a key written
differently) raises `Unencodable`, and the caller gives that set's elements to libnftables.
The encoding is libnftables' own, byte for byte: tests/test_nft_kernel.py adds the same
elements both ways into a namespace's kernel and compares the kernel's dumps.

The netlink framing (headers, attributes, the nftables constants) lives here; the counter
dumps (pyproxy/kernel/nlsets.py) use it too.
"""

from __future__ import annotations

import errno
import functools
import socket
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from pyproxy.render.objects import VERDICT, ElementValue, Field, Key, SetDecl, Verdict
from pyproxy.render.staging import Load

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_CAP_ACK, NETLINK_EXT_ACK = 10, 11
SO_SNDBUFFORCE = 32
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END = 0x10, 0x11
# include/uapi/linux/netfilter/nf_tables.h: the message types (what the change events announce,
# what a dump asks for, what a batch sends)
NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE = 0, 2
NFT_MSG_NEWCHAIN, NFT_MSG_DELCHAIN = 3, 5
NFT_MSG_NEWRULE, NFT_MSG_DELRULE = 6, 8
NFT_MSG_NEWSET, NFT_MSG_DELSET = 9, 11
NFT_MSG_NEWSETELEM, NFT_MSG_GETSETELEM, NFT_MSG_DELSETELEM = 12, 13, 14
NFT_MSG_NEWGEN = 15
NFT_MSG_NEWOBJ, NFT_MSG_DELOBJ = 18, 20
NFT_MSG_NEWFLOWTABLE, NFT_MSG_DELFLOWTABLE = 22, 24
NLM_F_REQUEST, NLM_F_ACK, NLM_F_CREATE = 0x1, 0x4, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLMSGERR_ATTR_MSG = 1
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
# include/uapi/linux/netfilter/nf_tables.h
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_USERDATA = 1, 2, 6
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NFTNL_UDATA_SET_ELEM_COMMENT = 0
NFPROTO = {"ip": 2, "ip6": 10, "inet": 1}
# verdict codes: NF_DROP, NF_ACCEPT and nftables' own (negative)
VERDICTS = {"drop": 0, "accept": 1, "continue": -1, "return": -5}
CHAIN_VERDICTS = {"jump": -3, "goto": -4}
PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1, "icmpv6": 58}
# The attribute holding a message's elements has a 16-bit length.
MESSAGE_PAYLOAD = 60_000
ACK_TIMEOUT = 30.0

HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
ATTR = struct.Struct("=HH")
_VERDICT = struct.Struct(">i")


class Unencodable(ValueError):
    """A declaration or an element this encoder does not understand (libnftables will)."""


class BatchRefused(OSError):
    """The kernel refused the batch: nothing of it was applied."""


def netlink_socket() -> socket.socket:
    """A NETLINK_NETFILTER socket in the calling thread's network namespace, bound (so it
    has its port id from now on)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    return sock


# ---- declarations ------------------------------------------------------------------------

Encoder = Callable[[Field], bytes]


def _ipv4(address: Field) -> bytes:
    return socket.inet_pton(socket.AF_INET, str(address))


def _ipv6(address: Field) -> bytes:
    return socket.inet_pton(socket.AF_INET6, str(address))


def _service(port: Field) -> bytes:
    return int(port).to_bytes(2, "big")  # OverflowError (a ValueError's cousin) if > 65535


def _protocol(protocol: Field) -> bytes:
    number = PROTOCOLS.get(protocol) if isinstance(protocol, str) else None
    return bytes((int(protocol) if number is None else number,))


def _integer32(value: Field) -> bytes:
    return int(value).to_bytes(4, sys.byteorder)  # numgen's register, in host order


_ENCODERS: dict[str, Encoder] = {"ipv4_addr": _ipv4, "ipv6_addr": _ipv6,
                                 "inet_service": _service, "inet_proto": _protocol,
                                 "integer32": _integer32}


class _Cached(dict[Field, bytes]):
    """field → encoded field; the same addresses and ports recur across a set's elements."""

    def __init__(self, encode: Encoder, pad: int) -> None:
        super().__init__()
        self.encode, self.pad = encode, pad

    def __missing__(self, field: Field) -> bytes:
        value = self.encode(field)
        # a concatenation's fields each take whole 32-bit registers
        value += b"\0" * (-len(value) % 4 if self.pad else 0)
        self[field] = value
        return value


@dataclass(frozen=True)
class Layout:
    """How one set's elements are laid out: the key's field types, the data's (None: a set;
    "verdict": a verdict map)."""

    key: tuple[str, ...]
    data: tuple[str, ...] | str | None

    @classmethod
    def of(cls, declaration: SetDecl) -> Layout:
        """From a set's or map's declaration (`staging.static_sets`)."""
        if declaration.flags or declaration.timeout is not None:
            raise Unencodable(f"set with flags {declaration.flags}")  # intervals, timeouts, …
        try:
            key, data = declaration.key_types, declaration.data_types
        except KeyError as err:
            raise Unencodable(f"typeof {err}") from None
        for field in (*key, *(data or ())):
            if field not in _ENCODERS:
                raise Unencodable(f"type {field!r}")
        if not key:
            raise Unencodable("declaration without a key")
        if declaration.data is not None and not declaration.data:
            raise Unencodable("map without data")
        return cls(key, "verdict" if declaration.data == VERDICT else data)

    def encoder(self) -> ElementEncoder:
        return ElementEncoder(self)


# ---- elements ----------------------------------------------------------------------------

def attribute(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    length = ATTR.size + len(payload)
    return ATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def attributes(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, payload start, payload end) of the attributes in data[start:end]."""
    while start + ATTR.size <= end:
        length, kind = ATTR.unpack_from(data, start)
        if length < ATTR.size:
            return
        yield kind & NLA_TYPE_MASK, start + ATTR.size, start + length
        start += (length + 3) & ~3


def nfnl_messages(data: bytes,
                  subsystem: int) -> Iterator[tuple[int, int, int, int, int]]:
    """The nfnetlink messages of one datagram that belong to `subsystem` (nftables,
    ctnetlink): (offset, length, message type within the subsystem, flags, sender's port id)
    each. A message too short for its nfgenmsg, or running past the datagram, ends it."""
    offset = 0
    while offset + HEADER.size + 4 <= len(data):
        length, kind, flags, _seq, portid = HEADER.unpack_from(data, offset)
        if length < HEADER.size + 4 or offset + length > len(data):
            return
        if kind >> 8 == subsystem:
            yield offset, length, kind & 0xFF, flags, portid
        offset += (length + 3) & ~3


def _nest(kind: int, payload: bytes) -> bytes:
    return attribute(kind | NLA_F_NESTED, payload)


class ElementEncoder:
    """An element (its Key and value) → its NFTA_LIST_ELEM attribute. This runs for every
    element of a full sync (166k at 10k services × 10 endpoints): the attribute headers
    around the fixed-size key and data are built once."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._key = [_Cached(_ENCODERS[t], len(layout.key) > 1).__getitem__ for t in layout.key]
        self._key_size = _size(layout.key)
        self._key_head = _heads(NFTA_SET_ELEM_KEY, self._key_size)
        data = layout.data
        self._verdicts: dict[tuple[str, str], bytes] = {}
        self._is_map = data is not None
        self._is_verdict_map = data == "verdict"
        # value data (not a set, not a verdict map): as fixed in size as the key
        values = data if isinstance(data, tuple) else ()
        self._data = [_Cached(_ENCODERS[t], len(values) > 1).__getitem__
                      for t in values] if values else None
        self._data_head = _heads(NFTA_SET_ELEM_DATA, _size(values)) if values else b""
        # column-wise: addresses straight through inet_pton (each pod address appears once
        # or twice), the rest through the caches
        self._key_columns = [_column_encoder(t, self._key[i]) for i, t in enumerate(layout.key)]
        self._data_columns = [_column_encoder(t, encode)
                              for t, encode in zip(values, self._data or (), strict=True)]
        data_size = len(self._data_head) + _size(values) if values else 0
        self._element_head = ATTR.pack(4 + len(self._key_head) + self._key_size + data_size,
                                        NFTA_LIST_ELEM | NLA_F_NESTED)

    def __call__(self, element: tuple[Key, ElementValue]) -> bytes:
        key, value = element
        comment = b""
        if isinstance(value, Verdict) != self._is_verdict_map or (
                bool(value) != self._is_map):
            raise Unencodable(f"element {element!r}")
        payload = self._key_head + self._fields(self._key, key, self._key_size)
        if isinstance(value, Verdict):
            payload += self._verdict(value)
            if value.comment:
                note = value.comment
                if '"' in note or "\\" in note or len(note.encode()) > 128:
                    raise Unencodable(f"comment in {element!r}")
                comment = attribute(NFTA_SET_ELEM_USERDATA, bytes(
                    (NFTNL_UDATA_SET_ELEM_COMMENT, len(note.encode()) + 1))
                    + note.encode() + b"\0")
        elif self._data is not None:
            payload += self._data_head + self._fields(self._data, value, 0)
        payload += comment
        return ATTR.pack(len(payload) + 4, NFTA_LIST_ELEM | NLA_F_NESTED) + payload

    def key(self, key: Key) -> bytes:
        """The NFTA_LIST_ELEM naming an element to delete: its key alone, as libnftables
        sends a `delete element` (the same key bytes as an addition's)."""
        payload = self._key_head + self._fields(self._key, key, self._key_size)
        return ATTR.pack(len(payload) + 4, NFTA_LIST_ELEM | NLA_F_NESTED) + payload

    def encode(self, elements: Sequence[tuple[Key, ElementValue]]) -> list[bytes]:
        """Every element, grouped into message payloads (whole elements, at most
        MESSAGE_PAYLOAD bytes each)."""
        fixed = self._column_wise(elements)
        if fixed is not None:
            whole, size = fixed
            step = max(1, MESSAGE_PAYLOAD // size) * size
            return [whole[i:i + step] for i in range(0, len(whole), step)]
        return _grouped(map(self, elements))

    def encode_keys(self, keys: Iterable[Key]) -> list[bytes]:
        """The keys of elements to delete, grouped into message payloads."""
        return _grouped(map(self.key, keys))

    def _column_wise(self, elements: Sequence[tuple[Key, ElementValue]],
                     ) -> tuple[bytes, int] | None:
        """The elements of a set or value map (the endpoints, hairpin and address sets: all
        but ~10k of a large table's elements) are fields of fixed size: encoded a field at a
        time over all elements (~5× faster than one element at a time). Returns the
        elements' bytes and each one's size, or None where they are not all of that shape
        (then element by element, which says what is wrong)."""
        data = self._data
        if not elements or (self._is_map and data is None):
            return None
        key_fields, data_fields = len(self._key), len(data or ())
        keys, values = zip(*elements, strict=True)
        if {len(k) for k in keys} != {key_fields} or {len(v) for v in values} != {data_fields}:
            return None
        count = len(elements)
        try:
            columns = [list(map(encode, column)) for encode, column in zip(
                [*self._key_columns, *self._data_columns],
                [*zip(*keys, strict=True), *(zip(*values, strict=True) if data else ())],
                strict=True)]
        except (ValueError, OverflowError, OSError, TypeError):
            return None
        width = len(columns) + 1 + bool(data)
        parts: list[bytes] = [b""] * (count * width)
        parts[0::width] = [self._element_head + self._key_head] * count
        for i, column in enumerate(columns[:key_fields]):
            parts[1 + i::width] = column
        if data:
            parts[1 + key_fields::width] = [self._data_head] * count
            for i, column in enumerate(columns[key_fields:]):
                parts[2 + key_fields + i::width] = column
        whole = b"".join(parts)
        size, rest = divmod(len(whole), count)
        if rest or size != ATTR.unpack_from(self._element_head)[0]:
            return None
        return whole, size

    def _fields(self, encoders: list[Encoder], fields: tuple[Field, ...], size: int) -> bytes:
        try:
            if len(fields) == len(encoders):
                pairs = zip(encoders, fields, strict=True)
                value = b"".join([encode(field) for encode, field in pairs])
                if size == 0 or len(value) == size:
                    return value
        except (ValueError, OverflowError, OSError, TypeError) as err:  # inet_pton: OSError
            raise Unencodable(f"{fields!r}: {err}") from None
        raise Unencodable(f"{fields!r}: not {len(encoders)} fields of the declared types")

    def _verdict(self, verdict: Verdict) -> bytes:
        code, chain = verdict.code, verdict.chain
        cached = self._verdicts.get((code, chain))
        if cached is None:
            cached = self._verdicts[(code, chain)] = _nest(NFTA_SET_ELEM_DATA,
                                                           _verdict(code, chain))
        return cached


def _grouped(encoded: Iterable[bytes]) -> list[bytes]:
    """Encoded elements grouped into message payloads of at most MESSAGE_PAYLOAD bytes."""
    payloads: list[bytes] = []
    pending: list[bytes] = []
    length = 0
    for element in encoded:
        if length + len(element) > MESSAGE_PAYLOAD and pending:
            payloads.append(b"".join(pending))
            pending, length = [], 0
        pending.append(element)
        length += len(element)
    if pending:
        payloads.append(b"".join(pending))
    return payloads


def _column_encoder(field_type: str, cached: Encoder) -> Encoder:
    if field_type == "ipv4_addr":
        return functools.partial(socket.inet_pton, socket.AF_INET)
    if field_type == "ipv6_addr":
        return functools.partial(socket.inet_pton, socket.AF_INET6)
    return cached


_SIZES = {"ipv4_addr": 4, "ipv6_addr": 16, "inet_service": 2, "inet_proto": 1, "integer32": 4}


def _size(types: tuple[str, ...]) -> int:
    """A value's length: a concatenation's fields each take whole 32-bit registers."""
    if len(types) == 1:
        return _SIZES[types[0]]
    return sum((_SIZES[t] + 3) & ~3 for t in types)


def _heads(kind: int, size: int) -> bytes:
    """The two headers of a nested NFTA_DATA_VALUE of `size` bytes (a multiple of 4, or
    the padding follows)."""
    if size % 4:
        raise Unencodable(f"a {size}-byte value")  # a lone port or protocol: not ours
    return ATTR.pack(8 + size, kind | NLA_F_NESTED) + ATTR.pack(4 + size, NFTA_DATA_VALUE)


def _verdict(code: str, chain: str) -> bytes:
    if not chain and code in VERDICTS:
        inner = attribute(NFTA_VERDICT_CODE, _VERDICT.pack(VERDICTS[code]))
    elif chain and code in CHAIN_VERDICTS and '"' not in chain:
        inner = (attribute(NFTA_VERDICT_CODE, _VERDICT.pack(CHAIN_VERDICTS[code]))
                 + attribute(NFTA_VERDICT_CHAIN, chain.encode() + b"\0"))
    else:
        raise Unencodable(f"verdict {code} {chain}")
    return _nest(NFTA_DATA_VERDICT, inner)


# ---- batches -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    """One transaction's datagram, and what each of its messages does (for the errors)."""

    data: bytes
    begin: int  # the batch header's sequence number
    sets: dict[int, str]  # message sequence number → "adding elements to SET" or so


# One message kind's elements for one set: (deletion?, set name, payloads).
Edit = tuple[bool, str, Iterable[bytes]]


def _message(kind: int, flags: int, seq: int, family: int, res_id: int, body: bytes) -> bytes:
    head = struct.pack("=BBH", family, 0, socket.htons(res_id))
    return HEADER.pack(HEADER.size + 4 + len(body), kind, flags, seq, 0) + head + body


def build_batch(family: str, table: str, loads: Iterable[tuple[str, Iterable[bytes]]],
                seq: int = 1) -> Batch:
    """The batch adding, to each named set, its elements: one NEWSETELEM message for each
    payload (`ElementEncoder.encode`: whole elements, within the 16-bit length of the
    attribute that holds them)."""
    return build_edits(family, table, ((False, name, payloads) for name, payloads in loads),
                       seq)


def build_edits(family: str, table: str, edits: Iterable[Edit], seq: int = 1) -> Batch:
    """The batch making these edits in their order: NEWSETELEM messages (the flags of nft's
    `add element`) or DELSETELEM ones (its `delete element`), one for each payload."""
    nfproto = NFPROTO[family]
    prefix = attribute(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0")
    begin = seq
    parts = [_message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, begin, 0, NFNL_SUBSYS_NFTABLES, b"")]
    sets: dict[int, str] = {}

    for delete, name, payloads in edits:
        kind = (NFNL_SUBSYS_NFTABLES << 8) | (NFT_MSG_DELSETELEM if delete
                                             else NFT_MSG_NEWSETELEM)
        flags = NLM_F_REQUEST | NLM_F_ACK | (0 if delete else NLM_F_CREATE)
        what = f"deleting elements from {name}" if delete else f"adding elements to {name}"
        for payload in payloads:
            seq += 1
            sets[seq] = what
            body = (prefix + attribute(NFTA_SET_ELEM_LIST_SET, name.encode() + b"\0")
                    + _nest(NFTA_SET_ELEM_LIST_ELEMENTS, payload))
            parts.append(_message(kind, flags, seq, nfproto, 0, body))
    seq += 1
    parts.append(_message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq, 0, NFNL_SUBSYS_NFTABLES, b""))
    return Batch(b"".join(parts), begin, sets)


def _error_text(data: bytes, offset: int, length: int) -> str:
    """The kernel's extended ack message, when it sent one (after the capped request)."""
    for kind, a, b in attributes(data, offset + HEADER.size + 4 + HEADER.size, offset + length):
        if kind == NLMSGERR_ATTR_MSG:
            return data[a:b].rstrip(b"\0").decode(errors="replace")
    return ""


def commit(sock: socket.socket, batch: Batch, timeout: float = ACK_TIMEOUT) -> None:
    """Send one batch and wait for the kernel's answer to each of its messages. Raises
    BatchRefused when the kernel refused it (nothing applied), another OSError when the
    socket failed or no answer came."""
    if not batch.sets:
        return
    sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)  # acks without a copy of the request
    sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
    try:  # one datagram is one batch: the send buffer must hold all of it
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, len(batch.data) + 4096)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, len(batch.data) + 4096)
    sock.settimeout(timeout)
    sock.send(batch.data)
    pending = set(batch.sets)
    errors: list[str] = []
    try:
        while pending:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + HEADER.size <= len(data):
                length, kind, _, seq, _ = HEADER.unpack_from(data, offset)
                if length < HEADER.size:
                    break
                if kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + HEADER.size)
                    if code:
                        what = batch.sets.get(seq, "the batch")
                        detail = _error_text(data, offset, length)
                        errors.append(f"{what}: "
                                      f"{errno.errorcode.get(-code, str(-code))}"
                                      + (f" ({detail})" if detail else ""))
                        if seq == batch.begin:
                            pending.clear()  # the kernel gave up on the whole batch
                    pending.discard(seq)
                offset += (length + 3) & ~3
    except TimeoutError:
        missing = (f"no answer from the kernel for {len(pending)} of {len(batch.sets)} "
                   f"messages in {timeout:g} s")
        if not errors:  # applied or not: unknown (OSError, not BatchRefused)
            raise OSError(errno.ETIMEDOUT, missing) from None
        errors.append(missing)
    if errors:
        raise BatchRefused(errno.EINVAL, "; ".join(errors[:3]))


def encode_loads(loads: Sequence[Load]) -> tuple[list[tuple[str, list[bytes]]], list[Load]]:
    """Split (set name, declaration, elements) into the encoded ones and those left to
    libnftables (whose declaration or any element this encoder does not understand)."""
    encoded: list[tuple[str, list[bytes]]] = []
    left: list[Load] = []
    encoders: dict[SetDecl, ElementEncoder] = {}
    for name, declaration, elements in loads:
        try:
            encoder = encoders.get(declaration)
            if encoder is None:
                encoder = encoders[declaration] = Layout.of(declaration).encoder()
            encoded.append((name, encoder.encode(elements)))
        except Unencodable:
            left.append((name, declaration, elements))
    return encoded, left


# An edit to encode: (deletion?, set name, its declaration, the elements; a deletion's values
# are not sent).
Change = tuple[bool, str, SetDecl, Sequence[tuple[Key, ElementValue]]]


def encode_edits(changes: Iterable[Change]) -> list[Edit]:
    """Element additions and deletions, encoded in their order; Unencodable when any one is
    not understood (then all of them go through libnftables: they are one transaction)."""
    edits: list[Edit] = []
    encoders: dict[SetDecl, ElementEncoder] = {}
    for delete, name, declaration, elements in changes:
        encoder = encoders.get(declaration)
        if encoder is None:
            encoder = encoders[declaration] = Layout.of(declaration).encoder()
        payloads = (encoder.encode_keys(key for key, _ in elements) if delete
                    else encoder.encode(elements))
        edits.append((delete, name, payloads))
    return edits
