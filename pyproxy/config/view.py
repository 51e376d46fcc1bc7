"""The effective configuration as a file, and a configuration checked without running.

`pyproxy config view` and kube-proxy's `--write-config-to` print what `pyproxy run` would use
(defaults, then the --config file, then the flags) as a KubeProxyConfiguration that pyproxy
reads back to the same settings: `mode: nftables`, so the `nftables` section is the one that
counts. Fields pyproxy accepts without applying are written as given (`--profiling` as
`enableProfiling: true`), as kube-proxy's --write-config-to would. A file cannot say everything
a flag can (pyproxy's own settings, a server disabled with `--healthz-bind-address=`,
`--min-sync-period=0`: kube-proxy's defaulting reads those zero values as "default"), so what
would not read back is listed after the document as the flags that give it. Which settings read
back is not predicted but checked: the document is loaded again and compared, so the list
cannot drift from the loader.

`pyproxy config check` collects every problem of the file and the flags (each naming its
field or flag, and the file), the warnings (unknown fields, kube-proxy flags and settings
pyproxy accepts without applying), what behaves otherwise than under the kube-proxy mode the
configuration names (iptables: NodePorts on 127.0.0.1) and the notes `pyproxy run` would log
at start.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import yaml

from pyproxy.config.file import API_VERSION, KIND, load_config, load_config_file
from pyproxy.config.flags import apply_flags
from pyproxy.config.proxyconfig import ProxyConfig
from pyproxy.config.settings import SETTINGS, Setting
from pyproxy.config.values import ConfigError, ValueType, format_duration

_NFT_SECTION = "nftables."


def _file_path(setting: Setting) -> str | None:
    """The field the document writes: the nftables section's, as the document's mode is."""
    paths = setting.paths
    return next((p for p in paths if p.startswith(_NFT_SECTION)), paths[0] if paths else None)


def _plain(setting: Setting, value: Any) -> Any:
    """A ProxyConfig value as the file spells it."""
    if value is None:
        return ""
    if setting.type is ValueType.DURATION:
        return format_duration(value)
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(value) if setting.type is ValueType.STRING else list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _flag_text(setting: Setting, value: Any) -> str:
    """`--flag=value` giving `value` on the command line."""
    name = setting.flag or setting.kube_flags[0]
    plain = _plain(setting, value)
    if isinstance(plain, bool):
        text = str(plain).lower()
    elif isinstance(plain, list):
        text = ",".join(plain)
    elif isinstance(plain, dict):
        text = ",".join(f"{k}={str(v).lower()}" for k, v in plain.items())
    else:
        text = str(plain)
    return f"--{name}={text}"


def _nest(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = document
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = value


@dataclass(frozen=True, slots=True)
class EffectiveConfiguration:
    """`document`: a KubeProxyConfiguration; `flags`: what it cannot say, as flags."""

    document: Mapping[str, Any]
    flags: tuple[str, ...]

    def text(self) -> str:
        body = yaml.safe_dump(dict(self.document), sort_keys=True, default_flow_style=False)
        head = ("# pyproxy's effective configuration: defaults, then --config, then flags "
                "(pyproxy config view)\n")
        if not self.flags:
            return head + body
        tail = ["# Not expressible in a KubeProxyConfiguration; pyproxy run takes them as flags:"]
        tail += [f"#   {flag}" for flag in self.flags]
        return head + body + "\n".join(tail) + "\n"


def effective_configuration(config: ProxyConfig) -> EffectiveConfiguration:
    """`config` as a KubeProxyConfiguration that loads back to the same settings, and the
    flags for those that do not."""
    document: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "mode": "nftables"}
    for setting in SETTINGS:
        path = _file_path(setting)
        if path is not None:
            _nest(document, path, _plain(setting, getattr(config, setting.attr)))
    for path, value in sorted(config.unapplied_fields.items()):
        _nest(document, path, value)
    reread = load_config(yaml.safe_dump(document))
    flags = tuple(_flag_text(s, getattr(config, s.attr)) for s in SETTINGS
                  if getattr(reread, s.attr) != getattr(config, s.attr))
    return EffectiveConfiguration(document, flags)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigCheck:
    """What `pyproxy config check` reports. `config` is None when there are problems."""

    config: ProxyConfig | None
    problems: tuple[str, ...] = ()
    """Each stops `pyproxy run` from starting; each names its field or flag (and file)."""
    warnings: tuple[str, ...] = ()
    """Accepted, changes nothing: unknown fields, settings and flags not applied."""
    notes: tuple[str, ...] = ()
    """What `pyproxy run` logs at start about the settings together."""
    changes: tuple[str, ...] = ()
    """What behaves otherwise than under the kube-proxy mode the configuration names
    (iptables), each with the setting that keeps the old behaviour, where one does."""


def check_configuration(args: argparse.Namespace) -> ConfigCheck:
    """The --config file in `args` and the flags given, every problem of both collected (the
    flags are checked over the defaults when the file has problems), and every warning with
    them: a problem does not hide what would be warned about once it is fixed."""
    problems: list[str] = []
    warnings: tuple[str, ...] = ()
    base = ProxyConfig()
    path = getattr(args, "config", None)
    if path:
        try:
            base = load_config_file(path)
        except ConfigError as err:
            problems += err.problems
            warnings = err.warnings
    try:
        config = apply_flags(base, args)
    except ConfigError as err:
        return ConfigCheck(config=None, problems=(*problems, *err.problems),
                           warnings=(*warnings, *base.unapplied))
    if problems:
        return ConfigCheck(config=None, problems=tuple(problems),
                           warnings=(*warnings, *config.unapplied))
    return ConfigCheck(config=config, warnings=config.unapplied, notes=config.notes,
                       changes=config.changes)
