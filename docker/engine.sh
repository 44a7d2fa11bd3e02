#!/usr/bin/env bash
# The Docker commands of the Makefile (docs/docker.md):
#   docker/engine.sh setup          podman and its tools from the distribution's packages (as root, Debian-like)
#   docker/engine.sh base           the local base image: Debian 12 made with mmdebstrap from Debian's packages
#   docker/engine.sh build          the image, on the registry's CUDA base or, where that cannot be pulled, the local base
#   docker/engine.sh run ARGS...    `lowmem-grpo ARGS...` in a container as the image's user, ./runs and the cache mounted
#   docker/engine.sh engine         which engine the others use
# Settings (environment): ENGINE (docker or podman; default: podman if installed, else a docker whose daemon
# answers), IMAGE (lowmem-grpo), DOCKER_BASE (registry, local, or auto: the registry's base when it can be pulled),
# DOCKER_CA (a CA bundle pip trusts during the build, passed as a build secret; default: $PIP_CERT when it names a
# file), DOCKER_CACHE (the host folder mounted as /cache), RUNS (the host folder mounted as /runs; ./runs), RUNS_MODE
# (its mount options, e.g. ro), DOCKER_NETWORK (none by default),
# DEBIAN_MIRROR (for the local base; default: mmdebstrap's), CONTAINERS_CONF (podman's settings; default
# docker/containers.conf, which this machine kind needs; set it empty for the system's own).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

IMAGE=${IMAGE:-lowmem-grpo}
LOCAL_BASE=localhost/lowmem-grpo-base:bookworm
REGISTRY_BASE=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
# The image's user: what the container runs as, and who must be able to write the mounted folders.
IMAGE_UID=1000
if [ -z "${CONTAINERS_CONF+set}" ]; then
    export CONTAINERS_CONF="$ROOT/docker/containers.conf"
elif [ -z "$CONTAINERS_CONF" ]; then
    unset CONTAINERS_CONF
fi

die() {  # a missing piece: what is missing, and the fix
    echo "error: $1" >&2
    [ -n "${2:-}" ] && echo "  fix: $2" >&2
    exit 2
}

engine() {
    if [ -n "${ENGINE:-}" ]; then
        command -v "$ENGINE" > /dev/null || die "ENGINE=$ENGINE is not installed" "install it, or leave ENGINE unset"
        echo "$ENGINE"
    elif command -v podman > /dev/null; then
        echo podman
    elif command -v docker > /dev/null && docker info > /dev/null 2>&1; then
        echo docker
    elif command -v docker > /dev/null; then
        die "docker is installed but its daemon does not answer (docker info fails), and podman is not installed" \
            "start the Docker daemon, or install podman: make docker-setup (as root, Debian-like)"
    else
        die "neither docker nor podman is installed" \
            "install Docker (docs.docker.com/engine/install), or podman: make docker-setup (as root, Debian-like)"
    fi
}

setup() {
    [ "$(id -u)" = 0 ] || die "make docker-setup installs packages: it must run as root" "run it as root (sudo)"
    command -v apt-get > /dev/null || die "make docker-setup needs apt-get (a Debian-like system)" \
        "install podman, buildah, runc and mmdebstrap with your distribution's tools"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman buildah runc mmdebstrap fuse-overlayfs uidmap slirp4netns > /dev/null
    podman --version
    podman info --format '{{.Host.OCIRuntime.Name}} runtime, {{.Store.GraphDriverName}} storage' \
        || die "podman is installed but does not start" "read the message above (docs/docker.md, Troubleshooting)"
}

have_image() {
    "$1" image inspect "$2" > /dev/null 2>&1
}

base() {
    local engine tar
    engine=$(engine)
    command -v mmdebstrap > /dev/null || die "the local base needs mmdebstrap" "make docker-setup, or apt-get install mmdebstrap"
    [ "$(id -u)" = 0 ] || die "mmdebstrap makes the local base as root here" "run it as root"
    tar=$(mktemp --suffix=.tar)
    # removed when base returns; the trap then removes itself (a RETURN trap stays set for later functions)
    trap 'rm -f "$tar"; trap - RETURN' RETURN
    echo "making $LOCAL_BASE: Debian 12 (bookworm, minbase) from Debian's packages"
    # shellcheck disable=SC2086  # DEBIAN_MIRROR is zero or more mirror arguments
    mmdebstrap --quiet --variant=minbase --include=ca-certificates \
        bookworm "$tar" ${DEBIAN_MIRROR:-}
    "$engine" import --change 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" > /dev/null
}

pick_base() {  # registry or local
    local engine=$1 wanted=${DOCKER_BASE:-auto}
    case "$wanted" in
        registry|local) echo "$wanted"; return ;;
        auto) ;;
        *) die "DOCKER_BASE=$wanted is not one of registry, local, auto" "leave it unset (auto)" ;;
    esac
    if have_image "$engine" "$REGISTRY_BASE" || "$engine" pull -q "$REGISTRY_BASE" > /dev/null 2>&1; then
        echo registry
    else
        echo "the registry's base $REGISTRY_BASE cannot be pulled: building on the local Debian 12 base" >&2
        echo local
    fi
}

build() {
    local engine route start ca args
    engine=$(engine)
    route=$(pick_base "$engine")
    args=(build -t "$IMAGE")
    [ "$engine" = podman ] && args+=(--format docker)  # the OCI format drops SHELL
    if [ "$route" = local ]; then
        have_image "$engine" "$LOCAL_BASE" || base
        args+=(--build-arg "BASE_IMAGE=$LOCAL_BASE" --build-arg PYTHON_FROM=system)
        [ "$engine" = podman ] && args+=(--pull=never)
    else
        args+=(--build-arg PYTHON_FROM=uv)
    fi
    ca=${DOCKER_CA:-${PIP_CERT:-}}
    if [ -n "$ca" ]; then
        [ -f "$ca" ] || die "DOCKER_CA=$ca is not a file" "name a CA bundle file, or leave DOCKER_CA and PIP_CERT unset"
        echo "pip in the build trusts $ca (build secret ca_bundle, not stored in the image)"
        args+=(--secret "id=ca_bundle,src=$ca")
    fi
    [ "$engine" = docker ] && export DOCKER_BUILDKIT=1  # build secrets and skipped stages
    echo "$engine ${args[*]} ."
    start=$(date +%s)
    "$engine" "${args[@]}" .
    echo "built $IMAGE with $engine on the $route base in $(( $(date +%s) - start )) s;" \
        "size $("$engine" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"
}

writable_by_image_user() {  # make a host folder the container's user can write, as a root caller
    mkdir -p "$1"
    if [ "$(id -u)" = 0 ] && [ "$(stat -c %u "$1")" != "$IMAGE_UID" ]; then
        chown "$IMAGE_UID:$IMAGE_UID" "$1"  # the folder itself only; root reads and writes what lands in it
    fi
}

run() {
    local engine runs cache user=()
    engine=$(engine)
    have_image "$engine" "$IMAGE" || build
    runs=$(realpath -m "${RUNS:-runs}")
    cache=$(realpath -m "${DOCKER_CACHE:-$HOME/.cache/lowmem-grpo-docker}")
    if [ "$engine" = podman ] && [ "$(id -u)" != 0 ]; then
        # rootless: the image's user is the caller on the host, so the run belongs to the caller
        user=(--userns "keep-id:uid=$IMAGE_UID,gid=$IMAGE_UID")
        mkdir -p "$runs" "$cache"
    elif [ "$(id -u)" = 0 ] || [ "$(id -u)" = "$IMAGE_UID" ]; then
        writable_by_image_user "$runs"
        writable_by_image_user "$cache"
    else
        # Docker has no per-container user mapping: run as the caller's ids (non-root), so the run is the caller's
        user=(--user "$(id -u):$(id -g)" -e HOME=/tmp)
        mkdir -p "$runs" "$cache"
    fi
    # No network: the CPU default's model ships in the image (DOCKER_NETWORK=host for hub models).
    exec "$engine" run --rm --network "${DOCKER_NETWORK:-none}" "${user[@]}" \
        -v "$runs:/runs${RUNS_MODE:+:$RUNS_MODE}" -v "$cache:/cache" "$IMAGE" "$@"
}

case "${1:-}" in
    setup) setup ;;
    base) base ;;
    build) build ;;
    engine) engine ;;
    run) shift; run "$@" ;;
    *) die "usage: docker/engine.sh setup|base|build|engine|run ARGS..." ;;
esac
