#!/usr/bin/env bash
# Installs what building and testing microvm needs on a Debian 12 machine, and nothing twice:
# Debian packages (only the missing ones: scripts/lib.sh's ensure_packages), then
# vhost-device-vsock and virtiofsd (for the QEMU backend) into the cache outside the repo.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
. "$here/lib.sh"

packages=(
  build-essential gcc make        # test guests, kernel
  flex bison bc libelf-dev libssl-dev dwarves cpio python3   # kernel build
  linux-source                    # the guest kernel's source (kernel-config/build.sh)
  qemu-system-x86                 # the QEMU backend and the benchmark's comparison VMM
  containerd runc containernetworking-plugins   # private containerd for the CRI tests (CNI in /usr/lib/cni)
  busybox-static                  # test images
  protobuf-compiler               # k8s-cri client code generation (tests)
  libseccomp-dev zlib1g-dev       # the guest agent's static link (seccomp; libbpf's libelf and zlib)
  libcap-ng-dev                   # virtiofsd's build (with libseccomp-dev)
  jq procps iproute2 util-linux   # scripts and leak checks
  kmod                            # the nested lane's L1 image (scripts/lane/build-l1.sh)
)

ensure_packages "${packages[@]}"

command -v cargo >/dev/null 2>&1 || die "cargo not found; install a Rust toolchain (rustup) first"

# The two cargo builds run side by side (about 2 minutes each on two busy cores when cold; together
# about as long as one after the other there, shorter on wider machines); each skips at once when
# its binary is in the cache.
"$here/install-vhost-device-vsock.sh" >/dev/null &
vsock=$!
"$here/install-virtiofsd.sh" >/dev/null &
virtiofsd=$!
failed=0
wait "$vsock" || { log "installing vhost-device-vsock failed"; failed=1; }
wait "$virtiofsd" || { log "installing virtiofsd failed"; failed=1; }
[ "$failed" -eq 0 ] || exit 1
log ok
