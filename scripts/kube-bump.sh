#!/usr/bin/env bash
# Move the Kubernetes the tests build (kube/go.mod) to another release, e.g. v1.38.0: one version
# is the one variable; this rewrites the pins that follow from it.
#   - require k8s.io/kubernetes VERSION
#   - replace every staging module that release's go.mod names (k8s.io/api, k8s.io/apiserver, ...)
#     with v0.MINOR.PATCH of the same release: k8s.io/kubernetes replaces them with paths inside its
#     own repository, which a dependent module ignores
#   - etcd's server module at the version of the etcd client that release requires
# then `go mod tidy`. Build with scripts/kube-build.sh (binaries go to .cache/kubernetes/VERSION/bin).
#
# usage: scripts/kube-bump.sh VERSION
set -euo pipefail
version=${1:?usage: scripts/kube-bump.sh VERSION (e.g. v1.38.0)}
[[ $version =~ ^v1\.([0-9]+)\.([0-9]+.*)$ ]] || { echo "kube-bump: $version is not a Kubernetes release (v1.MINOR.PATCH)" >&2; exit 2; }
staging="v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
cd "$(dirname "$0")/../kube"
export GOFLAGS=-mod=mod GOTOOLCHAIN=local
mod=$(go mod download -json "k8s.io/kubernetes@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
mapfile -t mods < <(sed -n '/^replace (/,/^)/p' "$mod" | awk '$2 == "=>" && $3 ~ /^\.\/staging/ {print $1}')
etcd=$(awk '$1 == "go.etcd.io/etcd/client/v3" {print $2; exit}' "$mod")
{
  sed '/^require/,$d' go.mod
  echo "require k8s.io/kubernetes $version"
  echo
  echo "// k8s.io/kubernetes names its staging modules as v0.0.0 and replaces them with paths inside its"
  echo "// own repository, which a dependent module ignores: pin each to the same release here."
  echo "replace ("
  for m in "${mods[@]}"; do
    # only the modules the proxy serves (sample-* are never published)
    if go list -m "$m@$staging" >/dev/null 2>&1; then printf '\t%s => %s %s\n' "$m" "$m" "$staging"; fi
  done
  echo ")"
} > go.mod.new
mv go.mod.new go.mod
go get "k8s.io/kubernetes@$version" "go.etcd.io/etcd/server/v3@$etcd"
for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do go get -tool "k8s.io/kubernetes/cmd/$c@$version"; done
go mod tidy
echo "kube-bump: kube/go.mod now pins k8s.io/kubernetes $version (staging $staging, etcd $etcd); build: scripts/kube-build.sh"
