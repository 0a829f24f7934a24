#!/usr/bin/env bash
# Build tools/imgsig (cosign's key-pair signature format, from go-containerregistry and
# sigstore/sigstore: the deploy role's image verifier, and the tests' signer) into
# .cache/imgsig/bin/imgsig. A stamp of every input (the module's files, the Go version) skips an
# unchanged tree at once; the first build compiles about 300 packages (about 2 minutes on 2 busy
# cores; cosign itself took over 7: docs/security.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dir=.cache/imgsig
command -v go >/dev/null || { echo "imgsig-build: go not found: install Go 1.26 (the version make kube uses)" >&2; exit 1; }
stamp=$(cd tools/imgsig && cat go.mod go.sum ./*.go | sha256sum | cut -d' ' -f1)-$(go env GOVERSION)
if [[ -x $dir/bin/imgsig && $(cat "$dir/.stamp" 2>/dev/null) == "$stamp" ]]; then
  exit 0
fi
mkdir -p "$dir/bin"
echo "imgsig-build: building tools/imgsig into $dir/bin"
(cd tools/imgsig && GOFLAGS=-mod=mod go build -trimpath -o "$root/$dir/bin/imgsig.new" .)
mv "$dir/bin/imgsig.new" "$dir/bin/imgsig"
echo "$stamp" >"$dir/.stamp"
