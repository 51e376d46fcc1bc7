"""The libnftables shell: transactions and listings of our tables in the current network
namespace through Debian's binding, the elements of staged syncs over raw netlink, and the
netlink port ids that tell our own commits' change events from someone else's. What to
commit is the applier's (sync/applier.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import structlog

from pyproxy.kernel import nlelements, nltable
from pyproxy.render import ops, staging
from pyproxy.render.objects import TABLE, Element, Field, Key, SetDecl, Verdict
from pyproxy.render.ops import Op
from pyproxy.render.ruleset import Structure

log = structlog.get_logger(__name__)


class NftError(RuntimeError):
    """The kernel or libnftables refused a transaction; nothing of it was applied."""


def new_context() -> Any:
    """A libnftables context of this network namespace, echo output off."""
    import nftables  # Debian's binding, matching the installed libnftables

    ctx = nftables.Nftables()
    ctx.set_echo_output(False)
    return ctx




class OwnSockets:
    """The netlink port ids of this process's libnftables transaction contexts. The kernel
    stamps every nftables change event with the port id of the socket that committed it, so
    an event carrying one of these is our own commit (pyproxy/kernel/nftevents.py). Process-wide,
    as sockets are. A replaced context's ids stay known a little longer: the events of its
    last commit may still be on their way to the listener when it is closed."""

    RETIRED_KEPT = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[int, tuple[int, ...]] = {}  # id(owner) → its context's ids
        self._retired: deque[int] = deque(maxlen=self.RETIRED_KEPT)
        self._listeners: list[Callable[[], None]] = []
        self._bulk_listeners: list[Callable[[bool], None]] = []

    def replace(self, owner: object, portids: Iterable[int]) -> None:
        """`owner`'s transaction context is now the one with these port ids. Listeners hear
        of it before the context commits anything."""
        with self._lock:
            self._retired.extend(self._current.get(id(owner), ()))
            self._current[id(owner)] = tuple(portids)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def subscribe_bulk(self, listener: Callable[[bool], None]) -> None:
        """`listener(True)` before a bulk of our own writes, `listener(False)` after it."""
        with self._lock:
            self._bulk_listeners.append(listener)

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Our writes inside are too many to announce. While anyone listens to the change
        events, the kernel builds one for every element committed, even though the
        listener's filter then drops ours: a quarter of the kernel time of a 10k-service
        cold start (measured: 0.52 → 0.78 s). The listeners stop listening meanwhile and,
        since someone else's change would have gone unheard, have the structure compared
        after."""
        with self._lock:
            listeners = list(self._bulk_listeners)
        for listener in listeners:
            listener(True)
        try:
            yield
        finally:
            for listener in listeners:
                listener(False)

    def current(self) -> frozenset[int]:
        """The port ids of the contexts in use."""
        with self._lock:
            return frozenset(p for ids in self._current.values() for p in ids)

    def __contains__(self, portid: object) -> bool:
        with self._lock:
            return any(portid in ids for ids in self._current.values()) \
                or portid in self._retired


OWN_SOCKETS = OwnSockets()


def netfilter_sockets() -> dict[int, int]:
    """This process's NETLINK_NETFILTER sockets: file descriptor → port id (0: not bound
    yet; the kernel binds a socket when it first sends)."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(int(name)))  # learns family and protocol
        except OSError:
            continue  # closed meanwhile, or not a socket Python can wrap
        with probe:
            if probe.family == socket.AF_NETLINK and probe.proto == nlelements.NETLINK_NETFILTER:
                found[int(name)] = int(probe.getsockname()[0])
    return found


class _Commit:
    """One netlink batch of elements, committed now or (`background`) by a thread of its
    own (LibNftables.add_elements): `wait()` returns what the commit raised, if anything."""

    def __init__(self, sock: socket.socket, batch: nlelements.Batch, family: str,
                 loads: tuple[staging.Load, ...], background: bool) -> None:
        self.family = family
        self.loads = loads
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._commit, args=(sock, batch),
                                            name="netlink-commit", daemon=True)
            self._thread.start()
        else:
            self._commit(sock, batch)

    def _commit(self, sock: socket.socket, batch: nlelements.Batch) -> None:
        try:
            nlelements.commit(sock, batch)
        except BaseException as err:  # handed to the caller's thread by wait()
            self._error = err

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
        return self._error


class LibNftables:
    """libnftables through the Python binding. Text input: half the size of JSON, faster to
    load and to render (docs/nft-layout.md).

    Measured with libnftables 1.0.6 at 10k services: a context that has seen a large cache
    (after loading the whole table, or after a listing) refreshes all of it, set elements
    included, on its next transaction (~0.5 s). So transactions go through one context that
    is renewed after every full sync, and listings use throwaway contexts. `list table` is
    slow for the same reason (it fetches every element even with --terse: ~4 s at 10k),
    while a terse `list ruleset` is not (~40 ms): that is what the structure checks read.
    `factory` makes contexts (tests bind them to a network namespace).

    The transaction context's netlink port id goes into `sockets`, so that the change events
    of our own commits are told from someone else's.

    `netlink` makes the raw netlink socket that the elements of staged full syncs go
    through (pyproxy/kernel/nlelements.py), in the namespace the contexts talk to: by
    default the current one with the default factory; with another factory, none unless
    given (then libnftables adds them too)."""

    def __init__(self, factory: Callable[[], Any] = new_context,
                 sockets: OwnSockets = OWN_SOCKETS,
                 netlink: Callable[[], socket.socket] | None = None,
                 queries: Callable[[], socket.socket] | None = None) -> None:
        self._factory = factory
        self._sockets = sockets
        if netlink is None and factory is new_context:
            netlink = nlelements.netlink_socket
        self._netlink = netlink() if netlink is not None else None
        # Sockets for small reads (the table's comment), opened per read: the elements'
        # socket may have a batch in flight on another thread.
        self._queries = queries or netlink
        self._pipelined = False
        self._in_flight: _Commit | None = None
        self._nft = self._writer()

    def _writer(self) -> Any:
        """A transaction context, its socket's port id registered. libnftables opens the
        socket with the context but the kernel assigns the port id only when it first sends:
        a small read makes it do so before any commit. `list flowtables` (there are none):
        `list tables` would mark the context's cache as a full one, and its first transaction
        would then fetch every element (~0.3 s at 10k services). Sockets other threads open
        meanwhile may be registered too; none of them writes nftables."""
        before = netfilter_sockets()
        ctx = self._factory()
        with contextlib.suppress(Exception):  # no table access: the commits will say so
            ctx.cmd("list flowtables")
        opened = {fd: portid for fd, portid in netfilter_sockets().items()
                  if fd not in before and portid}
        own = [] if self._netlink is None else [int(self._netlink.getsockname()[0])]
        self._sockets.replace(self, [*opened.values(), *own])
        return ctx

    def run(self, script: str) -> str:
        self._settle()  # transactions in the order they were asked for
        rc, out, err = self._nft.cmd(script)
        if rc != 0:
            raise NftError(first_lines(err or out or f"nft exited {rc}"))
        return str(out)

    def apply(self, family: str, transaction: Sequence[Op]) -> str:
        """Commit the operations as one transaction: the nft script they write (returned),
        through the transaction context."""
        script = ops.script(family, transaction)
        self.run(script)
        return script

    def apply_elements(self, family: str, transaction: Sequence[Op],
                       declarations: Mapping[str, SetDecl]) -> str:
        """Commit a transaction of element additions and deletions only (the applier made
        sure), in sets with these declarations: over raw netlink as one batch, all or
        nothing, where nlelements understands every set and element. That skips
        libnftables' reload of its view of every set in the table (4 ms of CPU per call at
        5k services x 50 endpoints, 1,326 sets). Otherwise through libnftables, as `apply`.
        NftError if the kernel refused it (nothing applied). Returns the nft script the
        operations are (for `last_script`)."""
        if self._netlink is None:
            return self.apply(family, transaction)
        try:
            edits = nlelements.encode_edits(_changes(transaction, declarations))
        except nlelements.Unencodable:
            return self.apply(family, transaction)
        self._settle()  # after any batch in flight, in order
        try:
            nlelements.commit(self._netlink, nlelements.build_edits(family, TABLE, edits))
        except nlelements.BatchRefused as err:
            raise NftError(str(err)) from err
        except OSError as err:
            # The socket failed (no answer: applied or not, unknown). libnftables from now
            # on; it commits the same transaction, or refuses it (a deletion applied
            # meanwhile), which a full sync then mends.
            self._netlink_off(err)
            return self.apply(family, transaction)
        return ops.script(family, transaction)

    def _netlink_off(self, error: OSError) -> None:
        log.warning("raw_netlink_elements_off", error=str(error))
        if self._netlink is not None:
            self._netlink.close()
        self._netlink = None

    def add_elements(self, family: str, chunk: staging.ElementChunk) -> None:
        """Over raw netlink the sets whose declaration and elements nlelements understands
        (all of a table pyproxy renders, but for its interval sets), through libnftables the
        rest, in a transaction of their own: either way into sets nothing uses yet.

        Inside `bulk()` the netlink batch is committed by a thread of its own and this
        returns before the kernel answered: the kernel works through one chunk (the socket
        calls release the GIL) while the caller makes and encodes the next. Its answer is
        taken (a refusal handled as below, NftError raised) by the next call, or at the
        latest when the bulk ends."""
        left = list(chunk.loads)
        batch = None
        if self._netlink is not None:
            encoded, left = nlelements.encode_loads(chunk.loads)
            batch = nlelements.build_batch(family, TABLE, encoded)
        self._settle()  # one batch in the kernel at a time, in order
        if batch is not None and self._netlink is not None:
            commit = _Commit(self._netlink, batch, family, chunk.loads, self._pipelined)
            if self._pipelined:
                self._in_flight = commit
            else:
                self._answered(commit)
        elif batch is not None:  # the socket failed with the previous batch
            left = list(chunk.loads)
        if left:
            self.run(staging.ElementChunk(tuple(left)).script(family))

    def _settle(self) -> None:
        """Wait for the batch in flight, and handle its answer."""
        commit, self._in_flight = self._in_flight, None
        if commit is not None:
            self._answered(commit)

    def _answered(self, commit: _Commit) -> None:
        error = commit.wait()
        if isinstance(error, nlelements.BatchRefused):
            # Nothing of it was applied. libnftables gets the same elements: it refuses
            # them in its own words (a set deleted under us), or takes them (then the
            # encoder is wrong, and this says so).
            log.warning("raw_netlink_batch_refused", error=str(error))
            self.run(staging.ElementChunk(commit.loads).script(commit.family))
        elif isinstance(error, OSError):
            # The socket itself failed (a send buffer it may not raise, no answer):
            # libnftables adds every element from now on, as before this path existed.
            self._netlink_off(error)
            self.run(staging.ElementChunk(commit.loads).script(commit.family))
        elif error is not None:
            raise error

    def renew(self) -> None:
        """A fresh transaction context (drops libnftables' cache of the whole table)."""
        self._nft = self._writer()

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Our own writes, announced as a bulk (OwnSockets.bulk), element batches committed
        in the background (add_elements); all of them answered when it ends."""
        with self._sockets.bulk():
            self._pipelined = True
            try:
                yield
                self._settle()
            finally:
                self._pipelined = False
                commit, self._in_flight = self._in_flight, None
                if commit is not None:  # failing anyway: nothing may reach the kernel later
                    commit.wait()

    def list_structure(self, family: str) -> Structure | None:
        """Our table without set elements: chains, rules, set declarations, as JSON. None
        when the table does not exist. Stateless: a rule's counter (the localhost NodePort
        reject chains') moves with traffic, which is nobody's tampering."""
        ctx = self._factory()
        ctx.set_terse_output(True)
        ctx.set_stateless_output(True)
        ctx.set_json_output(True)
        rc, out, _ = ctx.cmd("list ruleset")
        return structure_of(json.loads(str(out) or "{}"), family) if rc == 0 else None

    def table_comment(self, family: str) -> str | None:
        """Our table's comment ("" without one), None when there is no table or no netlink
        socket to ask with (a custom context factory given none)."""
        if self._queries is None:
            return None
        with contextlib.closing(self._queries()) as sock:
            return nltable.table_comment(sock, family, TABLE)

    def list_elements(self, family: str, kind: str, name: str) -> list[Element] | None:
        """The elements of one set or map, read as JSON (None: no such set)."""
        ctx = self._factory()
        ctx.set_json_output(True)
        rc, out, _ = ctx.cmd(f"list {kind} {family} {TABLE} {name}")
        if rc != 0:
            return None
        for entry in json.loads(str(out) or "{}").get("nftables", ()):
            if kind in entry:
                return [element_of(item) for item in entry[kind].get("elem", ())]
        return None

    def list_names(self, family: str) -> tuple[list[str], list[str]]:
        """Names of our table's chains and of its sets and maps."""
        structure = self.list_structure(family)
        if structure is None:
            return [], []  # no table yet
        return list(structure.chains), list(structure.sets)


def _changes(transaction: Sequence[Op],
             declarations: Mapping[str, SetDecl]) -> Iterator[nlelements.Change]:
    for verb, obj in transaction:
        if not isinstance(obj, ops.Elements) or verb not in (ops.Verb.ADD, ops.Verb.DELETE):
            raise nlelements.Unencodable(f"{verb} {type(obj).__name__}: not an element edit")
        declaration = declarations.get(obj.set)
        if declaration is None:
            raise nlelements.Unencodable(f"{obj.set}: no declaration")
        yield verb is ops.Verb.DELETE, obj.set, declaration, obj.elements


def structure_of(listing: Any, family: str) -> Structure | None:
    """Our table's objects in a JSON listing (`nft -j -t list ruleset`), None when it has
    none. Handles are left out: a full sync rewrites every rule, and with it its handle."""
    lines: list[str] = []
    chains: dict[str, int] = {}
    sets: list[str] = []
    for entry in listing.get("nftables", ()):
        (kind, obj), = entry.items()
        if kind == "metainfo" or obj.get("family") != family or \
                obj.get("table" if kind != "table" else "name") != TABLE:
            continue
        lines.append(json.dumps({kind: {k: v for k, v in obj.items() if k != "handle"}},
                                sort_keys=True))
        if kind == "chain":
            chains[obj["name"]] = 0
        elif kind == "rule":
            chains[obj["chain"]] = chains.get(obj["chain"], 0) + 1
        elif kind in ("set", "map"):
            sets.append(obj["name"])
    return Structure(tuple(lines), chains, tuple(sets)) if lines else None


def element_of(item: Any) -> Element:
    """An element as a JSON listing gives it: a set's key, or a map's [key, value]; a key
    with a comment is {"elem": {"val": key, "comment": …}}; a concatenation is
    {"concat": [fields]}; an interval {"prefix": …} or {"range": …}; a verdict
    {"goto": {"target": chain}}, {"drop": null}."""
    key, value = item if isinstance(item, list) else (item, None)
    comment = ""
    if isinstance(key, dict) and "elem" in key:
        comment = key["elem"].get("comment", "")
        key = key["elem"]["val"]
    fields = _fields(key)
    if value is None:
        return fields, ()
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in _VERDICTS:
        ((code, target),) = value.items()
        return fields, Verdict(code, (target or {}).get("target", ""), comment)
    return fields, _fields(value)


_VERDICTS = ("goto", "jump", "drop", "accept", "return", "continue")


def _fields(value: Any) -> Key:
    if isinstance(value, dict) and "concat" in value:
        return tuple(_field(v) for v in value["concat"])
    return (_field(value),)


def _field(value: Any) -> Field:
    if isinstance(value, dict) and "prefix" in value:
        return f"{value['prefix']['addr']}/{value['prefix']['len']}"
    if isinstance(value, dict) and "range" in value:
        low, high = value["range"]
        return f"{low}-{high}"
    if not isinstance(value, str | int):
        raise ValueError(f"an element's field nft listed as {value!r}")
    return value


def first_lines(text: str, limit: int = 20) -> str:
    lines = text.strip().splitlines()
    more = f"\n… {len(lines) - limit} more lines" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more
