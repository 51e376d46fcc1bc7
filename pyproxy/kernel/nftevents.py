"""nftables change events: someone else changing one of our tables is noticed within
milliseconds (and repaired by the daemon), instead of at the next periodic structure check.

The kernel announces every committed change on the NFNLGRP_NFTABLES multicast group of
NETLINK_NETFILTER: one message per object (table, chain, rule, set, element), several to a
datagram (the kernel packs a transaction's messages together), then NFT_MSG_NEWGEN closing
the transaction. Each message carries the netlink port id of the socket that committed it,
so our own commits (the port ids of our libnftables contexts, `pyproxy.nft.OwnSockets`) are
told from anybody else's.

A plain socket, not pyroute2: pyroute2 0.9's nftables messages decode every attribute (every
expression of every rule) through its asyncio core, where three attributes are needed here,
and a socket filter is easier to attach to a socket of our own. A classic BPF program drops
our own commits' datagrams in the kernel: a full sync at 10k services writes ~230k elements,
whose announcements would overflow any receive buffer and cost seconds of CPU to read. (It
cannot drop by table or message type: a datagram holds several messages, and the filter
sees the first.) Someone else's element changes are reported like the rest (a deleted or
changed element of a map or set is repaired at once, issue 28), except in the sets the
packet path fills (affinity, connection counters: `objects.filled_by_packets`). The kernel
builds an event for each element committed while anyone is subscribed (a quarter of a
10k-service cold start's kernel time), so the monitor leaves the group during a staged full
sync (`OwnSockets.bulk`) and has the structure compared after it.

Parsing and deciding are pure (`parse`, `Transaction`, `filter_program`); `NftMonitor` is the
thread around the socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import socket
import struct
import threading
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field, replace

import structlog

from pyproxy.kernel.libnftables import OwnSockets
from pyproxy.kernel.nlelements import (
    HEADER,
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFT_MSG_DELCHAIN,
    NFT_MSG_DELFLOWTABLE,
    NFT_MSG_DELOBJ,
    NFT_MSG_DELRULE,
    NFT_MSG_DELSET,
    NFT_MSG_DELSETELEM,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWFLOWTABLE,
    NFT_MSG_NEWGEN,
    NFT_MSG_NEWOBJ,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET,
    NFT_MSG_NEWSETELEM,
    NFT_MSG_NEWTABLE,
    SOL_NETLINK,
    attributes,
    nfnl_messages,
)
from pyproxy.render.objects import TABLE, filled_by_packets

log = structlog.get_logger(__name__)

NFNLGRP_NFTABLES = 7
NETLINK_ADD_MEMBERSHIP, NETLINK_DROP_MEMBERSHIP = 1, 2
FAMILIES = {NFPROTO[name]: name for name in ("ip", "ip6")}  # the tables we own

# What each message did, and which attribute names the object (1 is always the table).
_VERBS = {
    NFT_MSG_NEWTABLE: ("table added or changed", 0),
    NFT_MSG_DELTABLE: ("table deleted", 0),
    NFT_MSG_NEWCHAIN: ("chain {} added or changed", 3),
    NFT_MSG_DELCHAIN: ("chain {} deleted", 3),
    NFT_MSG_NEWRULE: ("rule added to chain {}", 2),
    NFT_MSG_DELRULE: ("rule deleted from chain {}", 2),
    NFT_MSG_NEWSET: ("set or map {} added", 2),
    NFT_MSG_DELSET: ("set or map {} deleted", 2),
    NFT_MSG_NEWSETELEM: ("element added to {}", 2),
    NFT_MSG_DELSETELEM: ("element deleted from {}", 2),
    NFT_MSG_NEWOBJ: ("object {} added", 2),
    NFT_MSG_DELOBJ: ("object {} deleted", 2),
    NFT_MSG_NEWFLOWTABLE: ("flowtable {} added", 2),
    NFT_MSG_DELFLOWTABLE: ("flowtable {} deleted", 2),
}


@dataclass(frozen=True, slots=True)
class Message:
    """One nftables change as the kernel announced it."""

    msg: int  # NFT_MSG_*
    portid: int  # the committing socket's (0: the kernel itself)
    family: int  # NFPROTO_*
    table: str = ""
    name: str = ""  # the chain, set or object ("" for a table or a generation)

    def describe(self) -> str:
        verb, _ = _VERBS.get(self.msg, (f"change (message {self.msg}) to {{}}", 0))
        return f"{FAMILIES.get(self.family, self.family)} {self.table}: {verb.format(self.name)}"


def parse(data: bytes) -> Iterator[Message]:
    """The nftables messages in one datagram (others, and truncated ones, are skipped)."""
    for offset, length, msg, _flags, portid in nfnl_messages(data, NFNL_SUBSYS_NFTABLES):
        family = data[offset + HEADER.size]
        attrs = _attributes(data, offset + HEADER.size + 4, offset + length)
        _, which = _VERBS.get(msg, ("", 0))
        table = "" if msg == NFT_MSG_NEWGEN else attrs.get(1, "")
        yield Message(msg, portid, family, table, attrs.get(which, "") if which else "")


def _attributes(data: bytes, start: int, end: int) -> dict[int, str]:
    """The string attributes wanted here (table and object names), by type."""
    return {kind: data[begin:stop].split(b"\0", 1)[0].decode("utf-8", "replace")
            for kind, begin, stop in attributes(data, start, end)
            if kind in (1, 2, 3) and stop <= end}


@dataclass(frozen=True, slots=True)
class Transaction:
    """The messages of one transaction so far, those that are someone else's change to one
    of our tables (`changes`). NFT_MSG_NEWGEN ends a transaction."""

    changes: tuple[Message, ...] = ()
    other_tables: bool = False
    """It changed another table's chains or rules (`other_table_change`)."""

    def feed(self, message: Message, ours: Container[int]) -> tuple[Transaction, str | None]:
        """The transaction after `message`, and, when it ends with foreign changes to our
        tables, what they were (for the log and /healthz)."""
        if message.msg == NFT_MSG_NEWGEN:
            return Transaction(), self.summary() if self.changes else None
        if foreign(message, ours):
            return replace(self, changes=(*self.changes, message)), None
        if not self.other_tables and other_table_change(message):
            return replace(self, other_tables=True), None
        return self, None

    def summary(self, limit: int = 3) -> str:
        seen = list(dict.fromkeys(m.describe() for m in self.changes))
        more = f" (+{len(seen) - limit} more)" if len(seen) > limit else ""
        return "; ".join(seen[:limit]) + more


def foreign(message: Message, ours: Container[int]) -> bool:
    """Someone else's change to one of our tables. Not tampering the daemon repairs: the
    kernel's own messages (port id 0), and element changes in the sets the packet path fills
    (whoever makes them: the daemon deletes counters itself, through a socket of its own)."""
    elements = message.msg in (NFT_MSG_NEWSETELEM, NFT_MSG_DELSETELEM)
    return (message.table == TABLE and message.family in FAMILIES and message.portid != 0
            and message.portid not in ours
            and not (elements and filled_by_packets(message.name)))


# What can change how another table's base chain treats our traffic: a table or chain (a base
# chain's hook, priority or policy) or a rule. Not elements: a set lookup in a firewall's
# chain is beyond what the check decides anyway (core/coexistence.py), and kube-proxy's
# element changes would ask for a check at every sync.
_STRUCTURE = frozenset({NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE, NFT_MSG_NEWCHAIN, NFT_MSG_DELCHAIN,
                        NFT_MSG_NEWRULE, NFT_MSG_DELRULE})


def other_table_change(message: Message) -> bool:
    """A change to the tables, chains or rules of a table not ours (any family: an `inet`
    firewall sees IPv4 too), by anybody but the kernel."""
    ours = message.table == TABLE and message.family in FAMILIES
    return message.msg in _STRUCTURE and not ours and message.portid != 0


# ---------------------------------------------------------------------------------------------
# The socket filter

BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
SO_ATTACH_FILTER = 26  # asm-generic/socket.h
Instruction = tuple[int, int, int, int]  # code, jump if true, jump if false, constant


def _host32(value: int) -> int:
    """A 32-bit header field as a BPF load sees it (big-endian) when the host stores it in
    its own order (netlink headers are host order)."""
    return int.from_bytes(struct.pack("=I", value), "big")


def filter_program(ours: Iterable[int]) -> list[Instruction]:
    """Drop the datagrams whose (first) message was committed by one of `ours`, keep the
    rest. A datagram only ever holds messages of one transaction, hence of one committer."""
    portids = sorted(set(ours))
    drop = 1 + len(portids) + 1
    program: list[Instruction] = [(BPF_LD_W_ABS, 0, 0, 12)]  # nlmsg_pid
    for n, portid in enumerate(portids):
        at = 1 + n
        program.append((BPF_JEQ_K, drop - at - 1, 0, _host32(portid)))
    return [*program, (BPF_RET_K, 0, 0, 0xFFFFFFFF), (BPF_RET_K, 0, 0, 0)]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def attach_filter(sock: socket.socket, program: list[Instruction]) -> None:
    code = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), code)
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))


# ---------------------------------------------------------------------------------------------
# The shell


def subscribed_socket(program: list[Instruction], buffer_bytes: int,
                      groups: tuple[int, ...]) -> socket.socket:
    """A netfilter netlink socket of this thread's network namespace: `program` filtering
    what is queued (attached before it joins a group: nothing unfiltered arrives), a receive
    buffer of `buffer_bytes` (beyond rmem_max where the capability allows), then `groups`
    joined. What nftables' and conntrack's event readers both listen on."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        attach_filter(sock, program)
        for option in (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
                break
            except OSError:
                continue
        sock.bind((0, 0))
        for group in groups:
            sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
    except BaseException:
        sock.close()
        raise
    return sock


def open_socket() -> socket.socket:
    """A socket subscribed to the nftables group of this process's network namespace, with a
    filter that drops everything until `NftMonitor` sets the real one (nothing unfiltered is
    queued before)."""
    return subscribed_socket([(BPF_RET_K, 0, 0, 0)], 4 << 20, (NFNLGRP_NFTABLES,))


@dataclass
class NftMonitor:
    """Reads the change events on a thread of its own and reports, per transaction, someone
    else's changes to our tables (`on_foreign`), changes to other tables' chains or rules
    (`on_other_tables`: their base chains may drop our traffic now, core/coexistence.py),
    and events lost to a full receive buffer (`on_lost`: what happened meanwhile is unknown,
    the structure must be compared)."""

    ours: OwnSockets
    on_foreign: Callable[[str], None]
    on_lost: Callable[[], None]
    open: Callable[[], socket.socket] = open_socket
    poll_seconds: float = 0.5  # how soon the thread notices `stop`
    on_other_tables: Callable[[], None] = lambda: None
    _sock: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, stop: threading.Event) -> bool:
        """Subscribe (in the calling thread's namespace) and start reading. False when the
        kernel or the privileges do not allow it: the periodic check still runs."""
        try:
            sock = self.open()
        except OSError as err:
            log.warning("nft_events_unavailable", error=str(err))
            return False
        sock.settimeout(self.poll_seconds)
        self._sock = sock
        # Before any commit of a new context: its datagrams are dropped from the first.
        self.ours.subscribe(self._refilter)
        self.ours.subscribe_bulk(self._bulk)
        self._refilter()
        threading.Thread(target=self._run, args=(sock, stop), name="nft-events",
                         daemon=True).start()
        return True

    def _refilter(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):  # closed: stopping
                    attach_filter(self._sock, filter_program(self.ours.current()))

    def _bulk(self, starting: bool) -> None:
        """Out of the group during a bulk of our own writes (the kernel builds no event
        for their elements then); back in after it, what happened meanwhile unknown."""
        with self._lock:
            if self._sock is None:
                return
            option = NETLINK_DROP_MEMBERSHIP if starting else NETLINK_ADD_MEMBERSHIP
            with contextlib.suppress(OSError):  # closed: stopping
                self._sock.setsockopt(SOL_NETLINK, option, NFNLGRP_NFTABLES)
        if not starting:
            self.on_lost()
            self.on_other_tables()

    def _run(self, sock: socket.socket, stop: threading.Event) -> None:
        pending = Transaction()
        try:
            while not stop.is_set():
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError as err:
                    if err.errno != errno.ENOBUFS:
                        log.error("nft_events_stopped", error=str(err))
                        return
                    log.warning("nft_events_lost")
                    pending = Transaction()
                    self.on_lost()
                    self.on_other_tables()
                    continue
                for message in parse(data):
                    others = message.msg == NFT_MSG_NEWGEN and pending.other_tables
                    pending, change = pending.feed(message, self.ours)
                    if change is not None:
                        self.on_foreign(change)
                    if others:
                        self.on_other_tables()
        finally:
            with self._lock:
                self._sock = None
                sock.close()
