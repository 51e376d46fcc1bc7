"""The Helm chart, charts/pyproxy, with the real helm (v4.3.1, `make tools`; issue 39, point 1).

manifests/ and the chart cannot drift: `helm template` with the values' defaults (and the API
server's address, which has none) gives the very objects `kubectl kustomize manifests/` gives,
compared as parsed YAML (the configuration inside the ConfigMap too), but for what only a
chart has: its two labels on each object and the configuration's checksum on the pod template.
With the monitoring values on, it gives manifests/monitoring/'s too; with kubeadm=true, the
kubeadm variant's (manifests/kubeadm/). `helm lint --strict`
passes; the bootstrap trap (the API server reached through a Service address) is a chart
failure, the `kubernetes` Service's ClusterIP looked up on a real API server. What the chart
renders is accepted by the real API server (`kubectl apply --dry-run=server`).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.controlplane import ControlPlane, kubeconfig, write_kubeconfig
from testkit.fixtures import require_kubectl, require_tool, requires_netns

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pyproxy"
MANIFESTS = ROOT / "manifests"
NAMESPACE = "kube-system"
API = "192.0.2.10"  # the API server's address the renders are given (documentation's range)
# What only the chart has: the labels Helm's conventions add to each object's metadata, and
# the pod template's checksum of the ConfigMap (pyproxy reads it at start only).
CHART_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
CHECKSUM = "checksum/config"

Objects = dict[tuple[str, str], dict[str, Any]]


def helm(*args: str, kubeconfig_path: Path | None = None,
         home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real helm; its cache, configuration and data (and kubectl's cache) in HOME, a
    test's folder, never the user's."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HELM_")}
    if home is not None:
        env.update(HOME=str(home), HELM_CACHE_HOME=str(home / "cache"),
                   HELM_CONFIG_HOME=str(home / "config"), HELM_DATA_HOME=str(home / "data"))
    if kubeconfig_path is not None:
        env["KUBECONFIG"] = str(kubeconfig_path)
    return subprocess.run([str(require_tool("helm")), *args], capture_output=True, text=True,
                          timeout=180, check=False, env=env)


def by_kind_and_name(text: str) -> Objects:
    objects: Objects = {}
    for doc in yaml.safe_load_all(text):
        if doc is not None:
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, key
            objects[key] = doc
    return objects


def template(*sets: str, namespace: str = NAMESPACE) -> Objects:
    args = [arg for value in sets for arg in ("--set", value)]
    out = helm("template", "pyproxy", str(CHART), "--namespace", namespace, *args)
    assert out.returncode == 0, out.stderr
    return by_kind_and_name(out.stdout)


def template_error(*sets: str) -> str:
    out = helm("template", "pyproxy", str(CHART), "--namespace", NAMESPACE,
               *[arg for value in sets for arg in ("--set", value)])
    assert out.returncode != 0, "the chart rendered"
    return out.stderr


def kustomize(folder: Path) -> Objects:
    out = subprocess.run([str(require_kubectl()), "kustomize", str(folder)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return by_kind_and_name(out.stdout)


def as_manifests_have_it(objects: Objects) -> Objects:
    """The chart's objects without what only a chart has (checked to be there), and the
    ConfigMap's configuration parsed."""
    plain = copy.deepcopy(objects)
    for (kind, name), obj in plain.items():
        labels = obj["metadata"]["labels"]
        assert labels.pop("helm.sh/chart") == f"pyproxy-{chart()['version']}", (kind, name)
        assert labels.pop("app.kubernetes.io/managed-by") == "Helm", (kind, name)
        if kind == "DaemonSet" and ("ConfigMap", "pyproxy") in plain:
            template_meta = obj["spec"]["template"]["metadata"]
            assert len(template_meta.pop("annotations").pop(CHECKSUM)) == 64
    return parsed_config(plain)


def parsed_config(objects: Objects) -> Objects:
    plain = copy.deepcopy(objects)
    if ("ConfigMap", "pyproxy") in plain:
        data = plain[("ConfigMap", "pyproxy")]["data"]
        data["config.yaml"] = yaml.safe_load(data["config.yaml"])
    return plain


def manifests(api_server: str = API, **config: Any) -> Objects:
    """What `kubectl apply -k manifests/` applies, with the API server's address filled in
    and these configuration fields changed."""
    objects = parsed_config(kustomize(MANIFESTS))
    data = objects[("ConfigMap", "pyproxy")]["data"]
    assert data["apiServerHost"] == ""  # the placeholder
    data["apiServerHost"] = api_server
    data["config.yaml"].update(config)
    return objects


def chart() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "Chart.yaml").read_text()))


def daemonset(objects: Objects) -> dict[str, Any]:
    return objects[("DaemonSet", "pyproxy")]


def container(objects: Objects) -> dict[str, Any]:
    [the_container] = daemonset(objects)["spec"]["template"]["spec"]["containers"]
    return dict(the_container)


# -- offline: lint, and the objects against manifests/ ----------------------------------------


def test_helm_lint_strict() -> None:
    """Helm's own checks, as `ct lint` runs them, on the values as shipped and as installed
    (lint renders a template's `fail` as a note: the required address is tested below)."""
    monitoring = [f"apiServer.host={API}", "monitoring.serviceMonitor.enabled=true",
                  "monitoring.prometheusRule.enabled=true",
                  "config.metricsBindAddress=0.0.0.0:10249"]
    for sets in ([], [f"apiServer.host={API}"], monitoring, ["kubeadm=true"]):
        out = helm("lint", "--strict", str(CHART), *[a for v in sets for a in ("--set", v)])
        assert out.returncode == 0, out.stdout + out.stderr
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout
        assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_the_chart_renders_the_manifests() -> None:
    """manifests/ and the chart cannot drift: the same ServiceAccount, RBAC, ConfigMap and
    DaemonSet, field for field, with the values' defaults."""
    assert as_manifests_have_it(template(f"apiServer.host={API}")) == manifests()


def test_with_kubeadm_the_chart_renders_manifests_kubeadm() -> None:
    """kubeadm=true: the objects of `kubectl apply -f manifests/00-serviceaccount.yaml -f
    manifests/01-rbac.yaml -f manifests/kubeadm/`, kubeadm's ConfigMap mounted instead of one
    of the chart's, and no API server address asked for (kubeconfig.conf names it)."""
    expected = by_kind_and_name("---\n".join(
        path.read_text() for path in (MANIFESTS / "00-serviceaccount.yaml",
                                      MANIFESTS / "01-rbac.yaml",
                                      MANIFESTS / "kubeadm" / "03-daemonset.yaml")))
    rendered = template("kubeadm=true")
    assert ("ConfigMap", "pyproxy") not in rendered
    assert "annotations" not in daemonset(rendered)["spec"]["template"]["metadata"]
    assert as_manifests_have_it(rendered) == expected
    # what pyproxy is told: its other values still reach it
    canary = template("kubeadm=true", "canary=true", "extraArgs={-v=2}")
    assert container(canary)["args"] == ["run", "--config=/var/lib/kube-proxy/config.conf",
                                         "--hostname-override=$(NODE_NAME)", "-v=2"]


def test_kubeadm_outside_kube_system_is_refused() -> None:
    out = helm("template", "pyproxy", str(CHART), "--namespace", "pyproxy", "--set",
               "kubeadm=true")
    assert out.returncode != 0
    assert "install the release in kube-system, not pyproxy" in out.stderr


def test_with_monitoring_the_chart_renders_manifests_monitoring() -> None:
    rendered = template(f"apiServer.host={API}", "monitoring.serviceMonitor.enabled=true",
                        "monitoring.prometheusRule.enabled=true",
                        "config.metricsBindAddress=0.0.0.0:10249")
    expected = {**manifests(metricsBindAddress="0.0.0.0:10249"),
                **kustomize(MANIFESTS / "monitoring")}
    assert as_manifests_have_it(rendered) == expected
    # Each one alone.
    monitor = template(f"apiServer.host={API}", "monitoring.serviceMonitor.enabled=true",
                       "config.metricsBindAddress=0.0.0.0:10249")
    assert {kind for kind, _ in monitor} >= {"Service", "ServiceMonitor"}
    assert "PrometheusRule" not in {kind for kind, _ in monitor}
    rule = template(f"apiServer.host={API}", "monitoring.prometheusRule.enabled=true")
    assert {kind for kind, _ in rule} - {kind for kind, _ in manifests()} == {"PrometheusRule"}


def test_the_chart_carries_the_manifests_alert_rules() -> None:
    """The PrometheusRule promtool tests is manifests/monitoring/'s; the chart holds a copy of
    the file (a symbolic link would have every helm command log that it followed one)."""
    assert ((CHART / "files" / "prometheusrule.yaml").read_bytes()
            == (MANIFESTS / "monitoring" / "prometheusrule.yaml").read_bytes())


def test_the_chart_is_the_packages_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (chart()["version"], chart()["appVersion"]) == (version, version)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == version


@pytest.mark.parametrize("host, says", [
    pytest.param("", "apiServer.host is required", id="none given"),
    pytest.param("  ", "apiServer.host is required", id="blank"),
    pytest.param("kubernetes", "is a cluster DNS name", id="kubernetes"),
    pytest.param("kubernetes.default", "is a cluster DNS name", id="kubernetes.default"),
    pytest.param("kubernetes.default.svc", "is a cluster DNS name", id="FQDN without domain"),
    pytest.param("Kubernetes.Default.svc.cluster.local.", "is a cluster DNS name",
                 id="FQDN, capitals, trailing dot"),
])
def test_the_bootstrap_trap_is_a_chart_failure(host: str, says: str) -> None:
    """Without the API server's real address, or with one only a Service proxy's rules reach,
    nothing renders, and the message says what to set and where it is explained."""
    error = template_error(f"apiServer.host={host}")
    assert says in error
    assert "set apiServer.host to the API server's real address" in error
    assert "docs/deploying.md, step 2" in error


def test_names_that_are_no_service_address_are_taken() -> None:
    for host in ("api.example.com", "10.0.0.1", "2001:db8::1", "svc.example.org"):
        data = template(f"apiServer.host={host}")[("ConfigMap", "pyproxy")]["data"]
        assert data["apiServerHost"] == host


def test_a_mistyped_value_is_refused() -> None:
    """values.schema.json: a misspelt key (which would otherwise be ignored) or a wrong type
    fails before anything renders."""
    assert "additional properties 'apiserver' not allowed" in template_error(
        f"apiserver.host={API}")
    assert "/apiServer/port" in template_error(f"apiServer.host={API}", "apiServer.port=https")


def test_a_service_monitor_on_loopback_metrics_is_refused() -> None:
    """The shipped configuration serves /metrics on the node's loopback: a ServiceMonitor
    would scrape nothing, so the chart says what to set instead."""
    error = template_error(f"apiServer.host={API}", "monitoring.serviceMonitor.enabled=true")
    assert "set config.metricsBindAddress to 0.0.0.0:10249" in error


def test_the_values_reach_the_objects() -> None:
    rendered = template(
        f"apiServer.host={API}", "apiServer.port=443", "image.repository=registry.example/pp",
        "image.tag=1.2.3", "canary=true", "config.healthzBindAddress=0.0.0.0:10266",
        "config.clusterCIDR=10.32.0.0/12", "extraArgs={-v=2}",
        "resources.limits.memory=2Gi", "tolerations=null", "maxUnavailable=2")
    ds, the_container = daemonset(rendered), container(rendered)
    assert the_container["image"] == "registry.example/pp:1.2.3"
    assert the_container["args"][-1] == "-v=2"
    assert the_container["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                          "limits": {"memory": "2Gi"}}
    # The probes follow the configuration's healthz port.
    assert the_container["ports"][0]["containerPort"] == 10266
    assert the_container["livenessProbe"]["httpGet"]["port"] == 10266
    assert the_container["readinessProbe"]["httpGet"]["port"] == 10266
    pod = ds["spec"]["template"]["spec"]
    # The canary label (docs/deploying.md, "A canary node first") beside the OS selector.
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "pyproxy.io/run-pyproxy": "true"}
    assert "tolerations" not in pod
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 2
    data = rendered[("ConfigMap", "pyproxy")]["data"]
    assert data["apiServerPort"] == "443"
    config = yaml.safe_load(data["config.yaml"])
    assert (config["apiVersion"], config["kind"]) == ("kubeproxy.config.k8s.io/v1alpha1",
                                                      "KubeProxyConfiguration")
    # A field given merges with the defaults.
    assert config["clusterCIDR"] == "10.32.0.0/12"
    assert config["nftables"]["syncPeriod"] == "30s"
    digest = "sha256:" + "ab" * 32
    pinned = container(template(f"apiServer.host={API}", f"image.digest={digest}"))
    assert pinned["image"] == f"ghcr.io/pyproxy/pyproxy@{digest}"


def test_a_configuration_change_rolls_the_pods_and_an_image_change_only_the_image() -> None:
    """The pod template carries the ConfigMap's checksum: pyproxy reads its configuration at
    start, so `helm upgrade` with a new configuration must replace the pods."""
    def checksum(*sets: str) -> str:
        pod = daemonset(template(f"apiServer.host={API}", *sets))["spec"]["template"]
        return str(pod["metadata"]["annotations"][CHECKSUM])

    shipped = checksum()
    assert checksum("config.nftables.syncPeriod=20s") != shipped
    assert checksum(f"apiServer.host={API}1") != shipped
    assert checksum("image.tag=9.9.9") == shipped


def test_the_chart_config_is_one_pyproxy_loads(tmp_path: Path) -> None:
    """The rendered config.yaml, as the pods read it: `pyproxy config check` accepts it."""
    data = template(f"apiServer.host={API}")[("ConfigMap", "pyproxy")]["data"]
    (tmp_path / "config.yaml").write_text(data["config.yaml"])
    out = subprocess.run([sys.executable, "-c",
                          "import sys; from pyproxy.cli import main; sys.exit(main())",
                          "config", "check", "--config", str(tmp_path / "config.yaml")],
                         capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


# -- the real API server -------------------------------------------------------------------------


def admin_kubeconfig(plane: ControlPlane, folder: Path) -> Path:
    return write_kubeconfig(folder / "admin.kubeconfig",
                            kubeconfig(plane.url, plane.pki.ca, cert=plane.pki.admin,
                                       key=plane.pki.admin_key))


@pytest.mark.netns
@pytest.mark.k8s
@requires_netns
def test_the_api_server_accepts_what_the_chart_renders(control_plane: ControlPlane,
                                                       tmp_path: Path) -> None:
    """kubeconform's job done by the real thing: every object the chart renders (the
    Prometheus Operator's: the next test, with its CRDs) passes the API server's validation
    and admission without being stored, with other values too, and kubeadm's variant."""
    config = admin_kubeconfig(control_plane, tmp_path)
    every = ["clusterrole.rbac.authorization.k8s.io/pyproxy",
             "clusterrolebinding.rbac.authorization.k8s.io/pyproxy", "daemonset.apps/pyproxy",
             "serviceaccount/pyproxy"]
    for sets, names in (
            ([f"apiServer.host={API}"], [*every, "configmap/pyproxy"]),
            ([f"apiServer.host={API}", "canary=true", "image.digest=sha256:" + "0" * 64,
              "config.healthzBindAddress=0.0.0.0:10266", "tolerations=null"],
             [*every, "configmap/pyproxy"]),
            (["kubeadm=true"], every)):
        out = helm("template", "pyproxy", str(CHART), "--namespace", NAMESPACE,
                   *[arg for value in sets for arg in ("--set", value)])
        assert out.returncode == 0, out.stderr
        applied = subprocess.run(
            [str(require_kubectl()), f"--kubeconfig={config}", "apply", "--dry-run=server",
             "-o", "name", "-f", "-"], input=out.stdout, capture_output=True, text=True,
            timeout=120, check=False)
        assert applied.returncode == 0, applied.stderr
        assert sorted(applied.stdout.split()) == sorted(names)


@pytest.mark.netns
@pytest.mark.k8s
@requires_netns
def test_the_api_server_validates_the_monitoring_objects_by_the_operators_crds(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    """The ServiceMonitor and the PrometheusRule, the chart's and manifests/monitoring/'s,
    against the Prometheus Operator's own CRDs (v0.85.0's, `make test-tools`), installed on
    the real API server for this test and removed after it: their schemas accept both, and
    refuse what they should (an interval that is no duration)."""
    config = admin_kubeconfig(control_plane, tmp_path)
    crds = require_tool("operator-crds")

    def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(require_kubectl()), f"--kubeconfig={config}", *args],
                              input=stdin, capture_output=True, text=True, timeout=120,
                              check=False)

    def dry_run(text: str) -> subprocess.CompletedProcess[str]:
        return kubectl("apply", "--dry-run=server", "-o", "name", "-f", "-", stdin=text)

    installed = kubectl("apply", "--server-side", "-f", str(crds))
    try:
        assert installed.returncode == 0, installed.stderr
        established = kubectl("wait", "--for=condition=Established", "--timeout=60s",
                              "crd/servicemonitors.monitoring.coreos.com",
                              "crd/prometheusrules.monitoring.coreos.com")
        assert established.returncode == 0, established.stderr
        out = helm("template", "pyproxy", str(CHART), "--namespace", NAMESPACE,
                   "--set", f"apiServer.host={API}",
                   "--set", "monitoring.serviceMonitor.enabled=true",
                   "--set", "monitoring.prometheusRule.enabled=true",
                   "--set", "config.metricsBindAddress=0.0.0.0:10249")
        assert out.returncode == 0, out.stderr
        monitoring = {"servicemonitor.monitoring.coreos.com/pyproxy",
                      "prometheusrule.monitoring.coreos.com/pyproxy"}
        chart_applied = dry_run(out.stdout)
        assert chart_applied.returncode == 0, chart_applied.stderr
        assert monitoring <= set(chart_applied.stdout.split())
        kustomized = subprocess.run([str(require_kubectl()), "kustomize",
                                     str(MANIFESTS / "monitoring")], capture_output=True,
                                    text=True, timeout=60, check=True).stdout
        manifests_applied = dry_run(kustomized)
        assert manifests_applied.returncode == 0, manifests_applied.stderr
        assert monitoring <= set(manifests_applied.stdout.split())
        broken = dry_run(kustomized.replace("interval: 30s", "interval: half a minute"))
        assert broken.returncode != 0 and "interval" in broken.stderr, broken.stderr
    finally:
        kubectl("delete", "--wait=false", "-f", str(crds))


@pytest.mark.netns
@pytest.mark.k8s
@requires_netns
def test_the_kubernetes_services_cluster_ip_is_refused_by_install(control_plane: ControlPlane,
                                                                   tmp_path: Path) -> None:
    """The trap's commonest form, KUBERNETES_SERVICE_HOST copied from a pod: `helm install`
    looks the `kubernetes` Service up on the cluster and refuses its ClusterIP (a dry run
    against the server, which stores nothing)."""
    config = admin_kubeconfig(control_plane, tmp_path)
    from kubernetes import client

    cluster_ip = client.CoreV1Api(control_plane.admin_client()).read_namespaced_service(
        "kubernetes", "default").spec.cluster_ip
    refused = helm("install", "pyproxy", str(CHART), "--namespace", NAMESPACE,
                   "--dry-run=server", "--set", f"apiServer.host={cluster_ip}",
                   kubeconfig_path=config, home=tmp_path)
    assert refused.returncode != 0
    assert f"apiServer.host {cluster_ip} is the ClusterIP of the kubernetes Service" in (
        refused.stderr)
    taken = helm("install", "pyproxy", str(CHART), "--namespace", NAMESPACE,
                 "--dry-run=server", "--set", f"apiServer.host={API}",
                 kubeconfig_path=config, home=tmp_path)
    assert taken.returncode == 0, taken.stderr
