"""What ships: manifests/, the Containerfile and requirements.lock, systemd/, and the Makefile's
`image`, `install` and `uninstall` targets. Offline and fast.

Manifests are validated with the installed `kubernetes` client's models (pydantic v2,
`extra="forbid"`, strict types), plus a check that every key is the API's wire name (the models
also accept their snake_case attribute names, which a real API server would drop). The
ClusterRole is compared with the API calls the daemon really makes: an ApiSource (and every
Resource in pyproxy/cluster/resources.py) runs against a recording API client, so a new watch
fails here until the role follows.

`python tests/test_shipping.py --write-lock` (`make lock`) rewrites requirements.lock from the
virtualenv, with hashes (pip-tools, and the package index).
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
SYSTEMD = ROOT / "systemd"
CONTAINERFILE = ROOT / "Containerfile"
LOCK = ROOT / "requirements.lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
IMAGE = f"ghcr.io/pyproxy/pyproxy:{VERSION}"
PYPROXY = str(Path(sys.executable).parent / "pyproxy")
NAMESPACE = "kube-system"

client = pytest.importorskip("kubernetes.client")
from pydantic import BaseModel, ValidationError  # noqa: E402  (after the importorskip)

# ---------------------------------------------------------------------------------------------
# Manifests: loading and schema validation

MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("v1", "ServiceAccount"): client.V1ServiceAccount,
    ("v1", "ConfigMap"): client.V1ConfigMap,
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): client.V1ClusterRole,
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): client.V1ClusterRoleBinding,
    ("apps/v1", "DaemonSet"): client.V1DaemonSet,
}


class InvalidManifest(ValueError):
    pass


def _wire_names(model: Any, raw: Any, path: str) -> None:
    """Every key of `raw` must be the wire name (attribute_map) of a field of `model`; the
    models also accept snake_case attribute names, which an API server would not know."""
    if isinstance(model, BaseModel):
        if not isinstance(raw, dict):
            raise InvalidManifest(f"{path}: expected an object")
        by_wire = {wire: attr for attr, wire in type(model).attribute_map.items()}
        for key, value in raw.items():
            if key not in by_wire:
                raise InvalidManifest(f"{path}.{key}: not a field of {type(model).__name__}")
            _wire_names(getattr(model, by_wire[key]), value, f"{path}.{key}")
    elif isinstance(model, list) and isinstance(raw, list):
        for i, (item, raw_item) in enumerate(zip(model, raw, strict=True)):
            _wire_names(item, raw_item, f"{path}[{i}]")
    elif isinstance(model, dict) and isinstance(raw, dict):
        for key, item in model.items():
            _wire_names(item, raw[key], f"{path}.{key}")


def validate(doc: Any) -> BaseModel:
    """The document as the client's model; InvalidManifest/ValidationError when the API server
    would reject it or silently drop part of it."""
    if not isinstance(doc, dict):
        raise InvalidManifest(f"expected an object, got {type(doc).__name__}")
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in MODELS:
        raise InvalidManifest(f"unexpected apiVersion/kind {key}")
    model = MODELS[key].model_validate(doc)  # type: ignore[index]
    _wire_names(model, doc, key[1])
    meta = doc.get("metadata") or {}
    if not meta.get("name"):
        raise InvalidManifest(f"{key[1]}: metadata.name is required")
    for where, labels in (("metadata.labels", meta.get("labels") or {}),):
        for label in labels:
            if not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
                                label):
                raise InvalidManifest(f"{key[1]}: {where}: bad label key {label!r}")
    return model


def manifest_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    """The documents `kubectl apply -k manifests/` applies (tests/test_kustomize.py checks
    that its kustomization lists every other file of the folder)."""
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        path = MANIFESTS / name
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path.name, doc


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    """kind → the (only) document of that kind."""
    found: dict[str, dict[str, Any]] = {}
    for name, doc in manifest_documents():
        kind = doc["kind"]
        assert kind not in found, f"{name}: a second {kind}"
        found[kind] = doc
    return found


def test_every_manifest_is_valid() -> None:
    docs = list(manifest_documents())
    assert {doc["kind"] for _, doc in docs} == {kind for _, kind in MODELS}
    for name, doc in docs:
        try:
            validate(doc)
        except (InvalidManifest, ValidationError) as err:
            pytest.fail(f"{name}: {err}")
        namespaced = doc["kind"] in ("ServiceAccount", "ConfigMap", "DaemonSet")
        assert doc["metadata"].get("namespace") == (NAMESPACE if namespaced else None), name


def _daemonset() -> dict[str, Any]:
    return next(doc for _, doc in manifest_documents() if doc["kind"] == "DaemonSet")


def _container(ds: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = ds["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _spoil(doc: dict[str, Any], how: str) -> dict[str, Any]:
    bad = copy.deepcopy(doc)
    pod = bad["spec"]["template"]["spec"]
    container = pod["containers"][0]
    if how == "misspelled field":
        pod["hostNetwrok"] = pod.pop("hostNetwork")
    elif how == "misspelled nested field":
        container["livenessProbe"]["httpGet"]["paht"] = "/livez"
    elif how == "snake_case field":
        pod["host_network"] = pod.pop("hostNetwork")
    elif how == "wrong type":
        pod["hostNetwork"] = "yes"
    elif how == "wrong type in a list":
        container["ports"][0]["containerPort"] = "10256"
    elif how == "missing required field":
        del bad["spec"]["selector"]
    elif how == "unknown kind":
        bad["kind"] = "DeamonSet"
    return bad


@pytest.mark.parametrize("how", [
    "misspelled field", "misspelled nested field", "snake_case field", "wrong type",
    "wrong type in a list", "missing required field", "unknown kind"])
def test_validation_rejects_a_broken_manifest(how: str) -> None:
    ds = _daemonset()
    validate(ds)
    with pytest.raises((InvalidManifest, ValidationError)):
        validate(_spoil(ds, how))


# ---------------------------------------------------------------------------------------------
# RBAC: exactly what the daemon's API calls need




class _FakeHTTPResponse:
    def __init__(self, data: bytes, stop: threading.Event | None) -> None:
        self.status = 200
        self.reason = "OK"
        self.headers: dict[str, str] = {}
        self.data = data
        self._stop = stop

    def stream(self, amt: int = 0, decode_content: bool = True) -> Iterator[bytes]:
        assert self._stop is not None
        self._stop.wait(5)  # a watch that stays open, silent, until the test is done
        return iter(())

    def close(self) -> None:  # a watch ended early is closed, not drained (watch.py)
        pass

    def release_conn(self) -> None:
        pass


class _Recorded:
    def __init__(self, response: _FakeHTTPResponse) -> None:
        self.status = 200
        self.response = response


class RecordingApiClient(client.ApiClient):  # type: ignore[misc]
    """Answers every request with an empty list (or a silent watch) and records it."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(client.Configuration())
        self.stop = stop
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None,
                 post_params: Any = None, _request_timeout: Any = None) -> _Recorded:
        with self.lock:
            self.requests.append((method, url))
        if method == "GET" and "watch=true" in url:
            return _Recorded(_FakeHTTPResponse(b"", self.stop))
        return _Recorded(_FakeHTTPResponse(b'{"items": [], "metadata": {"resourceVersion": "1"}}',
                                           None))


def rbac_of(method: str, url: str) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) that an API request needs."""
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    if segments[0] == "api":
        group, rest = "", segments[2:]
    else:
        group, rest = segments[1], segments[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    query = parse_qs(parts.query)
    verb = {
        "GET": "watch" if query.get("watch") == ["true"] else ("get" if name else "list"),
        "POST": "create", "PATCH": "patch", "PUT": "update",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return group, resource, verb


def daemon_api_calls(factories_too: bool = True,
                     **source_options: Any) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) the daemon's API source uses: its reflectors run against
    the recording client until each has listed and watched; plus every Resource in watch.py
    (also those the source does not start yet) unless `factories_too` is off."""
    from pyproxy.cluster import resources, watch
    from pyproxy.cluster.sources import ApiSource

    class NodeProxier:
        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    from pyproxy.cluster.events import record_start

    stop = threading.Event()
    api = RecordingApiClient(stop)
    source = ApiSource(api, "node-a", stop, **source_options)
    source.start(NodeProxier())  # type: ignore[arg-type]
    record_start(api, "node-a", stop).join(10)  # what `pyproxy run` records at start
    source.watch_all_nodes()
    factories = [f for name, f in vars(resources).items()
                 if callable(f) and getattr(f, "__module__", None) == resources.__name__
                 and getattr(f, "__annotations__", {}).get("return") in ("Resource",
                                                                          resources.Resource)]
    assert factories, "no Resource factories found in pyproxy/cluster/resources.py"
    extra = [watch.Reflector(api, factory(), lambda key, obj: None, lambda: None, stop)
             for factory in factories if factories_too]
    for reflector in extra:
        threading.Thread(target=reflector.run, daemon=True).start()
    try:
        deadline = time.monotonic() + 10
        everyone = source.reflectors + extra
        while any(r.status.watches == 0 for r in everyone):
            assert time.monotonic() < deadline, [r.status for r in everyone]
            time.sleep(0.01)
    finally:
        stop.set()
    with api.lock:
        return {rbac_of(method, url) for method, url in api.requests}


_API_CLASS = re.compile(r"[A-Z][A-Za-z0-9]*Api")


def api_calls_outside_reflectors(package: Path = ROOT / "pyproxy") -> list[str]:
    """Kubernetes API calls anywhere in pyproxy/ that the reflector derivation cannot see:
    any `<Something>Api(...)` object outside watch.py, and anything but list_* in it."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if not _API_CLASS.fullmatch(name) or name == "ApiClient":
                continue
            where = f"{path.name}:{node.lineno}: {name}"
            if path.name != "watch.py":
                found.append(where)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
                    and _API_CLASS.fullmatch(getattr(node.value.func, "attr", "") or "")
                    and not node.attr.startswith("list_")):
                found.append(f"{path.name}:{node.lineno}: {node.attr}")
    return found


def role_rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no names, no URLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_cluster_role_grants_exactly_what_the_daemon_uses(objects: dict[str, Any]) -> None:
    assert not api_calls_outside_reflectors(), (
        "pyproxy calls the Kubernetes API through a generated API class; go through "
        "pyproxy/cluster/apirequest.py, teach daemon_api_calls() about it and update "
        "manifests/01-rbac.yaml")
    used = daemon_api_calls()
    assert ("events.k8s.io", "events", "create") in used  # the start Event is recorded
    expected: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in used:
        expected.setdefault((group, resource), set()).add(verb)
    for verbs in expected.values():
        if verbs & {"list", "watch"}:
            verbs.add("get")  # reading one object: nothing list does not already show
    assert ("discovery.k8s.io", "endpointslices") in expected  # the derivation works
    granted = role_rules(objects["ClusterRole"])
    assert granted == expected
    assert "*" not in str(objects["ClusterRole"]["rules"])


def test_the_daemon_reads_service_cidrs_unless_the_gate_is_off(
        objects: dict[str, Any]) -> None:
    """ServiceCIDRs are read by the daemon itself, not only declared in watch.py; with
    MultiCIDRServiceAllocator off (kube-proxy's gate) they are not asked for at all."""
    cidrs = ("networking.k8s.io", "servicecidrs")
    assert {(*cidrs, "list"), (*cidrs, "watch")} <= daemon_api_calls(factories_too=False)
    assert {(g, r) for g, r, _ in daemon_api_calls(factories_too=False,
                                                    service_cidrs=False)} == {
        ("", "services"), ("discovery.k8s.io", "endpointslices"), ("", "nodes"),
        ("events.k8s.io", "events")}
    assert role_rules(objects["ClusterRole"])[cidrs] == {"get", "list", "watch"}


def test_a_new_watch_fails_the_rbac_test(monkeypatch: pytest.MonkeyPatch,
                                        objects: dict[str, Any]) -> None:
    """The derivation follows resources.py: a watch the role does not allow is noticed."""
    from pyproxy.cluster import resources

    def pods_resource() -> resources.Resource:
        return resources.Resource("Pod",
                                  lambda api: client.CoreV1Api(api).list_pod_for_all_namespaces)

    pods_resource.__module__ = resources.__name__
    pods_resource.__annotations__["return"] = "Resource"
    monkeypatch.setattr(resources, "pods_resource", pods_resource, raising=False)
    used = daemon_api_calls()
    assert ("", "pods", "watch") in used
    assert ("", "pods") not in role_rules(objects["ClusterRole"])


def test_other_api_calls_are_noticed(tmp_path: Path) -> None:
    (tmp_path / "watch.py").write_text(
        "def f(api):\n    return client.CoreV1Api(api).list_node\n")
    assert api_calls_outside_reflectors(tmp_path) == []
    (tmp_path / "events.py").write_text(
        "def g(api, body):\n"
        "    client.EventsV1Api(api).create_namespaced_event('default', body)\n")
    (tmp_path / "watch.py").write_text(
        "def f(api):\n    return client.CoreV1Api(api).read_node\n")
    assert api_calls_outside_reflectors(tmp_path) == [
        "events.py:2: EventsV1Api", "events.py:2: create_namespaced_event",
        "watch.py:2: read_node"]


def test_rbac_objects_refer_to_each_other(objects: dict[str, Any]) -> None:
    binding = objects["ClusterRoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole",
                                  "name": objects["ClusterRole"]["metadata"]["name"]}
    account = objects["ServiceAccount"]["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                    "namespace": account["namespace"]}]
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["name"]
    assert pod.get("automountServiceAccountToken", True)


# ---------------------------------------------------------------------------------------------
# ConfigMap and DaemonSet


def _load(text: str) -> Any:
    """The configuration, which must have no warning either: an unknown field is only
    warned about at start (as by kube-proxy), and shipped files have none."""
    from pyproxy.config import load_config

    config = load_config(text)
    assert config.warnings == ()
    return config


def test_configmap_holds_a_kube_proxy_configuration(objects: dict[str, Any]) -> None:
    data = objects["ConfigMap"]["data"]
    assert set(data) == {"config.yaml", "apiServerHost", "apiServerPort"}
    document = yaml.safe_load(data["config.yaml"])
    assert document["mode"] == "nftables"
    assert document["metricsBindAddress"] == "127.0.0.1:10249"
    assert document["healthzBindAddress"] == "0.0.0.0:10256"
    config = _load(data["config.yaml"])
    assert config.metrics_bind_address == "127.0.0.1:10249"
    assert config.healthz_bind_address == "0.0.0.0:10256"
    assert config.cluster_cidrs  # the documented placeholder
    assert config.kubeconfig is None  # the service account


def test_the_api_server_address_is_required(objects: dict[str, Any]) -> None:
    """The ConfigMap's placeholder for the API server's address is empty, and the DaemonSet
    hands it to pyproxy, which refuses to start (rather than fall back to the kubelet's
    `kubernetes` ClusterIP, which a node without proxy rules cannot reach)."""
    from pyproxy.cluster.apiconnection import in_cluster
    from pyproxy.config import ConfigError

    data = objects["ConfigMap"]["data"]
    assert data["apiServerHost"] == ""
    assert data["apiServerPort"] == "6443"
    env = {e["name"]: e["valueFrom"]["configMapKeyRef"]
           for e in _container(objects["DaemonSet"])["env"]
           if "configMapKeyRef" in e.get("valueFrom", {})}
    pod_env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1",  # what the kubelet would set
               **{name: data[ref["key"]] for name, ref in env.items()}}
    with pytest.raises(ConfigError, match="apiServerHost"):
        in_cluster(pod_env)
    pod_env["KUBERNETES_SERVICE_HOST"] = "192.0.2.10"
    assert in_cluster(pod_env).server == "https://192.0.2.10:6443"


def test_configmap_config_errors_are_caught() -> None:
    """The ConfigMap check is not vacuous: a typo in the embedded configuration fails."""
    text = _configmap_text().replace("healthzBindAddress", "healthzBindAdress")
    with pytest.raises(AssertionError, match="healthzBindAdress"):
        _load(text)


def _configmap_text() -> str:
    doc = next(d for _, d in manifest_documents() if d["kind"] == "ConfigMap")
    text: str = doc["data"]["config.yaml"]
    return text


def test_daemonset_pod(objects: dict[str, Any]) -> None:
    ds = objects["DaemonSet"]
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["updateStrategy"] == {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxUnavailable": 1}}
    assert pod["hostNetwork"] is True
    # The node's resolver: an apiServerHost given as a DNS name must not depend on CoreDNS,
    # whose ClusterIP pyproxy itself programs (ClusterFirstWithHostNet would).
    assert pod["dnsPolicy"] == "Default"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]  # every taint, every effect
    for field in ("hostPID", "hostIPC"):
        assert not pod.get(field)


def test_daemonset_container_privileges(objects: dict[str, Any]) -> None:
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    container = _container(objects["DaemonSet"])
    security = container["securityContext"]
    assert security["capabilities"] == {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["runAsUser"] == 0
    assert security["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/run/pyproxy", "/run/xtables.lock"}  # no /lib/modules, no /proc


def test_daemonset_image_and_resources(objects: dict[str, Any]) -> None:
    from kubernetes.utils import parse_quantity

    container = _container(objects["DaemonSet"])
    assert container["image"] == IMAGE
    resources = container["resources"]
    assert resources["requests"] == {"cpu": "100m", "memory": "128Mi"}
    # No CPU limit: syncs are never throttled. Memory: see the figures in the manifest.
    assert resources["limits"] == {"memory": "1Gi"}
    for quantities in resources.values():
        for value in quantities.values():
            parse_quantity(value)
    assert (parse_quantity(resources["requests"]["memory"])
            <= parse_quantity(resources["limits"]["memory"]))


def _run_args(container: dict[str, Any], config_path: Path, node: str) -> list[str]:
    """The container's command line as pyproxy gets it, $(NODE_NAME) expanded, the config file
    swapped for a local copy."""
    assert container["command"] == ["pyproxy"]
    args = [a.replace("$(NODE_NAME)", node) for a in container["args"]]
    return [re.sub(r"^--config=/etc/pyproxy/config.yaml$", f"--config={config_path}", a)
            for a in args]


def test_daemonset_command_line_configures_the_daemon(objects: dict[str, Any],
                                                      tmp_path: Path) -> None:
    from pyproxy.cli import build_parser
    from pyproxy.config import from_args

    ds = objects["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    container = _container(ds)
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "--hostname-override=$(NODE_NAME)" in container["args"]
    for name, key in (("KUBERNETES_SERVICE_HOST", "apiServerHost"),
                      ("KUBERNETES_SERVICE_PORT", "apiServerPort")):
        assert env[name]["valueFrom"] == {"configMapKeyRef": {  # required: not optional
            "name": objects["ConfigMap"]["metadata"]["name"], "key": key}}

    config_file = tmp_path / "config.yaml"
    config_file.write_text(objects["ConfigMap"]["data"]["config.yaml"])
    args = build_parser().parse_args(_run_args(container, config_file, "node-a"))
    config = from_args(args)
    assert config.node_name() == "node-a"

    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The config file is the ConfigMap's key, where --config looks for it.
    assert "--config=/etc/pyproxy/config.yaml" in container["args"]
    config_mount = next(m for m in mounts.values() if m["mountPath"] == "/etc/pyproxy")
    assert config_mount["readOnly"] is True
    assert volumes[config_mount["name"]]["configMap"] == {
        "name": objects["ConfigMap"]["metadata"]["name"],
        "items": [{"key": "config.yaml", "path": "config.yaml"}]}
    # The debug socket's directory is the node's /run/pyproxy.
    assert config.debug_socket
    socket_dir = os.path.dirname(config.debug_socket)
    run_mount = next(m for m in mounts.values() if m["mountPath"] == socket_dir)
    assert volumes[run_mount["name"]]["hostPath"] == {"path": socket_dir,
                                                      "type": "DirectoryOrCreate"}
    # Probes on the health server's port.
    port = int(config.healthz_bind_address.rsplit(":", 1)[1])
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert {"name": "healthz", "containerPort": port, "protocol": "TCP"} in container["ports"]


KUBEADM_VARIANT = MANIFESTS / "kubeadm" / "03-daemonset.yaml"
KUBEADM_CONFIGMAP = ROOT / "tests" / "data" / "kubeadm-kube-proxy-configmap.yaml"


def test_kubeadm_variant_equals_the_daemonset_but_for_its_configuration(
        objects: dict[str, Any]) -> None:
    """manifests/kubeadm/ is the DaemonSet with kubeadm's kube-proxy ConfigMap in place of
    pyproxy's: the same in everything else."""
    variant = yaml.safe_load(KUBEADM_VARIANT.read_text())
    validate(variant)
    main, other = copy.deepcopy(objects["DaemonSet"]), copy.deepcopy(variant)
    for ds in (main, other):
        pod = ds["spec"]["template"]["spec"]
        container = _container(ds)
        container["args"] = [a for a in container["args"] if not a.startswith("--config=")]
        container["env"] = [e for e in container["env"] if e["name"] == "NODE_NAME"]
        container["volumeMounts"] = [m for m in container["volumeMounts"]
                                     if m["name"] not in ("config", "kube-proxy")]
        pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in ("config", "kube-proxy")]
    assert main == other


def test_kubeadm_variant_reads_kubeadms_configmap(tmp_path: Path) -> None:
    """Mounted where kube-proxy's pod has it, kubeadm's config.conf loads and names the
    kubeconfig.conf next to it, which names the API server kubeadm wrote there."""
    from pyproxy.cli import build_parser
    from pyproxy.cluster.apiconnection import parse_kubeconfig
    from pyproxy.config import from_args

    variant = yaml.safe_load(KUBEADM_VARIANT.read_text())
    pod = variant["spec"]["template"]["spec"]
    container = _container(variant)
    assert not any(e["name"].startswith("KUBERNETES_SERVICE") for e in container["env"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kube-proxy")
    assert (mount["mountPath"], mount["readOnly"]) == ("/var/lib/kube-proxy", True)
    volume = next(v for v in pod["volumes"] if v["name"] == "kube-proxy")
    assert volume["configMap"] == {"name": "kube-proxy"}  # every key: both files
    configmap = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())
    assert configmap["metadata"]["name"] == "kube-proxy"
    data = configmap["data"]
    (tmp_path / "config.conf").write_text(data["config.conf"])
    args = [a.replace("$(NODE_NAME)", "node-a").replace(
        "/var/lib/kube-proxy/config.conf", str(tmp_path / "config.conf"))
        for a in container["args"]]
    assert f"--config={tmp_path}/config.conf" in args
    config = from_args(build_parser().parse_args(args))
    assert config.kubeconfig == f"{mount['mountPath']}/kubeconfig.conf"
    connection = parse_kubeconfig(data["kubeconfig.conf"], config.kubeconfig)
    assert connection.server == "https://192.0.2.10:6443"
    assert connection.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert pod.get("automountServiceAccountToken", True)  # where the token file comes from


# ---------------------------------------------------------------------------------------------
# Container image: Containerfile, requirements.lock, make image


def runtime_closure() -> dict[str, tuple[str, str]]:
    """pyproxy's runtime requirements and everything they pull in, as installed in this
    virtualenv: normalised name → (name, version)."""
    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    found: dict[str, tuple[str, str]] = {}
    todo = [Requirement(r).name for r in distribution("pyproxy").requires or []
            if not Requirement(r).marker or Requirement(r).marker.evaluate({"extra": ""})]
    while todo:
        name = todo.pop()
        if norm(name) in found:
            continue
        dist = distribution(name)
        found[norm(name)] = (dist.metadata["Name"], dist.version)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


LOCK_HEADER = """\
# pyproxy's runtime dependencies and everything they pull in, pinned, with the sha256 of every
# file PyPI serves for each version: the Containerfile, `make install` and the Makefile's venv
# install them with `pip install --require-hashes --no-deps -r requirements.lock`.
# Generated from the project virtualenv by `make lock` (`.venv/bin/python tests/test_shipping.py
# --write-lock`: the virtualenv's versions, their hashes by pip-tools' `pip-compile
# --generate-hashes`); tests/test_shipping.py fails when this file and the virtualenv disagree.
"""


def lock_pins() -> list[str]:
    """NAME==VERSION of each package of the virtualenv's runtime closure, sorted by name."""
    return [f"{name}=={version}" for _, (name, version) in sorted(runtime_closure().items())]


def write_lock() -> None:
    """requirements.lock: the virtualenv's pins, with the hashes pip-compile finds on the
    package index for exactly those versions (it resolves the pins to themselves: they are a
    closed set)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pins, out = Path(tmp) / "pins.in", Path(tmp) / "pins.txt"
        pins.write_text("\n".join(lock_pins()) + "\n")
        subprocess.run([sys.executable, "-m", "piptools", "compile", "--quiet",
                        "--generate-hashes", "--allow-unsafe", "--strip-extras",
                        "--no-header", "--no-annotate", "--no-emit-index-url",
                        "--no-emit-find-links", "--output-file", str(out), str(pins)],
                       check=True, cwd=tmp)
        LOCK.write_text(LOCK_HEADER + out.read_text().lstrip("\n"))


def lock_requirements() -> dict[str, list[str]]:
    """requirements.lock: NAME==VERSION → its hashes (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            pin, *options = line.split()
            assert all(option.startswith("--hash=sha256:") for option in options), line
            found[pin] = [option.removeprefix("--hash=sha256:") for option in options]
    return found


def test_requirements_lock_matches_the_virtualenv() -> None:
    try:
        expected = lock_pins()
    except PackageNotFoundError as err:
        pytest.skip(f"not installed in this environment: {err}")
    assert LOCK.read_text().startswith(LOCK_HEADER)
    pins = lock_requirements()
    for pin, hashes in pins.items():
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+", pin), pin
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), pin
    def norm(pin: str) -> str:  # the name as PyPI compares it, the version as it is
        name, _, pinned = pin.partition("==")
        return f"{re.sub(r'[-_.]+', '-', name).lower()}=={pinned}"

    assert sorted(map(norm, pins)) == sorted(map(norm, expected)), (
        "requirements.lock differs from the virtualenv; regenerate it with `make lock` "
        "(`.venv/bin/python tests/test_shipping.py --write-lock`) and review the diff")
    assert "pyproxy" not in {pin.split("==")[0].lower() for pin in pins}


def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in CONTAINERFILE.read_text().splitlines()
        if not line.lstrip().startswith("#")))
    result = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            result.append((instruction.upper(), " ".join(rest.split())))
    return result


def test_containerfile() -> None:
    instructions = containerfile_instructions()
    bases = [args.split()[0] for op, args in instructions if op == "FROM"]
    assert bases
    for base in bases:
        assert re.fullmatch(r"debian:(bookworm|trixie|\d+(\.\d+)*)-slim(@sha256:[0-9a-f]{64})?",
                            base), base
    everything = " ".join(args for _, args in instructions)
    assert ":latest" not in everything
    run = " ".join(args for op, args in instructions if op == "RUN")
    for package in ("libnftables1", "python3-nftables", "conntrack", "iproute2", "nftables",
                    "python3-venv", "--no-install-recommends"):
        assert f" {package} " in f" {run} ", package
    assert "pip install --require-hashes --no-deps -r /src/requirements.lock" in run
    assert "pip check" in run
    # Debian's nftables binding linked into the virtualenv as the Makefile's venv target does.
    makefile = (ROOT / "Makefile").read_text()
    debian_nft = re.search(r"^DEBIAN_NFT := (\S+)$", makefile, re.M)
    assert debian_nft
    venv_target = makefile[makefile.index("\nvenv:"):].split("\n\n")[0]
    link = re.search(r"\[ -e \"\$\$site/nftables\" \] \|\| ln -s \$\(DEBIAN_NFT\) "
                     r"\"\$\$site/nftables\"", venv_target)
    assert link, "the Makefile's venv target changed: update the Containerfile and this test"
    expected = link.group(0).replace("$(DEBIAN_NFT)", debian_nft.group(1)).replace("$$", "$")
    assert expected in run
    assert """sysconfig.get_paths()["purelib"]""" in run
    copied = [args.split()[:-1] for op, args in instructions if op == "COPY"]
    sources = {source for sources in copied for source in sources}
    assert sources == {"requirements.lock", "pyproject.toml", "setup.py", "README.md",
                       "pyproxy"}
    # The wheels are mounted where pip installs (no layer keeps them); without build arguments
    # the mount is the lock (a file every context has), and pip goes to the index; the
    # offline configuration never stays in the image.
    assert ("ARG", "WHEELS=requirements.lock") in instructions
    mounted = [args for op, args in instructions
               if op == "RUN" and "pip install" in args]
    assert len(mounted) == 2
    assert all(args.startswith("--mount=type=bind,source=${WHEELS},target=/tmp/wheels ")
               for args in mounted)
    assert "rm -rf /src /opt/pyproxy/pip.conf" in run
    # `docker build .` needs no build argument: every one has a default. The commit comes in
    # only through REVISION (the package records it); the version is the package's own.
    args = [args for op, args in instructions if op == "ARG"]
    assert all("=" in arg for arg in args), args
    assert "REVISION=" in args
    assert 'PYPROXY_COMMIT="${REVISION}" /opt/pyproxy/bin/pip install --no-deps /src' in run
    # No version argument to forget: `make image` labels the version, from pyproject.toml.
    assert "${VERSION}" not in everything and not [a for a in args if a.startswith("VERSION")]
    assert "/opt/pyproxy/bin/pyproxy --version" in run
    entry = dict(instructions)
    assert entry["ENTRYPOINT"] == '["pyproxy"]'
    assert entry["USER"] == "0:0"


def test_one_version_everywhere() -> None:
    """pyproject's version is the package's (`pyproxy --version`, `pyproxy version`), the
    image's tag and, through the builder's --label, its label."""
    from image import build

    for argv in (["--version"], ["version"]):
        out = subprocess.run([PYPROXY, *argv], capture_output=True, text=True, check=True)
        assert out.stdout.startswith(f"pyproxy {VERSION}"), out.stdout
    out = subprocess.run([PYPROXY, "version", "-o", "json"], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout)["version"] == VERSION
    made = _make("-n", "image")
    assert f"--tag 'localhost/pyproxy:{VERSION}'" in made.stdout
    assert build.VERSION == VERSION
    assert build.PYPROXY.endswith(f"/pyproxy:{VERSION}")


def _fake_buildah(bin_dir: Path, log: Path) -> None:
    """A buildah that has the base image, records `bud` (and its context's files) and pushes
    an OCI layout with one manifest; FAIL_BUD=1 makes `bud` fail."""
    bin_dir.mkdir()
    script = bin_dir / "buildah"
    script.write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$1" in
  images) echo 0123456789ab ;;
  inspect) echo ;;  # the base's labels: none, as a pulled debian:bookworm-slim has
  bud) [ -z "$FAIL_BUD" ] || exit 1
       (cd "${{@: -1}}" && find . -type f | sort) > {log}.context ;;
  push) dir="${{@: -1}}"; dir="${{dir#oci:}}"; mkdir -p "$dir/blobs/sha256"
        echo '{{"imageLayoutVersion": "1.0.0"}}' > "$dir/oci-layout"
        echo '{{"schemaVersion": 2, "manifests": [{{"mediaType":
          "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:00", "size": 2}}]}}' \
          > "$dir/index.json" ;;
  *) exit 1 ;;
esac
""")
    script.chmod(0o755)


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args],
                          capture_output=True, text=True, env=env, timeout=300, check=False)


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@needs_make
def test_make_image_builds_pyproxy_with_buildah() -> None:
    """`make image` installs buildah and mmdebstrap when missing and hands IMAGE to the
    builder (image/build.py, the product's side: not the test kit), whose failure is make's."""
    dry = _make("-n", "image", "IMAGE=registry.example/pyproxy:9")
    assert dry.returncode == 0, dry.stderr
    assert "buildah mmdebstrap" in dry.stdout
    assert "-m image.build --sbom --tag 'registry.example/pyproxy:9'" in dry.stdout
    assert "testkit" not in dry.stdout
    assert "e2e/tools/build.sh syft" in dry.stdout  # the SBOM's tool, built once
    assert "localhost/pyproxy:" + VERSION in _make("-n", "image").stdout


def _build_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str,
                 **extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    from image import build

    log = tmp_path / "log"
    _fake_buildah(tmp_path / "bin", log)
    monkeypatch.setenv("PYPROXY_K8S_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", **extra}
    # The wheelhouse as the host's pip would leave it (the test downloads nothing).
    wheels = build.wheelhouse_path()
    wheels.mkdir(parents=True)
    (wheels / "x-1-py3-none-any.whl").write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "image.build", *flags,
                             "--tag", "registry.example/pyproxy:9"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    return result, log


def test_make_image_writes_syfts_sbom_beside_the_archive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--sbom (`make image`): syft's SPDX JSON document of the archive, beside it, once per
    archive; the archive's path alone is printed."""
    from image import oci
    from testkit.tools import tool_path

    monkeypatch.setenv("PYPROXY_K8S_CACHE", str(tmp_path / "cache"))
    syft = tool_path("syft")
    assert syft.is_relative_to(tmp_path / "cache")
    syft.parent.mkdir(parents=True)
    calls = tmp_path / "syft.log"
    syft.write_text(f"""#!/bin/bash
echo "$SYFT_CHECK_FOR_APP_UPDATE $*" >> {calls}
for arg; do
  case "$arg" in spdx-json=*) echo '{{"spdxVersion": "SPDX-2.3"}}' > "${{arg#spdx-json=}}";; esac
done
""")
    syft.chmod(0o755)
    result, _ = _build_image(tmp_path, monkeypatch, "--sbom")
    assert result.returncode == 0, result.stdout + result.stderr
    [archive] = [Path(line) for line in result.stdout.splitlines()]
    sbom = oci.sbom_path(archive)
    assert sbom.parent == archive.parent
    assert sbom.name == archive.name.removesuffix(".tar") + ".spdx.json"
    assert json.loads(sbom.read_text()) == {"spdxVersion": "SPDX-2.3"}
    [call] = calls.read_text().splitlines()
    assert call.split() == ["false", "scan", "--quiet", f"oci-archive:{archive}", "-o",
                            f"spdx-json={sbom}.partial"]
    again = subprocess.run([sys.executable, "-m", "image.build", "--sbom",
                            "--tag", "registry.example/pyproxy:9"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert again.returncode == 0, again.stderr
    assert len(calls.read_text().splitlines()) == 1  # the same archive: its SBOM is kept


def test_image_is_built_from_a_minimal_context(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The Containerfile is built by buildah in chroot isolation with the host's network, on
    the base buildah has, from a context holding only what the image needs and the wheels,
    given the checkout's commit to record and to label with beside pyproject's version; the
    image comes out as an OCI archive named for containerd, and its path is printed."""
    from image import build

    result, log = _build_image(tmp_path, monkeypatch)
    assert result.returncode == 0, result.stdout + result.stderr
    (bud,) = [line.split() for line in log.read_text().splitlines() if line.startswith("bud")]
    assert {"--isolation=chroot", "--network=host", "--pull=never", "--layers"} <= set(bud)
    assert bud[bud.index("-f") + 1] == str(ROOT / "Containerfile")
    assert bud[bud.index("-t") + 1] == "registry.example/pyproxy:9"
    build_args = [bud[i + 1] for i, arg in enumerate(bud) if arg == "--build-arg"]
    commit = build.source_commit()
    assert commit  # the suite runs from a checkout
    assert build_args == ["WHEELS=wheels", f"REVISION={commit}"]
    labels = [bud[i + 1] for i, arg in enumerate(bud) if arg == "--label"]
    assert labels == [f"org.opencontainers.image.version={VERSION}",
                      f"org.opencontainers.image.revision={commit}"]
    files = Path(f"{log}.context").read_text().split()
    assert {"./pyproject.toml", "./setup.py", "./README.md", "./requirements.lock",
            "./pyproxy/__init__.py", "./pyproxy/cli/__init__.py",
            "./wheels/x-1-py3-none-any.whl"} <= set(files)
    assert all(f.startswith(("./pyproxy/", "./pyproject.toml", "./setup.py", "./README.md",
                             "./requirements.lock", "./wheels/")) for f in files), files
    assert not [f for f in files if "__pycache__" in f]
    assert not Path(bud[-1]).exists()  # the temporary context is gone
    archive = Path(result.stdout.strip())
    assert archive.parent == tmp_path / "cache" / "images"
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None
        (manifest,) = yaml.safe_load(member.read())["manifests"]
    assert manifest["annotations"] == {"io.containerd.image.name": "registry.example/pyproxy:9",
                                       "org.opencontainers.image.ref.name": "9"}


def test_image_build_failure_is_an_error(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build exits non-zero, says which step failed, and leaves no archive."""
    result, _ = _build_image(tmp_path, monkeypatch, FAIL_BUD="1")
    assert result.returncode == 1
    assert "buildah bud" in result.stderr and "exited 1" in result.stderr
    assert not list((tmp_path / "cache" / "images").glob("*.tar"))


# ---------------------------------------------------------------------------------------------
# systemd unit and make install/uninstall


def unit_settings(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert key not in current, f"{key} repeated"
        current[key.strip()] = value.strip()
    return sections


def test_systemd_unit_settings() -> None:
    from pyproxy.config import ProxyConfig

    service = unit_settings((SYSTEMD / "pyproxy.service").read_text())["Service"]
    assert service["Type"] == "notify"
    assert 'sd_notify("READY=1")' in (ROOT / "pyproxy" / "run.py").read_text()
    assert service["Restart"] == "on-failure"
    assert set(service["CapabilityBoundingSet"].split()) == {"CAP_NET_ADMIN", "CAP_NET_RAW"}
    assert set(service.get("AmbientCapabilities", "").split()) <= {"CAP_NET_ADMIN",
                                                                   "CAP_NET_RAW"}
    for key, value in (("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"),
                       ("RuntimeDirectory", "pyproxy"), ("RuntimeDirectoryMode", "0700"),
                       ("EnvironmentFile", "-/etc/pyproxy/pyproxy.env")):
        assert service[key] == value, key
    socket = ProxyConfig().debug_socket
    assert socket and os.path.dirname(socket) == "/run/" + service["RuntimeDirectory"]
    assert service["ExecStart"] == (
        "/opt/pyproxy/bin/pyproxy run --config /etc/pyproxy/config.yaml $PYPROXY_ARGS")


def _env_examples() -> list[str]:
    """PYPROXY_ARGS values in systemd/pyproxy.env: the setting and the commented examples."""
    values = []
    for line in (SYSTEMD / "pyproxy.env").read_text().splitlines():
        match = re.match(r"^#?\s*PYPROXY_ARGS=(.*)$", line)
        if match:
            values.append(" ".join(shlex.split(match.group(1))))
    return values


def test_systemd_example_configuration_works() -> None:
    from pyproxy.cli import build_parser
    from pyproxy.config import from_args

    config = _load((SYSTEMD / "config.yaml").read_text())
    assert config.kubeconfig and config.kubeconfig.startswith("/etc/pyproxy/")
    assert config.metrics_bind_address == "127.0.0.1:10249"
    service = unit_settings((SYSTEMD / "pyproxy.service").read_text())["Service"]
    command = service["ExecStart"].split()[1:]
    examples = _env_examples()
    assert len(examples) >= 2
    for example in examples:
        argv = [a.replace("/etc/pyproxy/config.yaml", str(SYSTEMD / "config.yaml"))
                for a in command if a != "$PYPROXY_ARGS"] + shlex.split(example)
        from_args(build_parser().parse_args(argv))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as systemd reads it. verify wants ExecStart to exist: the copy runs the
    virtualenv's pyproxy. Unknown keys are only warnings, so any output fails."""
    pyproxy = Path(sys.executable).parent / "pyproxy"
    if not pyproxy.exists():
        pytest.skip("no pyproxy script next to the test interpreter")
    text = (SYSTEMD / "pyproxy.service").read_text()
    unit = tmp_path / "pyproxy.service"

    def verify(text: str) -> str:
        unit.write_text(text)
        result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                                capture_output=True, text=True, timeout=60, check=False)
        return (result.stdout + result.stderr).strip() + ("" if result.returncode == 0
                                                          else f" (exit {result.returncode})")

    good = text.replace("ExecStart=/opt/pyproxy/bin/pyproxy", f"ExecStart={pyproxy}")
    assert good != text
    assert verify(good) == ""
    assert "ProtectSystm" in verify(good.replace("ProtectSystem=", "ProtectSystm="))


def _can_install_offline() -> str | None:
    probe = subprocess.run(["/usr/bin/python3", "-c", "import setuptools, wheel, venv, pip"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        return "Debian's python3 with pip, setuptools, wheel (python3-pip) is needed offline"
    return None


@needs_make
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no /usr/bin/python3")
def test_make_install_and_uninstall_round_trip(tmp_path: Path) -> None:
    why = _can_install_offline()
    if why:
        pytest.skip(why)
    dest = tmp_path / "root"
    # Offline: no dependencies (REQUIREMENTS=), and pyproxy built with Debian's pip,
    # setuptools and wheel (system site packages) instead of downloading a build backend.
    offline = ["REQUIREMENTS=", "VENV_FLAGS=--without-pip --system-site-packages",
               "PIP_FLAGS=--no-index --no-build-isolation"]
    # A systemctl that records its calls: with DESTDIR there must be none.
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'systemctl.log'}\n")
    (stub / "systemctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:/usr/bin:/bin:/usr/sbin:/sbin"}
    # A configuration file that exists already is kept; a missing one is installed.
    (dest / "etc/pyproxy").mkdir(parents=True)
    (dest / "etc/pyproxy/config.yaml").write_text("# mine\n")
    result = _make("install", f"DESTDIR={dest}", *offline, env=env)
    assert result.returncode == 0, result.stdout + result.stderr

    venv = dest / "opt/pyproxy"
    assert (venv / "pyvenv.cfg").exists()
    script = (venv / "bin/pyproxy").read_text()
    assert script.startswith("#!/opt/pyproxy/bin/python")  # DESTDIR is not in the result
    for path in venv.rglob("*"):
        if path.is_file() and path.suffix in ("", ".cfg", ".py", ".txt", ".pyc"):
            assert str(dest).encode() not in path.read_bytes(), path
    site = next(venv.glob("lib/python3*/site-packages"))
    assert os.readlink(site / "nftables") == "/usr/lib/python3/dist-packages/nftables"
    assert (site / "pyproxy" / "cli" / "__init__.py").exists()
    # Installed, no checkout is left to ask: the build recorded the one it was built from.
    from pyproxy import version

    assert version.recorded_commit(site / "pyproxy") == version.git_commit(ROOT)
    unit = dest / "etc/systemd/system/pyproxy.service"
    assert unit.read_text() == (SYSTEMD / "pyproxy.service").read_text()
    assert (dest / "etc/pyproxy/config.yaml").read_text() == "# mine\n"
    assert (dest / "etc/pyproxy/pyproxy.env").read_text() == (SYSTEMD / "pyproxy.env").read_text()
    for doc in ("deploying.md", "operating.md", "services.md", "configuration.md", "metrics.md"):
        assert (venv / "share/doc/pyproxy" / doc).exists(), doc

    gone = _make("uninstall", f"DESTDIR={dest}", env=env)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert not venv.exists()
    assert not unit.exists()
    assert (dest / "etc/pyproxy/config.yaml").read_text() == "# mine\n"  # kept
    assert sorted(p.name for p in (dest / "etc/pyproxy").iterdir()) == ["config.yaml",
                                                                        "pyproxy.env"]
    assert not (tmp_path / "systemctl.log").exists()


@needs_make
def test_make_uninstall_is_careful(tmp_path: Path) -> None:
    """Uninstall never removes a PREFIX that is not a virtualenv; install wants an absolute
    PREFIX."""
    dest = tmp_path / "root"
    victim = dest / "srv/data"
    victim.mkdir(parents=True)
    (victim / "keep").write_text("x")
    result = _make("uninstall", f"DESTDIR={dest}", "PREFIX=/srv/data")
    assert result.returncode == 0, result.stderr
    assert (victim / "keep").exists()
    assert "not a virtualenv" in result.stderr
    bad = _make("install", f"DESTDIR={dest}", "PREFIX=relative")
    assert bad.returncode != 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-lock"]:
        write_lock()
        print(f"wrote {LOCK}")
    else:
        print(__doc__)
        sys.exit(2)
