"""`make soak`'s reading of its samples (bench/bench_soak.py): the fits, the drift, the
verdicts against issue 37's targets, and the SVG of the series over time. Pure: no I/O, no
clock; the samples are plain dicts as the JSON keeps them.

A sample (one a minute): ``t`` (seconds since the daemon's first sync), ``rss_mib``,
``cpu_pct`` (its CPU over the minute before), ``fds``, ``threads``, ``elements`` (the
churned Services' elements in the kernel), ``expected`` (what the API held when the churn
was paused), ``converged`` and ``converge_s``; NPL samples separately: ``t``, ``npl`` (s),
``near_restart``, ``write`` (the bench's PATCH round trip, s).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The targets (issue 37, point 3).
WARMUP_S = 600.0  # the RSS fit, the descriptors and the threads from the 10th minute on
RSS_SLOPE_MAX_MIB_PER_H = 1.0
# Flat: the last third's median no more than this above the first third's (after the warm-up).
FDS_TOLERANCE = 2
THREADS_TOLERANCE = 1
# NPL p99 "not drifting": the last third's pooled p99 at most this times the first third's.
NPL_DRIFT_MAX = 1.5


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    if len(xs) != len(ys):
        raise ValueError("xs and ys differ in length")
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..1) of values, as bench_vs_kube_proxy reads one."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def thirds(items: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any]]:
    """items cut in three runs of (nearly) equal length, in order."""
    n = len(items)
    a, b = n // 3, n - n // 3
    return items[:a], items[a:b], items[b:]


@dataclass(frozen=True)
class Verdict:
    name: str
    met: bool
    figure: str  # the measured figure, said the way the docs quote it


def after_warmup(samples: Sequence[dict[str, Any]], warmup: float) -> list[dict[str, Any]]:
    return [s for s in samples if s["t"] >= warmup]


def rss_verdict(samples: Sequence[dict[str, Any]], warmup: float = WARMUP_S) -> Verdict:
    kept = after_warmup(samples, warmup)
    if len(kept) < 2:
        return Verdict("RSS growth", False, "too few samples after the warm-up")
    per_hour = 3600 * slope([s["t"] for s in kept], [s["rss_mib"] for s in kept])
    return Verdict("RSS growth", per_hour <= RSS_SLOPE_MAX_MIB_PER_H,
                   f"{per_hour:+.2f} MiB/h (least-squares fit of {len(kept)} samples from "
                   f"{warmup / 60:.0f} min; {kept[0]['rss_mib']:.1f} → "
                   f"{kept[-1]['rss_mib']:.1f} MiB)")


def flat_verdict(samples: Sequence[dict[str, Any]], key: str, tolerance: int,
                 warmup: float = WARMUP_S) -> Verdict:
    kept = after_warmup(samples, warmup)
    first, _, last = thirds(kept)
    if not first or not last:
        return Verdict(f"{key} flat", False, "too few samples after the warm-up")
    before = statistics.median(s[key] for s in first)
    after = statistics.median(s[key] for s in last)
    values = [s[key] for s in kept]
    per_hour = 3600 * slope([s["t"] for s in kept], values)
    return Verdict(f"{key} flat", after - before <= tolerance,
                   f"median {before:g} first third, {after:g} last third (min {min(values)}, "
                   f"max {max(values)}, fit {per_hour:+.2f}/h)")


def convergence_verdict(samples: Sequence[dict[str, Any]]) -> Verdict:
    if not samples:
        return Verdict("table converges", False, "no samples")
    missed = [s for s in samples if not s["converged"]]
    worst = max(s["converge_s"] for s in samples)
    figure = (f"{len(samples) - len(missed)}/{len(samples)} samples at the expected count, "
              f"slowest in {worst:.1f} s")
    if missed:
        first = missed[0]
        figure += (f"; first miss at {first['t'] / 60:.0f} min: {first['elements']} elements "
                   f"against {first['expected']}")
    return Verdict("table converges", not missed, figure)


def npl_thirds(npl: Sequence[dict[str, Any]], duration: float) -> dict[str, dict[str, float]]:
    """p50/p99 (ms) and count of the NPL samples in the run's first and last third by time,
    those taken near an API server restart left out (they measure the outage, not drift)."""
    out = {}
    for name, low, high in (("first", 0.0, duration / 3),
                            ("last", 2 * duration / 3, float("inf"))):
        kept = [s for s in npl if low <= s["t"] < high and not s.get("near_restart")]
        values = [s["npl"] for s in kept]
        # The daemon's part: the NPL less the bench's own write (its PATCH's round trip),
        # which a slow API server stretches (bench_npl.flips records it).
        daemon = [s["npl"] - s["write"] for s in kept if "write" in s]
        out[name] = {"p50_ms": 1000 * percentile(values, 0.5),
                     "p99_ms": 1000 * percentile(values, 0.99), "n": float(len(values)),
                     "after_write_p50_ms": 1000 * percentile(daemon, 0.5),
                     "after_write_p99_ms": 1000 * percentile(daemon, 0.99)}
    return out


def npl_verdict(npl: Sequence[dict[str, Any]], duration: float) -> Verdict:
    parts = npl_thirds(npl, duration)
    first, last = parts["first"], parts["last"]
    if not first["n"] or not last["n"]:
        return Verdict("NPL p99 not drifting", False, "too few NPL samples")
    ratio = last["p99_ms"] / first["p99_ms"]
    return Verdict("NPL p99 not drifting", ratio <= NPL_DRIFT_MAX,
                   f"p99 {first['p99_ms']:.0f} ms first third, {last['p99_ms']:.0f} ms last "
                   f"third ({ratio:.2f}×; p50 {first['p50_ms']:.0f} → {last['p50_ms']:.0f} ms; "
                   f"n {first['n']:.0f}/{last['n']:.0f}); after the write: p99 "
                   f"{first['after_write_p99_ms']:.0f} → {last['after_write_p99_ms']:.0f} ms")


def verdicts(samples: Sequence[dict[str, Any]], npl: Sequence[dict[str, Any]],
             duration: float, warmup: float = WARMUP_S) -> list[Verdict]:
    return [rss_verdict(samples, warmup),
            flat_verdict(samples, "fds", FDS_TOLERANCE, warmup),
            flat_verdict(samples, "threads", THREADS_TOLERANCE, warmup),
            convergence_verdict(samples),
            npl_verdict(npl, duration)]


def npl_per_minute(npl: Sequence[dict[str, Any]], samples: Sequence[dict[str, Any]],
                   ) -> list[dict[str, float]]:
    """Each sample's NPL p50/p99 (ms) over the NPL samples since the sample before."""
    out = []
    previous = float("-inf")
    for s in samples:
        values = [n["npl"] for n in npl if previous <= n["t"] < s["t"]]
        out.append({"t": s["t"], "p50_ms": 1000 * percentile(values, 0.5),
                    "p99_ms": 1000 * percentile(values, 0.99)})
        previous = s["t"]
    return out


# -- the plot ------------------------------------------------------------------------------

WIDTH, PANEL_H, LEFT, RIGHT, TOP = 720, 92, 64, 12, 22
COLORS = ("#1f77b4", "#d62728")


def _points(ts: Sequence[float], ys: Sequence[float], t_max: float, lo: float, hi: float,
            top: float) -> str:
    span = (hi - lo) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, PANEL_H - 30
    pts = []
    for t, y in zip(ts, ys, strict=True):
        if y != y:  # NaN: a minute without NPL samples
            continue
        px = LEFT + plot_w * (t / t_max if t_max else 0.0)
        py = top + plot_h - plot_h * (y - lo) / span
        pts.append(f"{px:.1f},{py:.1f}")
    return " ".join(pts)


def svg(title: str, samples: Sequence[dict[str, Any]], npl: Sequence[dict[str, Any]],
        restarts: Sequence[float]) -> str:
    """The series over time, one panel each (two lines where two belong together), the API
    server's restarts as dashed lines. Small: no library, a polyline per series."""
    minute = npl_per_minute(npl, samples)
    ts = [s["t"] for s in samples]
    panels: list[tuple[str, list[tuple[str, list[float]]]]] = [
        ("RSS (MiB)", [("rss", [s["rss_mib"] for s in samples])]),
        ("CPU (% of a core)", [("cpu", [s["cpu_pct"] for s in samples])]),
        ("open descriptors", [("fds", [float(s["fds"]) for s in samples])]),
        ("threads", [("threads", [float(s["threads"]) for s in samples])]),
        ("table elements: kernel, expected", [
            ("kernel", [float(s["elements"]) for s in samples]),
            ("expected", [float(s["expected"]) for s in samples])]),
        ("NPL (ms): p50, p99", [("p50", [m["p50_ms"] for m in minute]),
                                ("p99", [m["p99_ms"] for m in minute])]),
    ]
    t_max = max(ts, default=0.0)
    height = TOP + PANEL_H * len(panels) + 18
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{LEFT}" y="14" font-size="12">{_escape(title)}</text>']
    for k, (label, series) in enumerate(panels):
        top = TOP + k * PANEL_H + 12
        values = [y for _, ys in series for y in ys if y == y]
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        plot_h = PANEL_H - 30
        out.append(f'<text x="{LEFT}" y="{top - 3}">{_escape(label)}</text>')
        out.append(f'<rect x="{LEFT}" y="{top}" width="{WIDTH - LEFT - RIGHT}" '
                   f'height="{plot_h}" fill="none" stroke="#bbb"/>')
        out.append(f'<text x="{LEFT - 4}" y="{top + 9}" text-anchor="end">{hi:.4g}</text>')
        out.append(f'<text x="{LEFT - 4}" y="{top + plot_h}" text-anchor="end">{lo:.4g}</text>')
        for r in restarts:
            if t_max:
                x = LEFT + (WIDTH - LEFT - RIGHT) * r / t_max
                out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" '
                           'stroke="#999" stroke-dasharray="3,3"/>')
        for n, (_, ys) in enumerate(series):
            out.append(f'<polyline fill="none" stroke="{COLORS[n % 2]}" stroke-width="1.5" '
                       f'points="{_points(ts, ys, t_max, lo, hi, top)}"/>')
    out.append(f'<text x="{LEFT}" y="{height - 4}">minutes since the first sync: 0 … '
               f'{t_max / 60:.0f}; dashed: kube-apiserver restarted</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
