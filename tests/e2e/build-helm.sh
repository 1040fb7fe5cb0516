#!/usr/bin/env bash
# Build the helm command line from the Go module proxy (a plain `go install`) and cache it
# beside the Kubernetes build: the README's quick start runs `helm install` as written
# (tests/e2e/test_quickstart_e2e.py). The other chart tests drive Helm through helm-sdkpy.
#
#   bash tests/e2e/build-helm.sh        # prints the binary's path on stdout
#
# Environment: VRAM_ENFORCER_CACHE (default ~/.cache/vram-enforcer),
# VRAM_ENFORCER_HELM_VERSION (default 3.22.0); GOPROXY as usual.
set -euo pipefail

HELM=${VRAM_ENFORCER_HELM_VERSION:-3.22.0}
CACHE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}
OUT="$CACHE/helm-$HELM"

# The output is read whole before it is matched (under pipefail, `cmd | grep -q` can fail
# when grep exits before cmd's last write).
cached() {
    local out
    [ -x "$OUT/helm" ] && out=$("$OUT/helm" version --short 2>/dev/null) || return 1
    grep -Eq "^v${HELM//./\\.}(\+|\$)" <<<"$out"
}

build() {
    echo "build-helm: building helm v$HELM" >&2
    # The version stamp, as helm's own release build sets it.
    GOBIN="$OUT" CGO_ENABLED=0 GOTOOLCHAIN=local go install -trimpath \
        -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM" \
        "helm.sh/helm/v3/cmd/helm@v$HELM"
}

# shellcheck source=tests/e2e/go-tool.sh
source "$(dirname "$0")/go-tool.sh"
go_tool helm "$OUT/helm" "a helm that reports v$HELM"
