"""The operators' tools the tests run: promtool, helm and syft, built by `make tools`
(e2e/tools/build.sh) from upstream's Go modules into the cache outside the checkout (as
`make k8s` builds the control plane, whose kubectl the kustomize tests run); and
operator-crds, the Prometheus Operator's CRDs from its module (a folder, not a binary)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "e2e" / "tools" / "build.sh"
TOOLS = ("promtool", "helm", "syft", "operator-crds")


def tool_path(name: str) -> Path:
    """Where `make tools` puts NAME's binary, whether or not it is built yet."""
    out = subprocess.run([str(BUILD_SCRIPT), "--path", name], capture_output=True, text=True,
                         check=True, timeout=30)
    return Path(out.stdout.strip())
