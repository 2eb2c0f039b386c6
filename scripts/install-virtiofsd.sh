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
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"

version="${VIRTIOFSD_VERSION:-1.14.0}"
root="$cache/virtiofsd-$version"
install_crate virtiofsd "$version" "$root" true
echo "$root/bin/virtiofsd"
