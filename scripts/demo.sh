#!/usr/bin/env bash
# make demo: pyproxy on the embedded example cluster. Everything kernel-side happens in a
# throwaway network namespace, removed on exit (also on Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."
PYPROXY=.venv/bin/pyproxy
SNAPSHOT=examples/cluster.yaml
NS="pyproxy-demo-$$"

cleanup() { ip netns del "$NS" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "What node-c (zone-2) does with every service, and why"
$PYPROXY explain -f "$SNAPSHOT" --node node-c | sed -n '1,20p'

say "One service in detail, as JSON (the contract other tools read)"
$PYPROXY explain -f "$SNAPSHOT" --node node-a --service demo/nearest -o json

say "Programming node-a's rules into a throwaway network namespace ($NS)"
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" addr add 192.168.1.10/24 dev lo
ip netns exec "$NS" $PYPROXY apply -f "$SNAPSHOT" --node node-a --node-ip 192.168.1.10 \
    --cluster-cidr 10.244.0.0/16
say "The dispatch map: one element per service address and port"
ip netns exec "$NS" nft list map ip pyproxy service-ips
say "Chains: a handful, shared by every service of the same shape"
ip netns exec "$NS" nft list chains ip | grep -c chain | xargs echo "chains in table ip pyproxy:"

say "Look further"
cat <<TXT
  pyproxy explain -f $SNAPSHOT --node node-b            # any node's view
  pyproxy render  -f $SNAPSHOT --node node-a --node-ip 192.168.1.10 --cluster-cidr 10.244.0.0/16
  pyproxy run --snapshot $SNAPSHOT --hostname-override node-a   # the daemon, no API server
TXT
