"""The README and docs/ stay true to the repository: every relative link leads to a file (and
a heading, when it names one), every `make TARGET` they tell a reader to run is a target of
the Makefile, and docs/performance.md keeps one current table per benchmark, each with the
recorded run it comes from (the history of runs is bench/results/HISTORY.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
MAKE = re.compile(r"`make (?:-s )?([a-z][\w-]*)")
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")
PERFORMANCE = ROOT / "docs" / "performance.md"
PERFORMANCE_MAX_LINES = 132  # the soak's table, then the element-only changes'
PERFORMANCE_MAX_COMMITS = 6  # a table per benchmark; the soak's is the sixth


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fenced, found = False, set()
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#+ (.*)", line)):
            found.add(_slug(m.group(1)))
    return found


def _outside_code(page: Path) -> str:
    """The page without its fenced code blocks (a `](x)` in nft or shell text is no link)."""
    return re.sub(r"^```.*?^```$", "", page.read_text(encoding="utf-8"),
                  flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(_outside_code(page)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        heading_missing = bool(anchor) and dest.suffix == ".md" and (
            not dest.exists() or anchor not in _anchors(dest))
        if not dest.exists() or heading_missing:
            broken.append(target)
    assert not broken, broken


def _targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", makefile, re.MULTILINE))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_make_target_named_exists(page: Path) -> None:
    named = set(MAKE.findall(page.read_text(encoding="utf-8")))
    assert named <= _targets(), sorted(named - _targets())


def test_the_performance_doc_is_current_figures_not_history() -> None:
    lines = PERFORMANCE.read_text(encoding="utf-8").splitlines()
    commits = {c for line in lines for c in COMMIT.findall(line)}
    assert len(lines) <= PERFORMANCE_MAX_LINES, "move earlier runs to bench/results/HISTORY.md"
    assert len(commits) <= PERFORMANCE_MAX_COMMITS, sorted(commits)


def test_every_performance_figure_cited_is_a_recorded_run() -> None:
    text = PERFORMANCE.read_text(encoding="utf-8")
    cited = set(re.findall(r"bench/results/[\w.-]+\.(?:json|md)", text))
    assert "bench/results/HISTORY.md" in cited
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, missing
