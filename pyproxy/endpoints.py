"""Merging the EndpointSlices of a Service into one endpoint list per service port."""

from __future__ import annotations

from collections.abc import Iterable

from pyproxy.model import Endpoint, IPFamily, ServicePortName, SliceEndpoints


def merge_slices(
    slices: Iterable[SliceEndpoints], port: ServicePortName, family: IPFamily
) -> tuple[Endpoint, ...]:
    """The endpoints of one service port and family, from all of the Service's slices.

    Matching is by port name and protocol (the number comes from the slice: the target port is
    already resolved there). A duplicated `IP:port` counts once; when copies disagree a
    non-terminating one wins (a pod IP reused while the old pod terminates). The result is
    sorted by `IP:port` so that diffs and rule order are stable.
    """
    chosen: dict[str, Endpoint] = {}
    for piece in slices:
        if piece.family is not family or piece.service != port.service:
            continue
        for ep in piece.endpoints_for(port):
            old = chosen.get(ep.key)
            if old is None or (old.terminating and not ep.terminating):
                chosen[ep.key] = ep
    return tuple(chosen[key] for key in sorted(chosen))
