"""Every setting docs/configuration.md calls applied changes what `pyproxy run` does.

One row per setting: two configurations that differ in it alone, and a probe that runs the
code `pyproxy run` runs with them (node configuration and rendering, the sync clocks, the
servers it starts, the API client it builds, the host settings it writes, its logging)
and returns what can be observed. A setting whose two probes agree is not applied. A test
also checks the rows against the document, so a setting newly called applied needs a row.

Host settings are written into a fake /proc tree here; tests/test_upstream_parity.py writes
them for real, inside a throwaway network namespace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from pyproxy.cluster import apiconnection
from pyproxy.cluster.apiserver import client_for
from pyproxy.cluster.cache import ClusterCache
from pyproxy.cluster.resources import (
    endpoint_slices_resource,
    nodes_resource,
    service_cidrs_resource,
    services_resource,
)
from pyproxy.cluster.snapshot import build_state
from pyproxy.cluster.sources import ApiSource, SnapshotSource
from pyproxy.cluster.watch import Reflector
from pyproxy.config import ConfigError, ProxyConfig, reference_markdown
from pyproxy.core.model import IPFamily, LocalMode, Node
from pyproxy.core.outliers import Failure, OutlierPolicy
from pyproxy.kernel.host import apply_host_settings
from pyproxy.logs import setup_logging
from pyproxy.run import build_daemon
from pyproxy.serve import servers as serve
from pyproxy.serve.health import ProxyHealth
from pyproxy.serve.live import connection_views
from pyproxy.serve.metrics import Metrics
from pyproxy.sync import settings
from pyproxy.sync.least import LeastConnections
from pyproxy.sync.node import NodeProxier
from pyproxy.sync.outliers import OutlierEjection
from pyproxy.sync.runner import BoundedFrequencyRunner
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fakes import FakeNft
from testkit.nftns import render_script

Configs = Callable[[Path], tuple[ProxyConfig, ProxyConfig]]
Probe = Callable[[ProxyConfig, Path], Any]


def change(attr: str, value: Any, **base: Any) -> Configs:
    """`base` settings, and the same with `attr` set to `value`."""
    def configs(tmp: Path) -> tuple[ProxyConfig, ProxyConfig]:
        first = ProxyConfig(**base)
        return first, dataclasses.replace(first, **{attr: value})
    return configs


# --- probes ----------------------------------------------------------------------------------

def node_name(config: ProxyConfig, tmp: Path) -> str:
    return config.node_name(lambda: "os-hostname")


def node_ips(config: ProxyConfig, tmp: Path) -> tuple[str, ...]:
    node = Node("node-a", host_ips=("10.0.0.1", "fd00::1"))
    return settings.node_config_for(config, "node-a", node, ("192.168.50.1",)).node_ips


STATE = build_state([
    {**make_node("node-a", "zone-1"), "spec": {"podCIDRs": ["10.244.3.0/24"]},
     "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}},
    make_service("ns", "web", lambda s: (s["spec"].update(type="NodePort"),
                                         s["spec"]["ports"][0].update(nodePort=30080))),
    make_slice("ns", "web", [ep("10.244.1.5", "node-b")]),
])


def rules(config: ProxyConfig, tmp: Path) -> str:
    node = settings.node_config_for(config, "node-a", STATE.nodes["node-a"], ("192.168.50.1",))
    return render_script(STATE, node)


def timing(config: ProxyConfig, tmp: Path) -> settings.SyncTiming:
    return settings.sync_timing(config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


HEALTHZ_PORTS = (free_port(), free_port())
METRICS_PORTS = (free_port(), free_port())


def listening(config: ProxyConfig, tmp: Path) -> set[int]:
    """Which of the test's ports the servers `pyproxy run` starts listen on."""
    stop = threading.Event()
    servers = serve.start_servers(config, ProxyHealth((IPFamily.IPv4,)), Metrics(), stop)
    try:
        answering = set()
        for port in (*HEALTHZ_PORTS, *METRICS_PORTS):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    answering.add(port)
        return answering
    finally:
        stop.set()
        for server in servers:
            server.stop()


def busy_port_outcome(config: ProxyConfig, tmp: Path) -> str:
    """A healthz port someone else holds: fatal, or retried in the background."""
    stop = threading.Event()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = dataclasses.replace(config, metrics_bind_address=None,
                                   healthz_bind_address=f"127.0.0.1:{blocker.getsockname()[1]}")
        try:
            serve.start_servers(busy, ProxyHealth((IPFamily.IPv4,)), Metrics(), stop)
        except ConfigError:
            return "exits"
        finally:
            stop.set()
    return "retries"


def kubeconfig(tmp: Path, server: str) -> str:
    path = tmp / f"{server.split('//')[1].split(':')[0]}.kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return str(path)


def api_server(config: ProxyConfig, tmp: Path) -> str:
    return str(client_for(apiconnection.load(config), config).configuration.host)


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 3))
        self.now += seconds


class FakeRest:
    """Stands in for the client's HTTP layer: every request is answered at once."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    def request(self, method: str, url: str, **kwargs: Any) -> str:
        self.requests.append((method, url))
        return "response"


def request_waits(config: ProxyConfig, tmp: Path) -> list[float]:
    """How long each of 14 back-to-back API requests waited for its token."""
    fake = FakeTime()
    api = client_for(apiconnection.load(config), config, clock=fake.clock, sleep=fake.sleep)
    api.rest_client = FakeRest()
    waits = []
    for _ in range(14):
        before = fake.now
        assert api.call_api("GET", f"{api.configuration.host}/api/v1/nodes") == "response"
        waits.append(round(fake.now - before, 3))
    return waits


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def log_output(config: ProxyConfig, tmp: Path) -> str:
    saved, stderr = structlog.get_config(), sys.stderr
    sys.stderr = out = FakeTty()
    try:
        setup_logging(config.logging_format, config.verbosity)
        probe = structlog.get_logger("probe")
        probe.debug("detail")
        probe.info("event")
        text = out.getvalue()
    finally:
        sys.stderr = stderr
        structlog.configure(**saved)
    # The time stamp differs from call to call; the rest is what the settings decide.
    return "".join(line.split(" ", 1)[-1] if not line.startswith("{") else
                   json.dumps({k: v for k, v in json.loads(line).items() if k != "timestamp"})
                   for line in text.splitlines(keepends=True))


def fake_proc(tmp: Path) -> tuple[Path, Path, Path]:
    """A /proc/sys/net/netfilter, hashsize and oom_score_adj with values no setting has."""
    root = tmp / f"proc-{len(list(tmp.glob('proc-*')))}"
    netfilter = root / "sys" / "net" / "netfilter"
    netfilter.mkdir(parents=True)
    for name in ("nf_conntrack_max", "nf_conntrack_tcp_timeout_established",
                 "nf_conntrack_tcp_timeout_close_wait", "nf_conntrack_tcp_be_liberal",
                 "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"):
        (netfilter / name).write_text("7\n")
    (root / "hashsize").write_text("7\n")
    (root / "oom_score_adj").write_text("0\n")
    return root / "sys", root / "hashsize", root / "oom_score_adj"


def host_settings(config: ProxyConfig, tmp: Path) -> dict[str, str]:
    proc_sys, hashsize, oom = fake_proc(tmp)
    apply_host_settings(config, cpus=2, proc_sys=str(proc_sys), hashsize=str(hashsize),
                        oom_score_adj=str(oom))
    files = [*sorted((proc_sys / "net" / "netfilter").iterdir()), hashsize, oom]
    return {f.name: f.read_text().strip() for f in files}


def watch_accept(config: ProxyConfig, tmp: Path) -> list[str]:
    """What each of the daemon's reflectors asks a plain watch for (ApiSource as run_daemon
    makes it, its list functions recording instead of sending)."""
    asked: list[str] = []

    def record(_api: Any) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            # No `_accept`: the list function's default, JSON.
            asked.append(kwargs.get("_accept", "application/json"))
            raise RuntimeError("recorded")
        return call

    source = ApiSource(None, "node-a", threading.Event(), content_type=config.content_type)
    for resource in (services_resource(), endpoint_slices_resource(), nodes_resource("a"),
                     service_cidrs_resource()):
        reflector = Reflector(None, dataclasses.replace(resource, list_function=record),
                              lambda *_: None, lambda: None, source.stop,
                              content_type=source.content_type)
        with contextlib.suppress(RuntimeError):
            reflector._watch("1")
    return asked


def service_cidr_watch(config: ProxyConfig, tmp: Path) -> bool:
    return config.watches_service_cidrs  # what run_daemon hands ApiSource


def debug_socket(config: ProxyConfig, tmp: Path) -> bool:
    proxier = NodeProxier(ClusterCache("node-a"), [])
    runner = BoundedFrequencyRunner("probe", 1.0, 1.0, 1.0)
    source = SnapshotSource(str(tmp / "none.yaml"), proxier, threading.Event())
    server = serve.start_debug(config, proxier, ProxyHealth((IPFamily.IPv4,)), runner, source)
    if server is None:
        return False
    server.stop()
    return True


def in_flight(config: ProxyConfig, tmp: Path) -> tuple[bool, float]:
    """Whether the daemon reads the connections in flight, and how often at most."""
    proxier = NodeProxier(ClusterCache("node-a"), [])
    views = connection_views(proxier, Metrics(), config.in_flight_interval)
    return views.in_flight is not None, views.interval


def least_connections(config: ProxyConfig, tmp: Path) -> float:
    """How often the daemon's least-connection feedback steps."""
    daemon = build_daemon(replace(config, snapshot="unused.yaml", hostname_override="node-a"),
                          interface_ips=("10.0.0.1",), kernel=lambda family: FakeNft())
    least = next(o for o in daemon.proxier.observers if isinstance(o, LeastConnections))
    return least.interval


def with_kubeconfig(attr: str, value: Any) -> Configs:
    def configs(tmp: Path) -> tuple[ProxyConfig, ProxyConfig]:
        first = ProxyConfig(kubeconfig=kubeconfig(tmp, "https://a.example:6443"))
        # kubeconfig: another file, naming another server
        new = kubeconfig(tmp, "https://b.example:6443") if attr == "kubeconfig" else value
        return first, dataclasses.replace(first, **{attr: new})
    return configs


def debug_configs(tmp: Path) -> tuple[ProxyConfig, ProxyConfig]:
    return ProxyConfig(debug_socket=None), ProxyConfig(debug_socket=str(tmp / "debug.sock"))


H0, H1 = (f"127.0.0.1:{p}" for p in HEALTHZ_PORTS)
M0, M1 = (f"127.0.0.1:{p}" for p in METRICS_PORTS)

# setting → (the two configurations, the probe)
def outliers_of(config: ProxyConfig) -> OutlierEjection:
    return OutlierEjection.of(config, None, "node-a", threading.Event(), Metrics())


def outlier_ejection_on(config: ProxyConfig, tmp: Path) -> bool:
    """Whether a TCP service port without the annotation takes part."""
    return outliers_of(config).on(STATE.ports[0])


def first_ejection(config: ProxyConfig, tmp: Path) -> tuple[float, ...]:
    """When an endpoint failing once a second is ejected, and for how long."""
    tracker = outliers_of(config).tracker
    for second in range(60):
        if tracker.failure("10.244.1.5:8080", float(second), Failure.NO_REPLY):
            ejection = tracker.ejected(float(second))["10.244.1.5:8080"]
            return ejection.since, ejection.until
    return ()


APPLIED: dict[str, tuple[Configs, Probe]] = {
    "hostname_override": (change("hostname_override", "node-b"), node_name),
    "bind_address": (change("bind_address", "10.0.0.9"), node_ips),
    "healthz_bind_address": (change("healthz_bind_address", H1, healthz_bind_address=H0,
                                    metrics_bind_address=None), listening),
    "metrics_bind_address": (change("metrics_bind_address", M1, metrics_bind_address=M0,
                                    healthz_bind_address=None), listening),
    "bind_address_hard_fail": (change("bind_address_hard_fail", True), busy_port_outcome),
    "cluster_cidrs": (change("cluster_cidrs", ("10.244.0.0/16",)), rules),
    "detect_local_mode": (change("detect_local_mode", LocalMode.NODE_CIDR,
                                 cluster_cidrs=("10.244.0.0/16",)), rules),
    "bridge_interface": (change("bridge_interface", "br1", bridge_interface="cbr0",
                                detect_local_mode=LocalMode.BRIDGE_INTERFACE), rules),
    "interface_name_prefix": (change("interface_name_prefix", "cali", interface_name_prefix="veth",
                                     detect_local_mode=LocalMode.INTERFACE_NAME_PREFIX), rules),
    "nodeport_addresses": (change("nodeport_addresses", ("192.168.0.0/16",)), rules),
    "masquerade_bit": (change("masquerade_bit", 3), rules),
    "masquerade_all": (change("masquerade_all", True), rules),
    "sync_period": (change("sync_period", 10.0), timing),
    "min_sync_period": (change("min_sync_period", 0.2), timing),
    "full_sync_period": (change("full_sync_period", 600.0), timing),
    "conntrack_max_per_core": (change("conntrack_max_per_core", 100_000), host_settings),
    "conntrack_min": (change("conntrack_min", 200_000), host_settings),
    "conntrack_tcp_established_timeout": (change("conntrack_tcp_established_timeout", 7200.0),
                                          host_settings),
    "conntrack_tcp_close_wait_timeout": (change("conntrack_tcp_close_wait_timeout", 60.0),
                                         host_settings),
    "conntrack_tcp_be_liberal": (change("conntrack_tcp_be_liberal", True), host_settings),
    "conntrack_udp_timeout": (change("conntrack_udp_timeout", 45.0), host_settings),
    "conntrack_udp_stream_timeout": (change("conntrack_udp_stream_timeout", 150.0),
                                     host_settings),
    "oom_score_adj": (change("oom_score_adj", 500), host_settings),
    "kubeconfig": (with_kubeconfig("kubeconfig", None), api_server),
    "master": (with_kubeconfig("master", "https://master.example:6443"), api_server),
    "qps": (with_kubeconfig("qps", 20.0), request_waits),
    "burst": (with_kubeconfig("burst", 2), request_waits),
    "content_type": (change("content_type", "application/json"), watch_accept),
    "logging_format": (change("logging_format", "json"), log_output),
    "verbosity": (change("verbosity", 4), log_output),
    "feature_gates": (change("feature_gates", {"MultiCIDRServiceAllocator": False}),
                      service_cidr_watch),
    "debug_socket": (debug_configs, debug_socket),
    "outlier_ejection": (change("outlier_ejection", True), outlier_ejection_on),
    "outlier_ejection_policy": (change("outlier_ejection_policy", OutlierPolicy(
        failures=2, base_ejection=60.0)), first_ejection),
    "in_flight_interval": (change("in_flight_interval", 0.0), in_flight),
    "least_connections_interval": (change("least_connections_interval", 1.0),
                                   least_connections),
}
# Applied settings whose effect only a running daemon shows: the test that shows it.
SHOWN_END_TO_END = {
    "snapshot": "tests/test_daemon_e2e.py::test_snapshot_mode_follows_the_file",
    "fast_failure": "tests/test_fast_failure_netns.py::"
                    "test_a_removed_endpoints_connection_fails_at_once_not_after_tcp_gives_up",
}


@pytest.mark.parametrize("attr", sorted(APPLIED))
def test_an_applied_setting_changes_what_the_daemon_does(attr: str, tmp_path: Path) -> None:
    configs, probe = APPLIED[attr]
    base, changed = configs(tmp_path)
    assert getattr(base, attr) != getattr(changed, attr)
    assert {f.name for f in dataclasses.fields(ProxyConfig)
            if getattr(base, f.name) != getattr(changed, f.name)} == {attr}
    assert probe(base, tmp_path) != probe(changed, tmp_path)


def documented() -> tuple[set[str], set[str]]:
    """(settings docs/configuration.md calls applied, those it calls accepted, not applied),
    from its table of settings (setting, file fields, flag, default, applies, applied by)."""
    applied, unapplied = set(), set()
    in_settings = False
    for line in reference_markdown().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("#"):
            in_settings = line == "## Settings"
        if not in_settings or len(cells) != 6 or not cells[0].startswith("`"):
            continue
        setting, says = cells[0].strip("`"), cells[4]
        if says.startswith("accepted, not applied"):
            unapplied.add(setting)
        elif says.startswith(("yes:", "partly:")):
            applied.add(setting)
    return applied, unapplied


def test_every_setting_the_document_calls_applied_has_a_row() -> None:
    applied, unapplied = documented()
    assert applied - unapplied == set(APPLIED) | set(SHOWN_END_TO_END)
    assert unapplied == {"config_sync_period"}
    for where in SHOWN_END_TO_END.values():
        path, name = where.split("::")
        assert f"def {name}(" in (Path(__file__).parent.parent / path).read_text()


def test_unapplied_settings_are_warned_about_only_when_given() -> None:
    assert ProxyConfig().unapplied == ()
    assert ProxyConfig(feature_gates={"MultiCIDRServiceAllocator": False}).unapplied == ()
    notes = ProxyConfig(config_sync_period=60.0,
                        feature_gates={"NFTablesProxyMode": True, "Other": False}).unapplied
    assert len(notes) == 2
    assert notes[0].startswith("configSyncPeriod (1m0s): accepted, not applied")
    assert notes[1].startswith("featureGates NFTablesProxyMode, Other: accepted, not applied")


def test_requests_wait_for_tokens_as_client_go_s(tmp_path: Path) -> None:
    """burst at once, then qps per second; 0 means client-go's defaults (5 and 10)."""
    path = kubeconfig(tmp_path, "https://a.example:6443")
    defaults = [0.0] * 10 + [0.2] * 4
    assert request_waits(ProxyConfig(kubeconfig=path), tmp_path) == defaults
    assert request_waits(ProxyConfig(kubeconfig=path, qps=0.0, burst=0), tmp_path) == defaults
    assert request_waits(ProxyConfig(kubeconfig=path, qps=20.0, burst=2), tmp_path) \
        == [0.0] * 2 + [0.05] * 12
