#!/usr/bin/env bash
# Installs vhost-device-vsock (the rust-vmm vhost-user vsock backend, which speaks the same
# hybrid-vsock Unix-socket protocol as our VMM) into a cache outside the repository, so the
# QEMU backend (shim/src/vm/qemu/) and its tests can use it. Idempotent: skips if present.
# Prints the binary path as its last line.
#
# It is built as a static PIE: the shim runs it with the pod's vsock folder as its root, which
# holds nothing but its sockets, so it can have no dynamic loader or shared library to load
# (docs/qemu-backend.md). The explicit --target keeps +crt-static off the build scripts and
# proc macros, which are built for the host and loaded by the compiler.
#
# NSS: a static glibc program that calls getpwuid_r, getaddrinfo & co. loads NSS modules at run
# time, which its root could not give it. Rust's std refers to both (home_dir, lookup_host), so
# the system linker warns of them; vhost-device-vsock never calls them and the default linker
# (rust-lld, which does not print glibc's link warnings) drops that dead code. The check is on
# the binary itself: none of glibc's NSS machinery (its module loader, its database lookup) nor
# the functions that use it may be linked in.
set -euo pipefail

VERSION="${VHOST_DEVICE_VSOCK_VERSION:-0.3.0}"
CACHE="${MICROVM_CACHE:-/var/cache/microvm}"
TARGET=x86_64-unknown-linux-gnu
# "-static": a cache of the older dynamic build is never taken for this one.
ROOT="$CACHE/vhost-device-vsock-$VERSION-static"
BIN="$ROOT/bin/vhost-device-vsock"

is_static() {
    # `file` says "static-pie linked"; readelf has no INTERP program header for it.
    file -L "$1" | grep -q 'static-pie linked' && ! readelf -lW "$1" | grep -q INTERP
}

uses_nss() {
    local syms
    syms=$(nm "$1") || return 0
    grep -qE ' [TtWw] (__nss_[a-z_]*(module|database|lookup)[a-z_0-9]*|getaddrinfo|getpwuid_r|getpwnam_r|getgrgid_r|getgrnam_r|getgrouplist|gethostbyname[a-z_0-9]*|getservbyname_r)$' <<<"$syms"
}

if [[ -x "$BIN" ]] && is_static "$BIN" && ! uses_nss "$BIN"; then
    echo "vhost-device-vsock $VERSION (static) already installed" >&2
    echo "$BIN"
    exit 0
fi

command -v cargo >/dev/null || { echo "error: cargo not found (install a Rust toolchain)" >&2; exit 1; }
command -v file >/dev/null || { echo "error: file not found (apt-get install file)" >&2; exit 1; }
command -v nm >/dev/null || { echo "error: nm not found (apt-get install binutils)" >&2; exit 1; }

mkdir -p "$ROOT"
# Build outside any workspace target dir so it does not disturb the project build;
# --locked uses the crate's published Cargo.lock, which is what its authors tested.
BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/vhost-device-vsock-build.XXXXXX")"
trap 'rm -rf "$BUILD_DIR"' EXIT
echo "installing vhost-device-vsock $VERSION (static PIE) into $ROOT (compiles for a few minutes)" >&2
if ! RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$BUILD_DIR/target" \
    cargo install --locked --version "$VERSION" --root "$ROOT" --target "$TARGET" \
    vhost-device-vsock >&2; then
    echo "error: cargo install of vhost-device-vsock $VERSION failed" >&2
    exit 1
fi
test -x "$BIN" || { echo "error: cargo install did not produce $BIN" >&2; exit 1; }
if ! is_static "$BIN"; then
    file -L "$BIN" >&2
    rm -f "$BIN"
    echo "error: $BIN is not a static PIE" >&2
    exit 1
fi
if uses_nss "$BIN"; then
    rm -f "$BIN"
    echo "error: $BIN links glibc's NSS (getpwuid_r, getaddrinfo, ...), which its root cannot serve" >&2
    exit 1
fi
echo "$BIN"
