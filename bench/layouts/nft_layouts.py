#!/usr/bin/env python3
"""Benchmark nftables ruleset layouts for pyproxy (cold load + one-service changes).

Usage (as root, from the host network namespace):

    python3 bench/layouts/nft_layouts.py --layout L2 --services 10000 --endpoints 10 --runs 3
    python3 bench/layouts/nft_layouts.py --verify            # real-packet check of L1/L2/L3 DNAT

Every run creates a fresh network namespace ``ppxbench-<pid>-<run>``, re-executes this script
inside it (``ip netns exec NS <venv python> nft_layouts.py --worker ...``), collects a JSON result
from the worker's stdout and deletes the namespace.  The root namespace's ruleset is never touched.

Layouts (all in ``table ip pyproxy``, same nat/filter skeleton):

L1  chain per service, inline cascade:
      service-ips: VIP . proto . port : goto svc-<name>
      svc-<name>:  masq-mark rule; ``numgen random mod (N-j) == 0 meta l4proto tcp \
dnat to EPj:8080``
                   (j = 0..N-2); last rule a plain ``meta l4proto tcp dnat to EPlast:8080``
L2  few chains, data maps (chain count independent of #services):
      service-ips: VIP . proto . port : goto pick-<proto>-N    (N = endpoint count; shared chains)
      pick-<proto>-N: masq-mark rule;
                   ``dnat ip to ip daddr . <proto> dport . numgen random mod N \
map @endpoints-<proto>``
      endpoints-<proto> (typeof ip daddr . <proto> dport . numgen random mod 1 : \
ip daddr . <proto> dport):
                   VIP . port . idx : EP . port
      One map + pick chains per protocol: with ``th dport`` in the typeof, nft 1.0.6 can load \
the map
      and rules in one transaction but fails to add a rule referencing the map later ("conflicting
      protocols specified: ip vs. th"), so the protocol is fixed per map instead.
L3  hybrid: L1's per-service chain, endpoint choice via a per-service named map
      svc-<name>:  masq-mark rule; ``meta l4proto tcp dnat ip to numgen random mod N \
map @eps-<name>``
      eps-<name> (typeof numgen random mod 1 : ip daddr . <proto> dport): idx : EP . port

Change operations (each its own transaction, timed around ``Nftables().cmd()`` only):
  replace    replace the N endpoints of one service by N others
  remove1    remove one endpoint of a service (N -> N-1)
  addsvc     add a whole new service with N endpoints
  delsvc     delete a service
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

TABLE = "ip pyproxy"
MASQ_BIT = "0x4000"
CLUSTER_CIDR = "10.0.0.0/8"
VENV_PY = "/work/main/.venv/bin/python"
L2_PROTOS = ("tcp", "udp")   # sctp works the same way (needs the sctp conntrack module)
OPS = ("replace", "remove1", "addsvc", "delsvc")


# ----------------------------------------------------------------------------- model

def ip4(n: int) -> str:
    return f"{(n >> 24) & 255}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


VIP_BASE = (10 << 24) | (96 << 16)      # 10.96.0.0/12: service VIPs
EP_BASE = (10 << 24) | (128 << 16)      # 10.128.0.0/9: endpoint (pod) IPs


class Svc:
    __slots__ = ("eps", "idx", "name", "port", "proto", "vip")

    def __init__(self, idx: int, n_eps: int, ep_gen: int = 0, proto: str = "tcp", port: int = 80):
        self.idx = idx
        # '/' like upstream; legal unquoted
        self.name = f"svc-{idx}-ns{idx % 97}/name{idx}/{proto}/p{port}"
        self.vip = ip4(VIP_BASE + 1 + idx)
        self.proto = proto
        self.port = port
        # endpoint generation ep_gen gives a disjoint set of IPs (used by "replace")
        base = EP_BASE + (ep_gen * 4_000_000) + idx * 64
        self.eps = [(ip4(base + j + 1), 8080) for j in range(n_eps)]


def build_model(n_svc: int, n_eps: int) -> list[Svc]:
    return [Svc(i, n_eps) for i in range(n_svc)]


# ----------------------------------------------------------------------------- rendering

def masq_rule() -> str:
    # Inline mark set (no jump to a mark-for-masquerade chain): adds no jump/goto to the rule.
    return f"ip saddr != {CLUSTER_CIDR} meta mark set meta mark | {MASQ_BIT}"


def skeleton(max_eps: int, layout: str) -> str:
    """Base chains, dispatch maps, minimal filter side.

    Per-layout objects follow as flat commands."""
    s = [f"table {TABLE} {{",
         "  map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; }",
         "  map no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict; }",
         "  set cluster-ips { type ipv4_addr; }",
         "  chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; "
         "jump services; }",
         "  chain nat-output { type nat hook output priority -100; policy accept; jump services; }",
         "  chain nat-postrouting { type nat hook postrouting priority srcnat; policy accept; "
         "jump masquerading; }",
         "  chain filter-forward { type filter hook forward priority -110; policy accept; "
         "ct state new jump service-endpoints-check; }",
         "  chain filter-output { type filter hook output priority -110; policy accept; "
         "ct state new jump service-endpoints-check; }",
         "  chain filter-input { type filter hook input priority -110; policy accept; "
         "ct state new jump service-endpoints-check; }",
         "  chain service-endpoints-check { "
         "ip daddr . meta l4proto . th dport vmap @no-endpoint-services; }",
         "  chain reject-chain { reject; }",
         f"  chain mark-for-masquerade {{ meta mark set meta mark | {MASQ_BIT}; }}",
         "  chain masquerading {",
         f"    meta mark & {MASQ_BIT} == 0 return",
         f"    meta mark set meta mark ^ {MASQ_BIT}",
         "    masquerade fully-random",
         "  }",
         "  chain services { ip daddr . meta l4proto . th dport vmap @service-ips; }"]
    if layout == "L2":
        for proto in L2_PROTOS:
            s.append(f"  map endpoints-{proto} {{")
            s.append(f"    typeof ip daddr . {proto} dport . numgen random mod 1 : "
                     f"ip daddr . {proto} dport")
            s.append("  }")
            for n in range(1, max_eps + 1):
                s.append(f"  chain pick-{proto}-{n} {{")
                s.append(f"    {masq_rule()}")
                s.append(f"    dnat ip to ip daddr . {proto} dport . numgen random mod {n} "
                         f"map @endpoints-{proto}")
                s.append("  }")
    s.append("}")
    return "\n".join(s) + "\n"


# --- L1 -----------------------------------------------------------------------------

def l1_chain_rules(svc: Svc) -> list[str]:
    n = len(svc.eps)
    rules = [masq_rule()]
    for j, (ip, port) in enumerate(svc.eps):
        if j < n - 1:
            rules.append(f"numgen random mod {n - j} == 0 "
                         f"meta l4proto {svc.proto} dnat to {ip}:{port}")
        else:
            rules.append(f"meta l4proto {svc.proto} dnat to {ip}:{port}")
    return rules


def l1_add_service(svc: Svc) -> list[str]:
    c = [f"add chain {TABLE} {svc.name}"]
    c += [f"add rule {TABLE} {svc.name} {r}" for r in l1_chain_rules(svc)]
    c.append(f"add element {TABLE} service-ips "
             f"{{ {svc.vip} . {svc.proto} . {svc.port} : goto {svc.name} }}")
    c.append(f"add element {TABLE} cluster-ips {{ {svc.vip} }}")
    return c


def l1_replace_eps(svc: Svc) -> list[str]:
    return [f"flush chain {TABLE} {svc.name}"] + [f"add rule {TABLE} {svc.name} {r}"
                                                  for r in l1_chain_rules(svc)]


def l1_del_service(svc: Svc) -> list[str]:
    return [f"delete element {TABLE} service-ips {{ {svc.vip} . {svc.proto} . {svc.port} }}",
            f"delete element {TABLE} cluster-ips {{ {svc.vip} }}",
            f"flush chain {TABLE} {svc.name}",
            f"delete chain {TABLE} {svc.name}"]


# --- L2 -----------------------------------------------------------------------------

def l2_ep_elems(svc: Svc, eps=None, start: int = 0) -> str:
    eps = svc.eps if eps is None else eps
    return ", ".join(f"{svc.vip} . {svc.port} . {start + j} : {ip} . {p}"
                     for j, (ip, p) in enumerate(eps))


def l2_ep_keys(svc: Svc, idxs) -> str:
    return ", ".join(f"{svc.vip} . {svc.port} . {j}" for j in idxs)


def l2_add_service(svc: Svc) -> list[str]:
    return [f"add element {TABLE} endpoints-{svc.proto} {{ {l2_ep_elems(svc)} }}",
            f"add element {TABLE} service-ips "
            f"{{ {svc.vip} . {svc.proto} . {svc.port} : goto pick-{svc.proto}-{len(svc.eps)} }}",
            f"add element {TABLE} cluster-ips {{ {svc.vip} }}"]


def l2_replace_eps(old: Svc, new: Svc) -> list[str]:
    # same N: element-only change in endpoints-<proto>, no verdict/goto involved
    return [f"delete element {TABLE} endpoints-{old.proto} "
            f"{{ {l2_ep_keys(old, range(len(old.eps)))} }}",
            f"add element {TABLE} endpoints-{new.proto} {{ {l2_ep_elems(new)} }}"]


def l2_remove_one(svc: Svc, j: int) -> list[str]:
    """Remove endpoint j: move the last endpoint into slot j, drop the last slot,
    re-point to pick-(N-1)."""
    n = len(svc.eps)
    c = [f"delete element {TABLE} endpoints-{svc.proto} "
         f"{{ {l2_ep_keys(svc, sorted({j, n - 1}))} }}"]
    if j != n - 1:
        last = svc.eps[n - 1]
        c.append(f"add element {TABLE} endpoints-{svc.proto} "
                 f"{{ {svc.vip} . {svc.port} . {j} : {last[0]} . {last[1]} }}")
    c.append(f"delete element {TABLE} service-ips {{ {svc.vip} . {svc.proto} . {svc.port} }}")
    c.append(f"add element {TABLE} service-ips "
             f"{{ {svc.vip} . {svc.proto} . {svc.port} : goto pick-{svc.proto}-{n - 1} }}")
    return c


def l2_del_service(svc: Svc) -> list[str]:
    return [f"delete element {TABLE} service-ips {{ {svc.vip} . {svc.proto} . {svc.port} }}",
            f"delete element {TABLE} cluster-ips {{ {svc.vip} }}",
            f"delete element {TABLE} endpoints-{svc.proto} "
            f"{{ {l2_ep_keys(svc, range(len(svc.eps)))} }}"]


# --- L3 -----------------------------------------------------------------------------

def l3_map(svc: Svc) -> str:
    return "eps-" + svc.name[4:]


def l3_chain_rules(svc: Svc) -> list[str]:
    return [masq_rule(),
            f"meta l4proto {svc.proto} dnat ip to numgen random mod {len(svc.eps)} "
            f"map @{l3_map(svc)}"]


def l3_elems(svc: Svc) -> str:
    return ", ".join(f"{j} : {ip} . {p}" for j, (ip, p) in enumerate(svc.eps))


def l3_add_service(svc: Svc) -> list[str]:
    m = l3_map(svc)
    c = [f"add map {TABLE} {m} {{ typeof numgen random mod 1 : ip daddr . {svc.proto} dport; }}",
         f"add element {TABLE} {m} {{ {l3_elems(svc)} }}",
         f"add chain {TABLE} {svc.name}"]
    c += [f"add rule {TABLE} {svc.name} {r}" for r in l3_chain_rules(svc)]
    c.append(f"add element {TABLE} service-ips "
             f"{{ {svc.vip} . {svc.proto} . {svc.port} : goto {svc.name} }}")
    c.append(f"add element {TABLE} cluster-ips {{ {svc.vip} }}")
    return c


def l3_replace_eps(old: Svc, new: Svc) -> list[str]:
    # same N: rule unchanged, element-only change in the per-service map
    m = l3_map(old)
    return [f"delete element {TABLE} {m} {{ {', '.join(str(j) for j in range(len(old.eps)))} }}",
            f"add element {TABLE} {m} {{ {l3_elems(new)} }}"]


def l3_remove_one(svc: Svc, j: int) -> list[str]:
    n, m = len(svc.eps), l3_map(svc)
    c = [f"delete element {TABLE} {m} {{ {', '.join(str(k) for k in sorted({j, n - 1}))} }}"]
    if j != n - 1:
        last = svc.eps[n - 1]
        c.append(f"add element {TABLE} {m} {{ {j} : {last[0]} . {last[1]} }}")
    smaller = Svc(svc.idx, n - 1)
    c.append(f"flush chain {TABLE} {svc.name}")
    c += [f"add rule {TABLE} {svc.name} {r}" for r in l3_chain_rules(smaller)]
    return c


def l3_del_service(svc: Svc) -> list[str]:
    return [*l1_del_service(svc), f"delete map {TABLE} {l3_map(svc)}"]


# --- cold load ---------------------------------------------------------------------

def render_cold(layout: str, model: list[Svc], max_eps: int) -> str:
    """Whole ruleset for ONE cmd() transaction: skeleton block + flat per-service commands.
    Dispatch elements are batched into a few large `add element` commands at the end."""
    out = [f"add table {TABLE}\n", f"delete table {TABLE}\n", skeleton(max_eps, layout)]
    vip_elems, cip_elems = [], []
    if layout == "L1":
        for s in model:
            out.append(f"add chain {TABLE} {s.name}\n")
            out.extend(f"add rule {TABLE} {s.name} {r}\n" for r in l1_chain_rules(s))
            vip_elems.append(f"{s.vip} . {s.proto} . {s.port} : goto {s.name}")
    elif layout == "L2":
        chunks: dict = {p: [] for p in L2_PROTOS}
        for s in model:
            chunks[s.proto].append(l2_ep_elems(s))
            vip_elems.append(f"{s.vip} . {s.proto} . {s.port} : goto pick-{s.proto}-{len(s.eps)}")
        for proto, elems in chunks.items():
            for i in range(0, len(elems), 1000):
                out.append(f"add element {TABLE} endpoints-{proto} "
                           f"{{ {', '.join(elems[i:i + 1000])} }}\n")
    elif layout == "L3":
        for s in model:
            m = l3_map(s)
            out.append(f"add map {TABLE} {m} {{ typeof numgen random mod 1 : "
                       f"ip daddr . {s.proto} dport; elements = {{ {l3_elems(s)} }}; }}\n")
            out.append(f"add chain {TABLE} {s.name}\n")
            out.extend(f"add rule {TABLE} {s.name} {r}\n" for r in l3_chain_rules(s))
            vip_elems.append(f"{s.vip} . {s.proto} . {s.port} : goto {s.name}")
    else:
        raise SystemExit(f"unknown layout {layout}")
    for s in model:
        cip_elems.append(s.vip)
    for i in range(0, len(vip_elems), 1000):
        out.append(f"add element {TABLE} service-ips {{ {', '.join(vip_elems[i:i + 1000])} }}\n")
    for i in range(0, len(cip_elems), 1000):
        out.append(f"add element {TABLE} cluster-ips {{ {', '.join(cip_elems[i:i + 1000])} }}\n")
    return "".join(out)


def render_op(layout: str, op: str, svc: Svc, n_eps: int) -> str:
    if op == "replace":
        new = Svc(svc.idx, n_eps, ep_gen=1)
        cmds = {"L1": lambda: l1_replace_eps(new),
                "L2": lambda: l2_replace_eps(svc, new),
                "L3": lambda: l3_replace_eps(svc, new)}[layout]()
    elif op == "remove1":
        j = 3 % n_eps
        if layout == "L1":
            cmds = l1_replace_eps(Svc(svc.idx, n_eps - 1))   # cascade re-render with N-1 endpoints
        elif layout == "L2":
            cmds = l2_remove_one(svc, j)
        else:
            cmds = l3_remove_one(svc, j)
    elif op == "addsvc":
        cmds = {"L1": l1_add_service, "L2": l2_add_service, "L3": l3_add_service}[layout](svc)
    elif op == "delsvc":
        cmds = {"L1": l1_del_service, "L2": l2_del_service, "L3": l3_del_service}[layout](svc)
    else:
        raise ValueError(op)
    return "\n".join(cmds) + "\n"


# ------------------------------------------------------------------------- worker (inside netns)

def rss_mb() -> tuple[float, float]:
    cur = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
    return cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_cmd(nft, text: str, what: str) -> float:
    t0 = time.perf_counter()
    rc, _out, err = nft.cmd(text)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{what}: rc={rc}: {err[:2000]}")
    return dt


def worker(args) -> dict:
    import nftables
    res: dict = {}
    t0 = time.perf_counter()
    model = build_model(args.services, args.endpoints)
    res["model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    text = render_cold(args.layout, model, args.endpoints)
    res["render_s"] = time.perf_counter() - t0
    res["input_mb"] = len(text) / 1e6
    res["rss_render_mb"] = rss_mb()[0]

    nft = nftables.Nftables()
    nft.set_echo_output(False)
    res["load_s"] = run_cmd(nft, text, "cold load")
    del text
    res["rss_load_mb"], res["maxrss_load_mb"] = rss_mb()

    # one-service changes: each op on distinct services, each its own transaction
    n = args.services
    k = args.changes
    for op in OPS:
        times = []
        for i in range(k):
            if op == "replace":
                svc = model[(1 + i * 7) % n]
            elif op == "remove1":
                svc = model[(2 + i * 7) % n]
            elif op == "addsvc":
                svc = Svc(n + i, args.endpoints)
            else:  # delsvc
                svc = model[(5 + i * 7) % n]
            times.append(run_cmd(nft, render_op(args.layout, op, svc, args.endpoints), op))
        res[op + "_ms"] = statistics.median(times) * 1000
        res[op + "_first_ms"] = times[0] * 1000
    res["rss_end_mb"], res["maxrss_end_mb"] = rss_mb()
    if args.layout == "L2":
        res["chains"] = 13 + len(L2_PROTOS) * args.endpoints
    else:
        res["chains"] = 13 + args.services
    return res


# ------------------------------------------------------------------------- verify (real packets)

VERIFY_PY = r"""
import socket, sys
vip, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(count):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 30000 + i)); s.sendto(b"x", (vip, port)); s.close()
"""


def verify(layout: str) -> dict:
    """Small ruleset with a UDP VIP 10.96.0.10:53 -> 3 endpoints on lo, 90 packets,
    count DNAT targets."""
    ns = f"ppxbench-{os.getpid()}-v{layout}"
    eps = [("10.1.0.1", 5353), ("10.1.0.2", 5354), ("10.1.0.3", 5355)]
    svc = Svc(0, 3, proto="udp", port=53)
    svc.vip, svc.eps = "10.96.0.10", eps
    model_text = render_cold(layout, [svc], 3)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        sh = "ip link set lo up; " + "; ".join(f"ip addr add {ip}/32 dev lo" for ip, _ in eps) + \
             "; ip route add 10.96.0.0/12 dev lo"
        subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", sh], check=True)
        p = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=model_text,
                           text=True, capture_output=True)
        if p.returncode:
            return {"layout": layout, "error": p.stderr}
        subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", VERIFY_PY, svc.vip,
                        "53", "90"], check=True)
        ct = subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-L", "-p", "udp"],
                            capture_output=True, text=True).stdout
        counts: dict = {}
        for line in ct.splitlines():
            f = [x for x in line.split() if x.startswith(("src=", "sport="))]
            if len(f) >= 4:   # orig src, orig sport, reply src, reply sport
                key = f"{f[2][4:]}:{f[3][6:]}"
                counts[key] = counts.get(key, 0) + 1
        return {"layout": layout, "dnat_targets": counts}
    finally:
        subprocess.run(["ip", "netns", "del", ns])


# ----------------------------------------------------------------------------- driver (host ns)

def drive(args) -> None:
    results = []
    me = os.path.abspath(__file__)
    for r in range(args.runs):
        ns = f"ppxbench-{os.getpid()}-{r}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            cmd = ["ip", "netns", "exec", ns, args.python, me, "--worker", "--layout", args.layout,
                   "--services", str(args.services), "--endpoints", str(args.endpoints),
                   "--changes", str(args.changes)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if p.returncode != 0:
                print(f"run {r}: worker failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                continue
            res = json.loads(p.stdout.strip().splitlines()[-1])
            results.append(res)
            print(f"# run {r}: " + json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
        except subprocess.TimeoutExpired:
            print(f"run {r}: timeout after {args.timeout}s", file=sys.stderr)
        finally:
            subprocess.run(["ip", "netns", "del", ns])
    if not results:
        sys.exit(1)
    keys = ["render_s", "input_mb", "load_s", "replace_ms", "remove1_ms", "addsvc_ms", "delsvc_ms",
            "rss_load_mb", "maxrss_end_mb", "chains"]
    print(f"\n{args.layout} {args.services}x{args.endpoints}, medians of {len(results)} runs "
          f"(change ops: median of {args.changes} transactions each)")
    for k in keys:
        vals = [r[k] for r in results]
        print(f"  {k:<16} {statistics.median(vals):>10.3f}   "
              f"(runs: {', '.join(f'{v:.3f}' for v in vals)})")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"layout": args.layout, "services": args.services,
                                "endpoints": args.endpoints, "runs": results}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["L1", "L2", "L3"], default="L2")
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3, help="fresh-netns runs (median reported)")
    ap.add_argument("--changes", type=int, default=10, help="transactions per change op")
    ap.add_argument("--timeout", type=int, default=300, help="per-run timeout (s)")
    ap.add_argument("--python", default=VENV_PY if os.path.exists(VENV_PY) else sys.executable)
    ap.add_argument("--json", help="append raw results to this JSONL file")
    ap.add_argument("--render-only", action="store_true", help="print the cold-load text and exit")
    ap.add_argument("--verify", action="store_true", help="real-packet DNAT check of all layouts")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render_only:
        sys.stdout.write(render_cold(args.layout, build_model(args.services, args.endpoints),
                                     args.endpoints))
    elif args.verify:
        for lay in ("L1", "L2", "L3"):
            print(json.dumps(verify(lay)))
    elif args.worker:
        print(json.dumps(worker(args)))
    else:
        if os.geteuid() != 0:
            sys.exit("must run as root (creates network namespaces)")
        drive(args)


if __name__ == "__main__":
    main()
