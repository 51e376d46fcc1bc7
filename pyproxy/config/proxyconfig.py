"""The resolved configuration: `ProxyConfig`, everything `pyproxy run` is configured with
(kube-proxy's defaults for nftables mode), what it makes of a node (`node_config`), and the
checks across settings that the file and the flags share (`cross_problems`).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network
from types import MappingProxyType
from typing import Any

from pyproxy.config.settings import (
    DEFAULT_BIND_ADDRESS,
    HEALTHZ_PORT,
    METRICS_PORT,
    NOT_APPLIED,
    LogFormat,
)
from pyproxy.config.values import ConfigError, format_duration
from pyproxy.core.model import IPFamily, LocalMode, override_ips
from pyproxy.core.nodeconfig import NodeConfig, is_loopback_cidr
from pyproxy.core.outliers import OutlierPolicy

# KEP-6032: localhost NodePorts in nftables mode (pyproxy/core/model.py, LocalhostNodePorts).
# Alpha and off in kube-proxy 1.37; on here, as the KEP's beta for 1.38 has it
# (kubernetes/enhancements#6378). `false` restores the 1.37 default.
LOCALHOST_NODEPORTS_GATE = "KubeProxyNFTablesLocalhostNodePorts"
LOCALHOST_NODEPORTS_DEFAULT = True
# What `localhost` stands for (kube-proxy's expandNodePortAddressKeywords: both families,
# whatever the node has).
LOCALHOST_CIDRS = ("127.0.0.0/8", "::1/128")
# kube-proxy's modes a configuration can name that pyproxy runs (as nftables, its only mode).
IPTABLES, NFTABLES = "iptables", "nftables"
# What pyproxy adds to an iptables-mode configuration's nodePortAddresses where that mode
# served NodePorts on 127.0.0.1: its localhost proxy's (IPv4; iptables mode never served ::1).
IPTABLES_LOCALHOST = "127.0.0.0/8"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """Everything `pyproxy run` is configured with. Defaults are kube-proxy's for nftables
    mode; durations are in seconds. Build it with `load_config` / `apply_flags`, which validate;
    constructing it directly (tests, tools) skips validation. What each setting does, its
    file fields, its flag and where it is applied: its row in the settings table
    (`pyproxy.config.settings.SETTINGS`), in this order."""

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
    least_connections_interval: float = 2.0
    in_flight_interval: float = 10.0
    config_sync_period: float = 900.0

    conntrack_max_per_core: int = 32768
    conntrack_min: int = 131072
    conntrack_tcp_established_timeout: float = 86400.0
    conntrack_tcp_close_wait_timeout: float = 3600.0
    conntrack_tcp_be_liberal: bool = False
    conntrack_udp_timeout: float = 0.0
    conntrack_udp_stream_timeout: float = 0.0
    fast_failure: bool = True

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

    outlier_ejection: bool = False
    outlier_ejection_policy: OutlierPolicy = field(default_factory=OutlierPolicy)
    debug_socket: str | None = "/run/pyproxy/pyproxy.sock"
    snapshot: str | None = None

    kube_proxy_mode: str = NFTABLES
    """The mode kube-proxy would run this configuration in: `iptables` for a file whose mode
    is iptables or empty (kubeadm's). pyproxy runs nftables either way; with `iptables` it
    takes that mode's defaults where it can (the `iptables` section, NodePorts on every local
    address and 127.0.0.1) and `changes` says what still differs."""
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
    def changes(self) -> tuple[str, ...]:
        """What this configuration does under pyproxy that it did not under the kube-proxy
        mode it names (`kube_proxy_mode`), each with what keeps the old behaviour, where
        anything does. `config check` prints them before the switch; `run` logs them."""
        return tuple(_mode_changes(self))

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
                    node_cidrs: Sequence[str] = (),
                    local_ips: Sequence[str] | None = None) -> NodeConfig:
        """What the renderer needs for this node. node_ips: the node's IPs, at most one per
        family, primary first (bindAddress overrides the one of its family); node_cidrs: its
        spec.podCIDRs (used by detect-local mode NodeCIDR); local_ips: every address of its
        interfaces, which nodePortAddresses selects from (None: not known, the node IPs
        stand in). Of those, NodeConfig keeps the ones NodePorts are served on."""
        interface = {
            LocalMode.BRIDGE_INTERFACE: self.bridge_interface,
            LocalMode.INTERFACE_NAME_PREFIX: self.interface_name_prefix,
        }.get(self.detect_local_mode, "")
        node = NodeConfig(
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
        if local_ips is None:
            return node
        known = dataclasses.replace(node, local_ips=tuple(local_ips))
        return dataclasses.replace(node, local_ips=tuple(
            ip for family in IPFamily for ip in known.nodeport_addresses_of(family)))

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
               f"applied ({NOT_APPLIED['config_sync_period']})")
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
    entries = config.nodeport_addresses
    loopback = [e for e in entries if e == "localhost" or is_loopback_cidr(e)]
    if "all" in entries and len(entries) > 1 + len(loopback):
        # Loopback entries do change something beside `all`: they turn the localhost proxy on.
        but = " but loopback ones (the localhost proxy's)" if loopback else ""
        yield f"nodePortAddresses includes 'all': the other entries{but} change nothing"


# ---------------------------------------------------------------------------------------------
# kube-proxy's iptables mode: where it served NodePorts, and what differs under pyproxy


def iptables_serves_localhost(entries: Sequence[str], localhost_nodeports: bool) -> bool:
    """Whether kube-proxy's iptables mode served NodePorts on 127.0.0.0/8 with these
    nodePortAddresses (keywords as kube-proxy expands them; none: unset): iptables.
    localhostNodePorts on and an IPv4 CIDR holding 127.0.0.0 or a loopback one, where no IPv4
    CIDR at all means 0.0.0.0/0 (kube-proxy v1.37, NewNodePortAddresses and the proxier)."""
    if not localhost_nodeports:
        return False
    v4_seen = False
    for entry in entries:
        if entry == "primary":  # the node's IPv4 /32: an IPv4 CIDR, never loopback
            v4_seen = True
            continue
        cidr = {"localhost": IPTABLES_LOCALHOST, "all": "0.0.0.0/0"}.get(entry, entry)
        net = ip_network(cidr, strict=False)
        if net.version == 4:
            v4_seen = True
            if net.network_address.is_loopback or _LOOPBACK_START in net:
                return True
    return not v4_seen


_LOOPBACK_START = ip_address("127.0.0.0")  # kube-proxy's ipv4LoopbackStart


def iptables_nodeport_addresses(entries: Sequence[str], localhost_nodeports: bool,
                                ) -> tuple[str, ...]:
    """nodePortAddresses that serve NodePorts where kube-proxy's iptables mode did, for a
    configuration naming that mode: `entries` (`all` when unset, iptables mode's default:
    every local address) plus 127.0.0.0/8, the localhost proxy's, where iptables mode served
    127.0.0.1 and no IPv4 loopback CIDR is there yet. Entries without an IPv4 CIDR meant
    every local IPv4 address to iptables mode: 0.0.0.0/0 keeps that beside 127.0.0.0/8 (which
    alone would select no IPv4 address but loopback)."""
    chosen = tuple(entries) or ("all",)
    has_loopback = any(e == "localhost" or (is_loopback_cidr(e) and ":" not in e)
                       for e in chosen)
    if not iptables_serves_localhost(chosen, localhost_nodeports) or has_loopback:
        return chosen
    has_ipv4 = any(":" not in e for e in chosen)  # keywords count: each has an IPv4 side
    return (*chosen, *(() if has_ipv4 else ("0.0.0.0/0",)), IPTABLES_LOCALHOST)


def _mode_changes(config: ProxyConfig) -> Iterator[str]:
    if config.kube_proxy_mode != IPTABLES:
        return
    localhost = config.unapplied_fields.get("iptables.localhostNodePorts", True) is not False
    if not iptables_serves_localhost(config.nodeport_addresses, localhost):
        return
    proxied = config.localhost_nodeports_gate and any(
        e == "localhost" or (is_loopback_cidr(e) and ":" not in e)
        for e in config.nodeport_addresses)
    why = ("kube-proxy's iptables mode DNATed every protocol there with route_localnet=1, "
           "which nftables never sets (CVE-2020-8558)")
    if not proxied:
        wanted = iptables_nodeport_addresses(config.nodeport_addresses, True)
        keep = [f"nodePortAddresses: [{', '.join(wanted)}]"]
        if not config.localhost_nodeports_gate:
            keep.append("featureGates KubeProxyNFTablesLocalhostNodePorts: true")
        yield (f"NodePorts on 127.0.0.1 are rejected, every protocol ({why}); TCP ones are kept "
               f"by {' and '.join(keep)}: pyproxy's localhost proxy serves them")
        return
    yield (f"NodePorts on 127.0.0.0/8: TCP ones are served on 127.0.0.1 only, by pyproxy's "
           f"localhost proxy (a connection through it ends when pyproxy stops or restarts; "
           f"other 127.x addresses refuse), and UDP and SCTP ones are rejected and counted "
           f"(kubeproxy_nftables_localhost_nodeport_rejected_packets_total): {why}. Nothing "
           f"keeps those; kube-proxy's "
           f"kubeproxy_iptables_localhost_nodeports_accepted_packets_total (where nfacct "
           f"works) shows whether anything on the node used them")


def default_servers(bind_address: str) -> tuple[str, str]:
    """healthz and metrics defaults: kube-proxy serves on IPv6 when bindAddress is IPv6."""
    if ip_address(bind_address).version == 6:
        return f"[::]:{HEALTHZ_PORT}", f"[::1]:{METRICS_PORT}"
    return f"0.0.0.0:{HEALTHZ_PORT}", f"127.0.0.1:{METRICS_PORT}"


# ---------------------------------------------------------------------------------------------
# Validation across settings (file and flags alike)


def cross_problems(config: ProxyConfig) -> list[str]:
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
