#!/usr/bin/env bash
# Build a real kube-apiserver (1.20.2) from Debian's source package, offline, and cache it
# outside the checkout. Idempotent: a cached binary that runs is reused at once.
#
#   bash tests/e2e/build-kube-apiserver.sh      # prints the binary's path on stdout
#
# Needs root on Debian 12 (apt). Takes about 6-7 minutes on 2 cores the first time; the
# build tree (about 2 GB, in ${TMPDIR:-/tmp}) is removed afterwards, whatever happens.
#
# Environment: VRAM_ENFORCER_CACHE (default ~/.cache/vram-enforcer) is where the binary goes.
set -euo pipefail

VERSION=1.20.2
CACHE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}
OUT="$CACHE/kube-apiserver-$VERSION"
BIN="$OUT/kube-apiserver"
SRC_LIST=/etc/apt/sources.list.d/vram-enforcer-src.sources
REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
export DEBIAN_FRONTEND=noninteractive

log() { echo "build-kube-apiserver: $*" >&2; }

need_packages() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]}"
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

cached() { [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -qx "Kubernetes v$VERSION"; }

# Runtime needs of the e2e tests: etcd and openssl. Checked even with a cached binary (cheap).
need_packages etcd-server openssl
if cached; then
    echo "$BIN"
    exit 0
fi

# One build at a time per cache; a build that finished while we waited is reused.
mkdir -p "$CACHE"
exec 9>"$CACHE/.build-kube-apiserver.lock"
flock 9
if cached; then
    echo "$BIN"
    exit 0
fi

need_packages golang-go rsync dpkg-dev golang-github-modern-go-reflect2-dev
[ -f "$REFLECT2/go_above_118.go" ] || { log "$REFLECT2 is not reflect2 >= 1.0.2"; exit 1; }

# The main Debian mirror configured for this release (deb822 or one-line format).
debian_mirror() {
    local codename uri
    codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
    uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | tr '\t' ' ' | awk -v cn="$codename" '
        BEGIN { RS = ""; FS = "\n" }
        {
            types = suites = uri = ""
            for (i = 1; i <= NF; i++) {
                if ($i ~ /^Types:/) types = " " substr($i, 7) " "
                else if ($i ~ /^Suites:/) suites = " " substr($i, 8) " "
                else if ($i ~ /^URIs:/) { split(substr($i, 6), u, " "); uri = u[1] }
            }
            if (types ~ / deb / && suites ~ (" " cn " ") && uri != "") { print uri; exit }
        }')
    if [ -z "$uri" ]; then
        uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk -v cn="$codename" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == cn) { print $i; exit }
            }')
    fi
    echo "${uri:-http://deb.debian.org/debian}" "$codename"
}

has_source() { apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Package: kubernetes$'; }

# apt-get source needs a deb-src entry; add one for the configured mirror if none serves it.
if ! has_source; then
    apt-get update -qq
    if ! has_source; then
        read -r mirror codename < <(debian_mirror)
        log "adding deb-src $mirror $codename in $SRC_LIST"
        cat >"$SRC_LIST" <<EOF
Types: deb-src
URIs: $mirror
Suites: $codename
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        apt-get update -qq
        has_source || { log "no source package for kubernetes in $mirror $codename"; exit 1; }
    fi
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kube-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
started=$(date +%s)

log "fetching the kubernetes source package into $WORK"
# As root, apt warns that the download is unsandboxed: harmless, hence the log.
apt-get source --download-only kubernetes >"$WORK/apt-source.log" 2>&1 \
    || { tail -20 "$WORK/apt-source.log" >&2; exit 1; }
dpkg-source -x ./kubernetes_*.dsc src >/dev/null # unpacks and applies Debian's patches
cd src
grep -q "tag: v$VERSION" hack/lib/version.sh \
    || { log "the source package is not Kubernetes v$VERSION; update VERSION here"; exit 1; }

# The vendored reflect2 1.0.1 faults at run time under Go >= 1.18 (it reads runtime
# internals that changed): use Debian's 1.0.2. vendor/modules.txt still says 1.0.1, which
# only the module consistency check reads; the API is the same.
rm -rf vendor/github.com/modern-go/reflect2
mkdir -p vendor/github.com/modern-go/reflect2
cp -r "$REFLECT2/." vendor/github.com/modern-go/reflect2/

# As debian/rules does: GOPATH layout, CGO off, `make WHAT=...`. hack/lib/golang.sh then sets
# its own GOPATH and GOCACHE under _output/, and go.mod ("go 1.15") plus vendor/ make Go use
# the vendored sources only. GOPROXY=off guarantees that nothing is downloaded. Stray
# GOFLAGS would break the build scripts' -tags parsing, so they are cleared.
mkdir -p .go/src/k8s.io
ln -sfn ../../.. .go/src/k8s.io/kubernetes
unset GOFLAGS GO111MODULE GOBIN GOROOT
export GOPATH="$PWD/.go" GOPROXY=off GOSUMDB=off CGO_ENABLED=0 HOME="$WORK/home"
mkdir -p "$HOME"
log "building cmd/kube-apiserver with $(go version | cut -d' ' -f3) (about 6-7 minutes on 2 cores)"
make WHAT=cmd/kube-apiserver >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; exit 1; }

mkdir -p "$OUT"
install -m 0755 _output/bin/kube-apiserver "$BIN.tmp"
"$BIN.tmp" --version >/dev/null
mv "$BIN.tmp" "$BIN"
log "built in $(($(date +%s) - started)) s"
echo "$BIN"
