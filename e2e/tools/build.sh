#!/usr/bin/env bash
# Builds the operators' tools the tests run, from upstream's Go modules with the machine's Go,
# once per version, into a cache outside the checkout (as e2e/k8s/build.sh builds the control
# plane): promtool (Prometheus' rule checker and unit tester: tests/test_metrics_reference.py),
# helm (the chart, charts/pyproxy: tests/test_helm.py) and syft (the image's bill of materials:
# `make image`). Each module is built by its own
# go.mod (`go install MODULE/cmd/NAME@VERSION`: none of the three has a replace directive).
# One is no binary: operator-crds, the Prometheus Operator's CustomResourceDefinitions of
# ServiceMonitor and PrometheusRule, taken from its module's source as the module proxy serves
# it (example/prometheus-operator-crd/), which tests/test_helm.py installs on the real API
# server to validate the chart's monitoring objects against.
# A tool's folder is ~/.cache/pyproxy/tools-NAME-VERSION/bin (operator-crds: .../crds;
# PYPROXY_K8S_CACHE moves the cache); a no-op for those that exist.
#   build.sh [NAME...]       build those (all when none is named; progress on stderr)
#   build.sh --path NAME     print the path of NAME's binary (operator-crds: its folder)
set -euo pipefail

# name package version, and the -X stamps its releases carry (so that --version says it).
declare -A package version stamps tags
package[promtool]=github.com/prometheus/prometheus/cmd/promtool
version[promtool]=v0.316.0
stamps[promtool]="-X github.com/prometheus/common/version.Version=${version[promtool]}
  -X github.com/prometheus/common/version.Branch=HEAD
  -X github.com/prometheus/common/version.BuildDate=19700101-00:00:00"
package[helm]=helm.sh/helm/v4/cmd/helm
version[helm]=v4.3.1
stamps[helm]="-X helm.sh/helm/v4/internal/version.version=${version[helm]}
  -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
package[syft]=github.com/anchore/syft/cmd/syft
version[syft]=v1.57.1
stamps[syft]="-X main.version=${version[syft]#v} -X main.buildDate=1970-01-01T00:00:00Z"
# Upstream's release build tags: the pure-Go OpenPGP (no gpgme through cgo), no btrfs driver.
tags[syft]="containers_image_openpgp exclude_graphdriver_btrfs"
package[operator-crds]=github.com/prometheus-operator/prometheus-operator
version[operator-crds]=v0.85.0
crd_files=(monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_prometheusrules.yaml)
all=(promtool helm syft operator-crds)

cache="${PYPROXY_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyproxy}"
binary() {
  if [[ "$1" == operator-crds ]]; then echo "$cache/tools-$1-${version[$1]}/crds"
  else echo "$cache/tools-$1-${version[$1]}/bin/$1"; fi
}

if [[ "${1:-}" == "--path" ]]; then
  [[ -n "${2:-}" && -n "${package[$2]:-}" ]] || { echo "usage: build.sh --path {${all[*]}}" >&2; exit 2; }
  binary "$2"
  exit 0
fi
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=("${all[@]}")
missing=()
for name in "${names[@]}"; do
  [[ -n "${package[$name]:-}" ]] || { echo "make tools: no tool named $name (${all[*]})" >&2; exit 2; }
  [[ -x "$(binary "$name")" ]] || missing+=("$name")
done
[[ ${#missing[@]} -gt 0 ]] || exit 0

command -v go >/dev/null || { echo "make tools: Go is needed to build ${missing[*]}" >&2; exit 1; }
# Static, stripped binaries without debug info, at the lowest priority (the machine builds
# other things meanwhile); PYPROXY_GO_BUILD_P=1 builds one package at a time.
export CGO_ENABLED=0
parallel=()
[[ -n "${PYPROXY_GO_BUILD_P:-}" ]] && parallel=(-p "$PYPROXY_GO_BUILD_P")
for name in "${missing[@]}"; do
  start=$SECONDS
  target="$(binary "$name")"
  if [[ "$name" == operator-crds ]]; then
    echo "make tools: fetching $name (${package[$name]}@${version[$name]})..." >&2
    tmp="$(mktemp -d)"
    dir="$(cd "$tmp" && go mod download -json "${package[$name]}@${version[$name]}" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    [[ -d "$dir" ]] || { echo "make tools: go mod download gave no folder for $name" >&2; exit 1; }
    for file in "${crd_files[@]}"; do
      cp "$dir/example/prometheus-operator-crd/$file" "$tmp/$file"
    done
    mkdir -p "$(dirname "$target")"
    rm -rf "$target.partial"
    mkdir "$target.partial"
    mv "$tmp"/*.yaml "$target.partial/"
    rm -rf "$tmp"
    mv "$target.partial" "$target"
    echo "make tools: fetched $name in $((SECONDS - start)) s" >&2
    continue
  fi
  echo "make tools: building $name (${package[$name]}@${version[$name]})..." >&2
  tmp="$(mktemp -d)"
  # Outside any module: the tool's own go.mod decides its dependencies.
  (cd "$tmp" && GOBIN="$tmp" GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=mod" nice -n 19 go install \
    "${parallel[@]}" -trimpath -tags "${tags[$name]:-}" \
    -ldflags "-s -w $(echo ${stamps[$name]})" "${package[$name]}@${version[$name]}")
  mkdir -p "$(dirname "$target")"
  mv "$tmp/$name" "$target.partial"
  rm -rf "$tmp"
  mv "$target.partial" "$target"
  echo "make tools: built $name in $((SECONDS - start)) s, $(du -m "$target" | cut -f1) MiB" >&2
done
