"""Configuration: kube-proxy's KubeProxyConfiguration file and flags, resolved into ProxyConfig.

The cases are tables: a YAML fragment (added to the apiVersion/kind header) and what it must
give, either settings or the exact error message an operator reads at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml

from pyproxy import config
from pyproxy.config import (
    ConfigError,
    LogFormat,
    ProxyConfig,
    add_flags,
    apply_flags,
    format_duration,
    from_args,
    load_config,
    parse_duration,
)
from pyproxy.config.file import FIELDS
from pyproxy.config.flags import FLAGS
from pyproxy.config.settings import SETTINGS
from pyproxy.core.model import IPFamily, LocalMode
from pyproxy.render.skeleton import render_config

HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

# What `kubeadm init --pod-network-cidr=10.244.0.0/16,fd00:10:244::/56` (v1.31) puts into the
# kube-system/kube-proxy ConfigMap: every field present, each at its Go zero value unless set,
# with the iptables/ipvs/winkernel sections filled in. The DaemonSet runs
# `kube-proxy --config=/var/lib/kube-proxy/config.conf --hostname-override=$(NODE_NAME)`.
KUBEADM_CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: kube-proxy
  namespace: kube-system
  labels:
    app: kube-proxy
  annotations:
    kubeadm.kubernetes.io/component-config.hash: sha256:0f4a5c1be0e32b2ad8f2d1ab4b4d6e0c2c5b6e1f
data:
  config.conf: |-
    apiVersion: kubeproxy.config.k8s.io/v1alpha1
    bindAddress: 0.0.0.0
    bindAddressHardFail: false
    clientConnection:
      acceptContentTypes: ""
      burst: 0
      contentType: ""
      kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
      qps: 0
    clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
    configSyncPeriod: 0s
    conntrack:
      maxPerCore: null
      min: null
      tcpBeLiberal: false
      tcpCloseWaitTimeout: null
      tcpEstablishedTimeout: null
      udpStreamTimeout: 0s
      udpTimeout: 0s
    detectLocal:
      bridgeInterface: ""
      interfaceNamePrefix: ""
    detectLocalMode: ""
    enableProfiling: false
    healthzBindAddress: ""
    hostnameOverride: ""
    iptables:
      localhostNodePorts: null
      masqueradeAll: false
      masqueradeBit: null
      minSyncPeriod: 0s
      syncPeriod: 0s
    ipvs:
      excludeCIDRs: null
      minSyncPeriod: 0s
      scheduler: ""
      strictARP: false
      syncPeriod: 0s
      tcpFinTimeout: 0s
      tcpTimeout: 0s
      udpTimeout: 0s
    kind: KubeProxyConfiguration
    logging:
      flushFrequency: 0
      options:
        json:
          infoBufferSize: "0"
        text:
          infoBufferSize: "0"
      verbosity: 0
    metricsBindAddress: ""
    mode: ""
    nftables:
      masqueradeAll: false
      masqueradeBit: null
      minSyncPeriod: 0s
      syncPeriod: 0s
    nodePortAddresses: null
    oomScoreAdj: null
    portRange: ""
    showHiddenMetricsForVersion: ""
    winkernel:
      enableDSR: false
      forwardHealthCheckVip: false
      networkName: ""
      rootHnsEndpointName: ""
      sourceVip: ""
  kubeconfig.conf: |-
    apiVersion: v1
    kind: Config
    clusters:
    - cluster:
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
        server: https://10.0.0.10:6443
      name: default
    contexts:
    - context:
        cluster: default
        namespace: default
        user: default
      name: default
    current-context: default
    users:
    - name: default
      user:
        tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
"""

MODE_EMPTY_NOTE = (
    "mode is empty (kube-proxy would run iptables): pyproxy runs nftables and, as kube-proxy "
    "does for an empty mode, takes masqueradeBit, masqueradeAll, syncPeriod and minSyncPeriod "
    "from the iptables section")
MODE_IPTABLES_NOTE = (
    "mode is iptables: pyproxy runs nftables, its only mode, and, as kube-proxy's iptables "
    "mode, takes masqueradeBit, masqueradeAll, syncPeriod and minSyncPeriod from the iptables "
    "section")
NODEPORT_NOTE = (
    "nodePortAddresses is unset: NodePorts are served as kube-proxy's iptables mode served "
    "them, on every local address and 127.0.0.1 (TCP, through pyproxy's localhost proxy): "
    "nodePortAddresses: [all, 127.0.0.0/8]. nodePortAddresses: [primary] serves the node's "
    "primary IPs only, as nftables mode does")
# iptables mode's NodePort addresses, as pyproxy serves them (the localhost proxy on 127.0.0.1).
IPTABLES_NODEPORTS = ("all", "127.0.0.0/8")
NO_CLUSTER_CIDR_NOTE = (
    "detectLocalMode is ClusterCIDR but clusterCIDR is empty: traffic from local pods is not "
    "told apart from other traffic (as kube-proxy does)")

# Every used field set away from its default, in nftables mode.
EVERY_FIELD = """\
mode: nftables
featureGates: {PreferSameTrafficDistribution: true, KubeProxyDrainingTerminatingNodes: false}
clientConnection: {kubeconfig: /etc/kube-proxy/kubeconfig, qps: 50, burst: 100}
logging: {format: json, verbosity: 4}
hostnameOverride: Worker-1.Example.COM
bindAddress: 192.168.50.1
healthzBindAddress: 192.168.50.1:20256
metricsBindAddress: "[::1]:20249"
bindAddressHardFail: true
nftables: {masqueradeBit: 5, masqueradeAll: true, syncPeriod: 1m0s, minSyncPeriod: 500ms}
detectLocalMode: InterfaceNamePrefix
detectLocal: {bridgeInterface: cbr0, interfaceNamePrefix: veth}
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
nodePortAddresses: [192.168.50.0/24, primary]
oomScoreAdj: -500
conntrack:
  maxPerCore: 0
  min: 1000
  tcpEstablishedTimeout: 2h30m
  tcpCloseWaitTimeout: 0s
  tcpBeLiberal: true
  udpTimeout: 30s
  udpStreamTimeout: 5m
configSyncPeriod: 5m
"""

EVERY_FIELD_CONFIG = ProxyConfig(
    hostname_override="Worker-1.Example.COM",
    bind_address="192.168.50.1",
    healthz_bind_address="192.168.50.1:20256",
    metrics_bind_address="[::1]:20249",
    bind_address_hard_fail=True,
    cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/56"),
    detect_local_mode=LocalMode.INTERFACE_NAME_PREFIX,
    bridge_interface="cbr0",
    interface_name_prefix="veth",
    nodeport_addresses=("192.168.50.0/24", "primary"),
    masquerade_bit=5,
    masquerade_all=True,
    sync_period=60.0,
    min_sync_period=0.5,
    config_sync_period=300.0,
    conntrack_max_per_core=0,
    conntrack_min=1000,
    conntrack_tcp_established_timeout=9000.0,
    conntrack_tcp_close_wait_timeout=0.0,
    conntrack_tcp_be_liberal=True,
    conntrack_udp_timeout=30.0,
    conntrack_udp_stream_timeout=300.0,
    kubeconfig="/etc/kube-proxy/kubeconfig",
    qps=50,
    burst=100,
    logging_format=LogFormat.JSON,
    verbosity=4,
    oom_score_adj=-500,
    feature_gates=MappingProxyType(
        {"PreferSameTrafficDistribution": True, "KubeProxyDrainingTerminatingNodes": False}),
)

# The v1alpha1 fields, from kube-proxy's staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go
# (current) and the fields older releases had (udpIdleTimeout, resourceContainer,
# logging.sanitization). pyproxy must accept each of them.
V1ALPHA1_FIELDS = [
    "featureGates", "clientConnection.kubeconfig", "clientConnection.acceptContentTypes",
    "clientConnection.contentType", "clientConnection.qps", "clientConnection.burst",
    "logging.format", "logging.flushFrequency", "logging.verbosity", "logging.vmodule",
    "logging.options.text.splitStream", "logging.options.text.infoBufferSize",
    "logging.options.json.splitStream", "logging.options.json.infoBufferSize",
    "logging.sanitization", "hostnameOverride", "bindAddress", "healthzBindAddress",
    "metricsBindAddress", "bindAddressHardFail", "enableProfiling",
    "showHiddenMetricsForVersion", "mode", "iptables.masqueradeBit", "iptables.masqueradeAll",
    "iptables.localhostNodePorts", "iptables.snatNodeInternalIP", "iptables.syncPeriod",
    "iptables.minSyncPeriod", "ipvs.syncPeriod", "ipvs.minSyncPeriod", "ipvs.scheduler",
    "ipvs.excludeCIDRs", "ipvs.strictARP", "ipvs.tcpTimeout", "ipvs.tcpFinTimeout",
    "ipvs.udpTimeout", "nftables.masqueradeBit", "nftables.masqueradeAll",
    "nftables.syncPeriod", "nftables.minSyncPeriod", "winkernel.networkName",
    "winkernel.sourceVip", "winkernel.enableDSR", "winkernel.rootHnsEndpointName",
    "winkernel.forwardHealthCheckVip", "detectLocalMode", "detectLocal.bridgeInterface",
    "detectLocal.interfaceNamePrefix", "clusterCIDR", "nodePortAddresses", "oomScoreAdj",
    "conntrack.maxPerCore", "conntrack.min", "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout", "conntrack.tcpBeLiberal", "conntrack.udpTimeout",
    "conntrack.udpStreamTimeout", "configSyncPeriod", "portRange", "udpIdleTimeout",
    "resourceContainer", "windowsRunAsService",
]


def load(body: str) -> ProxyConfig:
    return load_config(HEADER + textwrap.dedent(body))


def nested(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for path "a.b"."""
    *parents, leaf = path.split(".")
    document: dict[str, Any] = {leaf: value}
    for name in reversed(parents):
        document = {name: document}
    return document


def mode_settings(loaded: ProxyConfig) -> tuple[int, bool, float, float]:
    """The settings kube-proxy reads from the mode's section."""
    return (loaded.masquerade_bit, loaded.masquerade_all, loaded.sync_period,
            loaded.min_sync_period)


def parse_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(list(argv))


class TestDurations:
    @pytest.mark.parametrize(("text", "seconds"), [
        pytest.param("30s", 30.0, id="seconds"),
        pytest.param("1m0s", 60.0, id="as Go prints a minute"),
        pytest.param("15m0s", 900.0, id="configSyncPeriod default"),
        pytest.param("1h", 3600.0, id="hour"),
        pytest.param("24h0m0s", 86400.0, id="as Go prints a day"),
        pytest.param("500ms", 0.5, id="milliseconds"),
        pytest.param("2h30m", 9000.0, id="two units"),
        pytest.param("1h2m3.5s", 3723.5, id="three units and a fraction"),
        pytest.param("1.5h", 5400.0, id="fractional hours"),
        pytest.param(".5s", 0.5, id="no digits before the dot"),
        pytest.param("1.s", 1.0, id="no digits after the dot"),
        pytest.param("0", 0.0, id="bare zero needs no unit"),
        pytest.param("0s", 0.0, id="zero seconds"),
        pytest.param("-2s", -2.0, id="negative"),
        pytest.param("+3s", 3.0, id="explicit plus"),
        pytest.param("100ns", 1e-7, id="nanoseconds"),
        pytest.param("1us", 1e-6, id="microseconds, us"),
        pytest.param("1µs", 1e-6, id="microseconds, micro sign"),
        pytest.param("1μs", 1e-6, id="microseconds, greek mu"),
        pytest.param("1.0000000001s", 1.0, id="fraction truncated to nanoseconds"),
    ])
    def test_parses(self, text: str, seconds: float) -> None:
        """Go's time.ParseDuration syntax is understood."""
        assert seconds == parse_duration(text)

    @pytest.mark.parametrize(("text", "message"), [
        pytest.param("", "invalid duration ''", id="empty"),
        pytest.param("30", "missing unit in duration '30'", id="number without unit"),
        pytest.param("s", "invalid duration 's'", id="unit without number"),
        pytest.param(".s", "invalid duration '.s'", id="lone dot"),
        pytest.param("15min", "unknown unit 'min' in duration '15min'", id="unknown unit"),
        pytest.param("1 s", "unknown unit ' s' in duration '1 s'", id="space before unit"),
        pytest.param("1h-1m", "unknown unit 'h-' in duration '1h-1m'", id="sign inside"),
        pytest.param("--1s", "invalid duration '--1s'", id="two signs"),
        pytest.param("3000000h", "invalid duration '3000000h': out of range", id="overflow"),
    ])
    def test_rejects(self, text: str, message: str) -> None:
        """Anything Go rejects is rejected, with Go's wording."""
        with pytest.raises(ValueError) as caught:
            parse_duration(text)
        assert message == str(caught.value)

    @pytest.mark.parametrize(("seconds", "text"), [
        (0.0, "0s"), (0.5, "500ms"), (1e-6, "1µs"), (1e-7, "100ns"), (1.5, "1.5s"),
        (30.0, "30s"), (90.0, "1m30s"), (900.0, "15m0s"), (3600.0, "1h0m0s"),
        (9000.0, "2h30m0s"), (86400.0, "24h0m0s"), (-30.0, "-30s"),
    ])
    def test_formats_as_go_and_round_trips(self, seconds: float, text: str) -> None:
        """format_duration prints what Go's Duration.String prints, and parses back."""
        assert text == format_duration(seconds)
        assert seconds == parse_duration(text)


class TestDefaults:
    def test_kube_proxy_defaults_for_nftables_mode(self) -> None:
        """An empty ProxyConfig carries kube-proxy's defaults (nftables mode)."""
        default = ProxyConfig()
        assert (default.bind_address, default.healthz_bind_address,
                default.metrics_bind_address) == ("0.0.0.0", "0.0.0.0:10256", "127.0.0.1:10249")
        assert default.hostname_override is None
        assert default.detect_local_mode is LocalMode.CLUSTER_CIDR
        assert default.nodeport_addresses == ("primary",)
        assert (default.masquerade_bit, default.masquerade_all) == (14, False)
        assert (default.sync_period, default.min_sync_period, default.full_sync_period,
                default.config_sync_period) == (30.0, 1.0, 3600.0, 900.0)
        assert (default.conntrack_max_per_core, default.conntrack_min) == (32768, 131072)
        assert (default.conntrack_tcp_established_timeout,
                default.conntrack_tcp_close_wait_timeout) == (86400.0, 3600.0)
        assert (default.conntrack_udp_timeout, default.conntrack_udp_stream_timeout) == (0, 0)
        assert default.conntrack_tcp_be_liberal is False
        assert (default.kubeconfig, default.master, default.qps, default.burst) == (
            None, None, 5.0, 10)
        assert (default.logging_format, default.verbosity) == (LogFormat.TEXT, 0)
        assert default.oom_score_adj == -999
        assert dict(default.feature_gates) == {}
        assert (default.debug_socket, default.snapshot) == ("/run/pyproxy/pyproxy.sock", None)

    def test_minimal_nftables_file_is_all_defaults(self) -> None:
        """A file with nothing but apiVersion, kind and mode gives the defaults."""
        loaded = load("mode: nftables\n")
        assert ProxyConfig() == loaded
        assert loaded.notes == (NO_CLUSTER_CIDR_NOTE,)

    def test_zero_values_mean_default(self) -> None:
        """As kube-proxy's defaulting: "", 0 and 0s in defaulted fields select the default."""
        loaded = load("""\
            mode: nftables
            bindAddress: ""
            healthzBindAddress: ""
            metricsBindAddress: ""
            configSyncPeriod: 0s
            clientConnection: {qps: 0, burst: 0}
            nftables: {syncPeriod: 0s, minSyncPeriod: 0s, masqueradeBit: null}
            conntrack: {maxPerCore: null, min: null, tcpEstablishedTimeout: null}
            oomScoreAdj: null
            detectLocalMode: ""
            logging: {format: ""}
            nodePortAddresses: []
        """)
        assert ProxyConfig() == loaded

    def test_zero_where_kube_proxy_keeps_zero(self) -> None:
        """Pointer fields (masqueradeBit, conntrack, oomScoreAdj) keep an explicit 0."""
        loaded = load("""\
            mode: nftables
            nftables: {masqueradeBit: 0}
            conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
            oomScoreAdj: 0
        """)
        assert (
            loaded.masquerade_bit, loaded.conntrack_max_per_core, loaded.conntrack_min,
            loaded.conntrack_tcp_established_timeout, loaded.conntrack_tcp_close_wait_timeout,
            loaded.oom_score_adj) == (0, 0, 0, 0.0, 0.0, 0)

    def test_ipv6_bind_address_moves_the_servers(self) -> None:
        """With an IPv6 bindAddress, healthz and metrics default to [::] and [::1]."""
        loaded = load("bindAddress: fd00::5\n")
        servers = (loaded.healthz_bind_address, loaded.metrics_bind_address)
        assert servers == ("[::]:10256", "[::1]:10249")

    def test_bare_ip_gets_the_default_port(self) -> None:
        """A bind address without port gets kube-proxy's port (AppendPortIfNeeded)."""
        loaded = load("healthzBindAddress: 10.0.0.1\nmetricsBindAddress: '::'\n")
        servers = (loaded.healthz_bind_address, loaded.metrics_bind_address)
        assert servers == ("10.0.0.1:10256", "[::]:10249")


class TestKubeadm:
    def kubeadm_config(self) -> str:
        configmap = yaml.safe_load(KUBEADM_CONFIGMAP)
        text: str = configmap["data"]["config.conf"]
        return text

    def test_kubeadm_configmap_as_is(self) -> None:
        """kubeadm's ConfigMap loads: defaults, its kubeconfig and its CIDRs, and the two
        consequences of its empty mode are noted."""
        loaded = load_config(self.kubeadm_config())
        expected = ProxyConfig(
            kubeconfig="/var/lib/kube-proxy/kubeconfig.conf",
            cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/56"),
            nodeport_addresses=IPTABLES_NODEPORTS, kube_proxy_mode="iptables",
            file_notes=(MODE_EMPTY_NOTE, NODEPORT_NOTE),
        )
        assert expected == loaded
        assert loaded.notes == (MODE_EMPTY_NOTE, NODEPORT_NOTE)

    def test_kubeadm_daemonset_command_line(self, tmp_path: Path) -> None:
        """The DaemonSet's `--config ... --hostname-override=$(NODE_NAME)` works unchanged."""
        path = tmp_path / "config.conf"
        path.write_text(self.kubeadm_config())
        resolved = from_args(parse_flags(f"--config={path}", "--hostname-override=Node-A"))
        assert resolved.node_name(hostname=lambda: "ignored") == "node-a"
        assert resolved.cluster_cidrs == ("10.244.0.0/16", "fd00:10:244::/56")

    def test_kubeadm_switched_to_nftables_mode(self) -> None:
        """With mode: nftables, the nftables section applies, and tuned iptables/ipvs
        settings are reported as ignored."""
        document = yaml.safe_load(self.kubeadm_config())
        document["mode"] = "nftables"
        document["iptables"]["masqueradeAll"] = True
        document["ipvs"].update(scheduler="rr", strictARP=True)
        loaded = load_config(yaml.safe_dump(document))
        assert loaded.masquerade_all is False
        assert loaded.notes == (
            "iptables.masqueradeAll: ignored (iptables mode only; mode is nftables)",
            "ipvs.scheduler: ignored (ipvs mode only)",
            "ipvs.strictARP: ignored (ipvs mode only)",
        )


class TestEveryField:
    def test_every_used_field(self) -> None:
        """Every field pyproxy uses reaches its setting."""
        loaded = load(EVERY_FIELD)
        assert loaded == EVERY_FIELD_CONFIG
        assert loaded.notes == ()
        assert loaded.node_name() == "worker-1.example.com"

    def test_json(self) -> None:
        """The same configuration written as JSON loads the same."""
        document = {"apiVersion": config.API_VERSION, "kind": config.KIND,
                    **yaml.safe_load(EVERY_FIELD)}
        assert load_config(json.dumps(document, indent=2)) == EVERY_FIELD_CONFIG

    def test_every_v1alpha1_field_is_known(self) -> None:
        """The fields pyproxy knows are exactly the v1alpha1 fields."""
        assert sorted(V1ALPHA1_FIELDS) == sorted(spec.path for spec in FIELDS)

    @pytest.mark.parametrize("path", [p for p in V1ALPHA1_FIELDS if p != "mode"])
    def test_every_v1alpha1_field_is_accepted_at_its_zero_value(self, path: str) -> None:
        """Each field at its Go zero value loads, and says nothing."""
        spec = next(s for s in FIELDS if s.path == path)
        document = {"apiVersion": config.API_VERSION, "kind": config.KIND, "mode": "nftables",
                    **nested(path, ZERO[spec.type])}
        loaded = load_config(json.dumps(document))
        assert loaded.file_notes == ()

    @pytest.mark.parametrize("path", [s.path for s in FIELDS
                                      if s.attr is None and s.path != "mode"])
    def test_ignored_fields_are_noted_when_set(self, path: str) -> None:
        """A field pyproxy does not use, set to a value that means something, is noted (in
        nftables mode: iptables.localhostNodePorts is read in iptables mode only)."""
        spec = next(s for s in FIELDS if s.path == path)
        document = {"apiVersion": config.API_VERSION, "kind": config.KIND, "mode": "nftables",
                    **nested(path, SET[spec.type])}
        loaded = load_config(json.dumps(document))
        why = "iptables mode only; mode is nftables" if spec.section == "iptables" else spec.doc
        assert (f"{path}: ignored ({why})",) == loaded.file_notes


ZERO: dict[Any, Any] = {
    "string": "", "boolean": False, "int32": 0, "uint32": 0, "number": 0, "duration": "0s",
    "duration or nanoseconds": 0, "list of strings": [], "map of string to boolean": {},
    "quantity": "0", "list of {filePattern, verbosity}": [],
}
SET: dict[Any, Any] = {
    "string": "x", "boolean": True, "int32": 7, "uint32": 7, "number": 7, "duration": "5s",
    "duration or nanoseconds": "5s", "list of strings": ["10.0.0.0/8"],
    "map of string to boolean": {"A": True}, "quantity": "64Ki",
    "list of {filePattern, verbosity}": [{"filePattern": "proxier*", "verbosity": 5}],
}


class TestModes:
    SECTIONS = (
        "iptables: {masqueradeBit: 1, masqueradeAll: true, syncPeriod: 10s, minSyncPeriod: 2s}\n"
        "nftables: {masqueradeBit: 2, masqueradeAll: false, syncPeriod: 20s, minSyncPeriod: 3s}\n"
    )

    def test_nftables_mode_reads_the_nftables_section(self) -> None:
        """mode: nftables takes the mode settings from the nftables section."""
        loaded = load("mode: nftables\n" + self.SECTIONS)
        assert mode_settings(loaded) == (2, False, 20.0, 3.0)
        assert tuple(
            f"iptables.{name}: ignored (iptables mode only; mode is nftables)"
            for name in ("masqueradeBit", "masqueradeAll", "syncPeriod", "minSyncPeriod")
        ) == loaded.file_notes

    def test_empty_mode_reads_the_iptables_section(self) -> None:
        """An empty mode takes them from the iptables section, as kube-proxy's conversion."""
        loaded = load("mode: ''\n" + self.SECTIONS)
        assert mode_settings(loaded) == (1, True, 10.0, 2.0)
        why = "mode is empty, so the iptables section applies; set mode: nftables to use this"
        assert (MODE_EMPTY_NOTE, NODEPORT_NOTE,
                f"nftables.masqueradeBit: ignored ({why})",
                f"nftables.syncPeriod: ignored ({why})",
                f"nftables.minSyncPeriod: ignored ({why})") == loaded.file_notes

    def test_iptables_mode_reads_the_iptables_section(self) -> None:
        """mode: iptables, which kubeadm v1.37 writes into its kube-proxy ConfigMap
        (tests/test_kubeadm.py), runs nftables with the iptables section, as an empty mode."""
        loaded = load("mode: iptables\n" + self.SECTIONS)
        assert mode_settings(loaded) == (1, True, 10.0, 2.0)
        why = "mode is iptables, so the iptables section applies; set mode: nftables to use this"
        assert (MODE_IPTABLES_NOTE, NODEPORT_NOTE,
                f"nftables.masqueradeBit: ignored ({why})",
                f"nftables.syncPeriod: ignored ({why})",
                f"nftables.minSyncPeriod: ignored ({why})") == loaded.file_notes
        assert loaded.warnings == ()

    def test_iptables_proxy_mode_flag_warns(self) -> None:
        """--proxy-mode=iptables is accepted with a warning: pyproxy runs nftables, and the
        flag does not bring iptables mode's NodePort addresses (a file's mode does): the
        warning names the flag that does, unless --nodeport-addresses is given."""
        config = from_args(parse_flags("--proxy-mode=iptables"))
        assert config.warnings == (
            "--proxy-mode=iptables: pyproxy runs nftables, its only mode; NodePorts are served "
            "on nodePortAddresses (primary), not where iptables mode served them (every local "
            "address and 127.0.0.1): --nodeport-addresses=all,127.0.0.0/8 keeps that",)
        assert config.nodeport_addresses == ("primary",)
        config = from_args(parse_flags("--proxy-mode=iptables", "--nodeport-addresses=primary"))
        assert config.warnings == ("--proxy-mode=iptables: pyproxy runs nftables, its only mode",)

    def test_localhost_nodeports_noted(self) -> None:
        """iptables.localhostNodePorts set (even to false) is noted in nftables mode, where it
        never applies."""
        loaded = load("mode: nftables\niptables: {localhostNodePorts: true}\n")
        assert loaded.file_notes == (
            "iptables.localhostNodePorts: ignored (iptables mode only; mode is nftables)",)

    @pytest.mark.parametrize(("fields", "addresses"), [
        pytest.param("", IPTABLES_NODEPORTS, id="unset: every local address and 127.0.0.1"),
        pytest.param("nodePortAddresses: []\n", IPTABLES_NODEPORTS, id="empty is unset"),
        pytest.param("iptables: {localhostNodePorts: false}\n", ("all",),
                     id="localhostNodePorts false: no 127.0.0.1"),
        pytest.param("nodePortAddresses: [0.0.0.0/0]\n", ("0.0.0.0/0", "127.0.0.0/8"),
                     id="0.0.0.0/0 served 127.0.0.1 in iptables mode"),
        pytest.param("nodePortAddresses: [fd00::/64]\n",
                     ("fd00::/64", "0.0.0.0/0", "127.0.0.0/8"),
                     id="no IPv4 CIDR: IPv4 matched all, 127.0.0.1 too"),
        pytest.param("nodePortAddresses: [primary]\n", ("primary",), id="primary: as given"),
        pytest.param("nodePortAddresses: [192.168.0.0/16]\n", ("192.168.0.0/16",),
                     id="a CIDR without loopback: as given"),
        pytest.param("nodePortAddresses: [all, localhost]\n", ("all", "localhost"),
                     id="loopback named already"),
    ])
    def test_iptables_mode_gets_iptables_mode_nodeport_addresses(
            self, fields: str, addresses: tuple[str, ...]) -> None:
        """A file whose mode is iptables (or empty) serves NodePorts where kube-proxy's
        iptables mode served them: every local address when nodePortAddresses is unset, and
        127.0.0.1 (the localhost proxy) wherever iptables mode served localhost NodePorts
        (v1.37: localhostNodePorts on, an IPv4 CIDR holding 127.0.0.0, none meaning all)."""
        for mode in ("iptables", "''"):
            loaded = load(f"mode: {mode}\n{fields}")
            assert loaded.nodeport_addresses == addresses
            assert loaded.kube_proxy_mode == "iptables"
        nftables = load(f"mode: nftables\n{fields}")
        assert nftables.kube_proxy_mode == "nftables"
        assert "127.0.0.0/8" not in nftables.nodeport_addresses

    def test_what_still_differs_from_iptables_mode(self) -> None:
        """Where iptables mode served NodePorts on 127.0.0.1, one change is always left (UDP
        and SCTP, the rest of 127.0.0.0/8); without the localhost proxy (the gate off, or
        nodePortAddresses without loopback) the change names the setting that keeps TCP.
        Nothing differs where iptables mode did not serve them, nor in nftables mode."""
        (change,) = load("mode: iptables\n").changes
        assert change.startswith("NodePorts on 127.0.0.0/8: TCP ones are served on 127.0.0.1 "
                                 "only, by pyproxy's localhost proxy")
        assert "UDP and SCTP ones are rejected" in change and "Nothing keeps those" in change
        (change,) = load("mode: iptables\nnodePortAddresses: [all, localhost]\n"
                         "featureGates: {KubeProxyNFTablesLocalhostNodePorts: false}\n").changes
        assert change.startswith("NodePorts on 127.0.0.1 are rejected, every protocol")
        assert change.endswith(
            "TCP ones are kept by nodePortAddresses: [all, localhost] and "
            "featureGates KubeProxyNFTablesLocalhostNodePorts: true: pyproxy's localhost proxy "
            "serves them")
        flagged = apply_flags(load("mode: iptables\n"), parse_flags("--nodeport-addresses=all"))
        (change,) = flagged.changes
        assert change.endswith("TCP ones are kept by nodePortAddresses: [all, 127.0.0.0/8]: "
                               "pyproxy's localhost proxy serves them")
        # The setting named keeps IPv4's every local address: not [fd00::/64, 127.0.0.0/8].
        flagged = apply_flags(load("mode: iptables\n"),
                              parse_flags("--nodeport-addresses=fd00::/64"))
        assert flagged.changes[0].endswith(
            "nodePortAddresses: [fd00::/64, 0.0.0.0/0, 127.0.0.0/8]: pyproxy's localhost "
            "proxy serves them")
        assert load("mode: iptables\niptables: {localhostNodePorts: false}\n").changes == ()
        assert load("mode: iptables\nnodePortAddresses: [primary]\n").changes == ()
        assert load("mode: nftables\n").changes == ()
        assert load("mode: nftables\nnodePortAddresses: [all]\n").changes == ()


ERRORS = [
    # structure
    pytest.param("nftables: true", "nftables: expected an object, got boolean true",
                 id="section not an object"),
    pytest.param("mode: nftables\nmode: ''", "mode: duplicate field (line 4)",
                 id="duplicate field"),
    # mode
    pytest.param("mode: ipvs", "mode: pyproxy only implements nftables mode, got 'ipvs' "
                 "(use nftables; iptables or empty run nftables too)", id="ipvs mode"),
    pytest.param("mode: NFTables", "mode: pyproxy only implements nftables mode, got "
                 "'NFTables' (use nftables; iptables or empty run nftables too)",
                 id="mode is case-sensitive"),
    # types
    pytest.param("mode: nftables\nnftables: {syncPeriod: 30}", "nftables.syncPeriod: expected "
                 "a duration such as 30s, 1m0s, 500ms or 2h30m (a string), got integer 30",
                 id="duration as a number"),
    pytest.param("configSyncPeriod: 15min", "configSyncPeriod: unknown unit 'min' in duration "
                 "'15min'; expected a duration such as 30s, 1m0s, 500ms or 2h30m",
                 id="duration with unknown unit"),
    pytest.param("mode: nftables\nnftables: {masqueradeBit: '14'}",
                 "nftables.masqueradeBit: expected an integer (int32), got string \"14\"",
                 id="integer as a string"),
    pytest.param("mode: nftables\nnftables: {masqueradeBit: 14.0}",
                 "nftables.masqueradeBit: expected an integer (int32), got number 14.0",
                 id="integer as a float"),
    pytest.param("conntrack: {min: 3000000000}", "conntrack.min: expected an integer in "
                 "-2147483648..2147483647 (int32), got integer 3000000000", id="int32 overflow"),
    pytest.param("logging: {verbosity: -1}", "logging.verbosity: expected an integer in "
                 "0..4294967295 (uint32), got integer -1", id="negative verbosity"),
    pytest.param("bindAddressHardFail: 'yes'",
                 "bindAddressHardFail: expected a boolean (true or false), got string \"yes\"",
                 id="boolean as a string"),
    pytest.param("conntrack: {tcpBeLiberal: 1}",
                 "conntrack.tcpBeLiberal: expected a boolean (true or false), got integer 1",
                 id="boolean as a number"),
    pytest.param("hostnameOverride: 1234", "hostnameOverride: expected a string, got integer "
                 "1234", id="string as a number"),
    pytest.param("nodePortAddresses: 10.0.0.0/8", "nodePortAddresses: expected a list of "
                 "strings, got string \"10.0.0.0/8\"", id="list as a string"),
    pytest.param("nodePortAddresses: [1]", "nodePortAddresses: expected a list of strings, "
                 "got list", id="list of numbers"),
    pytest.param("featureGates: {Foo: 'yes'}", "featureGates: expected feature name: "
                 "true|false, got 'Foo': 'yes'", id="feature gate not a boolean"),
    pytest.param("clientConnection: {qps: fast}", "clientConnection.qps: expected a number, "
                 "got string \"fast\"", id="qps as a word"),
    pytest.param("ipvs: {strictARP: 'yes'}", "ipvs.strictARP: expected a boolean (true or "
                 "false), got string \"yes\"", id="ignored fields are type checked too"),
    pytest.param("logging: {options: {json: {infoBufferSize: lots}}}",
                 "logging.options.json.infoBufferSize: expected a quantity such as 0 or 64Ki, "
                 "got string \"lots\"", id="quantity"),
    pytest.param("logging: {flushFrequency: 5x}", "logging.flushFrequency: unknown unit 'x' in "
                 "duration '5x'; expected a duration such as 30s, 1m0s, 500ms or 2h30m",
                 id="flush frequency"),
    # values
    pytest.param("mode: nftables\nnftables: {masqueradeBit: 32}",
                 "nftables.masqueradeBit: must be within 0..31, got 32", id="masqueradeBit > 31"),
    pytest.param("iptables: {masqueradeBit: -1}",
                 "iptables.masqueradeBit: must be within 0..31, got -1",
                 id="masqueradeBit < 0 in the section an empty mode uses"),
    pytest.param("mode: nftables\nnftables: {syncPeriod: -5s}",
                 "nftables.syncPeriod: must be greater than 0, got -5s", id="negative syncPeriod"),
    pytest.param("mode: nftables\nnftables: {minSyncPeriod: -1s}",
                 "nftables.minSyncPeriod: must not be negative, got -1s",
                 id="negative minSyncPeriod"),
    pytest.param("conntrack: {tcpEstablishedTimeout: -1s}",
                 "conntrack.tcpEstablishedTimeout: must not be negative, got -1s",
                 id="negative conntrack timeout"),
    pytest.param("conntrack: {maxPerCore: -1}",
                 "conntrack.maxPerCore: must be within 0..2147483647, got -1",
                 id="negative maxPerCore"),
    pytest.param("oomScoreAdj: 2000", "oomScoreAdj: must be within -1000..1000, got 2000",
                 id="oomScoreAdj out of range"),
    pytest.param("clientConnection: {qps: -1}",
                 "clientConnection.qps: must be a finite number >= 0, got -1", id="negative qps"),
    pytest.param("clientConnection: {burst: -1}",
                 "clientConnection.burst: must be within 0..2147483647, got -1",
                 id="negative burst"),
    pytest.param("bindAddress: node1", "bindAddress: expected an IP address, got 'node1'",
                 id="bindAddress not an IP"),
    pytest.param("healthzBindAddress: localhost:10256",
                 "healthzBindAddress: must be IP:port: 'localhost' is not an IP address",
                 id="healthz host name"),
    pytest.param("metricsBindAddress: 127.0.0.1:99999", "metricsBindAddress: must be IP:port "
                 "(e.g. 0.0.0.0:10249), got '127.0.0.1:99999'", id="metrics port out of range"),
    pytest.param("healthzBindAddress: ':10256'",
                 "healthzBindAddress: must be IP:port: '' is not an IP address",
                 id="healthz without host"),
    pytest.param("logging: {format: xml}", "logging.format: expected text or json, got 'xml'",
                 id="logging format"),
    pytest.param("clusterCIDR: 10.244.0.0", "clusterCIDR: '10.244.0.0' is not a CIDR "
                 "(e.g. 10.244.0.0/16)", id="clusterCIDR without prefix length"),
    pytest.param("clusterCIDR: pods", "clusterCIDR: 'pods' is not a CIDR (e.g. 10.244.0.0/16)",
                 id="clusterCIDR not a CIDR"),
    pytest.param("clusterCIDR: 10.244.0.0/33", "clusterCIDR: '10.244.0.0/33' is not a CIDR "
                 "(e.g. 10.244.0.0/16)", id="clusterCIDR prefix too long"),
    pytest.param("clusterCIDR: '10.244.0.0/16,'", "clusterCIDR: '' is not a CIDR "
                 "(e.g. 10.244.0.0/16)", id="clusterCIDR trailing comma"),
    pytest.param("clusterCIDR: 10.244.0.0/16,10.245.0.0/16", "clusterCIDR: at most one CIDR "
                 "per IP family, got IPv4 10.244.0.0/16, 10.245.0.0/16",
                 id="two IPv4 cluster CIDRs"),
    pytest.param("clusterCIDR: 'fd00::/48,10.0.0.0/8,fd01::/48'", "clusterCIDR: at most one "
                 "CIDR per IP family, got IPv6 fd00::/48, fd01::/48", id="two IPv6 cluster CIDRs"),
    pytest.param("detectLocalMode: Bridge", "detectLocalMode: expected one of ClusterCIDR, "
                 "NodeCIDR, BridgeInterface, InterfaceNamePrefix, got 'Bridge'",
                 id="unknown detectLocalMode"),
    pytest.param("detectLocalMode: None", "detectLocalMode: expected one of ClusterCIDR, "
                 "NodeCIDR, BridgeInterface, InterfaceNamePrefix, got 'None'",
                 id="None is pyproxy-internal, not a kube-proxy mode"),
    pytest.param("detectLocalMode: BridgeInterface", "detectLocalMode is BridgeInterface but "
                 "detectLocal.bridgeInterface (--pod-bridge-interface) is empty",
                 id="BridgeInterface without bridge"),
    pytest.param("detectLocalMode: InterfaceNamePrefix\ndetectLocal: {bridgeInterface: cbr0}",
                 "detectLocalMode is InterfaceNamePrefix but detectLocal.interfaceNamePrefix "
                 "(--pod-interface-name-prefix) is empty", id="InterfaceNamePrefix without prefix"),
    pytest.param("detectLocal: {bridgeInterface: 'cbr0\" accept'}",
                 "detectLocal.bridgeInterface: expected an interface name ([A-Za-z0-9_.:-], at "
                 "most 15 characters), got 'cbr0\" accept'", id="interface name with a quote"),
    pytest.param("detectLocal: {interfaceNamePrefix: 'veth*'}",
                 "detectLocal.interfaceNamePrefix: expected an interface name ([A-Za-z0-9_.:-], "
                 "at most 15 characters), got 'veth*'", id="interface prefix with a wildcard"),
    pytest.param("detectLocal: {bridgeInterface: averyveryverylong}",
                 "detectLocal.bridgeInterface: expected an interface name ([A-Za-z0-9_.:-], at "
                 "most 15 characters), got 'averyveryverylong'", id="interface name too long"),
    pytest.param("nodePortAddresses: [eth0]", "nodePortAddresses: 'eth0' is neither a CIDR nor "
                 "one of primary, localhost, all", id="nodePortAddresses interface name"),
    pytest.param("nodePortAddresses: [192.168.1.1]", "nodePortAddresses: '192.168.1.1' is "
                 "neither a CIDR nor one of primary, localhost, all",
                 id="nodePortAddresses bare IP"),
]


class TestErrors:
    @pytest.mark.parametrize(("body", "message"), ERRORS)
    def test_file_errors(self, body: str, message: str) -> None:
        """A bad file fails with a message naming the field and what it expects."""
        with pytest.raises(ConfigError) as caught:
            load(body + "\n")
        assert message == str(caught.value)

    @pytest.mark.parametrize(("text", "message"), [
        pytest.param("", "expected a KubeProxyConfiguration object, got null", id="empty"),
        pytest.param("- a\n", "expected a KubeProxyConfiguration object, got list", id="list"),
        pytest.param("kind: KubeProxyConfiguration\n",
                     "apiVersion: expected kubeproxy.config.k8s.io/v1alpha1, missing",
                     id="no apiVersion"),
        pytest.param("apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration",
                     "apiVersion: expected kubeproxy.config.k8s.io/v1alpha1, got string "
                     "\"kubeproxy.config.k8s.io/v1alpha2\"", id="v1alpha2"),
        pytest.param("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n",
                     "kind: expected KubeProxyConfiguration, missing", id="no kind"),
        pytest.param("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration",
                     "kind: expected KubeProxyConfiguration, got string \"KubeletConfiguration\"",
                     id="another component's config"),
    ])
    def test_document_errors(self, text: str, message: str) -> None:
        """The document must be one KubeProxyConfiguration object."""
        with pytest.raises(ConfigError) as caught:
            load_config(text)
        assert message == str(caught.value)

    def test_not_yaml(self) -> None:
        """Text that is neither YAML nor JSON is reported as such, with the parser's detail."""
        with pytest.raises(ConfigError, match=r"(?s)^not valid YAML or JSON: .*line 3"):
            load("mode: [nftables\n")

    def test_config_file_errors_name_the_file(self, tmp_path: Path) -> None:
        """Errors from --config name the file, and a missing file is an error."""
        path = tmp_path / "kube-proxy.yaml"
        path.write_text(HEADER + "mode: ipvs\n")
        with pytest.raises(ConfigError, match=f"^{path}: mode: pyproxy only implements"):
            from_args(parse_flags(f"--config={path}"))
        with pytest.raises(ConfigError, match=r"^--config /nonexistent.yaml: No such file"):
            from_args(parse_flags("--config=/nonexistent.yaml"))


class TestCrossField:
    def test_min_sync_period_above_sync_period_is_noted(self) -> None:
        """minSyncPeriod > syncPeriod is allowed, and said."""
        loaded = load("mode: nftables\nclusterCIDR: 10.0.0.0/8\n"
                      "nftables: {syncPeriod: 10s, minSyncPeriod: 1m}\n")
        assert loaded.notes == ("minSyncPeriod (1m0s) is longer than syncPeriod (10s): retries "
                                "after a failed sync also wait for minSyncPeriod",)

    def test_full_sync_period_below_min_sync_period_is_an_error(self) -> None:
        """The runner cannot run a full sync more often than minSyncPeriod allows."""
        with pytest.raises(ConfigError) as caught:
            apply_flags(ProxyConfig(), parse_flags("--full-sync-period=1s", "--min-sync-period=2s"))
        assert (str(caught.value)
                == "--full-sync-period (1s) must not be shorter than minSyncPeriod (2s)")

    def test_all_with_other_nodeport_addresses_is_noted(self) -> None:
        """`all` makes the other nodePortAddresses entries pointless; that is noted."""
        loaded = load("clusterCIDR: 10.0.0.0/8\nmode: nftables\n"
                      "nodePortAddresses: [10.0.0.0/8, all]\n")
        assert loaded.notes == (
            "nodePortAddresses includes 'all': the other entries change nothing",)

    def test_notes_follow_flags(self) -> None:
        """A note about settings goes away when a flag fixes them."""
        loaded = load("mode: nftables\n")
        assert NO_CLUSTER_CIDR_NOTE in loaded.notes
        fixed = apply_flags(loaded, parse_flags("--cluster-cidr=10.244.0.0/16"))
        assert fixed.notes == ()


class TestFlags:
    FILE = """\
        mode: nftables
        clusterCIDR: 10.244.0.0/16
        nftables: {masqueradeAll: true, syncPeriod: 45s}
        conntrack: {maxPerCore: 0}
        featureGates: {A: true, B: true}
        healthzBindAddress: 0.0.0.0:20256
    """

    def test_flags_not_given_keep_the_file(self) -> None:
        """Without flags, the file's values stand."""
        loaded = load(self.FILE)
        assert loaded == apply_flags(loaded, parse_flags())

    def test_given_flags_override_the_file(self) -> None:
        """Each flag given wins over the file; the others keep the file's values."""
        loaded = load(self.FILE)
        resolved = apply_flags(loaded, parse_flags(
            "--masquerade-all=false", "--sync-period=1m", "--conntrack-max-per-core=65536",
            "--feature-gates=B=false,C=true", "--cluster-cidr=10.0.0.0/8,fd00::/48",
            "--min-sync-period=0"))
        assert dataclasses.replace(
            loaded, masquerade_all=False, sync_period=60.0, conntrack_max_per_core=65536,
            feature_gates=MappingProxyType({"A": True, "B": False, "C": True}),
            cluster_cidrs=("10.0.0.0/8", "fd00::/48"), min_sync_period=0.0,
        ) == resolved
        assert resolved.healthz_bind_address == "0.0.0.0:20256"

    @pytest.mark.parametrize(("argv", "attr", "value"), [
        pytest.param(["--hostname-override=node-b"], "hostname_override", "node-b",
                     id="hostname"),
        pytest.param(["--cluster-cidr=10.0.0.0/8"], "cluster_cidrs", ("10.0.0.0/8",),
                     id="cluster CIDR"),
        pytest.param(["--cluster-cidr="], "cluster_cidrs", (), id="cluster CIDR cleared"),
        pytest.param(["--detect-local-mode=NodeCIDR"], "detect_local_mode", LocalMode.NODE_CIDR,
                     id="detect-local mode"),
        pytest.param(["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cni0"],
                     "bridge_interface", "cni0", id="bridge"),
        pytest.param(["--detect-local-mode=InterfaceNamePrefix",
                      "--pod-interface-name-prefix=cali"], "interface_name_prefix", "cali",
                     id="prefix"),
        pytest.param(["--nodeport-addresses=10.0.0.0/8, all"], "nodeport_addresses",
                     ("10.0.0.0/8", "all"), id="nodeport addresses"),
        pytest.param(["--nodeport-addresses="], "nodeport_addresses", ("primary",),
                     id="empty nodeport addresses mean the default"),
        pytest.param(["--masquerade-all"], "masquerade_all", True, id="bool flag alone"),
        pytest.param(["--masquerade-all=True"], "masquerade_all", True, id="bool flag, Go True"),
        pytest.param(["--kubeconfig=/k"], "kubeconfig", "/k", id="kubeconfig"),
        pytest.param(["--master=https://10.0.0.1:6443"], "master", "https://10.0.0.1:6443",
                     id="master"),
        pytest.param(["--kube-api-qps=20.5"], "qps", 20.5, id="qps"),
        pytest.param(["--kube-api-burst=40"], "burst", 40, id="burst"),
        pytest.param(["--healthz-bind-address=127.0.0.1:1"], "healthz_bind_address",
                     "127.0.0.1:1", id="healthz"),
        pytest.param(["--healthz-bind-address="], "healthz_bind_address", None,
                     id="empty healthz address disables"),
        pytest.param(["--metrics-bind-address=0.0.0.0"], "metrics_bind_address",
                     "0.0.0.0:10249", id="metrics without port"),
        pytest.param(["--bind-address=10.1.1.1"], "bind_address", "10.1.1.1", id="bind"),
        pytest.param(["--bind-address-hard-fail"], "bind_address_hard_fail", True,
                     id="hard fail"),
        pytest.param(["--config-sync-period=1m"], "config_sync_period", 60.0, id="config sync"),
        pytest.param(["--conntrack-min=0"], "conntrack_min", 0, id="conntrack min"),
        pytest.param(["--conntrack-tcp-timeout-established=1h"],
                     "conntrack_tcp_established_timeout", 3600.0, id="established"),
        pytest.param(["--conntrack-tcp-timeout-close-wait=0s"],
                     "conntrack_tcp_close_wait_timeout", 0.0, id="close wait"),
        pytest.param(["--conntrack-tcp-be-liberal=true"], "conntrack_tcp_be_liberal", True,
                     id="be liberal"),
        pytest.param(["--conntrack-udp-timeout=30s"], "conntrack_udp_timeout", 30.0,
                     id="udp"),
        pytest.param(["--conntrack-udp-timeout-stream=2m"], "conntrack_udp_stream_timeout",
                     120.0, id="udp stream"),
        pytest.param(["--oom-score-adj=-1000"], "oom_score_adj", -1000, id="oom"),
        pytest.param(["-v", "4"], "verbosity", 4, id="-v N"),
        pytest.param(["-v=5"], "verbosity", 5, id="-v=N"),
        pytest.param(["--v=6"], "verbosity", 6, id="--v=N"),
        pytest.param(["--logging-format=json"], "logging_format", LogFormat.JSON, id="format"),
        pytest.param(["--full-sync-period=2h"], "full_sync_period", 7200.0, id="full sync"),
        pytest.param(["--snapshot=cluster.yaml"], "snapshot", "cluster.yaml", id="snapshot"),
        pytest.param(["--debug-socket="], "debug_socket", None,
                     id="empty debug socket disables"),
        pytest.param(["--proxy-mode=nftables", "--hostname-override=n"], "hostname_override",
                     "n", id="proxy mode nftables is accepted"),
    ])
    def test_each_flag(self, argv: list[str], attr: str, value: Any) -> None:
        """Each flag sets its setting."""
        assert value == getattr(apply_flags(ProxyConfig(), parse_flags(*argv)), attr)

    def test_ipv6_bind_address_flag_moves_default_servers(self) -> None:
        """--bind-address of the other family moves healthz/metrics still at their defaults,
        and leaves an address set explicitly."""
        resolved = apply_flags(load("healthzBindAddress: 10.0.0.1:10256\n"),
                               parse_flags("--bind-address=fd00::1"))
        servers = (resolved.healthz_bind_address, resolved.metrics_bind_address)
        assert servers == ("10.0.0.1:10256", "[::1]:10249")

    @pytest.mark.parametrize(("argv", "message"), [
        pytest.param(["--sync-period=30"], "--sync-period: missing unit in duration '30'; "
                     "expected a duration such as 30s, 1m0s, 500ms or 2h30m", id="duration"),
        pytest.param(["--sync-period=0s"], "--sync-period: must be greater than 0, got 0s",
                     id="zero sync period"),
        pytest.param(["--full-sync-period=0"], "--full-sync-period: must be greater than 0, "
                     "got 0s", id="zero full sync period"),
        pytest.param(["--masquerade-all=yes"], "--masquerade-all: expected true or false, got "
                     "'yes'", id="bool"),
        pytest.param(["--conntrack-min=lots"], "--conntrack-min: expected an integer, got "
                     "'lots'", id="integer"),
        pytest.param(["--v=-1"], "--v: expected an integer in 0..4294967295 (uint32), got "
                     "integer -1", id="negative verbosity"),
        pytest.param(["--oom-score-adj=-1001"], "--oom-score-adj: must be within -1000..1000, "
                     "got -1001", id="oom range"),
        pytest.param(["--kube-api-qps=nan"], "--kube-api-qps: must be a finite number >= 0, "
                     "got nan", id="qps nan"),
        pytest.param(["--detect-local-mode=Foo"], "--detect-local-mode: expected one of "
                     "ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix, got 'Foo'",
                     id="detect-local mode"),
        pytest.param(["--proxy-mode=ipvs"], "--proxy-mode: pyproxy only implements "
                     "nftables mode, got 'ipvs' (use nftables; iptables or empty run nftables "
                     "too)", id="proxy mode"),
        pytest.param(["--feature-gates=A"], "--feature-gates: expected Name=true|false[,...], "
                     "got 'A'", id="feature gates"),
        pytest.param(["--cluster-cidr=10.0.0.0/8,10.1.0.0/16"], "--cluster-cidr: at most one "
                     "CIDR per IP family, got IPv4 10.0.0.0/8, 10.1.0.0/16", id="cluster CIDRs"),
        pytest.param(["--healthz-bind-address=foo:1"], "--healthz-bind-address: must be "
                     "IP:port: 'foo' is not an IP address", id="healthz"),
        pytest.param(["--bind-address="], "--bind-address: expected an IP address, got ''",
                     id="empty bind address"),
        pytest.param(["--pod-bridge-interface=br*"], "--pod-bridge-interface: expected an "
                     "interface name ([A-Za-z0-9_.:-], at most 15 characters), got 'br*'",
                     id="interface"),
        pytest.param(["--logging-format=xml"], "--logging-format: expected text or json, got "
                     "'xml'", id="logging format"),
        pytest.param(["--detect-local-mode=BridgeInterface"], "detectLocalMode is "
                     "BridgeInterface but detectLocal.bridgeInterface (--pod-bridge-interface) "
                     "is empty", id="cross-field check after flags"),
    ])
    def test_flag_errors(self, argv: list[str], message: str) -> None:
        """A bad flag value fails with a message naming the flag."""
        with pytest.raises(ConfigError) as caught:
            apply_flags(ProxyConfig(), parse_flags(*argv))
        assert message == str(caught.value)

    def test_namespace_without_the_flags(self) -> None:
        """A namespace from a parser without these flags changes nothing."""
        assert ProxyConfig() == apply_flags(ProxyConfig(), argparse.Namespace(other=1))

    def test_from_args_without_config_file(self) -> None:
        """Without --config, flags apply over the defaults."""
        assert ProxyConfig(masquerade_all=True) == from_args(parse_flags("--masquerade-all"))


class TestNodeConfig:
    def test_renderer_settings(self) -> None:
        """node_config carries what shapes the rules."""
        node = EVERY_FIELD_CONFIG.node_config("worker-1", ["192.168.50.1", "fd00::1"])
        assert node.node_name == "worker-1"
        assert node.cluster_cidrs == ("10.244.0.0/16", "fd00:10:244::/56")
        assert (node.local_mode, node.local_interface) == (
            LocalMode.INTERFACE_NAME_PREFIX, "veth")
        assert node.nodeport_addresses == ("192.168.50.0/24", "primary")
        assert (node.masquerade_bit, node.masquerade_all) == (5, True)
        rendered = render_config(node, IPFamily.IPv4)
        assert rendered.local_match().text() == 'iifname "veth*"'
        assert rendered.mark == "0x00000020"

    @pytest.mark.parametrize(("mode", "interface"), [
        (LocalMode.BRIDGE_INTERFACE, "cbr0"),
        (LocalMode.INTERFACE_NAME_PREFIX, "veth"),
        (LocalMode.CLUSTER_CIDR, ""),
        (LocalMode.NODE_CIDR, ""),
    ])
    def test_interface_for_the_mode(self, mode: LocalMode, interface: str) -> None:
        """Only the interface the detect-local mode uses is handed on."""
        settings = ProxyConfig(detect_local_mode=mode, bridge_interface="cbr0",
                               interface_name_prefix="veth")
        assert interface == settings.node_config("n", []).local_interface

    def test_node_cidr_mode_uses_the_nodes_pod_cidrs(self) -> None:
        """NodeCIDR mode matches the Node's podCIDRs."""
        node = ProxyConfig(detect_local_mode=LocalMode.NODE_CIDR).node_config(
            "n", ["10.0.0.5"], ["10.244.3.0/24", "fd00:10:244:3::/64"])
        assert node.node_cidrs == ("10.244.3.0/24", "fd00:10:244:3::/64")
        match = render_config(node, IPFamily.IPv4).local_match()
        assert match is not None and match.text() == "ip saddr 10.244.3.0/24"

    @pytest.mark.parametrize(("addresses", "expected"), [
        pytest.param(("all",), (), id="all is every local address"),
        pytest.param(("primary", "all"), (), id="all wins"),
        pytest.param(("primary",), ("primary",), id="primary"),
        pytest.param(("10.0.0.0/8",), ("10.0.0.0/8",), id="CIDR"),
    ])
    def test_nodeport_addresses(self, addresses: tuple[str, ...],
                                expected: tuple[str, ...]) -> None:
        """`all` becomes the empty tuple, NodeConfig's "every local address"."""
        node = ProxyConfig(nodeport_addresses=addresses).node_config("n", ["10.0.0.5"])
        assert expected == node.nodeport_addresses

    @pytest.mark.parametrize(("bind", "node_ips", "expected"), [
        pytest.param("0.0.0.0", ["10.0.0.5", "10.0.0.6"], ("10.0.0.5", "10.0.0.6"),
                     id="unspecified bind address changes nothing"),
        pytest.param("10.0.0.6", ["10.0.0.5", "fd00::1"], ("10.0.0.6", "fd00::1"),
                     id="bind address replaces the node IP of its family"),
        pytest.param("fd00::9", ["10.0.0.5", "fd00::1"], ("fd00::9", "10.0.0.5"),
                     id="bind address of the other family leads"),
        pytest.param("fd00::9", ["10.0.0.5"], ("fd00::9", "10.0.0.5"),
                     id="bind address adds its family"),
    ])
    def test_bind_address_is_the_primary_ip(self, bind: str, node_ips: list[str],
                                            expected: tuple[str, ...]) -> None:
        """A specific bindAddress overrides the node IP of its family and makes that family
        the primary one; the other family keeps the Node's IP (kube-proxy's detectNodeIPs)."""
        assert expected == ProxyConfig(bind_address=bind).node_config("n", node_ips).node_ips

    def test_primary_nodeport_follows_bind_address(self) -> None:
        """With nodePortAddresses [primary], NodePorts listen on the bindAddress."""
        node = ProxyConfig(bind_address="10.0.0.6").node_config("n", ["10.0.0.5", "10.0.0.6"])
        assert render_config(node, IPFamily.IPv4).nodeport_ips == ("10.0.0.6",)


class TestNodeName:
    @pytest.mark.parametrize(("override", "hostname", "expected"), [
        pytest.param(None, "Worker-7", "worker-7", id="OS hostname lowercased"),
        pytest.param("Node-A ", "ignored", "node-a", id="override trimmed and lowercased"),
        pytest.param(None, " host\n", "host", id="OS hostname trimmed"),
    ])
    def test_node_name(self, override: str | None, hostname: str, expected: str) -> None:
        """The node name is kube-proxy's: override or hostname, trimmed, lowercased."""
        assert expected == ProxyConfig(hostname_override=override).node_name(lambda: hostname)

    def test_blank_name_is_an_error(self) -> None:
        """A blank name is refused rather than matching no Node."""
        with pytest.raises(ConfigError, match="empty hostname"):
            ProxyConfig(hostname_override="  ").node_name(lambda: "host")


class TestReferenceDoc:
    def test_doc_matches_the_code(self) -> None:
        """docs/configuration.md is reference_markdown()'s output (regenerate with
        `python -m pyproxy.config > docs/configuration.md`)."""
        assert config.reference_markdown() == DOC.read_text(encoding="utf-8")

    def test_doc_lists_every_field_and_flag(self) -> None:
        """Every file field and every flag has a row."""
        text = config.reference_markdown()
        for path in V1ALPHA1_FIELDS:
            assert f"| `{path}` |" in text
        parser = argparse.ArgumentParser()
        add_flags(parser)
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"`{option}`" in text

    def test_one_row_per_setting_in_the_order_of_proxyconfig(self) -> None:
        """The settings table describes every ProxyConfig setting once, in the class's order,
        and every file field and flag with a setting comes from its row."""
        settings = [f.name for f in dataclasses.fields(ProxyConfig)
                    if f.name not in ("kube_proxy_mode", "file_notes", "warnings",
                                      "unapplied_fields")]
        assert [s.attr for s in SETTINGS] == settings
        for row in SETTINGS:
            assert row.description and row.applied_by, row.attr
            assert [f.path for f in FIELDS if f.attr == row.attr] == list(row.paths)
            assert [f.name for f in FLAGS if f.attr == row.attr] == \
                ([row.flag] if row.flag else []) + list(row.kube_flags)

    def test_every_setting_is_documented(self) -> None:
        """Every ProxyConfig setting is reachable from the file or a flag."""
        reachable = ({s.attr for s in FIELDS} | {f.attr for f in FLAGS})
        settings = {f.name for f in dataclasses.fields(ProxyConfig)} - {
            "kube_proxy_mode", "file_notes", "warnings", "unapplied_fields"}
        assert settings <= reachable
