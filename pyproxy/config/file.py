"""The file: kube-proxy's `KubeProxyConfiguration` (`kubeproxy.config.k8s.io/v1alpha1`, YAML or
JSON), read strictly, as a ProxyConfig.

Every v1alpha1 field ever defined is a `Field` of `FIELDS`: the settings' fields, from their
rows in the settings table, and the fields pyproxy checks (`mode`) or accepts, type checks and
ignores, each with why. `load_config` and `load_config_file` report every problem of a
document at once, each naming its field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pyproxy import yamlfile
from pyproxy.config.proxyconfig import (
    IPTABLES,
    NFTABLES,
    ProxyConfig,
    cross_problems,
    default_servers,
    iptables_nodeport_addresses,
)
from pyproxy.config.settings import DEFAULT_BIND_ADDRESS, SETTINGS, setting_value
from pyproxy.config.values import ConfigError, ValueType, describe, from_json

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"


@dataclass(frozen=True, slots=True)
class Field:
    """One KubeProxyConfiguration field."""

    path: str
    type: ValueType
    attr: str | None
    """The ProxyConfig setting it feeds; None: accepted, type checked, not used."""
    doc: str
    """What it does, or (attr None) why pyproxy does not use it."""
    section: str = ""
    """`iptables`/`nftables`: read only when `mode` selects this section (see _section)."""
    zero_is_unset: bool = False
    """kube-proxy's defaulting replaces the zero value ("", 0, 0s) with the default."""
    partly: bool = False
    """Only some values change anything (the doc says which)."""


MODE_FIELD, API_VERSION_FIELD, KIND_FIELD = "mode", "apiVersion", "kind"
_IPVS_ONLY = "ipvs mode only"
_WINDOWS_ONLY = "Windows (winkernel mode) only"
_KLOG_ONLY = "klog output routing; pyproxy logs through structlog"
_CLIENT = ("client-go's list of media types to accept; pyproxy's are set by "
           "`clientConnection.contentType`")


def _section(path: str) -> str:
    """The mode section a field belongs to (read only when `mode` selects it), or ""."""
    first = path.split(".", 1)[0]
    return first if first in (IPTABLES, NFTABLES) else ""


# The fields of the settings, from their rows.
_SETTING_FIELDS = tuple(
    Field(path, s.type, s.attr, s.doc, section=_section(path), zero_is_unset=s.zero_is_unset,
          partly=s.partly)
    for s in SETTINGS for path in s.paths)
# The fields pyproxy checks (`mode`) or accepts and ignores, and why.
_OTHER_FIELDS: tuple[Field, ...] = (
    Field(MODE_FIELD, ValueType.STRING, None,
          "`nftables`, `iptables` or empty: pyproxy runs nftables; `iptables` and empty "
          "(kubeadm's and kube-proxy's default) read the iptables section"),
    Field("clientConnection.acceptContentTypes", ValueType.STRING, None, _CLIENT),
    Field("logging.flushFrequency", ValueType.FLUSH, None, "pyproxy does not buffer logs"),
    Field("logging.vmodule", ValueType.VMODULE, None, "per-file verbosity is a klog feature"),
    Field("logging.options.text.splitStream", ValueType.BOOL, None, _KLOG_ONLY),
    Field("logging.options.text.infoBufferSize", ValueType.QUANTITY, None, _KLOG_ONLY),
    Field("logging.options.json.splitStream", ValueType.BOOL, None, _KLOG_ONLY),
    Field("logging.options.json.infoBufferSize", ValueType.QUANTITY, None, _KLOG_ONLY),
    Field("logging.sanitization", ValueType.BOOL, None, "removed from Kubernetes logging"),
    Field("enableProfiling", ValueType.BOOL, None, "pyproxy serves no pprof"),
    Field("showHiddenMetricsForVersion", ValueType.STRING, None, "pyproxy hides no metrics"),
    Field("iptables.localhostNodePorts", ValueType.BOOL, None,
          "read when mode is iptables or empty: false keeps 127.0.0.1 out of the NodePort "
          "addresses pyproxy gives such a configuration (as iptables mode did); pyproxy serves "
          "localhost NodePorts through nodePortAddresses (a userspace proxy, TCP), never "
          "with route_localnet", section=IPTABLES),
    Field("iptables.snatNodeInternalIP", ValueType.BOOL, None, "iptables mode only"),
    Field("ipvs.syncPeriod", ValueType.DURATION, None, _IPVS_ONLY),
    Field("ipvs.minSyncPeriod", ValueType.DURATION, None, _IPVS_ONLY),
    Field("ipvs.scheduler", ValueType.STRING, None, _IPVS_ONLY),
    Field("ipvs.excludeCIDRs", ValueType.STRINGS, None, _IPVS_ONLY),
    Field("ipvs.strictARP", ValueType.BOOL, None, _IPVS_ONLY),
    Field("ipvs.tcpTimeout", ValueType.DURATION, None, _IPVS_ONLY),
    Field("ipvs.tcpFinTimeout", ValueType.DURATION, None, _IPVS_ONLY),
    Field("ipvs.udpTimeout", ValueType.DURATION, None, _IPVS_ONLY),
    Field("winkernel.networkName", ValueType.STRING, None, _WINDOWS_ONLY),
    Field("winkernel.sourceVip", ValueType.STRING, None, _WINDOWS_ONLY),
    Field("winkernel.enableDSR", ValueType.BOOL, None, _WINDOWS_ONLY),
    Field("winkernel.rootHnsEndpointName", ValueType.STRING, None, _WINDOWS_ONLY),
    Field("winkernel.forwardHealthCheckVip", ValueType.BOOL, None, _WINDOWS_ONLY),
    Field("portRange", ValueType.STRING, None, "configured the userspace proxy, removed in 1.26"),
    Field("udpIdleTimeout", ValueType.DURATION, None, "userspace proxy only, removed in 1.26"),
    Field("resourceContainer", ValueType.STRING, None, "long removed from kube-proxy"),
    Field("windowsRunAsService", ValueType.BOOL, None, _WINDOWS_ONLY),
)
FIELDS: tuple[Field, ...] = (*_OTHER_FIELDS[:1], *_SETTING_FIELDS, *_OTHER_FIELDS[1:])
# The fields accepted and not applied that kube-proxy v1.37's v1alpha1 still has (it writes
# them with --write-config-to; the others it would drop): ProxyConfig.unapplied_fields.
_GONE_FIELDS = frozenset({"logging.sanitization", "iptables.snatNodeInternalIP",
                          "udpIdleTimeout", "resourceContainer", "windowsRunAsService"})
# A pointer in v1alpha1: false is not "unset" (kube-proxy defaults it to true).
_LOCALHOST_FIELD = "iptables.localhostNodePorts"
_POINTER_FIELDS = frozenset({_LOCALHOST_FIELD})
_KEPT_FIELDS: tuple[Field, ...] = tuple(
    f for f in _OTHER_FIELDS if f.path != MODE_FIELD and f.path not in _GONE_FIELDS)


def _tree(fields: Sequence[Field]) -> dict[str, Any]:
    """The fields as nested dicts ({"nftables": {"syncPeriod": field}}), to walk a document."""
    root: dict[str, Any] = {}
    for spec in fields:
        *parents, leaf = spec.path.split(".")
        node = root
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = spec
    return root


_TREE = _tree(FIELDS)


def load_config(text: str) -> ProxyConfig:
    """A KubeProxyConfiguration (YAML or JSON) as a validated ProxyConfig. Raises ConfigError
    with every problem found, each naming the field at fault. Fields v1alpha1 never had are
    ignored and kept in `ProxyConfig.warnings`, as kube-proxy's lenient decoding does."""
    document = _parse(text)
    values: dict[str, Any] = {}
    problems: list[str] = []
    warnings: list[str] = []
    _decode(document, _TREE, "", values, problems, warnings)
    config = _build(values, problems)
    problems += cross_problems(config)
    if problems:
        raise ConfigError(*problems, warnings=tuple(warnings))
    kept = {spec.path: _raw(document, spec.path) for spec in _KEPT_FIELDS
            if spec.path in values and (spec.path in _POINTER_FIELDS
                                        or not _is_zero(spec.type, values[spec.path]))}
    return dataclasses.replace(config, warnings=tuple(warnings),
                               unapplied_fields=MappingProxyType(kept))


def _raw(document: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path of a parsed document, as written."""
    node: Any = document
    for name in path.split("."):
        node = node[name]
    return node


# A ConfigMap holds at most 1 MiB (etcd's limit on one object, less its envelope).
MAX_FILE_BYTES = 1 << 20


def load_config_file(path: str) -> ProxyConfig:
    """`load_config` of a file; every problem names the file."""
    try:
        text = yamlfile.read_limited(path, MAX_FILE_BYTES, "a configuration file").decode()
    except (OSError, UnicodeDecodeError, yamlfile.TooLargeError) as err:
        raise ConfigError(f"--config {path}: {getattr(err, 'strerror', None) or err}") from err
    try:
        config = load_config(text)
    except ConfigError as err:
        raise ConfigError(*(f"{path}: {problem}" for problem in err.problems),
                          warnings=tuple(f"{path}: {w}" for w in err.warnings)) from None
    return dataclasses.replace(config, warnings=tuple(f"{path}: {w}" for w in config.warnings))


def _parse(text: str) -> dict[str, Any]:
    try:  # duplicate keys refused: kube-proxy's strict decoding refuses them
        document = yamlfile.load(text, strict=True)
    except yamlfile.DocumentError as err:
        raise ConfigError(str(err)) from None
    if not isinstance(document, dict):
        raise ConfigError(f"expected a {KIND} object, got {describe(document)}")
    if document.get(KIND_FIELD) == "ConfigMap":
        raise ConfigError(_configmap_hint(document))
    for key, want in ((API_VERSION_FIELD, API_VERSION), (KIND_FIELD, KIND)):
        got = document.pop(key, None)
        if got != want:
            shown = "missing" if got is None else f"got {describe(got)}"
            raise ConfigError(f"{key}: expected {want}, {shown}")
    return document


def _configmap_hint(document: Mapping[str, Any]) -> str:
    """A whole ConfigMap is what `kubectl get cm kube-proxy -o yaml` prints: the configuration
    is one of its keys (kubeadm's: config.conf), which kube-proxy's pod mounts as a file."""
    data = document.get("data")
    keys = [key for key, value in (data.items() if isinstance(data, dict) else ())
            if isinstance(value, str) and KIND in value]
    key = keys[0] if keys else "config.conf"
    meta = document.get("metadata")
    name = meta.get("name", "kube-proxy") if isinstance(meta, dict) else "kube-proxy"
    namespace = meta.get("namespace", "kube-system") if isinstance(meta, dict) else "kube-system"
    escaped = key.replace(".", "\\.")
    return (f"kind: this is a ConfigMap, not a {KIND}: give its {key} key as the file (as "
            f"kube-proxy's pod mounts it), e.g. kubectl -n {namespace} get cm {name} -o "
            f"jsonpath='{{.data.{escaped}}}' > {key}")


# kube-proxy's nftables mode refuses kernels older than 5.13 unless this variable is set; a
# field of that name is a guess kube-proxy ignores (with a warning), and so does pyproxy. The
# version is pyproxy.kernel.host.MIN_KERNEL's (tests/test_config_check.py keeps them equal).
_FIELD_HINTS = {
    "nftables.skipKernelVersionCheck": (
        "kube-proxy's kernel check is skipped with the environment variable "
        "KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK, not a field; pyproxy needs neither: "
        "below kernel 5.13 it warns (kernel_below_supported) and runs"),
}


def _unknown_field(path: str) -> str:
    hint = _FIELD_HINTS.get(path, "not a v1alpha1 field; a typo keeps the default")
    return f"{path}: unknown field, ignored (as kube-proxy does, with a warning): {hint}"


def _decode(document: Mapping[Any, Any], tree: Mapping[str, Any], prefix: str,
            out: dict[str, Any], problems: list[str], warnings: list[str]) -> None:
    """Check every field of `document` against `tree`, storing typed values by dotted path,
    a wrong value in `problems`, an unknown field in `warnings`. null means unset (as an
    omitted field), whatever the type."""
    for key, value in document.items():
        path = f"{prefix}{key}"
        spec = tree.get(key) if isinstance(key, str) else None
        if spec is None:
            warnings.append(_unknown_field(path))
        elif value is None:
            continue
        elif isinstance(spec, Field):
            try:
                out[path] = from_json(spec.type, value)
            except ValueError as err:
                problems.append(f"{path}: {err}")
        elif isinstance(value, dict):
            _decode(value, spec, f"{path}.", out, problems, warnings)
        else:
            problems.append(f"{path}: expected an object, got {describe(value)}")


def _is_zero(kind: ValueType, value: Any) -> bool:
    """The Go zero value (what kubeadm writes for every field it leaves unset)."""
    if kind is ValueType.QUANTITY and value == "0":
        return True
    return value in (False, 0, "") or value == [] or value == {}


def _build(values: Mapping[str, Any], problems: list[str]) -> ProxyConfig:
    mode = values.get(MODE_FIELD, "")
    problems += mode_problems(mode, MODE_FIELD)
    # As kube-proxy's v1alpha1 conversion: the mode-specific settings come from the section of
    # the mode kube-proxy would run, and an empty mode means iptables (what kubeadm writes).
    section = NFTABLES if mode == NFTABLES else IPTABLES
    changes: dict[str, Any] = {}
    notes = list(_mode_notes(mode, values))
    for spec in FIELDS:
        if spec.path not in values or spec.path == MODE_FIELD:
            continue
        value = values[spec.path]
        if spec.path == _LOCALHOST_FIELD and section == IPTABLES:
            continue  # read below, for the NodePort addresses
        if spec.attr is None or spec.section not in ("", section):
            if not _is_zero(spec.type, value):
                notes.append(f"{spec.path}: ignored ({_why_ignored(spec, mode)})")
        elif not (spec.zero_is_unset and _is_zero(spec.type, value)):
            try:
                changes[spec.attr] = setting_value(spec.attr, value, spec.path)
            except ConfigError as err:
                problems.append(str(err))
    healthz, metrics = default_servers(changes.get("bind_address", DEFAULT_BIND_ADDRESS))
    changes.setdefault("healthz_bind_address", healthz)
    changes.setdefault("metrics_bind_address", metrics)
    if section == IPTABLES:
        # kube-proxy's iptables mode served NodePorts on every local address when
        # nodePortAddresses is unset (an empty list too), and on 127.0.0.1 with route_localnet;
        # pyproxy keeps both (127.0.0.1: TCP through its localhost proxy). `changes` says
        # what still differs.
        localhost = values.get(_LOCALHOST_FIELD, True)
        given = changes.get("nodeport_addresses") if values.get("nodePortAddresses") else ()
        changes["nodeport_addresses"] = iptables_nodeport_addresses(given or (), localhost)
        changes["kube_proxy_mode"] = IPTABLES
    return ProxyConfig(**changes, file_notes=tuple(notes))


def mode_problems(mode: str, name: str) -> list[str]:
    if mode in ("", IPTABLES, NFTABLES):
        return []
    return [f"{name}: pyproxy only implements nftables mode, got {mode!r} "
            f"(use nftables; iptables or empty run nftables too)"]


def _mode_notes(mode: str, values: Mapping[str, Any]) -> Iterator[str]:
    if mode == NFTABLES:
        return
    if mode == IPTABLES:
        # kubeadm v1.37 writes it into its kube-proxy ConfigMap (tests/test_kubeadm.py).
        yield ("mode is iptables: pyproxy runs nftables, its only mode, and, as kube-proxy's "
               "iptables mode, takes masqueradeBit, masqueradeAll, syncPeriod and minSyncPeriod "
               "from the iptables section")
    else:
        yield ("mode is empty (kube-proxy would run iptables): pyproxy runs nftables and, as "
               "kube-proxy does for an empty mode, takes masqueradeBit, masqueradeAll, "
               "syncPeriod and minSyncPeriod from the iptables section")
    if not values.get("nodePortAddresses"):
        localhost = values.get(_LOCALHOST_FIELD, True) is not False
        chosen = iptables_nodeport_addresses((), localhost)
        where = ("every local address and 127.0.0.1 (TCP, through pyproxy's localhost proxy)"
                 if localhost else "every local address (iptables.localhostNodePorts is false)")
        yield (f"nodePortAddresses is unset: NodePorts are served as kube-proxy's iptables mode "
               f"served them, on {where}: nodePortAddresses: [{', '.join(chosen)}]. "
               f"nodePortAddresses: [primary] serves the node's primary IPs only, as nftables "
               f"mode does")


def _why_ignored(spec: Field, mode: str) -> str:
    if spec.section == NFTABLES:
        return (f"mode is {mode or 'empty'}, so the iptables section applies; set mode: "
                f"nftables to use this")
    if spec.section == IPTABLES:
        return f"iptables mode only; mode is {mode}"
    return spec.doc
