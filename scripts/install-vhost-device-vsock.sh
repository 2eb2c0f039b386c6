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
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"

version="${VHOST_DEVICE_VSOCK_VERSION:-0.3.0}"
# "-static": a cache of the older dynamic build is never taken for this one.
root="$cache/vhost-device-vsock-$version-static"

is_static() {
    # `file` says "static-pie linked"; readelf has no INTERP program header for it.
    file -L "$1" | grep -q 'static-pie linked' && ! readelf -lW "$1" | grep -q INTERP
}

uses_nss() {
    local syms
    syms=$(nm "$1") || return 0
    grep -qE ' [TtWw] (__nss_[a-z_]*(module|database|lookup)[a-z_0-9]*|getaddrinfo|getpwuid_r|getpwnam_r|getgrgid_r|getgrnam_r|getgrouplist|gethostbyname[a-z_0-9]*|getservbyname_r)$' <<<"$syms"
}

# The check install_crate runs on a cached binary (quietly) and on the one it built.
static_without_nss() {
    if ! is_static "$1"; then
        file -L "$1" >&2
        log "$1 is not a static PIE"
        return 1
    fi
    if uses_nss "$1"; then
        log "$1 links glibc's NSS (getpwuid_r, getaddrinfo, ...), which its root cannot serve"
        return 1
    fi
}

command -v file >/dev/null || die "file not found (apt-get install file)"
command -v nm >/dev/null || die "nm not found (apt-get install binutils)"

RUSTFLAGS="-C target-feature=+crt-static" \
    install_crate vhost-device-vsock "$version" "$root" static_without_nss --target x86_64-unknown-linux-gnu
echo "$root/bin/vhost-device-vsock"
