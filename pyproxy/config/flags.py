"""The flags: kube-proxy's, and pyproxy's own, made from the settings table and applied over a
ProxyConfig.

`add_flags` adds them to a parser, every default None, so that `apply_flags` can tell a flag
that was not given from one given its default value; `from_args` is the configuration `pyproxy
run` uses (defaults, then the --config file, then the flags); `run_actions` reads the flags
that make `run` do something else and exit. kube-proxy v1.37's flags that set nothing pyproxy
has are accepted, type checked, and warned about at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pyproxy.config.file import load_config_file, mode_problems
from pyproxy.config.proxyconfig import (
    IPTABLES,
    ProxyConfig,
    cross_problems,
    default_servers,
    iptables_nodeport_addresses,
)
from pyproxy.config.settings import DEFAULT_TEXT, SETTINGS, setting_value
from pyproxy.config.values import ConfigError, ValueType, format_duration, from_flag


@dataclass(frozen=True, slots=True)
class Flag:
    name: str
    type: ValueType
    attr: str | None
    """The setting it sets; None: `config`, `proxy-mode`, an action, or not applied."""
    help: str
    own: bool = False
    """pyproxy's own flag, not kube-proxy's."""
    short: str | None = None
    not_applied: str = ""
    """A kube-proxy flag accepted (type checked) that changes nothing here: why."""
    field: str = ""
    """(not_applied) The KubeProxyConfiguration field kube-proxy's flag sets, kept in
    ProxyConfig.unapplied_fields; none for the ipvs sync periods, which kube-proxy reads only
    in ipvs mode."""
    action: bool = False
    """Something `pyproxy run` does instead of running (`--cleanup`, `--write-config-to`)."""

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


_KLOG = "klog's; pyproxy logs through structlog"
_IPVS = "ipvs mode only; pyproxy runs nftables"
# kube-proxy v1.37's flags that set nothing pyproxy has (tests/test_kube_proxy_flags.py checks
# this list against kube-proxy's own --help): accepted and type checked, so a kube-proxy
# command line works unchanged, and each one given is warned about at start-up.
_UNAPPLIED_FLAGS: tuple[Flag, ...] = (
    Flag("iptables-localhost-nodeports", ValueType.BOOL, None,
         "localhost NodePorts (iptables mode)",
         not_applied="as a flag it changes nothing: pyproxy reads iptables.localhostNodePorts "
         "from a --config file whose mode is iptables or empty, and serves localhost "
         "NodePorts where --nodeport-addresses names loopback",
         field="iptables.localhostNodePorts"),
    Flag("ipvs-exclude-cidrs", ValueType.STRINGS, None, "ipvs cleanup exclusions",
         not_applied=_IPVS, field="ipvs.excludeCIDRs"),
    Flag("ipvs-min-sync-period", ValueType.DURATION, None, "ipvs minSyncPeriod", not_applied=_IPVS),
    Flag("ipvs-scheduler", ValueType.STRING, None, "ipvs scheduler", not_applied=_IPVS,
         field="ipvs.scheduler"),
    Flag("ipvs-strict-arp", ValueType.BOOL, None, "ipvs strict ARP", not_applied=_IPVS,
         field="ipvs.strictARP"),
    Flag("ipvs-sync-period", ValueType.DURATION, None, "ipvs syncPeriod", not_applied=_IPVS),
    Flag("ipvs-tcp-timeout", ValueType.DURATION, None, "ipvs TCP timeout", not_applied=_IPVS,
         field="ipvs.tcpTimeout"),
    Flag("ipvs-tcpfin-timeout", ValueType.DURATION, None, "ipvs TCP FIN timeout", not_applied=_IPVS,
         field="ipvs.tcpFinTimeout"),
    Flag("ipvs-udp-timeout", ValueType.DURATION, None, "ipvs UDP timeout", not_applied=_IPVS,
         field="ipvs.udpTimeout"),
    Flag("log-flush-frequency", ValueType.DURATION, None, "log flush period",
         not_applied="pyproxy does not buffer logs", field="logging.flushFrequency"),
    Flag("log-json-info-buffer-size", ValueType.QUANTITY, None, "klog buffer", not_applied=_KLOG,
         field="logging.options.json.infoBufferSize"),
    Flag("log-json-split-stream", ValueType.BOOL, None, "klog stream split", not_applied=_KLOG,
         field="logging.options.json.splitStream"),
    Flag("log-text-info-buffer-size", ValueType.QUANTITY, None, "klog buffer", not_applied=_KLOG,
         field="logging.options.text.infoBufferSize"),
    Flag("log-text-split-stream", ValueType.BOOL, None, "klog stream split", not_applied=_KLOG,
         field="logging.options.text.splitStream"),
    Flag("profiling", ValueType.BOOL, None, "pprof on /debug/pprof",
         not_applied="pyproxy serves no pprof", field="enableProfiling"),
    Flag("show-hidden-metrics-for-version", ValueType.STRING, None, "hidden metrics",
         not_applied="pyproxy hides no metrics", field="showHiddenMetricsForVersion"),
    Flag("vmodule", ValueType.VMODULE, None, "per-file log verbosity",
         not_applied="per-file verbosity is a klog feature", field="logging.vmodule"),
)
_ACTION_FLAGS: tuple[Flag, ...] = (
    Flag("write-config-to", ValueType.STRING, None,
         "write the effective configuration (as `pyproxy config view` prints it) to this file "
         "and exit", action=True),
    Flag("cleanup", ValueType.BOOL, None,
         "delete pyproxy's nftables tables (as `pyproxy cleanup`) and exit", action=True),
    Flag("init-only", ValueType.BOOL, None,
         "check the configuration, apply the start-up host settings (conntrack sysctls, "
         "oom_score_adj) and exit", action=True),
)

FLAGS: tuple[Flag, ...] = (
    Flag("config", ValueType.STRING, None,
         "KubeProxyConfiguration file (YAML or JSON); flags given explicitly override it"),
    Flag("proxy-mode", ValueType.STRING, None,
         "nftables (or empty); iptables is accepted with a warning: pyproxy runs nftables"),
    *_ACTION_FLAGS,
    *(flag for s in SETTINGS for flag in (
        *((Flag(s.flag, s.type, s.attr, s.flag_help, own=s.own, short=s.short),) if s.flag
          else ()),
        *(Flag(name, s.type, s.attr, f"as --{s.flag}" if s.flag else s.flag_help)
          for name in s.kube_flags))),
    *_UNAPPLIED_FLAGS,
)

_METAVARS = {
    ValueType.STRING: "TEXT", ValueType.BOOL: "BOOL", ValueType.INT32: "N",
    ValueType.UINT32: "N", ValueType.NUMBER: "N", ValueType.DURATION: "DURATION",
    ValueType.STRINGS: "LIST", ValueType.GATES: "NAME=BOOL,...", ValueType.QUANTITY: "QUANTITY",
    ValueType.VMODULE: "PATTERN=N,...",
}
_FLAG_METAVARS = {"config": "FILE", "snapshot": "FILE", "debug-socket": "PATH",
                  "write-config-to": "FILE"}


def add_flags(parser: argparse.ArgumentParser,
              settings: Sequence[str] | None = None, actions: bool = True) -> None:
    """Add kube-proxy's flags (and pyproxy's own) to `parser`; with `settings`, only the flags
    of those settings and --config (the node options `render`, `apply` and `trace` share with
    `run`); `actions`: with the flags that make `run` do something else and exit. Every
    default is None, so `apply_flags` can tell a flag that was not given from one given its
    default value."""
    kube = parser.add_argument_group(
        "kube-proxy flags", "as kube-proxy's; a flag given overrides the --config file")
    own = parser.add_argument_group("pyproxy flags")
    unapplied = parser.add_argument_group(
        "kube-proxy flags accepted, not applied", "type checked; each one given is warned "
        "about at start-up") if settings is None else None
    for flag in FLAGS:
        if settings is not None and flag.attr not in settings and flag.name != "config":
            continue
        if flag.action and not (actions and settings is None):
            continue
        names = [f"--{flag.name}", *([flag.short] if flag.short else [])]
        options: dict[str, Any] = {
            "dest": flag.dest, "default": None,
            "metavar": _FLAG_METAVARS.get(flag.name, _METAVARS[flag.type]),
            "help": flag_meaning(flag).replace("%", "%%") + (
                "" if flag.not_applied or flag.action else f" (default: {flag_default(flag)})"),
        }
        if flag.type is ValueType.BOOL:
            options.update(nargs="?", const="true")  # `--masquerade-all`, `--masquerade-all=false`
        if settings is not None and flag.attr == "hostname_override":
            options["help"] = "the Node's name, as --node (no default offline)"
        group = unapplied if flag.not_applied and unapplied else own if flag.own else kube
        group.add_argument(*names, **options)


def flag_meaning(flag: Flag) -> str:
    return f"{flag.help}: not applied, {flag.not_applied}" if flag.not_applied else flag.help


@dataclass(frozen=True, slots=True, kw_only=True)
class RunActions:
    """What `pyproxy run` is asked to do instead of running, as kube-proxy's flags ask it."""

    write_config_to: str | None = None
    cleanup: bool = False
    init_only: bool = False


def run_actions(args: argparse.Namespace) -> RunActions:
    """The action flags given in `args`. Raises ConfigError naming a flag with a bad value."""
    found: dict[str, Any] = {}
    for flag in _ACTION_FLAGS:
        raw = getattr(args, flag.dest, None)
        if raw is not None:
            try:
                found[flag.dest] = from_flag(flag.type, raw)
            except ValueError as err:
                raise ConfigError(f"--{flag.name}: {err}") from None
    return RunActions(**found)


def apply_flags(config: ProxyConfig, args: argparse.Namespace) -> ProxyConfig:
    """`config` with every flag given in `args` (not None) applied, validated again. Raises
    ConfigError with every flag at fault; a kube-proxy flag that changes nothing here adds
    a warning."""
    changes: dict[str, Any] = {}
    problems: list[str] = []
    warnings: list[str] = []
    kept = dict(config.unapplied_fields)
    for flag in FLAGS:
        raw = getattr(args, flag.dest, None)
        if raw is None:
            continue
        name = f"--{flag.name}"
        if flag.name == "proxy-mode":
            problems += mode_problems(raw, name)
            if raw == IPTABLES:
                warnings.append(_iptables_flag_warning(config, args, name))
        if flag.attr is None and not flag.not_applied:
            continue
        try:
            value = from_flag(flag.type, raw)
            if flag.attr is None:
                warnings.append(f"{name}: accepted, not applied ({flag.not_applied})")
                if flag.field:
                    kept[flag.field] = (format_duration(value) if flag.type is ValueType.DURATION
                                        else value)
                continue
            if flag.attr == "feature_gates":
                value = {**config.feature_gates, **value}
            changes[flag.attr] = setting_value(flag.attr, value, name)
        except ValueError as err:  # ConfigError is one, and already names the flag
            problems.append(str(err) if isinstance(err, ConfigError) else f"{name}: {err}")
    _follow_bind_family(config, changes)
    resolved = dataclasses.replace(config, **changes,
                                   warnings=config.warnings + tuple(warnings),
                                   unapplied_fields=MappingProxyType(kept))
    problems += cross_problems(resolved)
    if problems:
        raise ConfigError(*problems)
    return resolved


def _iptables_flag_warning(config: ProxyConfig, args: argparse.Namespace, name: str) -> str:
    """--proxy-mode=iptables: the flag does not bring iptables mode's NodePort addresses (a
    file's mode does); say which setting does, before the switch."""
    text = f"{name}=iptables: pyproxy runs nftables, its only mode"
    if config.kube_proxy_mode == IPTABLES or getattr(args, "nodeport_addresses", None):
        return text
    keep = ",".join(iptables_nodeport_addresses((), True))
    return (f"{text}; NodePorts are served on nodePortAddresses "
            f"({', '.join(config.nodeport_addresses)}), not where iptables mode served them "
            f"(every local address and 127.0.0.1): --nodeport-addresses={keep} keeps that")


def _follow_bind_family(config: ProxyConfig, changes: dict[str, Any]) -> None:
    """A new bindAddress of the other family moves the healthz/metrics servers that are still
    at the old family's defaults (as kube-proxy's defaulting would have placed them)."""
    if "bind_address" not in changes:
        return
    before = default_servers(config.bind_address)
    after = default_servers(changes["bind_address"])
    for attr, old, new in zip(("healthz_bind_address", "metrics_bind_address"), before, after,
                              strict=True):
        if attr not in changes and getattr(config, attr) == old:
            changes[attr] = new


def from_args(args: argparse.Namespace) -> ProxyConfig:
    """The configuration `pyproxy run` uses: defaults, then the --config file, then flags."""
    path = getattr(args, "config", None)
    return apply_flags(load_config_file(path) if path else ProxyConfig(), args)


# ---------------------------------------------------------------------------------------------
# Defaults as --help and docs/configuration.md show them


def shown_default(attr: str | None) -> str:
    if attr is None:
        return "—"
    if attr in DEFAULT_TEXT:
        return DEFAULT_TEXT[attr]
    value = getattr(ProxyConfig(), attr)
    if value == "":
        return "unset"
    if attr.endswith(("_period", "_timeout")):
        return f"`{format_duration(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`[{', '.join(value)}]`"
    if isinstance(value, Mapping):
        return "`{}`"
    return f"`{value}`"


def flag_default(flag: Flag) -> str:
    if flag.name == "config":
        return "none"
    if flag.name == "proxy-mode":
        return "nftables"
    return shown_default(flag.attr).replace("`", "")
