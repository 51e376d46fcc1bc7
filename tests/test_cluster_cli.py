"""`make cluster` (`python -m testkit.cluster run`) tears its cluster down whatever stops it:
its reader going away (`make cluster | head`), Ctrl-C, SIGTERM, SIGHUP (its terminal closed),
and a second signal during the teardown. The cluster is the harness's teardown seam: the real
`_main` and Lab, with `RealCluster.start`, `close`, `kubectl` and `admin_kubeconfig` replaced
(bringing a real one up takes a minute or two: tests/test_cluster.py SIGKILLs a real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HARNESS = """
import os, signal, subprocess, sys
from pathlib import Path
import testkit.cluster as c

marker = Path(os.environ["TEARDOWN_MARKER"])

def start(self, with_pyproxy=True):
    self.up_seconds = 1.0
    return self

def close(self):
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C must not stop the teardown
    marker.write_text("torn down")

def kubectl(self, *args, **kwargs):
    lines = int(os.environ["NODE_LINES"])
    return subprocess.CompletedProcess(args, 0, stdout="node-a   Ready\\n" * lines)

c.RealCluster.start = start
c.RealCluster.close = close
c.RealCluster.kubectl = kubectl
c.RealCluster.admin_kubeconfig = lambda self: self.lab.workdir / "admin.kubeconfig"
sys.exit(c._main(sys.argv[1:]))
"""


def harness(tmp_path: Path, *args: str, node_lines: int = 2) -> subprocess.Popen[str]:
    env = {**os.environ, "TEARDOWN_MARKER": str(tmp_path / "torn-down"),
           "NODE_LINES": str(node_lines)}
    # --prefix=: namespaces named after the process, not `make cluster`'s (no lock taken).
    return subprocess.Popen([sys.executable, "-c", HARNESS, "run", "--prefix=", *args],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    return code, proc.stderr.read()


def test_a_closed_pipe_tears_the_cluster_down(tmp_path: Path) -> None:
    """`make cluster | head`: the reader goes while the harness is writing (more than a pipe
    holds); it used to die of SIGPIPE (SIG_DFL) with the whole cluster left running."""
    proc = harness(tmp_path, node_lines=20_000)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "node-a" in first
    proc.stdout.close()  # `head` exits
    code, errors = finish(proc)
    assert code == 128 + signal.SIGPIPE, errors
    assert "Traceback" not in errors, errors
    assert (tmp_path / "torn-down").read_text() == "torn down"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=lambda s: signal.Signals(s).name)
def test_a_signal_tears_the_cluster_down(tmp_path: Path, sig: signal.Signals) -> None:
    """`make cluster KEEP=1`, stopped by Ctrl-C, SIGTERM or its terminal closing (SIGHUP,
    which used to kill it without a teardown); a second Ctrl-C in the teardown is ignored."""
    proc = harness(tmp_path, "--keep")
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Enter or Ctrl-C ends it." in line:
            break
    else:
        pytest.fail("the harness ended before it was up:\n" + "".join(seen) + finish(proc)[1])
    workdir = Path(next(line for line in seen if line.endswith("admin.kubeconfig\n"))
                   .strip()).parent
    assert workdir.is_dir()
    proc.send_signal(sig)
    code, errors = finish(proc)
    assert code == 128 + sig, errors
    assert "Traceback" not in errors, errors
    assert (tmp_path / "torn-down").read_text() == "torn down"
    assert not workdir.exists()  # the lab closed too
    assert proc.stdout.read().splitlines()[-2:] == ["tearing the cluster down ...",
                                                   "cluster torn down"]
