"""The README is a user's guide: its Performance section stays one current table per benchmark,
each with the command and the recorded run that reproduce it; the history of runs lives in
bench/results/HISTORY.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")
MAX_LINES = 80
MAX_COMMITS = 5


def _section(title: str) -> list[str]:
    """The README's `## title` section, up to the next `## ` heading."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    return lines[start:end]


def test_the_performance_section_is_short_and_names_few_commits() -> None:
    section = _section("Performance")
    commits = {c for line in section for c in COMMIT.findall(line)}
    assert len(section) <= MAX_LINES, f"{len(section)} lines: move history to HISTORY.md"
    assert len(commits) <= MAX_COMMITS, sorted(commits)


def test_every_figure_cited_is_a_recorded_run() -> None:
    """A table's figures come from a results file that is in the repository, and the section
    points at the history that keeps the earlier runs."""
    text = "\n".join(_section("Performance"))
    cited = set(re.findall(r"bench/results/[\w.-]+\.(?:json|md)", text))
    assert "bench/results/HISTORY.md" in cited
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, missing
