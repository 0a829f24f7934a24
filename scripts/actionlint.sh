#!/usr/bin/env bash
# Lint the GitHub Actions workflows (.github/workflows/*.yml) with actionlint, built from the Go module
# proxy at a pinned version into out/tools/ on first use (no GitHub download needed; Go's build cache
# makes a rebuild seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=v1.7.12
tool=out/tools/actionlint-$VERSION/actionlint
if [[ ! -x $tool ]]; then
  command -v go >/dev/null || { echo "actionlint: Go is needed to build it (https://go.dev/dl/, Go >= 1.24)" >&2; exit 1; }
  echo "actionlint: building github.com/rhysd/actionlint $VERSION into $(dirname "$tool")"
  GOBIN=$PWD/$(dirname "$tool") GOFLAGS=-buildvcs=false go install -trimpath "github.com/rhysd/actionlint/cmd/actionlint@$VERSION"
fi
"$tool" .github/workflows/*.yml
echo "actionlint: .github/workflows/*.yml pass"
