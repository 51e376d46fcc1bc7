"""The support statement's kernel and nft table (docs/deploying.md, "Kernel and nftables")
is the ruleset's: every nftables feature a full-featured `pyproxy render` uses is a row of
it, and every row's example is in that ruleset. A rule that starts using something the
table does not list (a newer kernel's or nft's) fails here until the table says which."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pyproxy.kernel.host import kernel_below_supported
from testkit.builders import ep, make_node, make_service, make_slice

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploying.md"
PYPROXY = str(Path(sys.executable).parent / "pyproxy")
HEADER = "| feature | in the ruleset | kernel | nft |"

# nftables statements and expressions that need a kernel or nft of some version; the ones a
# ruleset uses must be in the table. (Beyond what pyproxy uses, the ones a change would most
# likely bring in: `destroy` needs nft 1.0.8 and kernel 6.3, `last` 5.14, `inner` 6.2.)
VOCABULARY = (
    "flags interval", "typeof", "dnat ip to", "comment", "update @", "add @", "counter",
    "timeout", "ct original", "fib", "numgen", "jhash", "symhash", "th dport", "vmap",
    "reject", "masquerade", "fully-random", "ct status", "ct state", "meta l4proto",
    "meta mark", "jump", "goto", "size", "destroy", "last", "inner", "ct count", "limit rate",
    "quota", "synproxy", "flowtable", "meter", "notrack", "ct zone", "ct helper", "ct timeout",
    "ct expectation", "secmark", "tproxy", "osf", "xfrm", "queue", "dup to", "fwd to",
    "snat", "redirect",
)


def table_rows() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    lines = text[text.index(HEADER):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def examples(row: list[str]) -> list[str]:
    """The backticked examples of a row ("every ruleset": its feature column's)."""
    cell = row[0] if row[1] == "every ruleset" else row[1]
    return [part for code in re.findall(r"`([^`]+)`", cell) for part in code.split("…")
            if part.strip()]


def objects() -> list[dict[str, Any]]:
    """A Service of every kind and balancing (IPv4; the IPv6 table uses the same features)."""
    def annotated(balancing: str) -> Any:
        def tweak(svc: dict[str, Any]) -> None:
            svc["metadata"]["annotations"] = {"service.pyproxy.io/balancing": balancing}
        return tweak

    def lb(svc: dict[str, Any]) -> None:
        svc["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local",
                           loadBalancerSourceRanges=["203.0.113.0/24"],
                           ports=[{"name": "http", "port": 80, "nodePort": 30080}])
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.80"}]}}

    def sticky(svc: dict[str, Any]) -> None:
        svc["spec"]["sessionAffinity"] = "ClientIP"

    out: list[dict[str, Any]] = [make_node("node-a", "zone-1")]
    kinds = {"plain": None, "lb": lb, "sticky": sticky, "maglev": annotated("maglev"),
             "hash": annotated("source-hash"), "rr": annotated("round-robin")}
    for n, (name, tweak) in enumerate(kinds.items()):
        out.append(make_service("ns", name, tweak, ip=f"10.96.0.{10 + n}"))
        out.append(make_slice("ns", name, [ep(f"10.244.{i}.{10 + n}", "node-a")
                                           for i in (1, 2, 3)]))
    return out


@pytest.fixture(scope="module")
def ruleset(tmp_path_factory: pytest.TempPathFactory) -> str:
    snapshot = tmp_path_factory.mktemp("support") / "cluster.yaml"
    snapshot.write_text(yaml.safe_dump_all(objects()))
    script = ""
    for addresses in ("primary", "all"):  # `all`: NodePorts on every local address (fib)
        script += subprocess.run(
            [PYPROXY, "render", "-f", str(snapshot), "--node", "node-a", "--node-ip",
             "192.168.1.10", "--cluster-cidr", "10.244.0.0/16", "--nodeport-addresses",
             addresses], capture_output=True, text=True, check=True, timeout=120).stdout
    return script


def test_every_rows_example_is_in_the_ruleset(ruleset: str) -> None:
    rows = table_rows()
    assert len(rows) >= 8
    missing = [(row[0], example) for row in rows for example in examples(row)
               if example not in ruleset]
    assert not missing


def test_every_feature_the_ruleset_uses_is_a_row(ruleset: str) -> None:
    table = "\n".join("|".join(row) for row in table_rows())
    used = [word for word in VOCABULARY if re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])",
                                                     ruleset)]
    assert {"flags interval", "typeof", "jhash", "numgen", "fib"} <= set(used)
    assert [word for word in used if word not in table] == []


def test_the_park_label_says_what_it_does_in_the_doc_and_the_drill() -> None:
    """Step 4 parks kube-proxy with a nodeSelector no node matches; the label's name says
    where kube-proxy runs (`run-kube-proxy`), not the opposite, in the doc and in the drill
    that follows the doc literally."""
    label = re.compile(r'"(pyproxy\.io/[\w.-]*kube-proxy)"')
    doc = DOC.read_text(encoding="utf-8")
    drill = (ROOT / "drills" / "cluster_ops.py").read_text(encoding="utf-8")
    assert set(label.findall(doc)) == set(label.findall(drill)) == {"pyproxy.io/run-kube-proxy"}
    assert "no-kube-proxy" not in doc + drill


@pytest.mark.parametrize(("release", "old"), [
    pytest.param("6.18.44-fc-v669", False, id="this machine's"),
    pytest.param("5.13.0-52-generic", False, id="the floor itself"),
    pytest.param("5.10.0-28-amd64", True, id="Debian 11's"),
    pytest.param("4.18.0-553.el8_10.x86_64", True, id="RHEL 8's"),
    pytest.param("6", False, id="a major number alone is not below 5.13"),
    pytest.param("weird", False, id="unreadable: no warning"),
])
def test_a_kernel_below_the_floor_is_warned_about(release: str, old: bool) -> None:
    assert kernel_below_supported(release) is old
