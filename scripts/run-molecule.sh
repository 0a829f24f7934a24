#!/usr/bin/env bash
# Run every molecule scenario under molecule/ (each for real on localhost).
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
scenarios=(molecule/*/molecule.yml)
[[ ${#scenarios[@]} -eq 0 ]] && { echo "no molecule scenarios"; exit 0; }
failed=()
for f in "${scenarios[@]}"; do
  s=$(basename "$(dirname "$f")")
  echo "=== molecule test -s $s"
  if ! molecule test -s "$s"; then failed+=("$s"); fi
done
mkdir -p out/test-results
names=$(IFS=,; echo "${failed[*]}")
echo "passed=$(( ${#scenarios[@]} - ${#failed[@]} )) failed=${#failed[@]} names=$names" > out/test-results/molecule.txt
if [[ ${#failed[@]} -gt 0 ]]; then echo "molecule scenarios failed: ${failed[*]}" >&2; exit 1; fi
echo "molecule: ${#scenarios[@]} scenarios passed"
