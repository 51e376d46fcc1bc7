"""What kube-proxy sets on the host when it starts, besides its rules: the conntrack sysctls
(`conntrack.*`) and the process's OOM score (`oomScoreAdj`).

`conntrack_sysctls` is the plan, pure; `apply_conntrack` and `apply_oom_score_adj` write it and
report every outcome. Failures are reported, never fatal: kube-proxy stops on most of them, but
the same settings are routinely left to the host (and a daemon in a network namespace other than
the initial one cannot change the global ones at all).

Written through /proc/sys, which is per network namespace for the conntrack timeouts and
be_liberal: the daemon sets them in its own namespace. nf_conntrack_max and the conntrack hash
size are global: the kernel lets only the initial namespace change them (nf_conntrack_max is
read-only elsewhere, the hashsize write refused), so outside it they are reported and skipped.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from pyproxy.config import ProxyConfig
from pyproxy.logs import setup_logging

log = structlog.get_logger(__name__)

PROC_SYS = "/proc/sys"
NETFILTER = "net/netfilter"
CONNTRACK_MAX = "nf_conntrack_max"
HASHSIZE = "/sys/module/nf_conntrack/parameters/hashsize"
OOM_SCORE_ADJ = "/proc/self/oom_score_adj"
# kube-proxy 1.36 caps maxPerCore x CPUs here: 1M entries are ~300 MiB of kernel memory, and
# 32768 per core on a 128-core machine asked for 4M (kubernetes#137002).
CONNTRACK_MAX_CAP = 1048576


@dataclass(frozen=True)
class Sysctl:
    """One conntrack setting: its name under /proc/sys/net/netfilter and the value wanted."""

    name: str
    value: int


@dataclass(frozen=True)
class Outcome:
    """What became of one setting: `set` (written), `unchanged` (already so), `skipped` (not
    ours to change here; `detail` says why) or `failed`."""

    setting: str
    value: int
    action: str
    detail: str = ""


def conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """kube-proxy's getConntrackMax: maxPerCore × CPUs, capped at 1,048,576 (the cap wins
    over `minimum`, as upstream checks it first), else at least `minimum`; 0 (leave the
    limit alone) when maxPerCore is 0."""
    if max_per_core <= 0:
        return 0
    scaled = max_per_core * cpus
    if scaled > CONNTRACK_MAX_CAP:
        return CONNTRACK_MAX_CAP
    return max(scaled, minimum)


def conntrack_sysctls(config: ProxyConfig, cpus: int) -> tuple[Sysctl, ...]:
    """What kube-proxy sets at start, in its order: each only when configured (non-zero;
    be_liberal only ever to 1). Timeouts are whole seconds, truncated as Go's
    `int(d / time.Second)`."""
    wanted: list[Sysctl] = []
    limit = conntrack_max(config.conntrack_max_per_core, config.conntrack_min, cpus)
    if limit > 0:
        wanted.append(Sysctl(CONNTRACK_MAX, limit))
    for name, seconds in (
        ("nf_conntrack_tcp_timeout_established", config.conntrack_tcp_established_timeout),
        ("nf_conntrack_tcp_timeout_close_wait", config.conntrack_tcp_close_wait_timeout),
    ):
        if seconds > 0:
            wanted.append(Sysctl(name, int(seconds)))
    if config.conntrack_tcp_be_liberal:
        wanted.append(Sysctl("nf_conntrack_tcp_be_liberal", 1))
    for name, seconds in (
        ("nf_conntrack_udp_timeout", config.conntrack_udp_timeout),
        ("nf_conntrack_udp_timeout_stream", config.conntrack_udp_stream_timeout),
    ):
        if seconds > 0:
            wanted.append(Sysctl(name, int(seconds)))
    return tuple(wanted)


def apply_conntrack(plan: tuple[Sysctl, ...], proc_sys: str = PROC_SYS,
                    hashsize: str = HASHSIZE) -> list[Outcome]:
    """Write each setting that differs from the current value (kube-proxy's setIntSysCtl);
    after nf_conntrack_max, raise the hash size to a quarter of it if it is smaller (never
    lowered), as kube-proxy's SetMax."""
    outcomes: list[Outcome] = []
    for sysctl in plan:
        path = Path(proc_sys, NETFILTER, sysctl.name)
        if sysctl.name == CONNTRACK_MAX:
            outcome = _raise_conntrack_max(path, sysctl.value)
        else:
            outcome = _set(path, sysctl.name, sysctl.value)
        outcomes.append(outcome)
        if sysctl.name == CONNTRACK_MAX and outcome.action in ("set", "unchanged"):
            outcomes.append(_raise_hashsize(Path(hashsize), sysctl.value // 4,
                                            initial_netns=os.access(path, os.W_OK)))
    return outcomes


def _raise_conntrack_max(path: Path, value: int) -> Outcome:
    """nf_conntrack_max is only ever raised: a host (or an administrator) that set a larger
    limit keeps it, and nothing is written. kube-proxy 1.36 wrote its value whenever it
    differed, so where the sysctl is read-only (a container, LXC) the cap above turned a
    limit it used to leave alone into a failed write (kubernetes#141943, fixed by #142035)."""
    try:
        current = _read_int(path)
    except (OSError, ValueError):
        return _set(path, CONNTRACK_MAX, value)  # unreadable: try, as kube-proxy does
    if current > value:
        return Outcome(CONNTRACK_MAX, value, "unchanged",
                       f"already {current}, more than wanted: left alone")
    return _set(path, CONNTRACK_MAX, value)


def _set(path: Path, name: str, value: int) -> Outcome:
    try:
        current = _read_int(path)
    except (OSError, ValueError) as err:
        return Outcome(name, value, "failed", f"cannot read {path}: {_why(err)}")
    if current == value:
        return Outcome(name, value, "unchanged")
    try:
        path.write_text(str(value))
    except PermissionError:
        # nf_conntrack_max is read-only outside the initial network namespace: it is global.
        return Outcome(name, value, "skipped",
                       f"read-only here (a global setting: only the initial network namespace "
                       f"may change it); stays {current}")
    except OSError as err:
        return Outcome(name, value, "failed", f"cannot write {path}: {_why(err)}")
    return Outcome(name, value, "set", f"was {current}")


def _raise_hashsize(path: Path, wanted: int, initial_netns: bool) -> Outcome:
    setting = "nf_conntrack hashsize"
    try:
        current = _read_int(path)
    except (OSError, ValueError) as err:
        return Outcome(setting, wanted, "failed", f"cannot read {path}: {_why(err)}")
    if current >= wanted:
        return Outcome(setting, wanted, "unchanged", f"already {current}")
    if not initial_netns:
        # The kernel refuses this module parameter from any other network namespace.
        return Outcome(setting, wanted, "skipped",
                       f"global: only the initial network namespace may raise it; stays "
                       f"{current}")
    try:
        path.write_text(str(wanted))
    except OSError as err:  # e.g. /sys mounted read-only (kube-proxy reports the same)
        return Outcome(setting, wanted, "failed", f"cannot write {path}: {_why(err)}")
    return Outcome(setting, wanted, "set", f"was {current}")


def apply_oom_score_adj(value: int, path: str = OOM_SCORE_ADJ) -> Outcome:
    """The process's OOM score adjustment (kube-proxy's default -999: the kernel kills almost
    anything else first). Left alone when already so: systemd sets it for the unit
    (OOMScoreAdjust), and lowering it again would need CAP_SYS_RESOURCE."""
    try:
        if _read_int(Path(path)) == value:
            return Outcome("oom_score_adj", value, "unchanged")
        Path(path).write_text(str(value))
    except (OSError, ValueError) as err:
        return Outcome("oom_score_adj", value, "failed", f"cannot write {path}: {_why(err)}")
    return Outcome("oom_score_adj", value, "set")


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _why(err: Exception) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        return err.strerror or errno.errorcode.get(err.errno, str(err))
    return str(err)


def apply_host_settings(config: ProxyConfig, cpus: int | None = None,
                        proc_sys: str = PROC_SYS, hashsize: str = HASHSIZE,
                        oom_score_adj: str = OOM_SCORE_ADJ) -> list[Outcome]:
    """Everything `pyproxy run` sets on the host at start, in kube-proxy's order: the OOM
    score, then the conntrack sysctls (CPUs: all the machine has, as kube-proxy counts)."""
    outcomes = [apply_oom_score_adj(config.oom_score_adj, oom_score_adj)]
    plan = conntrack_sysctls(config, cpus or os.cpu_count() or 1)
    return outcomes + apply_conntrack(plan, proc_sys, hashsize)


def log_outcome(outcome: Outcome) -> None:
    """One setting's outcome, at the level it deserves."""
    fields = {"setting": outcome.setting, "value": outcome.value, "detail": outcome.detail}
    if outcome.action == "set":
        log.info("host_setting_applied", **fields)
    elif outcome.action == "unchanged":
        log.debug("host_setting_unchanged", **fields)
    elif outcome.action == "skipped":
        log.warning("host_setting_skipped", **fields)
    else:  # "failed": kube-proxy stops on most of these; the rules do not depend on them
        log.warning("host_setting_failed", **fields)


def init_host(config: ProxyConfig) -> int:
    """kube-proxy's --init-only: the host settings `pyproxy run` makes at start (the step
    that needs the most privilege), then exit: 1 if one of them failed."""
    setup_logging(config.logging_format, config.verbosity)
    for warning in (*config.unapplied, *config.changes):
        log.warning("configuration", note=warning)
    outcomes = apply_host_settings(config)
    for outcome in outcomes:
        log_outcome(outcome)
    return 1 if any(outcome.action == "failed" for outcome in outcomes) else 0


# kube-proxy's nftables mode's floor (pkg/proxy/nftables/supported.go): a distribution with
# this kernel has nft ≥ 1.0.1, which can read what pyproxy writes; docs/deploying.md, "Kernel
# and nftables", has the features behind it.
MIN_KERNEL = (5, 13)


def kernel_below_supported(release: str) -> bool:
    """A kernel release (`uname -r`: "6.18.44-fc-v669", "5.10.0-28-amd64") older than
    MIN_KERNEL. An unreadable release is not called old: the warning is for what is known."""
    parts = release.split("-", 1)[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return False
    return (major, minor) < MIN_KERNEL


def warn_if_kernel_below_supported(release: str) -> None:
    """kube-proxy refuses to start below MIN_KERNEL; pyproxy runs and says so (what breaks
    below is in docs/deploying.md, and a refused transaction is reported by every sync)."""
    if kernel_below_supported(release):
        log.warning("kernel_below_supported", kernel=release,
                    minimum=".".join(map(str, MIN_KERNEL)),
                    docs="docs/deploying.md, \"Kernel and nftables\"")
