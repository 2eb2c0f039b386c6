#!/usr/bin/env bash
# Builds the nested lane's L1 image (docs/nested-lane.md) and prints its directory on stdout:
#   <dir>/vmlinuz           Debian's own kernel (linux-image-amd64 of the system's suite)
#   <dir>/initrd.cpio.gz    busybox-static as /init (scripts/lane/l1-init) + the modules it needs
#                           to mount the host's root over 9p
#   <dir>/modules/<ver>/    the kernel's whole module tree (depmod'ed), bind-mounted inside L1 at
#                           /lib/modules/<ver> so that modprobe works there (kvm_amd, overlay, ...)
# All from Debian packages: the kernel .deb is fetched with `apt-get download` and unpacked with
# `dpkg -x`, never installed. Cached outside the repo in $MICROVM_CACHE/l1-<hash>, the hash over
# this script, l1-init and the kernel package's name and version; a second run prints the cached
# directory at once. Progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=SCRIPTDIR/../lib.sh
. "$here/../lib.sh"

# qemu-system-x86 runs L1; busybox-static is its init; kmod resolves module dependencies here and
# loads modules inside L1 (from the host's root, which L1 runs on); cpio and gzip pack the initrd.
ensure_packages qemu-system-x86 busybox-static kmod cpio gzip

# The kernel package linux-image-amd64 points at now (e.g. linux-image-6.1.0-56-amd64).
kernel_pkg() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}
pkg=$(kernel_pkg)
if [ -z "$pkg" ]; then
  apt-get update -qq >&2 || true
  pkg=$(kernel_pkg)
fi
[ -n "$pkg" ] || die "apt-cache cannot resolve linux-image-amd64 (no Debian package lists?)"
version=$(apt-cache policy "$pkg" | awk '/Candidate:/ { print $2; exit }')
[ -n "$version" ] && [ "$version" != "(none)" ] || die "no candidate version of $pkg"

hash=$( { cat "$here/build-l1.sh" "$here/l1-init"; echo "$pkg=$version"; } | cache_key)
out=$cache/l1-$hash
if [ -f "$out/ready" ]; then
  echo "$out"
  exit 0
fi

log "building the L1 image from $pkg $version into $out"
mkdir -p "$cache"
work=$(mktemp -d "$cache/.l1-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "$pkg=$version" >&2 2>/dev/null) || (cd "$work" && apt-get download "$pkg=$version" >&2)
deb=$(ls "$work"/*.deb)
dpkg -x "$deb" "$work/root"
kver=${pkg#linux-image-}
[ -f "$work/root/boot/vmlinuz-$kver" ] || die "$deb has no /boot/vmlinuz-$kver"
[ -d "$work/root/lib/modules/$kver" ] || die "$deb has no /lib/modules/$kver"
depmod -b "$work/root" "$kver"

# The initramfs: busybox, our init, and the modules (in load order) that mounting the host's root
# over virtio-9p needs. Everything else is loaded later with modprobe from the full tree.
initrd=$work/initrd
mkdir -p "$initrd"/{bin,dev,proc,sys,newroot,lower,upper,modules}
install -m 0755 /bin/busybox "$initrd/bin/busybox"
install -m 0755 "$here/l1-init" "$initrd/init"
: > "$initrd/modules/order"
for m in virtio_pci 9pnet_virtio 9p overlay; do
  modprobe -d "$work/root" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" { print $2 }'
done | awk '!seen[$0]++' | while read -r ko; do
  name=$(basename "$ko")
  cp "$ko" "$initrd/modules/$name"
  echo "$name" >> "$initrd/modules/order"
done
grep -q '^9p.ko$' "$initrd/modules/order" || die "9p.ko not found in $kver's modules"
(cd "$initrd" && find . | sort | cpio -o -H newc --quiet -R 0:0) | gzip -1 > "$work/initrd.cpio.gz"

mkdir -p "$out.tmp"
rm -rf "${out:?}.tmp"/*
mv "$work/root/boot/vmlinuz-$kver" "$out.tmp/vmlinuz"
mv "$work/initrd.cpio.gz" "$out.tmp/initrd.cpio.gz"
mkdir -p "$out.tmp/modules"
mv "$work/root/lib/modules/$kver" "$out.tmp/modules/$kver"
echo "$kver" > "$out.tmp/kernel-release"
echo "$pkg=$version" > "$out.tmp/package"
touch "$out.tmp/ready"
rm -rf "$out"
mv "$out.tmp" "$out"
# Images of older inputs go: each holds a whole kernel's modules.
for old in "$cache"/l1-*; do
  [ "$old" = "$out" ] || rm -rf "$old"
done
log "L1 image ready: $out"
echo "$out"
