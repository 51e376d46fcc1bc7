"""conformance: upstream's own e2e tests (k8s.io/kubernetes/test/e2e of the pinned release) on
the real cluster of testkit/cluster.py, with kube-proxy's DaemonSet (nftables mode, the
control) or pyproxy's.

    python -m testkit.conformance --proxy pyproxy --services   # Services [Conformance] only
    python -m testkit.conformance --markdown docs/conformance.md     # make conformance

`make k8s` builds e2e.test and ginkgo (the version k8s.io/kubernetes requires) beside the
control plane. The suite runs inside the cluster's ``outside`` namespace: it reaches the API
server's real address and every node's address (NodePort tests connect from the test
process), as a test runner beside a real cluster does. Every image the selected tests use is
already in every node's containerd under the name test/utils/image expects
(testkit/images.py); a pull with policy Always goes to registry.k8s.io's mirror, which holds the
same images (RealCluster's mirror). The control plane's namespace is a node too, where the
proxy's DaemonSet runs, so kube-apiserver reaches webhooks and aggregated API servers at their
Services' ClusterIPs through the proxy under test, as on kind's control-plane node (RealCluster's
control_plane_node). Both proxies' runs use the same cluster setup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from testkit.cluster import RealCluster, deploy_kube_proxy, node_tables, running_cluster
from testkit.controlplane import (
    API_IP,
    binaries_dir,
    kubeconfig,
    wait_for,
    write_kubeconfig,
)

# Upstream's nftables jobs (kind, kube-proxy in nftables mode): this focus and skip.
FOCUS = r"\[sig-network\]|\[Conformance\]"
SKIP = (r"Alpha|Beta|LoadBalancer|Disruptive|Flaky|Networking-IPv6|IPv6DualStack"
        r"|LocalhostNodePorts")
SERVICES_CONFORMANCE = r"\[sig-network\] Services.*\[Conformance\]"
# What this lab cannot do, skipped on top of upstream's selection: its CNI (ptp) enforces no
# NetworkPolicy (kind's kindnet does), so those tests judge a policy engine that is not there
# and fail with either proxy, each after minutes of retries.
LAB_SKIP = r"Feature:NetworkPolicy"
# Why a test fails here with either proxy: a limit of this machine or of what is built on it,
# not of a proxy (matched against the test's name; the report names every failing test).
LAB_LIMITS = (
    (r"SCTPConnectivity|: sctp", "this kernel has no SCTP (`CONFIG_IP_SCTP` off): the test's "
     "pods cannot open SCTP sockets and never get ready"),
    (r"Internet connection for containers", "this machine reaches no Internet (only Debian's "
     "archive and the Go module proxy)"),
    (r"should forward PTR records lookup to upstream nameserver", "before it points CoreDNS "
     "at its own server, it resolves 8.8.8.8's PTR record (dns.google.) through the cluster's "
     "upstream resolver: this machine reaches no Internet"),
    (r"should run iperf2", "agnhost's iperf is Debian bookworm's 2.1.8, whose enhanced CSV "
     "lines have 9 fields where the test parses the 17 of upstream's Alpine build"),
    (r"should support configurable pod resolv.conf", "the agnhost built for that run lacked "
     "upstream's /coredns, which the test runs in an agnhost pod (added in 53953ef; run alone "
     "since, it passed with both proxies)"),
    (r"ImageVolume should succeed with pod and pull policy of Always", "it reads "
     "/etc/os-release from its kitten:1.8 image volume and expects `Alpine Linux` there: "
     "upstream's kitten is built on agnhost, whose base is Alpine 3.21 "
     "(test/images/agnhost/BASEIMAGE), and no Alpine is built here: the kitten built here, on "
     "this lab's agnhost, has Debian bookworm's (its pull with policy Always, from the mirror, "
     "and its data.json pass)"),
    (r"consumable via the environment|consumable as environment variable names", "its pod "
     "runs `sh -c env` in the busybox image and looks for variables named `data-1`, "
     "`p-data-1`…: the busybox built here is Debian's busybox-static, whose ash drops "
     "environment variables whose names are not shell identifiers before `env` runs (checked "
     "with bookworm's 1.35 and trixie's 1.37: `env data-1=x busybox sh -c env` prints no "
     "data-1); upstream's busybox image keeps them"),
    (r"Sysctls \[LinuxOnly\] should support sysctls \[", "its pod execs `/bin/sysctl` in "
     "the busybox image; Debian's busybox-static lists sysctl as /sbin/sysctl, which is "
     "where the image built here links it (upstream's image links every applet in /bin)"),
    (r"should set TCP CLOSE_WAIT timeout", "its image, `build-image/distroless-iptables`, is "
     "not built here; and both DaemonSets leave the node's conntrack sysctls alone "
     "(kube-proxy's in this lab: the nodes share one kernel; pyproxy's by design, it runs "
     "unprivileged: docs/deploying.md), so the 1 h CLOSE_WAIT timeout it checks is not set"),
)
SELECTION_FILE = "selection.json"
# ginkgo's own limit for a run; the process gets a little more to write its reports.
RUN_LIMIT = 3 * 3600


@dataclass(frozen=True)
class Case:
    name: str
    status: str  # passed, failed, skipped
    seconds: float
    message: str = ""


@dataclass
class Run:
    proxy: str
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0
    junit: Path | None = None

    def count(self, status: str) -> int:
        return sum(1 for c in self.cases if c.status == status)


def e2e_kubeconfig(cluster: RealCluster) -> Path:
    """Admin, at the API server's real address (the suite runs in ``outside``)."""
    return write_kubeconfig(cluster.lab.workdir / "e2e.kubeconfig",
                            kubeconfig(f"https://{API_IP}:6443", cluster.plane.pki.ca,
                                       cert=cluster.plane.pki.admin,
                                       key=cluster.plane.pki.admin_key))


@dataclass(frozen=True)
class Selection:
    """What one run of the suite asked for; saved beside its reports (selection.json) so that
    a report can be written later from several runs, each with its own selection."""

    focus: str
    skip: str
    procs: int
    nodes: int
    # The cluster it ran on: the control plane's namespace a node too, where the proxy's
    # DaemonSet runs (kube-apiserver reaches Services through it), and registry.k8s.io's
    # mirror. False in the reports of runs from before either existed.
    control_plane_node: bool = False
    mirror: bool = False

    def save(self, report_dir: Path) -> None:
        (report_dir / SELECTION_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, report_dir: Path) -> Selection:
        return cls(**json.loads((report_dir / SELECTION_FILE).read_text()))


@dataclass
class Part:
    """One selection's runs (one per proxy), read back from its report folder."""

    selection: Selection
    runs: list[Run]


def run_suite(cluster: RealCluster, proxy: str, focus: str, skip: str, report_dir: Path,
              parallel: int = 2, timeout: float = RUN_LIMIT + 600) -> Run:
    bin_dir = binaries_dir()
    report_dir.mkdir(parents=True, exist_ok=True)
    Selection(focus, skip, parallel, len(cluster.nodes), cluster.control_plane is not None,
              cluster.mirror).save(report_dir)
    config = e2e_kubeconfig(cluster)
    argv = [str(bin_dir / "ginkgo"), f"--procs={parallel}", f"--focus={focus}",
            f"--skip={skip}", f"--timeout={RUN_LIMIT}s", "--no-color", "--junit-report",
            f"junit-{proxy}.xml", "--output-dir", str(report_dir),
            str(bin_dir / "e2e.test"), "--",
            f"--kubeconfig={config}", "--provider=local",
            f"--num-nodes={len(cluster.nodes)}", "--node-os-distro=debian",
            f"--report-dir={report_dir}", "--dump-logs-on-failure=false",
            "--allowed-not-ready-nodes=0"]
    log = report_dir / f"e2e-{proxy}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        subprocess.run(["ip", "netns", "exec", cluster.outside.full, *argv], stdout=out,
                       stderr=subprocess.STDOUT, timeout=timeout, check=False,
                       env={**os.environ, "HOME": str(cluster.lab.workdir)})
    run = Run(proxy, seconds=time.monotonic() - started, junit=report_dir / f"junit-{proxy}.xml")
    if run.junit is not None and run.junit.exists():
        run.cases = read_junit(run.junit)
    return run


def junit_seconds(path: Path) -> float:
    """How long the run took, as ginkgo wrote it in its report (the suite's wall-clock)."""
    return float(ET.parse(path).getroot().get("time", "0"))


def read_junit(path: Path) -> list[Case]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if name.startswith(("[SynchronizedBeforeSuite]", "[SynchronizedAfterSuite]",
                            "[ReportBeforeSuite]", "[ReportAfterSuite]", "[BeforeSuite]",
                            "[AfterSuite]")):
            continue
        status = case.get("status", "")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if status not in ("passed", "failed", "skipped"):
            status = "failed" if failure is not None else (
                "skipped" if case.find("skipped") is not None else "passed")
        message = ((failure.get("message") or failure.text or "") if failure is not None
                   else "")
        cases.append(Case(name, status, float(case.get("time", "0") or 0),
                          " ".join(message.split())[:300]))
    return cases


@contextlib.contextmanager
def cluster_with(proxy: str, nodes: int) -> Iterator[RealCluster]:
    """A fresh cluster with one proxy: pyproxy's DaemonSet, or kube-proxy's alone."""
    with running_cluster(nodes, with_pyproxy=proxy == "pyproxy",
                         control_plane_node=True, mirror=True) as cluster:
        if proxy == "kube-proxy":
            deploy_kube_proxy(cluster)
            cluster.rollout("deployment", "coredns")
        # The DaemonSet's pod on the control plane's node has programmed it: kube-apiserver
        # reaches webhooks and aggregated APIs at their ClusterIP through it.
        control_plane = cluster.control_plane
        assert control_plane is not None
        table = "kube-proxy" if proxy == "kube-proxy" else "pyproxy"
        wait_for(lambda: table in node_tables(control_plane).split(), 120,
                 f"{proxy}'s table on the control plane's node")
        yield cluster


def table(runs: Sequence[Run]) -> str:
    """test | result with kube-proxy | result with pyproxy | seconds (pyproxy's)."""
    by_proxy = {run.proxy: {c.name: c for c in run.cases} for run in runs}
    # The selection's tests only: what both runs skipped (outside the focus) is left out.
    names = sorted({c.name for run in runs for c in run.cases if c.status != "skipped"})
    rows = ["| test | kube-proxy | pyproxy | seconds |", "|---|---|---|---:|"]
    for name in names:
        cells = []
        for proxy in ("kube-proxy", "pyproxy"):
            case = by_proxy.get(proxy, {}).get(name)
            cells.append("-" if case is None else case.status)
        seconds = next((c.seconds for p in ("pyproxy", "kube-proxy")
                        if (c := by_proxy.get(p, {}).get(name)) is not None), 0.0)
        rows.append(f"| {_cell(name)} | {cells[0]} | {cells[1]} | {seconds:.0f} |")
    return "\n".join(rows)


def merged(parts: Sequence[Part]) -> list[Run]:
    """Each proxy's runs over all parts as one: a test's result from the part that ran it
    (a test two selections both ran: the first part's)."""
    out = []
    for proxy in ("kube-proxy", "pyproxy"):
        runs = [run for part in parts for run in part.runs if run.proxy == proxy]
        if not runs:
            continue
        cases: dict[str, Case] = {}
        for run in runs:
            for case in run.cases:
                if case.name not in cases or cases[case.name].status == "skipped":
                    cases[case.name] = case
        out.append(Run(proxy, list(cases.values()), sum(r.seconds for r in runs)))
    return out


def report(parts: Sequence[Part], seconds: float, from_reports: bool) -> str:
    from testkit.images import RELEASE

    nodes = sorted({part.selection.nodes for part in parts})
    lines = [
        "# Upstream's e2e tests: kube-proxy and pyproxy side by side",
        "",
        "Written by `make conformance` (testkit/conformance.py); do not edit by hand.",
        "",
        f"- release: k8s.io/kubernetes {RELEASE} (e2e.test and ginkgo built from it)",
        f"- cluster: {' or '.join(map(str, nodes))} worker nodes (kubelet, containerd, runc) "
        "on one machine, testkit/cluster.py, a fresh one for each run",
        (f"- e2e time of the runs (their JUnit reports): {seconds / 60:.0f} min"
         if from_reports else f"- wall-clock time: {seconds / 60:.0f} min"),
        *lab_lines(parts),
    ]
    for number, part in enumerate(parts, 1):
        sel = part.selection
        lines += ["", f"Selection {number}: focus `{sel.focus}`, skip `{sel.skip}`, "
                  f"ginkgo processes {sel.procs}", ""]
        for run in part.runs:
            lines.append(f"- {run.proxy}: {run.count('passed')} passed, "
                         f"{run.count('failed')} failed, {run.count('skipped')} skipped "
                         f"({run.seconds / 60:.0f} min); JUnit report "
                         f"{run.junit.name if run.junit else '-'}")
    selections = {(part.selection.focus, part.selection.skip) for part in parts}
    if selections == {(FOCUS, f"{SKIP}|{LAB_SKIP}")}:
        lines += ["", f"Upstream's nftables job (focus `{FOCUS}`, skip `{SKIP}`) with "
                  f"`{LAB_SKIP}` skipped too: this lab's CNI (ptp) enforces no NetworkPolicy, "
                  "so those tests fail with either proxy."]
    elif selections != {(FOCUS, SKIP)}:
        lines += ["", f"Upstream's nftables job selects focus `{FOCUS}`, skip `{SKIP}`; "
                  "`make conformance` runs that by default, with "
                  f"`{LAB_SKIP}` skipped too (this lab's CNI enforces no NetworkPolicy). "
                  "The selections above are parts of it."]
    runs = merged(parts)
    lines += ["", *substitutes(), *failures(runs), table(runs), ""]
    return "\n".join(lines)


CONTROL_PLANE_NODE = (
    "- the control plane reaches Services through the proxy under test: its namespace is a "
    "node too (a kubelet there, tainted `node-role.kubernetes.io/control-plane:NoSchedule`, "
    "as kind's control-plane node), where the proxy's DaemonSet runs as on every node, so "
    "kube-apiserver's calls to a Service's ClusterIP (admission and conversion webhooks, "
    "aggregated APIs) are DNATed by that proxy and routed to the pod's worker node")
NO_CONTROL_PLANE_NODE = (
    "- the control plane ran outside the nodes, with no proxy and no route to the Service "
    "CIDR: kube-apiserver reached no ClusterIP (`network is unreachable`), so the webhook and "
    "aggregated-API tests could not pass with either proxy (runs from before `make "
    "conformance` made the control plane's namespace a node where the proxy's DaemonSet "
    "runs, through which kube-apiserver now reaches Services)")
MIRROR = (
    "- images: built here and loaded in every node's containerd; registry.k8s.io resolves to "
    "a mirror on the cluster's fabric (distribution's registry, built by `make k8s`) holding "
    "the same images, so a pull with policy Always finds them")
NO_MIRROR = ("- images: built here and loaded in every node's containerd; no registry "
             "answered, so a pull with policy Always failed (ErrImagePull; runs from before "
             "registry.k8s.io's mirror)")


def lab_lines(parts: Sequence[Part]) -> list[str]:
    """How the cluster of each selection's runs reached Services from the control plane and
    served images (selections that ran on different clusters are named)."""
    lines = []
    for attribute, (yes, no) in (("control_plane_node", (CONTROL_PLANE_NODE,
                                                          NO_CONTROL_PLANE_NODE)),
                                 ("mirror", (MIRROR, NO_MIRROR))):
        values = [getattr(part.selection, attribute) for part in parts]
        if len(set(values)) == 1:
            lines.append(yes if values[0] else no)
            continue
        for value in (True, False):
            if numbers := [str(n) for n, v in enumerate(values, 1) if v == value]:
                lines.append(f"{yes if value else no} ({_selections(numbers)})")
    return lines


def _selections(numbers: Sequence[str]) -> str:
    """'selection 3', 'selections 1 and 2', 'selections 1, 2 and 4'."""
    if len(numbers) == 1:
        return f"selection {numbers[0]}"
    return f"selections {', '.join(numbers[:-1])} and {numbers[-1]}"


def substitutes() -> list[str]:
    """The images built here under upstream's names from another version or source (the
    e2e manifest's tag older than the module's source, or no source of it in the module)."""
    from testkit.images import E2E_SUBSTITUTES

    return ["Images built here under the e2e manifest's names from other sources "
            "(testkit/images.py says why each is a faithful stand-in):", "",
            *(f"- `{name}`: {what}" for name, what in E2E_SUBSTITUTES.items()), ""]


def failures(runs: Sequence[Run]) -> list[str]:
    """Every failing test, with what it means: failing with pyproxy only (a defect to fix),
    or with both, and then the lab's limit that explains it, if one does."""
    failed = {run.proxy: {c.name for c in run.cases if c.status == "failed"} for run in runs}
    ours, theirs = failed.get("pyproxy", set()), failed.get("kube-proxy", set())
    lines = []
    for name in sorted(ours - theirs):
        lines.append(f"- **fails with pyproxy only**: {_cell(name)}")
    for name in sorted(ours & theirs):
        reason = next((why for pattern, why in LAB_LIMITS if re.search(pattern, name)),
                      "not explained yet")
        lines.append(f"- fails with both: {_cell(name)} — {reason}")
    for name in sorted(theirs - ours):
        lines.append(f"- fails with kube-proxy only: {_cell(name)}")
    return ["Failures:", "", *lines, ""] if lines else ["No test failed.", ""]


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.conformance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", choices=("pyproxy", "kube-proxy", "both"), default="both")
    parser.add_argument("--focus", default=FOCUS)
    parser.add_argument("--services", action="store_const", dest="focus",
                        const=SERVICES_CONFORMANCE, help="only Services [Conformance]")
    parser.add_argument("--skip", default=f"{SKIP}|{LAB_SKIP}",
                        help="default: upstream's nftables job's skip and " + LAB_SKIP)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--report-dir", default="/tmp/pyproxy-conformance")
    parser.add_argument("--markdown", help="write the report (docs/conformance.md) here")
    parser.add_argument("--from-reports", action="store_true",
                        help="no run: the report from the JUnit files in --report-dir, or in "
                        "each --part")
    parser.add_argument("--part", action="append", metavar="DIR",
                        help="with --from-reports: a report folder of one selection's runs "
                        "(its selection.json says which); repeat to report several together")
    args = parser.parse_args(argv)
    started = time.monotonic()
    proxies = ["kube-proxy", "pyproxy"] if args.proxy == "both" else [args.proxy]
    if args.from_reports:
        parts = [read_part(Path(folder), proxies, args) for folder in args.part
                 or [args.report_dir]]
    else:
        parts = [Part(Selection(args.focus, args.skip, args.procs, args.nodes,
                                control_plane_node=True, mirror=True),
                      [run_with(proxy, args) for proxy in proxies])]
    runs = merged(parts)
    print(table(runs))
    if args.markdown:
        seconds = (sum(run.seconds for run in runs) if args.from_reports
                   else time.monotonic() - started)
        Path(args.markdown).write_text(report(parts, seconds, args.from_reports))
    return 0 if all(r.count("failed") == 0 and r.cases for r in runs) else 1


def run_with(proxy: str, args: argparse.Namespace) -> Run:
    """The selection on a fresh cluster with this proxy, its failures printed."""
    with cluster_with(proxy, args.nodes) as cluster:
        print(f"{proxy}: cluster up in {cluster.up_seconds:.0f} s; running e2e.test",
              flush=True)
        run = run_suite(cluster, proxy, args.focus, args.skip, Path(args.report_dir),
                        args.procs)
    print(f"{proxy}: {run.count('passed')} passed, {run.count('failed')} failed, "
          f"{run.count('skipped')} skipped in {run.seconds:.0f} s", flush=True)
    for case in run.cases:
        if case.status == "failed":
            print(f"  FAILED {case.name}: {case.message}", flush=True)
    return run


def read_part(folder: Path, proxies: Sequence[str], args: argparse.Namespace) -> Part:
    """A report folder's runs; its selection.json, or (a folder from before it was written)
    the selection given on the command line."""
    selection = (Selection.load(folder) if (folder / SELECTION_FILE).exists()
                 else Selection(args.focus, args.skip, args.procs, args.nodes))
    runs = []
    for proxy in proxies:
        junit = folder / f"junit-{proxy}.xml"
        runs.append(Run(proxy, read_junit(junit), junit_seconds(junit), junit))
    return Part(selection, runs)

if __name__ == "__main__":
    sys.exit(main())
