"""cluster: a real multi-node Kubernetes cluster on one machine, built from upstream's modules.

The control plane of testkit/controlplane.py (etcd, kube-apiserver, kube-controller-manager with
its default controllers, kube-scheduler) plus worker nodes, each a real kubelet with containerd
2.x and runc, in namespaces of its own, as kind runs a node per container:

::

     [outside] 172.19.0.2 --- .1 [net] br0 172.18.0.1/24 ---+--- .2 [cp] API 192.168.199.1:6443
     (clients, LB prober)                                     +--- .11 [node-a] pods 10.244.1.0/24
                                                              +--- .12 [node-b] pods 10.244.2.0/24

- A node is a network namespace (its address on the bridge, a default route via ``net``, a route
  to the API server's address via ``cp`` and one to every other node's pod CIDR via that node:
  what kindnet programs; ``net`` and ``cp`` route each pod CIDR to its node, as a cloud's VPC
  does) and a mount namespace held by a sleeping process, entered by containerd
  and the kubelet with nsenter (`ip netns exec` would hide the cgroup mounts). In the mount
  namespace the node's own folders cover /run/netns, /var/log/pods, /var/log/containers and
  /run/pyproxy (the DaemonSet's hostPath), so nodes share nothing but the kernel; the kubelet's
  kernel tunables (/proc/sys/vm/overcommit_memory, kernel/panic, ...) are covered by files holding
  the values it wants, so it never changes the host's (the tests never touch global sysctls).
- Pods get a veth each from the CNI ``ptp`` plugin (Debian's containernetworking-plugins) and an
  address from the node's pod CIDR (10.244.N.0/24, written into Node.spec.podCIDR by the harness,
  there is no node IPAM controller): point-to-point links make pod -> Service -> pod on the same
  node cross the node's routing and netfilter hooks without br_netfilter.
- cgroups (v1 here): every node's kubelet has a cgroupRoot of its own below this process's
  memory cgroup; containerd and the kubelet run in its ``system`` child, so stopping a node is
  killing what its cgroups hold (shims and containers too) and removing them.
- Should this process die without tearing down (SIGKILL), nothing of the cluster runs on: the
  control plane, containerd and the kubelet have a parent-death signal, and the process holding
  a node's mount namespace (`hold_node`) sees its stdin end and kills what the node's cgroups
  hold (containerd's shims and the containers outlive containerd). The next run sweeps the
  namespaces and the cgroups.
- Images come from testkit/images.py (built here, no registry) and are imported into every
  node's containerd before its kubelet starts.

`RealCluster.up()` brings the whole thing up: control plane, nodes, CoreDNS as kube-dns at
10.96.0.10 (its Go module, an image built here); `deploy_pyproxy()` applies manifests/ with only
the image and the API server's address filled in (a kustomize overlay, as an operator would).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testkit.controlplane import (
    API_IP,
    REPO,
    ControlPlane,
    Kube,
    issue_client,
    issue_server,
    kubeconfig,
    wait_for,
    write_kubeconfig,
)
from testkit.interrupts import (
    SIGPIPE_CODE,
    OutputClosed,
    hold_off_signals,
    output_closed,
    say,
    stop_on_signals,
    stopped_by,
)
from testkit.netlab import _NS_RE, NS_PREFIX, Lab, Netns, _die_with_parent, _pid_alive

FABRIC = ipaddress.ip_network("172.18.0.0/24")
GATEWAY = "172.18.0.1"
CP_IP = "172.18.0.2"
OUTSIDE_NET = ("172.19.0.1", "172.19.0.2")  # net's end, the outside client's
DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN = Path("/usr/lib/cni")
RUNC = shutil.which("runc") or "/usr/sbin/runc"
NODE_BINARIES = ("kubelet", "kubectl", "kube-scheduler", "containerd", "containerd-shim-runc-v2",
                 "ctr")
# What the kubelet's container manager wants of the kernel (setupKernelTunables): it writes
# them when they differ, and they are global, so the node's mount namespace shows these values.
KUBELET_TUNABLES = {
    "vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
    "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
CGROUP_FS = Path("/sys/fs/cgroup")
NODE_READY_TIMEOUT = 120.0
# The control plane's own node (RealCluster's control_plane_node), as kind's and kubeadm's:
# tainted, so only what tolerates every taint (the proxy's DaemonSet) runs there.
CONTROL_PLANE_NODE = "control-plane"
CONTROL_PLANE_ROLE = "node-role.kubernetes.io/control-plane"
# The mirror of registry.k8s.io (RealCluster's mirror): distribution's registry on the fabric's
# gateway, holding the images built here; every node's containerd resolves registry.k8s.io
# there first, so a pull with policy Always finds what the node already has.
MIRROR = f"{GATEWAY}:5000"
MIRRORED = "registry.k8s.io"


class ClusterError(RuntimeError):
    pass


# -- cgroups ----------------------------------------------------------------------------------


def _hierarchies() -> list[Path]:
    """The mounted v1 hierarchies (cpu and cpuacct are separate here; symlinks skipped)."""
    return sorted(p for p in CGROUP_FS.iterdir()
                  if p.is_dir() and not p.is_symlink() and p.name != "unified")


def _own_memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.rstrip("/")
    return ""


@dataclass
class Cgroup:
    """One path in every v1 hierarchy; `create` makes what is missing (cpuset levels get their
    parent's cpus and mems, else nothing could join them) and `remove` deletes what it made."""

    path: str  # e.g. /process_api/abc/ppx-1-1-node-a
    made: list[Path] = field(default_factory=list)

    def create(self) -> Cgroup:
        for hierarchy in _hierarchies():
            current = hierarchy
            for part in self.path.strip("/").split("/"):
                parent, current = current, current / part
                if current.exists():
                    continue
                current.mkdir()
                self.made.append(current)
                if hierarchy.name == "cpuset":
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (current / knob).write_text((parent / knob).read_text())
        return self

    def child(self, name: str) -> Cgroup:
        return Cgroup(f"{self.path}/{name}")

    def procs_file_args(self) -> list[str]:
        return [str(h / self.path.strip("/") / "cgroup.procs") for h in _hierarchies()]

    def pids(self) -> set[int]:
        """Every process below this cgroup (the pids hierarchy has them all)."""
        found: set[int] = set()
        base = CGROUP_FS / "pids" / self.path.strip("/")
        if base.exists():
            for procs in base.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in procs.read_text().split())
        return found

    def kill_all(self, timeout: float = 20.0) -> None:
        """SIGKILL everything below (frozen first, so nothing forks meanwhile), bounded."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise ClusterError(f"processes left in {self.path}: {sorted(pids)}")
            time.sleep(0.1)

    def remove(self) -> None:
        """Remove every cgroup below and at this path that exists (the kubelet's own too, and
        what runc made in the empty cgroup2 hierarchy of this hybrid setup)."""
        for hierarchy in [*_hierarchies(), CGROUP_FS / "unified"]:
            base = hierarchy / self.path.strip("/")
            if not base.exists():
                continue
            for directory in [*sorted((p for p in base.rglob("*") if p.is_dir()),
                                      key=lambda p: len(p.parts), reverse=True), base]:
                with contextlib.suppress(OSError):
                    directory.rmdir()
        for directory in reversed(self.made):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self.made.clear()

    def destroy(self, timeout: float = 5.0) -> None:
        """Everything below killed, then the cgroups removed. A killed task leaves its cgroup
        only once reaped (init reaps an orphan at once; a parent may take a moment): rmdir
        answers EBUSY until then."""
        self.kill_all()
        deadline = time.monotonic() + timeout
        while True:
            self.remove()
            if (not (CGROUP_FS / "pids" / self.path.strip("/")).exists()
                    or time.monotonic() > deadline):
                break
            time.sleep(0.05)


def sweep_stale_cgroups(base: str, fixed_prefix: str | None = None) -> list[str]:
    """The node cgroups of runs whose process died without tearing down (SIGKILL, a timeout's
    SIGTERM): their containers (a pause process, say) live on in them, reparented to init.
    Only ``ppx-<pid>-...`` cgroups of a dead pid are touched, as netlab's `sweep_stale` does
    for namespaces, so a concurrent run's nodes are left alone."""
    swept = []
    parent = CGROUP_FS / "pids" / base.strip("/")
    for path in sorted(parent.iterdir()) if parent.exists() else []:
        # A fixed-prefix lab (make cluster-up's) holds its lock: whatever has its prefix is a
        # killed run's.
        mine = fixed_prefix is not None and path.name.startswith(fixed_prefix)
        match = _NS_RE.match(path.name)
        if not mine and (match is None or _pid_alive(int(match.group(1)))):
            continue
        Cgroup(f"{base}/{path.name}").destroy()
        swept.append(path.name)
    return swept


# -- nodes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    name: str
    index: int  # 1, 2, ...: the pod CIDR 10.244.<index>.0/24, address .10+index
    zone: str  # "": no zone label
    address: str = ""  # its address on the bridge, when not .10+index (the control plane's)
    taints: tuple[str, ...] = ()  # key:effect, registered by its kubelet

    @property
    def ip(self) -> str:
        return self.address or str(FABRIC.network_address + 10 + self.index)

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index}.0/24"


class RealNode:
    """A node: network + mount namespaces, containerd, a kubelet. ``ns``: an existing network
    namespace to be the node's (the control plane's, for its node), else a new one."""

    def __init__(self, cluster: RealCluster, spec: NodeSpec, ns: Netns | None = None) -> None:
        self.cluster, self.spec = cluster, spec  # made and started from the main thread
        self.lab = cluster.lab
        self.dir = self.lab.workdir / "nodes" / spec.name
        self.dir.mkdir(parents=True)
        self.ns: Netns = ns if ns is not None else self.lab.add_ns(spec.name, router=True)
        self.cgroup = Cgroup(f"{cluster.cgroup_base}/{self.lab.prefix}{spec.name}").create()
        self.system = self.cgroup.child("system").create()
        self.holder: subprocess.Popen[str] | None = None
        self.containerd: subprocess.Popen[str] | None = None
        self.kubelet: subprocess.Popen[str] | None = None
        self.socket = self.dir / "containerd" / "containerd.sock"
        self._logs: list[Any] = []

    @property
    def name(self) -> str:
        return self.spec.name

    # -- namespaces ---------------------------------------------------------------------

    def _enter(self) -> list[str]:
        """nsenter into the node's network and mount namespaces, into its system cgroup."""
        assert self.holder is not None
        return ["nsenter", f"--net=/run/netns/{self.ns.full}", "-t", str(self.holder.pid),
                "--mount", "--", "sh", "-c",
                'for p in $CGROUP_PROCS; do echo $$ > "$p"; done; exec "$@"', "cgroup"]

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """A command in the node (its namespaces and system cgroup)."""
        env = {**os.environ, "CGROUP_PROCS": " ".join(self.system.procs_file_args())}
        out = subprocess.run([*self._enter(), *argv], capture_output=True, text=True,
                             timeout=timeout, check=False, env=env, input=input)
        if check and out.returncode != 0:
            raise ClusterError(f"{self.name}: {' '.join(argv)} failed ({out.returncode}): "
                               f"{out.stderr.strip()[-2000:]}")
        return out

    def _popen(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[str]:
        log = open(self.dir / log_name, "a")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        env = {**os.environ, "CGROUP_PROCS": " ".join(self.system.procs_file_args())}
        # SIGKILL should this process die (SIGKILLed, say): the node's daemons go with it
        # (their shims and containers are the holder's to kill, see _start_holder).
        return subprocess.Popen([*self._enter(), *argv], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)

    def _start_holder(self) -> None:
        """The mount namespace: private copies of the paths nodes must not share. Its process
        (`hold_node`) also kills what the node's cgroups hold should this process die without
        tearing down: containerd's shims and the containers outlive containerd."""
        log = open(self.dir / "holder.log", "a")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        self.holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.ns.full}", "--", "unshare", "--mount",
             "--propagation", "slave", "--", sys.executable, "-c",
             "import sys; from testkit.cluster import hold_node; hold_node(sys.argv[1])",
             self.cgroup.path],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            start_new_session=True, text=True)
        for target in ("/run/netns", "/var/log/pods", "/var/log/containers", "/run/pyproxy"):
            source = self.dir / "host" / target.strip("/").replace("/", "-")
            source.mkdir(parents=True, exist_ok=True)
            Path(target).mkdir(parents=True, exist_ok=True)
            self._mount(["--bind", str(source), target])
        for tunable, value in KUBELET_TUNABLES.items():
            fake = self.dir / "host" / "sysctl" / tunable.replace("/", "-")
            fake.parent.mkdir(parents=True, exist_ok=True)
            fake.write_text(value + "\n")
            self._mount(["--bind", str(fake), f"/proc/sys/{tunable}"])

    def _mount(self, args: list[str]) -> None:
        assert self.holder is not None
        deadline = time.monotonic() + 10
        while True:  # the holder may not have unshared yet
            ns = os.readlink(f"/proc/{self.holder.pid}/ns/mnt")
            if ns != os.readlink("/proc/self/ns/mnt"):
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.name}: mount namespace not made")
            time.sleep(0.02)
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "--mount", "--", "mount",
                        *args], check=True, capture_output=True, timeout=10)

    # -- containerd and the kubelet -----------------------------------------------------

    def write_config(self) -> None:
        c = self.dir / "containerd"
        (c / "root").mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        (c / "config.toml").write_text(containerd_config(self.dir, self.cluster.images_pause))
        if self.cluster.mirror:
            hosts = c / "certs.d" / MIRRORED / "hosts.toml"
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(f'server = "https://{MIRRORED}"\n\n[host."http://{MIRROR}"]\n'
                             '  capabilities = ["pull", "resolve"]\n')
        (self.dir / "cni" / "net.d" / "10-ptp.conflist").write_text(
            json.dumps(cni_config(self.spec.pod_cidr, self.dir / "cni" / "ipam"), indent=1))
        (self.dir / "resolv.conf").write_text(f"nameserver {GATEWAY}\n")
        pki = self.cluster.plane.pki
        cert, key = issue_client(pki, f"kubelet-{self.name}",
                                 f"/O=system:nodes/CN=system:node:{self.name}")
        serving, serving_key = issue_server(pki, f"kubelet-serving-{self.name}", [self.spec.ip])
        write_kubeconfig(self.dir / "kubelet.kubeconfig",
                         kubeconfig(f"https://{API_IP}:6443", pki.ca, cert=cert, key=key))
        (self.dir / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config(
            self, serving, serving_key)))

    def start_containerd(self) -> None:
        self.containerd = self._popen([str(self.cluster.bin / "containerd"), "--config",
                                       str(self.dir / "containerd" / "config.toml")],
                                      "containerd.log")
        wait_for(lambda: self.ctr("version", timeout=5).returncode == 0, 30,
                 f"{self.name}: containerd answering")

    def ctr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.cluster.bin / "ctr"), "--address", str(self.socket),
                         "--namespace", "k8s.io", *args], check=False, timeout=timeout)

    def import_images(self, archives: Sequence[Path]) -> None:
        for archive in archives:
            out = self.ctr("images", "import", "--no-unpack=false", str(archive), timeout=300)
            if out.returncode != 0:
                raise ClusterError(f"{self.name}: importing {archive}: {out.stderr.strip()}")

    def start_kubelet(self) -> None:
        labels = ([f"--node-labels=topology.kubernetes.io/zone={self.spec.zone}"]
                  if self.spec.zone else [])
        self.kubelet = self._popen([
            str(self.cluster.bin / "kubelet"), f"--config={self.dir / 'kubelet.yaml'}",
            f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
            f"--hostname-override={self.name}", f"--node-ip={self.spec.ip}",
            f"--root-dir={self.dir / 'kubelet'}", *labels, "-v=1",
        ], "kubelet.log")

    def start(self, archives: Sequence[Path]) -> None:
        self._start_holder()
        self.write_config()
        self.start_containerd()
        self.import_images(archives)
        self.start_kubelet()

    def stop(self) -> None:
        """Everything of the node dies at once (a power cut): kubelet, containerd, shims,
        containers; then its cgroups and its mount namespace go."""
        self.cgroup.kill_all()
        for proc in (self.kubelet, self.containerd):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        self.kubelet = self.containerd = None
        if self.holder is not None:
            self.holder.kill()  # before its stdin ends, which would have it destroy the cgroups
            self.holder.wait(5)
            if self.holder.stdin is not None:
                self.holder.stdin.close()
            self.holder = None
        for log in self._logs:
            log.close()
        self._logs.clear()

    def reboot(self) -> None:
        """A node reboot: every process gone, the network namespace's ruleset and conntrack
        table empty, /run (containerd's state, the pods' network namespaces) gone, then
        containerd and the kubelet start again with no proxy rules present. The images stay
        (they are on disk), as do the kubelet's and containerd's folders."""
        self.stop()
        self.lab.run(self.ns, ["nft", "flush", "ruleset"])
        self.lab.run(self.ns, ["conntrack", "-F"], check=False)
        for volatile in ("containerd/state", "runc", "host/run-netns", "host/run-pyproxy"):
            shutil.rmtree(self.dir / volatile, ignore_errors=True)
        self.cgroup = Cgroup(self.cgroup.path).create()
        self.system = self.cgroup.child("system").create()
        self._start_holder()
        self.start_containerd()
        self.start_kubelet()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        self.cgroup.remove()
        self.system.remove()


def hold_node(cgroup: str) -> None:
    """A node's holder (`RealNode._start_holder`): sleeps in the node's mount namespace until
    its stdin ends. A teardown SIGKILLs it first; stdin ends without that when the harness
    died (SIGKILLed, say): then everything below the node's cgroup is killed and the cgroups
    removed, as a teardown would (the namespaces stay for the next run's sweep)."""
    sys.stdin.read()
    Cgroup(cgroup).destroy()


def containerd_config(node_dir: Path, pause_image: str) -> str:
    c = node_dir / "containerd"
    return f"""version = 3
root = "{c / 'root'}"
state = "{c / 'state'}"

[grpc]
  address = "{c / 'containerd.sock'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause_image}"
  # Registry hosts (hosts.toml): registry.k8s.io's mirror when the cluster has one.
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{c / 'certs.d'}"

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # The CRI gives every sandbox oom_score_adj -998; this VM refuses a negative value
  # (real-node-facts.md), so runc would fail: clamp to what the process may set.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{node_dir / 'runc'}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{node_dir / 'cni' / 'net.d'}"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"

[plugins.'io.containerd.nri.v1.nri']
  disable = true
"""


def cni_config(pod_cidr: str, ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0", "name": "pods",
        "plugins": [
            {"type": "ptp", "ipMasq": False, "mtu": 1500,
             "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                      "ranges": [[{"subnet": pod_cidr}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(node: RealNode, serving: Path, serving_key: Path) -> dict[str, Any]:
    pki = node.cluster.plane.pki
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # cgroup v1 on these machines (real-node-facts.md).
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": node.cgroup.path,
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "address": node.spec.ip, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "tlsCertFile": str(serving), "tlsPrivateKeyFile": str(serving_key),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(pki.ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [DNS_IP], "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(node.dir / "resolv.conf"),
        "podLogsDir": "/var/log/pods",
        "failSwapOn": False, "serializeImagePulls": False,
        "staticPodPath": "",
        # The host's disk and memory are shared by every node: never evict for them, never
        # collect images (they cannot be pulled back).
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%",
                         "imagefs.available": "0%", "nodefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "nodeStatusUpdateFrequency": "4s", "syncFrequency": "10s",
        "fileCheckFrequency": "5s", "maxPods": 60,
        "registerWithTaints": [{"key": key, "effect": effect} for key, _, effect
                               in (taint.rpartition(":") for taint in node.spec.taints)],
    }


# -- the cluster ------------------------------------------------------------------------------


@dataclass
class RealCluster:
    lab: Lab
    bin: Path
    node_count: int = 2
    plane: ControlPlane = field(init=False)
    nodes: list[RealNode] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)  # testkit.images.ImageArchive
    images_pause: str = ""
    pyproxy_image: str = ""
    up_seconds: float = 0.0
    cgroup_base: str = field(default_factory=_own_memory_cgroup)
    # The control plane's namespace a node too (a kubelet and containerd there), so that the
    # proxy's DaemonSet programs it and kube-apiserver reaches Services (webhooks, aggregated
    # APIs) at their ClusterIP through the proxy under test, as on kind's control-plane node.
    control_plane_node: bool = False
    control_plane: RealNode | None = None
    # A mirror of registry.k8s.io serving the images built here (MIRROR), for the tests that
    # pull with policy Always (no registry answers on this machine otherwise).
    mirror: bool = False
    net: Netns = field(init=False)
    outside: Netns = field(init=False)

    # -- bring-up -----------------------------------------------------------------------

    def start(self, with_pyproxy: bool = True) -> RealCluster:
        """Everything up; with pyproxy's DaemonSet Ready (else no proxy runs yet)."""
        from image.build import PYPROXY

        started = time.monotonic()
        self.up()
        if with_pyproxy:
            self.deploy_pyproxy(PYPROXY)
            self.rollout("daemonset", "pyproxy")
            # CoreDNS reads the API through the `kubernetes` ClusterIP: Ready once a proxy runs.
            self.rollout("deployment", "coredns")
        self.up_seconds = time.monotonic() - started
        return self

    def up(self) -> RealCluster:
        from testkit import images as built

        fixed = None if self.lab.prefix.startswith(NS_PREFIX) else self.lab.prefix
        sweep_stale_cgroups(self.cgroup_base, fixed)

        self.images = built.ensure_images()
        self.images_pause = built.PAUSE
        self._fabric()
        if self.mirror:
            self.start_mirror()
        # Detached: a Ctrl-C at the terminal reaches this process only, which tears down in
        # order, and the control plane dies with this process should it be SIGKILLed.
        self.plane = ControlPlane(self.lab, self.bin, controllers=("*",),
                                  controller_args=("--allocate-node-cidrs=false",),
                                  detach=True)
        self._join(self.plane.ns, CP_IP)
        # Outside the nodes (a test runner, a client) the API server is reachable too.
        self.lab.add_route(self.net, f"{API_IP}/32", via=CP_IP)
        self.plane.start()
        self.plane.start_scheduler()
        specs = [NodeSpec(f"node-{chr(ord('a') + i)}", i + 1, f"zone-{'ab'[i % 2]}")
                 for i in range(self.node_count)]
        for spec in specs:
            self.add_node(spec)
        if self.mirror:
            self.fill_mirror(self.nodes[0])
        if self.control_plane_node:
            self.add_control_plane_node()
        self.wait_nodes_ready()
        self.deploy_coredns()
        return self

    def _fabric(self) -> None:
        self.net = self.lab.add_ns("net", router=True)
        self.lab.ip(self.net, "link", "add", "br0", "type", "bridge")
        self.lab.ip(self.net, "addr", "add", f"{GATEWAY}/24", "dev", "br0")
        self.lab.ip(self.net, "link", "set", "br0", "up")
        self.outside = self.lab.add_ns("outside")
        self.lab.link(self.net, self.outside, [f"{OUTSIDE_NET[0]}/24"], [f"{OUTSIDE_NET[1]}/24"],
                      if_b="eth0")
        self.lab.add_route(self.outside, "default", via=OUTSIDE_NET[0])

    def start_mirror(self) -> None:
        """distribution's registry (make k8s builds it) in ``net``, at the gateway's address
        every node reaches, storing in the lab's folder."""
        folder = self.lab.workdir / "mirror"
        folder.mkdir()
        config = folder / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(folder / "storage")}},
            "http": {"addr": MIRROR},
        }))
        # No OpenTelemetry exporter (it would post traces to localhost:4318 every few s).
        proc = self.lab.popen(self.net, [str(self.bin / "registry"), "serve", str(config)],
                              log_name="mirror.log", detach=True,
                              env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
        wait_for(lambda: proc.poll() is None and self.lab.run(
            self.net, ["curl", "-sf", "-o", "/dev/null", f"http://{MIRROR}/v2/"],
            check=False).returncode == 0, 30, f"the registry answering (log: "
            f"{self.lab.workdir / 'mirror.log'})", interval=0.2)

    def fill_mirror(self, node: RealNode) -> None:
        """Every registry.k8s.io image built here, pushed to the mirror from a node's
        containerd (blobs the mirror has are skipped: the agnhost-based images share theirs)."""
        for archive in self.images:
            if not archive.name.startswith(f"{MIRRORED}/"):
                continue
            remote = f"{MIRROR}/{archive.name.removeprefix(MIRRORED + '/')}"
            out = node.ctr("images", "push", "--plain-http", remote, archive.name)
            if out.returncode != 0:
                raise ClusterError(f"pushing {archive.name} to the mirror: "
                                   f"{out.stderr.strip()[-1000:]}")

    def _join(self, ns: Netns, ip: str) -> None:
        """A namespace on the bridge, with its default route via net."""
        link = self.lab.link(self.net, ns, [], [f"{ip}/24"], if_b="eth0")
        self.lab.ip(self.net, "link", "set", link.if_a, "master", "br0")
        self.lab.add_route(ns, "default", via=GATEWAY)

    def add_node(self, spec: NodeSpec) -> RealNode:
        node = RealNode(self, spec)
        self.nodes.append(node)
        self._join(node.ns, spec.ip)
        self.lab.add_route(node.ns, f"{API_IP}/32", via=CP_IP)
        # The fabric routes pod addresses (as a cloud's VPC routes do): the API server answers
        # a pod that reached it through the `kubernetes` ClusterIP (CoreDNS does) unmasqueraded.
        for ns in (self.net, self.plane.ns):
            self.lab.add_route(ns, spec.pod_cidr, via=spec.ip)
        for other in self.nodes:
            if other is not node:
                self.lab.add_route(node.ns, other.spec.pod_cidr, via=other.spec.ip)
                self.lab.add_route(other.ns, spec.pod_cidr, via=spec.ip)
        node.start([archive.path for archive in self.images])
        wait_for(lambda: self._node_exists(spec.name), NODE_READY_TIMEOUT,
                 f"{spec.name} registered")
        self.kube.core.patch_node(spec.name, {"spec": {"podCIDR": spec.pod_cidr,
                                                         "podCIDRs": [spec.pod_cidr]}})
        return node

    def add_control_plane_node(self) -> RealNode:
        """The control plane's namespace as a node, after the workers: a kubelet there with
        the control plane's address, tainted NoSchedule and labelled with its role (as kubeadm
        does), holding only the images of what runs there (the proxies' DaemonSets, which
        tolerate every taint). Its pod CIDR is 10.244.0.0/24, routed by the fabric and every
        node as a worker's; the control plane already routes every worker's pod CIDR, so the
        traffic the proxy there DNATs to a pod reaches it."""
        from image.build import PYPROXY
        from testkit import images as built

        spec = NodeSpec(CONTROL_PLANE_NODE, 0, "", address=CP_IP,
                        taints=(f"{CONTROL_PLANE_ROLE}:NoSchedule",))
        node = RealNode(self, spec, ns=self.plane.ns)
        self.control_plane = node
        self.lab.add_route(self.net, spec.pod_cidr, via=spec.ip)
        for worker in self.nodes:
            self.lab.add_route(worker.ns, spec.pod_cidr, via=spec.ip)
        wanted = {built.PAUSE, PYPROXY, built.KUBE_PROXY}
        node.start([archive.path for archive in self.images if archive.name in wanted])
        wait_for(lambda: self._node_exists(spec.name), NODE_READY_TIMEOUT,
                 f"{spec.name} registered")
        self.kube.core.patch_node(spec.name, {
            "metadata": {"labels": {CONTROL_PLANE_ROLE: ""}},
            "spec": {"podCIDR": spec.pod_cidr, "podCIDRs": [spec.pod_cidr]}})
        return node

    def _node_exists(self, name: str) -> bool:
        return any(n.metadata.name == name for n in self.kube.core.list_node().items)

    def wait_nodes_ready(self, timeout: float = NODE_READY_TIMEOUT) -> None:
        def ready() -> bool:
            nodes = self.kube.core.list_node().items
            count = len(self.nodes) + (self.control_plane is not None)
            return len(nodes) >= count and all(
                any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                for n in nodes)
        wait_for(ready, timeout, "every node Ready")

    @property
    def kube(self) -> Kube:
        if not hasattr(self, "_kube"):
            self._kube = Kube(self.plane.admin_client())
        return self._kube

    # -- kubectl ------------------------------------------------------------------------

    def admin_kubeconfig(self) -> Path:
        """For kubectl in this (root) namespace: through the control plane's forwarder."""
        path = self.lab.workdir / "admin.kubeconfig"
        if not path.exists():
            write_kubeconfig(path, kubeconfig(self.plane.url, self.plane.pki.ca,
                                              cert=self.plane.pki.admin,
                                              key=self.plane.pki.admin_key))
        return path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([str(self.bin / "kubectl"), f"--kubeconfig={self.admin_kubeconfig()}",
                              *args], input=input, capture_output=True, text=True,
                             timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
        return out

    # -- add-ons ------------------------------------------------------------------------

    def deploy_coredns(self) -> None:
        from testkit import images as built

        text = (Path(__file__).parent / "cluster_manifests" / "coredns.yaml").read_text()
        self.kubectl("apply", "-f", "-", input=text.replace("COREDNS_IMAGE", built.COREDNS)
                     .replace("DNS_IP", DNS_IP))

    def deploy_pyproxy(self, image: str, extra_config: dict[str, Any] | None = None) -> None:
        """manifests/ as shipped, through a kustomize overlay that fills in the image and the
        API server's real address (the ConfigMap's placeholders), as docs/deploying.md says."""
        self.deploy_manifests("pyproxy-overlay", image, ["base"], [  # manifests/kustomization
            {"target": {"kind": "ConfigMap", "name": "pyproxy"},
             "patch": yaml.safe_dump([
                 {"op": "replace", "path": "/data/apiServerHost", "value": API_IP},
                 {"op": "replace", "path": "/data/apiServerPort", "value": "6443"}])}])

    def deploy_manifests(self, overlay_name: str, image: str, resources: list[str],
                        patches: list[dict[str, Any]] | None = None) -> None:
        """`resources` of manifests/ (as base/...) applied through a kustomize overlay that
        fills in pyproxy's image (and applies `patches`): the image becomes the deployed one."""
        overlay = self.lab.workdir / overlay_name
        overlay.mkdir(exist_ok=True)
        name, _, tag = image.rpartition(":")
        shutil.copytree(REPO / "manifests", overlay / "base", dirs_exist_ok=True)
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": resources,
            "images": [{"name": "ghcr.io/pyproxy/pyproxy", "newName": name, "newTag": tag}],
            **({"patches": patches} if patches else {})}))
        rendered = self.kubectl("kustomize", str(overlay)).stdout
        self.kubectl("apply", "-f", "-", input=rendered)
        self.pyproxy_image = image

    def retag_pyproxy(self, tag: str) -> str:
        """The deployed image under another tag on every node (a new release, as far as the
        kubelet can tell: a rolling update to it restarts every pod)."""
        name = f"{self.pyproxy_image.rpartition(':')[0]}:{tag}"
        for node in self.nodes:
            out = node.ctr("images", "tag", "--force", self.pyproxy_image, name)
            if out.returncode != 0:
                raise ClusterError(f"{node.name}: ctr images tag: {out.stderr.strip()}")
        return name

    def rollout(self, kind: str, name: str, namespace: str = "kube-system",
                timeout: float = 180.0) -> None:
        self.kubectl("-n", namespace, "rollout", "status", f"{kind}/{name}",
                     f"--timeout={int(timeout)}s", timeout=timeout + 10)

    def close(self) -> None:
        if self.control_plane is not None:
            self.control_plane.close()
        for node in reversed(self.nodes):
            node.close()


def node_tables(node: Any) -> str:
    """`FAMILY NAME` of each nftables table in a node's namespace, space-separated."""
    return " ".join(line.split(None, 1)[1] for line in
                    node.run(["nft", "list", "tables"]).stdout.splitlines() if line.strip())


def kube_proxy_manifest(mode: str = "nftables") -> str:
    """testkit/cluster_manifests/kube-proxy.yaml in `mode`: for iptables, the ConfigMap's
    config.conf says `mode: iptables` and has an `iptables` section in place of the
    `nftables` one, as kubeadm v1.37 writes it (tests/data/kubeadm-kube-proxy-configmap.yaml:
    `localhostNodePorts: null`, kube-proxy's default true)."""
    text = (Path(__file__).resolve().parent / "cluster_manifests" / "kube-proxy.yaml").read_text()
    if mode == "nftables":
        return text
    if mode != "iptables":
        raise ValueError(f"kube-proxy mode {mode!r}: nftables or iptables")
    for old, new in (("    mode: nftables\n", "    mode: iptables\n"),
                     ("    nftables:\n", "    iptables:\n      localhostNodePorts: null\n")):
        if old not in text:
            raise ClusterError(f"kube-proxy.yaml: no {old.strip()!r} to change")
        text = text.replace(old, new)
    return text


def kube_proxy_synced(node: Any, mode: str = "nftables") -> bool:
    """Whether kube-proxy has written its rules on a node: its table (nftables mode), or its
    KUBE-SERVICES chain ending with the NodePorts rule (iptables mode, iptables-nft)."""
    if mode == "nftables":
        return "kube-proxy" in node_tables(node)
    out = node.run(["iptables", "-w", "5", "-t", "nat", "-S", "KUBE-SERVICES"], check=False)
    return "service nodeports" in out.stdout


def deploy_kube_proxy(cluster: RealCluster, mode: str = "nftables") -> None:
    """kube-proxy as kubeadm deploys it (its ConfigMap with config.conf and kubeconfig.conf,
    privileged DaemonSet), nftables mode (or iptables: iptables-nft, the image's Debian
    iptables), the image built here: the other proxy of the drills and of the conformance
    runs."""
    from testkit import images as built

    text = kube_proxy_manifest(mode)
    cluster.kubectl("apply", "-f", "-", input=text.replace("KUBE_PROXY_IMAGE", built.KUBE_PROXY)
                    .replace("API_SERVER", f"https://{API_IP}:6443"))
    cluster.rollout("daemonset", "kube-proxy")
    wait_for(lambda: all(kube_proxy_synced(n, mode) for n in cluster.nodes), 120,
             f"kube-proxy's rules ({mode} mode) on every node")


@contextlib.contextmanager
def running_cluster(nodes: int = 2, *, with_pyproxy: bool = True, prefix: str | None = None,
                    before_teardown: Callable[[], None] | None = None,
                    control_plane_node: bool = False,
                    mirror: bool = False) -> Iterator[RealCluster]:
    """A cluster for a test, a drill or `make cluster`, torn down on the way out, also when
    it failed to come up half-way (a node's processes live in its cgroups, not in the lab).
    ``before_teardown`` runs first on the way out (`make cluster`: signals held off);
    ``control_plane_node``: the control plane's namespace is a node too; ``mirror``: a mirror
    of registry.k8s.io (RealCluster's)."""
    from testkit.controlplane import binaries_dir

    with Lab(prefix=prefix) as lab:
        cluster = RealCluster(lab, binaries_dir(), nodes,
                              control_plane_node=control_plane_node, mirror=mirror)
        try:
            yield cluster.start(with_pyproxy)
        finally:
            if before_teardown is not None:
                before_teardown()
            cluster.close()
            with contextlib.suppress(AttributeError):  # failed before the control plane
                cluster.plane.stop()


# -- workloads and probes --------------------------------------------------------------------


def netexec(name: str, namespace: str, *, replicas: int = 1, node: str | None = None,
            labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Deployment of agnhost's netexec (what upstream's e2e tests serve from): HTTP on 8080,
    /hostname answers the pod's name, /dial?host=H&port=P&request=hostname dials from the pod
    (its resolver is the pod's, so a name goes through the cluster's DNS)."""
    from testkit import images as built

    labels = labels or {"app": name}
    spec: dict[str, Any] = {
        "containers": [{
            "name": "netexec", "image": built.AGNHOST, "imagePullPolicy": "Never",
            # Serving on for a few seconds after SIGTERM, as a well-behaved server does (a
            # preStop hook's job elsewhere): a pod being deleted keeps answering until every
            # node has dropped it, so a failure the probes count is the proxy's.
            "args": ["netexec", "--http-port=8080", "--udp-port=8081", "--delay-shutdown=8"],
            "ports": [{"containerPort": 8080}, {"containerPort": 8081, "protocol": "UDP"}],
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080},
                               "periodSeconds": 1},
        }],
        "terminationGracePeriodSeconds": 15,
        # Spread over the nodes (the scheduler would, but not reliably with two replicas).
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": labels}}],
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}


def service(name: str, namespace: str, selector: dict[str, str], *, kind: str = "ClusterIP",
            node_port: int | None = None, **spec: Any) -> dict[str, Any]:
    port: dict[str, Any] = {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}
    if node_port is not None:
        port["nodePort"] = node_port
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"type": kind, "selector": selector, "ports": [port], **spec}}


@dataclass(frozen=True)
class Target:
    """Where a prober connects from (a namespace's full name) and to."""

    netns: str
    ip: str
    port: int
    label: str


@dataclass
class ProbeReport:
    total: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # "label: reason" -> count
    first_failure: float | None = None  # seconds after the start
    last_failure: float | None = None

    def line(self) -> str:
        where = ", ".join(f"{k} x{v}" for k, v in sorted(self.failures.items())) or "none"
        when = ("" if self.first_failure is None else
                f", {self.first_failure:.1f}-{self.last_failure:.1f} s in")
        return f"{self.failed} failed of {self.total} connections (failures: {where}{when})"


class Prober:
    """Connections to every target in rounds, from a thread, until stopped: what a client
    population sees while something happens to the cluster. An answer of any kind counts as
    success; no answer within `timeout`, a refusal or a reset is a failure."""

    def __init__(self, targets: Sequence[Target], *, per_round: int = 2,
                 interval: float = 0.05, timeout: float = 3.0) -> None:
        import threading

        self.targets, self.per_round = list(targets), per_round
        self.interval, self.timeout = interval, timeout
        self.report = ProbeReport()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="prober")
        self._started = 0.0

    def __enter__(self) -> Prober:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def settle(self, seconds: float) -> None:
        """Keep probing for this long (the caller's thread waits)."""
        self._stop.wait(seconds)

    def stop(self) -> ProbeReport:
        self._stop.set()
        self._thread.join(60)
        return self.report

    def _run(self) -> None:
        from testkit.inproc import http_probe

        while not self._stop.is_set():
            for target in self.targets:
                counts = http_probe(target.netns, target.ip, target.port, self.per_round,
                                    self.timeout)
                for outcome, n in counts.items():
                    self.report.total += n
                    if is_failure(outcome):
                        self._failed(f"{target.label}: {outcome}", n)
            self._stop.wait(self.interval)

    def _failed(self, key: str, n: int) -> None:
        at = time.monotonic() - self._started
        self.report.failed += n
        self.report.failures[key] = self.report.failures.get(key, 0) + n
        if self.report.first_failure is None:
            self.report.first_failure = at
        self.report.last_failure = at


FAILURES = frozenset({"no answer", "refused", "unreachable", "reset", "empty answer"})


def is_failure(outcome: str) -> bool:
    """http_probe's outcomes: an answer's first word, or what went wrong (its own names, an
    errno's name such as ETIMEDOUT, "error N")."""
    return outcome in FAILURES or outcome.startswith(("E", "error "))


# -- make cluster / cluster-up / cluster-down ------------------------------------------------

LAB_PREFIX = "pyproxy-cluster-"
STATE = Path("/tmp") / "pyproxy-cluster.json"  # the serving process: pid, kubeconfig, ready


def _main(argv: Sequence[str] | None = None) -> int:
    """`make cluster`: torn down on exit, Ctrl-C, SIGTERM, SIGHUP and its reader going away
    (`make cluster | head`), as `make demo` is (testkit/interrupts.py); should it be SIGKILLed,
    its processes die with it (the control plane's and the node daemons' parent-death signal,
    the node holders killing what the nodes' cgroups hold) and the next run sweeps the rest."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m testkit.cluster",
                                     description="A real multi-node cluster on this machine.")
    parser.add_argument("command", choices=("run", "up", "down", "serve"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--keep", action="store_true",
                        help="run: leave it up until Enter or Ctrl-C")
    parser.add_argument("--no-pyproxy", action="store_true",
                        help="do not deploy pyproxy's DaemonSet")
    # Tests: "" names the namespaces and cgroups after this process (ppx-PID-...), so a run
    # does not take `make cluster`'s names and lock.
    parser.add_argument("--prefix", default=LAB_PREFIX, help=argparse.SUPPRESS)
    parser.add_argument("--control-plane-node", action="store_true",
                        help="the control plane's namespace a node too (tainted), where the "
                        "proxy's DaemonSet runs, so that kube-apiserver reaches Services (as "
                        "make conformance runs it)")
    parser.add_argument("--mirror", action="store_true",
                        help="a mirror of registry.k8s.io serving the images built here (for "
                        "pulls with policy Always, as make conformance runs it)")
    args = parser.parse_args(argv)
    from testkit.controlplane import binaries_dir

    if args.command == "down":
        return _down()
    if args.command == "up":
        return _up_detached(args)
    stop_on_signals()
    code = 0
    try:
        with running_cluster(args.nodes, with_pyproxy=not args.no_pyproxy,
                             prefix=args.prefix or None,
                             before_teardown=_tearing_down,
                             control_plane_node=args.control_plane_node,
                             mirror=args.mirror) as cluster:
            config = cluster.admin_kubeconfig()
            say(cluster.kubectl("get", "nodes,pods", "-A", "-o", "wide").stdout)
            say(f"cluster up in {cluster.up_seconds:.0f} s; kubectl from "
                f"{binaries_dir()}; kubeconfig (admin):")
            say(str(config))
            if args.command == "serve":
                STATE.write_text(json.dumps({"pid": os.getpid(), "kubeconfig": str(config),
                                             "ready": True}))
                signal.pause()
            elif args.keep:
                say("Enter or Ctrl-C ends it.")
                sys.stdin.readline()
    except KeyboardInterrupt:
        code = stopped_by()
    except OutputClosed:
        code = SIGPIPE_CODE
    finally:
        if args.command == "serve":
            STATE.unlink(missing_ok=True)
    with contextlib.suppress(OutputClosed):
        say("cluster torn down")
    return SIGPIPE_CODE if output_closed() and code == 0 else code


def _tearing_down() -> None:
    hold_off_signals()  # a second Ctrl-C must not stop the teardown half-way
    with contextlib.suppress(OutputClosed):
        say("tearing the cluster down ...")


def _up_detached(args: Any) -> int:
    """`make cluster-up`: the cluster lives in a process of its own, session leader, until
    `make cluster-down`; this returns once it is up, printing the kubeconfig's path last."""
    if STATE.exists():
        print(f"a cluster is already up (see {STATE}); make cluster-down first",
              file=sys.stderr)
        return 1
    log = Path("/tmp") / "pyproxy-cluster.log"
    argv = [sys.executable, "-m", "testkit.cluster", "serve", f"--nodes={args.nodes}"]
    if args.no_pyproxy:
        argv.append("--no-pyproxy")
    if args.control_plane_node:
        argv.append("--control-plane-node")
    if args.mirror:
        argv.append("--mirror")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=REPO)
    deadline = time.monotonic() + 900
    while not STATE.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(log.read_text()[-4000:], file=sys.stderr)
            print(f"make cluster-up: the cluster did not come up (log: {log})",
                  file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            return 1
        time.sleep(1)
    state = json.loads(STATE.read_text())
    print(log.read_text().rstrip().rsplit("\n", 1)[0])
    print(state["kubeconfig"])
    return 0


def _down() -> int:
    if not STATE.exists():
        print("no cluster is up", file=sys.stderr)
        return 0
    pid = int(json.loads(STATE.read_text())["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    STATE.unlink(missing_ok=True)
    print("cluster down")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
