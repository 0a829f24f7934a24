#!/usr/bin/env bash
# One release, built and published: what .github/workflows/release.yml runs on a tag, and what
# molecule/release runs here against a registry on 127.0.0.1 (the same commands).
#
#   RELEASE_REGISTRY=ghcr.io/lingjun-rdma scripts/release.sh v0.1.0 [all|build|publish]
#
# Two phases, so that the workflow builds in a job without credentials or write permissions and
# publishes in one that only pushes (all, the default, runs both):
# build (no credentials, no network writes):
# 1. the tag's version is the plugin's and the chart's appVersion, and CHANGELOG.md has its section;
# 2. the image, built with buildah for every platform of PLATFORMS into one manifest list, written
#    as an OCI layout ($OUT/image); the list's digest is kept (the push keeps it: --preserve-digests);
# 3. the chart, its default image set to <RELEASE_REGISTRY>/rdma-device-plugin:<version>@<digest>,
#    packaged by the Helm binary built from kube/helm/go.mod ($OUT/chart/);
# 4. the collection tarball (ansible-galaxy collection build);
# 5. the release notes from the CHANGELOGs, with how to install each artifact; release.json.
# publish (reads only $OUT, needs skopeo, jq and Helm, not the virtualenv):
# 6. a registry login into a temporary auth file, the password read from stdin (never a command
#    line); the image copied to <RELEASE_REGISTRY>/rdma-device-plugin:<version> with its digest, the
#    chart pushed by `helm push` to oci://<RELEASE_REGISTRY>/charts (a published version never
#    changes: the same version with other content is refused).
# Everything lands in $OUT (default out/release): image/, chart/, notes.md, release.json, the
# collection tarball.
#
# Environment:
#   RELEASE_REGISTRY   registry host[:port][/namespace] for the image and the chart (required)
#   PLATFORMS          default linux/amd64, the one platform plugin_src/requirements*.lock hold hashes for
#                      (docs/security.md: why arm64 is not built); another platform needs its hashes in the
#                      locks and, when not the host's, qemu binfmt handlers (`update-binfmts --display`)
#   BASE_IMAGE, BASE_IMAGE_DIGEST   default: the reference committed in plugin_src/base-image (nothing is
#                      looked up from a tag at release time; scripts/bump-base-image.sh moves the pin);
#                      another BASE_IMAGE needs its BASE_IMAGE_DIGEST
#   TLS_VERIFY         true (default), or false for a plain-HTTP registry (127.0.0.1)
#   REGISTRY_USER, REGISTRY_PASSWORD   a login for the pushes (optional; the password goes to the
#                      login through stdin, into an auth file of its own that is removed at the end)
#   HELM               the Helm v4 binary (default: the one `make kube` builds from kube/helm/go.mod)
#   STORAGE_DRIVER     buildah storage driver (default vfs); BUILD_ISOLATION (default chroot)
#   PIP_CA             CA bundle for pip inside the build (default the host's, when present)
#   RELEASE_DRAFT=1    a rehearsal: the version's CHANGELOG section may still say (unreleased)
#   PY                 Python with ansible and the collection's requirements (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

tag=${1:?usage: scripts/release.sh v<version> [all|build|publish]}
phase=${2:-all}
[[ $phase =~ ^(all|build|publish)$ ]] || { echo "release: phase '$phase': use all, build or publish" >&2; exit 2; }
version=${tag#v}
: "${RELEASE_REGISTRY:?RELEASE_REGISTRY (registry host[:port][/namespace]) is required, e.g. ghcr.io/lingjun-rdma}"
PLATFORMS=${PLATFORMS:-linux/amd64}
if [[ -z ${BASE_IMAGE:-} ]]; then
  # the committed pin: its one line that is not a comment, <name>@sha256:<digest>
  pinned=$(grep -v '^#' plugin_src/base-image)
  BASE_IMAGE=${pinned%@*} BASE_IMAGE_DIGEST=${pinned#*@}
fi
[[ ${BASE_IMAGE_DIGEST:-} =~ ^sha256:[0-9a-f]{64}$ ]] || {
  echo "release: BASE_IMAGE=$BASE_IMAGE needs BASE_IMAGE_DIGEST=sha256:<64 hex> (got '${BASE_IMAGE_DIGEST:-}'):" \
    "a release builds FROM a digest, never a tag; leave BASE_IMAGE unset for the committed plugin_src/base-image," \
    "or move that pin with scripts/bump-base-image.sh" >&2
  exit 2
}
# Every platform needs its wheels' hashes in the locks (pip --require-hashes refuses any other file):
# scripts/lock-image-deps.sh writes the platforms it hashed into the lock's header.
locked=$(sed -n 's/^# .*Hashes: scripts\/lock-image-deps.sh (CPython [0-9.]*, \(.*\))\.$/\1/p' plugin_src/requirements.lock)
for platform in ${PLATFORMS//,/ }; do
  arch=$(echo "${platform#*/}" | sed -e 's/amd64/x86_64/' -e 's/arm64/aarch64/')
  [[ ", $locked, " == *", ${platform%%/*} $arch, "* ]] || {
    echo "release: PLATFORMS names $platform, but plugin_src/requirements.lock holds hashes for $locked only:" \
      "pip --require-hashes would refuse its wheels. Leave it out of PLATFORMS, or hash its wheels into the" \
      "locks (scripts/lock-image-deps.sh) and build it under qemu (docs/security.md)" >&2
    exit 2
  }
done
TLS_VERIFY=${TLS_VERIFY:-true}
STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
BUILD_ISOLATION=${BUILD_ISOLATION:-chroot}
PY=${PY:-$root/.venv/bin/python}
OUT=${OUT:-$root/out/release}
PIP_CA=${PIP_CA-/etc/ssl/certs/ca-certificates.crt}
bin=$(dirname "$PY")
draft=()
[[ ${RELEASE_DRAFT:-0} == 1 ]] && draft=(--draft)

step() { echo "release [$1/6] $2"; }
fail() { echo "release: $*" >&2; exit 1; }
bah() { buildah --storage-driver "$STORAGE_DRIVER" "$@"; }

tools=(skopeo jq)
[[ $phase != publish ]] && tools+=(buildah)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || fail "'$tool' not found: install it (apt-get install -y $tool)"
done
if [[ -z ${HELM:-} ]]; then
  HELM=$(ls "$root"/.cache/kubernetes/*/bin/helm 2>/dev/null | tail -n 1 || true)
fi
[[ -n $HELM && -x $HELM ]] || fail "Helm not found: run make kube, or build it from the pinned modules" \
  "(cd kube/helm && GOFLAGS=-mod=mod go build -o \$PWD/helm helm.sh/helm/v4/cmd/helm) and set HELM"
host=${RELEASE_REGISTRY%%/*}
namespace=${RELEASE_REGISTRY#"$host"}
namespace=${namespace#/}
image_repo=$RELEASE_REGISTRY/rdma-device-plugin
chart_repo=$host${namespace:+/$namespace}/charts
plain_http=()
[[ $TLS_VERIFY == false ]] && plain_http=(--plain-http)

context='' auth_dir='' list=''
cleanup() {
  [[ -z $context ]] || rm -rf "$context"
  [[ -z $auth_dir ]] || rm -rf "$auth_dir"  # the registry login
  [[ -z $list ]] || bah manifest rm "$list" >/dev/null 2>&1 || true
}
trap cleanup EXIT

build() {
[[ -x $PY ]] || fail "$PY not found: run make setup first (or set PY)"
step 1 "versions and CHANGELOG of $tag"
"$PY" scripts/release_notes.py check "$version" "${draft[@]}"
rm -rf "$OUT" && mkdir -p "$OUT"

step 2 "image $image_repo:$version for $PLATFORMS"
native=$(uname -m | sed -e 's/x86_64/amd64/' -e 's/aarch64/arm64/')
for platform in ${PLATFORMS//,/ }; do
  arch=${platform#*/}
  if [[ $arch != "$native" ]] && ! grep -qsl "^interpreter.*qemu-${arch/arm64/aarch64}" /proc/sys/fs/binfmt_misc/*; then
    fail "building $platform on this $native host runs its binaries under qemu, and no qemu-${arch/arm64/aarch64}" \
      "binfmt handler is registered: install qemu-user-static (Debian/Ubuntu), or leave it out of PLATFORMS"
  fi
done
echo "  base $BASE_IMAGE@$BASE_IMAGE_DIGEST"
context=$(mktemp -d "${TMPDIR:-/tmp}/rdma-release.XXXXXX")
list=localhost/rdma-device-plugin-release:$version
# Two contexts, as the plugin_image role builds: the plugin, and the node package (rdma-node: its
# one home is the collection's plugins/module_utils, the Dockerfile copies pyproject.toml and rdma_node/).
mkdir -p "$context/plugin" "$context/rdma-node"
(cd plugin_src && cp -RL --parents Dockerfile pyproject.toml README.md requirements.lock requirements-build.lock src "$context/plugin")
(cd plugins/module_utils && cp -RL --parents pyproject.toml rdma_node "$context/rdma-node")
find "$context" -name __pycache__ -prune -exec rm -rf {} +
bah manifest rm "$list" >/dev/null 2>&1 || true
bah manifest create "$list" >/dev/null
secret=()
[[ -n $PIP_CA && -s $PIP_CA ]] && secret=(--secret "id=pip_ca,src=$PIP_CA")
for platform in ${PLATFORMS//,/ }; do
  echo "  building $platform"
  bah build --quiet --platform "$platform" --manifest "$list" --isolation "$BUILD_ISOLATION" "${secret[@]}" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "BASE_IMAGE_DIGEST=$BASE_IMAGE_DIGEST" \
    --build-arg "VERSION=$version" --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    --build-context "rdma-node=$context/rdma-node" --file "$context/plugin/Dockerfile" "$context/plugin" >/dev/null
done
# An OCI layout, pushed as it is by the publish phase (skopeo copy --preserve-digests): the digest the
# chart pins is the one the registry serves.
bah manifest push --all --quiet --format oci --digestfile "$OUT/image.digest" "$list" "oci:$OUT/image:$version"
digest=$(cat "$OUT/image.digest")
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "the build reported no digest for $image_repo:$version ($digest)"
echo "  built $image_repo:$version@$digest ($OUT/image)"

step 3 "chart, its image pinned to $digest"
chart=$context/chart/rdma-device-plugin
mkdir -p "$(dirname "$chart")"
cp -R charts/rdma-device-plugin "$chart"
rm -rf "$chart/tests"
"$PY" - "$chart" "$host" "${namespace:+$namespace/}rdma-device-plugin" "$version" "$digest" <<'PY'
"""The chart's default image becomes the released one: values.yaml's image block, Artifact Hub's list."""
import re, sys
chart, registry, repository, tag, digest = sys.argv[1:]
path = f"{chart}/values.yaml"
text = open(path).read()
block = re.search(r"^image:\n(?:(?:  .*)?\n)+", text, re.M)
new = block.group(0)
for key, value in (("registry", registry), ("repository", repository), ("tag", tag), ("digest", digest)):
    new, n = re.subn(rf"^  {key}: .*$", f"  {key}: {value}", new, count=1, flags=re.M)
    assert n == 1, f"values.yaml image.{key} not found"
open(path, "w").write(text[: block.start()] + new + text[block.end():])
path = f"{chart}/Chart.yaml"
text = open(path).read()
text, n = re.subn(r"(\n\s+image: ).*rdma-device-plugin:\S+", rf"\g<1>{registry}/{repository}:{tag}@{digest}", text)
assert n == 1, "Chart.yaml artifacthub.io/images not found"
open(path, "w").write(text)
PY
chart_version=$(sed -n 's/^version: *//p' "$chart/Chart.yaml")
mkdir -p "$OUT/chart"
"$HELM" package "$chart" --destination "$OUT/chart" >/dev/null
chart_ref=oci://$chart_repo/rdma-device-plugin:$chart_version
echo "  $OUT/chart/rdma-device-plugin-$chart_version.tgz, to be pushed as $chart_ref"

step 4 "collection tarball"
ANSIBLE_CONFIG=$root/ansible.cfg "$bin/ansible-galaxy" collection build . --output-path "$OUT" --force >/dev/null
collection=$(ls "$OUT"/lingjun-rdma-*.tar.gz)
echo "  $collection"

step 5 "release notes"
"$PY" scripts/release_notes.py notes "$version" "${draft[@]}" --image "$image_repo:$version@$digest" \
  --chart "$chart_ref" --collection "$collection" --platforms "${PLATFORMS//,/, }" > "$OUT/notes.md"
jq -n --arg version "$version" --arg image "$image_repo:$version" --arg digest "$digest" --arg chart "$chart_ref" \
  --arg collection "$collection" --arg platforms "$PLATFORMS" \
  --arg chart_file "$OUT/chart/rdma-device-plugin-$chart_version.tgz" \
  '{version: $version, image: $image, digest: $digest, chart: $chart, chart_file: $chart_file,
    collection: $collection, platforms: ($platforms | split(","))}' > "$OUT/release.json"
echo "release $tag built: $OUT/notes.md, $OUT/release.json"
}

publish() {
[[ -s $OUT/release.json ]] || fail "$OUT/release.json not found: run the build phase first"
digest=$(jq -r .digest "$OUT/release.json")
chart_ref=$(jq -r .chart "$OUT/release.json")
chart_file=$(jq -r .chart_file "$OUT/release.json")
[[ $(jq -r .image "$OUT/release.json") == "$image_repo:$version" ]] \
  || fail "$OUT/release.json is of $(jq -r .image "$OUT/release.json"), not $image_repo:$version"
step 6 "publish $image_repo:$version@$digest and $chart_ref"
auth_dir=$(mktemp -d "${TMPDIR:-/tmp}/rdma-release-auth.XXXXXX")
auth=$auth_dir/auth.json
echo '{"auths": {}}' > "$auth"
if [[ -n ${REGISTRY_USER:-} ]]; then
  # stdin, not a command line: a password in argv is visible to every process of the machine
  printf '%s' "${REGISTRY_PASSWORD:?REGISTRY_PASSWORD goes with REGISTRY_USER}" \
    | skopeo login --authfile "$auth" --tls-verify="$TLS_VERIFY" --username "$REGISTRY_USER" --password-stdin "$host" >/dev/null
fi
skopeo copy --all --preserve-digests --quiet --authfile "$auth" --dest-tls-verify="$TLS_VERIFY" \
  "oci:$OUT/image:$version" "docker://$image_repo:$version"
served=sha256:$(skopeo inspect --raw --authfile "$auth" --tls-verify="$TLS_VERIFY" "docker://$image_repo:$version" | sha256sum | cut -d' ' -f1)
[[ $served == "$digest" ]] || fail "the registry serves $image_repo:$version as $served, not the built $digest"
echo "  pushed $image_repo:$version@$digest"
# A version once published never changes: pull what the registry has under it, if anything.
existing=$auth_dir/existing
mkdir -p "$existing"
if "$HELM" pull "${chart_ref%:*}" --version "${chart_ref##*:}" --registry-config "$auth" "${plain_http[@]}" \
    --destination "$existing" >/dev/null 2>&1; then
  if [[ $(tar -xzOf "$existing"/*.tgz | sha256sum) != $(tar -xzOf "$chart_file" | sha256sum) ]]; then
    fail "chart rdma-device-plugin ${chart_ref##*:} is already published at $chart_ref with other content:" \
      "bump the chart version (charts/rdma-device-plugin/CHANGELOG.md) instead of pushing it again"
  fi
  echo "  already published (same content) $chart_ref"
else
  "$HELM" push "$chart_file" "oci://$chart_repo" --registry-config "$auth" "${plain_http[@]}" >/dev/null
  echo "  pushed $chart_ref"
fi
echo "release $tag published"
}

[[ $phase != publish ]] && build
[[ $phase != build ]] && publish
exit 0
