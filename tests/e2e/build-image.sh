#!/usr/bin/env bash
# Build the project's image from the Dockerfile, as a user would, with buildah (Debian's
# package: no daemon, no registry), and write it as an archive that containerd imports
# (`ctr images import`). The e2e cluster's pods (the chart's webhook, every injected
# sidecar, the workloads) run this image.
#
#   bash tests/e2e/build-image.sh        # prints the archive's path on stdout
#
# The base is not pulled (there is no registry here): PYTHON_IMAGE is a Debian bookworm
# root with python3 made by mmdebstrap from Debian's packages, cached beside the
# Kubernetes build and imported into buildah's storage once. The Dockerfile's default base,
# the one a user gets, stays the official python image.
#
# A TLS-inspecting proxy between this machine and the package index (a corporate network,
# and this project's CI) needs its CA inside the build: this machine's CA bundle and pip
# configuration are handed to the build as secrets (--secret id=ca-bundle / id=pip-conf,
# which the Dockerfile mounts for its pip steps only), so the image is the same as without.
#
# Environment: VRAM_ENFORCER_CACHE (default ~/.cache/vram-enforcer); VRAM_ENFORCER_IMAGE,
# the name given to the image (default localhost/vram-enforcer:e2e).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${VRAM_ENFORCER_CACHE:-$HOME/.cache/vram-enforcer}
IMAGE=${VRAM_ENFORCER_IMAGE:-localhost/vram-enforcer:e2e}
SUITE=bookworm
# What the Dockerfile needs of its base: `python` with venv and pip, groupadd/useradd, and
# a CA bundle. --variant=apt: Debian's Essential packages and apt, as in debian:bookworm-slim
# (the official python image's base); apt brings libstdc++6, which grpcio's wheel needs.
PACKAGES=python3,python3-venv,python-is-python3,passwd,ca-certificates
VARIANT=apt
BASE_ID=$(printf '%s %s %s' "$SUITE" "$VARIANT" "$PACKAGES" | sha256sum | cut -c1-12)
BASE_TAR="$CACHE/image-base/debian-$SUITE-python-$BASE_ID.tar"
BASE_IMAGE="localhost/vram-enforcer-base:$SUITE-$BASE_ID"
ARCHIVE="$CACHE/image/vram-enforcer.tar"

log() { echo "build-image: $*" >&2; }
# vfs: no overlay mounts, which a machine without a container engine may not allow;
# chroot isolation: no user namespaces or runtime needed, as root.
bah() { buildah --storage-driver vfs "$@"; }

for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null || { log "needs $tool (apt-get install buildah mmdebstrap)"; exit 1; }
done
mkdir -p "$CACHE/image-base" "$CACHE/image"
exec 9>"$CACHE/.build-image.lock"
flock 9
started=$(date +%s)

if [ ! -f "$BASE_TAR" ]; then
    log "making the base ($SUITE: $PACKAGES) with mmdebstrap"
    mmdebstrap --quiet --format=tar --variant="$VARIANT" --include="$PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$SUITE" "$BASE_TAR.tmp" http://deb.debian.org/debian
    mv "$BASE_TAR.tmp" "$BASE_TAR"
fi
# Bases of other package lists are not used again.
find "$CACHE/image-base" -mindepth 1 -maxdepth 1 ! -name "$(basename "$BASE_TAR")" -exec rm -rf {} +
for stale in $(bah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/vram-enforcer-base:' | grep -vx "$BASE_IMAGE"); do
    bah rmi "$stale" >/dev/null
done
if ! bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "importing the base as $BASE_IMAGE"
    container=$(bah from scratch)
    bah add "$container" "$BASE_TAR" / >/dev/null
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 "$container"
    bah commit --rm --quiet "$container" "$BASE_IMAGE" >/dev/null
fi

secrets=()
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
[ -f "$ca" ] && secrets+=(--secret "id=ca-bundle,src=$ca")
for conf in "${PIP_CONFIG_FILE:-}" /etc/pip.conf "${XDG_CONFIG_HOME:-$HOME/.config}/pip/pip.conf" "$HOME/.pip/pip.conf"; do
    if [ -n "$conf" ] && [ -f "$conf" ]; then
        secrets+=(--secret "id=pip-conf,src=$conf")
        break
    fi
done

log "building $IMAGE from the Dockerfile (base $BASE_IMAGE)"
revision=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
bah bud --quiet --isolation chroot --build-arg "PYTHON_IMAGE=$BASE_IMAGE" \
    --build-arg "REVISION=$revision" "${secrets[@]}" -t "$IMAGE" "$ROOT" >/dev/null
# The image replaced under the same name, and the builder stage, are left untagged.
bah rmi --prune >/dev/null 2>&1 || true
rm -f "$ARCHIVE.tmp"
bah push --quiet "$IMAGE" "docker-archive:$ARCHIVE.tmp:$IMAGE"
mv "$ARCHIVE.tmp" "$ARCHIVE"
log "built in $(($(date +%s) - started)) s: $ARCHIVE ($(du -m "$ARCHIVE" | cut -f1) MiB)"
echo "$ARCHIVE"
