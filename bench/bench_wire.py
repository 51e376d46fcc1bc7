"""JSON against protobuf on a real API server: what one EndpointSlice change costs on the wire
per node, and what pyproxy spends decoding it and decoding lists, both ways.

One control plane loaded with SERVICES × ENDPOINTS through the real API (bench_fleet's
loading and its `wire_sizes`), no proxies: a few minutes at 1k × 10. The decode figures are
the best of several rounds (a loaded machine only makes them slower), in µs per event or
per object, through the reflector's own codecs (`pyproxy/cluster/codec.py`).

    make bench-wire [WIRE_FLAGS='--size 1000x10']
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bench_fleet import change_events, commit, sizes_of
from bench.bench_vs_kube_proxy import load
from bench.synth import Cluster as Synth
from pyproxy.cluster.resources import (
    JSON_MEDIA_TYPE,
    PROTOBUF_MEDIA_TYPE,
    Resource,
    endpoint_slices_resource,
    services_resource,
)
from testkit import controlplane
from testkit.controlplane import ControlPlane, Kube

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 7


def best_us(fn: Callable[[], Any], per: int, rounds: int = ROUNDS) -> float:
    """The fastest of `rounds` runs of fn, in µs per one of the `per` things it decodes."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return round(best / per * 1e6, 2)


def event_costs(raw: dict[str, bytes]) -> dict[str, float]:
    """µs to decode one slice change off a watch: the JSON line (msgspec, typed), the
    protobuf frame (pyproxy/core/protobuf.py), each into the document the reflector hands
    over."""
    resource = endpoint_slices_resource()
    assert resource.protobuf is not None
    line = raw["watch_event_json"].strip()
    frame = raw["watch_event_protobuf"][4:]
    assert len(frame) == int.from_bytes(raw["watch_event_protobuf"][:4], "big"), "one frame"
    repeat = 2000

    def loop(decode: Callable[[bytes], Any], data: bytes) -> Callable[[], None]:
        def run() -> None:
            for _ in range(repeat):
                decode(data)
        return run

    return {"watch_event_json_us": best_us(loop(resource.codec.event, line), repeat),
            "watch_event_protobuf_us": best_us(loop(resource.protobuf.event, frame), repeat)}


def list_costs(plane: ControlPlane, kind: str, path: str,
               resource: Resource) -> dict[str, float]:
    """Bytes (plain, and gzipped at level 1 as the server sends a big list) and µs per
    object to decode the whole list of a kind, both ways."""
    assert resource.protobuf is not None
    api = plane.admin_client()
    try:
        bodies = {}
        for name, accept in (("json", JSON_MEDIA_TYPE), ("protobuf", PROTOBUF_MEDIA_TYPE)):
            response = api.call_api("GET", f"{plane.url}{path}",
                                    header_params={"Accept": accept}, _request_timeout=60)
            bodies[name] = bytes(response.read())
    finally:
        api.close()
    count = len(resource.codec.page(bodies["json"])[1])
    assert count == len(resource.protobuf.page(bodies["protobuf"])[1])
    out: dict[str, float] = {f"{kind}_list_objects": count}
    for name, codec in (("json", resource.codec), ("protobuf", resource.protobuf)):
        data = bodies[name]
        out[f"{kind}_list_{name}_bytes"] = len(data)
        out[f"{kind}_list_{name}_gzip_bytes"] = len(gzip.compress(data, compresslevel=1))
        out[f"{kind}_list_{name}_us_per_object"] = best_us(lambda c=codec, d=data: c.page(d),
                                                           count)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1000x10", help="SERVICESxENDPOINTS")
    parser.add_argument("--json", help="default: bench/results/wire-SIZE-COMMIT.json")
    args = parser.parse_args()
    services, endpoints = (int(x) for x in args.size.split("x"))
    bin_dir = controlplane.binaries_dir()
    if controlplane.missing_binaries(bin_dir):
        print(f"run `make k8s` first ({bin_dir})", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"commit": commit(), "services": services, "endpoints": endpoints}
    with controlplane.running_control_plane(bin_dir) as plane:
        kube = Kube(plane.admin_client())
        controlplane.apply_manifests(kube)
        synth = Synth(services, endpoints)
        report["load_s"] = round(load(kube, synth, "192.168.0.10"), 1)
        raw = change_events(plane, kube, synth)
        report["wire_sizes"] = sizes_of(raw)
        report["decode"] = {
            **event_costs(raw),
            **list_costs(plane, "slice", "/apis/discovery.k8s.io/v1/endpointslices",
                         endpoint_slices_resource()),
            **list_costs(plane, "service", "/api/v1/services", services_resource()),
        }
    out = Path(args.json or REPO / "bench" / "results" /
               f"wire-{args.size}-{report['commit']}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    for section in ("wire_sizes", "decode"):
        for name, value in report[section].items():
            print(f"{name:<40} {value:>12,}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
