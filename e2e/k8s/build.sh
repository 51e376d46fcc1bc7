#!/usr/bin/env bash
# Builds the tests' control plane from upstream's Go modules, once per release, into a cache
# outside the checkout: kube-apiserver, kube-controller-manager, kube-proxy (k8s.io/kubernetes at
# the release go.mod pins) and an embedded etcd (cmd/etcd). A no-op when all four exist.
#   build.sh            build (progress on stderr), then print nothing
#   build.sh --path     print the folder holding the binaries (building nothing)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The pinned release, from go.mod's requirement line (`k8s.io/kubernetes vX.Y.Z // indirect`:
# the module is only used through its tools).
release="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v[0-9]/ {print $2; exit}' "$here/go.mod")"
[[ -n "$release" ]] || { echo "make k8s: no k8s.io/kubernetes version in $here/go.mod" >&2; exit 1; }
cache="${PYPROXY_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyproxy}"
bin="$cache/k8s-$release/bin"
binaries=(kube-apiserver kube-controller-manager kube-proxy etcd)

if [[ "${1:-}" == "--path" ]]; then
  echo "$bin"
  exit 0
fi

missing=()
for name in "${binaries[@]}"; do
  [[ -x "$bin/$name" ]] || missing+=("$name")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

command -v go >/dev/null || { echo "make k8s: Go is needed to build the control plane" >&2; exit 1; }
mkdir -p "$bin"
cd "$here"
# Static, stripped binaries without debug info: smaller and quicker to link; the race detector
# and cgo are not needed by the tests.
export CGO_ENABLED=0
# The version stamps upstream's hack/lib/version.sh sets, so that /version and --version say
# the release (the emulation version itself is compiled in).
version_ldflags=""
for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  minor="${release#v1.}"; minor="${minor%%.*}"
  version_ldflags+=" -X $package.gitVersion=$release -X $package.gitMajor=1"
  version_ldflags+=" -X $package.gitMinor=$minor -X $package.gitTreeState=clean"
  version_ldflags+=" -X $package.buildDate=1970-01-01T00:00:00Z"
done
flags=(-trimpath -ldflags "-s -w$version_ldflags")
start=$SECONDS
echo "make k8s: downloading modules for k8s.io/kubernetes $release" >&2
go mod download -x 2>&1 | grep -c '^# get' | xargs -I{} echo "make k8s: {} module files fetched" >&2 || true
for name in "${missing[@]}"; do
  step=$SECONDS
  case "$name" in
    etcd) package=./cmd/etcd ;;
    *) package="k8s.io/kubernetes/cmd/$name" ;;
  esac
  echo "make k8s: building $name ($package)..." >&2
  go build "${flags[@]}" -o "$bin/$name.partial" "$package"
  mv "$bin/$name.partial" "$bin/$name"
  echo "make k8s: built $name in $((SECONDS - step)) s, $(du -m "$bin/$name" | cut -f1) MiB" >&2
done
echo "make k8s: control plane $release ready in $bin ($((SECONDS - start)) s)" >&2
