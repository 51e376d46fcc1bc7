"""The API server as the daemon reaches it: the client, rate-limited as client-go is, and
the check that its address is not a Service's (the bootstrap trap)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import structlog

from pyproxy.cluster import apiconnection
from pyproxy.cluster.apiconnection import ApiConnection
from pyproxy.cluster.ratelimit import TokenBucket, limit_requests
from pyproxy.config import ProxyConfig
from pyproxy.core.model import ClusterState
from pyproxy.lazy import submodule

log = structlog.get_logger(__name__)


def client_for(connection: ApiConnection, config: ProxyConfig,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> Any:
    """The API client, every request of which waits on a token bucket of
    clientConnection.qps/burst (client-go's rate limiting; the Python client has none)."""
    client = submodule("kubernetes.client")  # without the package's other parts (lazy.py)
    configuration = apiconnection.client_configuration(connection)
    log.info("api_server", server=connection.server, source=connection.source)
    return limit_requests(client.ApiClient(configuration),
                          TokenBucket(config.qps, config.burst, clock, sleep))


def server_host(api_client: Any) -> str:
    """The host name or address the client reaches the API server at."""
    return urlsplit(str(api_client.configuration.host)).hostname or ""


@dataclass
class ApiAddressCheck:
    """Is the API server reached through a Service address (the bootstrap trap)? Checked
    after every sync, when pyproxy knows the `kubernetes` Service and the service CIDRs:
    a warning when that changes, a gauge (`via_service`: 1 or 0), and a line in
    `pyproxy status`."""

    host: str
    via_service: Callable[[float], None]
    kubelet_ips: frozenset[str] = frozenset()
    problem: str | None = None

    def __call__(self, state: ClusterState) -> None:
        problem = apiconnection.service_address_problem(self.host, state, self.kubelet_ips)
        if problem != self.problem:
            if problem:
                log.warning("api_server_via_service_address", host=self.host, problem=problem,
                            fix="give pyproxy the API server's real address (docs/deploying.md)")
            else:
                log.info("api_server_address_direct", host=self.host)
            self.problem = problem
        self.via_service(1 if problem else 0)
