#!/usr/bin/env bash
# Regenerate the gRPC code into a temp dir and fail when it differs from what is committed
# (with --write, update the committed files instead).
set -euo pipefail
cd "$(dirname "$0")/../plugin_src/src"
PY=${PY:-../../.venv/bin/python}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -I. --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  rdma_device_plugin/api/deviceplugin.proto
for f in deviceplugin_pb2.py deviceplugin_pb2_grpc.py deviceplugin_pb2.pyi; do
  if [[ "${1:-}" == "--write" ]]; then
    cp "$out/rdma_device_plugin/api/$f" "rdma_device_plugin/api/$f"
  elif ! diff -q "$out/rdma_device_plugin/api/$f" "rdma_device_plugin/api/$f" >/dev/null; then
    echo "generated $f is stale: run make proto" >&2; exit 1
  fi
done
echo "generated gRPC code is up to date"
