"""This node's configuration as the rest of the flow reads it (`NodeConfig`): its name, addresses,
pod CIDRs and how pod traffic is told apart, which addresses serve NodePorts (and loopback
ones, KEP-6032), masquerading. Pure; built by sync/settings.py from the settings and the
Node object, and by the offline commands from their options."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from ipaddress import ip_address, ip_network

from pyproxy.core.model import IPFamily, LocalMode, Node, ip_family


class LocalhostNodePorts(StrEnum):
    """What happens to a connection to a NodePort on a loopback address (127.0.0.0/8, ::1),
    per family, as kube-proxy's nftables mode decides it (KEP-6032, gate
    `KubeProxyNFTablesLocalhostNodePorts`). Loopback addresses cannot be DNATed to another
    host (IPv4 only with `route_localnet`, which opens CVE-2020-8558; IPv6 not at all), so
    TCP goes through a userspace proxy and the rest is rejected."""

    OFF = "off"  # the gate off: no rule (the connection meets whatever listens there)
    # The gate on, no loopback in nodePortAddresses: every protocol rejected and counted.
    REJECT = "reject"
    # The gate on and nodePortAddresses names localhost explicitly (`localhost`, 127.0.0.1/32,
    # ::1/128, any CIDR but 0.0.0.0/0 and ::/0 holding 127.0.0.1 or ::1; `all` does not): TCP
    # through the userspace proxy, UDP and SCTP rejected.
    PROXY = "proxy"


def is_loopback_cidr(entry: str) -> bool:
    """A nodePortAddresses CIDR that turns the localhost proxy on: kube-proxy 1.38's
    ContainsExplicitLoopback, a CIDR holding 127.0.0.1 or ::1 that is not the catch-all
    0.0.0.0/0 or ::/0 (127.0.0.0/8, ::1/128, also 0.0.0.0/1; not 127.0.0.2/32). kube-proxy
    1.37 asked instead whether the CIDR's own address was a loopback one."""
    try:
        net = ip_network(entry, strict=False)
    except ValueError:
        return False
    localhost = ip_address("127.0.0.1" if net.version == 4 else "::1")
    return net.prefixlen > 0 and localhost in net


def select_nodeport_ips(entries: Sequence[str], family: IPFamily, node_ips: Sequence[str],
                        local_ips: Sequence[str]) -> tuple[str, ...] | None:
    """The addresses of `family` accepting NodePorts, as kube-proxy chooses them
    (NodePortAddresses.GetNodeIPs): every one of `local_ips` (the node's interface addresses)
    inside one of the nodePortAddresses CIDRs of the family, `primary` standing for the node
    IP's /32 or /128 (its only meaning in kube-proxy's server.go: matched against the
    interfaces like any CIDR); loopback addresses never (kube-proxy logs and skips them: they
    are the userspace proxy's). The order is `local_ips`'s, each once.

    None, "every local address" (kube-proxy's MatchAll: `fib daddr type local`): `entries`
    empty, a 0.0.0.0/0 or ::/0 of the family, or no CIDR of the family at all (`primary` on a
    node without an IP of it included). A tuple, even empty: exactly those addresses, so CIDRs
    that select no local address give NodePorts on none, as with kube-proxy."""
    if not entries:
        return None
    version = 4 if family is IPFamily.IPv4 else 6
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entry in entries:
        if entry == "primary":
            # server.go leaves out a loopback node IP (kube-proxy's stand-in for none)
            primary = next((ip for ip in node_ips if ip_family(ip) is family), None)
            if primary is not None and not ip_address(primary).is_loopback:
                nets.append(ip_network(primary))
            continue
        net = ip_network(entry, strict=False)
        if net.version == version:
            nets.append(net)
    if not nets or any(net.prefixlen == 0 for net in nets):
        return None
    chosen = (ip_address(ip) for ip in dict.fromkeys(local_ips) if ip_family(ip) is family)
    return tuple(str(ip) for ip in chosen
                 if not ip.is_loopback and any(ip in net for net in nets))


@dataclass(frozen=True)
class NodeConfig:
    """How this node proxies (the parts of kube-proxy's configuration that shape rules)."""

    node_name: str
    node_ips: tuple[str, ...] = ()
    cluster_cidrs: tuple[str, ...] = ()
    local_mode: LocalMode = LocalMode.CLUSTER_CIDR
    # Interface name or prefix for the interface detect-local modes; pod CIDRs for NodeCIDR.
    local_interface: str = ""
    node_cidrs: tuple[str, ...] = ()
    # CIDRs or "primary" (this node's primary addresses); empty: every local address.
    nodeport_addresses: tuple[str, ...] = ("primary",)
    # The node's local addresses (its interfaces', as the kernel lists them) that
    # nodePortAddresses' CIDRs are matched against; None: not known (offline tools given no
    # --node-address, tests), and the node IPs stand in. `ProxyConfig.node_config` keeps only
    # those NodePorts are served on (`nodeport_addresses_of`): another address coming or
    # going changes no rule, and so is no reason for a full sync.
    local_ips: tuple[str, ...] | None = None
    masquerade_bit: int = 14
    masquerade_all: bool = False
    # New connections counted per endpoint in the kernel (metrics, `services -o wide`).
    count_connections: bool = True
    # featureGates KubeProxyNFTablesLocalhostNodePorts (see LocalhostNodePorts). Off here,
    # where tests and offline tools build a NodeConfig; the daemon's default is ProxyConfig's.
    localhost_nodeports_gate: bool = False

    def local_mode_for(self, family: IPFamily) -> LocalMode:
        return self.local_mode if self.local_value(family) else LocalMode.NONE

    def local_value(self, family: IPFamily) -> str:
        if self.local_mode is LocalMode.CLUSTER_CIDR:
            return _first_of(self.cluster_cidrs, family)
        if self.local_mode is LocalMode.NODE_CIDR:
            return _first_of(self.node_cidrs, family)
        if self.local_mode in (LocalMode.BRIDGE_INTERFACE, LocalMode.INTERFACE_NAME_PREFIX):
            return self.local_interface
        return ""

    def nodeport_ips(self, family: IPFamily) -> tuple[str, ...] | None:
        """Node addresses accepting NodePorts, or None for "every local address" (see
        `select_nodeport_ips`)."""
        return select_nodeport_ips(
            self.nodeport_addresses, family, self.node_ips,
            self.node_ips if self.local_ips is None else self.local_ips)

    def nodeport_addresses_of(self, family: IPFamily) -> tuple[str, ...]:
        """The addresses of `family` NodePorts are served on, as far as they are known: those
        nodePortAddresses selects, or for "every local address" every known one (loopback
        aside, which is never a NodePort address of the rules)."""
        selected = self.nodeport_ips(family)
        if selected is not None:
            return selected
        known = self.node_ips if self.local_ips is None else self.local_ips
        return tuple(ip for ip in dict.fromkeys(known)
                     if ip_family(ip) is family and not ip_address(ip).is_loopback)

    @property
    def addresses(self) -> tuple[str, ...]:
        """The node's addresses NodePorts arrive on, as far as they are known: its IPs, then
        the other local addresses NodePorts are served on (conntrack cleanup's "this
        node")."""
        return tuple(dict.fromkeys((*self.node_ips, *(self.local_ips or ()))))

    def health_check_addresses(self) -> tuple[str, ...]:
        """Where healthCheckNodePorts listen: as kube-proxy's service health server, on the
        addresses nodePortAddresses selects; a family served on every local address on its
        node IP (kube-proxy: on every address); a node without IPs on 0.0.0.0."""
        if not self.node_ips:
            return ("0.0.0.0",)
        addresses: list[str] = []
        for family in dict.fromkeys(ip_family(ip) for ip in self.node_ips):
            selected = self.nodeport_ips(family)
            addresses.extend(
                (ip for ip in self.node_ips if ip_family(ip) is family) if selected is None
                else selected)
        return tuple(addresses)

    def nodeports_served(self) -> str:
        """Where NodePorts are served, in words: "192.168.0.5", "every local address", per
        family when there are two."""
        families = tuple(dict.fromkeys(ip_family(ip) for ip in self.node_ips)) or (
            IPFamily.IPv4,)
        served = []
        for family in families:
            ips = self.nodeport_ips(family)
            text = ("every local address" if ips is None else ", ".join(ips) if ips
                    else "no address")
            served.append(text if len(families) == 1 else f"{text} ({family})")
        return "; ".join(served)

    def loopback_cidrs(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(entry for entry in self.nodeport_addresses
                     if is_loopback_cidr(entry) and ip_family(entry) is family)

    def localhost_nodeports(self, family: IPFamily) -> LocalhostNodePorts:
        """kube-proxy's choice for `family` (nftables proxier: localhostNodePortsEnabled and
        useLocalhostNodePortProxy, per family)."""
        if not self.localhost_nodeports_gate:
            return LocalhostNodePorts.OFF
        if self.loopback_cidrs(family):
            return LocalhostNodePorts.PROXY
        return LocalhostNodePorts.REJECT


def unusable_address_warnings(node: Node | None, config: NodeConfig) -> tuple[str, ...]:
    """One warning per address of the Node's status.addresses that does not parse: passed over
    as kube-proxy does (not a reason to lose the Node), so NodePorts are served elsewhere than
    the operator may think; where, from `config` (what the node runs with without it)."""
    if node is None:
        return ()
    return tuple(f"Node {node.name}: {address} is not an IP address: passed over, as kube-proxy "
                 f"does; NodePorts are served on {config.nodeports_served()} instead"
                 for address in node.unusable_addresses)


def _first_of(cidrs: Sequence[str], family: IPFamily) -> str:
    return next((str(ip_network(c, strict=False)) for c in cidrs if ip_family(c) is family), "")
