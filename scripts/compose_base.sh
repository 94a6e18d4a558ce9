#!/usr/bin/env bash
# Build base images for the container image without any image registry
# (`make compose-base`): Debian bookworm from Debian's own packages with
# debootstrap, imported into the container engine.
#
#   localhost/mmadmit-base:bookworm        runtime base: python3 (3.11), venv, CA certificates
#   localhost/mmadmit-build-base:bookworm  the same plus gcc and the Python headers, so the
#                                          image's build stage compiles the C extensions
#
# Then build with them:
#   BASE_IMAGE=localhost/mmadmit-base:bookworm BUILD_IMAGE=localhost/mmadmit-build-base:bookworm
#
# Needs root (debootstrap), debootstrap itself, a Debian mirror (MIRROR) and
# podman or docker (ENGINE). Settings (environment):
#   ENGINE       podman | docker (default: podman if present, else docker)
#   SUITE        Debian suite (default bookworm; its python3 must be >= 3.11)
#   MIRROR       Debian mirror (default http://deb.debian.org/debian)
#   BASE_IMAGE   runtime base tag   (default localhost/mmadmit-base:$SUITE)
#   BUILD_IMAGE  build base tag     (default localhost/mmadmit-build-base:$SUITE)
#   WORKDIR      scratch folder for the root file systems (default .cache/compose-base,
#                gitignored); the downloaded .debs are kept in WORKDIR/debs for reruns
#   FORCE=1      rebuild even if both images already exist
set -euo pipefail

cd "$(dirname "$0")/.."
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE_IMAGE=${BASE_IMAGE:-localhost/mmadmit-base:$SUITE}
BUILD_IMAGE=${BUILD_IMAGE:-localhost/mmadmit-build-base:$SUITE}
WORKDIR=${WORKDIR:-.cache/compose-base}
FORCE=${FORCE:-0}

log() { printf '[compose-base] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

if [[ -z ${ENGINE:-} ]]; then
    if command -v podman >/dev/null 2>&1; then ENGINE=podman
    elif command -v docker >/dev/null 2>&1; then ENGINE=docker
    else die "no container engine (podman or docker) on PATH"; fi
fi
command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found (apt-get install -y debootstrap)"
[[ $(id -u) -eq 0 ]] || die "debootstrap needs root"

have_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

if [[ $FORCE != 1 ]] && have_image "$BASE_IMAGE" && have_image "$BUILD_IMAGE"; then
    log "$BASE_IMAGE and $BUILD_IMAGE exist already (FORCE=1 rebuilds)"
    exit 0
fi

mkdir -p "$WORKDIR/debs"
WORKDIR=$(cd "$WORKDIR" && pwd)

# make_rootfs NAME TAG PACKAGES: debootstrap a minimal root file system and import it.
make_rootfs() {
    local name=$1 tag=$2 packages=$3 dir="$WORKDIR/$1"
    rm -rf "$dir"
    log "debootstrap $SUITE ($packages) -> $dir"
    debootstrap --variant=minbase --include="$packages" --cache-dir="$WORKDIR/debs" \
        "$SUITE" "$dir" "$MIRROR" >"$WORKDIR/$name.log" 2>&1 \
        || { tail -n 20 "$WORKDIR/$name.log" >&2; die "debootstrap failed (log: $WORKDIR/$name.log)"; }
    # Nothing of the host's or the download's belongs in the image.
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
        "$dir"/var/log/* "$dir"/tmp/* "$dir"/etc/hostname
    : >"$dir/etc/resolv.conf"
    "$dir/usr/bin/python3" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
        || die "$SUITE's python3 is older than 3.11"
    log "importing $dir as $tag"
    tar --numeric-owner -C "$dir" -c . | "$ENGINE" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
    rm -rf "$dir"
}

RUNTIME_PACKAGES=python3,python3-venv,ca-certificates
make_rootfs runtime "$BASE_IMAGE" "$RUNTIME_PACKAGES"
make_rootfs build "$BUILD_IMAGE" "$RUNTIME_PACKAGES,gcc,libc6-dev,python3-dev"
log "done: BASE_IMAGE=$BASE_IMAGE BUILD_IMAGE=$BUILD_IMAGE"
"$ENGINE" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'mmadmit-(build-)?base' >&2 || true
