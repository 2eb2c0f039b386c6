#!/usr/bin/env bash
# Builds the microvm-deploy image from this checkout: `make build kernel initrd` first.
#   deploy/build-image.sh [tag]            (default microvm-deploy:latest; push it where your nodes pull)
#   deploy/build-image.sh --context DIR    only stage the image's build context in DIR (what the
#                                          image holds under /opt/microvm-deploy: bin/ and the
#                                          script); tests/tests/deploy_node_install_root.rs runs it
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

stage() {
  local ctx=$1
  mkdir -p "$ctx/bin"
  vhost=$("$repo/scripts/install-vhost-device-vsock.sh")
  virtiofsd=$("$repo/scripts/install-virtiofsd.sh")
  bin=${MICROVM_BIN_DIR:-$repo/target/release}
  cp "$bin/containerd-shim-microvm-v1" "$bin/microvm" "$ctx/bin/"
  cp "$vhost" "$ctx/bin/vhost-device-vsock"
  cp "$virtiofsd" "$ctx/bin/virtiofsd"
  cp -L "$repo/build/vmlinux" "$repo/build/initrd.cpio" "$ctx/bin/"
  cp "$repo/deploy/Dockerfile" "$repo/deploy/node-install.sh" "$ctx/"
}

if [ "${1:-}" = "--context" ]; then
  [ -n "${2:-}" ] || { echo "usage: $0 --context DIR" >&2; exit 2; }
  stage "$2"
  exit 0
fi

tag=${1:-microvm-deploy:latest}
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
stage "$ctx"
docker build -t "$tag" "$ctx"
