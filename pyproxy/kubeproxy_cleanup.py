"""`pyproxy cleanup --kube-proxy`: remove what kube-proxy leaves behind when a node moves to
pyproxy: its nftables tables, and its KUBE-* iptables chains (iptables and ipvs modes)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

from pyproxy.nft import LibNftables, NftError

KUBE_PROXY_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))
IPTABLES_TABLES = ("nat", "filter", "mangle")


def cleanup_kube_proxy(nft: LibNftables | None = None) -> list[str]:
    """What was removed, one line each. Missing pieces are not errors."""
    nft = nft or LibNftables()
    done = []
    for family, table in KUBE_PROXY_TABLES:
        try:
            nft.run(f"delete table {family} {table}")
            done.append(f"deleted nftables table {family} {table}")
        except NftError:
            pass  # not there
    # Both backends: kube-proxy may have used iptables-legacy on this node.
    for tool in ("iptables", "ip6tables", "iptables-legacy", "ip6tables-legacy"):
        if shutil.which(tool):
            done.extend(_iptables_cleanup(tool))
    return done


def _iptables_cleanup(tool: str) -> Iterator[str]:
    for table in IPTABLES_TABLES:
        listing = subprocess.run([tool, "-w", "-t", table, "-S"], capture_output=True,
                                 text=True, check=False)
        if listing.returncode != 0:
            continue
        rules = listing.stdout.splitlines()
        # First the jumps from other chains into KUBE-* chains, then the chains themselves.
        for rule in rules:
            parts = rule.split()
            if parts[:1] == ["-A"] and not parts[1].startswith("KUBE-") and any(
                    p.startswith("KUBE-") for p in parts[2:]):
                subprocess.run([tool, "-w", "-t", table, "-D", *parts[1:]], check=False,
                               capture_output=True)
                yield f"{tool} -t {table}: removed rule {' '.join(parts[1:])}"
        chains = [r.split()[1] for r in rules if r.startswith("-N KUBE-")]
        for chain in chains:
            subprocess.run([tool, "-w", "-t", table, "-F", chain], check=False,
                           capture_output=True)
        for chain in chains:
            subprocess.run([tool, "-w", "-t", table, "-X", chain], check=False,
                           capture_output=True)
            yield f"{tool} -t {table}: deleted chain {chain}"
