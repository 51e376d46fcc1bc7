"""The settings table: one row per ProxyConfig setting, and the conversions (with their checks)
from a decoded value to the setting's value.

A row (`Setting`) holds the setting's type, its conversion, what it does, where `pyproxy run`
applies it, the file fields and the flag that set it. The file's fields (config/file.py), the
flags (config/flags.py), `config view` (config/view.py) and docs/configuration.md
(config/reference.py) are all made from `SETTINGS`, so none of them can drift from the others.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from ipaddress import ip_address, ip_network
from types import MappingProxyType
from typing import Any

from pyproxy.config.values import ConfigError, ValueType, format_duration, parse_duration
from pyproxy.core.model import ANNOTATION_OUTLIER_EJECTION, LocalMode
from pyproxy.core.outliers import OutlierPolicy

DEFAULT_BIND_ADDRESS = "0.0.0.0"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
# Interface names go into nft text inside double quotes (`iifname "cbr0"`): nothing that could
# end the string or add a wildcard gets through. 15 = IFNAMSIZ - 1.
INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
NODEPORT_KEYWORDS = ("primary", "localhost", "all")


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


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


def _conntrack_timeout(name: str, sysctl: str, field: str) -> Setting:
    """conntrack_NAME_timeout: the sysctl nf_conntrack_SYSCTL set at start (as kube-proxy
    does; 0s leaves it alone), conntrack.FIELD in the file, --conntrack-SYSCTL."""
    return Setting(f"conntrack_{name}_timeout", ValueType.DURATION, _not_negative_duration,
                   f"nf_conntrack_{sysctl} at start; 0s leaves it alone",
                   applied_by="host.py, at start", paths=(f"conntrack.{field}",),
                   flag=f"conntrack-{sysctl.replace('_', '-')}",
                   flag_help="0 leaves the sysctl alone")


def _identity(value: Any) -> Any:
    return value


_POLICY_FIELDS = {"failures": "failures", "window": "window",
                  "ejection": "base_ejection",
                  "maxEjection": "max_ejection", "maxEjectedPercent": "max_ejected_percent",
                  "replyTimeout": "reply_timeout"}
_POLICY_PERCENTS = ("max_ejected_percent",)


def _outlier_policy(value: str) -> OutlierPolicy:
    """`failures=5,window=10s,ejection=30s,...`: the fields given replace the defaults."""
    given: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, _, text = item.partition("=")
        attr = _POLICY_FIELDS.get(name.strip())
        if attr is None:
            raise ValueError(f"unknown field {name.strip()!r} (known: "
                             f"{', '.join(_POLICY_FIELDS)})")
        text = text.strip()
        if attr == "failures" or attr in _POLICY_PERCENTS:
            if not text.isdigit():
                raise ValueError(f"{name.strip()}: expected a whole number, got {text!r}")
            number = int(text)
            high = 100 if attr in _POLICY_PERCENTS else 1_000_000
            if not 1 <= number <= high:
                raise ValueError(f"{name.strip()}: must be within 1..{high}, got {number}")
            given[attr] = number
        else:
            try:
                given[attr] = _positive_duration(parse_duration(text))
            except ValueError as err:
                raise ValueError(f"{name.strip()}: {err}") from None
    policy = OutlierPolicy(**given)
    if policy.max_ejection < policy.base_ejection:
        raise ValueError("maxEjection must not be shorter than ejection")
    return policy


# ---------------------------------------------------------------------------------------------
# The settings: one row each


@dataclass(frozen=True, slots=True)
class Setting:
    """One ProxyConfig setting and everything said about it: its type, the conversion (with
    its checks) from a decoded value, what it does, where `pyproxy run` applies it, the file
    fields and the flag that set it. The file fields, the flags, the checks and
    docs/configuration.md are all made from these rows."""

    attr: str
    type: ValueType
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


SETTINGS: tuple[Setting, ...] = (
    Setting("hostname_override", ValueType.STRING, _text_or_none,
            "the Node's name; empty: the OS hostname (lowercased)",
            applied_by="run.py: the Node to watch and serve (`ProxyConfig.node_name`)",
            paths=("hostnameOverride",),
            flag="hostname-override", flag_help="the Node's name, instead of the OS hostname",
            default_text="OS hostname, lowercased"),
    Setting("bind_address", ValueType.STRING, _ip,
            "overrides the node's primary IP for its family; no socket is bound to it",
            applied_by="run.py: the node IPs (`ProxyConfig.node_config`)",
            paths=("bindAddress",),
            flag="bind-address", flag_help="overrides the node's primary IP for its family",
            zero_is_unset=True),
    Setting("healthz_bind_address", ValueType.STRING,
            partial(_host_port, default_port=HEALTHZ_PORT),
            "IP:port of /healthz and /livez ([::]:10256 when bindAddress is IPv6); a bare IP "
            "gets port 10256",
            applied_by="run.py: the health server (health.py)",
            paths=("healthzBindAddress",),
            flag="healthz-bind-address",
            flag_help="IP:port of /healthz and /livez; empty disables",
            zero_is_unset=True, default_text=f"`0.0.0.0:{HEALTHZ_PORT}`"),
    Setting("metrics_bind_address", ValueType.STRING,
            partial(_host_port, default_port=METRICS_PORT),
            "IP:port of /metrics ([::1]:10249 when bindAddress is IPv6); a bare IP gets port "
            "10249",
            applied_by="run.py: the metrics server (metrics.py)",
            paths=("metricsBindAddress",),
            flag="metrics-bind-address", flag_help="IP:port of /metrics; empty disables",
            zero_is_unset=True, default_text=f"`127.0.0.1:{METRICS_PORT}`"),
    Setting("bind_address_hard_fail", ValueType.BOOL, _identity,
            "exit if the healthz or metrics server cannot bind",
            applied_by="run.py: a server that cannot bind",
            paths=("bindAddressHardFail",),
            flag="bind-address-hard-fail",
            flag_help="exit if the healthz or metrics server cannot bind"),
    Setting("cluster_cidrs", ValueType.STRING, _cluster_cidrs,
            "pod CIDRs, comma-separated, one per family, for detectLocalMode ClusterCIDR",
            applied_by="`NodeConfig` → pyproxy.render (local traffic)",
            paths=("clusterCIDR",),
            flag="cluster-cidr", flag_help="pod CIDRs, comma-separated, one per family",
            default_text="empty"),
    Setting("detect_local_mode", ValueType.STRING, _local_mode,
            "ClusterCIDR, NodeCIDR (the Node's podCIDRs), BridgeInterface or InterfaceNamePrefix",
            applied_by="`NodeConfig` → pyproxy.render (local traffic)",
            paths=("detectLocalMode",),
            flag="detect-local-mode",
            flag_help="ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix"),
    Setting("bridge_interface", ValueType.STRING, _interface,
            "pod bridge, for detectLocalMode BridgeInterface",
            applied_by="`NodeConfig` → pyproxy.render (local traffic)",
            paths=("detectLocal.bridgeInterface",),
            flag="pod-bridge-interface",
            flag_help="pod bridge, for --detect-local-mode BridgeInterface"),
    Setting("interface_name_prefix", ValueType.STRING, _interface,
            "pod interface name prefix, for detectLocalMode InterfaceNamePrefix",
            applied_by="`NodeConfig` → pyproxy.render (local traffic)",
            paths=("detectLocal.interfaceNamePrefix",),
            flag="pod-interface-name-prefix",
            flag_help="pod interface name prefix, for --detect-local-mode InterfaceNamePrefix"),
    Setting("nodeport_addresses", ValueType.STRINGS, _nodeport_addresses,
            "CIDRs, `primary` (the node's primary IPs), `localhost` (127.0.0.0/8 and ::1/128) "
            "or `all`, in any combination, of node addresses accepting NodePorts (matched "
            "against every address of the node's interfaces, read again every syncPeriod); "
            "localhost (`localhost`, 127.0.0.1/32, ::1/128, any CIDR but 0.0.0.0/0 and ::/0 "
            "holding 127.0.0.1 or ::1) turns on the userspace proxy for TCP NodePorts on it "
            "(featureGates KubeProxyNFTablesLocalhostNodePorts)",
            applied_by="`NodeConfig` → pyproxy.render (NodePort addresses)",
            paths=("nodePortAddresses",),
            flag="nodeport-addresses",
            flag_help="comma-separated CIDRs, primary, localhost or all: node addresses "
            "accepting NodePorts"),
    Setting("masquerade_bit", ValueType.INT32, partial(_in_range, 0, 31),
            "fwmark bit for masquerading, 0..31",
            applied_by="`NodeConfig` → pyproxy.render (the masquerade mark)",
            paths=("iptables.masqueradeBit", "nftables.masqueradeBit"),
            flag_help="fwmark bit for masquerading, 0..31",
            kube_flags=("iptables-masquerade-bit",)),
    Setting("masquerade_all", ValueType.BOOL, _identity,
            "masquerade all ClusterIP traffic",
            applied_by="`NodeConfig` → pyproxy.render (masquerading)",
            paths=("iptables.masqueradeAll", "nftables.masqueradeAll"),
            flag="masquerade-all", flag_help="masquerade all ClusterIP traffic"),
    Setting("sync_period", ValueType.DURATION, _positive_duration,
            "retry delay after a failed sync; health timeout is twice this",
            applied_by="run.py: sync timing (runner.py retries, health.py timeout)",
            paths=("iptables.syncPeriod", "nftables.syncPeriod"),
            flag="sync-period", flag_help="retry delay after a failed sync", own=True,
            kube_flags=("iptables-sync-period",),
            zero_is_unset=True),
    Setting("min_sync_period", ValueType.DURATION, _not_negative_duration,
            "minimum gap between syncs",
            applied_by="run.py: sync timing (runner.py)",
            paths=("iptables.minSyncPeriod", "nftables.minSyncPeriod"),
            flag="min-sync-period", flag_help="minimum gap between syncs", own=True,
            kube_flags=("iptables-min-sync-period",),
            zero_is_unset=True),
    Setting("full_sync_period", ValueType.DURATION, _positive_duration,
            applied_by="run.py: sync timing (sync/node.py)",
            flag="full-sync-period", flag_help="full resync at least this often", own=True),
    Setting("least_connections_interval", ValueType.DURATION, _positive_duration,
            applied_by="run.py: least-connection balancing's feedback (sync/least.py)",
            flag="least-connections-interval",
            flag_help="how often the slots of Services balanced by lc, wlc, sed or nq "
            "follow their connections in flight (conntrack is read then, within 5 % of a "
            "CPU; nothing is read while no Service uses them)", own=True),
    Setting("in_flight_interval", ValueType.DURATION, _not_negative_duration,
            applied_by="run.py: the connections in flight (sync/inflight.py, serve/live.py)",
            flag="in-flight-interval",
            flag_help="read conntrack for the connections in flight per endpoint at most this "
            "often, when a scrape, `pyproxy services -o wide` or a live `explain` asks (reads "
            "take at most 5 % of a CPU whatever this is); 0 never reads", own=True),
    Setting("config_sync_period", ValueType.DURATION, _positive_duration,
            "informer resync period",
            applied_by="—",
            paths=("configSyncPeriod",),
            flag="config-sync-period", flag_help="informer resync period; accepted, not applied",
            zero_is_unset=True,
            not_applied=("pyproxy's watches do not re-deliver objects they already delivered; "
            "kube-proxy's informer resync re-sends its cache to handlers that ignore unchanged "
            "objects")),
    Setting("conntrack_max_per_core", ValueType.INT32, partial(_in_range, 0, 2**31 - 1),
            "at start nf_conntrack_max raised to max(maxPerCore × CPUs, min) (maxPerCore × "
            "CPUs capped at 1,048,576 first; a larger host value is never lowered), and the "
            "conntrack hash size raised to a quarter of it; 0 leaves both alone. Global: set "
            "only from the initial network namespace (elsewhere reported and skipped)",
            applied_by="host.py, at start",
            paths=("conntrack.maxPerCore",),
            flag="conntrack-max-per-core",
            flag_help="nf_conntrack_max per CPU; 0 leaves the limit alone"),
    Setting("conntrack_min", ValueType.INT32, partial(_in_range, 0, 2**31 - 1),
            "lower bound of nf_conntrack_max",
            applied_by="host.py, at start",
            paths=("conntrack.min",),
            flag="conntrack-min", flag_help="lower bound of nf_conntrack_max"),
    _conntrack_timeout("tcp_established", "tcp_timeout_established", "tcpEstablishedTimeout"),
    _conntrack_timeout("tcp_close_wait", "tcp_timeout_close_wait", "tcpCloseWaitTimeout"),
    Setting("conntrack_tcp_be_liberal", ValueType.BOOL, _identity,
            "nf_conntrack_tcp_be_liberal = 1 at start (false leaves it alone)",
            applied_by="host.py, at start",
            paths=("conntrack.tcpBeLiberal",),
            flag="conntrack-tcp-be-liberal", flag_help="set nf_conntrack_tcp_be_liberal"),
    _conntrack_timeout("udp", "udp_timeout", "udpTimeout"),
    _conntrack_timeout("udp_stream", "udp_timeout_stream", "udpStreamTimeout"),
    Setting("fast_failure", ValueType.BOOL, _identity,
            applied_by="run.py: the conntrack cleanup after syncs (sync/conntrack.py, "
            "core/departed.py)",
            flag="fast-failure",
            flag_help="when an endpoint leaves a Service, delete the TCP conntrack entries "
            "of its connections through the Service (not of a terminating endpoint's, nor "
            "of one still listed in any condition), so that a client's next packet is "
            "answered with a reset at once instead of going to the gone address until TCP "
            "gives up; false: kube-proxy's behaviour (UDP only)",
            own=True, default_text="true"),
    Setting("kubeconfig", ValueType.STRING, _text_or_none,
            "kubeconfig file (a token, a `tokenFile` re-read every minute as client-go does, "
            "or a client certificate); empty: the pod's service account, with the server "
            "from KUBERNETES_SERVICE_HOST/PORT",
            applied_by="cluster/apiconnection.py, at start (every file it names is read "
                       "before anything changes)",
            paths=("clientConnection.kubeconfig",),
            flag="kubeconfig", flag_help="kubeconfig file",
            default_text="in-cluster"),
    Setting("master", ValueType.STRING, _text_or_none,
            applied_by="cluster/apiconnection.py, at start",
            flag="master", flag_help="API server URL, overriding the kubeconfig's",
            default_text="from kubeconfig"),
    Setting("qps", ValueType.NUMBER, _not_negative,
            "API client requests per second (a token bucket every request waits on, as "
            "client-go's)",
            applied_by="run.py: the API client's token bucket (ratelimit.py)",
            paths=("clientConnection.qps",),
            flag="kube-api-qps", flag_help="API client requests per second",
            zero_is_unset=True),
    Setting("burst", ValueType.INT32, partial(_in_range, 0, 2**31 - 1),
            "API client requests at once before qps applies",
            applied_by="run.py: the API client's token bucket (ratelimit.py)",
            paths=("clientConnection.burst",),
            flag="kube-api-burst", flag_help="API client burst",
            zero_is_unset=True),
    Setting("content_type", ValueType.STRING, _content_type,
            "what the API server is asked to send: `application/vnd.kubernetes.protobuf` "
            "(kube-proxy's default) on plain watches, where a change is about half its JSON "
            "(docs/fleet.md); lists and streamed lists stay JSON, gzipped, which pyproxy "
            "decodes 3 to 5 times faster; `application/json`: JSON everywhere",
            applied_by="cluster/watch.py: the Accept of each watch",
            paths=("clientConnection.contentType",),
            flag="kube-api-content-type", flag_help="API content type",
            zero_is_unset=True),
    Setting("logging_format", ValueType.STRING, _log_format,
            "on stderr: `text` (key=value lines; aligned and coloured on a terminal) or "
            "`json` (JSON lines), whatever stderr is",
            applied_by="logs.py",
            paths=("logging.format",),
            flag="logging-format", flag_help="text or json"),
    Setting("verbosity", ValueType.UINT32, _identity,
            "log verbosity (as klog's -v)",
            applied_by="logs.py",
            paths=("logging.verbosity",),
            flag="v", flag_help="log verbosity", short="-v"),
    Setting("oom_score_adj", ValueType.INT32, partial(_in_range, -1000, 1000),
            "written to /proc/self/oom_score_adj at start",
            applied_by="host.py, at start",
            paths=("oomScoreAdj",),
            flag="oom-score-adj", flag_help="the process's oom_score_adj"),
    Setting("feature_gates", ValueType.GATES, _gates,
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
    Setting("outlier_ejection", ValueType.BOOL, _identity,
            "outlier ejection (docs/services.md) for every TCP Service but those annotated "
            f"`{ANNOTATION_OUTLIER_EJECTION}: \"false\"`; off: only for those annotated "
            "`\"true\"`. An endpoint whose connection attempts from this node fail (no reply "
            "to the SYN, or a reset) is taken out of new connections for a while",
            applied_by="run.py: the conntrack event reader and the selections "
            "(sync/outliers.py)",
            flag="outlier-ejection", flag_help="outlier ejection for every TCP Service "
            "(else only for Services annotated to have it)", own=True),
    Setting("outlier_ejection_policy", ValueType.STRING, _outlier_policy,
            "when an endpoint is ejected and for how long, as `field=value,...` (the fields "
            "not given keep their default): `failures=5` failed attempts in a row within "
            "`window=10s`; ejected for "
            "`ejection=30s`, doubled each time in a row up to `maxEjection=5m`; at most "
            "`maxEjectedPercent=50` of a service port's endpoints; an attempt unanswered for "
            "`replyTimeout=1s` failed",
            applied_by="run.py: the outlier tracker and the conntrack event reader "
            "(sync/outliers.py)",
            flag="outlier-ejection-policy", flag_help="failures=N,window=D,"
            "ejection=D,maxEjection=D,maxEjectedPercent=P,replyTimeout=D",
            own=True, default_text="`failures=5,window=10s,ejection=30s,"
            "maxEjection=5m,maxEjectedPercent=50,replyTimeout=1s`"),
    Setting("debug_socket", ValueType.STRING, _text_or_none,
            applied_by="run.py: the debug server (debug.py, live.py)",
            flag="debug-socket", flag_help="unix socket for pyproxy debug; empty disables",
            own=True),
    Setting("snapshot", ValueType.STRING, _text_or_none,
            applied_by="run.py: the snapshot source (sources.py)",
            flag="snapshot",
            flag_help="proxy the cluster state in this snapshot file instead of watching the API "
            "server", own=True,
            default_text="unset: watch the API server"),

)
_CONVERT: Mapping[str, Callable[[Any], Any]] = {s.attr: s.convert for s in SETTINGS}
DEFAULT_TEXT = {s.attr: s.default_text for s in SETTINGS if s.default_text}
# Settings accepted (type checked, kept) that change nothing, and why.
NOT_APPLIED = {s.attr: s.not_applied for s in SETTINGS if s.not_applied}


def setting_value(attr: str, value: Any, name: str) -> Any:
    try:
        return _CONVERT[attr](value)
    except ValueError as err:
        raise ConfigError(f"{name}: {err}") from None
