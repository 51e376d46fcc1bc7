"""The synthetic cluster written straight into etcd, the way kube-apiserver stores it, in
transactions of many keys: 44,000 Services and their EndpointSlices in a minute or two, where
creating them through the API took more than half an hour on this shared 2-core machine
(issue 37: the API server is CPU-bound, ~20 ms of its CPU per object at that size).

kube-apiserver reads JSON from etcd as well as its own protobuf (its storage decoder
recognises both), and its watch cache sees the keys appear through its etcd watch, so the
proxies list and watch these objects as any others. What is skipped is what a create would
have done: admission, defaulting (synth.py writes the defaulted objects, as a list returns
them) and the ClusterIP and NodePort allocators' bookkeeping (nothing in the benchmark
allocates from them but the probe Service, whose VIP is outside the synthetic range).
The namespaces and Nodes are still created through the API.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

from bench.synth import Cluster as Synth
from testkit.controlplane import ControlPlane
from testkit.inproc import call_in_netns

PREFIX = "/registry"
MAX_OPS = 128  # etcd's --max-txn-ops default
MAX_BYTES = 1 << 20  # under etcd's 1.5 MiB request limit, with the base64 and JSON around it


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as etcd holds it: no resourceVersion (etcd's revision is its version)."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


def service_value(synth: Synth, i: int) -> dict[str, Any]:
    obj = stored(synth.service(i))
    spec = dict(obj["spec"])
    spec.pop("selector", None)  # its slices are the bench's: no controller may manage them
    return {**obj, "spec": spec}


def slice_value(synth: Synth, i: int) -> dict[str, Any]:
    obj = stored(synth.endpoint_slice(i, synth.initial_endpoints(i)))
    labels = {**obj["metadata"]["labels"], "endpointslice.kubernetes.io/managed-by": "bench"}
    return {**obj, "metadata": {**obj["metadata"], "labels": labels}}


def keys_and_values(synth: Synth) -> Iterator[tuple[str, bytes]]:
    for i in range(synth.services):
        key = synth.key(i)
        yield (f"{PREFIX}/services/specs/{key.namespace}/{key.name}",
               json.dumps(service_value(synth, i)).encode())
        if not synth.shape(i).no_endpoints:
            value = slice_value(synth, i)
            yield (f"{PREFIX}/endpointslices/{key.namespace}/{value['metadata']['name']}",
                   json.dumps(value).encode())


def batches(items: Iterator[tuple[str, bytes]]) -> Iterator[list[tuple[str, bytes]]]:
    batch: list[tuple[str, bytes]] = []
    size = 0
    for key, value in items:
        if batch and (len(batch) == MAX_OPS or size + len(value) > MAX_BYTES):
            yield batch
            batch, size = [], 0
        batch.append((key, value))
        size += len(value) + len(key)
    if batch:
        yield batch


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def put_all(plane: ControlPlane, synth: Synth) -> int:
    """Every Service and EndpointSlice in transactions through etcd's JSON gateway (in the
    control plane's namespace); returns the keys written."""
    def write() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", 2379, timeout=60)
        written = 0
        try:
            for batch in batches(keys_and_values(synth)):
                body = json.dumps({"success": [
                    {"requestPut": {"key": _b64(k.encode()), "value": _b64(v)}}
                    for k, v in batch]})
                conn.request("POST", "/v3/kv/txn", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                answer = response.read()
                if response.status != 200 or b'"succeeded":true' not in answer.replace(b" ", b""):
                    raise RuntimeError(f"etcd txn: {response.status} {answer[:300]!r}")
                written += len(batch)
        finally:
            conn.close()
        return written
    return int(call_in_netns(plane.ns.full, write, timeout=1800))


def wait_listed(kube: Any, services: int, slices: int, timeout: float = 600) -> None:
    """Until a consistent list through the API server holds at least that many of each."""
    from kubernetes import client

    discovery = client.DiscoveryV1Api(kube.api)
    deadline = time.monotonic() + timeout
    while True:
        have_services = _count(kube.core.list_service_for_all_namespaces(limit=1))
        have_slices = _count(discovery.list_endpoint_slice_for_all_namespaces(limit=1))
        if have_services >= services and have_slices >= slices:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the API server lists {have_services} Services and "
                               f"{have_slices} EndpointSlices of {services} and {slices}")
        time.sleep(1.0)


def _count(listed: Any) -> int:
    return len(listed.items) + int(listed.metadata.remaining_item_count or 0)
