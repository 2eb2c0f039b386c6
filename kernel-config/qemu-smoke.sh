#!/usr/bin/env bash
# Boots the guest kernel under QEMU TCG (no KVM) with a throw-away busybox initramfs whose /init
# prints `uname -r`, nproc, MemTotal and the virtio devices it sees, then reboots (-no-reboot makes
# QEMU exit). Checks microvm (1 and 2 vCPUs, a virtio-mmio block device) and q35 (2 vCPUs).
#
#   kernel-config/qemu-smoke.sh [path/to/vmlinux]      # default: build/vmlinux
#
# Needs qemu-system-x86 and busybox-static. Exits non-zero on the first failed boot.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
kernel=${1:-$here/../build/vmlinux}
[ -f "$kernel" ] || { echo "qemu-smoke: no kernel at $kernel (run kernel-config/build.sh)" >&2; exit 1; }
command -v qemu-system-x86_64 >/dev/null || { echo "qemu-smoke: qemu-system-x86_64 missing" >&2; exit 1; }
[ -x /bin/busybox ] || { echo "qemu-smoke: /bin/busybox missing (busybox-static)" >&2; exit 1; }

work=$(mktemp -d /tmp/qemu-smoke.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/root/bin"
cp /bin/busybox "$work/root/bin/busybox"
cat >"$work/root/init" <<'EOF'
#!/bin/busybox sh
b=/bin/busybox
$b mkdir -p /proc /sys /dev
$b mount -t proc proc /proc
$b mount -t sysfs sysfs /sys
$b mount -t devtmpfs devtmpfs /dev
echo "SMOKE release=$($b uname -r) nproc=$($b nproc) $($b grep MemTotal /proc/meminfo | $b tr -s ' ') uptime=$($b cut -d' ' -f1 /proc/uptime)"
for d in /sys/bus/virtio/devices/*; do
  [ -e "$d/driver" ] && echo "SMOKE virtio device=$($b cat "$d/device") driver=$($b basename "$($b readlink "$d/driver")")"
done
echo "SMOKE done"
$b reboot -f
EOF
chmod +x "$work/root/init"
(cd "$work/root" && find . | cpio -o -H newc --quiet >"$work/initrd.cpio")
truncate -s 8M "$work/disk.img"

# microvm has no timer to calibrate the TSC against: pass the host's TSC rate (TCG's guest TSC
# runs at the host's rate) and the matching loops-per-jiffy (HZ=250).
khz=$(awk '/^cpu MHz/ { printf "%d", $4 * 1000; exit }' /proc/cpuinfo)
lpj=$((khz * 1000 / 250))
microvm_cmdline="console=ttyS0 tsc_early_khz=$khz lpj=$lpj reboot=t panic=-1"
q35_cmdline="console=ttyS0 reboot=k panic=-1"

fail=0
boot() { # name expected_nproc expected_virtio_driver qemu-args...
  local name=$1 nproc=$2 want_driver=$3; shift 3
  local start end out
  start=$(date +%s%N)
  out=$(timeout 120 qemu-system-x86_64 -nographic -no-reboot -m 256 -cpu max \
    -kernel "$kernel" -initrd "$work/initrd.cpio" "$@" 2>&1) || true
  end=$(date +%s%N)
  local line
  line=$(grep -a '^SMOKE release=' <<<"$out" | tr -d '\r' || true)
  if ! grep -qa '^SMOKE done' <<<"$out"; then
    echo "FAIL $name: init did not finish; last lines:"; tail -n 15 <<<"$out"; fail=1; return
  fi
  if ! grep -q "nproc=$nproc " <<<"$line"; then
    echo "FAIL $name: wanted nproc=$nproc: $line"; fail=1; return
  fi
  if [ -n "$want_driver" ] && ! grep -qa "SMOKE virtio .*driver=$want_driver" <<<"$out"; then
    echo "FAIL $name: no virtio device bound to $want_driver"; fail=1; return
  fi
  echo "ok   $name: ${line#SMOKE } (QEMU exited after $(( (end - start) / 1000000 )) ms)"
}

boot microvm-1cpu 1 "" -M microvm,acpi=off -smp 1 -append "$microvm_cmdline"
boot microvm-2cpu-blk 2 virtio_blk -M microvm,acpi=off -smp 2 \
  -drive id=d0,file="$work/disk.img",format=raw,if=none -device virtio-blk-device,drive=d0 \
  -append "$microvm_cmdline"
boot q35-2cpu 2 "" -M q35 -smp 2,sockets=2,cores=1,threads=1 -append "$q35_cmdline"
exit $fail
