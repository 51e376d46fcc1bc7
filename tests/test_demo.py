"""`make demo` (`python -m demo.run`) cleans up whatever stops it: here, its reader going
away."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from testkit.fixtures import requires_netns
from testkit.waits import until

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "pyproxy-demo-"
LOCK = Path(tempfile.gettempdir()) / "pyproxy-demo.lock"

pytestmark = [pytest.mark.netns, requires_netns]


def demo_namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


def processes_using(path: str) -> list[int]:
    """Pids whose command line names `path` (the daemons name their snapshot file, as
    `--snapshot=PATH` since DaemonArgs spells their command lines, or as an argument)."""
    wanted = {path.encode(), b"--snapshot=" + path.encode()}
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            if wanted & set(argv):
                found.append(int(proc.name))
    return found


def test_a_closed_pipe_still_tears_the_demo_down() -> None:
    """`make demo | head`: once the namespaces and daemons exist, the reader goes away; the
    demo's next line fails with EPIPE, and it must still stop its daemons and delete its
    namespaces, its temp directory and its lock (it once left all ten namespaces behind)."""
    demo = subprocess.Popen([sys.executable, "-m", "demo.run"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert demo.stdout is not None and demo.stderr is not None
    seen = []
    try:
        for line in demo.stdout:  # read like `head` until the cluster is up
            seen.append(line)
            if "daemons synced" in line:
                break
        else:
            pytest.fail("the demo ended before its daemons synced:\n" + "".join(seen)
                        + demo.stderr.read())
        snapshot = next(m.group(0) for line in seen
                        if (m := re.search(rf"/\S*/{PREFIX}\w+/cluster\.yaml", line)))
        workdir = Path(snapshot).parent
        assert len(demo_namespaces()) == 10
        assert len(processes_using(snapshot)) == 3  # one daemon per node
        assert workdir.is_dir() and LOCK.exists()
        demo.stdout.close()  # `head` exits
        code = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)  # its own handler cleans up
            demo.wait(timeout=60)
    errors = demo.stderr.read()
    assert code == 128 + signal.SIGPIPE, errors
    assert "Traceback" not in errors, errors
    until(lambda: not demo_namespaces(), 5, "the demo's namespaces gone")
    assert processes_using(snapshot) == []
    assert not workdir.exists()
    assert not LOCK.exists()
