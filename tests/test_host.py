"""The host settings `pyproxy run` applies at start (kube-proxy's conntrack.go and OOM score),
against a fake /proc tree. tests/test_upstream_parity.py writes them for real in a throwaway
network namespace."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyproxy.config import ProxyConfig
from pyproxy.kernel.host import (
    Outcome,
    Sysctl,
    apply_conntrack,
    apply_oom_score_adj,
    conntrack_max,
    conntrack_sysctls,
)


@pytest.mark.parametrize(("per_core", "minimum", "cpus", "expected"), [
    (32768, 131072, 2, 131072),  # kube-proxy's defaults on two CPUs: the floor
    (32768, 131072, 8, 262144),
    (32768, 0, 2, 65536),
    (0, 131072, 64, 0),  # maxPerCore 0: leave the limit alone, whatever min says
    # kube-proxy 1.36 caps maxPerCore x CPUs at 1,048,576 (kubernetes#137002)...
    (32768, 131072, 64, 1048576),
    (32768, 2097152, 64, 1048576),  # ... before the floor is looked at, as getConntrackMax
    (32768, 2097152, 8, 2097152),
])
def test_conntrack_max_as_kube_proxy_computes_it(per_core: int, minimum: int, cpus: int,
                                                 expected: int) -> None:
    assert conntrack_max(per_core, minimum, cpus) == expected


def test_the_plan_has_only_what_is_configured() -> None:
    assert conntrack_sysctls(ProxyConfig(), cpus=2) == (
        Sysctl("nf_conntrack_max", 131072),
        Sysctl("nf_conntrack_tcp_timeout_established", 86400),
        Sysctl("nf_conntrack_tcp_timeout_close_wait", 3600))
    nothing = ProxyConfig(conntrack_max_per_core=0, conntrack_tcp_established_timeout=0,
                          conntrack_tcp_close_wait_timeout=0)
    assert conntrack_sysctls(nothing, cpus=2) == ()
    everything = ProxyConfig(conntrack_max_per_core=0, conntrack_tcp_established_timeout=0,
                             conntrack_tcp_close_wait_timeout=0, conntrack_tcp_be_liberal=True,
                             conntrack_udp_timeout=30.9, conntrack_udp_stream_timeout=120.0)
    assert conntrack_sysctls(everything, cpus=2) == (
        Sysctl("nf_conntrack_tcp_be_liberal", 1),
        Sysctl("nf_conntrack_udp_timeout", 30),  # whole seconds, truncated as Go's
        Sysctl("nf_conntrack_udp_timeout_stream", 120))


def proc(tmp: Path, values: dict[str, int], hashsize: int) -> tuple[Path, Path]:
    netfilter = tmp / "sys" / "net" / "netfilter"
    netfilter.mkdir(parents=True)
    for name, value in values.items():
        (netfilter / name).write_text(f"{value}\n")
    (tmp / "hashsize").write_text(f"{hashsize}\n")
    return tmp / "sys", tmp / "hashsize"


def test_only_what_differs_is_written_and_the_hash_size_only_raised(tmp_path: Path) -> None:
    proc_sys, hashsize = proc(tmp_path, {"nf_conntrack_max": 65536,
                                         "nf_conntrack_tcp_timeout_established": 86400}, 16384)
    plan = (Sysctl("nf_conntrack_max", 131072),
            Sysctl("nf_conntrack_tcp_timeout_established", 86400),
            Sysctl("nf_conntrack_udp_timeout", 30))  # no such file: reported, the rest goes on
    outcomes = apply_conntrack(plan, str(proc_sys), str(hashsize))
    assert [(o.setting, o.action) for o in outcomes] == [
        ("nf_conntrack_max", "set"), ("nf_conntrack hashsize", "set"),
        ("nf_conntrack_tcp_timeout_established", "unchanged"),
        ("nf_conntrack_udp_timeout", "failed")]
    assert (proc_sys / "net/netfilter/nf_conntrack_max").read_text() == "131072"
    assert hashsize.read_text() == "32768"  # a quarter of nf_conntrack_max
    # a larger hash size is never lowered
    hashsize.write_text("262144\n")
    outcomes = apply_conntrack(plan[:1], str(proc_sys), str(hashsize))
    assert outcomes[1] == Outcome("nf_conntrack hashsize", 32768, "unchanged", "already 262144")
    assert hashsize.read_text() == "262144\n"


def test_a_larger_nf_conntrack_max_is_never_lowered(tmp_path: Path) -> None:
    """The host's own larger limit stays, and nothing is written (kubernetes#142035, the 1.36
    regression #141943: where the sysctl is read-only, as in a container or a namespace
    other than the initial one, the attempt to lower it failed). The hash size is still
    raised to a quarter of the limit pyproxy wants, as kube-proxy does."""
    proc_sys, hashsize = proc(tmp_path, {"nf_conntrack_max": 2097152}, 16384)
    limit = proc_sys / "net/netfilter/nf_conntrack_max"
    outcomes = apply_conntrack((Sysctl("nf_conntrack_max", 131072),), str(proc_sys),
                               str(hashsize))
    assert outcomes[0] == Outcome("nf_conntrack_max", 131072, "unchanged",
                                  "already 2097152, more than wanted: left alone")
    assert limit.read_text() == "2097152\n"
    assert outcomes[1].action == "set"
    assert hashsize.read_text() == "32768"


def test_oom_score_adj(tmp_path: Path) -> None:
    path = tmp_path / "oom_score_adj"
    path.write_text("0\n")
    assert apply_oom_score_adj(-999, str(path)).action == "set"
    assert path.read_text() == "-999"
    assert apply_oom_score_adj(-999, str(path)).action == "unchanged"
    assert apply_oom_score_adj(5, str(tmp_path / "missing" / "x")).action == "failed"
