"""`make demo` (demo/run.py) cleans up whatever stops it: here, its reader going away."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.fixtures import requires_netns

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "pyproxy-demo-"

pytestmark = [pytest.mark.netns, requires_netns]


def demo_namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


def test_a_closed_pipe_still_tears_the_demo_down() -> None:
    """`make demo | head`: once the namespaces and daemons exist, the reader goes away; the
    demo's next line fails with EPIPE, and it must still stop its daemons and delete its
    namespaces (it left all ten behind)."""
    demo = subprocess.Popen([sys.executable, str(ROOT / "demo" / "run.py")], cwd=ROOT,
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
        assert len(demo_namespaces()) == 10
        demo.stdout.close()  # `head` exits
        code = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)  # its own handler cleans up
            demo.wait(timeout=60)
    errors = demo.stderr.read()
    assert code == 128 + signal.SIGPIPE, errors
    assert "Traceback" not in errors, errors
    deadline = time.monotonic() + 5
    while demo_namespaces() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert demo_namespaces() == []
