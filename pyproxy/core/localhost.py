"""Localhost NodePorts (KEP-6032, kube-proxy's `KubeProxyNFTablesLocalhostNodePorts`): what
the userspace proxy on 127.0.0.1 / ::1 listens for and where it sends connections. Pure; the
listeners are `pyproxy/serve/localhost.py`.

nftables cannot serve a NodePort on a loopback address: DNAT of a packet to 127.0.0.1 towards
another host needs `route_localnet` for IPv4 (CVE-2020-8558) and is impossible for IPv6. So,
as kube-proxy 1.37's nftables mode does behind the gate, a TCP listener per NodePort accepts
the connection in userspace and opens one of its own to an endpoint. UDP and SCTP are not
carried (the KEP's non-goal): the ruleset rejects them and counts it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pyproxy.core.model import Protocol, ServicePortName, TrafficPolicy
from pyproxy.core.topology import PortSelection


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePortSpec:
    """One listener: its NodePort, the endpoints (IP, port) it picks from at random, and the
    ClientIP affinity window in seconds (0: none). Every connection through it comes from
    loopback, so affinity pins all of them to one endpoint while they keep coming, as
    kube-proxy's proxy does."""

    name: ServicePortName
    node_port: int
    endpoints: tuple[tuple[str, int], ...]
    affinity_timeout: int = 0


def nodeport_specs(selections: Iterable[PortSelection]) -> tuple[NodePortSpec, ...]:
    """A spec per TCP NodePort with endpoints to send to, in NodePort order. The endpoints
    are those a connection from outside would get: the node-local ones with
    `externalTrafficPolicy: Local` (none: no listener, the connection is refused, as the KEP
    says), the cluster list otherwise, topology and traffic distribution already applied.
    pyproxy's balancing annotations are not applied here: the proxy picks at random."""
    specs = []
    for ps in selections:
        port = ps.port
        if not port.node_port or port.protocol is not Protocol.TCP:
            continue
        local = port.external_policy is TrafficPolicy.LOCAL
        endpoints = (ps.selection.local if local else ps.selection.cluster) or ()
        if not endpoints:
            continue
        specs.append(NodePortSpec(
            name=port.name, node_port=port.node_port,
            endpoints=tuple(dict.fromkeys((ep.ip, ep.port) for ep in endpoints)),
            affinity_timeout=port.affinity_timeout if port.session_affinity else 0))
    return tuple(sorted(specs, key=lambda s: s.node_port))
