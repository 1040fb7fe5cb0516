#!/usr/bin/env bash
# Build a current Kubernetes control plane and node (kube-apiserver, kube-scheduler,
# kube-controller-manager, kubelet, kube-proxy), kubectl, etcd, containerd and a pause
# binary from the Go module proxy with the ordinary `go` client, and the kube-apiserver of
# the oldest Kubernetes the chart supports; cache them outside the checkout. Idempotent:
# cached binaries that run are reused at once. runc and the CNI plugins come from Debian
# (.ci/run installs them).
#
#   bash tests/e2e/build-kubernetes.sh      # prints the cache directory on stdout
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces its staging modules
# (k8s.io/api, k8s.io/apimachinery, ...) with paths inside its own tree. So the binaries
# are built from a throw-away module that requires k8s.io/kubernetes at the release and
# points each staging module at its published version of the same release (v0.X.Y for
# v1.X.Y). etcd's server module has the same kind of replaces; it gets the same treatment.
#
# Environment: VRAM_ENFORCER_CACHE (default ~/.cache/vram-enforcer) is where they go;
# GOPROXY as usual.
set -euo pipefail

K8S=${VRAM_ENFORCER_K8S_VERSION:-1.37.2}
OLDEST=${VRAM_ENFORCER_K8S_OLDEST:-1.31.4}  # the chart's kubeVersion floor (see tests/e2e/README.md)
ETCD=${VRAM_ENFORCER_ETCD_VERSION:-3.6.6}
CONTAINERD=${VRAM_ENFORCER_CONTAINERD_VERSION:-2.4.2}
CACHE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}
OUT="$CACHE/kubernetes-$K8S"
BINARIES=(kube-apiserver kube-scheduler kube-controller-manager kubelet kube-proxy)

log() { echo "build-kubernetes: $*" >&2; }

# reports PATTERN COMMAND...: COMMAND runs and a line of its output matches PATTERN (grep -E).
# The output is read in full before it is matched: under pipefail, `cmd | grep -q` fails
# whenever grep exits before cmd's last write (SIGPIPE), a race that kubectl's and etcd's
# multi-line --version lose now and then.
reports() {
    local pattern=$1 out
    shift
    out=$("$@" 2>/dev/null) || return 1
    grep -Eq -- "$pattern" <<<"$out"
}

cached() {
    local b v=${K8S//./\\.}
    for b in "${BINARIES[@]}"; do
        reports "^Kubernetes v$v\$" "$OUT/$b" --version || return 1
    done
    reports "^Client Version: v$v\$" "$OUT/kubectl" version --client &&
        reports "^etcd Version: ${ETCD//./\\.}\$" "$OUT/etcd" --version &&
        reports " ${CONTAINERD//./\\.}([+ ]|\$)" "$OUT/containerd" --version &&
        [ -x "$OUT/containerd-shim-runc-v2" ] && [ -x "$OUT/ctr" ] && [ -x "$OUT/pause" ] &&
        reports "^Kubernetes v${OLDEST//./\\.}\$" "$CACHE/kubernetes-$OLDEST/kube-apiserver" --version
}

if cached; then
    echo "$OUT"
    exit 0
fi
command -v go >/dev/null || { log "needs Go (1.26 or newer) and the Go module proxy"; exit 1; }

# One build at a time per cache; a build that finished while we waited is reused.
mkdir -p "$CACHE"
exec 9>"$CACHE/.build-kubernetes.lock"
flock 9
if cached; then
    echo "$OUT"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vram-kube-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
started=$(date +%s)
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local

# Kubernetes: the staging modules are the ones its go.mod replaces with ./staging paths.
# build_kubernetes VERSION DIR BINARY...: the binaries of release VERSION into DIR.
build_kubernetes() {
    local version=$1 dir=$2 b
    shift 2
    mkdir -p "$WORK/k8s-$version" "$dir"
    cd "$WORK/k8s-$version"
    echo "module vram-enforcer.invalid/probe" >go.mod
    go mod download -json "k8s.io/kubernetes@v$version" >download.json
    cp "$(sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p' download.json)" upstream.mod
    {
        echo "module vram-enforcer.invalid/kube-build"
        echo
        echo "go 1.26"
        echo
        echo "require k8s.io/kubernetes v$version"
        echo
        echo "replace ("
        awk '/=> \.\/staging\/src\// { print "\t" $1 " => " $1 " v0." substr(v, 3) }' v="$version" upstream.mod |
            grep -v -e k8s.io/sample-cli-plugin -e k8s.io/sample-controller
        echo ")"
    } >go.mod
    local pkg=k8s.io/component-base/version minor
    minor=$(echo "$version" | cut -d. -f2)
    local ldflags="-s -w -X $pkg.gitVersion=v$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    log "Kubernetes v$version: resolving modules"
    for b in "$@"; do
        log "building $b v$version"
        go build -trimpath -ldflags "$ldflags" -o "$dir/$b" "k8s.io/kubernetes/cmd/$b"
    done
}
mkdir -p "$WORK/bin"
build_kubernetes "$K8S" "$WORK/bin" "${BINARIES[@]}" kubectl
build_kubernetes "$OLDEST" "$WORK/oldest" kube-apiserver

# etcd: its server module (package main at its root) replaces its sibling modules.
mkdir -p "$WORK/etcd"
cd "$WORK/etcd"
cat >go.mod <<MOD
module vram-enforcer.invalid/etcd-build

go 1.26

require go.etcd.io/etcd/server/v3 v$ETCD

replace (
	go.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 v$ETCD
	go.etcd.io/etcd/client/pkg/v3 => go.etcd.io/etcd/client/pkg/v3 v$ETCD
	go.etcd.io/etcd/client/v3 => go.etcd.io/etcd/client/v3 v$ETCD
	go.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 v$ETCD
)
MOD
log "building etcd v$ETCD"
go build -trimpath -ldflags "-s -w" -o "$WORK/bin/etcd" go.etcd.io/etcd/server/v3

# containerd 2.x (no replaces in its go.mod: a plain go install), without the snapshotters
# that need cgo; and pause, the sandbox's one process, as the kubelet's image would run it.
log "building containerd v$CONTAINERD"
GOBIN="$WORK/bin" go install -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "-s -w" \
    "github.com/containerd/containerd/v2/cmd/containerd@v$CONTAINERD" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@v$CONTAINERD" \
    "github.com/containerd/containerd/v2/cmd/ctr@v$CONTAINERD"
mkdir -p "$WORK/pause"
cd "$WORK/pause"
printf 'module pause\n\ngo 1.26\n' >go.mod
cat >main.go <<'GO'
// pause holds a pod's namespaces until it is told to stop.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
GO
go build -trimpath -ldflags "-s -w" -o "$WORK/bin/pause" .

mkdir -p "$OUT" "$CACHE/kubernetes-$OLDEST"
mv "$WORK/oldest/kube-apiserver" "$CACHE/kubernetes-$OLDEST/kube-apiserver.tmp"
mv "$CACHE/kubernetes-$OLDEST/kube-apiserver.tmp" "$CACHE/kubernetes-$OLDEST/kube-apiserver"
for b in "${BINARIES[@]}" kubectl etcd containerd containerd-shim-runc-v2 ctr pause; do
    mv "$WORK/bin/$b" "$OUT/$b.tmp" && mv "$OUT/$b.tmp" "$OUT/$b"
done
log "built in $(($(date +%s) - started)) s: $OUT"
cached || { log "the built binaries do not report the expected versions"; exit 1; }
echo "$OUT"
