"""What the sync layer takes from the configuration: this node's configuration, kept in step
with its Node object, the families it programs, and the clocks of its syncs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from pyproxy.config import ProxyConfig
from pyproxy.core.model import IPFamily, Node, ip_family, override_ips
from pyproxy.core.nodeconfig import NodeConfig

log = structlog.get_logger(__name__)


def families_of(node_ips: Sequence[str]) -> tuple[IPFamily, ...]:
    """The families a node with these IPs programs (IPv4 when it has none)."""
    found = tuple(dict.fromkeys(ip_family(ip) for ip in node_ips))
    return found or (IPFamily.IPv4,)


def node_config_for(config: ProxyConfig, node_name: str, node: Node | None,
                    interface_ips: Sequence[str],
                    local_ips: Sequence[str] | None = None) -> NodeConfig:
    """This node's configuration, as kube-proxy derives it: per family the IP its Node object
    gives (status.addresses: InternalIP first, then ExternalIP), bindAddress replacing the one
    of its family; its podCIDRs for detect-local mode NodeCIDR; of its interfaces' addresses
    (`local_ips`, None: not known), those NodePorts are served on. A family the Node has no
    address of takes the primary interface address (kube-proxy would assume loopback)."""
    host_ips = node.host_ips if node is not None else ()
    pod_cidrs = node.pod_cidrs if node is not None else ()
    return config.node_config(node_name, override_ips(host_ips, interface_ips), pod_cidrs,
                              local_ips)


@dataclass
class LocalAddresses:
    """The node's interface addresses, read from the kernel again at most every `interval`
    seconds (syncPeriod): a read costs pyroute2 a few milliseconds, too much for every sync.
    kube-proxy reads them at its full syncs (at start, after a failure, then hourly); a sync
    runs at least every syncPeriod, so an address that comes or goes is followed within about
    that. A failed read keeps the addresses read last; without `read` they are not known
    (None), and the node IPs stand in."""

    read: Callable[[], tuple[str, ...]] | None
    interval: float
    clock: Callable[[], float] = time.monotonic
    current: tuple[str, ...] | None = None
    _read_at: float | None = None

    def __call__(self) -> tuple[str, ...] | None:
        """The addresses (None: never read)."""
        now = self.clock()
        if self.read is None or (self._read_at is not None and now - self._read_at < self.interval):
            return self.current
        self._read_at = now
        try:
            self.current = self.read()
        except Exception as err:  # pyroute2's NetlinkError is no OSError
            log.warning("local_addresses_not_read", error=str(err), kept=self.current)
        return self.current


@dataclass
class NodeTracker:
    """Keeps the node's configuration in step with its Node object. Called first in every
    sync (under the sync lock): the first sync comes only after the Node's initial list, so
    no rule is ever written with IPs the Node object contradicts. kube-proxy exits when its
    node's IPs change and is restarted; here the new configuration is returned to the
    proxier, which makes the sync a full one that re-renders everything with the new IPs. So
    does a change of the local addresses NodePorts are served on (`local_ips`, see
    `LocalAddresses`)."""

    config: ProxyConfig
    node_name: str
    interface_ips: tuple[str, ...]
    current: NodeConfig
    node: Callable[[], Node | None]
    local_ips: Callable[[], tuple[str, ...] | None] = lambda: None
    # The Node's addresses that do not parse, logged when they change (not every sync).
    unusable: tuple[str, ...] = ()

    def __call__(self) -> NodeConfig | None:
        """The new configuration, or None when it did not change."""
        node = self.node()
        wanted = node_config_for(self.config, self.node_name, node, self.interface_ips,
                                 self.local_ips())
        unusable = node.unusable_addresses if node is not None else ()
        if unusable != self.unusable:
            for address in unusable:  # kube-proxy passes them over without a word
                log.warning("node_address_passed_over", node=self.node_name, address=address,
                            nodeports_served=wanted.nodeports_served())
            self.unusable = unusable
        if wanted == self.current:
            return None
        log.info("node_config_from_node", node_ips=list(wanted.node_ips),
                 was=list(self.current.node_ips), pod_cidrs=list(wanted.node_cidrs),
                 nodeport_addresses=list(wanted.addresses),
                 nodeport_addresses_were=list(self.current.addresses))
        self.current = wanted
        return wanted


@dataclass(frozen=True)
class SyncTiming:
    """The daemon's clocks, from syncPeriod, minSyncPeriod and pyproxy's fullSyncPeriod."""

    min_interval: float  # shortest gap from the end of one sync to the next (batching)
    retry_interval: float  # after a failed sync
    max_interval: float  # a sync at least this often: it checks the table for tampering
    health_timeout: float  # a queued change older than this makes /healthz fail
    full_sync_period: float
    verify_period: float  # how often a sync compares the table's structure with ours


def sync_timing(config: ProxyConfig) -> SyncTiming:
    return SyncTiming(
        min_interval=config.min_sync_period, retry_interval=config.sync_period,
        max_interval=config.sync_period, health_timeout=2 * config.sync_period,
        full_sync_period=config.full_sync_period, verify_period=config.sync_period)
