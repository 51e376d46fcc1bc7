"""Bad input (hypothesis), injection payloads, regressions of fixed bugs, oversized objects:
in snapshot mode."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drills.harness import (
    NODE,
    PYPROXY,
    Daemon,
    Env,
    Obj,
    Result,
    SnapshotBench,
    running,
    snapshot_bench,
    sticky,
    until,
    web,
)
from testkit.builders import ep, make_node, make_service, make_slice


@dataclass
class Expectation:
    """Which of the objects written are valid services, and how many invalid ones per kind."""

    valid_services: set[str] = field(default_factory=set)
    invalid: Counter[str] = field(default_factory=Counter)
    hints: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, ns/name) → field


def offline_explain(path: Path) -> dict[str, Any]:
    out = subprocess.run([PYPROXY, "explain", "-f", str(path), "--node", NODE, "-o", "json"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    report: dict[str, Any] = json.loads(out)
    return report


def snapshot_services(path: Path, keys: set[str]) -> list[Obj]:
    """The Services of the snapshot file at `path` named "namespace/name" in `keys`."""
    items = json.loads(path.read_text())["items"]
    return [obj for obj in items if isinstance(obj, dict) and obj.get("kind") == "Service"
            and isinstance(obj.get("metadata"), dict)
            and f"{obj['metadata'].get('namespace')}/{obj['metadata'].get('name')}" in keys]


@dataclass
class Baseline:
    """Counters of a (possibly shared) daemon before a drill."""

    invalid: Counter[str]
    failures: int
    source_errors: int

    @classmethod
    def of(cls, daemon: Daemon) -> Baseline:
        status = daemon.status()
        return cls(Counter(status["invalidObjects"]), status["syncFailures"],
                   status["source"]["errors"])


def check_programmed(r: Result, env: Env, daemon: Daemon, path: Path, expect: Expectation,
                     before: Baseline | None = None) -> None:
    """The daemon is alive and healthy, the kernel holds what it committed, every valid
    service is programmed (live = offline explain = expectation) and every invalid object
    was skipped, with a reason, and counted."""
    before = before or Baseline(Counter(), 0, 0)
    r.check(daemon.alive, f"daemon exited:\n{daemon.log_tail()}")
    status = daemon.status()
    r.check(status["healthy"], "daemon not healthy")
    r.check(status["syncFailures"] == before.failures,
            f"{status['syncFailures'] - before.failures} failed syncs: "
            f"{(status['lastSync'] or {}).get('error')}")
    r.check(status["source"]["errors"] == before.source_errors,
            f"snapshot errors: {status['source']}")
    started = time.monotonic()
    clean = daemon.diff_clean()
    r.figures["pyproxy diff took"] = f"{time.monotonic() - started:.2f} s"
    r.check(clean, "pyproxy diff: the kernel differs from what was committed")
    live = {(e["service"], e["port"], e["protocol"], e["ipFamily"]) for e in daemon.services()}
    offline = offline_explain(path)
    offline_ports = {(e["service"], e["port"], e["protocol"], e["ipFamily"])
                     for e in offline["services"]}
    r.check(live == offline_ports, f"live and offline service ports differ: "
            f"{sorted(live ^ offline_ports)[:5]}")
    programmed = {key[0] for key in live}
    missing = expect.valid_services - programmed
    extra = programmed - expect.valid_services
    r.check(not missing, f"{len(missing)} valid services not programmed: {sorted(missing)[:5]}")
    if not r.check(not extra, f"{len(extra)} invalid services programmed: "
                              f"{[repr(x) for x in sorted(extra)[:5]]}"):
        # The object itself, as evidence; `python -m drills.fuzz --seed N --show NS/NAME`
        # regenerates it too (a seed draws the same objects in any process).
        r.notes += [f"programmed though broken: {json.dumps(obj)[:1500]}"
                    for obj in snapshot_services(path, extra)[:5]]
    skipped = [s for s in offline["skipped"] if s["invalid"]]
    kinds = Counter(s["object"].split(" ", 1)[0] for s in skipped)
    r.check(kinds == expect.invalid, f"skipped as invalid {dict(kinds)}, expected "
            f"{dict(expect.invalid)}")
    r.check(all(s["reason"] for s in skipped), "a skipped object without a reason")
    counted = Counter(status["invalidObjects"]) - before.invalid
    r.check(counted == expect.invalid, f"invalidObjects {dict(counted)}, expected "
            f"{dict(expect.invalid)}")
    for kind, count in expect.invalid.items():
        metric = daemon.metric("pyproxy_invalid_objects_total", f'{{kind="{kind}"}}')
        r.check(metric >= count, f"pyproxy_invalid_objects_total{{kind={kind}}} = {metric}")
    reasons = {s["object"]: s["reason"] for s in skipped}
    wrong = [(obj, hint, reasons.get(f"{obj[0]} {obj[1]}"))
             for obj, hint in expect.hints.items()
             if f"{obj[0]} {obj[1]}" in reasons and hint not in reasons[f"{obj[0]} {obj[1]}"]]
    r.check(not wrong, f"reasons not naming the field at fault: {wrong[:3]}")
    r.figures["valid services programmed"] = len(programmed)
    r.figures["invalid objects skipped"] = dict(kinds)


def bad_input(env: Env, count: int = 1000, seed: int = 20240611,
              known_bugs: bool = False) -> Result:
    from drills.fuzz import generate

    r = Result("bad-input", f"{count} generated Services/EndpointSlices (hypothesis, seed "
               f"{seed}), valid and broken, in one snapshot")
    started = time.monotonic()
    objects, expect, broken = generate(count, seed, known_bugs)
    r.figures["generation"] = f"{time.monotonic() - started:.1f} s"
    r.figures["cases"] = (f"{len(expect.valid_services)} valid services, invalid: "
                          f"{dict(expect.invalid)}")
    if known_bugs:
        from drills.fuzz import disagreements

        wrong = disagreements(objects, broken)
        r.figures["broken objects pyproxy accepts"] = len(wrong)
        for why, obj in wrong[:5]:
            r.notes.append(f"accepted: {json.dumps(obj)[:200]} ({why})")
    daemon, path = env.snapshot_daemon([make_node(NODE, "zone-1"), *objects], "fuzz",
                                       sync_period=30)
    with running(daemon):
        r.converge_s = daemon.wait_ready(timeout=300)
        r.converge_what = "start to first sync"
        check_programmed(r, env, daemon, path, expect)
        last = daemon.status()["lastFullSync"]
        r.figures["first sync"] = (f"{last['commands']} commands, kernel "
                                   f"{last['kernel_seconds']:.2f} s, total {last['seconds']:.2f} s")
    env.cleanup()
    return r


# Crafted values that try to break out of nft's syntax: quotes, braces, semicolons, newlines,
# comments. Every one carries the marker "pwn", which must never reach the kernel.
PAYLOADS = ['x"; flush ruleset; #pwn', "x } ; add table ip pwn", "x\nadd table ip pwn",
            "x#pwn", "x'pwn", "x;pwn", "x{pwn}", 'x\\"pwn', "x pwn", "pwn\r\n"]


def _injection_cases(env: Env, payload: str, n: int) -> list[tuple[str, Obj, str]]:
    """(field, object, kind) for one payload. Services get their own addresses."""
    ip = f"10.96.1.{n}"

    def svc(name: str, tweak: Callable[[Obj], None]) -> Obj:
        return make_service("ns", name, tweak, ip=ip)

    def sl(name: str, tweak: Callable[[Obj], None]) -> Obj:
        return make_slice("ns", "target", [ep(env.pod("pod-a"), "node-b")], tweak,
                          name=name)

    def set_(path: str, value: Any) -> Callable[[Obj], None]:
        def tweak(obj: Obj) -> None:
            *parents, last = path.split(".")
            node = obj
            for part in parents:
                node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
            node[last] = value
        return tweak

    def lb(obj: Obj) -> None:
        obj["spec"].update(type="LoadBalancer", ports=[{"name": "http", "port": 80,
                                                        "nodePort": 30100 + n}])
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": f"198.51.100.{n}"}]}}

    def both(*tweaks: Callable[[Obj], None]) -> Callable[[Obj], None]:
        def tweak(obj: Obj) -> None:
            for t in tweaks:
                t(obj)
        return tweak

    return [
        ("metadata.name", svc(payload, lambda o: None), "Service"),
        ("metadata.namespace", {**svc(f"i{n}", lambda o: None),
                                "metadata": {"namespace": payload, "name": f"i{n}"}},
         "Service"),
        ("spec.ports[0].name", svc(f"i{n}-pn", set_("spec.ports.0.name", payload)), "Service"),
        ("spec.ports[0].protocol", svc(f"i{n}-pr", set_("spec.ports.0.protocol", payload)),
         "Service"),
        ("spec.clusterIP", svc(f"i{n}-ip", both(set_("spec.clusterIP", f"10.96.1.{n}{payload}"),
                                                set_("spec.clusterIPs",
                                                     [f"10.96.1.{n}{payload}"]))), "Service"),
        ("spec.externalIPs", svc(f"i{n}-ex", set_("spec.externalIPs",
                                                  [f"192.0.2.{n}{payload}"])), "Service"),
        ("spec.loadBalancerSourceRanges", svc(f"i{n}-sr", both(
            lb, set_("spec.loadBalancerSourceRanges", [f"203.0.113.0/24{payload}"]))),
         "Service"),
        ("status.loadBalancer.ingress", svc(f"i{n}-lb", both(
            lb, set_("status.loadBalancer.ingress", [{"ip": f"198.51.100.{n}{payload}"}]))),
         "Service"),
        ("topology-keys", svc(f"i{n}-tk", set_(
            "metadata.annotations", {"service.pyproxy.io/topology-keys":
                                     f"kubernetes.io/hostname,a{payload}b,*"})), "Service"),
        ("spec.type", svc(f"i{n}-ty", set_("spec.type", f"ClusterIP{payload}")), "Service"),
        ("spec.sessionAffinity", svc(f"i{n}-sa", set_("spec.sessionAffinity",
                                                      f"ClientIP{payload}")), "Service"),
        ("metadata.labels", svc(f"i{n}-lk", set_("metadata.labels", {payload: "x"})),
         "Service"),
        ("endpoints[0].addresses[0]", sl(f"i{n}-ea", set_("endpoints.0.addresses",
                                                          [f"10.244.1.2{payload}"])),
         "EndpointSlice"),
        ("endpoints[0].nodeName", sl(f"i{n}-nn", set_("endpoints.0.nodeName", payload)),
         "EndpointSlice"),
        ("endpoints[0].zone", sl(f"i{n}-zn", set_("endpoints.0.zone", payload)),
         "EndpointSlice"),
        ("endpoints[0].hints", sl(f"i{n}-hz", set_("endpoints.0.hints",
                                                   {"forZones": [{"name": payload}]})),
         "EndpointSlice"),
        ("ports[0].name", sl(f"i{n}-sp", set_("ports.0.name", payload)), "EndpointSlice"),
        ("metadata.labels", sl(f"i{n}-sn", set_("metadata.labels",
                                                {"kubernetes.io/service-name": payload})),
         "EndpointSlice"),
        ("metadata.name", sl(payload, lambda o: None), "EndpointSlice"),
        ("spec.clusterIP (IPv6 zone)", make_service(
            "ns", f"i{n}-z6", lambda s: s["spec"].update(ipFamilies=["IPv6"]),
            ip=f"fd00:96::1:{n}%{payload}"), "Service"),
        ("spec.externalIPs (IPv6 zone)", make_service(
            "ns", f"i{n}-x6", lambda s: s["spec"].update(
                ipFamilies=["IPv6"], externalIPs=[f"fd00:192::{n}%{payload}"]),
            ip=f"fd00:96::2:{n}"), "Service"),
        ("endpoints[0].addresses[0] (IPv6 zone)", make_slice(
            "ns", "target6", [ep(f"fd00:244:0:1::2%{payload}", "node-b")], name=f"i{n}-e6",
            family="IPv6"), "EndpointSlice"),
    ]


def _valid_with_payloads(env: Env) -> list[Obj]:
    """Valid objects whose free-text fields (annotations, label values are restricted, so
    annotations only) carry the payloads: they must be programmed, the text ignored."""
    def annotated(svc: Obj) -> None:
        svc["metadata"]["annotations"] = {f"example.com/a{i}": p for i, p in enumerate(PAYLOADS)}
    return [*web(env, ["pod-a"], "target", "10.96.0.30", annotated),
            make_service("ns", "target6", lambda s: s["spec"].update(ipFamilies=["IPv6"]),
                         ip="fd00:96::30"),
            make_slice("ns", "target6", [ep(env.cluster.pods["pod-a"].ip6, "node-b")],
                       family="IPv6")]


def injection(env: Env, bench: SnapshotBench | None = None) -> Result:
    r = Result("injection", f"{len(PAYLOADS)} nft break-out payloads in every field that "
               "reaches the ruleset")
    with snapshot_bench(env, bench, "injection") as b:
        daemon = b.daemon
        base = [*b.base, *_valid_with_payloads(env)]
        b.write(base)
        baseline = Baseline.of(daemon)
        before = env.ruleset()
        r.check("pwn" not in before, "a payload from an annotation reached the ruleset")
        cases = [c for i, p in enumerate(PAYLOADS) for c in _injection_cases(env, p, i + 1)]
        b.write(base + [obj for _, obj, _ in cases])
        after = env.ruleset()
        r.check(after == before, "the ruleset changed:\n" + _first_diff(before, after))
        r.check("pwn" not in after, "a payload reached the kernel")
        tables = env.cluster.node.run(["nft", "list", "tables"]).stdout.split("\n")
        r.check({t for t in tables if t} == {"table ip pyproxy", "table ip6 pyproxy"},
                f"tables: {tables}")
        expect = Expectation({"ns/web", "ns/target", "ns/target6"},
                             Counter(kind for _, _, kind in cases))
        check_programmed(r, env, daemon, b.path, expect, baseline)
        r.figures["crafted objects"] = len(cases)
    return r


def _first_diff(a: str, b: str) -> str:
    import difflib

    return "\n".join(list(difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="",
                                               n=1))[:30])


@dataclass
class InputCase:
    """An input the drills found pyproxy got wrong, and what must happen with it."""

    objects: Callable[[Env], list[Obj]]
    invalid: int  # how many of the objects must be skipped and counted as invalid
    programmed: tuple[str, ...] = ()  # services that must be programmed


def _np_itp_local_topology(svc: Obj) -> None:
    svc["spec"].update(type="NodePort", internalTrafficPolicy="Local")
    svc["spec"]["ports"][0]["nodePort"] = 30090
    svc["metadata"]["annotations"] = {
        "service.pyproxy.io/topology-keys": "topology.kubernetes.io/zone"}


def _lb_ranges(*ranges: str, vip: str = "198.51.100.7") -> Callable[[Obj], None]:
    def tweak(svc: Obj) -> None:
        svc["spec"].update(type="LoadBalancer", loadBalancerSourceRanges=list(ranges))
        svc["spec"]["ports"][0]["nodePort"] = 30091
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": vip}]}}
    return tweak


def _lb6_ranges(*ranges: str) -> Callable[[Obj], None]:
    def tweak(svc: Obj) -> None:
        svc["spec"].update(type="LoadBalancer", ipFamilies=["IPv6"],
                           loadBalancerSourceRanges=list(ranges))
        svc["spec"]["ports"][0]["nodePort"] = 30092
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": "fd00:198::7"}]}}
    return tweak


# Bugs the drills found, since fixed (docs/drills.md, "Bugs found"): regression drills.
REGRESSIONS: dict[str, InputCase] = {
    # Bug 1: '$' in the validation regexes matched before a final newline. A ClientIP
    # service: its name goes into chain and set names, and the slice's service-name label
    # value has the same newline.
    "trailing newline in a Service name": InputCase(lambda env: [
        make_service("ns", "nl\n", sticky, ip="10.96.2.1"),
        make_slice("ns", "nl\n", [ep(env.pod("pod-a"), "node-b")], name="nl")], 2),
    "trailing newline in a port name": InputCase(lambda env: [
        make_service("ns", "pn", lambda s: s["spec"]["ports"][0].update(name="http\n"),
                     ip="10.96.2.2")], 1),
    # Bug 2: Python's ipaddress accepts IPv6 zone indexes ('%eth0').
    "IPv6 zone index in loadBalancerSourceRanges": InputCase(lambda env: [
        make_service("ns", "zone", _lb6_ranges("fd00:203::%pwn/64"), ip="fd00:96::2")], 1),
    # Bug 4: `numgen random mod 0` for an empty cluster list on the external path.
    "NodePort, internalTrafficPolicy Local, no topology-key match": InputCase(lambda env: [
        make_service("ns", "tk", _np_itp_local_topology, ip="10.96.2.4"),
        make_slice("ns", "tk", [ep(env.pod("pod-b"), "node-b", "zone-2")])], 0, ("ns/tk",)),
    # Bug 3: overlapping intervals in the firewall-allow set.
    "loadBalancerSourceRanges 0.0.0.0/0": InputCase(lambda env: [
        *web(env, ["pod-a"], "open", "10.96.2.6", _lb_ranges("0.0.0.0/0"))], 0, ("ns/open",)),
    "overlapping loadBalancerSourceRanges": InputCase(lambda env: [
        *web(env, ["pod-a"], "overlap", "10.96.2.7", _lb_ranges("10.0.0.0/8", "10.1.0.0/16"))],
        0, ("ns/overlap",)),
    # Bug 3b: a range holding the node's address makes the renderer allow the VIPs as
    # sources too, and a VIP inside that range is an overlapping interval (MetalLB handing
    # out VIPs from the node's subnet, a range allowing that subnet).
    "source range holding the node's address and the VIP": InputCase(lambda env: [
        *web(env, ["pod-a"], "subnet", "10.96.2.8",
             _lb_ranges("192.168.0.0/16", vip="192.168.60.5"))], 0, ("ns/subnet",)),
}

# Bugs still open: CI runs them as strict xfails.
KNOWN_BUGS: dict[str, InputCase] = {}


def input_case(env: Env, label: str, bench: SnapshotBench) -> Result:
    """One input of REGRESSIONS or KNOWN_BUGS, written next to the bench's base services:
    the invalid objects must be skipped and counted, the valid ones programmed, and the
    kernel must accept every sync and hold what was committed."""
    case = REGRESSIONS.get(label) or KNOWN_BUGS[label]
    r = Result("regression" if label in REGRESSIONS else "known bug", label)
    daemon = bench.daemon
    # Back to the base (a fresh filler service: the file changes whatever the last case
    # left), and a successful sync.
    base = [*bench.base, make_service("ns", env.unique("filler"), ip="10.96.2.99")]
    bench.write(base)
    until(lambda: (daemon.status()["lastSync"] or {}).get("error") is None, 10,
          "a successful sync after the previous case")
    before = env.ruleset()
    baseline = Baseline.of(daemon)
    bench.write(base + case.objects(env))
    status = daemon.status()
    counted = sum((Counter(status["invalidObjects"]) - baseline.invalid).values())
    r.check(counted == case.invalid,
            f"{counted} objects counted invalid, expected {case.invalid}")
    r.check(status["syncFailures"] == baseline.failures,
            f"the kernel refused the sync: {(status['lastSync'] or {}).get('error')}")
    programmed = {e["service"] for e in daemon.services()}
    r.check(set(case.programmed) <= programmed, f"not programmed: {case.programmed}")
    r.check(daemon.diff_clean(), "the kernel differs from what was committed")
    if not case.programmed:
        r.check(env.ruleset() == before, "the ruleset changed")
    return r


def input_cases(env: Env, bench: SnapshotBench | None = None) -> list[Result]:
    with snapshot_bench(env, bench, "inputs") as b:
        return [input_case(env, label, b) for label in [*REGRESSIONS, *KNOWN_BUGS]]


def oversized(env: Env, slices: int = 5, ports: int = 100, port_endpoints: int = 100) -> Result:
    """Objects at and over the bounds: the ones over are skipped with a reason, the ones at
    the bounds are programmed, and nothing is fatal."""
    r = Result("oversized", f"slices of 1000 and 1001 endpoints, {slices}x1000 endpoints for "
               f"one service, 1000/1001-port services, {ports} ports x {port_endpoints} "
               "endpoints, 1 MiB annotation, 10,000 topology keys")
    pods = [f"10.244.{10 + i // 250}.{1 + i % 250}" for i in range(max(1001, port_endpoints))]

    def ports_svc(name: str, count: int, ip: str, **extra: Any) -> Obj:
        def tweak(svc: Obj) -> None:
            svc["spec"]["ports"] = [{"name": f"p{i}", "port": 1000 + i, "protocol": "TCP"}
                                    for i in range(count)]
            svc["metadata"].update(extra)
        return make_service("ns", name, tweak, ip=ip)

    def slice_of(service: str, name: str, count: int, nports: int = 1) -> Obj:
        def tweak(sl: Obj) -> None:
            sl["ports"] = [{"name": f"p{i}", "port": 2000 + i, "protocol": "TCP"}
                           for i in range(nports)]
        return make_slice("ns", service, [ep(pods[i % len(pods)], "node-b")
                                          for i in range(count)], tweak, name=name)

    big_pods = [f"10.245.{i // 250}.{1 + i % 250}" for i in range(slices * 1000)]
    objects: list[Obj] = [
        make_node(NODE, "zone-1"),
        ports_svc("ports-1000", 1000, "10.96.3.1"), ports_svc("ports-1001", 1001, "10.96.3.2"),
        ports_svc("s1000", 1, "10.96.3.3"), slice_of("s1000", "s1000", 1000),
        slice_of("s1000", "s1001", 1001),
        ports_svc("many", 1, "10.96.3.4"),
        *[make_slice("ns", "many", [ep(big_pods[s * 1000 + i], "node-b") for i in range(1000)],
                     lambda sl: sl.update(ports=[{"name": "p0", "port": 2000}]),
                     name=f"many-{s}") for s in range(slices)],
        ports_svc("wide", ports, "10.96.3.5"), slice_of("wide", "wide", port_endpoints, ports),
        make_service("ns", "annotated", lambda s: s["metadata"].update(
            annotations={"example.com/huge": "x" * (1 << 20)}), ip="10.96.3.6"),
        make_service("ns", "keys", lambda s: s["metadata"].update(annotations={
            "service.pyproxy.io/topology-keys": ",".join(f"k{i}" for i in range(10000))}),
            ip="10.96.3.7"),
        make_service("ns", "extips", lambda s: s["spec"].update(
            externalIPs=[f"192.0.2.{i % 250}" for i in range(257)]), ip="10.96.3.8"),
    ]
    expect = Expectation({"ns/ports-1000", "ns/s1000", "ns/many", "ns/wide", "ns/annotated"},
                         Counter({"Service": 3, "EndpointSlice": 1}))
    daemon, path = env.snapshot_daemon(objects, "oversized", sync_period=30)
    r.figures["snapshot size"] = f"{path.stat().st_size / 1e6:.1f} MB"
    with running(daemon):
        r.converge_s = daemon.wait_ready(timeout=300)
        r.converge_what = "start to first sync"
        check_programmed(r, env, daemon, path, expect)
        many = daemon.endpoints("many")
        r.check(many is not None and len(many) == slices * 1000,
                f"many: {len(many or ())} endpoints, expected {slices * 1000}")
        last = daemon.status()["lastFullSync"]
        r.figures["first sync"] = (f"{last['commands']} commands, kernel "
                                   f"{last['kernel_seconds']:.2f} s, total {last['seconds']:.2f} s")
        r.figures["daemon RSS"] = _rss(daemon)
    env.cleanup()
    return r


def _rss(daemon: Daemon) -> str:
    try:
        for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"
