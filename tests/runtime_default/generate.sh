#!/usr/bin/env bash
# Regenerate enforcer/core/runtime_default.py: containerd's RuntimeDefault seccomp profile
# for the default capability set, per architecture, from containerd's own source
# (contrib/seccomp/seccomp_default.go at CONTAINERD_VERSION). The allocation gate's profile
# replaces RuntimeDefault, so it must allow what RuntimeDefault allows, no more.
#
#   bash tests/runtime_default/generate.sh            # writes enforcer/core/runtime_default.py
#   bash tests/runtime_default/generate.sh --json     # prints the profiles (the drift test)
#
# containerd picks the architecture with `runtime.GOARCH`, a constant: the source file is
# copied into a throw-away module with `runtime.GOARCH` replaced by a variable, so one run
# on amd64 prints the arm64 profile too. Needs Go, the Go module proxy and ruff (RUFF=path).
set -euo pipefail

CONTAINERD_VERSION=${CONTAINERD_VERSION:-2.4.2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/tests/runtime_default"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export GOFLAGS=-mod=mod
go mod init runtimedefault >/dev/null 2>&1
go mod edit -require "github.com/containerd/containerd/v2@v$CONTAINERD_VERSION"
go mod download "github.com/containerd/containerd/v2@v$CONTAINERD_VERSION"
src=$(go list -m -f '{{.Dir}}' "github.com/containerd/containerd/v2")/contrib/seccomp/seccomp_default.go
mkdir profile
sed -e 's/runtime\.GOARCH/GOARCH/g' -e 's/^\t"runtime"$//' "$src" > profile/default.go
printf 'package seccomp\n\n// GOARCH stands for runtime.GOARCH in the copied source.\nvar GOARCH string\n' > profile/goarch.go
sed -i 's/^package seccomp$/package seccomp/' profile/default.go
cp "$HERE/main.go" main.go
go mod tidy >/dev/null 2>&1
json=$(go run . "$CONTAINERD_VERSION")
if [ "${1:-}" = "--json" ]; then
    echo "$json"
    exit 0
fi
out="$ROOT/enforcer/core/runtime_default.py"
"${PYTHON:-python3}" "$HERE/write.py" "$out" <<<"$json"
"${RUFF:-ruff}" format --quiet "$out"
