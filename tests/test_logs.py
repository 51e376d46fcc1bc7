"""Log lines: on stderr in every command, in the format asked for whatever stderr is; standard
output holds the answer only (`pyproxy render -f F | nft -f -`)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import yaml

from pyproxy.cli import build_parser
from pyproxy.cli.formats import format_services
from pyproxy.core.explain import format_table
from pyproxy.logs import setup_logging
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fixtures import requires_netns
from testkit.netlab import Lab

PYPROXY = str(Path(sys.executable).parent / "pyproxy")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    saved = structlog.get_config()
    yield None
    structlog.configure(**saved)


def logged(fmt: str, stream: io.StringIO) -> str:
    setup_logging(fmt, stream=stream, cache=False)
    structlog.get_logger("probe").warning("thing_happened", where="node a", count=2, ok=True)
    return stream.getvalue()


class TestFormats:
    def test_text_is_key_value_lines_off_a_terminal(self) -> None:
        """Under a pod or journald, `text` (the default) stays text: logfmt, no colours."""
        line = logged("text", io.StringIO())
        assert line.startswith("timestamp=")
        assert line.split(" ", 1)[1] == ('level=warning event=thing_happened where="node a" '
                                         'count=2 ok=true\n')

    def test_json_is_json_lines(self) -> None:
        entry = json.loads(logged("json", io.StringIO()))
        assert {k: v for k, v in entry.items() if k != "timestamp"} == {
            "event": "thing_happened", "level": "warning", "where": "node a", "count": 2,
            "ok": True}

    def test_text_on_a_terminal_is_for_people(self) -> None:
        line = logged("text", Terminal())
        assert "thing_happened" in line and "\x1b[" in line  # coloured columns

    def test_json_on_a_terminal_is_still_json(self) -> None:
        assert json.loads(logged("json", Terminal()))["event"] == "thing_happened"

    def test_logs_follow_a_replaced_stderr(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Lines go to the stderr of the moment, not the one logging was set up with."""
        setup_logging("text", cache=False)
        later = io.StringIO()
        monkeypatch.setattr(sys, "stderr", later)
        structlog.get_logger("probe").info("late")
        assert "event=late" in later.getvalue()


def test_every_command_takes_logging_format() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in commands:
        args = ["--file=x", "--node=n"] if name in ("render", "apply") else []
        if name == "trace":
            args = ["--src=10.0.0.1", "--dst=10.96.0.1:80"]
        if name == "config":
            args = ["check"]
        if name == "completion":
            args = ["bash"]
        parsed = parser.parse_args([name, *args, "--logging-format", "json"])
        assert parsed.logging_format == "json", name


# ---------------------------------------------------------------------------------------------
# Standard output is for the answer


def lenient_snapshot(path: Path) -> Path:
    """A Service whose ClusterIP has a leading zero: kube-proxy reads it (ParseIPSloppy) and
    so does pyproxy, with a warning in the log."""
    path.write_text(yaml.safe_dump_all([
        make_node("node-a", "zone-1"), make_service("demo", "web", ip="10.96.0.010"),
        make_slice("demo", "web", [ep("10.244.1.5", "node-a")])]))
    return path


def render(snapshot: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYPROXY, "render", "-f", str(snapshot), "--node", "node-a",
                           "--node-ip", "192.168.1.2", *extra],
                          capture_output=True, text=True, timeout=60, check=True)


@pytest.mark.parametrize("fmt", [None, "text", "json"])
def test_render_logs_on_stderr_only(tmp_path: Path, fmt: str | None) -> None:
    result = render(lenient_snapshot(tmp_path / "cluster.yaml"),
                    *(["--logging-format", fmt] if fmt else []))
    assert result.stdout.startswith("add table ip pyproxy")
    assert "address_read_leniently" not in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr  # spec.clusterIP and spec.clusterIPs[0]
    if fmt == "json":
        assert {json.loads(line)["event"] for line in lines} == {"address_read_leniently"}
    else:
        assert all(" level=warning event=address_read_leniently " in line for line in lines)


@pytest.mark.netns
@requires_netns
def test_render_pipes_into_nft(lab: Lab, tmp_path: Path) -> None:
    """`pyproxy render | nft -f -`, in a throwaway namespace, with a snapshot that logs."""
    ns = lab.add_ns("render")
    snapshot = lenient_snapshot(tmp_path / "cluster.yaml")
    result = lab.run(ns, ["bash", "-c", f"set -o pipefail; {PYPROXY} render -f {snapshot} "
                                      "--node node-a --node-ip 192.168.1.2 | nft -f -"],
                     check=False)
    assert result.returncode == 0, result.stderr
    assert "address_read_leniently" in result.stderr
    assert "10.96.0.10" in lab.run(ns, ["nft", "list", "set", "ip", "pyproxy",
                                        "cluster-ips"]).stdout


# ---------------------------------------------------------------------------------------------
# Tables


def test_tables_show_no_topology_as_a_dash() -> None:
    """No topology preference is `-` in a table (JSON keeps kube-proxy's "None")."""
    entry = {"service": "demo/web", "servicePort": "http", "protocol": "TCP", "port": 80,
             "type": "ClusterIP", "clusterIPs": ["10.96.0.10"], "nodePort": None,
             "topology": "None", "clusterEndpoints": [], "localEndpoints": None}
    header, row = format_services([entry]).splitlines()
    assert row.split()[header.split().index("TOPOLOGY")] == "-"
    report = {"node": {"name": "node-a", "labels": {}}, "skipped": [],
              "services": [{**entry, "port": "http", "ipFamily": "IPv4", "reasons": []}]}
    explained = format_table(report).splitlines()[2]
    assert explained.split()[3] == "-"
    assert "None" not in format_table(report)
