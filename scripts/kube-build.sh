#!/usr/bin/env bash
# Build the real Kubernetes components the tests and the local cluster use, from the modules pinned
# in kube/go.mod (k8s.io/kubernetes and its staging modules, etcd) and kube/helm/go.mod (Helm v4):
#   etcd kube-apiserver kube-controller-manager kube-scheduler kubectl   (upstream commands)
#   kubelet-managers   the kubelet's device, Topology and DRA managers behind a JSON protocol (kube/cmd)
#   kubelet            the real kubelet (k8s.io/kubernetes/cmd/kubelet, no overlay), for the real node
#   helm               Helm v4
# from kube/node/go.mod, the real node's container runtime (scripts/real_node.py, make node-up):
#   containerd containerd-shim-runc-v2 ctr   containerd 2.x
#   runc               cgo with libseccomp (Debian's libseccomp-dev), -tags seccomp
#   cni/bridge cni/host-local cni/loopback   the CNI plugins of the node's pod network
# and, from kube/v1.32/go.mod, kubelet-dm-serve: the device manager of Kubernetes v1.32 (the
# 1.28-1.34 re-registration behaviour, kubernetes issue 121994, that v1.37 no longer has) into
# .cache/kubernetes/<that version>/bin/.
# into .cache/kubernetes/<k8s.io/kubernetes version>/bin/ (KUBE_BIN overrides). Nothing is built
# when the binaries there were built from the same sources (a stamp of every input); otherwise Go's
# build cache (GOCACHE) makes a rebuild take seconds to a minute. The first build compiles about
# 3000 packages: tens of minutes on 2 cores; progress is printed as packages compile.
#
# usage: scripts/kube-build.sh [--print-bin | --print-legacy-bin]   (only print the bin directory of
#        kubelet-managers and the rest, or of the v1.32 kubelet-dm-serve)
set -euo pipefail
self=$(realpath "$0")
root=$(cd "$(dirname "$self")/.." && pwd)
cd "$root/kube"
command -v go >/dev/null || { echo "kube-build: no Go toolchain on PATH: install Go >= $(sed -n 's/^go //p' go.mod) (https://go.dev/doc/install)" >&2; exit 1; }
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
version=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
bin=${KUBE_BIN:-$root/.cache/kubernetes/$version/bin}
if [ "${1:-}" = "--print-bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$bin"

# The stamp: every input of the build (module files, our Go sources, the overlay, this script, Go).
stamp=$( { go version; cat "$self" go.mod go.sum helm/go.mod helm/go.sum v1.32/go.mod v1.32/go.sum node/go.mod node/go.sum; find cmd overlay helm v1.32 node -name '*.go' -not -path '*/vendor/*' -print0 | sort -z | xargs -0 cat; } | sha256sum | cut -c1-16)
legacy_version=$(cd v1.32 && go list -m -f '{{.Version}}' k8s.io/kubernetes)
legacy_bin=$root/.cache/kubernetes/$legacy_version/bin
if [ "${1:-}" = "--print-legacy-bin" ]; then echo "$legacy_bin"; exit 0; fi
tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet-managers helm kubelet
       containerd containerd-shim-runc-v2 ctr runc cni/bridge cni/host-local cni/loopback)
have=1
for t in "${tools[@]}"; do [ -x "$bin/$t" ] || have=0; done
[ -x "$legacy_bin/kubelet-dm-serve" ] || have=0
if [ $have = 1 ] && [ "$(cat "$bin/.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "kube-build: Kubernetes $version components up to date in $bin"
  exit 0
fi

# vendor DIR: `go mod vendor` in a module dir when its go.mod or go.sum changed since the last time.
vendor() {
  if [ ! -f "$1/vendor/modules.txt" ] || [ "$1/go.mod" -nt "$1/vendor/modules.txt" ] || [ "$1/go.sum" -nt "$1/vendor/modules.txt" ]; then
    echo "kube-build: go mod vendor in kube/${1#./} (the pinned sources, from Go's module cache)"
    (cd "$1" && go mod vendor)
  fi
}

# overlay/devicemanager/*.go join the device manager package (exposes its unexported
# constructor and read-only views; no behaviour added): `go build -overlay` leaves the sources as
# they are, but refuses files in the module cache, so the build reads a vendor tree (kube/vendor,
# not committed: `go mod vendor` writes it from the module cache, go.sum-checked). With -trimpath Go's
# build cache serves vendored packages as well as module-cache ones.
vendor .
vendor v1.32
export GOFLAGS=-mod=vendor
dm=$PWD/vendor/k8s.io/kubernetes/pkg/kubelet/cm/devicemanager
overlay=$(mktemp "${TMPDIR:-/tmp}/kube-overlay.XXXXXX.json")
trap 'rm -f "$overlay"' EXIT
printf '{"Replace": {"%s/zz_kubelet_managers.go": "%s/overlay/devicemanager/zz_kubelet_managers.go"}}\n' "$dm" "$PWD" > "$overlay"
overlay132=$(mktemp "${TMPDIR:-/tmp}/kube-overlay.XXXXXX.json")
trap 'rm -f "$overlay" "$overlay132"' EXIT
printf '{"Replace": {"%s/vendor/k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/zz_kubelet_dm_serve.go": "%s/v1.32/overlay/devicemanager/zz_kubelet_dm_serve.go"}}\n' "$PWD/v1.32" "$PWD" > "$overlay132"

pkgs=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl ./cmd/etcd ./cmd/kubelet-managers)
node_pkgs=(github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
           github.com/containerd/containerd/v2/cmd/ctr)
cni_pkgs=(github.com/containernetworking/plugins/plugins/main/bridge github.com/containernetworking/plugins/plugins/ipam/host-local
          github.com/containernetworking/plugins/plugins/main/loopback)
# runc's seccomp filter needs cgo and libseccomp; without it every pod fails "seccomp not supported".
if ! pkg-config --exists libseccomp 2>/dev/null; then
  echo "kube-build: libseccomp-dev is missing (runc needs it for seccomp): run make system-deps" >&2
  exit 1
fi
# containerd's release tags: no btrfs/devmapper/zfs snapshotters (their cgo headers are not needed here).
ctd_tags="no_btrfs no_devmapper no_zfs"
ctd_version=$(cd node && GOFLAGS=-mod=mod go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)
runc_version=$(cd node && GOFLAGS=-mod=mod go list -m -f '{{.Version}}' github.com/opencontainers/runc)
total=$( { go list -overlay "$overlay" -deps "${pkgs[@]}" k8s.io/kubernetes/cmd/kubelet; (cd helm && GOFLAGS=-mod=mod go list -deps helm.sh/helm/v4/cmd/helm)
           (cd node && GOFLAGS=-mod=mod go list -tags "$ctd_tags seccomp" -deps "${node_pkgs[@]}" "${cni_pkgs[@]}" github.com/opencontainers/runc)
           (cd v1.32 && go list -deps -overlay "$overlay132" ./cmd/kubelet-dm-serve | sed 's/^/v1.32:/'); } | sort -u | wc -l)
echo "kube-build: Kubernetes $version: building ${tools[*]} into $bin"
echo "kube-build: $total packages; Go's build cache ($(go env GOCACHE)) holds what was compiled before"
start=$(date +%s)
# go build -v names each package as it compiles it (cached ones are not named): a progress line
# every 100 packages and every 30 s.
progress() {
  awk -v total="$total" -v start="$start" '
    { n++; now = systime()
      if (n % 100 == 0 || now - last >= 30) { printf "kube-build: compiled %d of at most %d packages (%d s)\n", n, total, now - start; fflush(); last = now } }
    END { printf "kube-build: compiled %d packages (the others came from the build cache)\n", n }'
}
# The version the binaries report, set as Kubernetes' own build sets it (hack/lib/version.sh).
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=$version -X $p.gitMajor=$(echo "$version" | cut -d. -f1 | tr -d v)"
  ldflags+=" -X $p.gitMinor=$(echo "$version" | cut -d. -f2) -X $p.gitTreeState=clean"
done
set +e
{
  go build -v -trimpath -overlay "$overlay" -ldflags "$ldflags" -o "$bin/" "${pkgs[@]}" &&
  # The real kubelet: upstream's sources only (the overlay is kubelet-managers' alone).
  go build -v -trimpath -ldflags "$ldflags" -o "$bin/kubelet" k8s.io/kubernetes/cmd/kubelet &&
  (cd node && export GOFLAGS=-mod=mod &&
   go build -v -trimpath -tags "$ctd_tags" -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$ctd_version" \
     -o "$bin/" "${node_pkgs[@]}" &&
   CGO_ENABLED=1 go build -v -trimpath -tags seccomp -ldflags "-s -w -X main.version=${runc_version#v}" -o "$bin/runc" github.com/opencontainers/runc &&
   mkdir -p "$bin/cni" && CGO_ENABLED=0 go build -v -trimpath -ldflags "-s -w" -o "$bin/cni/" "${cni_pkgs[@]}") &&
  (cd helm && GOFLAGS=-mod=mod go build -v -trimpath -ldflags "-s -w" -o "$bin/helm" helm.sh/helm/v4/cmd/helm) &&
  mkdir -p "$legacy_bin" &&
  (cd v1.32 && go build -v -trimpath -overlay "$overlay132" -ldflags "-s -w" -o "$legacy_bin/kubelet-dm-serve" ./cmd/kubelet-dm-serve)
} 2>&1 | tee "$bin/.build.log" | grep --line-buffered -v '^#' | progress
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
  echo "kube-build: the build failed; the last lines of $bin/.build.log:" >&2
  tail -20 "$bin/.build.log" >&2
  exit 1
fi
echo "$stamp" > "$bin/.stamp"
echo "kube-build: built in $(( $(date +%s) - start )) s: $(cd "$bin" && ls | tr '\n' ' ')and $legacy_bin/kubelet-dm-serve"
