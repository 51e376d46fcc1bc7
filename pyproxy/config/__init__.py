"""Configuration: kube-proxy's own `KubeProxyConfiguration` file and flags, as one ProxyConfig.

A kube-proxy user keeps their configuration: `pyproxy run --config FILE` reads the file kube-proxy
reads (`kubeproxy.config.k8s.io/v1alpha1`, YAML or JSON; kubeadm keeps it in the `kube-proxy`
ConfigMap), and kube-proxy's flag names override it. Settings are resolved in three layers:

    ProxyConfig() defaults   kube-proxy's defaults for nftables mode
    load_config(text)        the file; a zero value means "default", as kube-proxy's defaulting does
    apply_flags(config, ns)  flags given on the command line (argparse default None = not given)

Every v1alpha1 field ever defined is accepted, including those that only apply to other modes or
platforms (`iptables`, `ipvs`, `winkernel`, `portRange`, `udpIdleTimeout`, ...): they are type
checked, and a value that would change something is reported in `ProxyConfig.notes`. A field
that v1alpha1 never had is ignored with a warning naming its path (`ProxyConfig.warnings`), as
kube-proxy's lenient decoding does: refusing to start over a field kube-proxy accepts would
break a working kube-proxy configuration, and `pyproxy config check` shows the typo before
it is deployed. Every problem of a file is reported at once, each naming its field.

Durations are in seconds (float) throughout; in the file and in flags they are Go duration
strings (`30s`, `1m0s`, `500ms`), parsed by `parse_duration`.

Each setting is one row of `_TABLE` (type, checks, what it does, where it is applied, its
file fields, its flag); the file's fields, the flags, the checks and docs/configuration.md
(`reference_markdown()`; `python -m pyproxy.config > docs/configuration.md` regenerates it)
are made from the rows, so none of them can drift from the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from functools import partial
from ipaddress import ip_address, ip_network
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from pyproxy.core.model import LocalMode, NodeConfig, is_loopback_cidr, override_ips

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
DEFAULT_BIND_ADDRESS = "0.0.0.0"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
# Interface names go into nft text inside double quotes (`iifname "cbr0"`): nothing that could
# end the string or add a wildcard gets through. 15 = IFNAMSIZ - 1.
INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
NODEPORT_KEYWORDS = ("primary", "localhost", "all")
# KEP-6032: localhost NodePorts in nftables mode (pyproxy/core/model.py, LocalhostNodePorts).
# Alpha and off in kube-proxy 1.37; on here, as the KEP's beta for 1.38 has it
# (kubernetes/enhancements#6378). `false` restores the 1.37 default.
LOCALHOST_NODEPORTS_GATE = "KubeProxyNFTablesLocalhostNodePorts"
LOCALHOST_NODEPORTS_DEFAULT = True
# What `localhost` stands for (kube-proxy's expandNodePortAddressKeywords: both families,
# whatever the node has).
LOCALHOST_CIDRS = ("127.0.0.0/8", "::1/128")


class ConfigError(ValueError):
    """The configuration cannot be used. `problems`: every one found, each naming the field
    or flag at fault (and the file, when there is one); the message is one a line."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems: tuple[str, ...] = problems


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


# ---------------------------------------------------------------------------------------------
# Go durations


_NS_PER_UNIT = {
    "ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000,
    "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
}
# One component of a Go duration: digits, optional fraction, unit (anything up to a digit/dot).
_DURATION_PART = re.compile(r"(\d*)(?:\.(\d*))?([^\d.]*)")
_MAX_NS = 2**63 - 1  # time.Duration is an int64 of nanoseconds


def parse_duration(text: str) -> float:
    """A Go duration string (`time.ParseDuration`) in seconds: `1h`, `2h30m`, `1m0s`, `500ms`,
    `1.5s`, `-2s`, or `0`. As in Go, every component needs a unit, and fractions are truncated
    to whole nanoseconds. Raises ValueError with Go's wording."""
    rest, negative = text, False
    if rest[:1] in ("-", "+"):
        negative, rest = rest[0] == "-", rest[1:]
    if rest == "0":
        return 0.0
    if not rest:
        raise ValueError(f"invalid duration {text!r}")
    total, pos = 0, 0
    while pos < len(rest):
        match = _DURATION_PART.match(rest, pos)
        assert match is not None  # every group is optional
        whole, fraction, unit = match.groups()
        if not whole and not fraction:
            raise ValueError(f"invalid duration {text!r}")
        if not unit:
            raise ValueError(f"missing unit in duration {text!r}")
        if unit not in _NS_PER_UNIT:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        fraction = fraction or ""
        amount = Fraction(int(whole or "0")) + Fraction(int(fraction or "0"), 10 ** len(fraction))
        total += int(amount * _NS_PER_UNIT[unit])
        pos = match.end()
    if total > _MAX_NS:
        raise ValueError(f"invalid duration {text!r}: out of range")
    return (-total if negative else total) / 1e9


def format_duration(seconds: float) -> str:
    """Seconds as Go prints a time.Duration: `0s`, `500ms`, `30s`, `1m30s`, `1h0m0s`."""
    ns = round(seconds * 1e9)
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    if ns == 0:
        return "0s"
    if ns < 1_000_000_000:
        unit = "ms" if ns >= 1_000_000 else "µs" if ns >= 1_000 else "ns"
        return f"{sign}{_decimal(ns, _NS_PER_UNIT[unit])}{unit}"
    hours, ns = divmod(ns, _NS_PER_UNIT["h"])
    minutes, ns = divmod(ns, _NS_PER_UNIT["m"])
    text = f"{_decimal(ns, _NS_PER_UNIT['s'])}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _decimal(value: int, scale: int) -> str:
    whole, fraction = divmod(value, scale)
    if not fraction:
        return str(whole)
    digits = str(fraction).rjust(len(str(scale)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}"


# ---------------------------------------------------------------------------------------------
# The resolved configuration


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """Everything `pyproxy run` is configured with. Defaults are kube-proxy's for nftables
    mode; durations are in seconds. Build it with `load_config` / `apply_flags`, which validate;
    constructing it directly (tests, tools) skips validation. What each setting does, its
    file fields, its flag and where it is applied: its row in `_TABLE`, in this order."""

    hostname_override: str | None = None
    bind_address: str = DEFAULT_BIND_ADDRESS
    healthz_bind_address: str | None = f"0.0.0.0:{HEALTHZ_PORT}"
    metrics_bind_address: str | None = f"127.0.0.1:{METRICS_PORT}"
    bind_address_hard_fail: bool = False

    cluster_cidrs: tuple[str, ...] = ()
    detect_local_mode: LocalMode = LocalMode.CLUSTER_CIDR
    bridge_interface: str = ""
    interface_name_prefix: str = ""
    nodeport_addresses: tuple[str, ...] = ("primary",)

    masquerade_bit: int = 14
    masquerade_all: bool = False

    sync_period: float = 30.0
    min_sync_period: float = 1.0
    full_sync_period: float = 3600.0
    config_sync_period: float = 900.0

    conntrack_max_per_core: int = 32768
    conntrack_min: int = 131072
    conntrack_tcp_established_timeout: float = 86400.0
    conntrack_tcp_close_wait_timeout: float = 3600.0
    conntrack_tcp_be_liberal: bool = False
    conntrack_udp_timeout: float = 0.0
    conntrack_udp_stream_timeout: float = 0.0

    kubeconfig: str | None = None
    master: str | None = None
    qps: float = 5.0
    burst: int = 10
    content_type: str = "application/vnd.kubernetes.protobuf"

    logging_format: LogFormat = LogFormat.TEXT
    verbosity: int = 0
    oom_score_adj: int = -999
    feature_gates: Mapping[str, bool] = field(
        default_factory=lambda: MappingProxyType({}), hash=False)

    debug_socket: str | None = "/run/pyproxy/pyproxy.sock"
    snapshot: str | None = None

    file_notes: tuple[str, ...] = ()
    """What reading the file found worth saying: ignored fields, the mode's consequences."""
    warnings: tuple[str, ...] = ()
    """What the file and the flags hold that changes nothing, where kube-proxy too would only
    warn or do nothing: unknown fields, kube-proxy flags pyproxy accepts without applying."""
    unapplied_fields: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), hash=False)
    """kube-proxy v1.37 fields pyproxy accepts without applying, by path, as the file spells
    them: set in the file (away from the zero value) or by their flag (`--profiling` is
    `enableProfiling: true`). `config view` and `--write-config-to` write them back, as
    kube-proxy's --write-config-to writes its whole configuration."""

    @property
    def notes(self) -> tuple[str, ...]:
        """Things the operator should know at start-up: `file_notes` plus what the settings
        imply together (recomputed, so flags that change a setting change its note)."""
        return self.file_notes + tuple(_derived_notes(self))

    @property
    def unapplied(self) -> tuple[str, ...]:
        """Settings given a value other than the default that pyproxy accepts but does not
        apply, unknown fields and unapplied flags (warned about at start-up)."""
        return self.warnings + tuple(_unapplied_notes(self))

    @property
    def watches_service_cidrs(self) -> bool:
        """Whether ServiceCIDRs are watched: kube-proxy starts that informer only with the
        MultiCIDRServiceAllocator gate on (the default)."""
        return self.feature_gates.get("MultiCIDRServiceAllocator", True)

    @property
    def localhost_nodeports_gate(self) -> bool:
        return self.feature_gates.get(LOCALHOST_NODEPORTS_GATE, LOCALHOST_NODEPORTS_DEFAULT)

    def node_name(self, hostname: Callable[[], str] = socket.gethostname) -> str:
        """The Node this proxy serves: hostname_override or the OS hostname, trimmed and
        lowercased (kube-proxy's GetHostname: Node names are lowercase, hostnames need not be)."""
        name = (self.hostname_override or hostname()).strip().lower()
        if not name:
            raise ConfigError("empty hostname: set hostnameOverride (--hostname-override)")
        return name

    def node_config(self, node_name: str, node_ips: Sequence[str],
                    node_cidrs: Sequence[str] = ()) -> NodeConfig:
        """What the renderer needs for this node. node_ips: the node's IPs, at most one per
        family, primary first (bindAddress overrides the one of its family); node_cidrs: its
        spec.podCIDRs (used by detect-local mode NodeCIDR)."""
        interface = {
            LocalMode.BRIDGE_INTERFACE: self.bridge_interface,
            LocalMode.INTERFACE_NAME_PREFIX: self.interface_name_prefix,
        }.get(self.detect_local_mode, "")
        return NodeConfig(
            node_name=node_name,
            node_ips=self._primary_first(node_ips),
            cluster_cidrs=self.cluster_cidrs,
            local_mode=self.detect_local_mode,
            local_interface=interface,
            node_cidrs=tuple(node_cidrs),
            nodeport_addresses=self._nodeport_cidrs(),
            masquerade_bit=self.masquerade_bit,
            masquerade_all=self.masquerade_all,
            localhost_nodeports_gate=self.localhost_nodeports_gate,
        )

    def _nodeport_cidrs(self) -> tuple[str, ...]:
        """nodePortAddresses for NodeConfig: `localhost` expanded; with `all`, the empty tuple
        (NodeConfig's "every local address") plus whatever names loopback explicitly, which
        still turns the localhost proxy on (kube-proxy: `all,localhost` does, `all` does not)."""
        entries: list[str] = []
        for entry in self.nodeport_addresses:
            entries.extend(LOCALHOST_CIDRS if entry == "localhost" else (entry,))
        if "all" in entries:
            loopback = tuple(e for e in entries if is_loopback_cidr(e))
            return ("0.0.0.0/0", "::/0", *loopback) if loopback else ()
        return tuple(dict.fromkeys(entries))

    def _primary_first(self, node_ips: Sequence[str]) -> tuple[str, ...]:
        # As kube-proxy's detectNodeIPs: a specific bindAddress replaces the node IP of its
        # family and makes that family the primary, so `nodePortAddresses: [primary]` means
        # that address; the other family keeps the Node's.
        bind = ip_address(self.bind_address)
        if bind.is_unspecified:
            return tuple(node_ips)
        return override_ips((str(bind),), node_ips)


# The settings of a node's rules: `render`, `apply` and `trace` take their flags (and --config)
# with the meanings `run` gives them.
NODE_SETTINGS = ("hostname_override", "bind_address", "cluster_cidrs", "detect_local_mode",
                 "bridge_interface", "interface_name_prefix", "nodeport_addresses",
                 "masquerade_bit", "masquerade_all")

# Feature gates pyproxy reads; any other is accepted and changes nothing.
APPLIED_FEATURE_GATES = frozenset({"MultiCIDRServiceAllocator", LOCALHOST_NODEPORTS_GATE})


def _unapplied_notes(config: ProxyConfig) -> Iterator[str]:
    default = ProxyConfig()
    if config.config_sync_period != default.config_sync_period:
        yield (f"configSyncPeriod ({format_duration(config.config_sync_period)}): accepted, not "
               f"applied ({_NOT_APPLIED['config_sync_period']})")
    ignored = sorted(set(config.feature_gates) - APPLIED_FEATURE_GATES)
    if ignored:
        yield (f"featureGates {', '.join(ignored)}: accepted, not applied (pyproxy has no "
               f"behaviour behind them; it reads only "
               f"{', '.join(sorted(APPLIED_FEATURE_GATES))})")


def _derived_notes(config: ProxyConfig) -> Iterator[str]:
    if config.min_sync_period > config.sync_period:
        yield (f"minSyncPeriod ({format_duration(config.min_sync_period)}) is longer than "
               f"syncPeriod ({format_duration(config.sync_period)}): retries after a failed sync "
               f"also wait for minSyncPeriod")
    if config.detect_local_mode is LocalMode.CLUSTER_CIDR and not config.cluster_cidrs:
        yield ("detectLocalMode is ClusterCIDR but clusterCIDR is empty: traffic from local pods "
               "is not told apart from other traffic (as kube-proxy does)")
    if "all" in config.nodeport_addresses and len(config.nodeport_addresses) > 1:
        yield "nodePortAddresses includes 'all': the other entries change nothing"


# ---------------------------------------------------------------------------------------------
# Value types: how a value is spelled in the file (JSON types) and in a flag (text)


class _Type(StrEnum):
    STRING = "string"
    BOOL = "boolean"
    INT32 = "int32"
    UINT32 = "uint32"
    NUMBER = "number"
    DURATION = "duration"
    FLUSH = "duration or nanoseconds"  # logging.flushFrequency: a Go string or an integer
    STRINGS = "list of strings"
    GATES = "map of string to boolean"
    QUANTITY = "quantity"
    VMODULE = "list of {filePattern, verbosity}"


_INT_RANGES = {_Type.INT32: (-(2**31), 2**31 - 1), _Type.UINT32: (0, 2**32 - 1)}
_GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # strconv.ParseBool
_GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")
_QUANTITY = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?")
_DURATION_HINT = "a duration such as 30s, 1m0s, 500ms or 2h30m"


def _describe(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string",
             list: "list", dict: "object"}
    name = names.get(type(value), type(value).__name__)
    if isinstance(value, (list, dict)):
        return name
    shown = json.dumps(value) if isinstance(value, (bool, int, float, str)) else repr(value)
    return f"{name} {shown}"


def _wrong(expected: str, value: object) -> ValueError:
    return ValueError(f"expected {expected}, got {_describe(value)}")


def _from_json(kind: _Type, value: object) -> Any:
    """A file value checked against its Go type (strict, as encoding/json is: no strings for
    numbers, no numbers for durations)."""
    if kind in (_Type.STRING, _Type.QUANTITY) and isinstance(value, str):
        if kind is _Type.QUANTITY and not _QUANTITY.fullmatch(value):
            raise _wrong(_expected(kind), value)
        return value
    if kind is _Type.BOOL and isinstance(value, bool):
        return value
    if kind in _INT_RANGES and isinstance(value, int) and not isinstance(value, bool):
        return _int_in_range(kind, value)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind in (_Type.NUMBER, _Type.QUANTITY) and is_number:
        return value
    if kind in (_Type.DURATION, _Type.FLUSH) and isinstance(value, str):
        return _duration(value)
    if kind is _Type.FLUSH and isinstance(value, int) and not isinstance(value, bool):
        return value / 1e9
    if kind is _Type.STRINGS and isinstance(value, list):
        if not all(isinstance(item, str) for item in value):
            raise _wrong("a list of strings", value)
        return list(value)
    if kind is _Type.GATES and isinstance(value, dict):
        for name, enabled in value.items():
            if not isinstance(name, str) or not isinstance(enabled, bool):
                raise ValueError(f"expected feature name: true|false, got {name!r}: {enabled!r}")
        return dict(value)
    if kind is _Type.VMODULE and isinstance(value, list):
        return [_vmodule_item(item) for item in value]
    raise _wrong(_expected(kind), value)


_EXPECTED = {
    _Type.STRING: "a string",
    _Type.BOOL: "a boolean (true or false)",
    _Type.INT32: "an integer (int32)",
    _Type.UINT32: "a non-negative integer (uint32)",
    _Type.NUMBER: "a number",
    _Type.DURATION: f"{_DURATION_HINT} (a string)",
    _Type.FLUSH: f"{_DURATION_HINT}, or an integer of nanoseconds",
    _Type.STRINGS: "a list of strings",
    _Type.GATES: "a map of feature names to true or false",
    _Type.QUANTITY: "a quantity such as 0 or 64Ki",
    _Type.VMODULE: "a list of {filePattern, verbosity}",
}


def _expected(kind: _Type) -> str:
    return _EXPECTED[kind]


def _int_in_range(kind: _Type, value: int) -> int:
    low, high = _INT_RANGES[kind]
    if not low <= value <= high:
        raise _wrong(f"an integer in {low}..{high} ({kind.value})", value)
    return value


def _vmodule_item(item: object) -> dict[str, Any]:
    if not isinstance(item, dict) or set(item) - {"filePattern", "verbosity"}:
        raise _wrong("{filePattern: string, verbosity: integer} items", item)
    if not isinstance(item.get("filePattern", ""), str):
        raise _wrong("a string filePattern", item["filePattern"])
    _from_json(_Type.UINT32, item.get("verbosity", 0))
    return item


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise ValueError(f"{err}; expected {_DURATION_HINT}") from None


def _from_flag(kind: _Type, text: str) -> Any:
    """A flag's text as the value the same field would have in the file."""
    if kind is _Type.STRING:
        return text
    if kind is _Type.BOOL:
        if text not in _GO_TRUE + _GO_FALSE:
            raise ValueError(f"expected true or false, got {text!r}")
        return text in _GO_TRUE
    if kind in _INT_RANGES:
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        return _int_in_range(kind, number)
    if kind is _Type.NUMBER:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if kind is _Type.DURATION:
        return _duration(text)
    if kind is _Type.STRINGS:
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind is _Type.GATES:
        return _gates_flag(text)
    if kind is _Type.QUANTITY:
        if not _QUANTITY.fullmatch(text):
            raise ValueError(f"expected {_expected(kind)}, got {text!r}")
        return text
    if kind is _Type.VMODULE:
        return _vmodule_flag(text)
    raise AssertionError(f"no flag has type {kind}")


def _gates_flag(text: str) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or value.strip() not in _GO_TRUE + _GO_FALSE:
            raise ValueError(f"expected Name=true|false[,...], got {item!r}")
        gates[name.strip()] = value.strip() in _GO_TRUE
    return gates


def _vmodule_flag(text: str) -> list[dict[str, Any]]:
    items = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        pattern, eq, level = item.partition("=")
        if not eq or not pattern or not level.isdigit():
            raise ValueError(f"expected pattern=N[,...], got {item!r}")
        items.append({"filePattern": pattern, "verbosity": int(level)})
    return items


# ---------------------------------------------------------------------------------------------
# Settings: from the decoded value to the ProxyConfig value (shared by file and flags)


def _text_or_none(value: str) -> str | None:
    return value or None


def _ip(value: str) -> str:
    try:
        return str(ip_address(value))
    except ValueError:
        raise ValueError(f"expected an IP address, got {value!r}") from None


def _host_port(value: str, default_port: int) -> str | None:
    """IP:port ([IPv6]:port); "" disables the server. A bare IP gets the default port, as
    kube-proxy's defaulting does (AppendPortIfNeeded)."""
    if not value:
        return None
    try:
        return _join_host_port(ip_address(value), default_port)
    except ValueError:
        pass
    match = re.fullmatch(r"\[([^\]]*)\]:(\d{1,5})|([^:\[\]]*):(\d{1,5})", value)
    if match is None:
        raise ValueError(f"must be IP:port (e.g. 0.0.0.0:{default_port}), got {value!r}")
    host, port = (match[1], match[2]) if match[2] else (match[3], match[4])
    try:
        address = ip_address(host)
    except ValueError:
        raise ValueError(f"must be IP:port: {host!r} is not an IP address") from None
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"must be IP:port (e.g. 0.0.0.0:{default_port}), got {value!r}")
    return _join_host_port(address, int(port))


def _join_host_port(address: Any, port: int) -> str:
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _cidr(value: str) -> str:
    # Go's net.ParseCIDR: a prefix length is required, host bits may be set.
    try:
        if "/" not in value:
            raise ValueError
        return str(ip_network(value, strict=False))
    except ValueError:
        raise ValueError(f"{value!r} is not a CIDR (e.g. 10.244.0.0/16)") from None


def _cluster_cidrs(value: str) -> tuple[str, ...]:
    if not value.strip():
        return ()
    cidrs = tuple(_cidr(part.strip()) for part in value.split(","))
    for version in (4, 6):
        same = [c for c in cidrs if ip_network(c).version == version]
        if len(same) > 1:
            raise ValueError(f"at most one CIDR per IP family, got IPv{version} {', '.join(same)}")
    return cidrs


def _nodeport_addresses(value: list[str]) -> tuple[str, ...]:
    if not value:
        return ("primary",)  # unset or empty: the nftables-mode default
    entries = []
    for entry in value:
        entries.append(entry if entry in NODEPORT_KEYWORDS else _nodeport_cidr(entry))
    return tuple(dict.fromkeys(entries))


def _nodeport_cidr(entry: str) -> str:
    try:
        return _cidr(entry)
    except ValueError:
        raise ValueError(f"{entry!r} is neither a CIDR nor one of "
                         f"{', '.join(NODEPORT_KEYWORDS)}") from None


def _local_mode(value: str) -> LocalMode:
    modes = [m.value for m in LocalMode if m is not LocalMode.NONE]
    if not value:
        return LocalMode.CLUSTER_CIDR
    if value not in modes:
        raise ValueError(f"expected one of {', '.join(modes)}, got {value!r}")
    return LocalMode(value)


def _interface(value: str) -> str:
    if value and not INTERFACE_NAME.fullmatch(value):
        raise ValueError(f"expected an interface name ([A-Za-z0-9_.:-], at most 15 characters), "
                         f"got {value!r}")
    return value


def _log_format(value: str) -> LogFormat:
    if value not in ("", *LogFormat):
        raise ValueError(f"expected text or json, got {value!r}")
    return LogFormat(value or LogFormat.TEXT)


_CONTENT_TYPES = ("application/vnd.kubernetes.protobuf", "application/json")


def _content_type(value: str) -> str:
    if value not in ("", *_CONTENT_TYPES):
        raise ValueError(f"expected one of {', '.join(_CONTENT_TYPES)}, got {value!r}")
    return value or _CONTENT_TYPES[0]


def _in_range(low: int, high: int, value: int) -> int:
    if not low <= value <= high:
        raise ValueError(f"must be within {low}..{high}, got {value}")
    return value


def _not_negative(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"must be a finite number >= 0, got {_show_number(value)}")
    return value


def _not_negative_duration(value: float) -> float:
    if value < 0:
        raise ValueError(f"must not be negative, got {format_duration(value)}")
    return value


def _positive_duration(value: float) -> float:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {format_duration(value)}")
    return value


def _show_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)  # 5, not 5.0


def _gates(value: dict[str, bool]) -> Mapping[str, bool]:
    return MappingProxyType(dict(value))


def _identity(value: Any) -> Any:
    return value


# ---------------------------------------------------------------------------------------------
# The settings: one row each


@dataclass(frozen=True, slots=True)
class _Setting:
    """One ProxyConfig setting and everything said about it: its type, the conversion (with
    its checks) from a decoded value, what it does, where `pyproxy run` applies it, the file
    fields and the flag that set it. The file fields, the flags, the checks and
    docs/configuration.md are all made from these rows."""

    attr: str
    type: _Type
    convert: Callable[[Any], Any]
    doc: str = ""
    """What it does (a setting without a file field: its flag's help)."""
    applied_by: str = "—"
    """Where `pyproxy run` applies it (tests/test_applied_settings.py shows each one is)."""
    paths: tuple[str, ...] = ()
    """The file fields that set it; `iptables.*` and `nftables.*` are read per `mode`."""
    flag: str | None = None
    flag_help: str = ""
    own: bool = False
    """pyproxy's own flag, not kube-proxy's."""
    short: str | None = None
    zero_is_unset: bool = False
    """kube-proxy's defaulting replaces the file's zero value ("", 0, 0s) with the default."""
    partly: bool = False
    """Only some values change anything (the doc says which)."""
    default_text: str | None = None
    """The default as the document shows it, where the value itself would not say it."""
    not_applied: str = ""
    """Accepted, not applied: why."""
    kube_flags: tuple[str, ...] = ()
    """kube-proxy's flags for this setting, where `flag` is another name (pyproxy's own)."""

    @property
    def description(self) -> str:
        return self.doc or self.flag_help


_TABLE: tuple[_Setting, ...] = (
    _Setting("hostname_override", _Type.STRING, _text_or_none,
             "the Node's name; empty: the OS hostname (lowercased)",
             applied_by="run.py: the Node to watch and serve (`ProxyConfig.node_name`)",
             paths=("hostnameOverride",),
             flag="hostname-override", flag_help="the Node's name, instead of the OS hostname",
             default_text="OS hostname, lowercased"),
    _Setting("bind_address", _Type.STRING, _ip,
             "overrides the node's primary IP for its family; no socket is bound to it",
             applied_by="run.py: the node IPs (`ProxyConfig.node_config`)",
             paths=("bindAddress",),
             flag="bind-address", flag_help="overrides the node's primary IP for its family",
             zero_is_unset=True),
    _Setting("healthz_bind_address", _Type.STRING, partial(_host_port, default_port=HEALTHZ_PORT),
             "IP:port of /healthz and /livez ([::]:10256 when bindAddress is IPv6); a bare IP "
             "gets port 10256",
             applied_by="run.py: the health server (health.py)",
             paths=("healthzBindAddress",),
             flag="healthz-bind-address",
             flag_help="IP:port of /healthz and /livez; empty disables",
             zero_is_unset=True, default_text=f"`0.0.0.0:{HEALTHZ_PORT}`"),
    _Setting("metrics_bind_address", _Type.STRING, partial(_host_port, default_port=METRICS_PORT),
             "IP:port of /metrics ([::1]:10249 when bindAddress is IPv6); a bare IP gets port "
             "10249",
             applied_by="run.py: the metrics server (metrics.py)",
             paths=("metricsBindAddress",),
             flag="metrics-bind-address", flag_help="IP:port of /metrics; empty disables",
             zero_is_unset=True, default_text=f"`127.0.0.1:{METRICS_PORT}`"),
    _Setting("bind_address_hard_fail", _Type.BOOL, _identity,
             "exit if the healthz or metrics server cannot bind",
             applied_by="run.py: a server that cannot bind",
             paths=("bindAddressHardFail",),
             flag="bind-address-hard-fail",
             flag_help="exit if the healthz or metrics server cannot bind"),
    _Setting("cluster_cidrs", _Type.STRING, _cluster_cidrs,
             "pod CIDRs, comma-separated, one per family, for detectLocalMode ClusterCIDR",
             applied_by="`NodeConfig` → pyproxy.render (local traffic)",
             paths=("clusterCIDR",),
             flag="cluster-cidr", flag_help="pod CIDRs, comma-separated, one per family",
             default_text="empty"),
    _Setting("detect_local_mode", _Type.STRING, _local_mode,
             "ClusterCIDR, NodeCIDR (the Node's podCIDRs), BridgeInterface or InterfaceNamePrefix",
             applied_by="`NodeConfig` → pyproxy.render (local traffic)",
             paths=("detectLocalMode",),
             flag="detect-local-mode",
             flag_help="ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix"),
    _Setting("bridge_interface", _Type.STRING, _interface,
             "pod bridge, for detectLocalMode BridgeInterface",
             applied_by="`NodeConfig` → pyproxy.render (local traffic)",
             paths=("detectLocal.bridgeInterface",),
             flag="pod-bridge-interface",
             flag_help="pod bridge, for --detect-local-mode BridgeInterface"),
    _Setting("interface_name_prefix", _Type.STRING, _interface,
             "pod interface name prefix, for detectLocalMode InterfaceNamePrefix",
             applied_by="`NodeConfig` → pyproxy.render (local traffic)",
             paths=("detectLocal.interfaceNamePrefix",),
             flag="pod-interface-name-prefix",
             flag_help="pod interface name prefix, for --detect-local-mode InterfaceNamePrefix"),
    _Setting("nodeport_addresses", _Type.STRINGS, _nodeport_addresses,
             "CIDRs, `primary` (the node's primary IPs), `localhost` (127.0.0.0/8 and ::1/128) "
             "or `all`, in any combination, of node addresses accepting NodePorts; localhost "
             "(`localhost`, 127.0.0.1/32, ::1/128, any CIDR but 0.0.0.0/0 and ::/0 holding "
             "127.0.0.1 or ::1) turns on the userspace proxy for TCP NodePorts on it "
             "(featureGates KubeProxyNFTablesLocalhostNodePorts)",
             applied_by="`NodeConfig` → pyproxy.render (NodePort addresses)",
             paths=("nodePortAddresses",),
             flag="nodeport-addresses",
             flag_help="comma-separated CIDRs, primary, localhost or all: node addresses "
             "accepting NodePorts"),
    _Setting("masquerade_bit", _Type.INT32, partial(_in_range, 0, 31),
             "fwmark bit for masquerading, 0..31",
             applied_by="`NodeConfig` → pyproxy.render (the masquerade mark)",
             paths=("iptables.masqueradeBit", "nftables.masqueradeBit"),
             flag_help="fwmark bit for masquerading, 0..31",
             kube_flags=("iptables-masquerade-bit",)),
    _Setting("masquerade_all", _Type.BOOL, _identity,
             "masquerade all ClusterIP traffic",
             applied_by="`NodeConfig` → pyproxy.render (masquerading)",
             paths=("iptables.masqueradeAll", "nftables.masqueradeAll"),
             flag="masquerade-all", flag_help="masquerade all ClusterIP traffic"),
    _Setting("sync_period", _Type.DURATION, _positive_duration,
             "retry delay after a failed sync; health timeout is twice this",
             applied_by="run.py: sync timing (runner.py retries, health.py timeout)",
             paths=("iptables.syncPeriod", "nftables.syncPeriod"),
             flag="sync-period", flag_help="retry delay after a failed sync", own=True,
             kube_flags=("iptables-sync-period",),
             zero_is_unset=True),
    _Setting("min_sync_period", _Type.DURATION, _not_negative_duration,
             "minimum gap between syncs",
             applied_by="run.py: sync timing (runner.py)",
             paths=("iptables.minSyncPeriod", "nftables.minSyncPeriod"),
             flag="min-sync-period", flag_help="minimum gap between syncs", own=True,
             kube_flags=("iptables-min-sync-period",),
             zero_is_unset=True),
    _Setting("full_sync_period", _Type.DURATION, _positive_duration,
             applied_by="run.py: sync timing (sync/node.py)",
             flag="full-sync-period", flag_help="full resync at least this often", own=True),
    _Setting("config_sync_period", _Type.DURATION, _positive_duration,
             "informer resync period",
             applied_by="—",
             paths=("configSyncPeriod",),
             flag="config-sync-period", flag_help="informer resync period; accepted, not applied",
             zero_is_unset=True,
             not_applied=("pyproxy's watches do not re-deliver objects they already delivered; "
             "kube-proxy's informer resync re-sends its cache to handlers that ignore unchanged "
             "objects")),
    _Setting("conntrack_max_per_core", _Type.INT32, partial(_in_range, 0, 2**31 - 1),
             "at start nf_conntrack_max raised to max(maxPerCore × CPUs, min) (maxPerCore × "
             "CPUs capped at 1,048,576 first; a larger host value is never lowered), and the "
             "conntrack hash size raised to a quarter of it; 0 leaves both alone. Global: set "
             "only from the initial network namespace (elsewhere reported and skipped)",
             applied_by="host.py, at start",
             paths=("conntrack.maxPerCore",),
             flag="conntrack-max-per-core",
             flag_help="nf_conntrack_max per CPU; 0 leaves the limit alone"),
    _Setting("conntrack_min", _Type.INT32, partial(_in_range, 0, 2**31 - 1),
             "lower bound of nf_conntrack_max",
             applied_by="host.py, at start",
             paths=("conntrack.min",),
             flag="conntrack-min", flag_help="lower bound of nf_conntrack_max"),
    _Setting("conntrack_tcp_established_timeout", _Type.DURATION, _not_negative_duration,
             "nf_conntrack_tcp_timeout_established at start; 0s leaves it alone",
             applied_by="host.py, at start",
             paths=("conntrack.tcpEstablishedTimeout",),
             flag="conntrack-tcp-timeout-established", flag_help="0 leaves the sysctl alone"),
    _Setting("conntrack_tcp_close_wait_timeout", _Type.DURATION, _not_negative_duration,
             "nf_conntrack_tcp_timeout_close_wait at start; 0s leaves it alone",
             applied_by="host.py, at start",
             paths=("conntrack.tcpCloseWaitTimeout",),
             flag="conntrack-tcp-timeout-close-wait", flag_help="0 leaves the sysctl alone"),
    _Setting("conntrack_tcp_be_liberal", _Type.BOOL, _identity,
             "nf_conntrack_tcp_be_liberal = 1 at start (false leaves it alone)",
             applied_by="host.py, at start",
             paths=("conntrack.tcpBeLiberal",),
             flag="conntrack-tcp-be-liberal", flag_help="set nf_conntrack_tcp_be_liberal"),
    _Setting("conntrack_udp_timeout", _Type.DURATION, _not_negative_duration,
             "nf_conntrack_udp_timeout at start; 0s leaves it alone",
             applied_by="host.py, at start",
             paths=("conntrack.udpTimeout",),
             flag="conntrack-udp-timeout", flag_help="0 leaves the sysctl alone"),
    _Setting("conntrack_udp_stream_timeout", _Type.DURATION, _not_negative_duration,
             "nf_conntrack_udp_timeout_stream at start; 0s leaves it alone",
             applied_by="host.py, at start",
             paths=("conntrack.udpStreamTimeout",),
             flag="conntrack-udp-timeout-stream", flag_help="0 leaves the sysctl alone"),
    _Setting("kubeconfig", _Type.STRING, _text_or_none,
             "kubeconfig file (a token, a `tokenFile` re-read every minute as client-go does, "
             "or a client certificate); empty: the pod's service account, with the server "
             "from KUBERNETES_SERVICE_HOST/PORT",
             applied_by="cluster/apiconnection.py, at start (every file it names is read "
                        "before anything changes)",
             paths=("clientConnection.kubeconfig",),
             flag="kubeconfig", flag_help="kubeconfig file",
             default_text="in-cluster"),
    _Setting("master", _Type.STRING, _text_or_none,
             applied_by="cluster/apiconnection.py, at start",
             flag="master", flag_help="API server URL, overriding the kubeconfig's",
             default_text="from kubeconfig"),
    _Setting("qps", _Type.NUMBER, _not_negative,
             "API client requests per second (a token bucket every request waits on, as "
             "client-go's)",
             applied_by="run.py: the API client's token bucket (ratelimit.py)",
             paths=("clientConnection.qps",),
             flag="kube-api-qps", flag_help="API client requests per second",
             zero_is_unset=True),
    _Setting("burst", _Type.INT32, partial(_in_range, 0, 2**31 - 1),
             "API client requests at once before qps applies",
             applied_by="run.py: the API client's token bucket (ratelimit.py)",
             paths=("clientConnection.burst",),
             flag="kube-api-burst", flag_help="API client burst",
             zero_is_unset=True),
    _Setting("content_type", _Type.STRING, _content_type,
             "what the API server is asked to send: `application/vnd.kubernetes.protobuf` "
             "(kube-proxy's default) on plain watches, where a change is about half its JSON "
             "(docs/fleet.md); lists and streamed lists stay JSON, gzipped, which pyproxy "
             "decodes 3 to 5 times faster; `application/json`: JSON everywhere",
             applied_by="cluster/watch.py: the Accept of each watch",
             paths=("clientConnection.contentType",),
             flag="kube-api-content-type", flag_help="API content type",
             zero_is_unset=True),
    _Setting("logging_format", _Type.STRING, _log_format,
             "on stderr: `text` (key=value lines; aligned and coloured on a terminal) or "
             "`json` (JSON lines), whatever stderr is",
             applied_by="logs.py",
             paths=("logging.format",),
             flag="logging-format", flag_help="text or json"),
    _Setting("verbosity", _Type.UINT32, _identity,
             "log verbosity (as klog's -v)",
             applied_by="logs.py",
             paths=("logging.verbosity",),
             flag="v", flag_help="log verbosity", short="-v"),
    _Setting("oom_score_adj", _Type.INT32, partial(_in_range, -1000, 1000),
             "written to /proc/self/oom_score_adj at start",
             applied_by="host.py, at start",
             paths=("oomScoreAdj",),
             flag="oom-score-adj", flag_help="the process's oom_score_adj"),
    _Setting("feature_gates", _Type.GATES, _gates,
             "MultiCIDRServiceAllocator=false turns the ServiceCIDR watch off (kube-proxy 1.37 "
             "refuses it: the gate is GA, locked on; 1.38 removed it); "
             "KubeProxyNFTablesLocalhostNodePorts (default true, as KEP-6032's beta; kube-proxy "
             "1.37: false) handles NodePorts on loopback: TCP through a userspace proxy where "
             "nodePortAddresses names loopback, everything else rejected and counted; any other "
             "gate is accepted, not applied (a warning at start)",
             applied_by="run.py: the ServiceCIDR watch (watch.py), localhost NodePorts "
             "(NodeConfig → pyproxy.render, serve/localhost.py)",
             paths=("featureGates",),
             flag="feature-gates",
             flag_help="Name=true|false,...; merged over the file's featureGates; only "
             "MultiCIDRServiceAllocator and KubeProxyNFTablesLocalhostNodePorts are applied",
             partly=True),
    _Setting("debug_socket", _Type.STRING, _text_or_none,
             applied_by="run.py: the debug server (debug.py, live.py)",
             flag="debug-socket", flag_help="unix socket for pyproxy debug; empty disables",
             own=True),
    _Setting("snapshot", _Type.STRING, _text_or_none,
             applied_by="run.py: the snapshot source (sources.py)",
             flag="snapshot",
             flag_help="proxy the cluster state in this snapshot file instead of watching the API "
             "server", own=True,
             default_text="unset: watch the API server"),

)
_SETTINGS: Mapping[str, Callable[[Any], Any]] = {s.attr: s.convert for s in _TABLE}
_DEFAULT_TEXT = {s.attr: s.default_text for s in _TABLE if s.default_text}
# Settings accepted (type checked, kept) that change nothing, and why.
_NOT_APPLIED = {s.attr: s.not_applied for s in _TABLE if s.not_applied}


def _setting(attr: str, value: Any, name: str) -> Any:
    try:
        return _SETTINGS[attr](value)
    except ValueError as err:
        raise ConfigError(f"{name}: {err}") from None


# ---------------------------------------------------------------------------------------------
# The file: every v1alpha1 field


@dataclass(frozen=True, slots=True)
class _Field:
    """One KubeProxyConfiguration field."""

    path: str
    type: _Type
    attr: str | None
    """The ProxyConfig setting it feeds; None: accepted, type checked, not used."""
    doc: str
    """What it does, or (attr None) why pyproxy does not use it."""
    section: str = ""
    """`iptables`/`nftables`: read only when `mode` selects this section (see _section)."""
    zero_is_unset: bool = False
    """kube-proxy's defaulting replaces the zero value ("", 0, 0s) with the default."""
    partly: bool = False
    """Only some values change anything (the doc says which)."""


_IPT, _NFT = "iptables", "nftables"
_MODE, _API_VERSION, _KIND = "mode", "apiVersion", "kind"
_IPVS_ONLY = "ipvs mode only"
_WINDOWS_ONLY = "Windows (winkernel mode) only"
_KLOG_ONLY = "klog output routing; pyproxy logs through structlog"
_CLIENT = ("client-go's list of media types to accept; pyproxy's are set by "
           "`clientConnection.contentType`")


def _section(path: str) -> str:
    """The mode section a field belongs to (read only when `mode` selects it), or ""."""
    first = path.split(".", 1)[0]
    return first if first in (_IPT, _NFT) else ""


# The fields of the settings, from their rows.
_SETTING_FIELDS = tuple(
    _Field(path, s.type, s.attr, s.doc, section=_section(path), zero_is_unset=s.zero_is_unset,
           partly=s.partly)
    for s in _TABLE for path in s.paths)
# The fields pyproxy checks (`mode`) or accepts and ignores, and why.
_OTHER_FIELDS: tuple[_Field, ...] = (
    _Field(_MODE, _Type.STRING, None, "`nftables`, `iptables` or empty: pyproxy runs nftables; "
           "`iptables` and empty (kubeadm's and kube-proxy's default) read the iptables "
           "section"),
    _Field("clientConnection.acceptContentTypes", _Type.STRING, None, _CLIENT),
    _Field("logging.flushFrequency", _Type.FLUSH, None, "pyproxy does not buffer logs"),
    _Field("logging.vmodule", _Type.VMODULE, None, "per-file verbosity is a klog feature"),
    _Field("logging.options.text.splitStream", _Type.BOOL, None, _KLOG_ONLY),
    _Field("logging.options.text.infoBufferSize", _Type.QUANTITY, None, _KLOG_ONLY),
    _Field("logging.options.json.splitStream", _Type.BOOL, None, _KLOG_ONLY),
    _Field("logging.options.json.infoBufferSize", _Type.QUANTITY, None, _KLOG_ONLY),
    _Field("logging.sanitization", _Type.BOOL, None, "removed from Kubernetes logging"),
    _Field("enableProfiling", _Type.BOOL, None, "pyproxy serves no pprof"),
    _Field("showHiddenMetricsForVersion", _Type.STRING, None, "pyproxy hides no metrics"),
    _Field("iptables.localhostNodePorts", _Type.BOOL, None,
           "localhost NodePorts need route_localnet, which nftables mode never sets"),
    _Field("iptables.snatNodeInternalIP", _Type.BOOL, None, "iptables mode only"),
    _Field("ipvs.syncPeriod", _Type.DURATION, None, _IPVS_ONLY),
    _Field("ipvs.minSyncPeriod", _Type.DURATION, None, _IPVS_ONLY),
    _Field("ipvs.scheduler", _Type.STRING, None, _IPVS_ONLY),
    _Field("ipvs.excludeCIDRs", _Type.STRINGS, None, _IPVS_ONLY),
    _Field("ipvs.strictARP", _Type.BOOL, None, _IPVS_ONLY),
    _Field("ipvs.tcpTimeout", _Type.DURATION, None, _IPVS_ONLY),
    _Field("ipvs.tcpFinTimeout", _Type.DURATION, None, _IPVS_ONLY),
    _Field("ipvs.udpTimeout", _Type.DURATION, None, _IPVS_ONLY),
    _Field("winkernel.networkName", _Type.STRING, None, _WINDOWS_ONLY),
    _Field("winkernel.sourceVip", _Type.STRING, None, _WINDOWS_ONLY),
    _Field("winkernel.enableDSR", _Type.BOOL, None, _WINDOWS_ONLY),
    _Field("winkernel.rootHnsEndpointName", _Type.STRING, None, _WINDOWS_ONLY),
    _Field("winkernel.forwardHealthCheckVip", _Type.BOOL, None, _WINDOWS_ONLY),
    _Field("portRange", _Type.STRING, None, "configured the userspace proxy, removed in 1.26"),
    _Field("udpIdleTimeout", _Type.DURATION, None, "userspace proxy only, removed in 1.26"),
    _Field("resourceContainer", _Type.STRING, None, "long removed from kube-proxy"),
    _Field("windowsRunAsService", _Type.BOOL, None, _WINDOWS_ONLY),
)
_FIELDS: tuple[_Field, ...] = (*_OTHER_FIELDS[:1], *_SETTING_FIELDS, *_OTHER_FIELDS[1:])
# The fields accepted and not applied that kube-proxy v1.37's v1alpha1 still has (it writes
# them with --write-config-to; the others it would drop): ProxyConfig.unapplied_fields.
_GONE_FIELDS = frozenset({"logging.sanitization", "iptables.snatNodeInternalIP",
                          "udpIdleTimeout", "resourceContainer", "windowsRunAsService"})
# A pointer in v1alpha1: false is not "unset" (kube-proxy defaults it to true).
_POINTER_FIELDS = frozenset({"iptables.localhostNodePorts"})
_KEPT_FIELDS: tuple[_Field, ...] = tuple(
    f for f in _OTHER_FIELDS if f.path != _MODE and f.path not in _GONE_FIELDS)


def _tree(fields: Sequence[_Field]) -> dict[str, Any]:
    """The fields as nested dicts ({"nftables": {"syncPeriod": field}}), to walk a document."""
    root: dict[str, Any] = {}
    for spec in fields:
        *parents, leaf = spec.path.split(".")
        node = root
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = spec
    return root


_TREE = _tree(_FIELDS)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: YAML keeps the last one silently, kube-proxy's
    strict decoding refuses them."""


def _unique_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise ConfigError(f"{key}: duplicate field (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_config(text: str) -> ProxyConfig:
    """A KubeProxyConfiguration (YAML or JSON) as a validated ProxyConfig. Raises ConfigError
    with every problem found, each naming the field at fault. Fields v1alpha1 never had are
    ignored and kept in `ProxyConfig.warnings`, as kube-proxy's lenient decoding does."""
    document = _parse(text)
    values: dict[str, Any] = {}
    problems: list[str] = []
    warnings: list[str] = []
    _decode(document, _TREE, "", values, problems, warnings)
    config = _build(values, problems)
    problems += _cross_problems(config)
    if problems:
        raise ConfigError(*problems)
    kept = {spec.path: _raw(document, spec.path) for spec in _KEPT_FIELDS
            if spec.path in values and (spec.path in _POINTER_FIELDS
                                        or not _is_zero(spec.type, values[spec.path]))}
    return dataclasses.replace(config, warnings=tuple(warnings),
                               unapplied_fields=MappingProxyType(kept))


def _raw(document: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path of a parsed document, as written."""
    node: Any = document
    for name in path.split("."):
        node = node[name]
    return node


def load_config_file(path: str) -> ProxyConfig:
    """`load_config` of a file; every problem names the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {path}: {getattr(err, 'strerror', None) or err}") from err
    try:
        config = load_config(text)
    except ConfigError as err:
        raise ConfigError(*(f"{path}: {problem}" for problem in err.problems)) from None
    return dataclasses.replace(config, warnings=tuple(f"{path}: {w}" for w in config.warnings))


def _parse(text: str) -> dict[str, Any]:
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML or JSON: {err}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"expected a {KIND} object, got {_describe(document)}")
    if document.get(_KIND) == "ConfigMap":
        raise ConfigError(_configmap_hint(document))
    for key, want in ((_API_VERSION, API_VERSION), (_KIND, KIND)):
        got = document.pop(key, None)
        if got != want:
            shown = "missing" if got is None else f"got {_describe(got)}"
            raise ConfigError(f"{key}: expected {want}, {shown}")
    return document


def _configmap_hint(document: Mapping[str, Any]) -> str:
    """A whole ConfigMap is what `kubectl get cm kube-proxy -o yaml` prints: the configuration
    is one of its keys (kubeadm's: config.conf), which kube-proxy's pod mounts as a file."""
    data = document.get("data")
    keys = [key for key, value in (data.items() if isinstance(data, dict) else ())
            if isinstance(value, str) and KIND in value]
    key = keys[0] if keys else "config.conf"
    meta = document.get("metadata")
    name = meta.get("name", "kube-proxy") if isinstance(meta, dict) else "kube-proxy"
    namespace = meta.get("namespace", "kube-system") if isinstance(meta, dict) else "kube-system"
    escaped = key.replace(".", "\\.")
    return (f"kind: this is a ConfigMap, not a {KIND}: give its {key} key as the file (as "
            f"kube-proxy's pod mounts it), e.g. kubectl -n {namespace} get cm {name} -o "
            f"jsonpath='{{.data.{escaped}}}' > {key}")


# kube-proxy's nftables mode refuses kernels older than 5.13 unless this variable is set; a
# field of that name is a guess kube-proxy ignores (with a warning), and so does pyproxy. The
# version is pyproxy.kernel.host.MIN_KERNEL's (tests/test_config_check.py keeps them equal).
_FIELD_HINTS = {
    "nftables.skipKernelVersionCheck": (
        "kube-proxy's kernel check is skipped with the environment variable "
        "KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK, not a field; pyproxy needs neither: "
        "below kernel 5.13 it warns (kernel_below_supported) and runs"),
}


def _unknown_field(path: str) -> str:
    hint = _FIELD_HINTS.get(path, "not a v1alpha1 field; a typo keeps the default")
    return f"{path}: unknown field, ignored (as kube-proxy does, with a warning): {hint}"


def _decode(document: Mapping[Any, Any], tree: Mapping[str, Any], prefix: str,
            out: dict[str, Any], problems: list[str], warnings: list[str]) -> None:
    """Check every field of `document` against `tree`, storing typed values by dotted path,
    a wrong value in `problems`, an unknown field in `warnings`. null means unset (as an
    omitted field), whatever the type."""
    for key, value in document.items():
        path = f"{prefix}{key}"
        spec = tree.get(key) if isinstance(key, str) else None
        if spec is None:
            warnings.append(_unknown_field(path))
        elif value is None:
            continue
        elif isinstance(spec, _Field):
            try:
                out[path] = _from_json(spec.type, value)
            except ValueError as err:
                problems.append(f"{path}: {err}")
        elif isinstance(value, dict):
            _decode(value, spec, f"{path}.", out, problems, warnings)
        else:
            problems.append(f"{path}: expected an object, got {_describe(value)}")


def _is_zero(kind: _Type, value: Any) -> bool:
    """The Go zero value (what kubeadm writes for every field it leaves unset)."""
    if kind is _Type.QUANTITY and value == "0":
        return True
    return value in (False, 0, "") or value == [] or value == {}


def _build(values: Mapping[str, Any], problems: list[str]) -> ProxyConfig:
    mode = values.get(_MODE, "")
    problems += _mode_problems(mode, _MODE)
    # As kube-proxy's v1alpha1 conversion: the mode-specific settings come from the section of
    # the mode kube-proxy would run, and an empty mode means iptables (what kubeadm writes).
    section = _NFT if mode == _NFT else _IPT
    changes: dict[str, Any] = {}
    notes = list(_mode_notes(mode, values))
    for spec in _FIELDS:
        if spec.path not in values or spec.path == _MODE:
            continue
        value = values[spec.path]
        if spec.attr is None or spec.section not in ("", section):
            if not _is_zero(spec.type, value):
                notes.append(f"{spec.path}: ignored ({_why_ignored(spec, mode)})")
        elif not (spec.zero_is_unset and _is_zero(spec.type, value)):
            try:
                changes[spec.attr] = _setting(spec.attr, value, spec.path)
            except ConfigError as err:
                problems.append(str(err))
    healthz, metrics = _default_servers(changes.get("bind_address", DEFAULT_BIND_ADDRESS))
    changes.setdefault("healthz_bind_address", healthz)
    changes.setdefault("metrics_bind_address", metrics)
    return ProxyConfig(**changes, file_notes=tuple(notes))


def _mode_problems(mode: str, name: str) -> list[str]:
    if mode in ("", _IPT, _NFT):
        return []
    return [f"{name}: pyproxy only implements nftables mode, got {mode!r} "
            f"(use nftables; iptables or empty run nftables too)"]


def _mode_notes(mode: str, values: Mapping[str, Any]) -> Iterator[str]:
    if mode == _NFT:
        return
    if mode == _IPT:
        # kubeadm v1.37 writes it into its kube-proxy ConfigMap (tests/test_kubeadm.py).
        yield ("mode is iptables: pyproxy runs nftables, its only mode, and, as kube-proxy's "
               "iptables mode, takes masqueradeBit, masqueradeAll, syncPeriod and minSyncPeriod "
               "from the iptables section")
    else:
        yield ("mode is empty (kube-proxy would run iptables): pyproxy runs nftables and, as "
               "kube-proxy does for an empty mode, takes masqueradeBit, masqueradeAll, "
               "syncPeriod and minSyncPeriod from the iptables section")
    if not values.get("nodePortAddresses"):
        yield ("nodePortAddresses is unset: NodePorts are served on the node's primary IPs only "
               "(nftables mode's default; iptables mode served every local address, "
               "nodePortAddresses: [all])")


def _why_ignored(spec: _Field, mode: str) -> str:
    if spec.section == _NFT:
        return (f"mode is {mode or 'empty'}, so the iptables section applies; set mode: "
                f"nftables to use this")
    if spec.section == _IPT:
        return f"iptables mode only; mode is {mode}"
    return spec.doc


def _default_servers(bind_address: str) -> tuple[str, str]:
    """healthz and metrics defaults: kube-proxy serves on IPv6 when bindAddress is IPv6."""
    if ip_address(bind_address).version == 6:
        return f"[::]:{HEALTHZ_PORT}", f"[::1]:{METRICS_PORT}"
    return f"0.0.0.0:{HEALTHZ_PORT}", f"127.0.0.1:{METRICS_PORT}"


# ---------------------------------------------------------------------------------------------
# Validation across settings (file and flags alike)


def _cross_problems(config: ProxyConfig) -> list[str]:
    problems = []
    mode = config.detect_local_mode
    if mode is LocalMode.BRIDGE_INTERFACE and not config.bridge_interface:
        problems.append("detectLocalMode is BridgeInterface but detectLocal.bridgeInterface "
                        "(--pod-bridge-interface) is empty")
    if mode is LocalMode.INTERFACE_NAME_PREFIX and not config.interface_name_prefix:
        problems.append("detectLocalMode is InterfaceNamePrefix but "
                        "detectLocal.interfaceNamePrefix (--pod-interface-name-prefix) is empty")
    if config.full_sync_period < config.min_sync_period:
        problems.append(f"--full-sync-period ({format_duration(config.full_sync_period)}) must "
                        f"not be shorter than minSyncPeriod "
                        f"({format_duration(config.min_sync_period)})")
    return problems


# ---------------------------------------------------------------------------------------------
# Flags


@dataclass(frozen=True, slots=True)
class _Flag:
    name: str
    type: _Type
    attr: str | None
    """The setting it sets; None: `config`, `proxy-mode`, an action, or not applied."""
    help: str
    own: bool = False
    """pyproxy's own flag, not kube-proxy's."""
    short: str | None = None
    not_applied: str = ""
    """A kube-proxy flag accepted (type checked) that changes nothing here: why."""
    field: str = ""
    """(not_applied) The KubeProxyConfiguration field kube-proxy's flag sets, kept in
    ProxyConfig.unapplied_fields; none for the ipvs sync periods, which kube-proxy reads only
    in ipvs mode."""
    action: bool = False
    """Something `pyproxy run` does instead of running (`--cleanup`, `--write-config-to`)."""

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


_KLOG = "klog's; pyproxy logs through structlog"
_IPVS = "ipvs mode only; pyproxy runs nftables"
# kube-proxy v1.37's flags that set nothing pyproxy has (tests/test_kube_proxy_flags.py checks
# this list against kube-proxy's own --help): accepted and type checked, so a kube-proxy
# command line works unchanged, and each one given is warned about at start-up.
_UNAPPLIED_FLAGS: tuple[_Flag, ...] = (
    _Flag("iptables-localhost-nodeports", _Type.BOOL, None, "localhost NodePorts (iptables mode)",
          not_applied="pyproxy never serves NodePorts on loopback addresses, as kube-proxy's "
          "nftables mode", field="iptables.localhostNodePorts"),
    _Flag("ipvs-exclude-cidrs", _Type.STRINGS, None, "ipvs cleanup exclusions", not_applied=_IPVS,
          field="ipvs.excludeCIDRs"),
    _Flag("ipvs-min-sync-period", _Type.DURATION, None, "ipvs minSyncPeriod", not_applied=_IPVS),
    _Flag("ipvs-scheduler", _Type.STRING, None, "ipvs scheduler", not_applied=_IPVS,
          field="ipvs.scheduler"),
    _Flag("ipvs-strict-arp", _Type.BOOL, None, "ipvs strict ARP", not_applied=_IPVS,
          field="ipvs.strictARP"),
    _Flag("ipvs-sync-period", _Type.DURATION, None, "ipvs syncPeriod", not_applied=_IPVS),
    _Flag("ipvs-tcp-timeout", _Type.DURATION, None, "ipvs TCP timeout", not_applied=_IPVS,
          field="ipvs.tcpTimeout"),
    _Flag("ipvs-tcpfin-timeout", _Type.DURATION, None, "ipvs TCP FIN timeout", not_applied=_IPVS,
          field="ipvs.tcpFinTimeout"),
    _Flag("ipvs-udp-timeout", _Type.DURATION, None, "ipvs UDP timeout", not_applied=_IPVS,
          field="ipvs.udpTimeout"),
    _Flag("log-flush-frequency", _Type.DURATION, None, "log flush period",
          not_applied="pyproxy does not buffer logs", field="logging.flushFrequency"),
    _Flag("log-json-info-buffer-size", _Type.QUANTITY, None, "klog buffer", not_applied=_KLOG,
          field="logging.options.json.infoBufferSize"),
    _Flag("log-json-split-stream", _Type.BOOL, None, "klog stream split", not_applied=_KLOG,
          field="logging.options.json.splitStream"),
    _Flag("log-text-info-buffer-size", _Type.QUANTITY, None, "klog buffer", not_applied=_KLOG,
          field="logging.options.text.infoBufferSize"),
    _Flag("log-text-split-stream", _Type.BOOL, None, "klog stream split", not_applied=_KLOG,
          field="logging.options.text.splitStream"),
    _Flag("profiling", _Type.BOOL, None, "pprof on /debug/pprof",
          not_applied="pyproxy serves no pprof", field="enableProfiling"),
    _Flag("show-hidden-metrics-for-version", _Type.STRING, None, "hidden metrics",
          not_applied="pyproxy hides no metrics", field="showHiddenMetricsForVersion"),
    _Flag("vmodule", _Type.VMODULE, None, "per-file log verbosity",
          not_applied="per-file verbosity is a klog feature", field="logging.vmodule"),
)
_ACTION_FLAGS: tuple[_Flag, ...] = (
    _Flag("write-config-to", _Type.STRING, None,
          "write the effective configuration (as `pyproxy config view` prints it) to this file "
          "and exit", action=True),
    _Flag("cleanup", _Type.BOOL, None,
          "delete pyproxy's nftables tables (as `pyproxy cleanup`) and exit", action=True),
    _Flag("init-only", _Type.BOOL, None,
          "check the configuration, apply the start-up host settings (conntrack sysctls, "
          "oom_score_adj) and exit", action=True),
)

_FLAGS: tuple[_Flag, ...] = (
    _Flag("config", _Type.STRING, None,
          "KubeProxyConfiguration file (YAML or JSON); flags given explicitly override it"),
    _Flag("proxy-mode", _Type.STRING, None,
          "nftables (or empty); iptables is accepted with a warning: pyproxy runs nftables"),
    *_ACTION_FLAGS,
    *(flag for s in _TABLE for flag in (
        *((_Flag(s.flag, s.type, s.attr, s.flag_help, own=s.own, short=s.short),) if s.flag
          else ()),
        *(_Flag(name, s.type, s.attr, f"as --{s.flag}" if s.flag else s.flag_help)
          for name in s.kube_flags))),
    *_UNAPPLIED_FLAGS,
)

_METAVARS = {
    _Type.STRING: "TEXT", _Type.BOOL: "BOOL", _Type.INT32: "N", _Type.UINT32: "N",
    _Type.NUMBER: "N", _Type.DURATION: "DURATION", _Type.STRINGS: "LIST",
    _Type.GATES: "NAME=BOOL,...", _Type.QUANTITY: "QUANTITY", _Type.VMODULE: "PATTERN=N,...",
}
_FLAG_METAVARS = {"config": "FILE", "snapshot": "FILE", "debug-socket": "PATH",
                  "write-config-to": "FILE"}


def add_flags(parser: argparse.ArgumentParser,
              settings: Sequence[str] | None = None, actions: bool = True) -> None:
    """Add kube-proxy's flags (and pyproxy's own) to `parser`; with `settings`, only the flags
    of those settings and --config (the node options `render`, `apply` and `trace` share with
    `run`); `actions`: with the flags that make `run` do something else and exit. Every
    default is None, so `apply_flags` can tell a flag that was not given from one given its
    default value."""
    kube = parser.add_argument_group(
        "kube-proxy flags", "as kube-proxy's; a flag given overrides the --config file")
    own = parser.add_argument_group("pyproxy flags")
    unapplied = parser.add_argument_group(
        "kube-proxy flags accepted, not applied", "type checked; each one given is warned "
        "about at start-up") if settings is None else None
    for flag in _FLAGS:
        if settings is not None and flag.attr not in settings and flag.name != "config":
            continue
        if flag.action and not (actions and settings is None):
            continue
        names = [f"--{flag.name}", *([flag.short] if flag.short else [])]
        options: dict[str, Any] = {
            "dest": flag.dest, "default": None,
            "metavar": _FLAG_METAVARS.get(flag.name, _METAVARS[flag.type]),
            "help": _flag_help(flag).replace("%", "%%") + (
                "" if flag.not_applied or flag.action else f" (default: {_flag_default(flag)})"),
        }
        if flag.type is _Type.BOOL:
            options.update(nargs="?", const="true")  # `--masquerade-all`, `--masquerade-all=false`
        if settings is not None and flag.attr == "hostname_override":
            options["help"] = "the Node's name, as --node (no default offline)"
        group = unapplied if flag.not_applied and unapplied else own if flag.own else kube
        group.add_argument(*names, **options)


def _flag_help(flag: _Flag) -> str:
    return f"{flag.help}: not applied, {flag.not_applied}" if flag.not_applied else flag.help


@dataclass(frozen=True, slots=True, kw_only=True)
class RunActions:
    """What `pyproxy run` is asked to do instead of running, as kube-proxy's flags ask it."""

    write_config_to: str | None = None
    cleanup: bool = False
    init_only: bool = False


def run_actions(args: argparse.Namespace) -> RunActions:
    """The action flags given in `args`. Raises ConfigError naming a flag with a bad value."""
    found: dict[str, Any] = {}
    for flag in _ACTION_FLAGS:
        raw = getattr(args, flag.dest, None)
        if raw is not None:
            try:
                found[flag.dest] = _from_flag(flag.type, raw)
            except ValueError as err:
                raise ConfigError(f"--{flag.name}: {err}") from None
    return RunActions(**found)


def apply_flags(config: ProxyConfig, args: argparse.Namespace) -> ProxyConfig:
    """`config` with every flag given in `args` (not None) applied, validated again. Raises
    ConfigError with every flag at fault; a kube-proxy flag that changes nothing here adds
    a warning."""
    changes: dict[str, Any] = {}
    problems: list[str] = []
    warnings: list[str] = []
    kept = dict(config.unapplied_fields)
    for flag in _FLAGS:
        raw = getattr(args, flag.dest, None)
        if raw is None:
            continue
        name = f"--{flag.name}"
        if flag.name == "proxy-mode":
            problems += _mode_problems(raw, name)
            if raw == _IPT:
                warnings.append(f"{name}=iptables: pyproxy runs nftables, its only mode")
        if flag.attr is None and not flag.not_applied:
            continue
        try:
            value = _from_flag(flag.type, raw)
            if flag.attr is None:
                warnings.append(f"{name}: accepted, not applied ({flag.not_applied})")
                if flag.field:
                    kept[flag.field] = (format_duration(value) if flag.type is _Type.DURATION
                                        else value)
                continue
            if flag.attr == "feature_gates":
                value = {**config.feature_gates, **value}
            changes[flag.attr] = _setting(flag.attr, value, name)
        except ValueError as err:  # ConfigError is one, and already names the flag
            problems.append(str(err) if isinstance(err, ConfigError) else f"{name}: {err}")
    _follow_bind_family(config, changes)
    resolved = dataclasses.replace(config, **changes,
                                   warnings=config.warnings + tuple(warnings),
                                   unapplied_fields=MappingProxyType(kept))
    problems += _cross_problems(resolved)
    if problems:
        raise ConfigError(*problems)
    return resolved


def _follow_bind_family(config: ProxyConfig, changes: dict[str, Any]) -> None:
    """A new bindAddress of the other family moves the healthz/metrics servers that are still
    at the old family's defaults (as kube-proxy's defaulting would have placed them)."""
    if "bind_address" not in changes:
        return
    before = _default_servers(config.bind_address)
    after = _default_servers(changes["bind_address"])
    for attr, old, new in zip(("healthz_bind_address", "metrics_bind_address"), before, after,
                              strict=True):
        if attr not in changes and getattr(config, attr) == old:
            changes[attr] = new


def from_args(args: argparse.Namespace) -> ProxyConfig:
    """The configuration `pyproxy run` uses: defaults, then the --config file, then flags."""
    path = getattr(args, "config", None)
    return apply_flags(load_config_file(path) if path else ProxyConfig(), args)


# ---------------------------------------------------------------------------------------------
# Reference documentation (docs/configuration.md is this function's output)


def _default_text(attr: str | None) -> str:
    if attr is None:
        return "—"
    if attr in _DEFAULT_TEXT:
        return _DEFAULT_TEXT[attr]
    value = getattr(ProxyConfig(), attr)
    if value == "":
        return "unset"
    if attr.endswith(("_period", "_timeout")):
        return f"`{format_duration(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`[{', '.join(value)}]`"
    if isinstance(value, Mapping):
        return "`{}`"
    return f"`{value}`"


def _flag_default(flag: _Flag) -> str:
    if flag.name == "config":
        return "none"
    if flag.name == "proxy-mode":
        return "nftables"
    return _default_text(flag.attr).replace("`", "")


def _applies(spec: _Field) -> str:
    if spec.path == _MODE:
        return f"checked: {spec.doc}"
    if spec.attr is None:
        return f"ignored: {spec.doc}"
    if spec.section == _NFT:
        return f"when mode is nftables: {spec.doc}"
    if spec.section == _IPT:
        return f"when mode is empty or iptables (kube-proxy's default): {spec.doc}"
    if spec.attr in _NOT_APPLIED:
        return f"accepted, not applied: {spec.doc} ({_NOT_APPLIED[spec.attr]})"
    if spec.partly:
        return f"partly: {spec.doc}"
    return f"yes: {spec.doc}"


def _flag_for(attr: str | None) -> str:
    names = [f"`--{f.name}`" for f in _FLAGS if attr is not None and f.attr == attr]
    return ", ".join(names) or "—"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


_DOC_INTRO = f"""\
# Configuration

<!-- Generated by pyproxy.config.reference_markdown(); regenerate with
     `python -m pyproxy.config > docs/configuration.md`. tests/test_config.py checks it. -->

`pyproxy run` takes kube-proxy's own configuration: `--config FILE` reads a
`{KIND}` (`apiVersion: {API_VERSION}`, YAML or JSON, e.g. the `config.conf` key
of kubeadm's `kube-system/kube-proxy` ConfigMap), and kube-proxy's flag names override it.

- **Layers.** Defaults (kube-proxy's, for nftables mode), then the file, then the flags that are
  given on the command line. In the file a zero value (`""`, `0`, `0s`, `null`) of a field
  kube-proxy defaults means "use the default", as kube-proxy's defaulting does; a flag's value is
  taken as given (`--min-sync-period=0` means no minimum).
- **Mode.** `mode` must be `nftables`, `iptables` or empty; pyproxy runs nftables whatever it
  says (`ipvs` and anything else are refused). As kube-proxy's v1alpha1 conversion, the
  mode-specific settings (masqueradeBit, masqueradeAll, syncPeriod, minSyncPeriod) come from the
  `nftables` section when mode is `nftables`, and from the `iptables` section when mode is
  `iptables` or empty (kube-proxy's default mode; kubeadm v1.37 writes `mode: iptables` into
  its kube-proxy ConfigMap, tests/test_kubeadm.py). `nodePortAddresses` defaults to `[primary]`
  either way.
- **Fields.** Every v1alpha1 field is accepted. Fields that do not apply are type checked, and
  a value that would have changed kube-proxy's behaviour is reported at start-up as a note. A
  field v1alpha1 never had (a typo, or `nftables.skipKernelVersionCheck`, which is an
  environment variable of kube-proxy's, not a field) is ignored with a start-up warning
  naming its path, as kube-proxy's lenient decoding does. A whole ConfigMap given as the file
  is refused with the command that extracts its `config.conf`.
- **Flags.** Every flag of kube-proxy v1.37 is accepted: applied, or type checked and warned
  about at start-up as not applied (the table below says which and why). `--write-config-to
  FILE`, `--cleanup` and `--init-only` do what kube-proxy's do and exit, as `--version` and
  `-h` do.
- **Offline commands.** `render`, `apply` and `trace -f` take `run`'s node options with the
  same names and values (`--hostname-override` or `--node`, `--bind-address`,
  `--cluster-cidr`, `--detect-local-mode`, `--pod-bridge-interface`,
  `--pod-interface-name-prefix`, `--nodeport-addresses` with `primary` and `all`,
  `--masquerade-all`, `--iptables-masquerade-bit`) and `--config`, resolved and checked as
  `run` does; `--node-ip` (at most one per family) replaces the snapshot Node's address of its
  family, the other family keeps the Node's.
- **Checking.** `pyproxy config check [--config FILE] [flags]` reports every problem at once,
  each with its field or flag and the file, then the warnings and the notes `run` would log,
  and what it finds of the API connection (a note: its files may exist only on the node);
  exit code 0 usable, 1 problems, 2 usage. `pyproxy config view [--config FILE] [flags]`
  prints the effective configuration (defaults, file, flags) as a KubeProxyConfiguration
  that `--config` reads back, followed by the flags for what a file cannot say (pyproxy's own
  settings, a disabled server, a zero `--min-sync-period`). Fields accepted and not applied
  are in it as given, from the file or from their kube-proxy flag (`--profiling` as
  `enableProfiling: true`, `--vmodule` as `logging.vmodule`), as kube-proxy's
  `--write-config-to` writes them; the ipvs sync periods' flags set nothing outside ipvs mode.
- **Durations** are Go duration strings: `30s`, `1m0s`, `1h`, `500ms`, `2h30m`.
"""


def _setting_applies(setting: _Setting) -> str:
    if setting.not_applied:
        return f"accepted, not applied: {setting.description} ({setting.not_applied})"
    return f"{'partly' if setting.partly else 'yes'}: {setting.description}"


def _settings_section() -> list[str]:
    lines = ["## Settings", "",
             "One row per setting: the file fields and the flag that set it, its default, what "
             "it does", "and where `pyproxy run` applies it (tests/test_applied_settings.py "
             "shows that each one", "called applied changes what the daemon does).", "",
             _row("setting", "file fields", "flag", "default", "applies", "applied by"),
             _row(*["---"] * 6)]
    for setting in _TABLE:
        fields = ", ".join(f"`{p}`" for p in setting.paths) or "—"
        lines.append(_row(f"`{setting.attr}`", fields, _flag_for(setting.attr),
                          _default_text(setting.attr), _setting_applies(setting),
                          setting.applied_by))
    return [*lines, ""]


def reference_markdown() -> str:
    """docs/configuration.md: every setting, every file field and every flag, with defaults."""
    lines = [_DOC_INTRO, *_settings_section(), f"## File fields (`{KIND}`)", "",
             _row("field", "type", "setting", "flag", "default", "applies"),
             _row(*["---"] * 6),
             _row(f"`{_API_VERSION}`", "string", "—", "—", "—", f"required: `{API_VERSION}`"),
             _row(f"`{_KIND}`", "string", "—", "—", "—", f"required: `{KIND}`")]
    for spec in _FIELDS:
        flags = "`--proxy-mode`" if spec.path == _MODE else _flag_for(spec.attr)
        lines.append(_row(f"`{spec.path}`", spec.type.value,
                          f"`{spec.attr}`" if spec.attr else "—", flags,
                          _default_text(spec.attr), _applies(spec)))
    lines += ["", "## Flags", "",
              "Bool flags take an optional value: `--masquerade-all`, `--masquerade-all=false`.",
              "", _row("flag", "setting", "default", "meaning"), _row(*["---"] * 4)]
    for flag in _FLAGS:
        names = f"`--{flag.name}`" + (f", `{flag.short}`" if flag.short else "")
        meaning = f"pyproxy's own: {flag.help}" if flag.own else _flag_help(flag)
        lines.append(_row(names, f"`{flag.attr}`" if flag.attr else "—",
                          _flag_default(flag), meaning))
    return "\n".join(lines) + "\n"

