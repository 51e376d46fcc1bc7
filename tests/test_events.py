"""The start Event's shape (tests/test_k8s.py records it against a real API server)."""

from __future__ import annotations

from datetime import UTC, datetime

from pyproxy.cluster.events import start_event


def test_start_event_is_kube_proxys_with_our_names() -> None:
    when = datetime(2026, 11, 26, 7, 0, 1, 250000, tzinfo=UTC)
    event = start_event("node-a", when)
    assert event["metadata"] == {"name": f"node-a.{int(when.timestamp() * 1e9):x}",
                                 "namespace": "default"}
    assert event["eventTime"] == "2026-11-26T07:00:01.250000Z"  # MicroTime: six digits
    assert (event["reason"], event["type"], event["action"]) == ("Starting", "Normal",
                                                                  "StartPyproxy")
    assert event["regarding"] == {"kind": "Node", "apiVersion": "v1", "name": "node-a",
                                  "uid": "node-a"}
    assert event["reportingInstance"] == "node-a"


def test_two_starts_make_two_events() -> None:
    first = start_event("node-a", datetime(2026, 1, 1, tzinfo=UTC))
    second = start_event("node-a", datetime(2026, 1, 1, 0, 0, 0, 1, tzinfo=UTC))
    assert first["metadata"]["name"] != second["metadata"]["name"]
