#!/usr/bin/env bash
# Stand-ins for the base images the Dockerfiles and docker-compose.yml name, made from Debian's
# packages with debootstrap, because no registry can be reached here:
#
#   localhost/python:3.11-slim-bookworm    for python:3.11-slim-bookworm (deploy/Dockerfile):
#                                          Debian's Python 3.11 at /usr/bin (the official image has
#                                          its own build at /usr/local/bin)
#   localhost/attnserve-ci/cuda-standin    for nvidia/cuda:*-cudnn-runtime-ubuntu24.04
#                                          (deploy/Dockerfile.cuda): a bare Debian with apt, no CUDA
#   localhost/attnserve-ci/nginx           for nginx:1.28-alpine: Debian sid's nginx (the first
#                                          Debian nginx with `server ... resolve`, >= 1.27.3) + wget
#
# Each image carries the hash of its recipe (label attnserve.ci.recipe); one whose recipe is
# unchanged is kept. The debootstrap tarballs are kept under $CACHE (keyed by the same hash), so a
# wiped podman storage imports again in seconds. The host's CA bundle and its local CAs are copied
# in: downloads here pass a TLS proxy whose CA is among them.
set -euo pipefail
CACHE=${ATTNSERVE_CI_CACHE:-/var/cache/attnserve-ci}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA=/etc/ssl/certs/ca-certificates.crt
LOCAL_CAS=/usr/local/share/ca-certificates  # kept by update-ca-certificates when a build installs ca-certificates
mkdir -p "$CACHE"

# remove_rootfs DIR: unmount what a failed or interrupted debootstrap left mounted in DIR (proc,
# sys), then delete it without crossing into another file system.
remove_rootfs() {
    local mount
    for mount in $(awk -v d="$1/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
        umount -l "$mount" || true
    done
    rm -rf --one-file-system "$1" "$1.log"
}

# make_base TAG SUITE PACKAGES [SETUP]: SETUP is a shell snippet run in the rootfs (chroot).
make_base() {
    local tag=$1 suite=$2 packages=$3 setup=${4:-}
    local recipe key
    recipe="v1|$suite|$packages|$setup|$(cat "$CA" "$LOCAL_CAS"/*.crt 2>/dev/null | sha256sum | cut -c1-16)"
    key=$(printf '%s' "$recipe" | sha256sum | cut -c1-16)
    if [ "$(podman image inspect --format '{{index .Labels "attnserve.ci.recipe"}}' "$tag" 2>/dev/null)" = "$key" ]; then
        echo "base image $tag: cached (recipe $key)"
        return
    fi
    local tarball="$CACHE/rootfs-$key.tar"
    if [ ! -s "$tarball" ]; then
        local root
        root=$(mktemp -d "$CACHE/rootfs.XXXXXX") && chmod 755 "$root"  # the image's /
        echo "base image $tag: debootstrap $suite ($packages)"
        local start=$SECONDS
        debootstrap --variant=minbase ${packages:+--include="$packages"} "$suite" "$root" "$MIRROR" > "$root.log" 2>&1 \
            || { tail -20 "$root.log"; echo "debootstrap $suite failed"; remove_rootfs "$root"; exit 1; }
        mkdir -p "$root${CA%/*}" "$root$LOCAL_CAS" && cp "$CA" "$root$CA"
        cp "$LOCAL_CAS"/*.crt "$root$LOCAL_CAS"/ 2>/dev/null || true
        if [ -n "$setup" ]; then chroot "$root" /bin/sh -ec "$setup" > "$root.log" 2>&1 || { tail -20 "$root.log"; echo "$tag: set-up failed"; remove_rootfs "$root"; exit 1; }; fi
        rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
        tar --one-file-system -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        remove_rootfs "$root"
        echo "base image $tag: rootfs made in $((SECONDS - start)) s"
    fi
    touch "$tarball"  # in use: kept by the clean-up at the end
    podman import --change "LABEL attnserve.ci.recipe=$key" --change 'CMD ["/bin/bash"]' \
        "$tarball" "$tag" --quiet > /dev/null
    echo "base image $tag: imported (recipe $key)"
}

make_base localhost/python:3.11-slim-bookworm bookworm python3,python3-venv,python3-pip,python-is-python3 &
python_base=$!
make_base localhost/attnserve-ci/cuda-standin bookworm "" &
cuda_base=$!
# nginx from apt inside the chroot, with invoke-rc.d told not to start it on the host's network.
make_base localhost/attnserve-ci/nginx sid "" '
    printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get -o Acquire::Check-Valid-Until=false update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx wget
    rm /usr/sbin/policy-rc.d
    mkdir -p /var/cache/nginx
    nginx -v' &
nginx_base=$!
wait "$python_base"
wait "$cuda_base"
wait "$nginx_base"

# Tarballs of recipes not used for 30 days (a changed recipe leaves its old one behind).
find "$CACHE" -maxdepth 1 -name 'rootfs-*.tar' -mtime +30 -delete
