"""Kubernetes Events pyproxy records (the I/O shell): the start, as kube-proxy does, and each
outlier ejection (`EndpointEjected`, Warning, regarding the Service).

kube-proxy records one Event at start: `Starting` / `StartKubeProxy`, type Normal, regarding
its Node, through the events.k8s.io/v1 API (cluster-scoped objects' Events live in the
`default` namespace). pyproxy records the same, with its own action and controller name, so
`kubectl get events --field-selector regarding.name=NODE` shows when the proxy (re)started on a
node. The manifests' ClusterRole grants exactly `create`/`patch` on events for this.

Recording never blocks or fails the proxy: it runs on its own thread, retries while the API
server is away, and gives up after a few attempts with a log line.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import structlog

from pyproxy.cluster.apirequest import describe_error, request

log = structlog.get_logger(__name__)

EVENTS_NAMESPACE = "default"  # where Events about cluster-scoped objects (Nodes) go
EVENTS_PATH = f"/apis/events.k8s.io/v1/namespaces/{EVENTS_NAMESPACE}/events"
REPORTING_CONTROLLER = "pyproxy.io/pyproxy"
ATTEMPTS = 5


def start_event(node_name: str, now: datetime | None = None) -> dict[str, Any]:
    """The events.k8s.io/v1 Event recorded when the proxy starts on node_name."""
    now = now or datetime.now(UTC)
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            # client-go names events <object>.<hex nanoseconds>, unique per recording.
            "name": f"{node_name}.{int(now.timestamp() * 1e9):x}",
            "namespace": EVENTS_NAMESPACE,
        },
        # MicroTime: RFC 3339 with exactly six fractional digits.
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": node_name,
        "action": "StartPyproxy",
        "reason": "Starting",
        "type": "Normal",
        "note": "pyproxy started",
        # kube-proxy's NodeRef: the UID is the node's name (it does not fetch the Node).
        "regarding": {"kind": "Node", "apiVersion": "v1", "name": node_name,
                      "uid": node_name},
    }


def ejection_event(namespace: str, service: str, node_name: str, endpoint: str, note: str,
                   now: datetime | None = None) -> dict[str, Any]:
    """The Event recorded when outlier ejection takes an endpoint of a Service out of new
    connections on node_name (core/outliers.py), in the Service's namespace."""
    now = now or datetime.now(UTC)
    body = start_event(node_name, now)
    body["metadata"] = {"name": f"{service}.{int(now.timestamp() * 1e9):x}",
                        "namespace": namespace}
    body.update(action="EjectEndpoint", reason="EndpointEjected", type="Warning",
                note=f"endpoint {endpoint} ejected from new connections on node {node_name}: "
                     f"{note}"[:1024],
                regarding={"kind": "Service", "apiVersion": "v1", "namespace": namespace,
                           "name": service})
    return body


def events_path(namespace: str) -> str:
    return f"/apis/events.k8s.io/v1/namespaces/{namespace}/events"


def record_start(api_client: Any, node_name: str, stop: threading.Event,
                 retry_seconds: float = 2.0) -> threading.Thread:
    """Record the start Event in the background."""
    return record(api_client, start_event(node_name), stop, retry_seconds)


def record(api_client: Any, body: dict[str, Any], stop: threading.Event,
           retry_seconds: float = 2.0) -> threading.Thread:
    """Record an Event in the background, retried a few times."""

    def run() -> None:
        path = events_path(body["metadata"]["namespace"])
        regarding = body["regarding"]["name"]
        for attempt in range(1, ATTEMPTS + 1):
            try:
                response = request(api_client, "POST", path, body=body, timeout=10)
                response.release_conn()
                log.info("event_recorded", reason=body["reason"], regarding=regarding)
                return
            except Exception as err:
                status = getattr(err, "status", None)
                log.warning("event_not_recorded", attempt=attempt, status=status,
                            error=describe_error(err))
                if status in (401, 403, 422):  # retrying cannot help
                    return
            if stop.wait(retry_seconds * attempt):
                return

    thread = threading.Thread(target=run, name=f"record-event-{body['reason']}", daemon=True)
    thread.start()
    return thread
