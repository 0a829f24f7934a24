#!/usr/bin/env bash
# Install the Debian packages listed in scripts/system-packages.txt that are missing.
# Idempotent and quick when everything is present.
set -euo pipefail
cd "$(dirname "$0")"
mapfile -t pkgs < <(grep -vE '^\s*(#|$)' system-packages.txt)
[[ ${#pkgs[@]} -eq 0 ]] && exit 0
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && { echo "system packages present"; exit 0; }
SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
