"""Strict offline inputs (issue 27, point 5): trace's arguments checked and named, snapshots
with nothing usable refused, duplicates and conflicting claims reported the same way by
explain, render, apply and trace, readable tables for big services, errors naming the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from pyproxy.cli import main
from pyproxy.cluster.sources import SnapshotSource
from pyproxy.config import ProxyConfig
from pyproxy.run import Daemon, build_daemon
from pyproxy.serve.live import handlers
from testkit.builders import ep, make_node, make_service, make_slice
from testkit.fakes import FakeNft
from testkit.netlab import Lab

PYPROXY = str(Path(sys.executable).parent / "pyproxy")


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    saved = structlog.get_config()
    yield None
    structlog.configure(**saved)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(tmp_path: Path, *objects: Any, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(objects))
    return path


def snapshot_daemon(path: Path, nft: FakeNft) -> tuple[Daemon, SnapshotSource]:
    """The daemon `pyproxy run --snapshot` builds, on a fake kernel, and its source; not
    started (the test reads the file and syncs), the source's list expected."""
    config = ProxyConfig(snapshot=str(path), hostname_override="node-a",
                         healthz_bind_address=None, metrics_bind_address=None)
    daemon = build_daemon(config, interface_ips=("192.168.50.1",), kernel=lambda family: nft)
    assert isinstance(daemon.source, SnapshotSource)
    daemon.proxier.expect(daemon.source.NAME)
    return daemon, daemon.source


def dual_stack(tmp_path: Path) -> Path:
    service = make_service("demo", "web", ip="10.96.0.10")
    service["spec"].update(clusterIPs=["10.96.0.10", "fd00:96::10"],
                           ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack")
    return snapshot(tmp_path, make_node("node-a"), service,
                    make_slice("demo", "web", [ep("fd00:244::5", "node-a")], family="IPv6"))


class TestTrace:
    @pytest.mark.parametrize(("argv", "message"), [
        pytest.param(["--src=10.0.0.1", "--dst=10.96.0.10:0"],
                     "--dst: destination '10.96.0.10:0': port 0 is outside 1..65535", id="port 0"),
        pytest.param(["--src=10.0.0.1", "--dst=10.96.0.10:65536/udp"],
                     "--dst: destination '10.96.0.10:65536/udp': port 65536 is outside "
                     "1..65535", id="port 65536"),
        pytest.param(["--src=10.0.0.1", "--dst=[fd00:96::10]:80"],
                     "--src 10.0.0.1 is IPv4 and --dst fd00:96::10 is IPv6: a connection has "
                     "one family", id="mixed families"),
        pytest.param(["--src=pod-a", "--dst=10.96.0.10:80"],
                     "--src: 'pod-a' is not an IP address", id="src not an IP"),
        pytest.param(["--src=10.0.0.1", "--dst=web:80"],
                     "--dst: destination 'web:80': 'web' is not an IP address",
                     id="dst not an IP"),
        pytest.param(["--src=10.0.0.1", "--dst=10.96.0.10"],
                     "--dst: destination '10.96.0.10': expected IP:PORT[/PROTO]", id="no port"),
        pytest.param(["--src=10.0.0.1", "--dst=10.96.0.10:80", "--sport=70000"],
                     "--sport: expected a port in 1..65535, got '70000'", id="sport"),
    ])
    @pytest.mark.parametrize("mode", ["offline", "live"])
    def test_refused_naming_the_flag(self, argv: list[str], message: str, mode: str,
                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Exit code 2 offline and live alike (live: before the daemon is asked)."""
        where = (["-f", str(dual_stack(tmp_path)), "--node=node-a"] if mode == "offline"
                 else [f"--socket={tmp_path}/none.sock"])
        assert cli(capsys, "trace", *where, *argv)[1:] == ("", f"pyproxy: {message}\n")
        assert main(["trace", *where, *argv]) == 2

    def test_ipv6_destination_is_bracketed(self, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = cli(capsys, "trace", "-f", str(dual_stack(tmp_path)), "--node=node-a",
                           "--src=fd00:244::9", "--dst=[fd00:96::10]:80", "-o", "json")
        assert code == 0
        result = json.loads(out)
        assert result["dst"] == "[fd00:96::10]:80/tcp"
        assert result["candidates"][0]["endpoint"].startswith("[fd00:244::5]:")


class TestNothingUsable:
    CASES = [
        pytest.param("", "no objects", id="empty"),
        pytest.param("foo: bar\n", "1 object(s), none usable: item 1: not a Kubernetes "
                     "object: it has no kind", id="not Kubernetes"),
        pytest.param(yaml.safe_dump(make_service("demo", "web", ip="10.96.0.999")),
                     "1 object(s), none usable: Service demo/web: spec.clusterIPs[0]: "
                     "'10.96.0.999' is not an IP address", id="everything invalid"),
    ]

    @pytest.mark.parametrize(("text", "why"), CASES)
    @pytest.mark.parametrize("command", ["render", "apply", "explain", "trace"])
    def test_refused(self, command: str, text: str, why: str, tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
        path = tmp_path / "cluster.yaml"
        path.write_text(text)
        extra = ["--src=10.0.0.1", "--dst=10.96.0.10:80"] if command == "trace" else []
        code, out, err = cli(capsys, command, "-f", str(path), "--node=node-a", *extra)
        assert (code, out) == (1, "")
        allow = "; --allow-empty goes on anyway" if command in ("render", "apply") else ""
        assert err == (f"pyproxy: {path}: nothing usable in this snapshot ({why}); expected "
                       "what `kubectl get nodes,services,endpointslices -A -o yaml` prints"
                       f"{allow}\n")

    def test_render_allow_empty(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        path = tmp_path / "cluster.yaml"
        path.write_text("")
        code, out, _ = cli(capsys, "render", "-f", str(path), "--node=node-a", "--allow-empty")
        assert code == 0 and out.startswith("add table ip pyproxy")

    @pytest.mark.netns
    def test_apply_allow_empty(self, lab: Lab, tmp_path: Path) -> None:
        """In a throwaway namespace: refused, then programmed with --allow-empty."""
        ns = lab.add_ns("apply")
        path = tmp_path / "cluster.yaml"
        path.write_text("")
        argv = [PYPROXY, "apply", "-f", str(path), "--node=node-a", "--node-ip=192.0.2.1"]
        assert lab.run(ns, argv, check=False).returncode == 1
        assert lab.run(ns, ["nft", "list", "tables"]).stdout == ""
        assert lab.run(ns, [*argv, "--allow-empty"], check=False).returncode == 0
        assert lab.run(ns, ["nft", "list", "tables"]).stdout.split() == [
            "table", "ip", "pyproxy"]

    def test_yaml_errors_name_the_file(self, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
        path = tmp_path / "cluster.yaml"
        path.write_text("items: [\n")
        code, _, err = cli(capsys, "explain", "-f", str(path), "--node=node-a")
        assert code == 1
        assert err == (f"pyproxy: {path}: not valid YAML or JSON: while parsing a flow node: "
                       "did not find expected node content at line 2, column 1\n")


class TestReportedTheSameEverywhere:
    def test_non_kubernetes_items_are_named(self, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
        path = snapshot(tmp_path, make_node("node-a"), {"metadata": {"name": "x"}},
                        {"kind": "ConfigMap", "metadata": {"name": "y", "namespace": "z"}})
        code, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "-o", "json")
        assert code == 0
        assert json.loads(out)["skipped"] == [
            {"object": "item 2", "reason": "not a Kubernetes object: it has no kind "
             "(metadata.name x)", "invalid": True},
            {"object": "ConfigMap y", "reason": "kind not used by the proxy", "invalid": False}]

    def test_duplicate_service_the_later_is_used(self, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
        path = snapshot(tmp_path, make_node("node-a"), make_service("demo", "web", ip="10.96.0.10"),
                        make_slice("demo", "web", [ep("10.244.1.5", "node-a")]),
                        make_service("demo", "web", ip="10.96.0.20"))
        reason = ("duplicate: item 2 is ignored, item 4 (the same Service, later in the "
                  "snapshot) is used")
        _, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "-o", "json")
        report = json.loads(out)
        assert [s["clusterIPs"] for s in report["services"]] == [["10.96.0.20"]]
        assert report["skipped"] == [{"object": "Service demo/web", "reason": reason,
                                      "invalid": True}]
        _, out, err = cli(capsys, "render", "-f", str(path), "--node=node-a")
        assert "10.96.0.20" in out and "10.96.0.10" not in out
        assert err == f"pyproxy: skipped Service demo/web: {reason}\n"
        _, out, err = cli(capsys, "trace", "-f", str(path), "--node=node-a",
                          "--src=10.0.0.1", "--dst=10.96.0.20:80")
        assert out.startswith("10.0.0.1 -> 10.96.0.20:80/tcp: DNAT (service demo/web:http)")
        assert err == f"pyproxy: skipped Service demo/web: {reason}\n"

    def test_duplicate_endpoint_slice(self, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
        path = snapshot(tmp_path, make_node("node-a"), make_service("demo", "web", ip="10.96.0.10"),
                        make_slice("demo", "web", [ep("10.244.1.5", "node-a")]),
                        make_slice("demo", "web", [ep("10.244.1.6", "node-a")]))
        _, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "-o", "json")
        report = json.loads(out)
        assert [e.split(":")[0] for e in report["services"][0]["clusterEndpoints"]] == \
            ["10.244.1.6"]
        [skipped] = report["skipped"]
        assert skipped["object"].startswith("EndpointSlice demo/")
        assert "duplicate: item 3 is ignored, item 4" in skipped["reason"]

    def test_two_services_claiming_one_external_ip_and_port(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """explain names both and the one used; render and trace use that one and say so."""
        services = []
        for name, ip in (("b", "10.96.0.11"), ("a", "10.96.0.10")):
            service = make_service("demo", name, ip=ip)
            service["spec"]["externalIPs"] = ["192.0.2.50"]
            services.append(service)
        path = snapshot(tmp_path, make_node("node-a"), *services,
                        make_slice("demo", "a", [ep("10.244.1.5", "node-a")]),
                        make_slice("demo", "b", [ep("10.244.1.6", "node-a")]))
        code, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "-o", "json")
        [conflict] = json.loads(out)["conflicts"]
        assert (conflict["family"], conflict["claimedBy"], conflict["used"]) == \
            ("IPv4", ["demo/a:http", "demo/b:http"], ["demo/a:http"])
        assert "service-ips { 192.0.2.50 . tcp . 80 }" in conflict["elements"]
        code, table, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a")
        assert "conflicts:\n  " in table
        assert "(IPv4): claimed by demo/a:http, demo/b:http; the rules of demo/a:http are " \
               "used" in table
        code, out, err = cli(capsys, "trace", "-f", str(path), "--node=node-a",
                             "--src=10.0.0.1", "--dst=192.0.2.50:80")
        assert code == 0 and "(service demo/a:http)" in out.splitlines()[0]
        assert "10.244.1.5" in out and "10.244.1.6" not in out
        line = "(IPv4): claimed by demo/a:http, demo/b:http; the rules of demo/a:http are used"
        assert err.startswith("pyproxy: conflict: ") and line in err
        _, out, err = cli(capsys, "render", "-f", str(path), "--node=node-a")
        assert err.startswith("pyproxy: conflict: ") and line in err

    def test_the_daemon_reads_a_snapshot_as_explain_and_render_do(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Issue 30, point 3: the daemon's --snapshot feeds the same items to the same cache
        as the offline commands. Its explain (what the debug socket answers) skips the same
        copy of a duplicate Service for the same reason and names the same conflict; its
        rules use the same copy. Reading the file again without the copy forgets it."""
        claiming = []
        for name, ip in (("b", "10.96.0.11"), ("a", "10.96.0.12")):
            service = make_service("demo", name, ip=ip)
            service["spec"]["externalIPs"] = ["192.0.2.50"]
            claiming.append(service)
        objects = [make_node("node-a"), make_service("demo", "web", ip="10.96.0.10"),
                   make_slice("demo", "web", [ep("10.244.1.5", "node-a")]), *claiming,
                   make_service("demo", "web", ip="10.96.0.20")]
        path = snapshot(tmp_path, *objects)
        _, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "-o", "json")
        offline = json.loads(out)
        _, rendered, _ = cli(capsys, "render", "-f", str(path), "--node=node-a")
        assert "10.96.0.20" in rendered and "10.96.0.10" not in rendered

        nft = FakeNft()
        daemon, source = snapshot_daemon(path, nft)
        proxier = daemon.proxier
        assert source.poll() and proxier.sync()
        explain = handlers(proxier, daemon.health, daemon.runner, lambda: None)["/explain"]
        code, live = explain({})
        assert code == 200
        assert [s["object"] for s in offline["skipped"]] == ["Service demo/web"]
        assert live["skipped"] == offline["skipped"]
        assert live["services"] == offline["services"]
        assert [c["used"] for c in live["conflicts"]] == [["demo/a:http"]]
        assert live["conflicts"] == offline["conflicts"]
        assert "10.96.0.20" in nft.last and "10.96.0.10" not in nft.last

        path.write_text(yaml.safe_dump_all(objects[:-1]))
        assert source.poll() and proxier.sync()
        assert explain({})[1]["skipped"] == []
        assert "10.96.0.10" in nft.last


    def test_a_snapshots_bad_input_is_counted_however_it_is_caught(
            self, tmp_path: Path) -> None:
        """An object the snapshot's reading skips (here an EndpointSlice without a name, which
        the cache cannot key) is bad input as much as one the converter refuses: counted in
        the daemon's invalid objects (status, the metric's hook) and logged, once per
        reading that newly has it. `make chaos`'s bad-input drill found 39 such slices
        uncounted (753 of 792) once snapshots were read as the offline commands read them."""
        nameless = make_slice("demo", "web", [ep("10.244.1.6", "node-a")])
        del nameless["metadata"]["name"]
        broken = make_service("demo", "bad", ip="10.96.0.99")
        broken["spec"]["ports"][0]["port"] = 0
        objects = [make_node("node-a"), make_service("demo", "web", ip="10.96.0.10"),
                   make_slice("demo", "web", [ep("10.244.1.5", "node-a")]), nameless, broken]
        path = snapshot(tmp_path, *objects)
        daemon, source = snapshot_daemon(path, FakeNft())
        proxier = daemon.proxier

        def counted(kind: str) -> float | None:
            return daemon.metrics.registry.get_sample_value(
                "pyproxy_invalid_objects_total", {"kind": kind})

        assert source.poll() and proxier.sync()
        assert proxier.skipped_total == {"EndpointSlice": 1, "Service": 1}
        assert counted("EndpointSlice") == counted("Service") == 1
        # Read again with one more object: what was skipped before is not counted twice.
        path.write_text(yaml.safe_dump_all([*objects, make_service("demo", "more",
                                                                   ip="10.96.0.11")]))
        assert source.poll() and proxier.sync()
        assert proxier.skipped_total == {"EndpointSlice": 1, "Service": 1}
        assert counted("EndpointSlice") == counted("Service") == 1


def test_a_big_service_keeps_its_row_readable(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """300 endpoints: the table shows three and how many more; -o json has them all."""
    endpoints = [ep(f"10.244.{i // 250}.{i % 250 + 1}", "node-a") for i in range(300)]
    path = snapshot(tmp_path, make_node("node-a"), make_service("demo", "big", ip="10.96.0.10"),
                    make_slice("demo", "big", endpoints))
    _, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a")
    row = next(line for line in out.splitlines() if line.startswith("demo/big"))
    assert len(row) < 150, row
    assert row.split()[4].count(",") == 2 and row.split()[5:8] == ["+", "297", "more"]
    assert "(endpoint lists are cut after 3: -o json has them all)" in out
    _, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "-o", "json")
    assert len(json.loads(out)["services"][0]["clusterEndpoints"]) == 300


def sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no room (a hole): a huge snapshot, made instantly."""
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


class TestLimits:
    """A snapshot nested too deep or too large is an error naming the file and the limit
    (issue 35, point 4): 5,000 levels were a RecursionError traceback, in YAML and in JSON."""

    @pytest.mark.parametrize(("name", "text", "where"), [
        pytest.param("deep.yaml", "items:\n- " + "[" * 5000 + "]" * 5000 + "\n", " at line 2",
                     id="YAML, flow"),
        pytest.param("deep.yaml", "items:\n" + "".join(f"{' ' * i}- k:\n" for i in
                                                       range(0, 10000, 2)), " at line 51",
                     id="YAML, block"),
        pytest.param("deep.json", '{"items": [' + "[" * 5000 + "]" * 5000 + "]}", "",
                     id="JSON"),
    ])
    def test_5000_deep(self, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                       text: str, where: str) -> None:
        """Every offline command says so in one line and exits 1."""
        path = tmp_path / name
        path.write_text(text)
        code, out, err = cli(capsys, "explain", "-f", str(path), "--node=node-a")
        assert (code, out) == (1, "")
        assert f"pyproxy: {path}: nested deeper than 100 levels (the limit){where}\n" == err

    def test_a_huge_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A file beyond the limit is refused by its size, before it is read."""
        path = sparse(tmp_path / "huge.yaml", 8 << 30)
        code, _, err = cli(capsys, "render", "-f", str(path), "--node=node-a")
        assert code == 1
        assert f"pyproxy: {path}: larger than 512 MiB, the limit for a snapshot\n" == err

    def test_the_daemon_keeps_its_rules(self, tmp_path: Path) -> None:
        """The daemon's --snapshot source reports a file beyond the limits as a reading that
        failed (logged, counted), as a broken file, and goes on with what it had."""
        path = snapshot(tmp_path, make_node("node-a"),
                        make_service("demo", "web", ip="10.96.0.10"))
        _, source = snapshot_daemon(path, FakeNft())
        assert source.poll()
        path.write_text("items:\n- " + "[" * 5000 + "]" * 5000 + "\n")
        assert not source.poll()
        assert f"{path}: nested deeper than 100 levels (the limit) at line 2" == source.last_error
        sparse(path, 8 << 30)
        assert not source.poll()
        assert f"{path}: larger than 512 MiB, the limit for a snapshot" == source.last_error
        assert source.errors == 2


class TestExplainOfAServiceThatDoesNotExist:
    """explain NS/NAME exits 1 when there is no such Service (issue 35, point 4)."""

    def test_an_endpointslice_of_that_name_is_not_the_service(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A skipped EndpointSlice named as the Service asked for (hand-made slices often
        are) made explain exit 0 with the slice listed, as if the Service existed."""
        orphan = make_slice("demo", "web", [ep("10.244.1.5", "node-a")], name="ghost")
        del orphan["metadata"]["labels"]["kubernetes.io/service-name"]
        path = snapshot(tmp_path, make_node("node-a"), make_service("demo", "web"), orphan)
        code, out, err = cli(capsys, "explain", "-f", str(path), "--node=node-a", "demo/ghost")
        assert (code, out) == (1, "")
        assert err == "pyproxy: service demo/ghost is not in the snapshot\n"

    def test_a_service_skipped_is_one_that_exists(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A Service that is there but not proxied (headless) is explained: exit 0, and why."""
        headless = make_service("demo", "db", lambda s: s["spec"].update(clusterIP="None"))
        path = snapshot(tmp_path, make_node("node-a"), make_service("demo", "web"), headless)
        code, out, _ = cli(capsys, "explain", "-f", str(path), "--node=node-a", "demo/db")
        assert code == 0
        assert "Service demo/db (not proxied): headless" in out
