"""controlplane: a real Kubernetes control plane for the tests, built from upstream's Go modules.

`make k8s` (e2e/k8s/build.sh) builds kube-apiserver, kube-controller-manager and kube-proxy of
the release pinned in e2e/k8s/go.mod, and an embedded etcd, into a cache outside the checkout.
`ControlPlane` starts them in a network namespace of their own (``cp``):

::

    [cp]  etcd 127.0.0.1:2379, kube-apiserver 0.0.0.0:6443 (advertised 192.168.199.1, on lo),
      |   kube-controller-manager (endpointslice, endpointslice-mirroring, serviceaccount,
      |   garbagecollector, namespace) -> https://127.0.0.1:6443
      +-- veth 192.168.200.(4k+1)/30 <-> .(4k+2)/30 -- [a node namespace] route 192.168.199.1/32

- The test process (root namespace) reaches the API server through a forwarder: a listening
  socket on 127.0.0.1 in the root namespace whose upstream connections are opened inside
  ``cp`` (a thread that entered it with setns). Nothing is added to the root namespace.
- Certificates are made at start with openssl (ECDSA P-256, valid two days): a CA, the
  serving certificate (127.0.0.1, 192.168.199.1, 10.96.0.1, kubernetes.default.svc…), an admin
  client (group system:masters) and the controller manager's client. Authorization is
  `Node,RBAC`, so a token of the manifests' ServiceAccount gets exactly the ClusterRole's rights.
- No kubelet: a Pod is an API object bound to a node whose status the tests write.

Processes are started by a `Lab` (testkit/netlab.py) and stopped with it; `stop()` stops exactly
the processes this object started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testkit.daemonargs import PYPROXY, DaemonArgs
from testkit.inproc import call_in_netns
from testkit.netlab import Lab, Netns
from testkit.waits import until

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "e2e" / "k8s" / "build.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-proxy")
# kube-proxy alone of the next release (`make kube-proxy-next`): see next_kube_proxy.
NEXT_BUILD_SCRIPT = REPO / "e2e" / "k8s-next" / "build.sh"

API_IP = "192.168.199.1"  # the API server's advertised address, on cp's loopback
API_PORT = 6443
SERVICE_CIDRS = ("10.96.0.0/16", "fd00:96::/108")
FIRST_SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service
# Only what a service proxy's world needs; the rest of the controller manager stays off.
CONTROLLERS = (
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "serviceaccount-controller",
    "garbage-collector-controller",
    "namespace-controller",
)
START_TIMEOUT = 90.0


class ControlPlaneError(RuntimeError):
    pass


def binaries_dir() -> Path:
    """The folder `make k8s` builds into (whether or not the binaries are there yet)."""
    configured = os.environ.get("PYPROXY_K8S_BIN")
    if configured:
        return Path(configured)
    out = subprocess.run([str(BUILD_SCRIPT), "--path"], capture_output=True, text=True,
                         check=True, timeout=30)
    return Path(out.stdout.strip())


def missing_binaries(bin_dir: Path) -> list[str]:
    return [name for name in BINARIES if not os.access(bin_dir / name, os.X_OK)]


def next_kube_proxy() -> tuple[str, Path]:
    """The release after the pinned one that `make kube-proxy-next` builds kube-proxy of
    (e2e/k8s-next/go.mod) and where the binary is, whether or not it is built yet."""
    out = subprocess.run([str(NEXT_BUILD_SCRIPT), "--path"], capture_output=True, text=True,
                         check=True, timeout=30)
    bin_dir = Path(out.stdout.strip())
    return bin_dir.parent.name.removeprefix("kube-proxy-"), bin_dir / "kube-proxy"


# -- certificates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    ca_key: Path
    server: Path
    server_key: Path
    admin: Path
    admin_key: Path
    controller_manager: Path
    controller_manager_key: Path
    service_account_key: Path
    service_account_public: Path
    scheduler: Path
    scheduler_key: Path
    kubelet_client: Path  # the API server's identity towards kubelets (logs, exec)
    kubelet_client_key: Path
    # The aggregation layer's, as kubeadm makes them: a CA of its own (extension API servers
    # trust the request headers of a client it signed) and the API server's client of it.
    front_proxy_ca: Path
    front_proxy_client: Path
    front_proxy_client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _ec_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
             str(path))


def _issue(pki_dir: Path, ca: Path, ca_key: Path, name: str, subject: str,
           extensions: list[str]) -> tuple[Path, Path]:
    key, cert = pki_dir / f"{name}.key", pki_dir / f"{name}.crt"
    _ec_key(key)
    args = ["req", "-new", "-x509", "-key", str(key), "-out", str(cert), "-days", "2",
            "-subj", subject, "-CA", str(ca), "-CAkey", str(ca_key)]
    for ext in extensions:
        args += ["-addext", ext]
    _openssl(*args)
    return cert, key


def make_pki(pki_dir: Path) -> Pki:
    pki_dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca = pki_dir / "ca.key", pki_dir / "ca.crt"
    _ec_key(ca_key)
    _openssl("req", "-new", "-x509", "-key", str(ca_key), "-out", str(ca), "-days", "2",
             "-subj", "/CN=pyproxy-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    client = ["basicConstraints=critical,CA:FALSE", "extendedKeyUsage=clientAuth",
              "keyUsage=critical,digitalSignature"]
    sans = ",".join([
        "IP:127.0.0.1", f"IP:{API_IP}", f"IP:{FIRST_SERVICE_IP}", "IP:fd00:96::1",
        "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"])
    server, server_key = _issue(
        pki_dir, ca, ca_key, "apiserver", "/CN=kube-apiserver",
        ["basicConstraints=critical,CA:FALSE", "extendedKeyUsage=serverAuth",
         "keyUsage=critical,digitalSignature", f"subjectAltName={sans}"])
    admin, admin_key = _issue(pki_dir, ca, ca_key, "admin",
                              "/O=system:masters/CN=pyproxy-test-admin", client)
    kcm, kcm_key = _issue(pki_dir, ca, ca_key, "controller-manager",
                          "/CN=system:kube-controller-manager", client)
    sa_key, sa_public = pki_dir / "service-account.key", pki_dir / "service-account.pub"
    _ec_key(sa_key)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_public))
    scheduler, scheduler_key = _issue(pki_dir, ca, ca_key, "scheduler",
                                      "/CN=system:kube-scheduler", client)
    kubelet_client, kubelet_client_key = _issue(
        pki_dir, ca, ca_key, "apiserver-kubelet-client",
        "/O=kubeadm:cluster-admins/CN=kube-apiserver-kubelet-client", client)
    front_ca_key, front_ca = pki_dir / "front-proxy-ca.key", pki_dir / "front-proxy-ca.crt"
    _ec_key(front_ca_key)
    _openssl("req", "-new", "-x509", "-key", str(front_ca_key), "-out", str(front_ca), "-days",
             "2", "-subj", "/CN=front-proxy-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    front_client, front_client_key = _issue(pki_dir, front_ca, front_ca_key,
                                            "front-proxy-client", "/CN=front-proxy-client",
                                            client)
    return Pki(ca, ca_key, server, server_key, admin, admin_key, kcm, kcm_key, sa_key,
               sa_public, scheduler, scheduler_key, kubelet_client, kubelet_client_key,
               front_ca, front_client, front_client_key)


def issue_client(pki: Pki, name: str, subject: str) -> tuple[Path, Path]:
    """A client certificate signed by the cluster's CA (a kubelet's: /O=system:nodes/CN=
    system:node:NAME, which the Node authorizer recognises)."""
    return _issue(pki.ca.parent, pki.ca, pki.ca_key, name, subject,
                  ["basicConstraints=critical,CA:FALSE", "extendedKeyUsage=clientAuth",
                   "keyUsage=critical,digitalSignature"])


def issue_server(pki: Pki, name: str, ips: list[str]) -> tuple[Path, Path]:
    """A serving certificate signed by the cluster's CA for these addresses (a kubelet's)."""
    sans = ",".join(f"IP:{ip}" for ip in ips)
    return _issue(pki.ca.parent, pki.ca, pki.ca_key, name, f"/CN={name}",
                  ["basicConstraints=critical,CA:FALSE", "extendedKeyUsage=serverAuth",
                   "keyUsage=critical,digitalSignature", f"subjectAltName={sans}"])


def kubeconfig(server: str, ca: Path, *, token: str | None = None,
               cert: Path | None = None, key: Path | None = None) -> dict[str, Any]:
    user: dict[str, Any] = {}
    if token is not None:
        user["token"] = token
    if cert is not None and key is not None:
        user["client-certificate"] = str(cert)
        user["client-key"] = str(key)
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server,
                                                  "certificate-authority": str(ca)}}],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }


def write_kubeconfig(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


# -- the forwarder from the root namespace into cp --------------------------------------------


class Forwarder:
    """127.0.0.1:<port> in the root namespace → target inside a namespace.

    The listening socket is made by this (root namespace) process; each upstream connection is
    made on a short-lived thread that entered the target namespace, and keeps living there."""

    def __init__(self, netns: str, target: tuple[str, int]) -> None:
        self.netns, self.target = netns, target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, daemon=True, name="cp-forwarder").start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(downstream,), daemon=True).start()

    def _connect(self, downstream: socket.socket) -> None:
        try:
            upstream = call_in_netns(
                self.netns, lambda: socket.create_connection(self.target, timeout=10))
        except OSError:
            downstream.close()
            return
        upstream.settimeout(None)
        # Each side's segments go out as they come (the clients' own sockets do: urllib3
        # and Go set TCP_NODELAY). With Nagle here, a request whose body arrived after its
        # headers (urllib3 sends them apart) waited for the API server's delayed ACK: 40 ms
        # added to about half of the benches' writes, network programming latency included.
        for sock in (downstream, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets.update((downstream, upstream))
        threading.Thread(target=self._pump, args=(upstream, downstream), daemon=True).start()
        self._pump(downstream, upstream)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._sockets.difference_update((source, sink))

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


# -- the control plane ------------------------------------------------------------------------


@dataclass
class Attachment:
    """A node namespace's link to the control plane."""

    ns: Netns
    address: str  # the node's end of the link
    server: str  # the API server's URL as the node reaches it


class ControlPlane:
    """``controllers``: the controller manager's --controllers (a real cluster with kubelets
    wants the defaults, "*"); ``controller_args``: more of its flags; ``apiserver_args``:
    more of the API server's flags (kept for its restarts: an audit log, say)."""

    def __init__(self, lab: Lab, bin_dir: Path, *, controllers: tuple[str, ...] = CONTROLLERS,
                 controller_args: tuple[str, ...] = (),
                 apiserver_args: tuple[str, ...] = (), detach: bool = False) -> None:
        """``detach``: its processes in sessions of their own, and SIGKILLed should this
        process die (`Lab.popen`'s ``detach``: start them from the main thread)."""
        self.lab = lab
        self.detach = detach
        self.bin = bin_dir
        self.controllers = controllers
        self.controller_args = controller_args
        self.apiserver_args = apiserver_args
        self.scheduler: subprocess.Popen[str] | None = None
        self.dir = lab.workdir / "control-plane"
        self.dir.mkdir()
        self.pki = make_pki(self.dir / "pki")
        self.ns = lab.add_ns("cp")
        lab.ip(self.ns, "addr", "add", f"{API_IP}/32", "dev", "lo")
        self.etcd: subprocess.Popen[str] | None = None
        self.apiserver: subprocess.Popen[str] | None = None
        self.controller_manager: subprocess.Popen[str] | None = None
        self.forwarder: Forwarder | None = None
        self._links = 0
        self._apiserver_starts = 0
        self.internal_kubeconfig = write_kubeconfig(
            self.dir / "controller-manager.kubeconfig",
            kubeconfig(f"https://127.0.0.1:{API_PORT}", self.pki.ca,
                       cert=self.pki.controller_manager, key=self.pki.controller_manager_key))

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> ControlPlane:
        started = time.monotonic()
        self.start_etcd()
        self.forwarder = Forwarder(self.ns.full, ("127.0.0.1", API_PORT))
        self.start_apiserver()
        self.controller_manager = self.lab.popen(self.ns, [
            self.bin / "kube-controller-manager",
            f"--kubeconfig={self.internal_kubeconfig}",
            f"--authentication-kubeconfig={self.internal_kubeconfig}",
            f"--authorization-kubeconfig={self.internal_kubeconfig}",
            f"--controllers={','.join(self.controllers)}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--root-ca-file={self.pki.ca}",
            f"--service-account-private-key-file={self.pki.service_account_key}",
            "--secure-port=0", "--concurrent-service-endpoint-syncs=5", "-v=1",
            *self.controller_args,
        ], log_name="kube-controller-manager.log", detach=self.detach)
        self.startup_seconds = time.monotonic() - started
        return self

    def start_scheduler(self) -> None:
        """kube-scheduler (a cluster with kubelets places its Pods through it)."""
        config = write_kubeconfig(
            self.dir / "scheduler.kubeconfig",
            kubeconfig(f"https://127.0.0.1:{API_PORT}", self.pki.ca,
                       cert=self.pki.scheduler, key=self.pki.scheduler_key))
        self.scheduler = self.lab.popen(self.ns, [
            self.bin / "kube-scheduler", f"--kubeconfig={config}",
            f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
            "--leader-elect=false", "--secure-port=0", "-v=1",
        ], log_name="kube-scheduler.log", detach=self.detach)

    def start_etcd(self) -> None:
        self.etcd = self.lab.popen(self.ns, [
            self.bin / "etcd", f"--data-dir={self.dir / 'etcd'}",
            "--listen-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380",
        ], log_name="etcd.log", detach=self.detach)
        self._wait(lambda: self._port_open(2379), "etcd listening", self.etcd)

    def start_apiserver(self) -> None:
        """Start (or restart) kube-apiserver and wait for /readyz."""
        self._apiserver_starts += 1
        self.apiserver = self.lab.popen(self.ns, [
            self.bin / "kube-apiserver",
            "--etcd-servers=http://127.0.0.1:2379",
            "--bind-address=0.0.0.0", f"--secure-port={API_PORT}",
            f"--advertise-address={API_IP}",
            f"--service-cluster-ip-range={','.join(SERVICE_CIDRS)}",
            "--authorization-mode=Node,RBAC",
            f"--client-ca-file={self.pki.ca}",
            f"--tls-cert-file={self.pki.server}", f"--tls-private-key-file={self.pki.server_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.pki.service_account_public}",
            f"--service-account-signing-key-file={self.pki.service_account_key}",
            f"--cert-dir={self.dir / 'apiserver-certs'}",
            f"--kubelet-client-certificate={self.pki.kubelet_client}",
            f"--kubelet-client-key={self.pki.kubelet_client_key}",
            # Nodes have no DNS names here: logs and exec go to their InternalIP.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # kube-proxy's own DaemonSet (kubeadm's) runs privileged.
            "--allow-privileged=true",
            # The aggregation layer, as kubeadm configures it: kube-apiserver proxies to an
            # extension API server (an APIService's Service) as front-proxy-client, whose
            # request headers the extension trusts from the front proxy's CA (it reads them
            # from kube-system/extension-apiserver-authentication).
            f"--requestheader-client-ca-file={self.pki.front_proxy_ca}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={self.pki.front_proxy_client}",
            f"--proxy-client-key-file={self.pki.front_proxy_client_key}",
            "--profiling=false", "-v=1",
            *self.apiserver_args,
        ], log_name=f"kube-apiserver-{self._apiserver_starts}.log", detach=self.detach)
        self._wait(self._ready, "kube-apiserver /readyz", self.apiserver)

    def kill_apiserver(self) -> None:
        """SIGKILL the API server (a crash: no graceful shutdown, connections reset)."""
        assert self.apiserver is not None
        self.apiserver.kill()
        self.apiserver.wait(10)
        self.lab.stop_process(self.apiserver)
        self.apiserver = None

    def compact(self) -> int:
        """Compact etcd's history up to its current revision; returns that revision."""
        out = self.lab.run(self.ns, [str(self.bin / "etcd"), "compact",
                                     "--endpoint=http://127.0.0.1:2379"], timeout=40)
        return int(out.stdout.strip())

    def stop(self) -> None:
        if self.forwarder is not None:
            self.forwarder.close()
        for proc in (self.scheduler, self.controller_manager, self.apiserver, self.etcd):
            if proc is not None:
                self.lab.stop_process(proc)

    def _wait(self, ready: Callable[[], bool], what: str,
              proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if proc.poll() is not None:
                raise ControlPlaneError(f"{what}: the process exited ({proc.returncode}); "
                                        f"logs in {self.lab.workdir}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{what}: not within {START_TIMEOUT:.0f} s")
            time.sleep(0.2)

    def _port_open(self, port: int) -> bool:
        def probe() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return True
            return False
        return call_in_netns(self.ns.full, probe)

    def _ready(self) -> bool:
        api = self.admin_client()
        try:
            response = api.call_api("GET", f"{self.url}/readyz", _request_timeout=3)
            response.read()
            return bool(response.status == 200)
        except Exception:
            return False
        finally:
            api.close()

    # -- clients ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The API server's URL for this (root namespace) process."""
        assert self.forwarder is not None
        return f"https://127.0.0.1:{self.forwarder.port}"

    def admin_client(self) -> Any:
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        config.ssl_ca_cert = str(self.pki.ca)
        config.cert_file = str(self.pki.admin)
        config.key_file = str(self.pki.admin_key)
        return client.ApiClient(config)

    def attach(self, node: Netns) -> Attachment:
        """Link a node namespace to the control plane; processes there reach the API server at
        https://192.168.199.1:6443."""
        k = self._links
        self._links += 1
        if k >= 60:
            raise ControlPlaneError("too many links to the control plane")
        cp_end, node_end = f"192.168.200.{4 * k + 1}", f"192.168.200.{4 * k + 2}"
        self.lab.link(self.ns, node, [f"{cp_end}/30"], [f"{node_end}/30"])
        node.lab.add_route(node, f"{API_IP}/32", via=cp_end)
        return Attachment(node, node_end, f"https://{API_IP}:{API_PORT}")

    def node_kubeconfig(self, path: Path, token: str) -> Path:
        """A kubeconfig for a process in an attached namespace, authenticating with token."""
        return write_kubeconfig(path, kubeconfig(f"https://{API_IP}:{API_PORT}", self.pki.ca,
                                                 token=token))

    def admin_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for a process in an attached namespace with admin rights."""
        return write_kubeconfig(path, kubeconfig(f"https://{API_IP}:{API_PORT}", self.pki.ca,
                                                 cert=self.pki.admin, key=self.pki.admin_key))


@contextlib.contextmanager
def running_control_plane(bin_dir: Path,
                          apiserver_args: tuple[str, ...] = ()) -> Iterator[ControlPlane]:
    with Lab() as lab:
        plane = ControlPlane(lab, bin_dir, apiserver_args=apiserver_args)
        try:
            yield plane.start()
        finally:
            plane.stop()
            if os.environ.get("NETLAB_KEEP_LOGS"):
                shutil.copytree(lab.workdir, Path("/tmp") / f"{lab.prefix}logs",
                                dirs_exist_ok=True)


@contextlib.contextmanager
def plane_for_proxies(apiserver_args: tuple[str, ...] = ()) -> Iterator[tuple[ControlPlane,
                                                                              Kube]]:
    """The control plane `make k8s` built, started, with pyproxy's ServiceAccount and RBAC
    applied: where the benches and drills that run the proxies begin. ControlPlaneError,
    saying what to run, when it is not built."""
    bin_dir = binaries_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        raise ControlPlaneError(f"the control plane is not built in {bin_dir} "
                                f"({', '.join(missing)} missing): run `make k8s`")
    with running_control_plane(bin_dir, apiserver_args) as plane:
        kube = Kube(plane.admin_client())
        apply_manifests(kube)
        yield plane, kube


# -- the API as the tests use it ---------------------------------------------------------------


class Kube:
    """Thin helpers over the official client for what the tests write: namespaces, Nodes with
    status, Pods bound to nodes with the status a kubelet would write, Services."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.api = api_client
        # Typed Any: the tests send plain dicts, the bodies `kubectl apply` would send
        # (the client serializes them as they are), where the stubs ask for model objects.
        self.core: Any = client.CoreV1Api(api_client)
        self.discovery: Any = client.DiscoveryV1Api(api_client)

    def namespace(self, name: str, timeout: float = 30.0) -> None:
        """Create a namespace and wait for its default ServiceAccount (Pods need it)."""
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            self.core.create_namespace({"metadata": {"name": name}})
        wait_for(lambda: any(sa.metadata.name == "default" for sa in
                             self.core.list_namespaced_service_account(name).items),
                 timeout, f"default ServiceAccount in {name}")

    def node(self, name: str, ips: tuple[str, ...], zone: str | None = None,
             region: str | None = None, cpu: str = "4") -> None:
        labels = {"kubernetes.io/hostname": name}
        if zone:
            labels["topology.kubernetes.io/zone"] = zone
        if region:
            labels["topology.kubernetes.io/region"] = region
        self.core.create_node({"metadata": {"name": name, "labels": labels}})
        self.core.patch_node_status(name, {"status": {
            "addresses": [{"type": "InternalIP", "address": ip} for ip in ips]
            + [{"type": "Hostname", "address": name}],
            "capacity": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
            "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "written by the test",
                            "lastHeartbeatTime": now_rfc3339(),
                            "lastTransitionTime": now_rfc3339()}],
        }})

    def pod(self, namespace: str, name: str, node: str, ips: tuple[str, ...],
            labels: dict[str, str], ready: bool = True) -> None:
        """A Pod bound to node, Running with ips, Ready or not (no kubelet: the test is it)."""
        self.core.create_namespaced_pod(namespace, {
            "metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 300,
                     "containers": [{"name": "app", "image": "registry.invalid/app:1",
                                     "ports": [{"containerPort": 8080}]}]},
        })
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": "Running", "podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips],
            "hostIP": ips[0], "startTime": now_rfc3339(),
        }})
        self.set_ready(namespace, name, ready)

    def set_ready(self, namespace: str, name: str, ready: bool) -> None:
        status = "True" if ready else "False"
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {"conditions": [
            {"type": "Ready", "status": status, "lastTransitionTime": now_rfc3339()},
            {"type": "ContainersReady", "status": status, "lastTransitionTime": now_rfc3339()},
        ]}})

    def delete_pod(self, namespace: str, name: str, grace: int = 0) -> None:
        """grace > 0: the pod is terminating (nobody finishes the deletion: no kubelet)."""
        self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace)

    def slices(self, namespace: str, service: str) -> list[Any]:
        return list(self.discovery.list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={service}").items)

    def endpoint_conditions(self, namespace: str, service: str) -> dict[str, tuple[bool, ...]]:
        """address → (ready, serving, terminating) over the service's slices."""
        out: dict[str, tuple[bool, ...]] = {}
        for piece in self.slices(namespace, service):
            for endpoint in piece.endpoints or []:
                c = endpoint.conditions
                out[endpoint.addresses[0]] = (bool(c.ready), bool(c.serving),
                                              bool(c.terminating))
        return out


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def wait_for(check: Callable[[], object], timeout: float, what: str,
             interval: float = 0.1) -> float:
    """until() of the test kit, with any error of the check (the API briefly away) counting
    as "not yet"; returns the seconds it took."""
    return until(check, timeout, what, interval, ignore=(Exception,))


# -- pyproxy with the manifests' identity ------------------------------------------------------


def apply_manifests(kube: Kube) -> None:
    """manifests/00-serviceaccount.yaml and 01-rbac.yaml, as `kubectl apply` would create them."""
    from kubernetes import utils
    from kubernetes.client.exceptions import ApiException

    create_from_dict: Callable[..., Any] = utils.create_from_dict  # untyped upstream
    for name in ("00-serviceaccount.yaml", "01-rbac.yaml"):
        for doc in yaml.safe_load_all((REPO / "manifests" / name).read_text()):
            try:
                create_from_dict(kube.api, doc)
            except utils.FailToCreateError as err:
                if not all(isinstance(e, ApiException) and e.status == 409
                           for e in err.api_exceptions):
                    raise


def service_account_token(kube: Kube) -> str:
    """A token of kube-system/pyproxy, through the TokenRequest API (what the kubelet mounts)."""
    request = kube.core.create_namespaced_service_account_token(
        "pyproxy", "kube-system",
        {"spec": {"audiences": [], "expirationSeconds": 7200}})
    return str(request.status.token)


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    ns: Netns
    socket: str
    log: Path

    def status(self) -> dict[str, Any]:
        out = self.ns.run([PYPROXY, "status", "--socket", self.socket, "-o", "json"],
                          check=False)
        return dict(json.loads(out.stdout)) if out.stdout.strip() else {}

    def watches(self) -> dict[str, dict[str, Any]]:
        """kind → the reflector's status (lists, watches, errors…)."""
        return {w["kind"]: w for w in self.status().get("source", {}).get("api", [])}


def start_pyproxy(lab: Lab, ns: Netns, kubeconfig: Path, node: str, *extra: str,
                  name: str = "pyproxy") -> Daemon:
    sock = str(lab.workdir / f"{name}.sock")
    argv = DaemonArgs(kubeconfig=kubeconfig, node=node,
                      cluster_cidr="10.244.0.0/16,fd00:244::/48", debug_socket=sock,
                      extra=extra).argv()
    proc = lab.popen(ns, argv, log_name=f"{name}.log")
    return Daemon(proc, ns, sock, lab.workdir / f"{name}.log")



def kube_proxy_config(path: Path, kubeconfig: Path, node: str = "node-a",
                      cluster_cidr: str = "10.244.0.0/16,fd00:244::/48",
                      min_sync_period: str = "200ms", sync_period: str = "5s",
                      extra: dict[str, Any] | None = None) -> Path:
    """upstream kube-proxy's configuration file for a node namespace, nftables mode (`extra`:
    more top-level fields)."""
    path.write_text(yaml.safe_dump({
        **(extra or {}),
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "nftables", "hostnameOverride": node, "clusterCIDR": cluster_cidr,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
        # Global sysctls kube-proxy cannot set from inside a namespace: leave them alone.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s", "udpTimeout": "0s",
                      "udpStreamTimeout": "0s"},
        "nftables": {"minSyncPeriod": min_sync_period, "syncPeriod": sync_period},
    }))
    return path


def proxy_kubeconfigs(plane: ControlPlane, kube: Kube, workdir: Path) -> tuple[Path, Path]:
    """kube-proxy's kubeconfig (kubeadm's identity for it) and pyproxy's (the manifests'
    ServiceAccount), for processes in attached namespaces, written in `workdir`."""
    return (plane.node_kubeconfig(workdir / "kube-proxy.kubeconfig", kube_proxy_token(kube)),
            plane.node_kubeconfig(workdir / "pyproxy.kubeconfig", service_account_token(kube)))


def kube_proxy_token(kube: Kube) -> str:
    """kube-system/kube-proxy bound to system:node-proxier, as kubeadm sets it up."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        kube.core.create_namespaced_service_account(
            "kube-system", {"metadata": {"name": "kube-proxy"}})
    except ApiException as err:
        if err.status != 409:
            raise
    try:
        rbac: Any = client.RbacAuthorizationV1Api(kube.api)  # a dict body, as in Kube
        rbac.create_cluster_role_binding({
            "metadata": {"name": "kube-proxy-test"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:node-proxier"},
            "subjects": [{"kind": "ServiceAccount", "name": "kube-proxy",
                          "namespace": "kube-system"}]})
    except ApiException as err:
        if err.status != 409:
            raise
    request = kube.core.create_namespaced_service_account_token(
        "kube-proxy", "kube-system", {"spec": {"audiences": [], "expirationSeconds": 7200}})
    return str(request.status.token)
