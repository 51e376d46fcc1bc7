"""Snapshots (YAML/JSON, List or documents), slice merging, and `pyproxy explain`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pyproxy.cli import main
from pyproxy.cluster.snapshot import SnapshotError, build_state, parse_snapshot
from pyproxy.core.explain import explain_report, format_table
from pyproxy.core.model import IPFamily, Protocol, ServiceKey, ServicePortName
from testkit.builders import ep, make_node, make_service, make_slice, terminating

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cluster.yaml"
HTTP = ServicePortName("ns", "svc", "http", Protocol.TCP)


def test_slices_merge_and_deduplicate() -> None:
    state = build_state([
        make_service("ns", "svc"),
        make_slice("ns", "svc", [ep("10.244.1.2"), ep("10.244.1.1")], name="svc-1"),
        make_slice("ns", "svc", [ep("10.244.1.1"), ep("10.244.2.1")], name="svc-2"),
        # the same IP:port terminating in one slice, ready in another: the ready one wins
        make_slice("ns", "svc", [terminating("10.244.3.1")], name="svc-3"),
        make_slice("ns", "svc", [ep("10.244.3.1")], name="svc-4"),
        make_slice("ns", "svc", [ep("fd00:244::1")], name="svc-v6", family="IPv6"),
        make_slice("ns", "other", [ep("10.244.9.9")], name="other-1"),
    ])
    v4 = state.endpoints(HTTP, IPFamily.IPv4)
    assert [e.key for e in v4] == [
        "10.244.1.1:8080", "10.244.1.2:8080", "10.244.2.1:8080", "10.244.3.1:8080"]
    assert not v4[-1].terminating
    assert [e.key for e in state.endpoints(HTTP, IPFamily.IPv6)] == ["[fd00:244::1]:8080"]


def test_ipv6_slices_merge_by_bracketed_key() -> None:
    # Sorted by "[IP]:port" as text, as Endpoint.key spells it; a copy in two slices once.
    state = build_state([
        make_service("ns", "svc"),
        make_slice("ns", "svc", [ep("fd00::a"), ep("fd00::1:9")], name="v6-1", family="IPv6"),
        make_slice("ns", "svc", [terminating("fd00::1"), ep("fd00::a")], name="v6-2",
                   family="IPv6"),
        make_slice("ns", "svc", [ep("fd00::1")], name="v6-3", family="IPv6"),
    ])
    merged = state.endpoints(HTTP, IPFamily.IPv6)
    assert [(e.key, e.terminating) for e in merged] == sorted(
        [("[fd00::1:9]:8080", False), ("[fd00::1]:8080", False), ("[fd00::a]:8080", False)])
    assert [e.key for e in merged][:2] == ["[fd00::1:9]:8080", "[fd00::1]:8080"]


def test_one_slice_is_its_own_merged_list() -> None:
    # Within one slice: sorted by `IP:port` as text (so 10.244.1.10 before 10.244.1.1), a
    # duplicated address once, the non-terminating copy winning.
    state = build_state([
        make_service("ns", "svc"),
        make_slice("ns", "svc", [ep("10.244.1.9"), terminating("10.244.1.10"),
                                 ep("10.244.1.1"), ep("10.244.1.10")]),
    ])
    merged = state.endpoints(HTTP, IPFamily.IPv4)
    assert [(e.key, e.terminating) for e in merged] == [
        ("10.244.1.10:8080", False), ("10.244.1.1:8080", False), ("10.244.1.9:8080", False)]
    # The slice's own endpoints, not copies: nothing is rebuilt per sync or per reader.
    (piece,) = state.slices[ServiceKey("ns", "svc")]
    assert merged is piece.endpoints
    assert state.endpoints(HTTP, IPFamily.IPv4) is merged


def test_endpoints_match_service_ports_by_name_and_protocol() -> None:
    def two_ports(svc: dict[str, Any]) -> None:
        svc["spec"]["ports"] = [{"name": "http", "port": 80}, {"name": "dns", "port": 53,
                                                               "protocol": "UDP"}]

    def slice_ports(s: dict[str, Any]) -> None:
        s["ports"] = [{"name": "http", "port": 8080}, {"name": "dns", "port": 5353,
                                                       "protocol": "UDP"},
                      {"name": "dns", "port": 5354, "protocol": "TCP"}]

    state = build_state([make_service("ns", "svc", two_ports),
                         make_slice("ns", "svc", [ep("10.244.1.1")], slice_ports)])
    dns = ServicePortName("ns", "svc", "dns", Protocol.UDP)
    assert [e.key for e in state.endpoints(dns, IPFamily.IPv4)] == ["10.244.1.1:5353"]
    assert [e.key for e in state.endpoints(HTTP, IPFamily.IPv4)] == ["10.244.1.1:8080"]


def test_snapshot_forms() -> None:
    objs = [make_node("n1", "z"), make_service("ns", "svc"),
            make_slice("ns", "svc", [ep("10.1.1.1")])]
    as_list = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs})
    as_docs = yaml.safe_dump_all(objs)
    as_json = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    typed = yaml.safe_dump({"kind": "ServiceList", "items": [
        {k: v for k, v in make_service("ns", "svc").items() if k != "kind"}]})
    for text in (as_list, as_docs, as_json):
        state = parse_snapshot(text)
        assert [str(p.name) for p in state.ports] == ["ns/svc:http"]
        assert "n1" in state.nodes
        assert state.endpoints(HTTP, IPFamily.IPv4)
    assert [str(p.name) for p in parse_snapshot(typed).ports] == ["ns/svc:http"]


def test_snapshot_errors() -> None:
    with pytest.raises(SnapshotError):
        parse_snapshot("a: [unclosed")
    with pytest.raises(SnapshotError):
        parse_snapshot("- 1\n- 2\n")
    state = parse_snapshot(yaml.safe_dump_all([{"kind": "ConfigMap", "metadata": {"name": "x"}},
                                               {"metadata": {"name": "nokind"}}]))
    assert [(s.object, s.reason, s.invalid) for s in state.skipped] == [
        ("ConfigMap x", "kind not used by the proxy", False),
        ("item 2", "not a Kubernetes object: it has no kind (metadata.name nokind)", True)]


def test_one_bad_object_does_not_hide_the_others() -> None:
    state = build_state([
        make_service("ns", "good"),
        make_service("ns", "bad", lambda s: s["spec"].update(clusterIPs=["nope"])),
        make_slice("ns", "good", [ep("10.244.1.1")]),
        make_slice("ns", "bad", [ep("10.244.1.999")]),
    ])
    assert [str(p.name) for p in state.ports] == ["ns/good:http"]
    assert {s.object for s in state.skipped} == {"Service ns/bad", "EndpointSlice ns/bad-ipv4"}


def test_objects_without_a_name_are_each_reported() -> None:
    """The cache keys objects by namespace/name, as the API does: one without a name is no
    event for it, and each is reported by its item, not folded into one."""
    nameless = make_service("ns", "svc")
    del nameless["metadata"]["name"]
    state = build_state([make_service("ns", "svc"), nameless, {**nameless, "spec": {}}])
    assert [str(p.name) for p in state.ports] == ["ns/svc:http"]
    assert [(s.object, s.reason) for s in state.skipped] == [
        ("Service", "item 2 has no metadata.name"), ("Service", "item 3 has no metadata.name")]


# --- explain ----------------------------------------------------------------------------------


def example_report(node: str, **kw: Any) -> dict[str, Any]:
    return explain_report(parse_snapshot(EXAMPLE.read_text()), node, **kw)


def entry(report: dict[str, Any], service: str, family: str = "IPv4") -> dict[str, Any]:
    (found,) = [e for e in report["services"]
                if e["service"] == service and e["ipFamily"] == family]
    return found


def test_explain_json_contract_on_the_example() -> None:
    report = example_report("node-c")
    assert report["node"]["name"] == "node-c"
    assert report["node"]["labels"]["topology.kubernetes.io/zone"] == "zone-2"
    assert len(report["services"]) >= 30
    web = entry(report, "demo/web")
    assert set(web) >= {"service", "port", "protocol", "clusterIPs", "internalTrafficPolicy",
                        "externalTrafficPolicy", "topology", "clusterEndpoints",
                        "localEndpoints", "reasons"}
    assert web["port"] == "http" and web["protocol"] == "TCP"
    assert web["clusterIPs"] == ["10.96.0.10"]
    assert web["localEndpoints"] is None and len(web["clusterEndpoints"]) == 3
    assert entry(report, "demo/zonal")["topology"] == "PreferSameZone"
    assert entry(report, "demo/zonal")["clusterEndpoints"] == ["10.244.3.13:8080"]
    assert entry(report, "demo/same-node")["topology"] == "PreferSameNode"
    assert entry(report, "demo/nearest")["topology"] == "TopologyKeys:kubernetes.io/hostname"
    assert entry(report, "demo/node-only")["clusterEndpoints"] == []
    assert entry(report, "demo/local-only")["clusterEndpoints"] is None
    assert entry(report, "demo/local-only")["localEndpoints"] == []
    assert entry(report, "demo/lb-local")["localEndpoints"] == ["10.244.3.18:8080"]
    assert entry(report, "demo/dual", "IPv6")["clusterIPs"] == ["fd00:96::20"]
    zone_gone = entry(report, "demo/zone-gone")
    assert zone_gone["topology"] == "None"
    assert any("no endpoint is hinted for zone zone-2" in r for r in zone_gone["reasons"])
    skipped = {s["object"]: s for s in report["skipped"]}
    assert skipped["Service demo/broken"]["invalid"]
    assert not skipped["Service demo/headless"]["invalid"]
    json.dumps(report)  # serialisable as is


def test_explain_differs_per_node() -> None:
    a = entry(example_report("node-a"), "demo/zonal")["clusterEndpoints"]
    c = entry(example_report("node-c"), "demo/zonal")["clusterEndpoints"]
    assert a == ["10.244.1.11:8080", "10.244.2.12:8080"] and c == ["10.244.3.13:8080"]


def test_explain_unknown_node_warns() -> None:
    report = example_report("node-z")
    assert "not in the snapshot" in report["warnings"][0]


def test_explain_table() -> None:
    text = format_table(example_report("node-a", service=ServiceKey("demo", "nearest")))
    lines = text.splitlines()
    assert lines[0] == "node node-a (zone zone-1)"
    assert lines[1].split() == ["SERVICE", "PORT", "FAMILY", "TOPOLOGY", "CLUSTER", "ENDPOINTS",
                                "LOCAL", "ENDPOINTS"]
    assert "TopologyKeys:topology.kubernetes.io/zone" in lines[2]
    assert "10.244.2.13:8080" in lines[2] and "(not used)" in lines[2]
    assert any("no endpoint matches, next key" in line for line in lines)


def test_cli_explain_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "-f", str(EXAMPLE), "--node", "node-b", "-o", "json",
                 "--service", "demo/web"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [e["service"] for e in report["services"]] == ["demo/web"]
    assert main(["explain", "-f", str(EXAMPLE), "--node", "node-b", "--service", "x/y"]) == 1
    assert "not in the snapshot" in capsys.readouterr().err
    assert main(["explain", "-f", "/nonexistent.yaml", "--node", "n"]) == 1
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["explain", "-f", str(EXAMPLE), "--node", "n", "--service", "noslash"])
    assert exc.value.code == 2


def test_console_script_runs() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "pyproxy"), "explain", "-f", str(EXAMPLE), "--node",
         "node-a"], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.startswith("node node-a")
