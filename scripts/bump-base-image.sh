#!/usr/bin/env bash
# Move the image's committed base (plugin_src/base-image) to what a tag names today:
#
#   scripts/bump-base-image.sh                                   the pinned name's tag again
#   scripts/bump-base-image.sh docker.io/library/debian:bookworm-slim
#
# The digest is the sha256 of the manifest the registry serves for the tag (for a multi-platform base,
# its manifest list), the digest `FROM name@digest` pulls; the list must hold linux/amd64. Needs
# skopeo and the registry. Review the diff and commit it: releases and the plugin_image role build
# FROM the committed digest only. TLS_VERIFY=false for a plain-HTTP registry (127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
pin=plugin_src/base-image
current=$(grep -v '^#' "$pin")
name=${1:-${current%@*}}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
skopeo inspect --raw --tls-verify="${TLS_VERIFY:-true}" "docker://$name" >"$raw"  # the bytes as served: their sha256 is the digest
digest=sha256:$(sha256sum <"$raw" | cut -d' ' -f1)
if grep -q '"manifests"' "$raw"; then
  grep -q '"architecture": *"amd64"' "$raw" \
    || { echo "bump-base-image: $name@$digest has no linux/amd64 image" >&2; exit 1; }
fi
sed -i "s|^[^#].*|$name@$digest|" "$pin"
echo "bump-base-image: $pin: ${current#*@} -> $digest ($name)"
