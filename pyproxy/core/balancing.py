"""How a service spreads new connections over the endpoints selected for this node: random
(kube-proxy's), round robin, source hashing or Maglev consistent hashing, each with optional
weights. Pure: it decides the *slots* of the endpoints map (pyproxy.render turns them into map
elements) and computes, for `trace`, which slot the kernel's hash picks.

A slot list is the endpoint per index; the kernel draws an index with `numgen random|inc mod
S` or `jhash … mod S seed X` and looks the endpoint up. Weights repeat an endpoint in
proportion; weight 0 drains it (existing connections stay with conntrack, new ones go
elsewhere).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd
from operator import is_

from pyproxy.core.model import DEFAULT_HASH_SEED, Algorithm, Endpoint, ServicePort
from pyproxy.core.outliers import PortOutliers

# Slots for weighted random / round robin / source hash: enough for weight ratios up to
# this many, few enough that a change touches a small number of elements.
MAX_SLOTS = 256
# Maglev lookup table size: a prime well above the endpoint count (the Maglev paper uses
# 65537 for hundreds of backends; 2039 keeps a service under ~2k elements while moving close
# to 1/N of the clients when one of N endpoints changes, for N up to ~100).
MAGLEV_TABLE_SIZE = 2039


@dataclass(frozen=True, slots=True)
class Balancing:
    algorithm: Algorithm = Algorithm.RANDOM
    seed: int = DEFAULT_HASH_SEED


def balancing_of(port: ServicePort) -> Balancing:
    return Balancing(port.balancing, port.hash_seed)


def effective_weights(port: ServicePort, endpoints: Sequence[Endpoint],
                      outliers: PortOutliers | None = None) -> tuple[list[int], str | None]:
    """Weights per endpoint: the service's `endpoint-weights` map by IP, else the slice's
    weight annotation, else 1, then outlier ejection's (`outliers`: the ejected at 0); and a
    note when they had to be ignored."""
    by_ip = dict(port.endpoint_weights)
    weights = [by_ip.get(ep.ip, 1 if ep.weight is None else ep.weight) for ep in endpoints]
    if endpoints and not any(weights):
        return [1] * len(endpoints), "every endpoint has weight 0: weights ignored"
    if outliers:
        weights = outliers.adjust([ep.key for ep in endpoints], weights)
    return weights, None


def keep_slots(previous: Sequence[Endpoint] | None,
               current: tuple[Endpoint, ...] | None) -> tuple[Endpoint, ...] | None:
    """`current` in the order that keeps every endpoint that stays in the slot it had in
    `previous`: a new endpoint takes a slot an old one left (or is appended), and when the
    list shrinks the last ones move into the holes. One endpoint more or less then changes
    one or two elements of the endpoints map, where the sorted order moved every endpoint
    after it (half of a 5,000-endpoint service's slots for a random pod address). The
    order is otherwise irrelevant to random, round-robin and source-hash picks (and
    source hashing keeps more clients where they were); `current` itself when nothing
    moves."""
    if current is None or not previous:
        return current
    # By address, whose string caches its hash (an (ip, port) tuple is hashed anew each
    # time: 40 % of this at 5,000 endpoints); the port is compared on a hit. An address
    # twice in the list (one per port number: slices disagreeing on it) needs the pair.
    slot_of = {ep.ip: i for i, ep in enumerate(previous)}
    if len(slot_of) != len(previous):
        return _keep_slots_by_pair(previous, current)
    out: list[Endpoint | None] = [None] * len(previous)
    new: list[Endpoint] = []
    get = slot_of.get
    for ep in current:
        i = get(ep.ip)
        if i is None or previous[i].port != ep.port:
            new.append(ep)
        else:
            out[i] = ep
    return _filled(out, new, current)


def _keep_slots_by_pair(previous: Sequence[Endpoint],
                        current: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    slot_of = {(ep.ip, ep.port): i for i, ep in enumerate(previous)}
    out: list[Endpoint | None] = [None] * len(previous)
    new: list[Endpoint] = []
    for ep in current:
        i = slot_of.get((ep.ip, ep.port))
        if i is None:
            new.append(ep)
        else:
            out[i] = ep
    return _filled(out, new, current)


def _filled(out: list[Endpoint | None], new: list[Endpoint],
            current: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    """The slots of the endpoints that stay (out), the new ones in the holes or appended,
    the last ones moved into the holes left when the list shrinks."""
    holes = [i for i, ep in enumerate(out) if ep is None]
    for i, ep in zip(holes, new, strict=False):
        out[i] = ep
    if len(new) > len(holes):
        out.extend(new[len(holes):])
    elif len(holes) > len(new):
        size = len(current)
        movers = [ep for ep in out[size:] if ep is not None]
        low = (i for i in holes[len(new):] if i < size)
        for i, ep in zip(low, movers, strict=False):
            out[i] = ep
        del out[size:]
    if len(out) == len(current) and all(map(is_, out, current)):  # in C: 40 % less
        return current
    return tuple(ep for ep in out if ep is not None)


def slots(endpoints: Sequence[Endpoint], weights: Sequence[int],
          algorithm: Algorithm) -> tuple[Endpoint, ...]:
    """The endpoint of every map index, in index order."""
    if not endpoints:
        return ()
    if algorithm is Algorithm.MAGLEV:
        table = maglev_table([ep.key for ep in endpoints], weights, MAGLEV_TABLE_SIZE)
        return tuple(endpoints[i] for i in table)
    return weighted_slots(endpoints, weights)


def weighted_slots(endpoints: Sequence[Endpoint],
                   weights: Sequence[int]) -> tuple[Endpoint, ...]:
    """Each endpoint repeated in proportion to its weight (weight 0: not at all)."""
    if all(w == 1 for w in weights):
        return tuple(endpoints)
    common = 0
    for w in weights:
        common = gcd(common, w)
    counts = [w // common for w in weights]
    total = sum(counts)
    if total > MAX_SLOTS:
        counts = _scale(counts, MAX_SLOTS)
    out: list[Endpoint] = []
    # Interleave the copies so round robin alternates rather than repeating an endpoint.
    for round_ in range(max(counts)):
        out.extend(ep for ep, n in zip(endpoints, counts, strict=True) if n > round_)
    return tuple(out)


def _scale(counts: list[int], budget: int) -> list[int]:
    """Largest-remainder scaling to `budget` slots; every nonzero weight keeps ≥ 1 slot."""
    total = sum(counts)
    exact = [c * budget / total for c in counts]
    scaled = [max(1, int(x)) if c else 0 for x, c in zip(exact, counts, strict=True)]
    order = sorted(range(len(counts)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order:
        if sum(scaled) >= budget:
            break
        if counts[i]:
            scaled[i] += 1
    return scaled


def maglev_table(names: Sequence[str], weights: Sequence[int], size: int) -> list[int]:
    """Maglev's lookup table (Eisenbud et al., NSDI 2016, §3.4), weighted: each backend
    fills slots in the order of its own permutation, taking turns in proportion to its
    weight. Depends only on the backend names and weights, so every node builds the same
    table, and removing one of N backends moves only about 1/N of the slots."""
    permutations = []
    for name in names:
        digest = hashlib.sha256(name.encode()).digest()
        offset = int.from_bytes(digest[:8], "big") % size
        skip = int.from_bytes(digest[8:16], "big") % (size - 1) + 1
        permutations.append((offset, skip))
    table = [-1] * size
    nexts = [0] * len(names)
    credit = [0.0] * len(names)
    top = max(weights) if weights else 1
    filled = 0
    while filled < size:
        progressed = False
        for i, (offset, skip) in enumerate(permutations):
            if weights[i] <= 0:
                continue
            credit[i] += weights[i] / top
            while credit[i] >= 1 and filled < size:
                credit[i] -= 1
                progressed = True
                while True:
                    slot = (offset + nexts[i] * skip) % size
                    nexts[i] += 1
                    if table[slot] < 0:
                        table[slot] = i
                        filled += 1
                        break
            if filled >= size:
                break
        if not progressed and not any(w > 0 for w in weights):
            break
    return table


# ---------------------------------------------------------------------------------------------
# The kernel's jhash (include/linux/jhash.h), for `trace` to name the slot a flow hashes to.

_MASK = 0xFFFFFFFF
_INIT = 0xDEADBEEF


def _rol(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = (a - c) & _MASK; a ^= _rol(c, 4); c = (c + b) & _MASK  # noqa: E702
    b = (b - a) & _MASK; b ^= _rol(a, 6); a = (a + c) & _MASK  # noqa: E702
    c = (c - b) & _MASK; c ^= _rol(b, 8); b = (b + a) & _MASK  # noqa: E702
    a = (a - c) & _MASK; a ^= _rol(c, 16); c = (c + b) & _MASK  # noqa: E702
    b = (b - a) & _MASK; b ^= _rol(a, 19); a = (a + c) & _MASK  # noqa: E702
    c = (c - b) & _MASK; c ^= _rol(b, 4); b = (b + a) & _MASK  # noqa: E702
    return a, b, c


def _final(a: int, b: int, c: int) -> tuple[int, int, int]:
    c ^= b; c = (c - _rol(b, 14)) & _MASK  # noqa: E702
    a ^= c; a = (a - _rol(c, 11)) & _MASK  # noqa: E702
    b ^= a; b = (b - _rol(a, 25)) & _MASK  # noqa: E702
    c ^= b; c = (c - _rol(b, 16)) & _MASK  # noqa: E702
    a ^= c; a = (a - _rol(c, 4)) & _MASK  # noqa: E702
    b ^= a; b = (b - _rol(a, 14)) & _MASK  # noqa: E702
    c ^= b; c = (c - _rol(b, 24)) & _MASK  # noqa: E702
    return a, b, c


def jhash(key: bytes, seed: int) -> int:
    length = len(key)
    a = b = c = (_INIT + length + seed) & _MASK
    k = key
    while length > 12:
        a = (a + int.from_bytes(k[0:4], "little")) & _MASK
        b = (b + int.from_bytes(k[4:8], "little")) & _MASK
        c = (c + int.from_bytes(k[8:12], "little")) & _MASK
        a, b, c = _mix(a, b, c)
        length -= 12
        k = k[12:]
    if length == 0:
        return c
    tail = k[:length] + bytes(12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & _MASK
    return _final(a, b, c)[2]


def hash_index(key: bytes, seed: int, modulus: int) -> int:
    """nft's `jhash … mod M seed S`: reciprocal_scale(jhash(key), M)."""
    return (jhash(key, seed) * modulus) >> 32


def flow_key(src: bytes, sport: int | None) -> bytes:
    """The bytes nft hashes: the source address, then (Maglev) the source port in its own
    32-bit register, zero padded."""
    if sport is None:
        return src
    return src + sport.to_bytes(2, "big") + bytes(2)
