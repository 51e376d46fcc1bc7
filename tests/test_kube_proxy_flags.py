"""Every flag of kube-proxy v1.37 works with `pyproxy run` (issue 27, point 2): applied, or
accepted (type checked) with a start-up warning that says it is not applied. The list comes
from kube-proxy's own `--help` (the binary `make k8s` builds), so a flag kube-proxy gains
fails here until pyproxy decides what to do with it.

kube-proxy is only ever asked for `--help`: run for real outside a throwaway namespace it
would write the host's conntrack sysctls.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyproxy.cli import build_parser
from pyproxy.config import ConfigError, ProxyConfig, from_args
from pyproxy.config.flags import FLAGS
from testkit.controlplane import binaries_dir
from testkit.netlab import Lab

PYPROXY = str(Path(sys.executable).parent / "pyproxy")
# `--name type   help`: the type is missing for a bool flag.
FLAG_LINE = re.compile(r"^\s+(?:-\w, )?--([\w-]+)(?: (\S+))?\s{2,}")

# A value of each of kube-proxy's flag types, and where a flag needs its own.
BY_TYPE = {
    "ip": "192.0.2.1", "ipport": "127.0.0.1:9999", "duration": "7s", "int32": "17",
    "float32": "7", "string": "x", "strings": "10.0.0.0/8", "LocalMode": "NodeCIDR",
    "mapStringBool": "MultiCIDRServiceAllocator=false", "quantity": "64Ki", "Level": "3",
    "pattern=N,...": "foo=2",
}
BY_NAME = {
    "cluster-cidr": "10.244.0.0/16", "nodeport-addresses": "all", "logging-format": "json",
    "pod-bridge-interface": "cbr0", "pod-interface-name-prefix": "veth",
    "master": "https://192.0.2.1:6443", "kube-api-content-type": "application/json",
    "show-hidden-metrics-for-version": "1.36", "ipvs-scheduler": "rr",
    "hostname-override": "node-a", "kubeconfig": "/etc/kubernetes/proxy.conf",
}
# Flags that make `run` do something else, tested on their own below (and --config, by the
# configuration tests); --proxy-mode only checks its value.
ACTIONS = {"help", "version", "config", "write-config-to", "cleanup", "init-only", "proxy-mode"}


@pytest.fixture(scope="module")
def kube_proxy_flags() -> dict[str, str]:
    """kube-proxy's flags and their types ("bool" for a flag without a value)."""
    binary = binaries_dir() / "kube-proxy"
    if not os.access(binary, os.X_OK):
        message = f"{binary} is not built (make k8s)"
        if os.environ.get("CI"):  # `make test` builds it first: a skip there would hide these
            pytest.fail(message)
        pytest.skip(message)
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    flags = {m[1]: m[2] or "bool" for m in map(FLAG_LINE.match, out.splitlines()) if m}
    assert {"bind-address", "cleanup", "vmodule", "write-config-to"} <= set(flags), out
    return flags


def given(name: str, kind: str) -> list[str]:
    if kind == "bool":
        return [f"--{name}"]
    return [f"--{name}={BY_NAME.get(name, BY_TYPE[kind])}"]


def test_every_kube_proxy_flag_is_applied_or_warned_about(
        kube_proxy_flags: dict[str, str]) -> None:
    """Each flag alone changes a setting, or is warned about at start-up as not applied."""
    parser = build_parser()
    default = ProxyConfig()
    for name, kind in sorted(kube_proxy_flags.items()):
        if name in ACTIONS:
            continue
        config = from_args(parser.parse_args(["run", *given(name, kind)]))
        changed = dataclasses.replace(config, warnings=()) != default
        assert changed or config.unapplied, name
        flag = next(f for f in FLAGS if f.name == name)
        if flag.not_applied:
            assert config.unapplied == (f"--{name}: accepted, not applied "
                                        f"({flag.not_applied})",), name


def test_kube_proxy_flags_are_type_checked(kube_proxy_flags: dict[str, str]) -> None:
    """A flag pyproxy does not apply still refuses a value kube-proxy would refuse."""
    parser = build_parser()
    for name in ("ipvs-sync-period", "profiling", "log-text-info-buffer-size", "vmodule"):
        with pytest.raises(ConfigError, match=f"^--{name}: "):
            from_args(parser.parse_args(["run", f"--{name}=nonsense"]))


def test_kube_proxy_flags_group_is_kube_proxys(kube_proxy_flags: dict[str, str]) -> None:
    """What `pyproxy run --help` calls kube-proxy's flags are kube-proxy's, and pyproxy's own
    flags are not among kube-proxy's."""
    kube = {f.name for f in FLAGS if not f.own}
    own = {f.name for f in FLAGS if f.own}
    assert kube == set(kube_proxy_flags) - {"help", "version"}
    assert not own & set(kube_proxy_flags)


def test_proxy_mode_is_checked(kube_proxy_flags: dict[str, str]) -> None:
    parser = build_parser()
    assert from_args(parser.parse_args(["run", "--proxy-mode=nftables"])) == ProxyConfig()
    with pytest.raises(ConfigError, match="pyproxy only implements nftables mode"):
        from_args(parser.parse_args(["run", "--proxy-mode=ipvs"]))
    # iptables, kube-proxy's default (and what kubeadm writes), runs nftables with a warning
    # naming the flag that keeps iptables mode's NodePort addresses (a file's mode brings
    # them, the flag does not).
    config = from_args(parser.parse_args(["run", "--proxy-mode=iptables"]))
    (warning,) = config.unapplied
    assert warning.startswith("--proxy-mode=iptables: pyproxy runs nftables, its only mode; ")
    assert warning.endswith("--nodeport-addresses=all,127.0.0.0/8 keeps that")


@pytest.mark.parametrize(("ci", "outcome"), [("true", "1 error"), ("", "1 skipped")])
def test_without_kube_proxy_ci_fails_where_a_developer_skips(tmp_path: Path, ci: str,
                                                             outcome: str) -> None:
    """The list comes from kube-proxy's binary: without it (`make k8s` not run), these tests
    skip on a developer's machine, and fail under CI (CI=true), whose `make test` builds it."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PYPROXY_K8S_BIN=str(tmp_path), **({"CI": ci} if ci else {}))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
         f"{__file__}::test_kube_proxy_flags_are_type_checked"],
        capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parent.parent)
    assert outcome in done.stdout.splitlines()[-1], done.stdout
    if ci:
        assert "is not built (make k8s)" in done.stdout, done.stdout


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_exit(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", flag])
    assert exited.value.code == 0
    assert capsys.readouterr().out


@pytest.mark.netns
def test_cleanup_deletes_pyproxys_tables_and_exits(lab: Lab) -> None:
    """kube-proxy's --cleanup: pyproxy's tables go, nobody else's."""
    ns = lab.add_ns("cleanup")
    lab.nft(ns, "add table ip pyproxy\nadd table ip6 pyproxy\nadd table ip other\n")
    result = lab.run(ns, [PYPROXY, "run", "--cleanup", "--hostname-override=node-a"],
                     check=False)
    assert result.returncode == 0, result.stderr
    assert lab.run(ns, ["nft", "list", "tables"]).stdout.split() == ["table", "ip", "other"]


@pytest.mark.netns
def test_init_only_makes_the_host_settings_and_exits(lab: Lab) -> None:
    """kube-proxy's --init-only: the start-up host settings, then exit (no API server is
    configured, and none is asked for). Per-namespace sysctls only: nf_conntrack_max is
    global and skipped outside the initial namespace, as `run` does."""
    ns = lab.add_ns("init")
    result = lab.run(ns, [PYPROXY, "run", "--init-only", "--hostname-override=node-a",
                          "--conntrack-tcp-timeout-established=1h2m",
                          "--conntrack-tcp-timeout-close-wait=61s", "--profiling",
                          "--oom-score-adj=0"],  # lowering it needs CAP_SYS_RESOURCE
                     check=False)
    assert result.returncode == 0, result.stderr
    established = "net.netfilter.nf_conntrack_tcp_timeout_established"
    close_wait = "net.netfilter.nf_conntrack_tcp_timeout_close_wait"
    values = lab.run(ns, ["sysctl", "-n", established, close_wait]).stdout.split()
    assert values == ["3720", "61"]
    assert "--profiling: accepted, not applied (pyproxy serves no pprof)" in result.stderr
