"""docs/deploying.md's offline troubleshooting section: where an operator looks when a node
surprises them. Its commands run as written (on examples/cluster.yaml, with the shipped
ConfigMap's configuration), and it says what issue 27's points 3 and 5 give them: the same node
options as `run` (`--nodeport-addresses all`, `--config`) and strict inputs (`--allow-empty`,
duplicates, two Services claiming one external IP, which wins)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploying.md"
PYPROXY = str(Path(sys.executable).parent / "pyproxy")
TITLE = "### Troubleshooting offline: what a node would do, from a snapshot"


def section() -> str:
    text = DOC.read_text(encoding="utf-8")
    assert TITLE in text, "docs/deploying.md has no offline troubleshooting section"
    start = text.index(TITLE)
    end = min(i for i in (text.find("\n## ", start), text.find("\n### ", start + 1))
              if i != -1)
    return text[start:end]


def commands() -> list[list[str]]:
    """The section's `pyproxy` command lines (continuations joined, comments dropped)."""
    block = re.search(r"```sh\n(.*?)```", section(), re.S)
    assert block is not None
    joined = block[1].replace("\\\n", " ")
    lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [argv for argv in lines if argv and argv[0] == "pyproxy"]


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, str]:
    """The files the section's kubectl lines would fetch: the example snapshot, and the shipped
    ConfigMap's configuration."""
    configmap = next(d for d in yaml.safe_load_all((ROOT / "manifests" /
                                                    "02-configmap.yaml").read_text())
                     if d and d.get("kind") == "ConfigMap")
    config = tmp_path / "config.yaml"
    config.write_text(configmap["data"]["config.yaml"])
    return {"cluster.yaml": str(ROOT / "examples" / "cluster.yaml"), "config.yaml": str(config),
            "NODE": "node-a"}


def run(argv: list[str], inputs: dict[str, str]) -> subprocess.CompletedProcess[str]:
    args = [inputs.get(a, a) for a in argv[1:]]
    args = [a for a in args if a not in (">", "NODE.nft")]  # the redirection
    return subprocess.run([PYPROXY, *args], capture_output=True, text=True, timeout=60)


def test_the_sections_commands_run_as_written(inputs: dict[str, str]) -> None:
    found = commands()
    assert [argv[1] for argv in found] == ["explain", "trace", "render"], found
    for argv in found:
        done = run(argv, inputs)
        assert done.returncode == 0, (argv, done.stderr)
        assert done.stdout.strip(), argv
    trace = run(found[1], inputs).stdout
    assert "DNAT (service demo/web:http)" in trace
    # `all`, one of the values the section names, with render's other options as written.
    render = run([*found[2], "--nodeport-addresses", "all"], inputs)
    assert render.returncode == 0, render.stderr


def test_the_section_says_what_points_3_and_5_give() -> None:
    text = " ".join(section().split())
    for phrase in ("`--config FILE`", "`--nodeport-addresses` (CIDRs, `primary`, `localhost` or "
                   "`all`)", "`--allow-empty`", "`apply` never programs an empty ruleset",
                   "reported as a duplicate: the later copy is used",
                   "Two Services claiming one external IP and port",
                   "naming both Services and the one whose rules are used",
                   "a second `--node-ip` of one family"):
        assert phrase in text, phrase
