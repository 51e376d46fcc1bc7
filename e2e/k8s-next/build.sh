#!/usr/bin/env bash
# Builds kube-proxy alone from the next Kubernetes release than the pinned one (e2e/k8s), once,
# into a cache outside the checkout, for the tests that compare pyproxy with it
# (tests/test_k8s_vs_kube_proxy.py's localhost NodePort flows). The release is go.mod's
# k8s.io/kubernetes requirement; it needs the Go release go.mod names, which the go command
# fetches from the module proxy (GOTOOLCHAIN) when the machine's Go is older.
# A no-op when the binary exists.
#   build.sh            build (progress on stderr), then print nothing
#   build.sh --path     print the folder holding the binary (building nothing)
#
# Two of the release's requirements are not served by the module proxy (403, "This module
# version is not available") and are substituted in go.mod: sigs.k8s.io/structured-merge-diff/v7
# v7.0.1 by v7.0.0, and sigs.k8s.io/iptables-wrappers v1.0.0 (the iptables runner that 1.38
# moved out of k8s.io/kubernetes; only the iptables and ipvs modes use it) by the stub in
# iptables-wrappers-stub/. The nftables proxier is the release's own code.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
release="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3; exit}
                $1 == "k8s.io/kubernetes" && $2 ~ /^v[0-9]/ {print $2; exit}' "$here/go.mod")"
[[ -n "$release" ]] || { echo "make kube-proxy-next: no k8s.io/kubernetes version in $here/go.mod" >&2; exit 1; }
cache="${PYPROXY_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyproxy}"
bin="$cache/kube-proxy-$release/bin"
# The Go release this module needs (go.mod's go line), fetched by the go command when older.
toolchain="${PYPROXY_NEXT_GOTOOLCHAIN:-go1.27.3}"

if [[ "${1:-}" == "--path" ]]; then
  echo "$bin"
  exit 0
fi
[[ -x "$bin/kube-proxy" ]] && exit 0

command -v go >/dev/null || { echo "make kube-proxy-next: Go is needed to build kube-proxy" >&2; exit 1; }
mkdir -p "$bin"
cd "$here"
export GOTOOLCHAIN="$toolchain" CGO_ENABLED=0
version_ldflags=""
minor="${release#v1.}"; minor="${minor%%.*}"
for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_ldflags+=" -X $package.gitVersion=$release -X $package.gitMajor=1"
  version_ldflags+=" -X $package.gitMinor=$minor -X $package.gitTreeState=clean"
  version_ldflags+=" -X $package.buildDate=1970-01-01T00:00:00Z"
done
start=$SECONDS
echo "make kube-proxy-next: kube-proxy $release with $toolchain ($(go version))" >&2
# No `go mod download` first: go.mod's graph is 800 MB of modules, most of them for packages
# kube-proxy does not import; `go build` fetches only those it needs. At the lowest priority;
# PYPROXY_GO_BUILD_P=1 builds one package at a time (a machine shared with other work).
parallel=()
[[ -n "${PYPROXY_GO_BUILD_P:-}" ]] && parallel=(-p "$PYPROXY_GO_BUILD_P")
nice -n 19 go build "${parallel[@]}" -trimpath -ldflags "-s -w$version_ldflags" \
  -o "$bin/kube-proxy.partial" k8s.io/kubernetes/cmd/kube-proxy
mv "$bin/kube-proxy.partial" "$bin/kube-proxy"
echo "make kube-proxy-next: built kube-proxy $release in $((SECONDS - start)) s," \
  "$(du -m "$bin/kube-proxy" | cut -f1) MiB, in $bin" >&2
