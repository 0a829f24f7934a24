#!/usr/bin/env bash
# Regenerate the gRPC code into a temp dir and fail when it differs from what is committed
# (with --write, update the committed files instead).
#
# deviceplugin.proto is written here from the upstream contract. The kubelet's DRA, DRA health and
# plugin registration protos are upstream's own files, copied verbatim from k8s.io/kubelet at the
# version kube/go.mod pins (the Go module cache, `go mod download`): a copy that differs from
# upstream is drift too (--write copies them again).
set -euo pipefail
cd "$(dirname "$0")/../plugin_src/src"
PY=${PY:-$(cd ../.. && pwd)/.venv/bin/python}
api=rdma_device_plugin/api
# upstream path under k8s.io/kubelet -> our file name (flat: one Python module per proto)
declare -A upstream=(
  [dra_v1.proto]=pkg/apis/dra/v1/api.proto
  [dra_v1beta1.proto]=pkg/apis/dra/v1beta1/api.proto
  [drahealth_v1.proto]=pkg/apis/dra-health/v1/api.proto
  [pluginregistration_v1.proto]=pkg/apis/pluginregistration/v1/api.proto
)
version=$(awk '$1 == "k8s.io/kubelet" && $2 ~ /^v/ {print $2; exit}' ../../kube/go.mod)
if command -v go >/dev/null 2>&1 && [[ -n "$version" ]]; then
  dir=$(cd ../../kube && go mod download -json "k8s.io/kubelet@$version" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  for f in "${!upstream[@]}"; do
    if [[ "${1:-}" == "--write" ]]; then
      install -m 0644 "$dir/${upstream[$f]}" "$api/$f"
    elif ! cmp -s "$dir/${upstream[$f]}" "$api/$f"; then
      echo "$api/$f differs from k8s.io/kubelet@$version ${upstream[$f]}: run make proto" >&2; exit 1
    fi
  done
else
  echo "go not found: the kubelet protos were not compared with k8s.io/kubelet@${version:-?} (generated code still is)" >&2
fi
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
protos=(deviceplugin.proto "${!upstream[@]}")
"$PY" -m grpc_tools.protoc -I. --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  "${protos[@]/#/$api/}"
for p in "${protos[@]}"; do
  for f in "${p%.proto}_pb2.py" "${p%.proto}_pb2_grpc.py" "${p%.proto}_pb2.pyi"; do
    if [[ "${1:-}" == "--write" ]]; then
      cp "$out/$api/$f" "$api/$f"
    elif ! diff -q "$out/$api/$f" "$api/$f" >/dev/null; then
      echo "generated $f is stale: run make proto" >&2; exit 1
    fi
  done
done
echo "generated gRPC code is up to date"
