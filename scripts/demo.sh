#!/usr/bin/env bash
# `make demo`: boot our guest kernel with our agent as PID 1 and print the agent's report.
# With the embedded VMM where this host's KVM can boot a Linux guest; otherwise under QEMU's
# software emulation (TCG), saying why (check-host's verdict), and then shows the embedded VMM
# running our vsock-echo test guest on /dev/kvm all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/microvm
kernel=${MICROVM_KERNEL:-$PWD/build/vmlinux}
initrd=${MICROVM_INITRD:-$PWD/build/initrd.cpio}

echo "== microvm check-host"
set +e
$bin check-host --kernel "$kernel"
status=$?
set -e
case $status in
  0) backend=kvm; echo "== booting with the embedded VMM on /dev/kvm" ;;
  2) backend=qemu; echo "== booting under QEMU/TCG: the embedded VMM cannot boot a Linux guest on this host (verdict above)" ;;
  *) echo "check-host failed" >&2; exit 1 ;;
esac
if [ "$backend" = qemu ]; then
  echo "== meanwhile our embedded VMM on this host's /dev/kvm, with our vsock-echo test guest"
  $bin run-test-guest vsock-echo --vcpus 2
fi
for vcpus in 1 2; do
  echo "== microvm boot --backend $backend --vcpus $vcpus --memory-mib 256 --check"
  $bin boot --backend "$backend" --kernel "$kernel" --initrd "$initrd" --vcpus "$vcpus" --memory-mib 256 --check
done
