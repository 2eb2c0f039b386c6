#!/usr/bin/env bash
# Installs vhost-device-vsock (the rust-vmm vhost-user vsock backend, which speaks the same
# hybrid-vsock Unix-socket protocol as our VMM) into a cache outside the repository, so the
# QEMU backend (shim/src/vm/qemu/) and its tests can use it. Idempotent: skips if present.
# Prints the binary path as its last line.
set -euo pipefail

VERSION="${VHOST_DEVICE_VSOCK_VERSION:-0.3.0}"
CACHE="${MICROVM_CACHE:-/var/cache/microvm}"
ROOT="$CACHE/vhost-device-vsock-$VERSION"
BIN="$ROOT/bin/vhost-device-vsock"

if [[ -x "$BIN" ]]; then
    echo "vhost-device-vsock $VERSION already installed" >&2
    echo "$BIN"
    exit 0
fi

command -v cargo >/dev/null || { echo "error: cargo not found (install a Rust toolchain)" >&2; exit 1; }

mkdir -p "$ROOT"
# Build outside any workspace target dir so it does not disturb the project build;
# --locked uses the crate's published Cargo.lock, which is what its authors tested.
BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/vhost-device-vsock-build.XXXXXX")"
trap 'rm -rf "$BUILD_DIR"' EXIT
echo "installing vhost-device-vsock $VERSION into $ROOT (compiles for a few minutes)" >&2
CARGO_TARGET_DIR="$BUILD_DIR" cargo install --locked --version "$VERSION" --root "$ROOT" vhost-device-vsock >&2
test -x "$BIN" || { echo "error: cargo install did not produce $BIN" >&2; exit 1; }
echo "$BIN"
