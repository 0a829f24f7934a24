#!/usr/bin/env bash
# Make a local Debian bookworm base image for plugin_src/Dockerfile when no registry can
# be pulled from (CI, air-gapped build hosts). It holds what the image's final stage needs
# at run time (python3, python3-pyverbs from rdma-core), so the Dockerfile's apt steps find
# nothing missing; the Dockerfile still works unchanged on debian:bookworm-slim.
#
#   scripts/make-base-image.sh [IMAGE]        default IMAGE: localhost/rdma-dp-base:bookworm
#
# Environment:
#   STORAGE_DRIVER  buildah storage driver (default: vfs; overlay needs a kernel/fuse setup)
#   MIRROR          Debian mirror (default: http://deb.debian.org)
#   FORCE=1         rebuild even when the image already exists
#   EXTRA_PACKAGES  comma-separated extra packages to include
#
# Cached: a second call returns at once when IMAGE exists in buildah's storage.
# Needs root (or a user namespace), mmdebstrap and buildah (Debian packages).
set -euo pipefail

IMAGE=${1:-localhost/rdma-dp-base:bookworm}
STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
MIRROR=${MIRROR:-http://deb.debian.org}
SUITE=bookworm
PACKAGES="python3,python3-pyverbs,ca-certificates${EXTRA_PACKAGES:+,$EXTRA_PACKAGES}"

for tool in mmdebstrap buildah; do
  command -v "$tool" >/dev/null || {
    echo "make-base-image: '$tool' not found; install it: apt-get install -y $tool" >&2
    exit 1
  }
done
bah() { buildah --storage-driver "$STORAGE_DRIVER" "$@"; }
# One build at a time: make test's lanes (the real node, molecule's plugin-image) may ask at once.
exec 9>"${TMPDIR:-/tmp}/rdma-dp-base.lock"
flock 9

if [[ ${FORCE:-0} != 1 ]] && bah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  echo "make-base-image: $IMAGE already present (FORCE=1 to rebuild)"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/rdma-dp-base.XXXXXX")
ctr=""
cleanup() {
  [[ -n $ctr ]] && bah rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s)
# minbase + the same dpkg path excludes as debian:*-slim (no docs, man pages, locales),
# written into the rootfs so later apt installs honour them too.
# The merged-usr hook lays out /usr-merge itself (as debootstrap does) and so avoids
# pulling usrmerge + perl (~50 MB) into the image.
mmdebstrap --quiet --variant=minbase --format=tar \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --include="$PACKAGES" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --dpkgopt='path-exclude=/usr/share/lintian/*' \
  --aptopt='APT::Install-Recommends "false"' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  "$SUITE" "$work/rootfs.tar" \
  "deb $MIRROR/debian $SUITE main" \
  "deb $MIRROR/debian $SUITE-updates main" \
  "deb $MIRROR/debian-security $SUITE-security main" \
  >"$work/mmdebstrap.log" 2>&1 || {
  echo "make-base-image: mmdebstrap failed (is $MIRROR reachable?); its log:" >&2
  tail -n 40 "$work/mmdebstrap.log" >&2
  exit 1
}

ctr=$(bah from scratch)
bah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
bah config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd /bin/bash \
  --label org.opencontainers.image.title="rdma-dp-base" \
  --label org.opencontainers.image.description="Debian $SUITE minbase + python3, python3-pyverbs (made by scripts/make-base-image.sh)" \
  "$ctr"
bah commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
ctr=""
echo "make-base-image: built $IMAGE in $(( $(date +%s) - start ))s"
