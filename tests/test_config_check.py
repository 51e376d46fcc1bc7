"""`pyproxy config check`, `pyproxy config view` and kube-proxy's `--write-config-to`: the
configuration `pyproxy run` would use, checked and shown without running it (issue 27, 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from pyproxy.cli import build_parser, main
from pyproxy.config import ConfigError, ProxyConfig, apply_flags, load_config, load_config_file
from pyproxy.config.flags import FLAGS
from pyproxy.config.view import effective_configuration
from pyproxy.kernel.host import MIN_KERNEL

DATA = Path(__file__).resolve().parent / "data"
HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    saved = structlog.get_config()
    yield None
    structlog.configure(**saved)


def kubeadm_config_conf(tmp_path: Path) -> Path:
    """config.conf of the ConfigMap kubeadm v1.37.2 writes, as kube-proxy's pod mounts it."""
    configmap = yaml.safe_load((DATA / "kubeadm-kube-proxy-configmap.yaml").read_text())
    path = tmp_path / "config.conf"
    path.write_text(configmap["data"]["config.conf"])
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def written(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "kube-proxy.yaml"
    path.write_text(HEADER + body)
    return path


class TestCheck:
    def test_kubeadm_config_conf_is_accepted(self, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
        """kubeadm's config.conf checks out, with the notes `run` would log, and, before the
        switch, what differs from the kube-proxy iptables mode it names: never a plain "ok"
        after a change of behaviour."""
        path = kubeadm_config_conf(tmp_path)
        code, out, _ = cli(capsys, "config", "check", f"--config={path}",
                           "--hostname-override=node-a")
        assert code == 0, out
        assert out.splitlines()[-1] == (
            f"{path}: pyproxy run would start; 1 change(s) from kube-proxy's iptables mode: "
            f"read them before the switch")
        assert "note: mode is iptables: pyproxy runs nftables" in out
        assert ("note: nodePortAddresses is unset: NodePorts are served as kube-proxy's "
                "iptables mode served them, on every local address and 127.0.0.1") in out
        (change,) = [line for line in out.splitlines() if line.startswith("change: ")]
        assert "UDP and SCTP ones are rejected" in change
        # The one setting for nftables mode's NodePorts: no change left, a plain "ok".
        code, out, _ = cli(capsys, "config", "check", f"--config={path}",
                           "--nodeport-addresses=primary")
        assert out.splitlines()[-1] == f"{path}: ok" and "change:" not in out
        assert "error:" not in out

    def test_every_problem_with_its_setting_and_file(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """All problems of the file and of the flags at once, each naming its field or flag
        and the file; exit code 1."""
        path = written(tmp_path, "mode: ipvs\nclusterCIDR: 10.244.0.0\n"
                                 "conntrack: {min: -1}\noomScoreAdj: 2000\n")
        code, out, _ = cli(capsys, "config", "check", f"--config={path}",
                           "--min-sync-period=soon", "--detect-local-mode=Bridge")
        assert code == 1
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert errors == [
            f"error: {path}: mode: pyproxy only implements nftables mode, got 'ipvs' "
            "(use nftables; iptables or empty run nftables too)",
            f"error: {path}: clusterCIDR: '10.244.0.0' is not a CIDR (e.g. 10.244.0.0/16)",
            f"error: {path}: conntrack.min: must be within 0..2147483647, got -1",
            f"error: {path}: oomScoreAdj: must be within -1000..1000, got 2000",
            "error: --detect-local-mode: expected one of ClusterCIDR, NodeCIDR, "
            "BridgeInterface, InterfaceNamePrefix, got 'Bridge'",
            "error: --min-sync-period: invalid duration 'soon'; expected a duration such as "
            "30s, 1m0s, 500ms or 2h30m",
        ]
        assert out.splitlines()[-1] == (f"{path}: 6 problem(s): pyproxy run would refuse "
                                        "to start")

    def test_no_file_checks_the_flags(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Without --config the defaults and the flags are checked."""
        code, out, _ = cli(capsys, "config", "check", "--detect-local-mode=BridgeInterface")
        assert code == 1
        assert ("error: detectLocalMode is BridgeInterface but detectLocal.bridgeInterface "
                "(--pod-bridge-interface) is empty") in out
        code, out, _ = cli(capsys, "config", "check", "--cluster-cidr=10.244.0.0/16")
        assert (code, out.splitlines()[-1]) == (0, "the defaults and flags: ok")

    def test_missing_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = cli(capsys, "config", "check", f"--config={tmp_path}/nope.yaml")
        assert code == 1
        assert f"error: --config {tmp_path}/nope.yaml: No such file or directory" in out

    def test_unknown_flag_is_a_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            main(["config", "check", "--no-such-flag"])
        assert exited.value.code == 2

    def test_a_whole_configmap_gets_a_hint(self, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
        """`kubectl get cm kube-proxy -o yaml` given as --config: use its config.conf."""
        path = DATA / "kubeadm-kube-proxy-configmap.yaml"
        code, out, _ = cli(capsys, "config", "check", f"--config={path}")
        assert code == 1
        assert (f"error: {path}: kind: this is a ConfigMap, not a KubeProxyConfiguration: give "
                "its config.conf key as the file (as kube-proxy's pod mounts it), e.g. kubectl "
                "-n kube-system get cm kube-proxy -o jsonpath='{.data.config\\.conf}' > "
                "config.conf") in out


    @pytest.mark.parametrize(("body", "where"), [
        pytest.param("mode: " + "[" * 5000 + "]" * 5000 + "\n", " at line 3", id="flow"),
        pytest.param("nftables:\n" + "".join(f"{' ' * i}k:\n" for i in range(1, 1000)),
                     " at line 102", id="block, 1,000 deep (5,000 is beyond the size limit)"),
        pytest.param("mode:\n" + "- " * 5000 + "x\n", " at line 4", id="compact sequences"),
        pytest.param("mode: &m nftables\nx: " + "[" * 5000 + "]" * 5000 + "\n", "",
                     id="with an anchor (PyYAML's own path)"),
    ])
    def test_5000_deep(self, tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str,
                       where: str) -> None:
        """YAML nested 5,000 deep is one error naming the file and the limit, exit code 1
        (issue 35: it was a RecursionError traceback)."""
        path = written(tmp_path, body)
        code, out, _ = cli(capsys, "config", "check", f"--config={path}")
        assert code == 1
        assert f"error: {path}: nested deeper than 100 levels (the limit){where}" in out

    def test_a_huge_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A file beyond a ConfigMap's 1 MiB is refused by its size, naming the limit."""
        path = written(tmp_path, "")
        with open(path, "ab") as fh:
            fh.truncate(4 << 30)  # a hole: no room taken
        code, out, _ = cli(capsys, "config", "check", f"--config={path}")
        assert code == 1
        assert (f"error: --config {path}: larger than 1 MiB, the limit for a configuration "
                "file") in out


class TestWarnings:
    """What kube-proxy only warns about (its lenient decoding) is a warning here too."""

    @pytest.mark.parametrize(("body", "path"), [
        pytest.param("nftables: {skipKernelVersionCheck: true}",
                     "nftables.skipKernelVersionCheck", id="skipKernelVersionCheck"),
        pytest.param("nftables: {minSyncPeriod2: 1s}", "nftables.minSyncPeriod2",
                     id="unknown nested field"),
        pytest.param("masqueradeAll: true", "masqueradeAll", id="unknown top-level field"),
        pytest.param("logging: {options: {xml: {}}}", "logging.options.xml",
                     id="unknown deep field"),
        pytest.param("Mode: nftables", "Mode", id="field names are case-sensitive"),
        pytest.param("1: x", "1", id="non-string key"),
    ])
    def test_unknown_fields_warn_and_start(self, body: str, path: str) -> None:
        loaded = load_config(HEADER + body + "\n")
        assert dataclasses.replace(loaded, warnings=()) == load_config(HEADER)
        [warning] = loaded.unapplied  # logged as a warning at start-up
        assert warning.startswith(f"{path}: unknown field, ignored (as kube-proxy does, with "
                                  "a warning): ")

    def test_skip_kernel_version_check_says_what_kube_proxy_reads(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        path = written(tmp_path, "mode: nftables\nnftables: {skipKernelVersionCheck: true}\n")
        code, out, _ = cli(capsys, "config", "check", f"--config={path}")
        floor = ".".join(map(str, MIN_KERNEL))  # the kernel pyproxy warns below (run.py)
        assert code == 0
        assert (f"warning: {path}: nftables.skipKernelVersionCheck: unknown field, ignored (as "
                "kube-proxy does, with a warning): kube-proxy's kernel check is skipped with the "
                "environment variable KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK, not a "
                f"field; pyproxy needs neither: below kernel {floor} it warns "
                "(kernel_below_supported) and runs") in out
        assert out.splitlines()[-1] == f"{path}: ok (1 warning(s))"

    def test_warnings_with_the_errors(self, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
        """A problem does not hide the warnings (issue 35: they appeared only once the file
        was fixed): the file's unknown fields and the flags accepted but not applied, beside
        the file's errors, counted in the last line."""
        path = written(tmp_path, "mode: ipvs\nmasqueradeAll: true\n")
        code, out, _ = cli(capsys, "config", "check", f"--config={path}", "--profiling")
        assert code == 1
        assert out.splitlines() == [
            f"error: {path}: mode: pyproxy only implements nftables mode, got 'ipvs' (use "
            "nftables; iptables or empty run nftables too)",
            f"warning: {path}: masqueradeAll: unknown field, ignored (as kube-proxy does, with "
            "a warning): not a v1alpha1 field; a typo keeps the default",
            "warning: --profiling: accepted, not applied (pyproxy serves no pprof)",
            f"{path}: 1 problem(s), 2 warning(s): pyproxy run would refuse to start"]

    def test_the_files_warnings_with_a_flags_error(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A good file's warnings are reported beside a flag's error."""
        path = written(tmp_path, "masqueradeAll: true\n")
        code, out, _ = cli(capsys, "config", "check", f"--config={path}",
                           "--min-sync-period=soon")
        assert code == 1
        assert [line.split(":")[0] for line in out.splitlines()] == ["error", "warning", str(path)]
        assert f"warning: {path}: masqueradeAll: unknown field" in out

    def test_a_wrong_value_is_still_an_error(self) -> None:
        with pytest.raises(ConfigError, match=r"^nftables\.syncPeriod: expected"):
            load_config(HEADER + "nftables: {syncPeriod: 5, skipKernelVersionCheck: true}\n")


def run_flags(*argv: str) -> object:
    return build_parser().parse_args(["run", *argv])


class TestView:
    def test_kubeadm_with_flags_reads_back(self, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
        """The YAML `config view` prints, given as --config with the flags it lists, gives
        the same settings."""
        path = kubeadm_config_conf(tmp_path)
        flags = ["--hostname-override=node-a", "--iptables-min-sync-period=0",
                 "--full-sync-period=2h", "--healthz-bind-address=", "--masquerade-all",
                 "--feature-gates=MultiCIDRServiceAllocator=false"]
        code, out, _ = cli(capsys, "config", "view", f"--config={path}", *flags)
        assert code == 0
        document = yaml.safe_load(out)
        assert document["mode"] == "nftables"
        assert document["nftables"]["masqueradeAll"] is True
        listed = [line.strip("# ") for line in out.splitlines() if line.startswith("#   ")]
        assert listed == ["--healthz-bind-address=", "--min-sync-period=0s",
                          "--full-sync-period=2h0m0s"]
        view = tmp_path / "view.yaml"
        view.write_text(out)
        original = apply_flags(load_config_file(str(path)), run_flags(*flags))
        again = apply_flags(load_config_file(str(view)), run_flags(*listed))
        # The view says mode: nftables, with iptables mode's NodePort addresses spelled out.
        assert document["nodePortAddresses"] == ["all", "127.0.0.0/8"]
        assert dataclasses.replace(again, file_notes=(), warnings=()) == \
            dataclasses.replace(original, file_notes=(), warnings=(), kube_proxy_mode="nftables")

    @pytest.mark.parametrize("config", [
        pytest.param(ProxyConfig(), id="defaults"),
        pytest.param(ProxyConfig(bind_address="fd00::1", healthz_bind_address="[::]:10256",
                                 metrics_bind_address="[::1]:10249",
                                 cluster_cidrs=("10.0.0.0/8", "fd00::/48"),
                                 nodeport_addresses=("all",), conntrack_max_per_core=0,
                                 snapshot="/x.yaml", qps=0.5, verbosity=4),
                     id="IPv6 and more"),
    ])
    def test_round_trip(self, config: ProxyConfig) -> None:
        effective = effective_configuration(config)
        again = apply_flags(load_config(yaml.safe_dump(dict(effective.document))),
                            run_flags(*effective.flags))
        assert dataclasses.replace(again, file_notes=()) == config

    # kube-proxy v1.37's flags accepted, not applied, and the field each sets in kube-proxy's
    # configuration (cmd/kube-proxy/app/options.go; logging's through logsapi.AddFlags), which
    # its --write-config-to writes. --ipvs-sync-period and --ipvs-min-sync-period set nothing
    # outside ipvs mode, and the view's mode is nftables.
    UNAPPLIED_FLAGS = {
        "--profiling": ("enableProfiling", True),
        "--show-hidden-metrics-for-version=1.36": ("showHiddenMetricsForVersion", "1.36"),
        "--iptables-localhost-nodeports=false": ("iptables.localhostNodePorts", False),
        "--ipvs-scheduler=rr": ("ipvs.scheduler", "rr"),
        "--ipvs-exclude-cidrs=10.0.0.0/8,10.1.0.0/16": ("ipvs.excludeCIDRs",
                                                         ["10.0.0.0/8", "10.1.0.0/16"]),
        "--ipvs-strict-arp": ("ipvs.strictARP", True),
        "--ipvs-tcp-timeout=7s": ("ipvs.tcpTimeout", "7s"),
        "--ipvs-tcpfin-timeout=8s": ("ipvs.tcpFinTimeout", "8s"),
        "--ipvs-udp-timeout=9s": ("ipvs.udpTimeout", "9s"),
        "--log-flush-frequency=7s": ("logging.flushFrequency", "7s"),
        "--log-json-info-buffer-size=64Ki": ("logging.options.json.infoBufferSize", "64Ki"),
        "--log-json-split-stream": ("logging.options.json.splitStream", True),
        "--log-text-info-buffer-size=1Mi": ("logging.options.text.infoBufferSize", "1Mi"),
        "--log-text-split-stream": ("logging.options.text.splitStream", True),
        "--vmodule=foo=2": ("logging.vmodule", [{"filePattern": "foo", "verbosity": 2}]),
    }

    @pytest.mark.parametrize("flag", sorted(UNAPPLIED_FLAGS))
    def test_a_flag_accepted_not_applied_is_in_the_view(
            self, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
        """As kube-proxy's --write-config-to, the view carries the field the flag sets, and
        reads back to it."""
        path, value = self.UNAPPLIED_FLAGS[flag]
        code, out, _ = cli(capsys, "config", "view", flag)
        assert code == 0
        node: Any = yaml.safe_load(out)
        for name in path.split("."):
            node = node[name]
        assert node == value
        assert dict(load_config(out).unapplied_fields) == {path: value}

    def test_every_unapplied_flag_with_a_field_is_listed(self) -> None:
        with_field = {f.name for f in FLAGS if f.not_applied and f.field}
        assert with_field == {f.lstrip("-").split("=")[0] for f in self.UNAPPLIED_FLAGS}
        assert {f.name for f in FLAGS if f.not_applied and not f.field} == {
            "ipvs-sync-period", "ipvs-min-sync-period"}

    def test_unapplied_fields_of_the_file_stay(self, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
        """A file's enableProfiling: true is in its view; a flag overrides it."""
        path = written(tmp_path, "mode: nftables\nenableProfiling: true\n"
                                 "ipvs: {scheduler: lc, syncPeriod: 0s}\nportRange: ''\n")
        code, out, _ = cli(capsys, "config", "view", f"--config={path}")
        assert code == 0
        document = yaml.safe_load(out)
        assert (document["enableProfiling"], document["ipvs"]) == (True, {"scheduler": "lc"})
        assert "portRange" not in document
        code, out, _ = cli(capsys, "config", "view", f"--config={path}", "--profiling=false")
        assert yaml.safe_load(out)["enableProfiling"] is False

    def test_problems_exit_1(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, err = cli(capsys, "config", "view", "--oom-score-adj=5000")
        assert (code, out) == (1, "")
        assert err == "pyproxy: --oom-score-adj: must be within -1000..1000, got 5000\n"


class TestWriteConfigTo:
    def test_writes_the_view_and_exits(self, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
        """kube-proxy's `--write-config-to`: the effective configuration, and nothing runs
        (no API server is asked for: none is configured here)."""
        path = kubeadm_config_conf(tmp_path)
        target = tmp_path / "out.yaml"
        code, _, _ = cli(capsys, "run", f"--config={path}", "--hostname-override=node-a",
                         f"--write-config-to={target}")
        assert code == 0
        code, view, _ = cli(capsys, "config", "view", f"--config={path}",
                            "--hostname-override=node-a")
        assert target.read_text() == view
        assert load_config_file(str(target)).hostname_override == "node-a"
        code, _, _ = cli(capsys, "run", f"--config={path}", "--profiling",
                         f"--write-config-to={target}")
        assert code == 0
        assert yaml.safe_load(target.read_text())["enableProfiling"] is True

    def test_unwritable(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = cli(capsys, "run", f"--write-config-to={tmp_path}/no/such/dir/x.yaml")
        assert code == 2
        assert "--write-config-to" in err and "No such file or directory" in err


class TestConnectionNote:
    """config check also says what run would find of its API connection, as a note: the
    files often exist only on the node (kubeadm's kubeconfig.conf, the pod's token)."""

    def test_kubeadm_kubeconfig_missing_here(self, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
        path = kubeadm_config_conf(tmp_path)
        code, out, _ = cli(capsys, "config", "check", f"--config={path}")
        assert code == 0
        assert ("note: API connection: not usable here (kubeconfig "
                "/var/lib/kube-proxy/kubeconfig.conf (clientConnection.kubeconfig, "
                "--kubeconfig): No such file or directory)") in out

    def test_usable_kubeconfig(self, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
        token = tmp_path / "token"
        token.write_text("abc\n")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "k", "cluster": {"server": "http://192.0.2.10:8080"}}],
            "users": [{"name": "u", "user": {"tokenFile": str(token)}}],
            "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
        code, out, _ = cli(capsys, "config", "check", f"--kubeconfig={kubeconfig}")
        assert code == 0
        assert f"note: API connection: http://192.0.2.10:8080 ({kubeconfig}): usable" in out
