#!/usr/bin/env bash
# Installs a cargo subcommand the project's checks need (cargo-fuzz for `make fuzz` and
# scripts/fuzz-smoke.sh, cargo-deny for scripts/cargo-deny.sh) from crates.io into a cache outside
# the repository, keyed by a hash of its inputs: the crate, its version, the toolchain that builds
# it and this script. A new toolchain or version installs anew; the same inputs reuse the cache.
# Usage: scripts/install-cargo-tool.sh CRATE VERSION
# Prints the directory holding the tool's binary as its last line.
set -euo pipefail

crate=${1:?usage: install-cargo-tool.sh CRATE VERSION}
version=${2:?usage: install-cargo-tool.sh CRATE VERSION}
CACHE="${MICROVM_CACHE:-/var/cache/microvm}"

command -v cargo >/dev/null || { echo "error: cargo not found (install a Rust toolchain)" >&2; exit 1; }
key=$({ echo "$crate $version"; rustc -vV; cat "$0"; } | sha256sum | cut -c1-16)
ROOT="$CACHE/$crate-$version-$key"
BIN="$ROOT/bin/$crate"

if [[ -x "$BIN" ]]; then
    echo "$crate $version already installed in $ROOT" >&2
    echo "$ROOT/bin"
    exit 0
fi

# Built outside any workspace target dir so it does not disturb the project's build; --locked
# takes the crate's published Cargo.lock, what its authors tested. Installed into a temporary
# root first and moved into place whole, so an interrupted build leaves no half cache entry.
mkdir -p "$CACHE"
BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/$crate-build.XXXXXX")"
STAGE="$(mktemp -d "$CACHE/.$crate-$version.XXXXXX")"
trap 'rm -rf "$BUILD_DIR" "$STAGE"' EXIT
echo "installing $crate $version into $ROOT (compiles for a few minutes)" >&2
CARGO_TARGET_DIR="$BUILD_DIR" cargo install --locked --version "=$version" --root "$STAGE" "$crate" >&2
test -x "$STAGE/bin/$crate" || { echo "error: cargo install did not produce $crate" >&2; exit 1; }
rm -rf "$ROOT"
mv "$STAGE" "$ROOT"
echo "$ROOT/bin"
