#!/usr/bin/env bash
# Builds the statically linked guest agent and packs it as /init into an uncompressed newc cpio
# initramfs at build/initrd.cpio (repo-relative), with the empty mount points the agent needs and
# the /dev/console and /dev/null nodes (so: run as root).
# Reproducible: fixed mtimes (epoch 0), owner 0:0, sorted entries, renumbered inodes.
# Prints the initrd's path. Honours CARGO_TARGET_DIR.
#
# --hostile-test-hooks builds the agent with its HOSTILE TEST HOOKS (guest-agent/src/hostile.rs:
# an agent that attacks the host, for tests/tests/cri_microvm_hostile_agent.rs) and writes
# build/initrd-hostile.cpio instead. The product initrd never holds them: without the option the
# agent is built without the feature (the two builds share the target folder and so the
# dependencies, built once; cargo relinks the agent whenever the feature changes), and an agent
# binary that holds the hooks' marker is refused.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
triple=x86_64-unknown-linux-gnu
target_dir=${CARGO_TARGET_DIR:-$repo/target}
out_dir=$repo/build
out=$out_dir/initrd.cpio
features=()
hostile=0
case ${1:-} in
  --hostile-test-hooks)
    hostile=1
    features=(--features hostile-test-hooks)
    out=$out_dir/initrd-hostile.cpio ;;
  '') ;;
  *) echo "usage: $0 [--hostile-test-hooks]" >&2; exit 2 ;;
esac
# What only a hostile agent's binary holds (guest-agent/src/main.rs logs it at start).
marker='HOSTILE TEST HOOKS'

# --target keeps build scripts dynamic while the agent itself is linked statically (glibc);
# libseccomp (the containers' seccomp filters; Debian's libseccomp-dev) and libbpf's libelf and
# zlib (the containers' device cgroup; libelf-dev, zlib1g-dev) are linked statically.
(cd "$repo" && RUSTFLAGS='-C target-feature=+crt-static -C strip=symbols' \
  LIBSECCOMP_LINK_TYPE=static LIBSECCOMP_LIB_PATH=${LIBSECCOMP_LIB_PATH:-/usr/lib/x86_64-linux-gnu} \
  CARGO_TARGET_DIR=$target_dir \
  cargo build --profile agent --locked -p guest-agent --target "$triple" "${features[@]}" >&2)
agent=$target_dir/$triple/agent/microvm-agent
[[ -x $agent ]] || { echo "build-initrd: no agent binary at $agent" >&2; exit 1; }
if grep -qaF "$marker" "$agent"; then
  if [[ $hostile == 0 ]]; then
    echo "build-initrd: $agent holds the hostile test hooks: refusing to pack it as the product initrd" >&2
    exit 1
  fi
elif [[ $hostile == 1 ]]; then
  echo "build-initrd: $agent lacks the hostile test hooks it was built with" >&2
  exit 1
fi
if command -v readelf >/dev/null && readelf -l "$agent" | grep -q INTERP; then
  echo "build-initrd: $agent is dynamically linked" >&2
  exit 1
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -m 0755 "$stage"/{proc,sys,dev,run,etc}
mkdir -m 1777 "$stage"/tmp
# The kernel opens /dev/console of the initramfs as fds 0-2 of /init; without it /init starts with
# them closed, and Rust's runtime aborts when it cannot reopen them on /dev/null. Device nodes need
# root (CAP_MKNOD); devtmpfs later mounts over /dev.
if ! mknod -m 0600 "$stage"/dev/console c 5 1 || ! mknod -m 0666 "$stage"/dev/null c 1 3; then
  echo "build-initrd: creating /dev/console and /dev/null needs root" >&2
  exit 1
fi
install -m 0755 "$agent" "$stage"/init
find "$stage" -exec touch -h -d @0 {} +

mkdir -p "$out_dir"
(cd "$stage" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort |
  cpio --create --format=newc --owner=0:0 --reproducible --quiet) >"$out.tmp"
mv "$out.tmp" "$out"
echo "$out"
