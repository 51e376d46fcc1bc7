"""Topology against the real EndpointSlice controller: the hints it writes for
trafficDistribution and topology-mode Auto, and where each node's pyproxy sends traffic."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from testkit.controlplane import (
    ControlPlane,
    Daemon,
    Kube,
    apply_manifests,
    service_account_token,
    start_pyproxy,
    wait_for,
)
from testkit.fixtures import requires_netns
from testkit.netlab import Lab, Netns, tally

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]


# -- three nodes in two zones, a routed pod network --------------------------------------------
#
#   [fabric] 192.168.61.(4i+1)/30 ── .(4i+2)/30 [node-X]  (i = 1, 2, 3 for node-a, -b, -c)
#            routes 10.244.(16i).0/20 via node-X        each pod on node-X: 10.244.(16i+j).2/24,
#                                                       j = 0 the client pod, 1 and 2 backends
# Every node runs its own pyproxy against the control plane; a client pod on each node connects
# to the Services, and the backend that answers names the pod the node's rules chose.

ZONES = {"node-a": "zone-1", "node-b": "zone-1", "node-c": "zone-2"}
TOPOLOGY_SERVICES = {  # name → (ClusterIP, spec or metadata fields that pick the topology)
    "zonal": ("10.96.1.1", {"spec": {"trafficDistribution": "PreferSameZone"}}),
    "nodal": ("10.96.1.2", {"spec": {"trafficDistribution": "PreferSameNode"}}),
    "auto": ("10.96.1.3", {"metadata": {"annotations": {
        "service.kubernetes.io/topology-mode": "Auto"}}}),
}


@dataclass
class ZonedCluster:
    lab: Lab
    kube: Kube
    clients: dict[str, Netns]  # node → its client pod
    daemons: dict[str, Daemon]

    def landing(self, node: str, ip: str, count: int = 40) -> set[str]:
        return set(tally(self.lab.connect(self.clients[node], ip, 80, count=count,
                                          parallel=10, timeout=0.5)))


def pod_name(node: str, j: int) -> str:
    return f"{node[-1]}{j}"  # a1, a2 on node-a…


@pytest.fixture(scope="module")
def zoned(control_plane: ControlPlane) -> Iterator[ZonedCluster]:
    kube = Kube(control_plane.admin_client())
    apply_manifests(kube)
    kube.namespace("topo")
    token = service_account_token(kube)
    with Lab() as lab:
        fabric = lab.add_ns("fabric", router=True)
        clients, backends, daemons = {}, [], {}
        for i, node in enumerate(ZONES, start=1):
            ns = lab.add_ns(node, router=True)
            node_ip = f"192.168.61.{4 * i + 2}"
            lab.link(fabric, ns, [f"192.168.61.{4 * i + 1}/30"], [f"{node_ip}/30"])
            lab.add_route(fabric, f"10.244.{16 * i}.0/20", via=node_ip)
            lab.add_route(ns, "default", via=f"192.168.61.{4 * i + 1}")
            control_plane.attach(ns)
            for j in range(3):
                pod = lab.add_ns(f"pod-{node[-1]}{j}")
                net = f"10.244.{16 * i + j}"
                lab.link(pod, ns, [f"{net}.2/24"], [f"{net}.1/24"])
                lab.add_route(pod, "default", via=f"{net}.1")
                if j == 0:
                    clients[node] = pod
                else:
                    backends.append((pod, pod_name(node, j), node, f"{net}.2"))
            kube.node(node, (node_ip,), zone=ZONES[node], region="region-1")
        lab.start_backends([(pod, name) for pod, name, _, _ in backends], tcp_ports=(8080,))
        for _pod, name, node, ip in backends:
            kube.pod("topo", name, node, (ip,), {"app": "zoned"})
        for name, (ip, fields) in TOPOLOGY_SERVICES.items():
            service: dict[str, Any] = {
                "metadata": {"name": name, **fields.get("metadata", {})},
                "spec": {"selector": {"app": "zoned"}, "clusterIP": ip,
                         "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}],
                         **fields.get("spec", {})}}
            kube.core.create_namespaced_service("topo", service)
        kubeconfig = control_plane.node_kubeconfig(lab.workdir / "pyproxy.kubeconfig", token)
        for i, node in enumerate(ZONES, start=1):
            daemons[node] = start_pyproxy(lab, lab.ns(node), kubeconfig, node, "--bind-address",
                                          f"192.168.61.{4 * i + 2}", name=f"pyproxy-{node}")
        try:
            yield ZonedCluster(lab, kube, clients, daemons)
        finally:
            for daemon in daemons.values():
                lab.stop_process(daemon.proc)
            kube.core.delete_namespace("topo")
            for node in ZONES:
                kube.core.delete_node(node)


def hints(kube: Kube, service: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """address → (zones, nodes) the controller's hints name."""
    out = {}
    for piece in kube.slices("topo", service):
        for endpoint in piece.endpoints or []:
            h = endpoint.hints
            zones = tuple(z.name for z in (h.for_zones or [])) if h else ()
            nodes = tuple(n.name for n in (h.for_nodes or [])) if h and h.for_nodes else ()
            out[endpoint.addresses[0]] = (zones, nodes)
    return out


def test_the_controllers_hints_decide_where_each_node_sends(zoned: ZonedCluster) -> None:
    zone_1, zone_2 = {"a1", "a2", "b1", "b2"}, {"c1", "c2"}
    expected = {
        "zonal": {"node-a": zone_1, "node-b": zone_1, "node-c": zone_2},
        "nodal": {"node-a": {"a1", "a2"}, "node-b": {"b1", "b2"}, "node-c": zone_2},
        # Auto: 2 of 3 nodes' CPU is in zone-1, and so are 4 of the 6 endpoints: every
        # endpoint gets its own zone's hint.
        "auto": {"node-a": zone_1, "node-b": zone_1, "node-c": zone_2},
    }
    for service, (ip, _) in TOPOLOGY_SERVICES.items():
        wait_for(lambda s=service: len(hints(zoned.kube, s)) == 6
                 and all(z for z, _ in hints(zoned.kube, s).values()), 30,
                 f"the controller's hints on {service}")
        got = hints(zoned.kube, service)
        for zones, nodes in got.values():
            assert len(zones) == 1, got
            assert bool(nodes) == (service == "nodal"), got
        for node, want in expected[service].items():
            wait_for(lambda n=node, i=ip, w=want: zoned.landing(n, i) == w, 20,
                     f"{service} from {node} lands on {sorted(want)}", interval=0.3)

    # The only zone-2 endpoint left unready: PreferSameZone on node-c has no endpoint of its
    # zone any more, so the controller's hints stop covering it and node-c uses all.
    for name in ("c1", "c2"):
        zoned.kube.set_ready("topo", name, False)
    wait_for(lambda: zoned.landing("node-c", TOPOLOGY_SERVICES["zonal"][0]) == zone_1, 30,
             "node-c falls back to zone-1's endpoints")
