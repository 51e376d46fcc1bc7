"""Configuration: kube-proxy's own `KubeProxyConfiguration` file and flags, as one ProxyConfig.

A kube-proxy user keeps their configuration: `pyproxy run --config FILE` reads the file kube-proxy
reads (`kubeproxy.config.k8s.io/v1alpha1`, YAML or JSON; kubeadm keeps it in the `kube-proxy`
ConfigMap), and kube-proxy's flag names override it. Settings are resolved in three layers:

    ProxyConfig() defaults   kube-proxy's defaults for nftables mode
    load_config(text)        the file; a zero value means "default", as kube-proxy's defaulting does
    apply_flags(config, ns)  flags given on the command line (argparse default None = not given)

Every v1alpha1 field ever defined is accepted, including those that only apply to other modes or
platforms (`iptables`, `ipvs`, `winkernel`, `portRange`, `udpIdleTimeout`, ...): they are type
checked, and a value that would change something is reported in `ProxyConfig.notes`. A field
that v1alpha1 never had is ignored with a warning naming its path (`ProxyConfig.warnings`), as
kube-proxy's lenient decoding does: refusing to start over a field kube-proxy accepts would
break a working kube-proxy configuration, and `pyproxy config check` shows the typo before
it is deployed. Every problem of a file is reported at once, each naming its field.

Durations are in seconds (float) throughout; in the file and in flags they are Go duration
strings (`30s`, `1m0s`, `500ms`), parsed by `parse_duration`.

Each setting is one row of the settings table (type, checks, what it does, where it is
applied, its file fields, its flag); the file's fields, the flags, the checks and
docs/configuration.md are made from the rows, so none of them can drift from the others.

The modules, each importing only those above it:

    values       a value's type as the file and flags spell it; Go durations; ConfigError
    settings     the settings table (`SETTINGS`), one row per setting, and its conversions
    proxyconfig  `ProxyConfig`, the resolved configuration; the checks across settings
    file         the KubeProxyConfiguration file: every v1alpha1 field, read strictly
    flags        kube-proxy's flags and pyproxy's own, applied over a ProxyConfig
    reference    docs/configuration.md (`reference_markdown()`; `python -m pyproxy.config >
                 docs/configuration.md` regenerates it)
    view         the effective configuration as a file (`config view`), and `config check`

This package holds what the rest of pyproxy imports from the configuration.
"""

from pyproxy.config.file import API_VERSION, KIND, load_config, load_config_file
from pyproxy.config.flags import RunActions, add_flags, apply_flags, from_args, run_actions
from pyproxy.config.proxyconfig import NODE_SETTINGS, ProxyConfig
from pyproxy.config.reference import reference_markdown
from pyproxy.config.settings import LogFormat
from pyproxy.config.values import ConfigError, format_duration, parse_duration

__all__ = [
    "API_VERSION",
    "KIND",
    "NODE_SETTINGS",
    "ConfigError",
    "LogFormat",
    "ProxyConfig",
    "RunActions",
    "add_flags",
    "apply_flags",
    "format_duration",
    "from_args",
    "load_config",
    "load_config_file",
    "parse_duration",
    "reference_markdown",
    "run_actions",
]
