"""Least-connection balancing (IPVS's lc, wlc, sed and nq) in random picks over slots (pure).

IPVS picks, for each new connection, the server with the least cost; nftables picks a slot
of the endpoints map at random (`numgen random mod S`). pyproxy closes the loop: at a bounded
interval the connections in flight per endpoint (core/inflight.py, from conntrack) set how
many of a service port's S slots each endpoint holds, so that the less loaded get more of the
new connections. The costs are IPVS's, with A an endpoint's active (ESTABLISHED) connections,
I its inactive ones (every other state) and w its weight (`endpoint-weights`, the slice's
`weight`; 1 by default; weight 0: no slot):

    lc   256·A + I          (weights are not used, but 0 still drains)
    wlc  (256·A + I) / w
    sed  (A + 1) / w
    nq   (A + 1) / w, and an endpoint with A = 0 first

"Least" becomes a share biased towards the less loaded: each step an endpoint's target
share is proportional to (1/c)^GAMMA — c its cost, plus one connection's so that an idle
endpoint's is not 0 — and its share moves a fifth of the way there (SMOOTHING). With
GAMMA = 3 an endpoint with twice the others' cost gets an eighth of their share of the new
connections.
nq gives every idle endpoint (A = 0) at least the largest target: idle first.

Why it does not oscillate: the target is a fixed function of the loads read now, with no
integral of past errors to wind up. Connections held for a lifetime d respond to a share
with that lag (a moving sum over d, or a first-order response for exponential lifetimes);
an integral controller (shares multiplied by (c̄/c)^g each step, which would settle where
every cost is equal) was measured to swing the slow endpoint of bench/bench_least.py from
1 to 21 held connections and back with a 33 s period: with a lag of 20 steps its gain must
be below ~0.1, and below that for longer lifetimes. The proportional law settles for every
lifetime tried (1 to 120 s, both kinds of response, tests/test_least.py), at the price of
not equalising completely: at the fixed point A ∝ (λ·d·w^GAMMA)^(1/(1+GAMMA)), an endpoint
holding connections ten times longer holds 10^(1/4) = 1.8 times the others' connections
(random: 10 times). A steeper GAMMA evens more but turns the counts' noise into more slot
moves (a count's ±5 % becomes a target's ±15 % at 3, ±20 % at 4; bench/bench_least.py's
cost). Hysteresis keeps it quiet: targets within DEADBAND (10 %) of the share leave it
alone, slot counts are rounded, and a table within two slots of its targets is not
rewritten (sync/least.py). Every endpoint of weight > 0 keeps at least one slot.

Slots are moved, not reshuffled: an endpoint that loses k slots gives up its last k, which
go to the endpoints that gain; every other slot keeps its endpoint, so a step writes only the
elements that changed (`moved_slots`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyproxy.core.model import Algorithm, Endpoint

Load = tuple[int, int]  # (established, other): core/inflight.py's Load
IDLE: Load = (0, 0)

LEAST = frozenset({Algorithm.LEAST_CONNECTIONS, Algorithm.WEIGHTED_LEAST_CONNECTIONS,
                   Algorithm.SHORTEST_EXPECTED_DELAY, Algorithm.NEVER_QUEUE})
GAMMA = 3.0  # how steeply the target share falls with the cost
SMOOTHING = 0.2  # how far a share moves towards its target in one step
DEADBAND = 0.10  # targets within this of the share leave it alone
MIN_SLOTS, SLOTS_PER_ENDPOINT, MAX_SLOTS = 64, 16, 256


def slot_count(endpoints: int) -> int:
    """S for a least-connection port: 16 per endpoint, 64 to 256. Fixed for a given number
    of endpoints, so that the pick rule (`mod S`) stays as it is while the shares move."""
    return max(MIN_SLOTS, min(MAX_SLOTS, SLOTS_PER_ENDPOINT * endpoints))


def cost(algorithm: Algorithm, load: Load, weight: int) -> float:
    """IPVS's cost of one endpoint, plus one connection's (never 0)."""
    active, inactive = load
    if algorithm is Algorithm.LEAST_CONNECTIONS:
        return 256 * active + inactive + 256
    if algorithm is Algorithm.WEIGHTED_LEAST_CONNECTIONS:
        return (256 * active + inactive + 256) / weight
    return (active + 1) / weight  # sed, nq


def step(algorithm: Algorithm, shares: Mapping[str, float], loads: Mapping[str, Load],
         weights: Mapping[str, int]) -> dict[str, float]:
    """The next shares (summing to 1) of the endpoints of `weights` (weight 0: none), from
    the last ones (`shares`; an endpoint without one starts at the mean) and the loads now."""
    live = [key for key, w in weights.items() if w > 0]
    if not live:
        return {}
    start = 1.0 / len(live)
    current = {key: shares.get(key, 0.0) or start for key in live}
    total = sum(current.values())
    current = {key: s / total for key, s in current.items()}
    costs = {key: cost(algorithm, loads.get(key, IDLE), weights[key]) for key in live}
    lowest = min(costs.values())
    raw = {key: (lowest / costs[key]) ** GAMMA for key in live}  # scaled: no underflow
    if algorithm is Algorithm.NEVER_QUEUE:
        top = max(raw.values())
        raw = {key: top if loads.get(key, IDLE)[0] == 0 else r for key, r in raw.items()}
    norm = sum(raw.values())
    target = {key: r / norm for key, r in raw.items()}
    if all(abs(target[k] - current[k]) <= DEADBAND * current[k] for k in live):
        return current
    return {key: current[key] + SMOOTHING * (target[key] - current[key]) for key in live}


def slot_targets(shares: Mapping[str, float], size: int) -> dict[str, int]:
    """Slots per endpoint from shares: largest remainders, every endpoint at least one."""
    keys = sorted(shares)
    if not keys:
        return {}
    exact = {k: shares[k] * size for k in keys}
    counts = {k: max(1, math.floor(exact[k])) for k in keys}
    spare = size - sum(counts.values())
    by_remainder = sorted(keys, key=lambda k: (exact[k] - math.floor(exact[k]), k), reverse=True)
    for k in by_remainder:
        if spare <= 0:
            break
        counts[k] += 1
        spare -= 1
    while spare < 0:  # the floors of one slot took more than the size allows
        k = max(counts, key=lambda key: (counts[key], key))
        counts[k] -= 1
        spare += 1
    return counts


def moved_slots(previous: Sequence[str], targets: Mapping[str, int]) -> tuple[str, ...]:
    """The slot table (endpoint key per index) holding `targets` slots per endpoint, with
    as few slots as possible changed from `previous`: a slot keeps its endpoint unless that
    endpoint is gone or holds too many (it gives up its last ones); the freed slots and any
    beyond `previous`'s length go to the endpoints short of theirs, in key order."""
    size = sum(targets.values())
    kept = list(previous[:size])
    table = _release_from_the_end([*kept, *[None] * (size - len(kept))], targets)
    held: dict[str, int] = {}
    for key in table:
        if key is not None:
            held[key] = held.get(key, 0) + 1
    wanting = [key for key in sorted(targets) for _ in range(targets[key] - held.get(key, 0))]
    it = iter(wanting)
    out = [key if key is not None else next(it) for key in table]
    return tuple(out)


def _release_from_the_end(table: list[str | None], targets: Mapping[str, int]
                          ) -> list[str | None]:
    counts: dict[str, int] = {}
    for key in table:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    for i in range(len(table) - 1, -1, -1):
        key = table[i]
        if key is None:
            continue
        if counts[key] > targets.get(key, 0):
            counts[key] -= 1
            table[i] = None
    return table


@dataclass(frozen=True, slots=True)
class LeastSlots:
    """A least-connection port's slot table as the feedback last set it (endpoint keys by
    index), and the shares it came from; what the renderer fits the endpoints in force to."""

    table: tuple[str, ...]
    shares: tuple[tuple[str, float], ...]


def initial_shares(weights: Mapping[str, int], algorithm: Algorithm) -> dict[str, float]:
    """Before any feedback: in proportion to the weights (lc: equal)."""
    live = {k: (1 if algorithm is Algorithm.LEAST_CONNECTIONS else w)
            for k, w in weights.items() if w > 0}
    total = sum(live.values())
    return {k: w / total for k, w in live.items()} if total else {}


def fitted(least: LeastSlots | None, keys: Sequence[str], weights: Sequence[int],
           algorithm: Algorithm) -> tuple[str, ...]:
    """The slot table for these endpoints (keys, with their weights): the feedback's last
    one, fitted to the endpoints in force (one gone: its slots to the others; one new: the
    mean share), or the initial one."""
    by_key = dict(zip(keys, weights, strict=True))
    live = {k: w for k, w in by_key.items() if w > 0}
    if not live:
        return ()
    if least is None:
        shares = initial_shares(live, algorithm)
        previous: tuple[str, ...] = ()
    else:
        known = {k: s for k, s in least.shares if k in live}
        mean = (sum(known.values()) / len(known)) if known else 1.0
        shares = {k: known.get(k, mean) for k in live}
        total = sum(shares.values())
        shares = {k: s / total for k, s in shares.items()}
        previous = least.table
    return moved_slots(previous, slot_targets(shares, slot_count(len(live))))


def least_slots(endpoints: Sequence[Endpoint], weights: Sequence[int], algorithm: Algorithm,
                least: LeastSlots | None) -> tuple[Endpoint, ...]:
    """The endpoints map's slots of a least-connection port's list (`fitted`'s table)."""
    by_key = {ep.key: ep for ep in endpoints}
    return tuple(by_key[key] for key in fitted(least, list(by_key), weights, algorithm))


NAMES = {Algorithm.LEAST_CONNECTIONS: "least connections",
         Algorithm.WEIGHTED_LEAST_CONNECTIONS: "weighted least connections",
         Algorithm.SHORTEST_EXPECTED_DELAY: "shortest expected delay",
         Algorithm.NEVER_QUEUE: "never queue"}


def least_reason(algorithm: Algorithm, least: LeastSlots | None) -> str:
    """explain's line: the algorithm, and the shares the feedback set last."""
    text = (f"balancing: {NAMES[algorithm]} ({algorithm}), by feedback: the endpoints' shares "
            "of the slots follow their connections in flight on this node")
    if least is None:
        return text + " (no feedback yet: shares by weight)"
    shares = ", ".join(f"{key} {share:.0%}" for key, share in least.shares)
    return f"{text}; now {shares}"
