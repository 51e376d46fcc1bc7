"""The daemon's memory figures are quoted in four places: docs/performance.md's daemon table
(the README's until issue 36), docs/deploying.md's "Sizing", and the comment on the memory
limit of both DaemonSets (manifests/ and manifests/kubeadm/). They have disagreed before.
Their one source is the `make bench-daemon` results the daemon table and "Sizing" cite
(bench/results/daemon-*.json, one file per size): every figure quoted is checked against it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = re.compile(r"bench/results/daemon-[\w.-]+\.json")
DAEMONSETS = ("manifests/03-daemonset.yaml", "manifests/kubeadm/03-daemonset.yaml")


def _section(path: str, heading: str) -> str:
    """A Markdown section, from its heading to the next heading of the same or a higher
    level (outside code blocks, where `# ` starts a shell comment)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    level = len(heading.split(" ", 1)[0])
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced ^= lines[end].startswith("```")
        marks = lines[end].split(" ", 1)[0]
        if not fenced and marks and set(marks) == {"#"} and len(marks) <= level:
            return "\n".join(lines[start:end])
    return "\n".join(lines[start:])


def daemon_table() -> str:
    return _section("docs/performance.md", "## The daemon: `make bench-daemon`")


def sizing() -> str:
    return _section("docs/deploying.md", "### Sizing")


def source() -> dict[tuple[int, int], dict[str, Any]]:
    """(services, endpoints) -> that size's record in the results files cited (one file per
    size: two cited runs of one size would leave the figures without one source)."""
    cited = sorted(set(RESULTS.findall(daemon_table())) | set(RESULTS.findall(sizing())))
    assert cited, "docs/performance.md and docs/deploying.md cite no bench/results/daemon-*.json"
    records: dict[tuple[int, int], dict[str, Any]] = {}
    origin: dict[tuple[int, int], str] = {}
    for path in cited:
        for record in json.loads((ROOT / path).read_text()):
            size = (record["services"], record["endpoints"])
            assert size not in records, f"{size} in both {origin[size]} and {path}"
            records[size], origin[size] = record, path
    return records


def resident(record: dict[str, Any]) -> int:
    return round(record["rss_after_first_sync_mib"])


def ratios(record: dict[str, Any]) -> tuple[float, float]:
    """Peak over resident: cold start, full resync (two decimals, as quoted)."""
    rss = record["rss_after_first_sync_mib"]
    return (round(record["rss_peak_cold_mib"] / rss, 2),
            round(record["rss_peak_resync_mib"] / rss, 2))


def about(quoted: int, measured: float) -> bool:
    """A peak quoted "about" N MiB: N is the figure rounded to 5 MiB at most."""
    return abs(quoted - measured) <= 2.5


def _count(text: str) -> int:
    return int(text.replace(",", "").replace("k", "000"))


def test_the_daemon_table_quotes_the_results_it_cites() -> None:
    figures = source()
    lines = daemon_table().splitlines()
    row = next(i for i, line in enumerate(lines)
               if line.startswith("| resident after the first sync |"))
    header = next(lines[i] for i in range(row, 0, -1) if lines[i + 1].startswith("|---"))
    sizes = [(_count(m.group(1)), int(m.group(2))) if (m := re.fullmatch(
        r"(\d+k) × (\d+)", cell.strip())) else None for cell in header.split("|")[1:-1]]
    quoted_resident = lines[row].split("|")[1:-1]
    peaks = next(line for line in lines if line.startswith("| peak / resident:"))
    quoted_peaks = peaks.split("|")[1:-1]
    checked = 0
    for column, size in enumerate(sizes):
        if size is None:
            continue
        record = figures[size]
        assert quoted_resident[column].strip(" *") == f"{resident(record)} MiB", size
        cold, resync = (float(x) for x in re.findall(r"(\d\.\d\d)×", quoted_peaks[column])[:2])
        assert (cold, resync) == ratios(record), size
        checked += 1
    assert checked >= 2


def test_deploying_sizing_quotes_the_same_figures() -> None:
    figures = source()
    rows = re.findall(r"^\| ([\d,]+) services × (\d+) endpoints \| (\d+) MiB \| "
                      r"(\d\.\d\d)× / (\d\.\d\d)× \(([^)]*)\) \|$", sizing(), re.MULTILINE)
    assert len(rows) >= 3
    for services, endpoints, rss, cold, resync, peaks in rows:
        record = figures[(_count(services), int(endpoints))]
        assert int(rss) == resident(record), (services, endpoints)
        assert (float(cold), float(resync)) == ratios(record), (services, endpoints)
        quoted = [int(n) for n in re.findall(r"\d+", peaks)]
        measured = (record["rss_peak_cold_mib"], record["rss_peak_resync_mib"])
        assert len(quoted) == 2 and all(map(about, quoted, measured)), (peaks, measured)


@pytest.mark.parametrize("path", DAEMONSETS)
def test_the_daemonset_comment_quotes_the_same_figures(path: str) -> None:
    figures = source()
    lines = (ROOT / path).read_text().splitlines()
    limits = next(i for i, line in enumerate(lines) if line.strip() == "limits:")
    comment = " ".join(line.strip().lstrip("#").strip() for line in lines[limits + 1:]
                       if line.strip().startswith("#") or not line.strip())
    comment = comment[:comment.index("memory:")] if "memory:" in comment else comment
    quoted = re.findall(r"(\d+) MiB at ([\d,]+)(?: services)? x (\d+)", comment)
    assert len(quoted) >= 3, comment
    sizes = [(_count(services), int(endpoints)) for _, services, endpoints in quoted]
    for (rss, _, _), size in zip(quoted, sizes, strict=True):
        assert int(rss) == resident(figures[size]), size
    span = re.search(r"(\d\.\d\d)-(\d\.\d\d)x", comment)
    assert span is not None, comment
    low, high = span.groups()
    every_ratio = [r for size in sizes for r in ratios(figures[size])]
    assert (float(low), float(high)) == (min(every_ratio), max(every_ratio))
    peaks = re.search(r"\(about ([^)]*) MiB\)", comment)
    assert peaks is not None, comment
    quoted_peaks = [int(n) for n in re.findall(r"\d+", peaks.group(1))]
    assert len(quoted_peaks) == len(sizes)
    for peak, size in zip(quoted_peaks, sizes, strict=True):  # the higher: a full resync's
        assert about(peak, figures[size]["rss_peak_resync_mib"]), (peak, size)
