"""Failures of the API connection an operator can see (issue 35, point 4): the reason of a
refusal or of a TLS failure reaches the log whole, every request is counted as client-go
counts it, each watch's state is a metric, and `pyproxy status` says when a watch has been
down too long. Against the API emulator over a socket, with the real `kubernetes` client."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from kubernetes import client as kubernetes_client

from pyproxy import cli, run
from pyproxy.cluster import apiconnection, watchstate
from pyproxy.cluster.apiconnection import ApiConnection
from pyproxy.cluster.apirequest import REASON_LIMIT, describe_error, observe_requests
from pyproxy.cluster.events import record_start
from pyproxy.cluster.resources import services_resource
from pyproxy.cluster.sources import ApiSource
from pyproxy.cluster.watch import Reflector
from pyproxy.cluster.watchstate import (
    CONNECTED,
    CONNECTING,
    DISCONNECTED,
    WatchStatus,
    watch_problems,
)
from pyproxy.config import ProxyConfig
from pyproxy.serve import servers as serving
from pyproxy.serve.debug import DebugError, ask
from pyproxy.serve.metrics import Metrics
from testkit.apiemu import ApiEmulator
from testkit.controlplane import make_pki
from testkit.waits import until

SERVICE_ACCOUNT = "system:serviceaccount:kube-system:pyproxy"
RBAC_MESSAGE = (f'services is forbidden: User "{SERVICE_ACCOUNT}" cannot list resource '
                f'"services" in API group "" at the cluster scope')


def start(reflector: Reflector) -> threading.Thread:
    reflector._backoff.initial, reflector._backoff.cap = 0.05, 0.2  # fast retries in tests
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def reflect() -> Iterator[Callable[[Any], Reflector]]:
    """A Reflector of Services through an API client, running until the test ends."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def make(api_client: Any) -> Reflector:
        reflector = Reflector(api_client, services_resource(), lambda key, obj: None,
                              lambda: None, stop, watch_timeout=30, read_timeout=2.0)
        threads.append(start(reflector))
        return reflector

    yield make
    stop.set()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def errors_logged(captured: list[dict[str, Any]]) -> list[str]:
    return [entry["error"] for entry in captured if entry["event"] == "api_unavailable_retrying"]


def test_a_refusal_is_logged_with_rbacs_message(reflect: Callable[[Any], Reflector]) -> None:
    """A 403 reaches the log as its status and its Status message, whatever headers the
    server sent (the client's text starts with all of them: cut at 300 characters it ended
    at `"status": "Fail`)."""
    with ApiEmulator() as api, structlog.testing.capture_logs() as captured:
        api.forbid(SERVICE_ACCOUNT)
        reflector = reflect(api.api_client())
        until(lambda: reflector.status.errors >= 1, 10, "a refused list")
        assert reflector.status.last_error == f"403 Forbidden: {RBAC_MESSAGE}"
    assert errors_logged(captured)[0] == f"403 Forbidden: {RBAC_MESSAGE}"


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """Two certificate authorities: the API server's, and another."""
    base = tmp_path_factory.mktemp("pki")
    return make_pki(base / "cluster"), make_pki(base / "other")


def tls_client(api: ApiEmulator, ca: Path) -> Any:
    connection = ApiConnection(server=api.url, source="test", ca_file=str(ca))
    return kubernetes_client.ApiClient(apiconnection.client_configuration(connection))


def test_a_tls_failure_is_logged_with_its_reason(reflect: Callable[[Any], Reflector],
                                                 pkis: tuple[Any, Any]) -> None:
    """A server whose certificate the CA given does not sign: the log says the certificate
    failed verification and why (cut at 300 characters it ended at `[SSL: CER`, after the
    whole URL)."""
    cluster, other = pkis
    with ApiEmulator(tls=(cluster.server, cluster.server_key)) as api, \
            structlog.testing.capture_logs() as captured:
        trusted = reflect(tls_client(api, cluster.ca))
        refused = reflect(tls_client(api, other.ca))
        until(lambda: trusted.status.synced, 10, "a list over TLS with the right CA")
        until(lambda: refused.status.errors >= 1, 10, "a refused handshake")
        last_error = refused.status.last_error
        assert trusted.status.errors == 0
    [error, *_] = errors_logged(captured)
    assert error.startswith("SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED] "
                            "certificate verify failed: unable to get local issuer certificate")
    assert error.endswith(f"({api.host}:{api.port})")
    assert last_error == error


@pytest.mark.parametrize(("body", "expected"), [
    pytest.param('{"kind":"Status","message":"nope","reason":"Forbidden","code":403}',
                 "403 Forbidden: nope", id="a Status: its message"),
    pytest.param('{"kind":"Status","reason":"Forbidden","code":403}',
                 "403 Forbidden: Forbidden", id="a Status without a message: its reason"),
    pytest.param("<html>\n<b>bad gateway</b>\n</html>", "403 Forbidden: <html> <b>bad "
                 "gateway</b> </html>", id="another body: on one line"),
    pytest.param("", "403 Forbidden", id="no body"),
])
def test_an_answer_is_described_by_its_status(body: str, expected: str) -> None:
    from kubernetes.client.exceptions import ApiException

    assert describe_error(ApiException(403, "Forbidden", body=body)) == expected


def test_a_giant_body_is_cut_after_the_reason() -> None:
    from kubernetes.client.exceptions import ApiException

    text = describe_error(ApiException(502, "Bad Gateway", body="x" * 100_000))
    assert text.startswith("502 Bad Gateway: xxx") and len(text) == REASON_LIMIT


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_every_request_is_counted_as_client_go_counts_it(
        reflect: Callable[[Any], Reflector]) -> None:
    """rest_client_requests_total{code, method, host} and rest_client_request_duration_seconds
    {verb, host} for every request through the client: lists, watches, the start Event; a
    request that got no answer as code "<error>". And the watch's state beside them."""
    metrics = Metrics()
    with ApiEmulator(bookmark_interval=0.2) as api:
        host = f"{api.host}:{api.port}"
        api_client = observe_requests(api.api_client(), metrics)
        reflector = reflect(api_client)
        metrics.watch_api(lambda: [reflector.status])

        def requests(code: str, method: str = "GET") -> float:
            return sample(metrics, "rest_client_requests_total", code=code, method=method,
                          host=host)

        def state(name: str) -> float:
            return sample(metrics, "pyproxy_watch_state", resource="Service", state=name)

        until(lambda: reflector.status.synced, 10, "the list")
        api.wait_for_watches(1, "services")
        assert requests("200") >= 2  # the list, the watch
        assert (state("connected"), state("disconnected"), state("connecting")) == (1, 0, 0)
        record_start(api_client, "node-a", threading.Event()).join(10)
        assert requests("201", "POST") == 1
        api.forbid(SERVICE_ACCOUNT)
        until(lambda: requests("403") >= 1, 10, "a refused request")
        assert (state("connected"), state("disconnected")) == (0, 1)
        api.forbid(None)
        api.set_available(False, "refuse")
        until(lambda: requests("<error>") >= 1, 10, "a request without an answer")
    answered = sum(requests(code) for code in ("200", "403", "<error>"))
    assert sample(metrics, "rest_client_request_duration_seconds_count", verb="GET",
                  host=host) == answered
    assert sample(metrics, "rest_client_request_duration_seconds_count", verb="POST",
                  host=host) == 1


def test_a_watch_that_never_answered_is_connecting_then_disconnected() -> None:
    status = WatchStatus("Service", state_since=1000.0)
    assert (status.state, status.down_for(1010.0)) == (CONNECTING, 10.0)
    status.set_connected(False, now=1005.0)  # the first try failed: down since the start
    assert (status.state, status.down_for(1010.0)) == (DISCONNECTED, 10.0)
    status.set_connected(True, now=1020.0)
    assert (status.state, status.down_for(1030.0)) == (CONNECTED, 0.0)
    status.set_connected(False, now=1040.0)
    assert status.down_for(1050.0) == 10.0


@pytest.fixture
def daemon_on(tmp_path: Path) -> Iterator[Callable[[ApiEmulator], str]]:
    """The daemon's parts as `pyproxy run` builds them, fed by the emulator, its debug
    socket served (no rules are written: the sync loop is not run)."""
    stop = threading.Event()
    servers: list[Any] = []

    def start_on(api: ApiEmulator) -> str:
        socket_path = str(tmp_path / "debug.sock")
        config = ProxyConfig(healthz_bind_address=None, metrics_bind_address=None,
                             debug_socket=socket_path, hostname_override="node-a")
        daemon = run.build_daemon(config, interface_ips=("192.168.50.1",),
                                  api_client=api.api_client(), stop=stop)
        assert isinstance(daemon.source, ApiSource)
        for reflector_thread in daemon.source.start(daemon.proxier):
            assert reflector_thread.is_alive()
        servers.append(serving.start_debug(config, daemon.proxier, daemon.health,
                                           daemon.runner, daemon.source))
        return socket_path

    yield start_on
    stop.set()
    for server in servers:
        server.stop()


def status_command(socket_path: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["status", "--socket", socket_path])
    return code, capsys.readouterr().out


def test_status_fails_when_a_watch_is_down_too_long(
        daemon_on: Callable[[ApiEmulator], str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every watch refused (403) since the start: `pyproxy status` said "healthy: yes" and
    exited 0. Past the bound (2 minutes; a second here) it exits 1 and says which watch,
    for how long, and why."""
    monkeypatch.setattr(watchstate, "DISCONNECTED_BOUND", 1.0)
    with ApiEmulator() as api:
        api.forbid(SERVICE_ACCOUNT)
        socket_path = daemon_on(api)
        until(lambda: ask(socket_path, "/status")["source"]["problems"], 10,
              "the watches down for more than the bound", ignore=(DebugError,))
        code, out = status_command(socket_path, capsys)
        assert code == 1, out
        [service] = [line for line in out.splitlines() if "watch Service " in line
                     and line.startswith("api watches:")]
        assert service.startswith("api watches:       FAILING: watch Service disconnected for ")
        assert f"(more than 1 s, never listed): 403 Forbidden: {RBAC_MESSAGE}" in service
        assert "watch Service       DISCONNECTED" in out
        # Served again: every watch lists, and status is well again.
        api.forbid(None)
        until(lambda: not ask(socket_path, "/status")["source"]["problems"], 20,
              "the watches back")
        code, out = status_command(socket_path, capsys)
        assert code == 0, out
        assert "FAILING" not in out


@pytest.mark.parametrize(("since", "state", "synced", "problems"), [
    pytest.param(0.0, CONNECTED, True, [], id="connected for long: well"),
    pytest.param(500.0, DISCONNECTED, True, [], id="down for less than the bound: well"),
    pytest.param(500.0, CONNECTING, False, [], id="starting: well"),
    pytest.param(300.0, DISCONNECTED, True,
                 ["watch Node disconnected for 300 s (more than 120 s): 403 Forbidden: no"],
                 id="down for longer"),
    pytest.param(0.0, CONNECTING, False,
                 ["watch Node connecting for 600 s (more than 120 s, never listed): "
                  "403 Forbidden: no"], id="never answered"),
])
def test_watch_problems(since: float, state: str, synced: bool, problems: list[str]) -> None:
    status = WatchStatus("Node", synced=synced, state=state, state_since=since,
                         last_error="403 Forbidden: no")
    assert watch_problems([status], now=600.0) == problems
