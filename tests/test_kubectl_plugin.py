"""`kubectl pyproxy` (pyproxy/cli/kubectl.py) offline, against a fake kubectl that answers
`get pods` from a list of pods and runs `exec ... -- pyproxy ARGS` with this checkout's pyproxy
(as kubectl exec does in the pod: the command's output, its exit code); and the real kubectl
finding the plugin on PATH. And `pyproxy completion bash|zsh` (shtab), loaded by the shells.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from testkit.fixtures import require_kubectl

ROOT = Path(__file__).resolve().parents[1]
PYPROXY = [sys.executable, "-c", "import sys; from pyproxy.cli import main; sys.exit(main())"]
PLUGIN = [sys.executable, "-c",
          "import sys; from pyproxy.cli.kubectl import main; sys.exit(main())"]

FAKE_KUBECTL = """#!{python}
# kubectl as the plugin uses it: `get pods` answers from $FAKE_PODS (filtered by the field
# selector's node), `exec POD ... -- pyproxy ARGS` runs this checkout's pyproxy. Each call is
# logged as a JSON line to $FAKE_LOG.
import json, os, subprocess, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\\n")
if os.environ.get("FAKE_REFUSE"):
    print("error: You must be logged in to the server (Unauthorized)", file=sys.stderr)
    sys.exit(1)
verb = next(a for a in argv if not a.startswith("--"))
if verb == "get":
    node = next(a.split("=", 2)[2] for a in argv if a.startswith("--field-selector="))
    pods = json.load(open(os.environ["FAKE_PODS"]))
    items = [p for p in pods if p["spec"]["nodeName"] == node]
    print(json.dumps({{"kind": "PodList", "items": items}}))
elif verb == "exec":
    command = argv[argv.index("--") + 1:]
    assert command[0] == "pyproxy", command
    code = subprocess.run([sys.executable, "-c",
                           "import sys; from pyproxy.cli import main; sys.exit(main())",
                           *command[1:]]).returncode
    if code:
        print(f"command terminated with exit code {{code}}", file=sys.stderr)
    sys.exit(code)
else:
    sys.exit(f"fake kubectl: {{argv}}")
"""


def pod(name: str, node: str, phase: str = "Running", deleting: bool = False,
        created: str = "2026-11-28T07:00:00Z") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "kube-system",
                            "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-28T07:30:00Z"
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase}}


class Fake:
    def __init__(self, tmp_path: Path, pods: list[dict[str, Any]]) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.kubectl = self.bin / "kubectl"
        self.kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable))
        self.kubectl.chmod(0o755)
        self.log = tmp_path / "kubectl.log"
        (tmp_path / "pods.json").write_text(json.dumps(pods))
        self.env = {**os.environ, "FAKE_LOG": str(self.log),
                    "FAKE_PODS": str(tmp_path / "pods.json"),
                    "PATH": f"{self.bin}:{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
        self.env.pop("KUBECTL", None)

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*PLUGIN, *args], env={**self.env, **env}, capture_output=True,
                              text=True, timeout=120, check=False)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture(name="fake")
def fake_fixture(tmp_path: Path) -> Fake:
    return Fake(tmp_path, [pod("pyproxy-aaaaa", "node-a"), pod("pyproxy-bbbbb", "node-b"),
                           pod("web-1", "node-c")])


def test_the_pod_on_the_node_runs_the_command_with_its_arguments(fake: Fake) -> None:
    """The pod is looked up by pyproxy's label and the node, with kubectl's connection flags;
    the command and its arguments reach `pyproxy` in it unchanged."""
    result = fake.run("--node", "node-b", "--context", "prod", "--kubeconfig", "/k/config",
                      "explain", "default/web", "-o", "json", "--socket", "/nowhere")
    get, exec_ = fake.calls()
    connection = ["--context=prod", "--kubeconfig=/k/config", "--namespace=kube-system"]
    assert get == [*connection, "get", "pods", "--selector=app.kubernetes.io/name=pyproxy",
                   "--field-selector=spec.nodeName=node-b", "--output=json"]
    assert exec_ == [*connection, "exec", "pyproxy-bbbbb", "--container=pyproxy", "--",
                     "pyproxy", "explain", "default/web", "-o", "json", "--socket", "/nowhere"]
    assert result.returncode == 3  # no daemon behind /nowhere, as on the node


@pytest.mark.parametrize("args", [
    pytest.param(["status", "--socket", "/nowhere"], id="status, daemon unreachable: 3"),
    pytest.param(["diff", "--socket", "/nowhere", "-o", "json"], id="diff: 3"),
    pytest.param(["version", "-o", "json"], id="version: 0"),
    pytest.param(["services", "not-a-key"], id="a usage mistake: 2"),
])
def test_output_and_exit_code_are_the_commands(fake: Fake, args: list[str]) -> None:
    through = fake.run("--node", "node-a", *args)
    direct = subprocess.run([*PYPROXY, *args], capture_output=True, text=True, timeout=120,
                            check=False, env=fake.env)
    assert through.returncode == direct.returncode
    assert through.stdout == direct.stdout
    assert through.stderr.startswith(direct.stderr)


def test_no_running_pod_on_the_node(tmp_path: Path) -> None:
    fake = Fake(tmp_path, [pod("pyproxy-aaaaa", "node-a", phase="Pending")])
    for node in ("node-a", "node-z"):
        result = fake.run("--node", node, "status")
        assert result.returncode == 3
        assert f"no running pyproxy pod on node {node}" in result.stderr
    assert all("exec" not in call for call in fake.calls())


def test_a_pod_being_replaced_leaves_the_answer_to_its_successor(tmp_path: Path) -> None:
    fake = Fake(tmp_path, [pod("pyproxy-old", "node-a", deleting=True),
                           pod("pyproxy-new", "node-a", created="2026-11-28T07:31:00Z")])
    fake.run("--node", "node-a", "version")
    assert fake.calls()[-1][2] == "pyproxy-new"


def test_kubectl_refused(fake: Fake) -> None:
    result = fake.run("--node", "node-a", "status", FAKE_REFUSE="1")
    assert result.returncode == 3
    assert "Unauthorized" in result.stderr


@pytest.mark.parametrize("args", [
    ["explain", "-f", "snapshot.yaml"], ["trace", "--file=s.yaml", "--src", "1.2.3.4"],
])
def test_offline_commands_are_refused(fake: Fake, args: list[str]) -> None:
    result = fake.run("--node", "node-a", *args)
    assert result.returncode == 2
    assert "run pyproxy itself" in result.stderr
    assert fake.calls() == []


def test_usage_mistakes(fake: Fake) -> None:
    assert fake.run("status").returncode == 2  # no --node
    assert fake.run("--node", "node-a", "run").returncode == 2  # not a command for it
    assert fake.calls() == []


def test_the_package_installs_the_plugin_under_kubectls_name() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-pyproxy"] == "pyproxy.cli.kubectl:main"


def test_the_real_kubectl_runs_the_plugin_from_path(fake: Fake) -> None:
    """kubectl's plugin mechanism: `kubectl pyproxy ...` runs kubectl-pyproxy from PATH with
    the arguments unparsed (the plugin then uses the fake, named by KUBECTL)."""
    kubectl = require_kubectl()
    plugin = fake.bin / "kubectl-pyproxy"
    plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom pyproxy.cli.kubectl import main\n"
                      "sys.exit(main())\n")
    plugin.chmod(0o755)
    result = subprocess.run([str(kubectl), "pyproxy", "--node", "node-a", "version"],
                            env={**fake.env, "KUBECTL": str(fake.kubectl)},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pyproxy ")
    assert fake.calls()[-1][-2:] == ["pyproxy", "version"]
    listed = subprocess.run([str(kubectl), "plugin", "list", "--name-only"], env=fake.env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert "kubectl-pyproxy" in listed.stdout


# -- shell completion ------------------------------------------------------------------------


def completion(shell: str) -> str:
    out = subprocess.run([*PYPROXY, "completion", shell], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_bash_completion_loads_and_completes(tmp_path: Path) -> None:
    script = tmp_path / "pyproxy.bash"
    script.write_text(completion("bash"))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        out = subprocess.run(
            ["bash", "-c", f'source {script}; COMP_WORDS=({line}); '
             f'COMP_CWORD={len(words) - 1}; COMP_LINE="{line}"; COMP_POINT={len(line)}; '
             '_shtab_pyproxy; printf "%s\\n" "${COMPREPLY[@]}"'],
            capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert complete("pyproxy", "ex") == ["explain"]
    assert {"status", "services", "trace", "diff", "completion"} <= set(complete("pyproxy", ""))
    assert complete("pyproxy", "status", "--out") == ["--output"]
    assert complete("pyproxy", "completion", "z") == ["zsh"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="no zsh")
def test_zsh_completion_parses(tmp_path: Path) -> None:
    script = tmp_path / "_pyproxy"
    script.write_text(completion("zsh"))
    out = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "#compdef pyproxy" in script.read_text()
