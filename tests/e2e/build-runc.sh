#!/usr/bin/env bash
# Build runc from the Go module proxy (a plain `go install`, with cgo: runc's nsenter is C,
# and the seccomp tag links Debian's libseccomp) and cache it beside the Kubernetes build.
# The e2e node (tests/e2e/node.py) runs its containers with it when it is there, else with
# Debian 12's runc 1.1.5, which cannot run a user-namespaced pod (`hostUsers: false` needs
# runc >= 1.2: idmapped mounts, which containerd asks `runc features` for).
#
#   bash tests/e2e/build-runc.sh        # prints the binary's path on stdout
#
# Needs gcc, pkg-config and libseccomp-dev (.ci/run installs them). Environment:
# VRAM_ENFORCER_CACHE (default ~/.cache/vram-enforcer), VRAM_ENFORCER_RUNC_VERSION (default
# 1.3.7, the version tests/e2e/node.py looks for); GOPROXY as usual.
set -euo pipefail

RUNC=${VRAM_ENFORCER_RUNC_VERSION:-1.3.7}
CACHE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}
OUT="$CACHE/runc-$RUNC"

# The output is read whole before it is matched (under pipefail, `cmd | grep -q` can fail
# when grep exits before cmd's last write).
cached() {
    local out
    [ -x "$OUT/runc" ] && out=$("$OUT/runc" --version 2>/dev/null) || return 1
    grep -Eq "^runc version ${RUNC//./\\.}\$" <<<"$out" && grep -q "^libseccomp: " <<<"$out"
}

build() {
    echo "build-runc: building runc v$RUNC" >&2
    # The version stamp, as runc's Makefile sets it (main.version).
    GOBIN="$OUT" CGO_ENABLED=1 GOTOOLCHAIN=local go install -trimpath -tags seccomp \
        -ldflags "-s -w -X main.version=$RUNC" "github.com/opencontainers/runc@v$RUNC"
}

# shellcheck source=tests/e2e/go-tool.sh
source "$(dirname "$0")/go-tool.sh"
go_tool runc "$OUT/runc" "a runc that reports $RUNC with libseccomp"
