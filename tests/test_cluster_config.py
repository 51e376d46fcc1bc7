"""The real cluster's node configuration (testkit/cluster.py), without bringing one up: the
control plane's own node registers tainted at the control plane's address, and every node's
containerd reads registry hosts from its certs.d (where registry.k8s.io's mirror is named)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from testkit.cluster import (
    CONTROL_PLANE_ROLE,
    CP_IP,
    NodeSpec,
    containerd_config,
    kubelet_config,
)


def test_the_control_plane_node_registers_tainted_at_the_control_planes_address(
        tmp_path: Path) -> None:
    worker = NodeSpec("node-a", 1, "zone-a")
    control_plane = NodeSpec("control-plane", 0, "", address=CP_IP,
                             taints=(f"{CONTROL_PLANE_ROLE}:NoSchedule",))
    assert (worker.ip, worker.pod_cidr) == ("172.18.0.11", "10.244.1.0/24")
    assert (control_plane.ip, control_plane.pod_cidr) == (CP_IP, "10.244.0.0/24")

    def config(spec: NodeSpec) -> dict[str, object]:
        node = SimpleNamespace(
            spec=spec, dir=tmp_path, socket=tmp_path / "containerd.sock",
            cgroup=SimpleNamespace(path="/x"),
            cluster=SimpleNamespace(plane=SimpleNamespace(pki=SimpleNamespace(ca=tmp_path))))
        return kubelet_config(node, tmp_path / "s.crt", tmp_path / "s.key")  # type: ignore[arg-type]

    assert config(worker)["registerWithTaints"] == []
    assert config(control_plane)["registerWithTaints"] == [
        {"key": CONTROL_PLANE_ROLE, "effect": "NoSchedule"}]
    assert config(control_plane)["address"] == CP_IP


def test_containerd_reads_registry_hosts_from_the_nodes_certs_d(tmp_path: Path) -> None:
    text = containerd_config(tmp_path, "registry.k8s.io/pause:3.10.2")
    assert f"config_path = \"{tmp_path / 'containerd' / 'certs.d'}\"" in text
