"""The table's vocabulary: its name and the names of its fixed chains, sets and maps, the
items a rendering is made of (`Kind`, `Item`, `Fragment`), and the base chains with their
fixed rules. The renderer (services.py) produces these; the slot store (ruleset.py),
staging, the applier, the tracer and the connection counters consume them. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from ipaddress import ip_address
from typing import NamedTuple, TypeVar

TABLE = "pyproxy"
# The ruleset's layout, recorded in the table's comment. Raise it whenever a release names,
# types or chains its objects otherwise: a pyproxy that finds another comment (an older or a
# newer release's table, or one someone made by hand) replaces the table whole in one
# transaction instead of patching it (CHANGELOG.md says which release changed it).
# Layout 1 is every release before the version was recorded ("rules for pyproxy").
LAYOUT_VERSION = 2
TABLE_COMMENT = f"pyproxy ruleset layout {LAYOUT_VERSION}"
PROTOCOLS = ("tcp", "udp", "sctp")

# Static object names, kept together (as upstream does).
SERVICES_CHAIN = "services"
MASQUERADING_CHAIN = "masquerading"
REJECT_CHAIN = "reject-chain"
SERVICE_ENDPOINTS_CHECK = "service-endpoints-check"
NODEPORT_ENDPOINTS_CHECK = "nodeport-endpoints-check"
FIREWALL_CHECK = "firewall-check"
CLUSTER_IPS_CHECK = "cluster-ips-check"
CLUSTER_IPS_SET = "cluster-ips"
SERVICE_CIDRS_SET = "service-cidrs"
NODEPORT_IPS_SET = "nodeport-ips"
HAIRPIN_SET = "hairpin"
FIREWALL_IPS_SET = "firewall-ips"
FIREWALL_ALLOW_SET = "firewall-allow"
SERVICE_IPS_MAP = "service-ips"
SERVICE_NODEPORTS_MAP = "service-nodeports"
NO_ENDPOINT_SERVICES_MAP = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS_MAP = "no-endpoint-nodeports"
COUNT_CONNECTIONS_CHAIN = "count-new-connections"
# Localhost NodePorts pyproxy does not serve (KEP-6032): (protocol . node port) → the
# protocol's reject chain, whose rule counts what it rejects. kube-proxy's names.
LOCALHOST_NODEPORT_REJECT_MAP = "localhost-nodeport-reject-ports"
# The connection counters are spread over this many sets by the endpoint address's low bits:
# a netlink dump of a set restarts its walk for every 32 KB message and skips the elements
# already sent, so reading one set costs the square of its size (110k elements: 0.6 s in one
# set, 0.07 s in eight; pyproxy/kernel/nlsets.py).
CONNECTION_SHARDS = 8
# Elements per shard set (the kernel refuses to create more; those connections go uncounted):
# ~1M (service address, endpoint) pairs per family. The kernel allocates as elements come.
CONNECTION_SHARD_SIZE = 131072


# The kernel keeps at most 128 bytes of a comment (NFT_USERDATA_MAXLEN) and refuses the
# whole transaction for a longer one: `ns/name:port` reaches 143 (63 + 63 + 15 and the
# separators), so one Service with long names would stop every sync (kubernetes#139515).
COMMENT_MAX_BYTES = 128


def element_comment(text: str) -> str:
    """`text` cut to what the kernel keeps (kubernetes#139516: comments are cosmetic, so
    the cut changes no verdict). Cut by bytes, at a character boundary."""
    data = text.encode()
    if len(data) <= COMMENT_MAX_BYTES:
        return text
    return data[:COMMENT_MAX_BYTES].decode(errors="ignore")


def endpoints_map(proto: str) -> str:
    return f"endpoints-{proto}"


def localhost_nodeport_reject_chain(proto: str) -> str:
    return f"localhost-nodeport-reject-{proto}"


def nodeport_endpoints_map(proto: str) -> str:
    return f"nodeport-endpoints-{proto}"


def connections_set(shard: int) -> str:
    return f"new-connections-{shard}"


# Sets whose elements the packet path makes (`update @set`): session affinity's and the
# connection counters'. No sync writes their elements (a full sync declares them without
# flushing), and the daemon itself deletes counters through a netlink socket of its own, so
# their element changes are nobody's tampering.
FILLED_BY_PACKETS = ("affinity-", "new-connections-")


def filled_by_packets(name: str) -> bool:
    return name.startswith(FILLED_BY_PACKETS)


# What a `typeof` expression of a declaration stores: the field type the kernel keeps (what
# a `type` declaration names). Only the expressions pyproxy declares with.
TYPEOF_TYPES = {"ip daddr": "ipv4_addr", "ip saddr": "ipv4_addr", "ip6 daddr": "ipv6_addr",
                "ip6 saddr": "ipv6_addr", "tcp dport": "inet_service",
                "udp dport": "inet_service", "sctp dport": "inet_service",
                "th dport": "inet_service", "meta l4proto": "inet_proto",
                "numgen random mod 1": "integer32"}


# A verdict map's data.
VERDICT = ("verdict",)


class SetDecl(NamedTuple):
    """A set's or map's declaration: its key's fields, a map's data fields, its flags and
    limits. The fields are types (`ipv4_addr`) or, with `typeof`, expressions (`ip daddr`:
    nft derives the type and keeps the expression for listings). A NamedTuple, like `Item`,
    whose value it is: equal declarations compare and hash as tuples."""

    key: tuple[str, ...]
    # A map's data: its fields, ("verdict",) for a verdict map; None for a set.
    data: tuple[str, ...] | None = None
    typeof: bool = False
    flags: tuple[str, ...] = ()  # `interval`, `dynamic`, `timeout`
    timeout: int | None = None  # seconds, for sets with the `timeout` flag
    size: int | None = None
    comment: str = ""

    @property
    def kind(self) -> str:
        """The nft word: `set` or `map`."""
        return "set" if self.data is None else "map"

    @property
    def dynamic(self) -> bool:
        """Filled by the packet path (`update @set`), never by a sync: declared, never
        flushed, its elements nobody's to write."""
        return "dynamic" in self.flags

    @property
    def key_types(self) -> tuple[str, ...]:
        return self._types(self.key)

    @property
    def data_types(self) -> tuple[str, ...] | None:
        """A map's data field types, ("verdict",) for a verdict map, None for a set."""
        return None if self.data is None or self.data == VERDICT else \
            self._types(self.data)

    def _types(self, fields: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(TYPEOF_TYPES[f] for f in fields) if self.typeof else fields

    def body(self) -> str:
        """The declaration as nft text, inside the braces of `add set|map … { … }`."""
        types = " . ".join(self.key)
        if self.data is not None:
            types += " : " + " . ".join(self.data)
        parts = [f"{'typeof' if self.typeof else 'type'} {types}"]
        if self.size is not None:
            parts.append(f"size {self.size}")
        if self.flags:
            parts.append(f"flags {','.join(self.flags)}")
        if self.timeout is not None:
            parts.append(f"timeout {self.timeout}s")
        if self.comment:
            parts.append(f'comment "{self.comment}"')
        return "; ".join(parts) + ";"


# An element's field: an address, a CIDR or a protocol name as nft writes it; a port or an
# index as a number.
Field = str | int
# An element's key: its fields, in the order of the declaration's key.
Key = tuple[Field, ...]


class Verdict(NamedTuple):
    """A verdict map element's value (`goto CHAIN`, `drop`), with the element's comment (the
    Service it belongs to: only these elements carry one)."""

    code: str  # goto, jump, drop, accept, return
    chain: str = ""  # for goto and jump
    comment: str = ""

    def text(self) -> str:
        """The verdict as nft writes it."""
        return f"{self.code} {self.chain}" if self.chain else self.code


# An element's value: a set element's is (); a map element's its data fields, or a Verdict.
ElementValue = tuple[Field, ...]


# An element of a set or map: its key and its value.
Element = tuple[Key, ElementValue]


def key_text(key: Key) -> str:
    """An element's key as nft writes it: `10.96.0.1 . tcp . 80`."""
    return _format(len(key), 0) % key


def value_text(value: ElementValue) -> str:
    """What follows an element's key in nft text: ` comment "…" : goto chain`, ` : 10.0.0.1
    . 80`, or nothing (a set element)."""
    if isinstance(value, Verdict):
        comment = f' comment "{value.comment}"' if value.comment else ""
        return f"{comment} : {value.text()}"
    return " : " + " . ".join([str(field) for field in value]) if value else ""


def element_text(key: Key, value: ElementValue) -> str:
    """An element as nft writes it (in `add element … { … }`) and lists it."""
    if isinstance(value, Verdict):
        return key_text(key) + value_text(value)
    # one %-format per shape: a third of the cost of joining the fields (a full sync that
    # is one transaction writes every element)
    return _format(len(key), len(value)) % (key + value)


_FORMATS: dict[tuple[int, int], str] = {}


def _format(key_fields: int, data_fields: int) -> str:
    """`%s . %s[ : %s . %s]`: an element's fields written between their separators."""
    found = _FORMATS.get((key_fields, data_fields))
    if found is None:
        found = " . ".join(["%s"] * key_fields)
        if data_fields:
            found += " : " + " . ".join(["%s"] * data_fields)
        _FORMATS[(key_fields, data_fields)] = found
    return found


# ---------------------------------------------------------------------------------------------
# A chain's rules: typed statements, written as nft text by `Rule.text` alone. What a reader
# needs of a rule (the sets and chains it uses, how it picks an endpoint, whom it applies to)
# it reads from the statements, never from the text (as knftables' objects are read).


class SetRef(NamedTuple):
    """`@NAME`: a set or map a rule matches against, looks up in or updates."""

    name: str

    def text(self) -> str:
        return f"@{self.name}"


class SourceMatch(NamedTuple):
    """A match on where the packet comes from: `expr` is nft's (`ip saddr 10.0.0.0/8`,
    `iifname "cbr0"`, `fib saddr type local`)."""

    source: Source
    expr: str

    def text(self) -> str:
        return self.expr


class Source(StrEnum):
    """Whom a rule's leading match selects, as far as the tracer must know it."""

    LOCAL_POD = "a local pod"
    NOT_LOCAL_POD = "not a local pod"
    NODE = "the node itself"


FROM_NODE = SourceMatch(Source.NODE, "fib saddr type local")


class Masquerade(NamedTuple):
    """`meta mark set meta mark | MARK`: the connection is masqueraded on its way out."""

    mark: str

    def text(self) -> str:
        return f"meta mark set meta mark | {self.mark}"


class PickDnat(NamedTuple):
    """`dnat IP to KEY . INDEX map @MAP`: DNAT to the endpoint in slot INDEX of the service's
    slots in MAP, INDEX drawn over `slots` slots from `offset` on."""

    ip: str  # ip or ip6
    key: str  # the map key's service part: `ip daddr . tcp dport`, `tcp dport`
    draw: Draw
    slots: int
    map: str
    offset: int = 0
    hashed: str = ""  # for Draw.HASH: what is hashed (`ip saddr`, `ip saddr . tcp sport`)
    seed: int = 0

    def drawn(self) -> str:
        """How the index is drawn, as nft writes it."""
        off = f" offset {self.offset}" if self.offset else ""
        if self.draw is Draw.HASH:
            return f"jhash {self.hashed} mod {self.slots} seed 0x{self.seed:08x}{off}"
        return f"numgen {self.draw.value} mod {self.slots}{off}"

    def text(self) -> str:
        return f"dnat {self.ip} to {self.key} . {self.drawn()} map @{self.map}"


class Draw(StrEnum):
    """How a pick draws its index: numgen's, or jhash's over the source (and port)."""

    RANDOM = "random"
    ROUND_ROBIN = "inc"
    HASH = "jhash"


class DnatTo(NamedTuple):
    """`meta l4proto PROTO dnat IP to ADDRESS:PORT`: DNAT to one endpoint."""

    ip: str
    proto: str
    address: str
    port: int

    def text(self) -> str:
        target = f"[{self.address}]" if ":" in self.address else self.address
        return f"meta l4proto {self.proto} dnat {self.ip} to {target}:{self.port}"


class ClientOf(NamedTuple):
    """`IP saddr @SET`: a client the affinity set remembers."""

    ip: str
    set: str

    def text(self) -> str:
        return f"{self.ip} saddr @{self.set}"


class Remember(NamedTuple):
    """`update @SET { IP saddr }`: the affinity set remembers (or renews) this client."""

    ip: str
    set: str

    def text(self) -> str:
        return f"update @{self.set} {{ {self.ip} saddr }}"


# One statement of a rule; a plain string is nft text that names no object of ours.
Statement = str | SetRef | Verdict | SourceMatch | Masquerade | PickDnat | DnatTo | ClientOf \
    | Remember


class Rule(NamedTuple):
    """A chain's rule: its statements in order."""

    statements: tuple[Statement, ...]

    def text(self) -> str:
        """The rule as nft writes it."""
        return " ".join(s if isinstance(s, str) else s.text() for s in self.statements)

    def sets(self) -> tuple[str, ...]:
        """The sets and maps the rule uses."""
        return tuple(_set_of(s) for s in self.statements if _set_of(s))

    def chains(self) -> tuple[str, ...]:
        """The chains it jumps or goes to."""
        return tuple(s.chain for s in self.statements if isinstance(s, Verdict) and s.chain)

    def renamed(self, names: Mapping[str, str]) -> Rule:
        """The same rule using other sets and maps (`names`: old → new; others stay)."""
        return Rule(tuple(_renamed(s, names) for s in self.statements))

    def of(self, kind: type[_S]) -> _S | None:
        """The rule's first statement of that kind."""
        return next((s for s in self.statements if isinstance(s, kind)), None)


_S = TypeVar("_S")


def rule(*statements: Statement) -> Rule:
    return Rule(statements)


def _set_of(statement: Statement) -> str:
    if isinstance(statement, SetRef):
        return statement.name
    if isinstance(statement, PickDnat):
        return statement.map
    if isinstance(statement, ClientOf | Remember):
        return statement.set
    return ""


def _renamed(statement: Statement, names: Mapping[str, str]) -> Statement:
    name = _set_of(statement)
    if name not in names:
        return statement
    if isinstance(statement, PickDnat):
        return statement._replace(map=names[name])
    if isinstance(statement, SetRef):
        return SetRef(names[name])
    assert isinstance(statement, ClientOf | Remember)
    return statement._replace(set=names[name])


class Kind(StrEnum):
    SET = "set"  # a set or map declaration; value = its SetDecl
    CHAIN = "chain"  # value = its Rules
    ELEMENT = "element"  # container = set/map name, key = its Key, value = its ElementValue


# A chain's rules, in order.
Rules = tuple[Rule, ...]
# A slot's value: what `Item.value` holds for its kind.
Value = Rules | SetDecl | ElementValue


class Item(NamedTuple):
    """One desired object. Items with the same (kind, container, key) are one slot in the
    kernel; several owners may want the same slot (a pick chain shared by many services).
    A set, map or chain has the key "", an element its Key (`element_text` writes it). A
    tuple, not a dataclass: hundreds of thousands of them go through set operations on
    every full sync, and tuple hashing is the fast path."""

    kind: Kind
    container: str
    key: str | Key
    value: Value


@dataclass(frozen=True)
class Fragment:
    """Everything one service port (or the static skeleton) wants in the table, each item
    once, in render order (the same input renders the same tuple, so an unchanged service
    compares equal without building sets)."""

    items: tuple[Item, ...] = ()

    def __post_init__(self) -> None:
        unique = tuple(dict.fromkeys(self.items))  # the same item twice is one slot
        if len(unique) != len(self.items) or not isinstance(self.items, tuple):
            object.__setattr__(self, "items", unique)


# Base chains: name → (type, hook, priority) as upstream; `dstnat` keyword avoided because
# nft 1.0.6 rejects it on the output hook.
BASE_CHAINS: dict[str, tuple[str, str, int]] = {
    "filter-prerouting": ("filter", "prerouting", -110),
    "filter-input": ("filter", "input", -110),
    "filter-forward": ("filter", "forward", -110),
    "filter-output": ("filter", "output", -110),
    "filter-output-post-dnat": ("filter", "output", -90),
    "nat-prerouting": ("nat", "prerouting", -100),
    "nat-output": ("nat", "output", -100),
    "nat-postrouting": ("nat", "postrouting", 100),
}

# After DNAT (input, forward, output after nat-output), the first packet of a connection that
# was DNATed: `ct state new` alone would also match a retransmitted SYN, and every datagram of
# a UDP flow until its first reply, but only the first packet passes before the conntrack entry
# is confirmed (at the end of postrouting/input). Another table's DNAT reaches the chain too;
# its keys belong to no service, are not exported and are garbage-collected.
_COUNT_NEW_CONNECTIONS = rule("ct status & (dnat | confirmed) == dnat",
                              Verdict("jump", COUNT_CONNECTIONS_CHAIN))

BASE_CHAIN_RULES: dict[str, Rules] = {
    "filter-prerouting": (rule("ct state new", Verdict("jump", FIREWALL_CHECK)),),
    "filter-input": (
        rule("ct state new", Verdict("jump", NODEPORT_ENDPOINTS_CHECK)),
        rule("ct state new", Verdict("jump", SERVICE_ENDPOINTS_CHECK)),
        _COUNT_NEW_CONNECTIONS,
    ),
    "filter-forward": (
        rule("ct state new", Verdict("jump", SERVICE_ENDPOINTS_CHECK)),
        rule("ct state new", Verdict("jump", CLUSTER_IPS_CHECK)),
        _COUNT_NEW_CONNECTIONS,
    ),
    # Source ranges are checked against the destination before DNAT; the endpoints check
    # after it: the node's own connections to an externalTrafficPolicy: Local address are
    # DNATed to the cluster endpoints, and the `drop` this node has for that address (no
    # local endpoint) is meant for traffic from outside only (kubernetes#131765). What is
    # still un-DNATed after nat-output found no endpoint, exactly as in input and forward.
    "filter-output": (rule("ct state new", Verdict("jump", FIREWALL_CHECK)),),
    "filter-output-post-dnat": (
        rule("ct state new", Verdict("jump", SERVICE_ENDPOINTS_CHECK)),
        rule("ct state new", Verdict("jump", CLUSTER_IPS_CHECK)),
        _COUNT_NEW_CONNECTIONS,
    ),
    "nat-prerouting": (rule(Verdict("jump", SERVICES_CHAIN)),),
    "nat-output": (rule(Verdict("jump", SERVICES_CHAIN)),),
    "nat-postrouting": (rule(Verdict("jump", MASQUERADING_CHAIN)),),
}


def base_chain_spec(name: str) -> str:
    kind, hook, priority = BASE_CHAINS[name]
    return f"type {kind} hook {hook} priority {priority}; policy accept;"


def connection_shard(endpoint_ip: str) -> int:
    """The set an endpoint's counters live in (its address's low bits, as the rules test)."""
    return int(ip_address(endpoint_ip)) % CONNECTION_SHARDS
