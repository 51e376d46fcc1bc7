"""manifests/kustomization.yaml, manifests/monitoring/kustomization.yaml and the overlay
docs/deploying.md shows (step 2), built by the real kustomize, kubectl's own (`kubectl
kustomize`, which `kubectl apply -k` runs; `make k8s` builds kubectl), and compared with the
files: the kustomizations add nothing and drop nothing, and the overlay changes only the image
and the API server's address (issue 39, point 2)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.fixtures import require_kubectl

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
DEPLOYING = ROOT / "docs" / "deploying.md"

Objects = dict[tuple[str, str], dict[str, Any]]


def by_kind_and_name(documents: list[Any]) -> Objects:
    objects: Objects = {}
    for doc in documents:
        if doc is not None:
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, key
            objects[key] = doc
    return objects


def files(folder: Path) -> Objects:
    """The objects of every YAML file of FOLDER but its kustomization."""
    return by_kind_and_name([doc for path in sorted(folder.glob("*.yaml"))
                             if path.name != "kustomization.yaml"
                             for doc in yaml.safe_load_all(path.read_text())])


def kustomize(folder: Path) -> Objects:
    out = subprocess.run([str(require_kubectl()), "kustomize", str(folder)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return by_kind_and_name(list(yaml.safe_load_all(out.stdout)))


@pytest.mark.parametrize("folder", [MANIFESTS, MANIFESTS / "monitoring"],
                         ids=["manifests", "monitoring"])
def test_a_kustomization_lists_every_file_of_its_folder(folder: Path) -> None:
    """A file added to the folder is applied by `kubectl apply -k` too (offline)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert (kustomization["apiVersion"], kustomization["kind"]) == (
        "kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(kustomization) == {"apiVersion", "kind", "resources"}
    assert sorted(kustomization["resources"]) == sorted(
        path.name for path in folder.glob("*.yaml") if path.name != "kustomization.yaml")


@pytest.mark.parametrize("folder", [MANIFESTS, MANIFESTS / "monitoring"],
                         ids=["manifests", "monitoring"])
def test_kustomize_builds_the_files_as_they_are(folder: Path) -> None:
    assert kustomize(folder) == files(folder)


def docs_overlay() -> str:
    """The overlay's kustomization.yaml in docs/deploying.md."""
    blocks = re.findall(r"```yaml\n(# kustomization\.yaml.*?)```", DEPLOYING.read_text(), re.S)
    assert len(blocks) == 1, "docs/deploying.md shows one overlay"
    return str(blocks[0])


def test_the_documented_overlay_sets_the_image_and_the_api_server(tmp_path: Path) -> None:
    """The overlay of docs/deploying.md beside a link to manifests/ in base/, as it says."""
    (tmp_path / "kustomization.yaml").write_text(docs_overlay())
    (tmp_path / "base").symlink_to(MANIFESTS)
    built = kustomize(tmp_path)
    expected = files(MANIFESTS)
    assert built.keys() == expected.keys()
    daemonset = expected[("DaemonSet", "pyproxy")]
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("ghcr.io/pyproxy/pyproxy:")
    container["image"] = "registry.example/pyproxy:0.2.0"
    configmap = expected[("ConfigMap", "pyproxy")]
    assert configmap["data"]["apiServerHost"] == ""
    configmap["data"]["apiServerHost"] = "192.0.2.10"
    assert built == expected
    # With base/monitoring, as its comment says: the Prometheus Operator's objects too.
    overlay = yaml.safe_load(docs_overlay())
    overlay["resources"].append("base/monitoring")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    assert kustomize(tmp_path) == {**built, **files(MANIFESTS / "monitoring")}
