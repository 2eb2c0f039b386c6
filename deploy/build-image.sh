#!/usr/bin/env bash
# Builds the microvm-deploy image from this checkout: `make build kernel initrd` first.
#   deploy/build-image.sh [tag]     (default microvm-deploy:latest; push it where your nodes pull)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tag=${1:-microvm-deploy:latest}
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/bin"
vhost=$("$repo/scripts/install-vhost-device-vsock.sh")
cp "$repo/target/release/containerd-shim-microvm-v1" "$repo/target/release/microvm" "$ctx/bin/"
cp "$vhost" "$ctx/bin/vhost-device-vsock"
cp -L "$repo/build/vmlinux" "$repo/build/initrd.cpio" "$ctx/bin/"
cp "$repo/deploy/Dockerfile" "$repo/deploy/node-install.sh" "$ctx/"
docker build -t "$tag" "$ctx"
