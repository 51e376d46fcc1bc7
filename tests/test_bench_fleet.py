"""bench/bench_fleet.py's reading of the API server's audit log: each request once, a streamed
list counted as a list, requests told apart by node (their veth address) and by fleet (their
ServiceAccount), and when a node's EndpointSlice watch came back after a restart; the probed
node's network programming latency read off its histogram as Prometheus reads one."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.bench_fleet import (
    USERS,
    Node,
    audit_summary,
    etcd_writes,
    histogram_quantile,
    npl_buckets,
    npl_figures,
    read_audit,
)

KP = USERS["kube-proxy"]


def event(audit_id: str, stage: str, verb: str, resource: str, source: str, at: str,
          uri: str = "/x", code: int = 200, user: str = KP,
          ended: str | None = None) -> dict[str, Any]:
    return {"stageTimestamp": f"2026-01-01T00:00:{ended or at}Z", "auditID": audit_id,
            "stage": stage, "verb": verb, "requestURI": uri,
            "user": {"username": user}, "sourceIPs": [source],
            "objectRef": {"resource": resource}, "responseStatus": {"code": code},
            "requestReceivedTimestamp": f"2026-01-01T00:00:{at}Z"}


def test_audit_requests_are_counted_once_per_node_and_fleet(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = [
        event("1", "ResponseComplete", "list", "services", "10.0.0.2", "01.000000"),
        # a watch: logged when its response starts and again when it ends
        event("2", "ResponseStarted", "watch", "endpointslices", "10.0.0.2", "02.500000"),
        event("2", "ResponseComplete", "watch", "endpointslices", "10.0.0.2", "02.500000",
              ended="09.000000"),
        # a watch that ended at once (a 410 ERROR event in it) is not "back"
        event("6", "ResponseComplete", "watch", "endpointslices", "10.0.0.2", "02.000000",
              uri="/apis/discovery.k8s.io/v1/endpointslices?watch=1&resourceVersion=17047"),
        # a streamed list (watch-list) is a list
        event("3", "ResponseStarted", "watch", "endpointslices", "10.0.0.6", "03.000000",
              uri="/apis/discovery.k8s.io/v1/endpointslices?sendInitialEvents=true&watch=1"),
        # the other fleet's request, and one before the window
        event("4", "ResponseComplete", "list", "nodes", "10.0.0.6", "03.000000",
              user=USERS["pyproxy"]),
        event("5", "ResponseComplete", "list", "nodes", "10.0.0.6", "00.000000"),
    ]
    log.write_text("\n".join(json.dumps(e) for e in lines) + "\n{\"cut by a SIGK")
    requests = read_audit(log)
    assert len(requests) == 6
    no_ns: Any = None  # the summary reads only names and addresses
    nodes = [Node("a", no_ns, "10.0.0.2", "to-a"), Node("b", no_ns, "10.0.0.6", "to-b")]
    since = requests[1].received - 0.5  # 00:00:00.5: the request at 00:00 is before
    summary = audit_summary(requests, KP, since, since + 10, nodes, back_from=since + 1.0)
    assert summary["requests"] == 4
    assert summary["lists"] == 2 and summary["nodes_that_listed"] == 2
    assert summary["per_node"]["a"]["lists"] == {"services": 1}
    assert summary["per_node"]["a"]["watches"] == 2
    assert summary["per_node"]["a"]["slices_watch_back_s"] == 1.0
    assert summary["per_node"]["b"]["lists"] == {"endpointslices": 1}
    # b's streamed list is its watch too (it never ended here)
    assert summary["per_node"]["b"]["slices_watch_back_s"] == 1.5
    assert summary["slices_watch_back_max_s"] == 1.5
    assert summary["requests_per_second"][:3] == [1, 1, 2]
    # where each node's first watch after the restart resumed from, and its answer
    assert summary["per_node"]["a"]["asked_after_restart"] == {"endpointslices": "17047"}
    assert summary["per_node"]["a"]["first_answer_after_restart"] == {
        "endpointslices": "gone"}
    assert summary["slices_resumed"] == 1  # a listed no slices, b did


def test_etcd_writes_from_its_json_watch() -> None:
    """etcd's JSON gateway streams concatenated messages, keys in base64, PUT implied."""
    messages = [
        {"result": {"header": {"revision": "9"}, "created": True}},
        {"result": {"events": [
            {"kv": {"key": "L3JlZ2lzdHJ5L2E=", "mod_revision": "3"}},
            {"kv": {"key": "L3JlZ2lzdHJ5L2I=", "mod_revision": "5"}, "type": "DELETE"}]}},
        {"result": {"events": [{"kv": {"key": "L3JlZ2lzdHJ5L2M=", "mod_revision": "9"}}]}},
    ]
    text = "\n".join(json.dumps(m) for m in messages) + '\n{"result": {"ev'  # cut by the timeout
    assert etcd_writes(text, 3, 6) == [
        {"revision": 3, "type": "PUT", "key": "/registry/a"},
        {"revision": 5, "type": "DELETE", "key": "/registry/b"}]


def test_histogram_quantile_interpolates_within_the_bucket_as_prometheus() -> None:
    inf = float("inf")
    # 10 observations: 4 up to 0.25 s, 4 in (0.25, 0.5], 2 in (0.5, 1]
    buckets = {0.25: 4.0, 0.5: 8.0, 1.0: 10.0, 2.0: 10.0, inf: 10.0}
    assert histogram_quantile(0.5, buckets) == 0.25 + 0.25 * (5 - 4) / 4
    assert math.isclose(histogram_quantile(0.99, buckets), 0.5 + 0.5 * (9.9 - 8) / 2)
    # the first bucket is interpolated from 0
    assert histogram_quantile(0.2, buckets) == 0.25 * 2 / 4
    # in the +Inf bucket: the highest finite bound
    assert histogram_quantile(0.99, {0.25: 1.0, 0.5: 1.0, inf: 10.0}) == 0.5
    # no observation, no +Inf bucket: no figure
    assert math.isnan(histogram_quantile(0.5, {0.25: 0.0, inf: 0.0}))
    assert math.isnan(histogram_quantile(0.5, {0.25: 3.0, 0.5: 3.0}))


METRICS_BEFORE = b"""\
# HELP kubeproxy_network_programming_duration_seconds [ALPHA] In Cluster Network Programming
# TYPE kubeproxy_network_programming_duration_seconds histogram
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.25"} 1
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.5"} 2
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="1"} 2
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 2
kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"} 0.6
kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"} 2
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.25"} 7
"""


def test_the_probed_nodes_latency_is_what_its_histogram_grew_by() -> None:
    after = (METRICS_BEFORE.replace(b'"0.25"} 1', b'"0.25"} 3').replace(b'"0.5"} 2', b'"0.5"} 5')
             .replace(b'"1"} 2', b'"1"} 6').replace(b'"+Inf"} 2', b'"+Inf"} 6'))
    # both families' series add up (pyproxy's has none of kube-proxy's labels)
    after += (b'kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv6",'
              b'le="1"} 1\n'
              b'kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv6",'
              b'le="+Inf"} 1\n')
    assert npl_buckets(METRICS_BEFORE) == {0.25: 1.0, 0.5: 2.0, 1.0: 2.0, float("inf"): 2.0}
    assert npl_buckets(b'kubeproxy_network_programming_duration_seconds_bucket{le="0.5"} 4\n'
                       ) == {0.5: 4.0}
    figures = npl_figures("fleet-00", METRICS_BEFORE, after)
    # grown: 2 up to 0.25 s, 1 in (0.25, 0.5], 2 in (0.5, 1]: 5 observations
    assert figures["observations"] == 5
    assert figures["p50_s"] == round(0.25 + 0.25 * (2.5 - 2) / 1, 4)
    assert figures["p99_s"] == round(0.5 + 0.5 * (4.95 - 3) / 2, 4)
    assert figures["buckets"] == {"0.25": 2.0, "0.5": 3.0, "1.0": 5.0, "inf": 5.0}
    # a proxy that did not answer: no figure, and why
    assert npl_figures("fleet-00", None, after)["p50_s"] is None
    # no change committed meanwhile: no figure either
    assert npl_figures("fleet-00", METRICS_BEFORE, METRICS_BEFORE)["p99_s"] is None
