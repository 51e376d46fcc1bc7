"""One table's comment, read over raw nfnetlink (NFT_MSG_GETTABLE).

pyproxy records the layout its table was written with in the table's comment
(pyproxy/render/objects.py `TABLE_COMMENT`). libnftables 1.0.6 leaves a table's comment out of
its JSON listings, and a text listing of the table costs seconds at 10k services (it fetches
every element): one GETTABLE request answers in microseconds whatever the table holds.
"""

from __future__ import annotations

import errno
import socket
import struct

from pyproxy.kernel.nlelements import (
    HEADER,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFT_MSG_NEWTABLE,
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    attribute,
    attributes,
)

NFT_MSG_GETTABLE = 1
NFTA_TABLE_NAME, NFTA_TABLE_USERDATA = 1, 6
NFTNL_UDATA_TABLE_COMMENT = 0  # libnftnl's type-length-value inside the userdata
_RECV_SIZE = 1 << 16


def request(family: str, table: str, seq: int = 1) -> bytes:
    body = (struct.pack("=BBH", NFPROTO[family], 0, 0)
            + attribute(NFTA_TABLE_NAME, table.encode() + b"\0"))
    kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE
    return HEADER.pack(HEADER.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def comment_of(userdata: bytes) -> str:
    """The comment in a table's userdata (libnftnl's TLVs: type, length, value), or ""."""
    offset = 0
    while offset + 2 <= len(userdata):
        kind, length = userdata[offset], userdata[offset + 1]
        value = userdata[offset + 2:offset + 2 + length]
        if kind == NFTNL_UDATA_TABLE_COMMENT:
            return value.rstrip(b"\0").decode(errors="replace")
        offset += 2 + length
    return ""


def parse_answer(data: bytes) -> tuple[bool, str | None]:
    """(answered, comment) from one datagram: answered once the ack came; comment None while
    no table message was seen (no such table), "" for a table without a comment."""
    comment: str | None = None
    offset = 0
    while offset + HEADER.size <= len(data):
        length, kind, _, _, _ = HEADER.unpack_from(data, offset)
        if length < HEADER.size:
            raise OSError(errno.EPROTO, "truncated netlink message")
        start, end = offset + HEADER.size, offset + length
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, start)
            if code not in (0, -errno.ENOENT):
                raise OSError(-code, f"table lookup: {errno.errorcode.get(-code, code)}")
            return True, comment
        if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE:
            comment = ""
            for attr, a, b in attributes(data, start + 4, end):  # after the nfgenmsg
                if attr == NFTA_TABLE_USERDATA:
                    comment = comment_of(data[a:b])
        offset += (length + 3) & ~3
    return False, comment


def table_comment(sock: socket.socket, family: str, table: str) -> str | None:
    """The comment of `family`'s table `table`: None when there is no such table, "" when it
    has none. OSError when the kernel answers otherwise (no permission, say)."""
    sock.send(request(family, table))
    found: str | None = None
    while True:
        answered, comment = parse_answer(sock.recv(_RECV_SIZE))
        found = comment if comment is not None else found
        if answered:
            return found
