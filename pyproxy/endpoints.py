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
    service = port.service
    lists = [piece.endpoints_numbered(number) for piece in slices
             if piece.family is family and piece.service == service
             for number in piece.numbers_for(port)]
    if len(lists) == 1:
        return lists[0]  # one slice declares the port: already sorted and unique
    chosen: dict[str, Endpoint] = {}
    for endpoints in lists:
        for ep in endpoints:
            old = chosen.get(ep.key)
            if old is None or (old.terminating and not ep.terminating):
                chosen[ep.key] = ep
    return tuple(chosen[key] for key in sorted(chosen))
