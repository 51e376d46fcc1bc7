"""Pieces of `pyproxy run` that need no namespace: server start-up and its retries, and the
daemon as `build_daemon` builds it."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pyproxy import run
from pyproxy.cluster.sources import SnapshotSource
from pyproxy.config import ConfigError, ProxyConfig
from pyproxy.core.model import IPFamily
from pyproxy.serve import servers as serve
from pyproxy.serve.health import ProxyHealth
from pyproxy.serve.metrics import Metrics
from pyproxy.serve.reporting import SyncReporting
from testkit.fakes import FakeNft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_busy_health_port_is_retried_until_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "SERVER_RETRY_SECONDS", 0.05)
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    config = ProxyConfig(healthz_bind_address=f"127.0.0.1:{port}", metrics_bind_address=None)
    stop = threading.Event()
    servers = serve.start_servers(config, ProxyHealth((IPFamily.IPv4,)), Metrics(), stop)
    try:
        assert servers == []  # not fatal
        blocker.close()
        deadline = time.monotonic() + 5
        while not servers:
            assert time.monotonic() < deadline, "never retried"
            time.sleep(0.02)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as answer:
            assert answer.status == 200
    finally:
        stop.set()
        for server in servers:
            server.stop()


def test_hard_fail_makes_a_busy_port_fatal() -> None:
    port = free_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        config = ProxyConfig(healthz_bind_address=f"127.0.0.1:{port}",
                             metrics_bind_address=None, bind_address_hard_fail=True)
        with pytest.raises(ConfigError, match="bindAddressHardFail"):
            serve.start_servers(config, ProxyHealth((IPFamily.IPv4,)), Metrics(),
                                threading.Event())


def test_the_daemon_is_built_finished(tmp_path: Path) -> None:
    """`build_daemon` gives every part what it needs at construction: the proxier asks the
    runner for syncs, reports to its observers and to health, health reads the proxier's
    damage; nothing is patched in afterwards (Daemon is frozen) and nothing runs yet. The
    kernel passed in is the one each family's table is written to."""
    snapshot = tmp_path / "cluster.yaml"
    snapshot.write_text("[]\n")
    config = ProxyConfig(snapshot=str(snapshot), healthz_bind_address=None,
                         metrics_bind_address=None, hostname_override="node-a")
    kernels: dict[IPFamily, FakeNft] = {}
    daemon = run.build_daemon(config, interface_ips=("192.168.50.1",),
                              kernel=lambda family: kernels.setdefault(family, FakeNft()))
    proxier = daemon.proxier
    assert daemon.address_check is None and isinstance(daemon.source, SnapshotSource)
    assert daemon.source.proxier is proxier
    assert isinstance(proxier.observers[0], SyncReporting)
    assert proxier.observers[0].health is daemon.health
    assert proxier.on_node_change == [daemon.health.set_node]
    assert proxier.repairs.damage == daemon.health.damage
    assert not daemon.runner.schedule().requested
    proxier.request_sync()
    assert daemon.runner.schedule().requested
    assert daemon.health.damage() is None
    with pytest.raises(AttributeError):
        daemon.proxier = proxier  # type: ignore[misc]
    proxier.expect("snapshot")
    proxier.source_synced("snapshot")
    assert proxier.sync()
    assert list(kernels) == [IPFamily.IPv4]
    assert "add table ip pyproxy" in kernels[IPFamily.IPv4].last
