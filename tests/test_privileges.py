"""Without CAP_NET_ADMIN (or not root) `pyproxy run` stops at once with one line naming what is
missing and exit code 1 (issue 35, point 4): it ran on, every sync refused and its traceback
logged every 30 s, while /healthz kept the node in load balancers."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyproxy.kernel.privileges import (
    CAP_NET_ADMIN,
    MissingPrivilege,
    effective_capabilities,
    privilege_problem,
    require_privileges,
)
from testkit.daemonargs import DaemonArgs
from testkit.fixtures import requires_netns
from testkit.netlab import Lab, NetlabError

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
ALL = "000001ffffffffff"  # root's effective set on a 6.x kernel
WITHOUT_NET_ADMIN = f"{int(ALL, 16) & ~(1 << CAP_NET_ADMIN):016x}"


def status(cap_eff: str) -> str:
    return f"Name:\tpyproxy\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\nSeccomp:\t0\n"


@pytest.mark.parametrize(("cap_eff", "euid", "problem"), [
    pytest.param(ALL, 0, None, id="root: can"),
    pytest.param(f"{1 << CAP_NET_ADMIN:016x}", 1000, None, id="not root, given NET_ADMIN: can"),
    pytest.param(WITHOUT_NET_ADMIN, 0, "the process runs as root (uid 0) but without "
                 "CAP_NET_ADMIN: it was dropped", id="root without NET_ADMIN"),
    pytest.param("0000000000000000", 1000, "the process runs as uid 1000, not root, without "
                 "CAP_NET_ADMIN.", id="not root"),
])
def test_what_is_missing(cap_eff: str, euid: int, problem: str | None) -> None:
    found = privilege_problem(status(cap_eff), euid)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
        assert "securityContext" in found  # and what to do


def test_the_capabilities_are_read_from_the_process_status() -> None:
    assert effective_capabilities(status("0000000000003000")) == 0x3000
    with pytest.raises(ValueError, match="CapEff"):
        effective_capabilities("Name:\tx\n")


def test_require_privileges_reads_this_process(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text(status(WITHOUT_NET_ADMIN))
    with pytest.raises(MissingPrivilege, match="without CAP_NET_ADMIN"):
        require_privileges(str(path), euid=0)
    path.write_text(status(ALL))
    require_privileges(str(path), euid=0)


@pytest.fixture
def snapshot() -> Iterator[Path]:
    """An empty cluster, readable by any user (pytest's temporary directories are not)."""
    directory = Path(tempfile.mkdtemp(prefix="pyproxy-privileges-"))
    directory.chmod(0o755)
    path = directory / "cluster.yaml"
    path.write_text("[]\n")
    path.chmod(0o644)
    yield path
    path.unlink()
    directory.rmdir()


@pytest.mark.netns
@requires_netns
@pytest.mark.parametrize(("drop", "says"), [
    pytest.param(["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", "--"],
                 "the process runs as root (uid 0) but without CAP_NET_ADMIN", id="root"),
    pytest.param(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"],
                 "the process runs as uid 65534, not root, without CAP_NET_ADMIN",
                 id="nobody"),
])
def test_without_net_admin_the_daemon_stops_at_once(snapshot: Path, drop: list[str],
                                                    says: str) -> None:
    """The daemon in a namespace of its own, as a process without CAP_NET_ADMIN: one line on
    stderr, exit code 1, nothing left behind (before: it ran until killed)."""
    with Lab() as lab:
        node = lab.add_ns("node")
        try:
            argv = DaemonArgs(snapshot=snapshot, min_sync_period=None, sync_period=None,
                              healthz="", metrics="").argv()
            result = node.run([*drop, *argv], check=False, timeout=30)
        except NetlabError:  # timed out
            pytest.fail("the daemon ran on without CAP_NET_ADMIN")
        assert result.returncode == 1, result.stderr
        [line] = result.stderr.splitlines()
        assert line.startswith(f"pyproxy: cannot program this node: {says}"), line
        assert "Traceback" not in result.stderr + result.stdout
        assert node.run(["nft", "list", "ruleset"]).stdout.strip() == ""
    assert os.geteuid() == 0  # the test itself kept its privileges
