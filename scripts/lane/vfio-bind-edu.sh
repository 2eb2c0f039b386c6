#!/usr/bin/env bash
# Inside an L1 started with `run-in-l1.sh --vfio`: binds QEMU's edu device (1234:11e8) to vfio-pci
# and prints its sysfs path, then its group's device node, one per line:
#   /sys/bus/pci/devices/0000:00:04.0
#   /dev/vfio/3
# Fails (with the reason) when there is no edu device, no IOMMU group, or no /dev/vfio node.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../lib.sh
. "$(dirname "$0")/../lib.sh"

dev=
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat "$d/vendor")" = 0x1234 ] && [ "$(cat "$d/device")" = 0x11e8 ]; then dev=$d; break; fi
done
[ -n "$dev" ] || die "no edu device (1234:11e8) on L1's PCI bus: was L1 started with --vfio?"
[ -e "$dev/iommu_group" ] || die "$dev has no IOMMU group (is intel_iommu=on in effect? dmesg: $(dmesg | grep -i -m3 -e DMAR -e iommu | tr '\n' ' '))"
group=$(basename "$(readlink "$dev/iommu_group")")

modprobe vfio-pci || die "modprobe vfio-pci"
if [ -e "$dev/driver" ] && [ "$(basename "$(readlink "$dev/driver")")" != vfio-pci ]; then
  echo "$(basename "$dev")" > "$dev/driver/unbind"
fi
echo vfio-pci > "$dev/driver_override"
if [ ! -e "$dev/driver" ]; then
  echo "$(basename "$dev")" > /sys/bus/pci/drivers_probe
fi
[ "$(basename "$(readlink "$dev/driver")")" = vfio-pci ] || die "$dev did not bind to vfio-pci"
for _ in 1 2 3 4 5 6 7 8 9 10; do [ -c "/dev/vfio/$group" ] && break; sleep 0.2; done
[ -c "/dev/vfio/$group" ] || die "no /dev/vfio/$group after binding $dev"
echo "$dev"
echo "/dev/vfio/$group"
