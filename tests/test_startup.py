"""`pyproxy run` getting started: the API connection (kubeadm's kube-proxy ConfigMap, a
kubeconfig's token file re-read as client-go does, the pod's service account), start-up errors
as one line and exit code 2 before anything on the host changes, and the bootstrap trap (an
API server reached through a Service address)."""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from pyproxy.cli.formats import format_status
from pyproxy.cluster import apiconnection
from pyproxy.cluster.apiconnection import ApiConnection, FileToken, parse_kubeconfig
from pyproxy.cluster.apirequest import request
from pyproxy.cluster.apiserver import ApiAddressCheck, client_for
from pyproxy.cluster.snapshot import build_state
from pyproxy.config import ConfigError, ProxyConfig, load_config_file
from pyproxy.serve.metrics import Metrics
from testkit.builders import make_service, make_service_cidr
from testkit.controlplane import Pki, make_pki
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Lab
from testkit.waits import eventually

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
KUBEADM_CONFIGMAP = Path(__file__).parent / "data" / "kubeadm-kube-proxy-configmap.yaml"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@functools.cache
def pki() -> Pki:
    """A CA and certificates made with openssl, once for the module."""
    return make_pki(Path(tempfile.mkdtemp(prefix="pyproxy-test-pki-")))


def kubeadm_files(tmp: Path, token: str = "token-1") -> Path:
    """kubeadm's ConfigMap as kube-proxy's pod sees it (config.conf and kubeconfig.conf in
    /var/lib/kube-proxy, the service account in /var/run/secrets/…), moved under `tmp`.
    Returns config.conf's path."""
    data = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())["data"]
    (tmp / "var/lib/kube-proxy").mkdir(parents=True)
    sa = tmp / SA_DIR.lstrip("/")
    sa.mkdir(parents=True)
    (sa / "token").write_text(token)
    (sa / "ca.crt").write_bytes(pki().ca.read_bytes())
    for name, text in data.items():
        moved = text.replace("/var/", f"{tmp}/var/")
        (tmp / "var/lib/kube-proxy" / name).write_text(moved)
    return tmp / "var/lib/kube-proxy/config.conf"


class TestKubeadm:
    def test_kubeadm_kubeconfig(self) -> None:
        """kubeadm's kubeconfig.conf: its server, the pod's CA and token files."""
        text = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())["data"]["kubeconfig.conf"]
        path = "/var/lib/kube-proxy/kubeconfig.conf"
        assert parse_kubeconfig(text, path) == ApiConnection(
            server="https://192.0.2.10:6443", source=path, ca_file=f"{SA_DIR}/ca.crt",
            token_file=f"{SA_DIR}/token")

    def test_kubeadm_configmap_gives_a_client(self, tmp_path: Path) -> None:
        """config.conf names kubeconfig.conf, which names the server and the token file:
        the client signs requests with the token in that file."""
        config = load_config_file(str(kubeadm_files(tmp_path)))
        api = client_for(apiconnection.load(config), config)
        assert api.configuration.host == "https://192.0.2.10:6443"
        assert api.configuration.ssl_ca_cert == f"{tmp_path}{SA_DIR}/ca.crt"
        assert api.configuration.get_api_key_with_prefix("BearerToken") == "Bearer token-1"

    def test_kubeadm_config_without_its_kubeconfig(self, tmp_path: Path) -> None:
        """kubeadm's config.conf outside kube-proxy's pod: the missing kubeconfig is named,
        with the setting that names it."""
        config = load_config_file(str(kubeadm_files(tmp_path)))
        Path(str(config.kubeconfig)).unlink()
        with pytest.raises(ConfigError, match=r"kubeconfig .*/var/lib/kube-proxy/kubeconfig"
                                              r"\.conf \(clientConnection\.kubeconfig"):
            apiconnection.load(config)


def write(tmp: Path, name: str, document: Any) -> str:
    path = tmp / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return str(path)


def kubeconfig(server: str = "https://api.example:6443", **user: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "k", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}


def without_current_context() -> dict[str, Any]:
    config = kubeconfig()
    config["contexts"].append({"name": "d", "context": {"cluster": "k"}})
    del config["current-context"]
    return config


class TestKubeconfig:
    def test_relative_paths_are_relative_to_the_file(self, tmp_path: Path) -> None:
        """As in client-go: a relative certificate or token path starts at the kubeconfig's
        directory."""
        config = kubeconfig(**{"client-certificate": "c.crt", "client-key": "c.key",
                               "tokenFile": "sub/token"})
        config["clusters"][0]["cluster"]["certificate-authority"] = "ca.crt"
        connection = parse_kubeconfig(yaml.safe_dump(config), str(tmp_path / "kc"))
        assert connection.files() == [
            ("certificate-authority", f"{tmp_path}/ca.crt"),
            ("client-certificate", f"{tmp_path}/c.crt"), ("client-key", f"{tmp_path}/c.key"),
            ("tokenFile", f"{tmp_path}/sub/token")]

    def test_inline_data_is_decoded(self) -> None:
        pem = "-----BEGIN CERTIFICATE-----\n"
        config = kubeconfig(**{"client-certificate-data": base64.b64encode(b"cert").decode(),
                               "client-key-data": base64.b64encode(b"key").decode()})
        config["clusters"][0]["cluster"]["certificate-authority-data"] = base64.b64encode(
            pem.encode()).decode()
        connection = parse_kubeconfig(yaml.safe_dump(config), "/kc")
        assert (connection.ca_data, connection.cert_data, connection.key_data) == (
            pem, "cert", "key")

    def test_the_only_context_serves_without_current_context(self) -> None:
        config = kubeconfig(token="t")
        del config["current-context"]
        assert parse_kubeconfig(yaml.safe_dump(config), "/kc").token == "t"

    def test_exec_users_go_to_the_clients_loader(self) -> None:
        config = kubeconfig(exec={"command": "get-token", "apiVersion": "x"})
        assert parse_kubeconfig(yaml.safe_dump(config), "/kc").client_loader

    def test_master_overrides_the_server(self, tmp_path: Path) -> None:
        path = write(tmp_path, "kc", kubeconfig(token="t"))
        connection = apiconnection.load(ProxyConfig(kubeconfig=path,
                                                    master="https://10.0.0.1:6443"))
        assert connection.server == "https://10.0.0.1:6443"

    @pytest.mark.parametrize(("document", "message"), [
        pytest.param("a: [", "kc: not valid YAML", id="not YAML"),
        pytest.param({"foo": "bar"}, "kc: not a kubeconfig (no clusters)", id="no clusters"),
        pytest.param(without_current_context(),
                     "kc: current-context: not set, and there is not exactly one context",
                     id="no current context"),
        pytest.param({**kubeconfig(), "current-context": "x"},
                     "kc: contexts[name=x]: not found", id="unknown context"),
        pytest.param({**kubeconfig(), "clusters": [{"name": "other", "cluster": {}}]},
                     "kc: clusters[name=k]: not found", id="unknown cluster"),
        pytest.param({**kubeconfig(), "clusters": [{"name": "k", "cluster": {}}]},
                     "kc: clusters[name=k].cluster.server: not set", id="no server"),
        pytest.param(kubeconfig(server="api.example:6443"),
                     "kc: clusters[name=k].cluster.server: 'api.example:6443' is not an http(s) "
                     "URL with a host", id="server without scheme"),
        pytest.param(kubeconfig(**{"client-key-data": "%%%"}),
                     "kc: users[name=u].user.client-key-data: not base64 of a PEM file",
                     id="bad inline data"),
        pytest.param(kubeconfig(tokenFile="missing-token"),
                     "kc: tokenFile {tmp}/missing-token: No such file or directory",
                     id="token file missing"),
        pytest.param(kubeconfig(tokenFile="kc"), None, id="token file readable"),
    ])
    def test_errors_name_the_file_and_the_field(self, tmp_path: Path, document: Any,
                                                message: str | None) -> None:
        path = write(tmp_path, "kc", document)
        if message is None:
            apiconnection.load(ProxyConfig(kubeconfig=path))
            return
        with pytest.raises(ConfigError) as raised:
            apiconnection.load(ProxyConfig(kubeconfig=path))
        assert str(raised.value).startswith(f"{tmp_path}/" + message.format(tmp=tmp_path))

    def test_a_kubeconfig_beyond_the_limits_is_refused_before_it_is_read_whole(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        deep = write(tmp_path, "deep", "a: " + "[" * 150 + "]" * 150 + "\n")
        with pytest.raises(ConfigError, match=r"deep: nested deeper than 100 levels"):
            apiconnection.load(ProxyConfig(kubeconfig=deep))
        path = write(tmp_path, "kc", kubeconfig(token="t"))
        monkeypatch.setattr(apiconnection, "MAX_KUBECONFIG_BYTES", 64)
        with pytest.raises(ConfigError, match=r"kc .*larger than 64 bytes, the limit for a "
                                               r"kubeconfig"):
            apiconnection.load(ProxyConfig(kubeconfig=path))

    @pytest.mark.parametrize(("ca", "cert", "key", "message"), [
        pytest.param("not-a-cert", None, None, "certificate-authority {tmp}/not-a-cert: not "
                     "usable for TLS", id="CA not a certificate"),
        pytest.param("ca", "admin", "kcm_key", "client-certificate {admin} and client-key "
                     "{kcm_key}: not usable for TLS", id="key of another certificate"),
        pytest.param("ca", "admin", "admin_key", None, id="usable"),
    ])
    def test_certificates_are_checked_at_start(self, tmp_path: Path, ca: str,
                                               cert: str | None, key: str | None,
                                               message: str | None) -> None:
        """What TLS would refuse at the first request is refused at start, naming the file."""
        files = {"ca": str(pki().ca), "admin": str(pki().admin),
                 "admin_key": str(pki().admin_key), "kcm_key": str(pki().controller_manager_key),
                 "not-a-cert": write(tmp_path, "not-a-cert", "hello\n")}
        config = kubeconfig(**({"client-certificate": files[cert], "client-key": files[key]}
                               if cert and key else {}))
        config["clusters"][0]["cluster"]["certificate-authority"] = files[ca]
        path = write(tmp_path, "kc", config)
        if message is None:
            apiconnection.load(ProxyConfig(kubeconfig=path))
            return
        with pytest.raises(ConfigError) as raised:
            apiconnection.load(ProxyConfig(kubeconfig=path))
        assert str(raised.value).startswith(f"{path}: " + message.format(tmp=tmp_path, **files))

    def test_an_empty_token_file_is_refused(self, tmp_path: Path) -> None:
        write(tmp_path, "token", "\n")
        path = write(tmp_path, "kc", kubeconfig(tokenFile="token"))
        with pytest.raises(ConfigError, match=r"tokenFile .*/token: empty"):
            apiconnection.load(ProxyConfig(kubeconfig=path))


class TestInCluster:
    def test_service_account_and_service_address(self, tmp_path: Path) -> None:
        environ = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
        assert apiconnection.in_cluster(environ, directory=str(tmp_path)) == ApiConnection(
            server="https://[fd00::1]:6443",
            source="in-cluster (KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT)",
            ca_file=f"{tmp_path}/ca.crt", token_file=f"{tmp_path}/token")

    def test_master_needs_no_service_variables(self, tmp_path: Path) -> None:
        connection = apiconnection.in_cluster({}, "https://10.0.0.1:6443", str(tmp_path))
        assert (connection.server, connection.source) == ("https://10.0.0.1:6443",
                                                          "in-cluster (--master)")

    @pytest.mark.parametrize(("environ", "message"), [
        pytest.param({}, "no kubeconfig (--kubeconfig, clientConnection.kubeconfig) and not "
                         "in a pod", id="not in a pod"),
        pytest.param({"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "443"},
                     "KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT is empty: set the "
                     "API server's real address (the pyproxy ConfigMap's apiServerHost",
                     id="empty apiServerHost"),
    ])
    def test_errors(self, environ: dict[str, str], message: str) -> None:
        with pytest.raises(ConfigError) as raised:
            apiconnection.in_cluster(environ)
        assert str(raised.value).startswith(message)

    def test_missing_service_account_files(self, tmp_path: Path) -> None:
        environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
        with pytest.raises(ConfigError, match=r"^in-cluster .*: certificate-authority "
                                              r".*/ca\.crt: No such file or directory"):
            apiconnection.load(ProxyConfig(), environ, str(tmp_path))


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str | None] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        body = b'{"kind": "NodeList", "items": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(name="recorder")
def _recorder() -> Iterator[str]:
    """An HTTP server recording each request's Authorization header; yields its URL."""
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class TestTokenFile:
    def test_a_rotated_token_is_used_after_a_minute(self, tmp_path: Path,
                                                    recorder: str) -> None:
        """Bound service-account tokens expire; the kubelet writes the new one into the same
        file. As client-go, the file is read again once the token in hand is a minute old."""
        from kubernetes import client

        token = tmp_path / "token"
        token.write_text("one\n")
        connection = ApiConnection(server=recorder, source="kc", token_file=str(token))
        clock = FakeClock()
        configuration = apiconnection.client_configuration(connection, clock)
        api = client.ApiClient(configuration)

        def get() -> None:
            request(api, "GET", "/api/v1/nodes", timeout=5).release_conn()

        get()
        token.write_text("two\n")
        clock.now += 59
        get()
        clock.now += 1
        get()
        token.unlink()  # a failed read keeps the token in hand
        clock.now += 60
        with capture_logs() as logs:
            get()
        assert _Recorder.seen == ["Bearer one", "Bearer one", "Bearer two", "Bearer two"]
        assert [e["event"] for e in logs] == ["token_file_not_read"]

    def test_file_token_reads_once_a_minute(self, tmp_path: Path) -> None:
        path = tmp_path / "token"
        path.write_text("a")
        clock = FakeClock()
        token = FileToken(str(path), clock)
        path.write_text("b")
        assert token.current() == "a"
        clock.now += 60
        assert token.current() == "b"


# ---------------------------------------------------------------------------------------------
# Start-up errors: one line, exit code 2


def pyproxy_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    argv = DaemonArgs(node=None, min_sync_period=None, sync_period=None, healthz="",
                      metrics="", extra=args).argv()
    return subprocess.run(argv, env={**environ, **(env or {})}, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize(("args", "env", "message"), [
    pytest.param(["--kubeconfig", "{tmp}/missing"], {},
                 "kubeconfig {tmp}/missing (clientConnection.kubeconfig, --kubeconfig): No such "
                 "file or directory", id="missing kubeconfig"),
    pytest.param(["--kubeconfig", "{tmp}/var/lib/kube-proxy/config.conf"], {},
                 "{tmp}/var/lib/kube-proxy/config.conf: not a kubeconfig (no clusters)",
                 id="not a kubeconfig"),
    pytest.param(["--config", "{tmp}/var/lib/kube-proxy/config.conf"], {},
                 "kubeconfig {tmp}/var/lib/kube-proxy/kubeconfig.conf "
                 "(clientConnection.kubeconfig, --kubeconfig): No such file or directory",
                 id="kubeadm config without its kubeconfig"),
    pytest.param([], {}, "no kubeconfig (--kubeconfig, clientConnection.kubeconfig) and not in a "
                         "pod (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set)",
                 id="not in a pod"),
    pytest.param([], {"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "6443"},
                 "KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT is empty", id="empty host"),
    pytest.param(["--config", "{tmp}/missing.conf"], {},
                 "--config {tmp}/missing.conf: No such file or directory", id="missing config"),
    pytest.param(["--master", "api:6443", "--kubeconfig", "{tmp}/kc"], {},
                 "--master: 'api:6443' is not an http(s) URL with a host", id="bad master"),
])
def test_start_up_errors_are_one_line(tmp_path: Path, args: list[str], env: dict[str, str],
                                      message: str) -> None:
    """No traceback: one line naming the file or setting, exit code 2."""
    config = kubeadm_files(tmp_path)
    Path(str(load_config_file(str(config)).kubeconfig)).unlink()
    write(tmp_path, "kc", kubeconfig(token="t"))
    result = pyproxy_run(*(a.format(tmp=tmp_path) for a in args), env=env)
    assert (result.returncode, result.stdout) == (2, "")
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pyproxy: " + message.format(tmp=tmp_path)), lines[0]


# ---------------------------------------------------------------------------------------------
# The bootstrap trap


def cluster_state(*extra: dict[str, Any]) -> Any:
    return build_state([make_service("default", "kubernetes", ip="10.96.0.1"),
                        make_service_cidr("kubernetes", "10.96.0.0/16"), *extra])


@pytest.mark.parametrize(("host", "problem"), [
    pytest.param("192.0.2.10", None, id="the real address"),
    pytest.param("api.example.com", None, id="a DNS name outside the cluster"),
    pytest.param("10.96.0.1", "10.96.0.1 is a ClusterIP of the default/kubernetes Service",
                 id="the kubernetes ClusterIP"),
    pytest.param("10.96.3.4", "10.96.3.4 is inside the service CIDR 10.96.0.0/16",
                 id="in a service CIDR"),
    pytest.param("kubernetes.default.svc", "kubernetes.default.svc is a cluster DNS name",
                 id="cluster DNS name"),
    pytest.param("kubernetes.default.svc.cluster.local.",
                 "kubernetes.default.svc.cluster.local. is a cluster DNS name", id="FQDN"),
])
def test_service_address_problem(host: str, problem: str | None) -> None:
    found = apiconnection.service_address_problem(host, cluster_state())
    assert (found if problem is None else (found or "").split(":")[0]) == problem


def test_the_kubelets_cluster_ip_is_known_before_any_service() -> None:
    """The kubelet tells every pod the kubernetes Service's ClusterIP (KUBERNETES_PORT_*),
    whatever the pod spec made of KUBERNETES_SERVICE_HOST: the trap shows before any list,
    even when no list can ever succeed."""
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
               "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1", "KUBERNETES_PORT": "tcp://x"}
    ips = apiconnection.kubelet_cluster_ips(environ)
    assert ips == {"10.96.0.1"}
    empty = build_state([])
    problem = apiconnection.service_address_problem("10.96.0.1", empty, ips)
    assert problem is not None and problem.startswith(
        "10.96.0.1 is the kubernetes Service's ClusterIP (the kubelet's")
    assert apiconnection.service_address_problem("192.0.2.10", empty, ips) is None


def test_api_address_check_warns_once_and_sets_the_gauge() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    check = ApiAddressCheck("10.96.0.1", metrics.api_server_via_service.set)
    structlog.reset_defaults()
    with capture_logs() as logs:
        check(build_state([]))
        check(cluster_state())
        check(cluster_state())
    assert registry.get_sample_value("pyproxy_api_server_via_service_address") == 1
    assert [e["event"] for e in logs] == ["api_server_via_service_address"]
    assert logs[0]["log_level"] == "warning"
    assert check.problem is not None and check.problem.startswith("10.96.0.1 is a ClusterIP")


def test_status_shows_the_trap() -> None:
    status = json.loads(STATUS)
    status["source"]["apiServer"] = {"host": "10.96.0.1", "problem": "10.96.0.1 is a ClusterIP"}
    assert ("api server:        10.96.0.1: WARNING: 10.96.0.1 is a ClusterIP"
            in format_status(status).splitlines())
    status["source"]["apiServer"]["problem"] = None
    assert "api server:        10.96.0.1" in format_status(status).splitlines()


STATUS = json.dumps({
    "node": "node-a", "families": ["IPv4"], "healthy": True, "nodeEligible": True,
    "sources": {"services": True}, "services": 1, "servicePorts": 1,
    "pendingChanges": {"services": 0, "endpoints": 0}, "syncs": 1, "syncFailures": 0,
    "lastSync": None, "lastFullSync": None, "lastPartialSync": None, "invalidObjects": {},
    "source": {"api": []}})


NETFILTER = Path("/proc/sys/net/netfilter")
PER_NAMESPACE = ("nf_conntrack_tcp_timeout_established", "nf_conntrack_udp_timeout")


@pytest.mark.netns
@requires_netns
def test_a_refused_start_changes_nothing_on_the_host(lab: Lab, tmp_path: Path) -> None:
    """The conntrack sysctls asked for are not written (nor any rule) when the API connection
    cannot be had: every check comes before the first change."""
    ns = lab.add_ns("refused")

    def sysctls() -> list[str]:
        return lab.run(ns, ["cat", *(str(NETFILTER / n) for n in PER_NAMESPACE)]).stdout.split()

    before = sysctls()
    assert before != ["7200", "45"]
    result = lab.run(ns, DaemonArgs(
        kubeconfig=tmp_path / "missing", node="a", min_sync_period=None, sync_period=None,
        healthz="", metrics="", extra=("--conntrack-tcp-timeout-established", "2h",
                                       "--conntrack-udp-timeout", "45s")).argv(), check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"pyproxy: kubeconfig {tmp_path}/missing "
                             "(clientConnection.kubeconfig, --kubeconfig): No such file or "
                             "directory\n")
    assert sysctls() == before
    assert "pyproxy" not in lab.run(ns, ["nft", "list", "tables"]).stdout


@pytest.mark.netns
@requires_netns
def test_a_node_that_needs_its_own_rules_to_reach_the_api_says_so(lab: Lab,
                                                                  tmp_path: Path) -> None:
    """A rebooted node with the kubelet's ClusterIP as API address: no rules, so the API
    server is never reached and no Service is ever known; pyproxy says at once what is wrong,
    in its log and in `pyproxy status`."""
    ns = lab.add_ns("trap")
    path = write(tmp_path, "kc", kubeconfig("https://10.96.0.1:443", token="t"))
    sock = str(tmp_path / "debug.sock")
    environ = {**os.environ, "KUBERNETES_SERVICE_HOST": "10.96.0.1",
               "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1"}
    argv = DaemonArgs(kubeconfig=path, node="a", min_sync_period=None, sync_period=None,
                      healthz="", metrics="", debug_socket=sock,
                      extra=("--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
                             "--conntrack-tcp-timeout-close-wait=0")).argv()
    proc = lab.popen(ns, argv, env=environ, log_name="trap.log")

    def status() -> dict[str, Any]:
        out = lab.run(ns, [PYPROXY, "status", "--socket", sock, "-o", "json"], check=False)
        return dict(json.loads(out.stdout)) if out.stdout.strip() else {}

    try:
        eventually(lambda: status().get("source", {}).get("apiServer"), "the status")
        api_server = status()["source"]["apiServer"]
        assert api_server["host"] == "10.96.0.1"
        assert api_server["problem"].startswith("10.96.0.1 is the kubernetes Service's ClusterIP")
        log = (lab.workdir / "trap.log").read_text()
        assert "level=warning event=api_server_via_service_address host=10.96.0.1" in log, log
    finally:
        lab.stop_process(proc)


def test_exec_credentials_come_from_the_clients_loader(tmp_path: Path) -> None:
    """An exec plugin (rare for a node proxy) still works, through the client's own loader."""
    plugin = tmp_path / "get-token"
    plugin.write_text("#!/bin/sh\necho '{\"apiVersion\": \"client.authentication.k8s.io/v1\", "
                      "\"kind\": \"ExecCredential\", \"status\": {\"token\": \"from-exec\"}}'\n")
    plugin.chmod(0o755)
    path = write(tmp_path, "kc", kubeconfig(exec={
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
        "interactiveMode": "Never"}))
    configuration = apiconnection.client_configuration(
        apiconnection.load(ProxyConfig(kubeconfig=path)))
    assert configuration.host == "https://api.example:6443"
    assert configuration.get_api_key_with_prefix("BearerToken") == "Bearer from-exec"
