#!/usr/bin/env bash
# One release, built and published: what .github/workflows/release.yml runs on a tag, and what
# molecule/release runs here against a registry on 127.0.0.1 (the same commands).
#
#   RELEASE_REGISTRY=ghcr.io/lingjun-rdma scripts/release.sh v0.1.0
#
# 1. the tag's version is the plugin's and the chart's appVersion, and CHANGELOG.md has its section;
# 2. the image, built with buildah for every platform of PLATFORMS into one manifest list, pushed as
#    <RELEASE_REGISTRY>/rdma-device-plugin:<version>; the pushed list's digest is kept;
# 3. the chart, its default image set to that image pinned by digest, packaged and pushed to
#    oci://<RELEASE_REGISTRY>/charts/rdma-device-plugin:<chart version> by the collection's own
#    rdma_chart_publish (the plugin_image role's chart push; a published version never changes);
# 4. the collection tarball (ansible-galaxy collection build);
# 5. the release notes from the CHANGELOGs, with how to install each artifact.
# Everything lands in $OUT (default out/release): notes.md, release.json, the collection tarball.
#
# Environment:
#   RELEASE_REGISTRY   registry host[:port][/namespace] for the image and the chart (required)
#   PLATFORMS          default linux/amd64,linux/arm64; a platform other than the host's needs qemu
#                      binfmt handlers (the workflow installs them; `update-binfmts --display`)
#   BASE_IMAGE         default docker.io/library/debian:bookworm-slim
#   BASE_IMAGE_DIGEST  default: the digest the registry serves for BASE_IMAGE (skopeo)
#   TLS_VERIFY         true (default), or false for a plain-HTTP registry (127.0.0.1)
#   REGISTRY_USER, REGISTRY_PASSWORD   a login for the pushes (optional)
#   STORAGE_DRIVER     buildah storage driver (default vfs); BUILD_ISOLATION (default chroot)
#   PIP_CA             CA bundle for pip inside the build (default the host's, when present)
#   RELEASE_DRAFT=1    a rehearsal: the version's CHANGELOG section may still say (unreleased)
#   PY                 Python with ansible and the collection's requirements (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

tag=${1:?usage: scripts/release.sh v<version>}
version=${tag#v}
: "${RELEASE_REGISTRY:?RELEASE_REGISTRY (registry host[:port][/namespace]) is required, e.g. ghcr.io/lingjun-rdma}"
PLATFORMS=${PLATFORMS:-linux/amd64,linux/arm64}
BASE_IMAGE=${BASE_IMAGE:-docker.io/library/debian:bookworm-slim}
TLS_VERIFY=${TLS_VERIFY:-true}
STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
BUILD_ISOLATION=${BUILD_ISOLATION:-chroot}
PY=${PY:-$root/.venv/bin/python}
OUT=${OUT:-$root/out/release}
PIP_CA=${PIP_CA-/etc/ssl/certs/ca-certificates.crt}
bin=$(dirname "$PY")
draft=()
[[ ${RELEASE_DRAFT:-0} == 1 ]] && draft=(--draft)

step() { echo "release [$1/5] $2"; }
fail() { echo "release: $*" >&2; exit 1; }
bah() { buildah --storage-driver "$STORAGE_DRIVER" "$@"; }

for tool in buildah skopeo; do
  command -v "$tool" >/dev/null || fail "'$tool' not found: install it (apt-get install -y $tool)"
done
[[ -x $PY ]] || fail "$PY not found: run make setup first (or set PY)"
host=${RELEASE_REGISTRY%%/*}
namespace=${RELEASE_REGISTRY#"$host"}
namespace=${namespace#/}
image_repo=$RELEASE_REGISTRY/rdma-device-plugin
tls=(--tls-verify="$TLS_VERIFY")
creds=()
if [[ -n ${REGISTRY_USER:-} ]]; then
  creds=(--creds "$REGISTRY_USER:${REGISTRY_PASSWORD:?REGISTRY_PASSWORD goes with REGISTRY_USER}")
fi

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
if [[ -z ${BASE_IMAGE_DIGEST:-} ]]; then
  # the digest of what the reference names (a manifest list for a multi-platform base)
  BASE_IMAGE_DIGEST=sha256:$(skopeo inspect --raw "docker://$BASE_IMAGE" | sha256sum | cut -d' ' -f1)
fi
context=$(mktemp -d "${TMPDIR:-/tmp}/rdma-release.XXXXXX")
list=localhost/rdma-device-plugin-release:$version
cleanup() {
  rm -rf "$context"
  bah manifest rm "$list" >/dev/null 2>&1 || true
}
trap cleanup EXIT
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
bah manifest push --all --quiet "${tls[@]}" "${creds[@]}" --digestfile "$OUT/image.digest" \
  "$list" "docker://$image_repo:$version"
digest=$(cat "$OUT/image.digest")
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "the push reported no digest for $image_repo:$version ($digest)"
echo "  pushed $image_repo:$version@$digest"

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
publish=$(jq -n --arg chart "$chart" --arg registry "$host" --arg repository "${namespace:+$namespace/}charts" \
  --argjson tls "$TLS_VERIFY" --arg user "${REGISTRY_USER:-}" --arg password "${REGISTRY_PASSWORD:-}" \
  '{chart_path: $chart, registry: $registry, repository: $repository, tls_verify: $tls, username: $user, password: $password}')
# this checkout's collection whatever the caller's Ansible settings (molecule sets a relative path)
ran=$(ANSIBLE_CONFIG=$root/ansible.cfg ANSIBLE_COLLECTIONS_PATH=$root/collections ANSIBLE_STDOUT_CALLBACK=json \
  ANSIBLE_LOAD_CALLBACK_PLUGINS=1 "$bin/ansible" localhost -c local -e "ansible_python_interpreter=$PY" \
  -m lingjun.rdma.rdma_chart_publish -a "$publish" 2>"$context/publish.err") || true
published=$(jq -c '.plays[0].tasks[0].hosts.localhost' <<<"$ran" 2>/dev/null) \
  || fail "the chart push did not run: $ran $(cat "$context/publish.err")"
jq -e '.failed != true' <<<"$published" >/dev/null || fail "the chart push failed: $(jq -r .msg <<<"$published")"
chart_ref=$(jq -r .ref <<<"$published")
echo "  $(jq -r 'if .changed then "pushed" else "already published (same content)" end' <<<"$published") $chart_ref"

step 4 "collection tarball"
ANSIBLE_CONFIG=$root/ansible.cfg "$bin/ansible-galaxy" collection build . --output-path "$OUT" --force >/dev/null
collection=$(ls "$OUT"/lingjun-rdma-*.tar.gz)
echo "  $collection"

step 5 "release notes"
"$PY" scripts/release_notes.py notes "$version" "${draft[@]}" --image "$image_repo:$version@$digest" \
  --chart "$chart_ref" --collection "$collection" --platforms "${PLATFORMS//,/, }" > "$OUT/notes.md"
jq -n --arg version "$version" --arg image "$image_repo:$version" --arg digest "$digest" --arg chart "$chart_ref" \
  --arg collection "$collection" --arg platforms "$PLATFORMS" \
  '{version: $version, image: $image, digest: $digest, chart: $chart, collection: $collection,
    platforms: ($platforms | split(","))}' > "$OUT/release.json"
echo "release $tag: $OUT/notes.md, $OUT/release.json"
