#!/usr/bin/env bash
# Builds the tests' Kubernetes from upstream's Go modules, once per release, into a cache outside
# the checkout: kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, kubelet,
# kubectl and kubeadm (k8s.io/kubernetes at the release go.mod pins), an embedded etcd (cmd/etcd), and
# containerd with its runc shim and ctr (github.com/containerd/containerd/v2 at CONTAINERD, the
# container runtime of the real nodes, testkit/cluster.py), and upstream's e2e suite (e2e.test,
# test/e2e of the same release) with its ginkgo runner, and distribution's registry (the real
# cluster's mirror of registry.k8s.io, serving the images built here to pulls with policy
# Always). A no-op when all of them exist.
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
binaries=(kube-apiserver kube-controller-manager kube-proxy etcd kube-scheduler kubelet kubectl
          kubeadm containerd containerd-shim-runc-v2 ctr ginkgo e2e.test registry)
# containerd 2.x: the kubelet learns its cgroup driver from the runtime's RuntimeConfig call
# (containerd >= 2.0; required from kubelet 1.38), which Debian 12's containerd 1.6 lacks.
# cgroup v1, which these machines have, stays supported in the 2.x line (deprecated in 2.2).
containerd_version=v2.4.2
# github.com/distribution/distribution/v3's registry (CNCF Distribution, what registry:3 runs).
registry_version=v3.1.2

if [[ "${1:-}" == "--path" ]]; then
  echo "$bin"
  exit 0
fi

missing=()
for name in "${binaries[@]}"; do
  [[ -x "$bin/$name" ]] || missing+=("$name")
done
# An e2e.test that does not say the release is rebuilt: an unstamped one (v0.0.0-master, as
# one built without the flags below says) makes the suite pick fixtures by the wrong version
# (Pod Security's restricted/v0.0 for PodCertificate's mTLS test) and log the wrong one.
if [[ -x "$bin/e2e.test" ]] && [[ "$("$bin/e2e.test" --version 2>/dev/null)" != "$release" ]]; then
  echo "make k8s: $bin/e2e.test says $("$bin/e2e.test" --version 2>/dev/null), not $release: rebuilding it" >&2
  missing+=(e2e.test)
fi
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
    containerd|containerd-shim-runc-v2|ctr)
      package="github.com/containerd/containerd/v2/cmd/$name@$containerd_version" ;;
    registry) package="github.com/distribution/distribution/v3/cmd/registry@$registry_version" ;;
    # Upstream's e2e suite and the ginkgo runner at the version k8s.io/kubernetes requires
    # (testkit/conformance.py runs them against the real cluster).
    ginkgo) package=github.com/onsi/ginkgo/v2/ginkgo ;;
    e2e.test) package=k8s.io/kubernetes/test/e2e ;;
    *) package="k8s.io/kubernetes/cmd/$name" ;;
  esac
  echo "make k8s: building $name ($package)..." >&2
  if [[ "$package" == *@* ]]; then
    # Outside this module (its own go.mod decides the dependencies); no btrfs/devmapper/zfs
    # snapshotters (cgo libraries), overlayfs is what the nodes use.
    tmp="$(mktemp -d)"
    (cd "$tmp" && GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
      -tags "no_btrfs no_devmapper no_zfs" "$package")
    mv "$tmp/$name" "$bin/$name.partial"
    rm -rf "$tmp"
  elif [[ "$name" == e2e.test ]]; then
    # `go test -c` takes the same -X stamps (the test binary links k8s.io/component-base).
    go test -c "${flags[@]}" -o "$bin/$name.partial" "$package"
    stamped="$("$bin/$name.partial" --version)"
    [[ "$stamped" == "$release" ]] || { echo "make k8s: e2e.test says $stamped, not $release" >&2; exit 1; }
  else
    go build "${flags[@]}" -o "$bin/$name.partial" "$package"
  fi
  mv "$bin/$name.partial" "$bin/$name"
  echo "make k8s: built $name in $((SECONDS - step)) s, $(du -m "$bin/$name" | cut -f1) MiB" >&2
done
echo "make k8s: control plane $release ready in $bin ($((SECONDS - start)) s)" >&2
