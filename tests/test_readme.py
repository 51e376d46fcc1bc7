"""The README is the front door: what pyproxy is, two commands, a five-minute tour, how to
install, one performance table and links; everything else lives in docs/. Its tour shows
the commands' real output, its one table is docs/performance.md's, and its Performance
section names the recorded run and the history (bench/results/HISTORY.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pyproxy.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")
MAX_README_LINES = 150
MAX_LINES = 40  # the README's Performance section
MAX_COMMITS = 5


def _lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def _section(title: str) -> list[str]:
    """The README's `## title` section, up to the next `## ` heading."""
    lines = _lines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    return lines[start:end]


def _table(lines: list[str]) -> list[str]:
    """The first Markdown table's rows."""
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")),
               len(lines))
    return lines[start:end]


def test_the_readme_is_a_guide_not_a_notebook() -> None:
    assert len(_lines()) <= MAX_README_LINES, "move the detail into docs/"


def test_the_two_commands_are_the_ones_ci_runs() -> None:
    """.ci/run runs what the README tells a new user to run for the tests: `make test`."""
    section = "\n".join(_section("Two commands"))
    assert re.search(r"^make demo\s+#", section, re.MULTILINE)
    assert re.search(r"^make test\s+#", section, re.MULTILINE)
    assert (ROOT / ".ci/run").read_text().splitlines()[-1] == "make test"


def test_the_performance_section_is_short_and_names_few_commits() -> None:
    section = _section("Performance")
    commits = {c for line in section for c in COMMIT.findall(line)}
    assert len(section) <= MAX_LINES, f"{len(section)} lines: move detail to docs/performance.md"
    assert len(commits) <= MAX_COMMITS, sorted(commits)


def test_every_figure_cited_is_a_recorded_run() -> None:
    """A table's figures come from a results file that is in the repository, and the section
    points at the history that keeps the earlier runs."""
    text = "\n".join(_section("Performance"))
    cited = set(re.findall(r"bench/results/[\w.-]+\.(?:json|md)", text))
    assert "bench/results/HISTORY.md" in cited
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, missing


def test_the_one_table_is_docs_performance_table() -> None:
    """The README's table is a copy of one of docs/performance.md's, row for row: two copies
    that drift apart are how quoted figures went wrong before."""
    readme = _table(_section("Performance"))
    doc = (ROOT / "docs/performance.md").read_text(encoding="utf-8").splitlines()
    start = doc.index(readme[0])
    assert doc[start:start + len(readme)] == readme


def _console_blocks(path: Path) -> list[tuple[str, str]]:
    """(command, output) of each ```console block of a page that runs pyproxy offline (`-f`)."""
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"^```console\n\$ (pyproxy .*? -f .*?)\n(.*?)^```$", text,
                        re.MULTILINE | re.DOTALL)
    assert blocks, f"{path.name} shows no offline command"
    return blocks


@pytest.mark.parametrize(("command", "shown"), [
    pytest.param(command, shown, id=f"{page}: {command.split(' -f ')[0]}")
    for page in ("README.md", "docs/operating.md")
    for command, shown in _console_blocks(ROOT / page)])
def test_the_tour_shows_the_real_output(command: str, shown: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each offline command the README's tour (and docs/operating.md) shows, run from the
    repository root, prints what the page shows (its stderr first: a skipped object is said
    before the answer)."""
    argv = shlex.split(command)
    assert argv[0] == "pyproxy"
    monkeypatch.chdir(ROOT)
    assert main(argv[1:]) == 0
    out, err = capsys.readouterr()
    assert err + out == shown
