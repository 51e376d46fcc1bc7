"""How pyproxy reaches the API server: a kubeconfig file, or the pod's service account.

Read the way client-go reads them for kube-proxy, not with the `kubernetes` client's loader:
- kubeadm's `kube-proxy` ConfigMap gives kube-proxy a kubeconfig whose user is
  `tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token`. The Python loader reads that
  file once; a bound service-account token expires (one hour, and the kubelet writes a new one
  at 80 % of its life), so client-go re-reads a token file every minute. So does `FileToken`.
- Every failure has to name the file and the field, and happen before pyproxy changes anything
  on the host: the loader's "Invalid kube-config file. No configuration found." and "Service
  host/port is not set." name neither. `load()` reads and checks every file it names at start.

Users with an exec plugin, an auth-provider or a username are handed to the `kubernetes`
client's loader (`ApiConnection.client_loader`): pyproxy does not reimplement those.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from pyproxy import yamlfile
from pyproxy.config import ConfigError, ProxyConfig
from pyproxy.core.model import ClusterState, ServiceKey
from pyproxy.lazy import submodule

log = structlog.get_logger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# A kubeconfig is a few KiB, a few hundred with many clusters' certificates inlined; what is
# far beyond is not one, and is refused before it is read whole.
MAX_KUBECONFIG_BYTES = 16 << 20
# client-go's cachingTokenSource over a fileTokenSource: a token file is read again once the
# copy in hand is a minute old, so a rotated bound token is picked up.
TOKEN_REREAD_SECONDS = 60.0
# Users whose credentials only the `kubernetes` client's loader knows how to get.
_CLIENT_LOADER_FIELDS = ("exec", "auth-provider", "username")
# TCP keepalive as client-go dials the API server (k8s.io/client-go transport/cache.go: a 30 s
# KeepAlive, which Go applies as 30 s idle, then probes 15 s apart, 9 of them): a connection
# whose peer is gone without a word (its host down, a route or a load balancer's state lost)
# fails ~165 s after its last byte, however long the watch's read timeout
# (cluster/watch.py). The `kubernetes` client leaves keepalive off unless asked.
KEEPALIVE_IDLE = 30
KEEPALIVE_INTERVAL = 15
KEEPALIVE_COUNT = 9


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiConnection:
    """The API server's address and the credentials to use there. Paths are absolute (a
    kubeconfig's relative paths are relative to its own directory, as in client-go)."""

    server: str
    source: str
    """Where this came from, for messages: the kubeconfig's path, or in-cluster."""
    ca_file: str | None = None
    ca_data: str | None = None
    cert_file: str | None = None
    cert_data: str | None = None
    key_file: str | None = None
    key_data: str | None = None
    token: str | None = None
    token_file: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    client_loader: bool = False
    """Credentials the `kubernetes` client's own loader must produce (exec, auth-provider)."""

    @property
    def host(self) -> str:
        """The server's host: an IP address or a DNS name, without brackets."""
        return urlsplit(self.server).hostname or ""

    def files(self) -> list[tuple[str, str]]:
        """(field, path) of every file this connection reads."""
        named = (("certificate-authority", self.ca_file), ("client-certificate", self.cert_file),
                 ("client-key", self.key_file), ("tokenFile", self.token_file))
        return [(name, path) for name, path in named if path]


def _join_host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_server(server: str, where: str) -> str:
    parts = urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: {server!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as err:
        raise ConfigError(f"{where}: {server!r}: {err}") from None
    return server.rstrip("/")


# ---------------------------------------------------------------------------------------------
# kubeconfig (pure: text in, ApiConnection out)


def _named(config: Mapping[str, Any], section: str, name: str, path: str) -> Mapping[str, Any]:
    entries = config.get(section) or []
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: {section}: expected a list")
    found = [e for e in entries if isinstance(e, dict) and e.get("name") == name]
    if len(found) != 1:
        problem = "not found" if not found else "defined more than once"
        raise ConfigError(f"{path}: {section}[name={name}]: {problem}")
    inner = found[0].get(section[:-1])  # clusters → cluster, users → user, contexts → context
    if inner is None:
        return {}
    if not isinstance(inner, dict):
        raise ConfigError(f"{path}: {section}[name={name}].{section[:-1]}: expected an object")
    return inner


def _context_name(config: Mapping[str, Any], path: str) -> str:
    name = config.get("current-context")
    if name:
        return str(name)
    contexts = config.get("contexts") or []
    if isinstance(contexts, list) and len(contexts) == 1 and isinstance(contexts[0], dict):
        return str(contexts[0].get("name", ""))
    raise ConfigError(f"{path}: current-context: not set, and there is not exactly one context")


def _text(section: Mapping[str, Any], key: str, where: str) -> str | None:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key}: expected a string")
    return value


def _decoded(section: Mapping[str, Any], key: str, where: str) -> str | None:
    """A `*-data` field: base64 of a PEM file."""
    import base64
    import binascii

    value = _text(section, key, where)
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ConfigError(f"{where}.{key}: not base64 of a PEM file") from None


def parse_kubeconfig(text: str, path: str) -> ApiConnection:
    """The current context's cluster and user. Raises ConfigError naming the file and the
    field at fault."""
    try:
        config = yamlfile.load(text)
    except yamlfile.DocumentError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(config, dict) or not config.get("clusters"):
        raise ConfigError(f"{path}: not a kubeconfig (no clusters)")
    base = os.path.dirname(os.path.abspath(path))

    def absolute(value: str | None) -> str | None:
        return value if value is None else os.path.join(base, value)

    context = _named(config, "contexts", _context_name(config, path), path)
    cluster_name, user_name = context.get("cluster"), context.get("user")
    if not cluster_name:
        raise ConfigError(f"{path}: the current context names no cluster")
    cluster = _named(config, "clusters", str(cluster_name), path)
    user = _named(config, "users", str(user_name), path) if user_name else {}
    where_cluster = f"{path}: clusters[name={cluster_name}].cluster"
    where_user = f"{path}: users[name={user_name}].user"
    server = _text(cluster, "server", where_cluster)
    if server is None:
        raise ConfigError(f"{where_cluster}.server: not set")
    return ApiConnection(
        server=_check_server(server, f"{where_cluster}.server"), source=path,
        ca_file=absolute(_text(cluster, "certificate-authority", where_cluster)),
        ca_data=_decoded(cluster, "certificate-authority-data", where_cluster),
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        tls_server_name=_text(cluster, "tls-server-name", where_cluster),
        cert_file=absolute(_text(user, "client-certificate", where_user)),
        cert_data=_decoded(user, "client-certificate-data", where_user),
        key_file=absolute(_text(user, "client-key", where_user)),
        key_data=_decoded(user, "client-key-data", where_user),
        token=_text(user, "token", where_user),
        token_file=absolute(_text(user, "tokenFile", where_user)),
        client_loader=any(user.get(key) for key in _CLIENT_LOADER_FIELDS),
    )


def in_cluster(environ: Mapping[str, str], master: str | None = None,
               directory: str = SERVICE_ACCOUNT_DIR) -> ApiConnection:
    """The pod's service account: its CA and token files, and the server from `master` or
    KUBERNETES_SERVICE_HOST/PORT (which the DaemonSet sets to the API server's real address)."""
    if master:
        server = master
    else:
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT")
        if host is None or port is None:
            raise ConfigError(
                "no kubeconfig (--kubeconfig, clientConnection.kubeconfig) and not in a pod "
                "(KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set): give a "
                "kubeconfig naming the API server")
        if not host or not port:
            raise ConfigError(
                "KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT is empty: set the API "
                "server's real address (the pyproxy ConfigMap's apiServerHost and "
                "apiServerPort, docs/deploying.md)")
        server = f"https://{_join_host_port(host, port)}"
    where = "--master" if master else "KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT"
    return ApiConnection(
        server=_check_server(server, where), source=f"in-cluster ({where})",
        ca_file=os.path.join(directory, "ca.crt"),
        token_file=os.path.join(directory, "token"))


# ---------------------------------------------------------------------------------------------
# Loading and checking (reads files, changes nothing)


def load(config: ProxyConfig, environ: Mapping[str, str] = os.environ,
         service_account_dir: str = SERVICE_ACCOUNT_DIR) -> ApiConnection:
    """The connection `config` asks for, every file it names read once. Raises ConfigError
    naming the setting or the file: `pyproxy run` calls this before it changes anything."""
    if config.kubeconfig:
        try:
            text = yamlfile.read_limited(config.kubeconfig, MAX_KUBECONFIG_BYTES,
                                         "a kubeconfig").decode()
        except (OSError, UnicodeDecodeError, yamlfile.TooLargeError) as err:
            raise ConfigError(f"kubeconfig {config.kubeconfig} (clientConnection.kubeconfig, "
                              f"--kubeconfig): {getattr(err, 'strerror', None) or err}") from None
        connection = parse_kubeconfig(text, config.kubeconfig)
        if config.master:
            connection = _with_server(connection, config.master)
    else:
        connection = in_cluster(environ, config.master, service_account_dir)
    check_files(connection)
    return connection


def _with_server(connection: ApiConnection, master: str) -> ApiConnection:
    from dataclasses import replace

    return replace(connection, server=_check_server(master, "--master"))


def check_files(connection: ApiConnection) -> None:
    """Every file the connection names can be read (a token file is not empty), and the
    certificates are what TLS will need: at start, not at the first request's retries."""
    for name, path in connection.files():
        try:
            content = Path(path).read_bytes()
        except OSError as err:
            raise ConfigError(f"{connection.source}: {name} {path}: "
                              f"{err.strerror or err}") from None
        if name == "tokenFile" and not content.strip():
            raise ConfigError(f"{connection.source}: {name} {path}: empty")
    if urlsplit(connection.server).scheme == "https":
        _check_tls(connection)


def _check_tls(connection: ApiConnection) -> None:
    """Load the CA and the client certificate into a TLS context, as urllib3 will."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    checks: list[tuple[str, Callable[[], None]]] = []
    if not connection.insecure and connection.ca_file:
        ca_file = connection.ca_file
        checks.append((f"certificate-authority {ca_file}",
                       lambda: context.load_verify_locations(cafile=ca_file)))
    if not connection.insecure and connection.ca_data:
        ca_data = connection.ca_data
        checks.append(("certificate-authority-data",
                       lambda: context.load_verify_locations(cadata=ca_data)))
    if connection.cert_file and connection.key_file:
        cert, key = connection.cert_file, connection.key_file
        checks.append((f"client-certificate {cert} and client-key {key}",
                       lambda: context.load_cert_chain(cert, key)))
    for what, check in checks:
        try:
            check()
        except (ssl.SSLError, ValueError) as err:
            reason = getattr(err, "reason", None) or str(err)
            raise ConfigError(f"{connection.source}: {what}: not usable for TLS "
                              f"({reason})") from None


class FileToken:
    """A bearer token read from a file, read again when the copy in hand is older than
    TOKEN_REREAD_SECONDS (client-go's cached file token source). A failed re-read keeps the
    old token: it may still be valid, and the API server will say when it is not."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()
        self._token = self._read()
        self._read_at = clock()

    def _read(self) -> str:
        return Path(self.path).read_text(encoding="utf-8").strip()

    def current(self) -> str:
        with self._lock:
            if self.clock() - self._read_at >= TOKEN_REREAD_SECONDS:
                try:
                    self._token = self._read()
                except (OSError, UnicodeDecodeError) as err:
                    log.warning("token_file_not_read", path=self.path, error=str(err))
                self._read_at = self.clock()
            return self._token

    def __call__(self, configuration: Any) -> None:
        """The client's refresh_api_key_hook, called before each request is signed."""
        configuration.api_key["BearerToken"] = self.current()


def _data_file(text: str, suffix: str) -> str:
    """Inline certificate data as a file, for the TLS library (the root filesystem may be
    read-only: the temporary directory is a writable emptyDir in the DaemonSet)."""
    handle, path = tempfile.mkstemp(prefix="pyproxy-", suffix=suffix)
    with os.fdopen(handle, "w") as out:
        out.write(text)
    return path


def keepalive_socket_options() -> list[tuple[int, int, int]]:
    """urllib3's socket options for every connection to the API server: urllib3's own
    (TCP_NODELAY; a list given replaces them) and TCP keepalive as client-go's."""
    from urllib3.connection import HTTPConnection

    return [*HTTPConnection.default_socket_options,
            (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)]


def client_configuration(connection: ApiConnection,
                         clock: Callable[[], float] = time.monotonic) -> Any:
    """A `kubernetes.client.Configuration` for the connection (`clock` times the token
    file's re-reads), its connections with TCP keepalive."""
    client = submodule("kubernetes.client")
    configuration = client.Configuration()
    configuration.socket_options = keepalive_socket_options()
    if connection.client_loader:
        _load_with_client(connection, configuration)  # sets no socket options
        return configuration
    configuration.host = connection.server
    configuration.ssl_ca_cert = connection.ca_file
    if connection.ca_data:
        configuration.ca_cert_data = connection.ca_data
    configuration.verify_ssl = not connection.insecure
    configuration.tls_server_name = connection.tls_server_name
    configuration.cert_file = connection.cert_file or (
        _data_file(connection.cert_data, ".crt") if connection.cert_data else None)
    configuration.key_file = connection.key_file or (
        _data_file(connection.key_data, ".key") if connection.key_data else None)
    configuration.api_key_prefix["BearerToken"] = "Bearer"
    if connection.token_file:
        token = FileToken(connection.token_file, clock)
        # The client asks the hook only for a key it already holds.
        configuration.api_key["BearerToken"] = token.current()
        configuration.refresh_api_key_hook = token
    elif connection.token:
        configuration.api_key["BearerToken"] = connection.token
    return configuration


def _load_with_client(connection: ApiConnection, configuration: Any) -> None:
    from kubernetes import config as kube_config
    from kubernetes.config.config_exception import ConfigException

    try:
        kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=connection.source, client_configuration=configuration,
            persist_config=False)
    except (ConfigException, OSError, ValueError) as err:
        raise ConfigError(f"{connection.source}: {err}") from None
    configuration.host = connection.server


# ---------------------------------------------------------------------------------------------
# The bootstrap trap (pure)

KUBERNETES_SERVICE = ServiceKey("default", "kubernetes")
# Names that only cluster DNS answers, and with the `kubernetes` Service's ClusterIP.
_CLUSTER_DNS_SUFFIXES = (".svc", ".svc.cluster.local")
_KUBERNETES_SERVICE_NAMES = ("kubernetes", "kubernetes.default")


def kubelet_cluster_ips(environ: Mapping[str, str]) -> frozenset[str]:
    """The `kubernetes` Service's ClusterIP as the kubelet tells every pod, whatever the pod
    spec sets KUBERNETES_SERVICE_HOST to: KUBERNETES_PORT_<port>_TCP_ADDR (always injected,
    even with enableServiceLinks off)."""
    return frozenset(value for key, value in environ.items()
                     if key.startswith("KUBERNETES_PORT_") and key.endswith("_TCP_ADDR")
                     and value)


def service_address_problem(host: str, state: ClusterState,
                            kubelet_ips: frozenset[str] = frozenset()) -> str | None:
    """Why reaching the API server at `host` depends on a service proxy's rules (None: it does
    not, as far as pyproxy can see). A node that reboots comes up with no rules: a pyproxy that
    needs rules to reach the API server never programs it. `kubelet_ips` (from the pod's
    environment) tells before any Service is known."""
    try:
        address = ip_address(host)
    except ValueError:
        name = host.rstrip(".").lower()
        if name.endswith(_CLUSTER_DNS_SUFFIXES) or name in _KUBERNETES_SERVICE_NAMES:
            return (f"{host} is a cluster DNS name: resolving it needs CoreDNS's ClusterIP, "
                    f"and reaching it the kubernetes Service's, both programmed by the proxy")
        return None
    if any(_same_address(address, ip) for ip in kubelet_ips):
        return (f"{host} is the kubernetes Service's ClusterIP (the kubelet's "
                f"KUBERNETES_PORT_*_TCP_ADDR): it works only while some proxy's rules for it "
                f"are in the kernel")
    ports = state.ports_by_service.get(KUBERNETES_SERVICE, ())
    if any(ip_address(ip) == address for port in ports for ip in port.cluster_ips):
        return (f"{host} is a ClusterIP of the default/kubernetes Service: it works only "
                f"while some proxy's rules for it are in the kernel")
    for cidr in state.service_cidrs:
        if address in ip_network(cidr):
            return (f"{host} is inside the service CIDR {cidr}: a Service address works only "
                    f"while some proxy's rules for it are in the kernel")
    return None


def _same_address(address: IPv4Address | IPv6Address, text: str) -> bool:
    try:
        return ip_address(text) == address
    except ValueError:
        return False
