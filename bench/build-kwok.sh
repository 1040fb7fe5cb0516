#!/usr/bin/env bash
# Build kwok (sigs.k8s.io/kwok, the simulated nodes of the creation-storm benchmark) from
# the Go module proxy and cache it beside the Kubernetes binaries, with the Stage objects
# its own kwokctl uses for fast nodes and pods (kwok alone runs no stage it is not given).
# Idempotent: a cached binary that runs is reused at once.
#
#   bash bench/build-kwok.sh      # prints the directory: kwok, stages/*.yaml
#
# Environment: VRAM_ENFORCER_CACHE (default ~/.cache/vram-enforcer); GOPROXY as usual.
set -euo pipefail

KWOK=${VRAM_ENFORCER_KWOK_VERSION:-0.8.0}
CACHE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}
OUT="$CACHE/kwok-$KWOK"
# Stage files of kwok's repository, by path under kustomize/stage: nodes become Ready and
# keep a kubelet's heartbeats (a lease, and their status every ten minutes), pods become
# Running once bound.
STAGES=(node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml)

cached() {
    local s
    "$OUT/kwok" --version 2>/dev/null | grep -q "$KWOK" || return 1
    for s in "${STAGES[@]}"; do [ -s "$OUT/stages/$(basename "$s")" ] || return 1; done
}

build() {
    local source s
    mkdir -p "$OUT/stages"
    export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
    echo "build-kwok: go install sigs.k8s.io/kwok/cmd/kwok@v$KWOK" >&2
    GOBIN="$OUT" go install "sigs.k8s.io/kwok/cmd/kwok@v$KWOK"
    source=$(go env GOMODCACHE)/sigs.k8s.io/kwok@v$KWOK/kustomize/stage
    for s in "${STAGES[@]}"; do
        install -m 0644 "$source/$s" "$OUT/stages/$(basename "$s")"
    done
}

# shellcheck source=tests/e2e/go-tool.sh
source "$(dirname "$0")/../tests/e2e/go-tool.sh"
go_tool kwok "$OUT" "a kwok that reports version $KWOK, and its stages"
