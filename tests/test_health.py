"""/healthz, /livez and the health-check node ports, over real HTTP on loopback.

Cloud load balancers act on these answers, so the status codes, bodies and headers are
checked against upstream kube-proxy's (reference §5.1, §5.2). Time is a fake clock: nothing
here sleeps.
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pyproxy.cluster.cache import Checkout, ClusterCache
from pyproxy.core.convert_endpoints import convert_node
from pyproxy.core.model import IPFamily, Node, ServiceKey
from pyproxy.core.nodeconfig import NodeConfig
from pyproxy.core.plan import Cause, Scope
from pyproxy.serve.health import (
    HealthServer,
    ProxyHealth,
    ServiceHealth,
    ServiceHealthServers,
    parse_host_port,
)
from pyproxy.serve.metrics import Metrics
from pyproxy.serve.reporting import HealthCheckNodePorts, SyncReporting
from pyproxy.sync.node import NodeProxier, SyncRecord
from pyproxy.sync.proxier import FamilyProxier
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fakes import FakeNft

V4, V6 = IPFamily.IPv4, IPFamily.IPv6
WEB = ServiceKey("ns", "web")
DB = ServiceKey("ns", "db")
START = 1_700_000_000.25  # 2023-11-14T22:13:20.25Z
START_TEXT = "2023-11-14T22:13:20.25Z"
TIMEOUT = 60.0  # 2 × the default syncPeriod


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


HAS_IPV6 = _has_ipv6_loopback()
needs_ipv6 = pytest.mark.skipif(not HAS_IPV6, reason="no ::1 in this environment")


@dataclass
class Clock:
    now: float

    def __call__(self) -> float:
        return self.now


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(host: str, port: int, path: str = "/", method: str = "GET") -> Answer:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return Answer(resp.status, resp.headers, resp.read())
    finally:
        conn.close()


def refused(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        try:
            sock.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def free_port(*hosts: str) -> int:
    """A TCP port free on every one of `hosts` (at the time of asking)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no free port")


def occupy(host: str, port: int) -> socket.socket:
    """Someone else listening on host:port (IPv6 sockets v6-only, to occupy only ::1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


def node(tweak: dict[str, Any] | None = None) -> Node:
    obj = make_node("node-a", "zone-1")
    for key, value in (tweak or {}).items():
        obj.setdefault(key, {}).update(value)
    converted = convert_node(obj)
    assert isinstance(converted, Node)
    return converted


ELIGIBLE = node()


# ---------------------------------------------------------------------------------------------
# /healthz and /livez


@dataclass
class Healthz:
    health: ProxyHealth
    mono: Clock
    wall: Clock
    metrics: Metrics
    server: HealthServer
    host: str = "127.0.0.1"
    served: list[str] = field(default_factory=list)

    def get(self, path: str, method: str = "GET") -> Answer:
        return request(self.host, self.server.port, path, method)

    def advance(self, seconds: float) -> None:
        self.mono.now += seconds
        self.wall.now += seconds

    def count(self, metric: str, code: int) -> float:
        value = self.metrics.registry.get_sample_value(metric, {"code": str(code)})
        return value or 0.0


def start_healthz(address: str = "127.0.0.1:0",
                  families: tuple[IPFamily, ...] = (V4, V6)) -> Healthz:
    mono, wall = Clock(1000.0), Clock(START)
    health = ProxyHealth(families, timeout=TIMEOUT, clock=mono, wall_clock=wall)
    metrics = Metrics()
    server = HealthServer(address, health, metrics.count_health)
    server.start()
    host, _, _ = parse_host_port(address)
    return Healthz(health, mono, wall, metrics, server, host)


@pytest.fixture
def hz() -> Iterator[Healthz]:
    h = start_healthz()
    h.health.set_node(ELIGIBLE)
    yield h
    h.server.stop()


def test_healthy_answers_carry_kube_proxys_body_and_headers(hz: Healthz) -> None:
    hz.wall.now = START + 30  # lastUpdated of the families stays at START
    for path in ("/healthz", "/livez"):
        answer = hz.get(path)
        assert answer.status == 200
        assert answer.headers["Content-Type"] == "application/json"
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert answer.headers["Content-Length"] == str(len(answer.body))
        assert answer.headers["Server"] is None  # like Go: no software version disclosed
        body = answer.json()
        now = "2023-11-14T22:13:50.25Z"
        family_status = {"IPv4": {"lastUpdated": START_TEXT, "healthy": True},
                         "IPv6": {"lastUpdated": START_TEXT, "healthy": True}}
        if path == "/healthz":
            # Field order as Go marshals upstream's ProxyHealth struct.
            assert list(body) == ["lastUpdated", "currentTime", "nodeEligible", "healthy",
                                  "status"]
            assert body["nodeEligible"] is True
        else:
            assert list(body) == ["lastUpdated", "currentTime", "healthy", "status"]
        # A 200 reports "now" as lastUpdated (upstream's backward compatibility).
        assert body["lastUpdated"] == now and body["currentTime"] == now
        assert body["healthy"] is True
        assert body["status"] == family_status
    # Byte for byte what Go's json.Marshal writes (compact).
    assert hz.get("/healthz").body == (
        b'{"lastUpdated":"2023-11-14T22:13:50.25Z","currentTime":"2023-11-14T22:13:50.25Z",'
        b'"nodeEligible":true,"healthy":true,"status":{'
        b'"IPv4":{"lastUpdated":"2023-11-14T22:13:20.25Z","healthy":true},'
        b'"IPv6":{"lastUpdated":"2023-11-14T22:13:20.25Z","healthy":true}}}')


def test_times_are_rfc3339_like_go() -> None:
    h = start_healthz(families=(V6, V4))  # IPv6-primary: Go still sorts the map keys
    try:
        h.wall.now = 1_700_000_000.0  # whole second: no fraction at all
        body = h.get("/livez").json()
        assert body["currentTime"] == "2023-11-14T22:13:20Z"
        assert list(body["status"]) == ["IPv4", "IPv6"]
        h.wall.now = 1_700_000_000.5
        assert h.get("/livez").json()["currentTime"] == "2023-11-14T22:13:20.5Z"
    finally:
        h.server.stop()


def test_an_update_queued_too_long_makes_the_proxy_unhealthy(hz: Healthz) -> None:
    hz.health.queued()
    hz.advance(TIMEOUT - 0.001)
    assert hz.get("/healthz").status == 200 and hz.get("/livez").status == 200
    hz.advance(0.001)  # exactly 2 × syncPeriod: late (upstream's `< healthTimeout` is healthy)
    for path in ("/healthz", "/livez"):
        answer = hz.get(path)
        assert answer.status == 503
        assert answer.headers["Content-Type"] == "application/json"
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        body = answer.json()
        assert body["healthy"] is False
        # A 503 reports the real last update, not "now".
        assert body["lastUpdated"] == START_TEXT
        assert body["currentTime"] != START_TEXT
    assert hz.get("/healthz").json()["nodeEligible"] is True  # the node is not the problem
    hz.health.updated()
    assert hz.get("/healthz").status == 200 and hz.get("/livez").status == 200


def test_unhealthy_answers_say_why(hz: Healthz) -> None:
    assert "reason" not in hz.get("/healthz").json()
    hz.health.sync_failed("Error: Could not process rule: Device or resource busy\nadd …")
    hz.advance(TIMEOUT)
    for path in ("/healthz", "/livez"):
        assert hz.get(path).json()["reason"] == (
            "rules not updated for IPv4 (60.0 s), IPv6 (60.0 s) (more than 60 s); the last "
            "sync failed: Error: Could not process rule: Device or resource busy")
    hz.health.updated()
    assert "reason" not in hz.get("/healthz").json()


def test_a_damaged_data_plane_fails_healthz_at_once_but_not_livez(hz: Healthz) -> None:
    """Someone else changed our tables: /healthz is 503 (with the reason) until the repair
    has succeeded, however fresh the last sync; /livez is about the process and stays 200."""
    damage: list[str] = ["table changed by someone else: ip pyproxy: chain services deleted"]
    hz.health.damage = lambda: damage[0] if damage else None
    answer = hz.get("/healthz")
    assert answer.status == 503
    body = answer.json()
    assert body["healthy"] is False and body["nodeEligible"] is True
    assert body["reason"] == damage[0]
    assert body["status"]["IPv4"]["healthy"] is True  # the rules were programmed in time
    livez = hz.get("/livez")
    assert livez.status == 200 and "reason" not in livez.json()
    assert not hz.health.healthy()
    damage.clear()
    assert hz.get("/healthz").status == 200 and hz.health.healthy()


def test_one_stale_family_is_enough(hz: Healthz) -> None:
    hz.health.queued()
    hz.advance(10)
    hz.health.updated([V4])  # IPv4 programmed its rules; IPv6 did not
    v4_update = "2023-11-14T22:13:30.25Z"
    hz.advance(TIMEOUT)
    answer = hz.get("/livez")
    assert answer.status == 503
    body = answer.json()
    assert body["healthy"] is False
    assert body["status"] == {"IPv4": {"lastUpdated": v4_update, "healthy": True},
                              "IPv6": {"lastUpdated": START_TEXT, "healthy": False}}
    assert body["lastUpdated"] == v4_update  # the newest of the families, as upstream
    assert hz.get("/healthz").status == 503
    hz.health.updated([V6])
    assert hz.get("/livez").status == 200 and hz.get("/healthz").status == 200


def test_the_oldest_queued_update_counts(hz: Healthz) -> None:
    hz.health.queued()
    hz.advance(TIMEOUT / 2)
    hz.health.queued()  # a later request does not restart the timer
    hz.advance(TIMEOUT / 2)
    assert hz.get("/livez").status == 503


def test_no_pending_update_is_healthy_however_old_the_last_one(hz: Healthz) -> None:
    hz.advance(7 * 86400)
    assert hz.get("/healthz").status == 200
    body = hz.get("/livez").json()
    assert body["healthy"] is True
    assert body["status"]["IPv4"] == {"lastUpdated": START_TEXT, "healthy": True}


@pytest.mark.parametrize("tweak", [
    pytest.param({"metadata": {"deletionTimestamp": "2023-11-14T22:00:00Z"}}, id="deleting"),
    pytest.param({"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler",
                                       "value": "1700000000", "effect": "NoSchedule"}]}},
                 id="autoscaler taint"),
])
def test_node_going_away_fails_healthz_but_not_livez(hz: Healthz, tweak: dict[str, Any]) -> None:
    hz.health.set_node(node(tweak))
    answer = hz.get("/healthz")
    assert answer.status == 503
    body = answer.json()
    assert body["nodeEligible"] is False
    assert body["healthy"] is True  # the rules are fine: only the node is draining
    assert hz.get("/livez").status == 200
    hz.health.set_node(ELIGIBLE)  # e.g. the scale-down was cancelled
    assert hz.get("/healthz").status == 200


def test_other_taints_keep_the_node_eligible(hz: Healthz) -> None:
    hz.health.set_node(node({"spec": {"taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
        {"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"}]}}))
    assert hz.get("/healthz").status == 200


def test_unknown_node_is_not_eligible() -> None:
    """Upstream's newest NodeManager: eligibility needs the Node object (nil → false). Older
    kube-proxy assumed eligible until the first Node event; pyproxy follows the newest."""
    h = start_healthz()
    try:
        answer = h.get("/healthz")
        assert answer.status == 503 and answer.json()["nodeEligible"] is False
        assert h.get("/livez").status == 200
        h.health.set_node(ELIGIBLE)
        assert h.get("/healthz").status == 200
        h.health.set_node(None)  # the Node object went away
        assert h.get("/healthz").status == 503
    finally:
        h.server.stop()


@pytest.mark.parametrize("path", ["/", "/metrics", "/healthz/", "/healthzx", "/live",
                                  "/debug/pprof/", "/configz", "/../etc/passwd"])
def test_other_paths_are_404_and_leak_nothing(hz: Healthz, path: str) -> None:
    answer = hz.get(path)
    assert answer.status == 404
    assert answer.body == b"404 page not found\n"  # Go's NotFound, nothing of ours
    assert answer.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert answer.headers["X-Content-Type-Options"] == "nosniff"
    assert answer.headers["Server"] is None
    assert hz.count("kubeproxy_proxy_healthz_total", 404) == 0
    assert hz.count("kubeproxy_proxy_livez_total", 404) == 0


def test_query_strings_are_ignored(hz: Healthz) -> None:
    assert hz.get("/healthz?verbose=1").status == 200
    assert hz.get("/livez?x").status == 200


def test_head_answers_without_a_body(hz: Healthz) -> None:
    full = hz.get("/healthz")
    head = hz.get("/healthz", "HEAD")
    assert head.status == 200 and head.body == b""
    assert head.headers["Content-Type"] == "application/json"
    assert head.headers["Content-Length"] == str(len(full.body))  # same clock, same body
    hz.health.set_node(None)
    assert hz.get("/healthz", "HEAD").status == 503
    assert hz.get("/livez", "HEAD").status == 200


def test_answers_are_counted_by_code(hz: Healthz) -> None:
    hz.get("/healthz")
    hz.get("/healthz", "HEAD")
    hz.get("/livez")
    hz.health.queued()
    hz.advance(TIMEOUT)
    hz.get("/healthz")
    hz.get("/livez")
    hz.get("/livez")
    hz.get("/nothing")
    assert hz.count("kubeproxy_proxy_healthz_total", 200) == 2
    assert hz.count("kubeproxy_proxy_healthz_total", 503) == 1
    assert hz.count("kubeproxy_proxy_livez_total", 200) == 1
    assert hz.count("kubeproxy_proxy_livez_total", 503) == 2


@needs_ipv6
def test_healthz_on_ipv6() -> None:
    h = start_healthz("[::1]:0")
    try:
        h.health.set_node(ELIGIBLE)
        assert h.host == "::1"
        assert h.get("/healthz").status == 200
    finally:
        h.server.stop()


def test_parse_host_port() -> None:
    assert parse_host_port("0.0.0.0:10256") == ("0.0.0.0", 10256, socket.AF_INET)
    assert parse_host_port("[::]:10256") == ("::", 10256, socket.AF_INET6)
    assert parse_host_port("[fd00::1]:1") == ("fd00::1", 1, socket.AF_INET6)
    assert parse_host_port(":10256") == ("0.0.0.0", 10256, socket.AF_INET)


def test_a_health_server_never_started_stops_at_once() -> None:
    health = ProxyHealth((V4,))
    server = HealthServer("127.0.0.1:0", health)
    server.stop()  # must not wait for a serving loop that never ran
    server.stop()  # nor fail when stopped twice
    assert refused("127.0.0.1", server.port)


def test_the_healthz_port_taken_is_an_error_for_the_caller() -> None:
    """run.py decides (bindAddressHardFail or log); the server itself must raise."""
    with occupy("127.0.0.1", 0) as taken, pytest.raises(OSError) as err:
        HealthServer(f"127.0.0.1:{taken.getsockname()[1]}", ProxyHealth((V4,)))
    assert err.value.errno == errno.EADDRINUSE


# ---------------------------------------------------------------------------------------------
# Health-check node ports


@dataclass
class Hcnp:
    health: ServiceHealth
    proxy: ProxyHealth
    mono: Clock
    servers: ServiceHealthServers

    def serve(self, ports: dict[ServiceKey, int], counts: dict[ServiceKey, int]) -> None:
        self.health.update(ports, counts)
        self.servers.sync()


def start_hcnp(*addresses: str) -> Hcnp:
    mono = Clock(1000.0)
    # No Node known: the node-port checks must not care (only /healthz does).
    proxy = ProxyHealth((V4, V6), timeout=TIMEOUT, clock=mono, wall_clock=Clock(START))
    health = ServiceHealth()
    return Hcnp(health, proxy, mono, ServiceHealthServers(health, proxy, addresses))


@pytest.fixture
def hcnp() -> Iterator[Hcnp]:
    h = start_hcnp("127.0.0.1")
    yield h
    h.servers.stop()


def expected_body(service: ServiceKey, count: int, healthy: bool,
                  reason: str | None = None) -> bytes:
    # Upstream's dedented template, byte for byte (tab indentation, no trailing newline);
    # pyproxy adds why the proxy is unhealthy.
    why = f",\n\t\"reason\": {json.dumps(reason)}" if reason else ""
    return (
        "{\n"
        "\t\"service\": {\n"
        f"\t\t\"namespace\": \"{service.namespace}\",\n"
        f"\t\t\"name\": \"{service.name}\"\n"
        "\t},\n"
        f"\t\"localEndpoints\": {count},\n"
        f"\t\"serviceProxyHealthy\": {'true' if healthy else 'false'}{why}\n"
        "}"
    ).encode()


def test_a_listener_per_service_open_while_the_service_exists(hcnp: Hcnp) -> None:
    web, db = free_port("127.0.0.1"), free_port("127.0.0.1")
    hcnp.serve({WEB: web, DB: db}, {WEB: 2, DB: 1})
    assert hcnp.servers.failures == {}
    answer = request("127.0.0.1", web, "/any/path?at=all")
    assert answer.status == 200
    assert answer.body == expected_body(WEB, 2, True)
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.headers["X-Content-Type-Options"] == "nosniff"
    assert answer.headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert answer.headers["Server"] is None
    assert json.loads(answer.body) == {"service": {"namespace": "ns", "name": "web"},
                                       "localEndpoints": 2, "serviceProxyHealthy": True}
    assert request("127.0.0.1", db).headers["X-Load-Balancing-Endpoint-Weight"] == "1"
    hcnp.serve({DB: db}, {DB: 1})  # web deleted (or no longer eTP=Local)
    assert refused("127.0.0.1", web)
    assert request("127.0.0.1", db).status == 200
    hcnp.serve({}, {})
    assert refused("127.0.0.1", db)


def test_no_local_endpoint_is_503(hcnp: Hcnp) -> None:
    port = free_port("127.0.0.1")
    hcnp.serve({WEB: port}, {})  # a service without any count is 0
    answer = request("127.0.0.1", port)
    assert answer.status == 503
    assert answer.body == expected_body(WEB, 0, True)
    assert answer.headers["X-Load-Balancing-Endpoint-Weight"] == "0"
    assert answer.headers["X-Content-Type-Options"] == "nosniff"


def test_an_unhealthy_proxy_is_503_even_with_local_endpoints(hcnp: Hcnp) -> None:
    """kubernetes#115825: stale rules must not attract load-balancer traffic."""
    port = free_port("127.0.0.1")
    hcnp.serve({WEB: port}, {WEB: 3})
    assert request("127.0.0.1", port).status == 200
    hcnp.proxy.queued()
    hcnp.mono.now += TIMEOUT
    answer = request("127.0.0.1", port)
    assert answer.status == 503
    assert answer.body == expected_body(
        WEB, 3, False, "rules not updated for IPv4 (60.0 s), IPv6 (60.0 s) (more than 60 s)")
    assert answer.headers["X-Load-Balancing-Endpoint-Weight"] == "3"
    hcnp.proxy.updated()
    assert request("127.0.0.1", port).status == 200


def test_a_damaged_data_plane_is_503_with_the_reason(hcnp: Hcnp) -> None:
    """The kernel does not hold what was committed (tampered, not repaired yet): load
    balancers must stop sending traffic here, with local endpoints or not."""
    port = free_port("127.0.0.1")
    hcnp.serve({WEB: port}, {WEB: 3})
    damage: list[str] = []
    hcnp.proxy.damage = lambda: damage[0] if damage else None
    damage.append("table changed by someone else: ip pyproxy: table deleted")
    answer = request("127.0.0.1", port)
    assert answer.status == 503
    assert answer.body == expected_body(WEB, 3, False, damage[0])
    damage.clear()  # repaired
    assert request("127.0.0.1", port).body == expected_body(WEB, 3, True)


def test_count_changes_need_no_new_listener(hcnp: Hcnp) -> None:
    port = free_port("127.0.0.1")
    hcnp.serve({WEB: port}, {WEB: 1})
    listeners = hcnp.servers.servers[(WEB, port)]
    hcnp.serve({WEB: port}, {WEB: 0})
    assert request("127.0.0.1", port).status == 503
    hcnp.serve({WEB: port}, {WEB: 5})
    answer = request("127.0.0.1", port)
    assert answer.status == 200 and answer.headers["X-Load-Balancing-Endpoint-Weight"] == "5"
    assert hcnp.servers.servers[(WEB, port)] is listeners


def test_a_changed_port_moves_the_listener(hcnp: Hcnp) -> None:
    old, new = free_port("127.0.0.1"), free_port("127.0.0.1")
    hcnp.serve({WEB: old}, {WEB: 1})
    hcnp.serve({WEB: new}, {WEB: 1})
    assert refused("127.0.0.1", old)
    assert request("127.0.0.1", new).status == 200


def test_head_on_a_health_check_node_port(hcnp: Hcnp) -> None:
    port = free_port("127.0.0.1")
    hcnp.serve({WEB: port}, {WEB: 1})
    answer = request("127.0.0.1", port, "/", "HEAD")
    assert answer.status == 200 and answer.body == b""
    assert answer.headers["X-Load-Balancing-Endpoint-Weight"] == "1"


def test_a_port_that_cannot_be_bound_is_reported_and_retried(hcnp: Hcnp) -> None:
    taken_port, free = free_port("127.0.0.1"), free_port("127.0.0.1")
    taken = occupy("127.0.0.1", taken_port)
    try:
        hcnp.serve({WEB: taken_port, DB: free}, {WEB: 1, DB: 1})
        assert set(hcnp.servers.failures) == {WEB}
        assert f"cannot listen on {taken_port}" in hcnp.servers.failures[WEB]
        assert request("127.0.0.1", free).status == 200  # the others are served regardless
        hcnp.servers.sync()  # still taken: still reported
        assert set(hcnp.servers.failures) == {WEB}
    finally:
        taken.close()
    hcnp.servers.sync()  # the next sync retries
    assert hcnp.servers.failures == {}
    answer = request("127.0.0.1", taken_port)
    assert answer.status == 200 and answer.body == expected_body(WEB, 1, True)


@needs_ipv6
def test_ipv4_and_ipv6_listeners_share_the_port() -> None:
    """kubernetes#114702: one socket per family on the same port, no collision."""
    h = start_hcnp("127.0.0.1", "::1")
    try:
        port = free_port("127.0.0.1", "::1")
        h.serve({WEB: port}, {WEB: 2})
        assert h.servers.failures == {}
        for host in ("127.0.0.1", "::1"):
            answer = request(host, port)
            assert answer.status == 200 and answer.body == expected_body(WEB, 2, True)
        h.serve({}, {})
        assert refused("127.0.0.1", port) and refused("::1", port)
    finally:
        h.servers.stop()


@needs_ipv6
def test_a_half_opened_service_is_closed_and_retried_whole() -> None:
    """IPv4 binds, IPv6 does not: the IPv4 listener must not be left behind (upstream closes
    everything it opened), or the retry would trip over it forever."""
    h = start_hcnp("127.0.0.1", "::1")
    port = free_port("127.0.0.1", "::1")
    taken = occupy("::1", port)
    try:
        h.serve({WEB: port}, {WEB: 1})
        assert set(h.servers.failures) == {WEB}
        assert refused("127.0.0.1", port)
        taken.close()
        h.servers.sync()
        assert h.servers.failures == {}
        assert request("127.0.0.1", port).status == 200
        assert request("::1", port).status == 200
    finally:
        taken.close()
        h.servers.stop()


def test_stop_closes_every_listener(hcnp: Hcnp) -> None:
    ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
    hcnp.serve({WEB: ports[0], DB: ports[1]}, {WEB: 1, DB: 1})
    hcnp.servers.stop()
    assert all(refused("127.0.0.1", p) for p in ports)
    assert hcnp.servers.servers == {}


# ---------------------------------------------------------------------------------------------
# Wired to syncs (serve/reporting.py's observers)


def test_syncs_open_health_check_node_ports_with_local_ready_endpoint_counts() -> None:
    port = free_port("127.0.0.1")

    def lb_local(svc: dict[str, Any]) -> None:
        svc["spec"].update(
            type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=port,
            ports=[{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080},
                   {"name": "alt", "port": 81, "targetPort": 8081, "nodePort": 30081}])

    def two_ports(eps: dict[str, Any]) -> None:
        eps["ports"] = [{"name": "http", "port": 8080, "protocol": "TCP"},
                        {"name": "alt", "port": 8081, "protocol": "TCP"}]

    proxy = ProxyHealth((V4,), timeout=TIMEOUT)
    service_health = ServiceHealth()
    hcnp = ServiceHealthServers(service_health, proxy, ["127.0.0.1"])
    proxier = NodeProxier(ClusterCache("node-a"), [FamilyProxier(
        V4, NodeConfig("node-a", ("192.168.50.1",)), FakeNft())], observers=[
            SyncReporting(proxy, Metrics()), HealthCheckNodePorts(service_health, hcnp)])
    for source in ("Service", "EndpointSlice", "Node"):
        proxier.expect(source)
        proxier.source_synced(source)
    try:
        proxier.on_node(("", "node-a"), make_node("node-a", "zone-1"))
        proxier.on_service(("ns", "web"), make_service("ns", "web", lb_local))
        # Two local ready IPs (counted once across both ports), one terminating local, one
        # ready on another node: the count is 2.
        proxier.on_slice(("ns", "web-1"), make_slice("ns", "web", [
            ep("10.244.0.1", "node-a"), ep("10.244.0.2", "node-a"),
            ep("10.244.0.3", "node-a", ready=False, serving=True, terminating=True),
            ep("10.244.1.1", "node-b")], two_ports))
        proxier.sync()
        answer = request("127.0.0.1", port)
        assert answer.status == 200
        assert answer.headers["X-Load-Balancing-Endpoint-Weight"] == "2"
        # The local endpoints go: 503 at once, the listener stays.
        proxier.on_slice(("ns", "web-1"), make_slice("ns", "web", [
            ep("10.244.1.1", "node-b")], two_ports))
        proxier.sync()
        answer = request("127.0.0.1", port)
        assert answer.status == 503 and json.loads(answer.body)["localEndpoints"] == 0
        proxier.on_service(("ns", "web"), None)
        proxier.sync()
        assert refused("127.0.0.1", port)
    finally:
        hcnp.stop()


def test_a_sync_marks_the_proxy_updated_and_records_the_node() -> None:
    mono = Clock(1000.0)
    proxy = ProxyHealth((V4,), timeout=TIMEOUT, clock=mono, wall_clock=Clock(START))
    observer = SyncReporting(proxy, Metrics())
    proxier = NodeProxier(ClusterCache("node-a"), [FamilyProxier(
        V4, NodeConfig("node-a", ("192.168.50.1",)), FakeNft())], observers=[observer])
    for source in ("Service", "EndpointSlice"):
        proxier.expect(source)
        proxier.source_synced(source)
    proxier.on_node(("", "node-a"), make_node("node-a", "zone-1"))  # queues an update
    mono.now += TIMEOUT
    assert not proxy.healthy() and not proxy.node_eligible()
    proxier.sync()
    assert proxy.healthy() and proxy.node_eligible()
    deleting = make_node("node-a", "zone-1")
    deleting["metadata"]["deletionTimestamp"] = "2023-11-14T22:00:00Z"
    proxier.on_node(("", "node-a"), deleting)
    proxier.sync()
    assert proxy.healthy() and not proxy.node_eligible()
    code, _ = proxy.response(with_node=True)
    assert code == 503
    # A failed sync does not count as programmed; the next good one does.
    proxy.queued()
    observer.failed(proxier, SyncRecord(START, Scope.CHANGED, Cause.CHANGES, 0, 0, 0.0, 0.0, 0.0, 0,
                               error="boom"))
    mono.now += TIMEOUT
    assert not proxy.healthy()
    observer.synced(proxier, SyncRecord(START, Scope.FULL, Cause.AFTER_FAILURE, 0, 0, 0.0, 0.0,
                                        0.0, 0), Checkout(frozenset(), False, 0, 0))
    assert proxy.healthy()
