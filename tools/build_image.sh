#!/usr/bin/env bash
# Builds the CPU image (Dockerfile, --target cpu) with no container registry and no Docker
# daemon: Debian's debootstrap makes a Debian 12 root file system from the Debian archive,
# buildah imports it under the names the Dockerfile's FROM lines use (debian:12.11 and
# debian:12.11-slim: the same release, today's point version of it), then builds the image
# and, with --check, runs the server in it and waits for `moeserve healthcheck` to pass.
#   tools/build_image.sh [--check] [--tag moeserve:cpu] [--work DIR]
# Needs root (or buildah's rootless setup), buildah and debootstrap (apt-get), network access
# to deb.debian.org, ~1.5 GB in DIR (default /var/tmp/moeserve-image) and several minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=moeserve:cpu
work=/var/tmp/moeserve-image
check=0
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=1 ;;
        --tag) tag=$2; shift ;;
        --work) work=$2; shift ;;
        *) echo "usage: tools/build_image.sh [--check] [--tag NAME] [--work DIR]" >&2; exit 2 ;;
    esac
    shift
done
for tool in buildah debootstrap; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "build_image: $tool is missing (apt-get install buildah debootstrap)" >&2
        exit 77
    fi
done
mkdir -p "$work"
# vfs storage and chroot isolation: work inside an unprivileged container too
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
B="buildah --root $work/storage --runroot $work/run --storage-driver vfs"

if ! $B inspect --type image docker.io/library/debian:12.11 >/dev/null 2>&1; then
    rootfs="$work/rootfs"
    if [ ! -x "$rootfs/usr/bin/apt-get" ]; then
        rm -rf "$rootfs"
        echo "build_image: debootstrap bookworm into $rootfs" >&2
        debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >&2
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    fi
    tar -C "$rootfs" -c . > "$work/rootfs.tar"
    ctr=$($B from scratch)
    $B add "$ctr" "$work/rootfs.tar" / >/dev/null
    $B config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$ctr"
    $B commit --rm "$ctr" docker.io/library/debian:12.11 >/dev/null
    $B tag docker.io/library/debian:12.11 docker.io/library/debian:12.11-slim
    rm -f "$work/rootfs.tar"
fi

echo "build_image: buildah build --target cpu -t $tag" >&2
$B build --pull=never --format docker --isolation chroot --network host --target cpu \
    --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    --build-arg CREATED="$(date -u +%FT%TZ)" -t "$tag" . >&2
$B inspect --type image --format '{{.Docker.Config.User}} {{.Docker.Config.Healthcheck.Test}}{{println}}' "$tag"

if [ "$check" = 1 ]; then
    port=${MOESERVE_IMAGE_PORT:-18765}
    ctr=$($B from "$tag")
    log="$work/serve.log"
    # the image's entrypoint and environment, on the host's network; --port moves it off 8000
    $B run --isolation chroot --network host --user 10001:10001 "$ctr" -- \
        /usr/local/bin/moeserve serve --port "$port" >"$log" 2>&1 &
    pid=$!
    ok=0
    for _ in $(seq 1 300); do
        if $B run --isolation chroot --network host --user 10001:10001 "$ctr" -- \
            /usr/local/bin/moeserve healthcheck --port "$port" 2>/dev/null; then
            ok=1
            break
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" || true
    $B rm "$ctr" >/dev/null
    cat "$log" >&2
    if [ "$ok" != 1 ]; then
        echo "build_image: the server in the image never became healthy" >&2
        exit 1
    fi
    echo "build_image: $tag serves and passes its HEALTHCHECK" >&2
fi
