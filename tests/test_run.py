"""Pieces of `pyproxy run` that need no namespace: server start-up and its retries."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from pyproxy import run
from pyproxy.config import ProxyConfig
from pyproxy.core.model import IPFamily
from pyproxy.serve.health import ProxyHealth
from pyproxy.serve.metrics import Metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_busy_health_port_is_retried_until_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "SERVER_RETRY_SECONDS", 0.05)
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    config = ProxyConfig(healthz_bind_address=f"127.0.0.1:{port}", metrics_bind_address=None)
    stop = threading.Event()
    servers = run._start_servers(config, ProxyHealth((IPFamily.IPv4,)), Metrics(), stop)
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
        with pytest.raises(OSError):
            run._start_servers(config, ProxyHealth((IPFamily.IPv4,)), Metrics(),
                               threading.Event())
