#!/usr/bin/env bash
# Recompute requirements-dev.txt's sha256 hashes: `make setup` installs it with
# `pip install --require-hashes` (pip and setuptools included) and the project's own packages with
# --no-deps --no-build-isolation, so a changed or substituted file on the index fails the setup
# instead of running as root in CI and in the release's build job.
#
#   scripts/lock-dev-deps.sh                      the versions pinned in requirements-dev.txt
#   INDEX_URL=https://mirror/simple scripts/lock-dev-deps.sh
#
# Bump a tool: edit its pin in requirements-dev.txt, then run this. pip-compile (pip-tools, in a
# throwaway venv) resolves the pins again, adds what a new version needs, and lists the hashes of every
# file of each release (all platforms), as the index serves them.
set -euo pipefail
cd "$(dirname "$0")/.."
INDEX_URL=${INDEX_URL:-https://pypi.org/simple}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
PIP_CONFIG_FILE=/dev/null "$work/venv/bin/pip" install --quiet --isolated --index-url "$INDEX_URL" pip-tools==7.7.0
grep -E '^[A-Za-z0-9_.!-]+==' requirements-dev.txt | sed 's/ .*//' >"$work/pins.in"
# --isolated / PIP_CONFIG_FILE: ignore local pip config (find-links, constraints): the hashes must be the index's.
(cd "$work" && PIP_CONFIG_FILE=/dev/null venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe \
  --no-strip-extras --no-emit-find-links --no-emit-index-url --no-header --no-annotate \
  --index-url "$INDEX_URL" --output-file lock pins.in)
{
  echo "# Pinned development and test toolchain, with the sha256 hashes of every file of each release:"
  echo "# make setup installs it with pip --require-hashes, pip and setuptools included."
  echo "# Bump a version: edit its pin here, then scripts/lock-dev-deps.sh (re-resolves, recomputes the hashes)."
  cat "$work/lock"
} >"$work/out"
mv "$work/out" requirements-dev.txt
echo "lock-dev-deps: requirements-dev.txt: $(grep -cE '^[A-Za-z0-9_.!-]+==' requirements-dev.txt) pins, $(grep -c -- '--hash=' requirements-dev.txt) hashes"
