#!/usr/bin/env bash
# Installs the Rust virtiofsd (the virtio-fs daemon the QEMU backend, shim/src/vm/qemu/, runs for
# a pod's share) from crates.io into a cache outside the repository. Idempotent: skips if present.
# Prints the binary path as its last line. Its build links libseccomp and libcap-ng
# (libseccomp-dev, libcap-ng-dev: scripts/install-deps.sh); a cold build takes about 2 minutes
# on two cores.
#
# The folder is named by the version only (not by the toolchain), because the shim finds the
# binary there by default (`vm::qemu::default_virtiofsd_binary`).
set -euo pipefail

VERSION="${VIRTIOFSD_VERSION:-1.14.0}"
CACHE="${MICROVM_CACHE:-/var/cache/microvm}"
ROOT="$CACHE/virtiofsd-$VERSION"
BIN="$ROOT/bin/virtiofsd"

if [[ -x "$BIN" ]]; then
    echo "virtiofsd $VERSION already installed" >&2
    echo "$BIN"
    exit 0
fi

command -v cargo >/dev/null || { echo "error: cargo not found (install a Rust toolchain)" >&2; exit 1; }

# Built outside any workspace target dir so it does not disturb the project build; --locked
# takes the crate's published Cargo.lock, what its authors tested. Installed into a temporary
# root first and moved into place whole, so an interrupted build leaves no half cache entry.
mkdir -p "$CACHE"
BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/virtiofsd-build.XXXXXX")"
STAGE="$(mktemp -d "$CACHE/.virtiofsd-$VERSION.XXXXXX")"
chmod 755 "$STAGE"
trap 'rm -rf "$BUILD_DIR" "$STAGE"' EXIT
echo "installing virtiofsd $VERSION into $ROOT (compiles for a few minutes)" >&2
CARGO_TARGET_DIR="$BUILD_DIR" cargo install --locked --version "=$VERSION" --root "$STAGE" virtiofsd >&2
test -x "$STAGE/bin/virtiofsd" || { echo "error: cargo install did not produce virtiofsd" >&2; exit 1; }
rm -rf "$ROOT"
mv "$STAGE" "$ROOT"
echo "$BIN"
