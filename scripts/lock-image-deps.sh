#!/usr/bin/env bash
# Regenerate plugin_src/requirements.lock (runtime dependencies of the image) and
# plugin_src/requirements-build.lock (setuptools and flit_core, the backends the plugin's and the node
# package's wheels are built with) with sha256 hashes,
# for the image's platform: CPython 3.11 on linux x86_64 (Debian bookworm's python3).
# The Dockerfile installs both with `pip install --require-hashes`, so a changed or substituted
# file on the index fails the build instead of landing in the image.
#
#   scripts/lock-image-deps.sh            the versions pinned in the current lock files
#   INDEX_URL=https://mirror/simple scripts/lock-image-deps.sh
#
# Versions come from the existing files (keep them in step with requirements-dev.txt, which
# plugin_src/tests/test_packaging.py checks); only the hashes are recomputed from what the index serves.
set -euo pipefail
cd "$(dirname "$0")/../plugin_src"
INDEX_URL=${INDEX_URL:-https://pypi.org/simple}
PIP=${PIP:-../.venv/bin/pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

lock() {  # lock FILE HEADER...
  local file=$1; shift
  grep -E '^[A-Za-z0-9_.-]+==' "$file" | sed 's/ .*//' >"$work/pins"
  rm -rf "$work/dl" && mkdir "$work/dl"
  # --isolated: ignore local pip config (find-links, constraints); the hashes must be the index's.
  PIP_CONFIG_FILE=/dev/null "$PIP" download --isolated --quiet --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --index-url "$INDEX_URL" --dest "$work/dl" -r "$work/pins"
  {
    printf '%s\n' "$@"
    while read -r pin; do
      name=${pin%%==*}
      norm=$(echo "$name" | tr 'A-Z-' 'a-z_')
      wheel=$(cd "$work/dl" && ls | awk -v n="$norm" 'tolower($0) ~ "^"n"-" {print; exit}')
      [[ -n $wheel ]] || { echo "lock-image-deps: no wheel downloaded for $pin" >&2; exit 1; }
      printf '%s \\\n    --hash=sha256:%s\n' "$pin" "$(sha256sum "$work/dl/$wheel" | cut -d' ' -f1)"
    done <"$work/pins"
  } >"$work/out"
  mv "$work/out" "$file"
}

lock requirements.lock \
  "# Runtime dependencies of the container image, installed with pip --require-hashes." \
  "# Versions: keep in step with requirements-dev.txt. Hashes: scripts/lock-image-deps.sh (CPython 3.11, linux x86_64)."
lock requirements-build.lock \
  "# What the image's builder stage builds the plugin's and the node package's wheels with (pip wheel --no-build-isolation)," \
  "# installed with pip --require-hashes. Hashes: scripts/lock-image-deps.sh (CPython 3.11, linux x86_64)."
echo "lock-image-deps: wrote plugin_src/requirements.lock and plugin_src/requirements-build.lock"
