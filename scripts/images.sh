#!/usr/bin/env bash
# KVDrive's two images built offline from the project's own Dockerfile, for the one-node cluster
# (scripts/cluster.sh) or any containerd:
#
#   scripts/images.sh build          the Debian base (mmdebstrap, from this host's apt sources),
#                                    then the Dockerfile's `operator` and `runtime` targets (buildah)
#   scripts/images.sh archive DIR [PAUSE_BINARY PAUSE_IMAGE]
#                                    build if stale, then write DIR/<image>.tar (docker-archive,
#                                    uncompressed) for `ctr images import`; prints the paths. With a
#                                    pause binary, also the pods' sandbox image (FROM scratch)
#   scripts/images.sh names          the two image references
#
# No registry is reachable here, so the Dockerfile's base images are build arguments: both targets
# build FROM the local Debian base (bookworm, python3 3.11 with venv, the host's CA bundle and pip
# settings so that pip reaches the package index the host reaches). The runtime image takes torch
# from the host's pip index (TORCH_INDEX empty: PyPI's build, which runs on the CPU) and no KvikIO
# (EXTRAS empty). A user with registry access who runs `docker build` without build arguments gets
# nvidia/cuda + the CUDA 12.8 torch build + KvikIO, and python:3.11-slim for the operator.
#
# The images carry the references the chart and the operator default to
# (ghcr.io/kvdrive/kvdrive-operator:<appVersion>, ghcr.io/kvdrive/kvdrive-runtime:0.1.0). They are
# rebuilt when their build context changes (a hash of the Dockerfile, pyproject.toml, README.md
# and the three packages, kept as a label); buildah's layer cache keeps torch's layer across
# source changes. After a rebuild the images it replaced are pruned (untagged leaves, then their
# parents that nothing current descends from: `buildah rmi --prune`), so the storage holds one build
# of each target and its layer cache, not every build ever made (it grew by ~6 GiB a rebuild and
# starved the cluster's disk). Storage: ${KVDRIVE_IMAGE_CACHE:-$HOME/.cache/kvdrive/images}.
set -euo pipefail

SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$SCRIPTS")"
LOG_TAG=images
# shellcheck source=scripts/lib/gobuild.sh
source "$SCRIPTS/lib/gobuild.sh"
# shellcheck source=scripts/lib/hostdeps.sh
source "$SCRIPTS/lib/hostdeps.sh"

IMAGE_CACHE="${KVDRIVE_IMAGE_CACHE:-$HOME/.cache/kvdrive/images}"
SUITE="${KVDRIVE_BASE_SUITE:-bookworm}"
BASE_IMAGE="localhost/kvdrive/debian:$SUITE"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO/charts/kvdrive-operator/Chart.yaml")"
OPERATOR_IMAGE="ghcr.io/kvdrive/kvdrive-operator:$APP_VERSION"
RUNTIME_IMAGE="$(sed -n 's/^DEFAULT_IMAGE = "\(.*\)"$/\1/p' "$REPO/operator/api/spec.py")"
TORCH_SPEC="${KVDRIVE_IMAGE_TORCH_SPEC:-torch==2.13.0}"
HASH_LABEL=io.kvdrive.context-hash

bah() { buildah --root "$IMAGE_CACHE/storage" --runroot "$IMAGE_CACHE/run" --storage-driver overlay "$@"; }

context_hash() {
    (cd "$REPO" && git ls-files -co --exclude-standard -- Dockerfile .dockerignore pyproject.toml README.md \
        runtime operator router | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
}

label_of() {  # IMAGE -> the context hash it was built from ("" when absent)
    bah inspect --type image --format "{{index .ImageAnnotations \"$HASH_LABEL\"}}{{index .Docker.Config.Labels \"$HASH_LABEL\"}}" \
        "$1" 2>/dev/null || true
}

host_sources() {  # the host's apt sources, for mmdebstrap (deb822 .sources files and sources.list)
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
        [[ -s "$f" ]] && grep -qv '^[[:space:]]*\(#\|$\)' "$f" && echo "$f"
    done
    return 0
}

build_base() {
    if bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
        return 0
    fi
    local work start=$SECONDS sources
    work="$(mktemp -d)"
    mapfile -t sources < <(host_sources)
    ((${#sources[@]})) || { log "no apt sources on this host for mmdebstrap"; return 1; }
    log "building the Debian $SUITE base from ${sources[*]}"
    # minbase: essential + apt + required (passwd for useradd); python3 with venv, for both targets.
    # The hooks run in mmdebstrap's shell with $1 the new root (so: single quotes)
    # shellcheck disable=SC2016
    mmdebstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/ca-certificates.crt"' \
        --customize-hook='if [ -f /etc/pip.conf ]; then cp /etc/pip.conf "$1/etc/pip.conf"; fi' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        "$SUITE" "$work/rootfs.tar" "${sources[@]}" >"$work/mmdebstrap.log" 2>&1 \
        || { tail -20 "$work/mmdebstrap.log" >&2; rm -rf "$work"; return 1; }
    local ctr
    ctr="$(bah from --quiet scratch)"
    bah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash \
        --label "org.opencontainers.image.description=Debian $SUITE for KVDrive's local images" "$ctr"
    bah commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
    rm -rf "$work"
    log "base $BASE_IMAGE ready ($((SECONDS - start)) s)"
}

build_target() {  # TARGET IMAGE HASH BUILD-ARGS...
    local target="$1" image="$2" hash="$3" start=$SECONDS
    shift 3
    if [[ "$(label_of "$image")" == "$hash" ]]; then
        log "$image is up to date (context $hash)"
        return 0
    fi
    log "building $image (Dockerfile target $target, context $hash)"
    bah bud --quiet --isolation chroot --network host --layers --target "$target" --tag "$image" \
        --label "$HASH_LABEL=$hash" "$@" --file "$REPO/Dockerfile" "$REPO" >/dev/null
    log "$image built ($((SECONDS - start)) s)"
}

prune_replaced() {  # drop the images no tag reaches any more (what rebuilds left behind)
    local out removed=0 before after _
    before="$(df --output=avail -B1M "$IMAGE_CACHE" | tail -1)"
    for _ in 1 2 3 4 5 6 7 8; do  # a pass removes the leaves; their parents may be next
        out="$(bah rmi --prune 2>/dev/null)" && [[ -n "$out" ]] || break
        removed=$((removed + $(grep -c . <<<"$out")))
    done
    after="$(df --output=avail -B1M "$IMAGE_CACHE" | tail -1)"
    ((removed == 0)) || log "pruned $removed replaced images ($(((after - before) / 1024)) GiB freed)"
}

build() {
    need_packages mmdebstrap buildah
    mkdir -p "$IMAGE_CACHE"
    build_base
    local hash
    hash="$(context_hash)"
    build_target operator "$OPERATOR_IMAGE" "$hash" --build-arg "PYTHON_IMAGE=$BASE_IMAGE"
    build_target runtime "$RUNTIME_IMAGE" "$hash" --build-arg "CUDA_IMAGE=$BASE_IMAGE" \
        --build-arg TORCH_INDEX= --build-arg "TORCH_SPEC=$TORCH_SPEC" --build-arg EXTRAS=
    prune_replaced
}

pause_image() {  # BINARY IMAGE: the sandbox image, one static binary FROM scratch
    local binary="$1" image="$2" ctr
    bah inspect --type image "$image" >/dev/null 2>&1 && return 0
    ctr="$(bah from --quiet scratch)"
    bah copy --quiet "$ctr" "$binary" /pause >/dev/null
    bah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
    bah commit --quiet --rm "$ctr" "$image" >/dev/null
}

archive() {  # DIR [PAUSE_BINARY PAUSE_IMAGE]: one docker-archive per image, reused while unchanged
    local dir="$1" image id file images=("$OPERATOR_IMAGE" "$RUNTIME_IMAGE")
    build
    if [[ -n "${2:-}" ]]; then
        pause_image "$2" "$3"
        images+=("$3")
    fi
    mkdir -p "$dir"
    for image in "${images[@]}"; do
        id="$(bah inspect --type image --format '{{.FromImageID}}' "$image")"
        file="$dir/$(tr '/:' '__' <<<"$image")-${id:0:12}.tar"
        if [[ ! -s "$file" ]]; then
            rm -f "$dir/$(tr '/:' '__' <<<"$image")"-*.tar
            bah push --quiet "$image" "docker-archive:$file.tmp:$image" >/dev/null
            mv "$file.tmp" "$file"
        fi
        echo "$file"
    done
}

case "${1:-}" in
build) build ;;
archive) [[ -n "${2:-}" ]] || { echo "usage: $0 archive DIR [PAUSE_BINARY PAUSE_IMAGE]" >&2; exit 2; }
    archive "$2" "${3:-}" "${4:-}" ;;
names) echo "$OPERATOR_IMAGE"; echo "$RUNTIME_IMAGE" ;;
*) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
