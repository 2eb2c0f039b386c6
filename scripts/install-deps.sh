#!/usr/bin/env bash
# Installs what building and testing microvm needs on a Debian 12 machine, and nothing twice:
# Debian packages (only the missing ones; `apt-get update` only when something is missing),
# then vhost-device-vsock and virtiofsd (for the QEMU backend) into the cache outside the repo.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

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

missing=()
for p in "${packages[@]}"; do
  # dpkg-query prints "install ok installed" for an installed package.
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: need root to install Debian packages: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "install-deps: cargo not found; install a Rust toolchain (rustup) first" >&2
  exit 1
fi

# The two cargo builds run side by side (about 2 minutes each on two busy cores when cold; together
# about as long as one after the other there, shorter on wider machines); each skips at once when
# its binary is in the cache.
"$here/install-vhost-device-vsock.sh" >/dev/null &
vsock=$!
"$here/install-virtiofsd.sh" >/dev/null &
virtiofsd=$!
failed=0
wait "$vsock" || { echo "install-deps: installing vhost-device-vsock failed" >&2; failed=1; }
wait "$virtiofsd" || { echo "install-deps: installing virtiofsd failed" >&2; failed=1; }
[ "$failed" -eq 0 ] || exit 1
echo "install-deps: ok" >&2
