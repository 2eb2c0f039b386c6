#!/usr/bin/env bash
# `make bench`: target/release/microvm-bench on this host (the boot benchmark against QEMU, then
# pods of the backend check-host picks against runc: their lifecycle and memory, their network
# through the pod IP, and BENCH_DENSITY (10) idle pods at once), and, where this host's KVM cannot
# boot our guest, the pod, network and density parts once more inside the nested lane's L1
# (docs/nested-lane.md), where the embedded VMM runs our guest on QEMU's emulated SVM, against
# runc pods in the same L1.
# `make bench-density` (BENCH_DENSITY_MAX=N, default 500; not in CI): the density part's long
# run only, on this host and in the lane: microvm pods until N run or memory is nearly used
# (docs/benchmarks.md). The lane's L1 gets MICROVM_LANE_MEMORY_MIB (8192 by default).
# Exits non-zero if a part failed: a comparison that cannot run is a failure, not "n/a". A
# failure on this host does not skip the lane (each prints what it could measure).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release
kernel=${MICROVM_KERNEL:-$PWD/build/vmlinux}
failed=()

lane_parts=pods,net,density
if [ -n "${BENCH_DENSITY_MAX:-}" ]; then
  export BENCH_ONLY=density
  lane_parts=density
fi

echo "== benchmark on this host"
"$bin/microvm-bench" || failed+=("this host (exit $?)")

set +e
"$bin/microvm" check-host --kernel "$kernel" >/dev/null
check=$?
set -e
case $check in
  0) echo "== the embedded VMM ran on this host's KVM above: no nested lane needed" ;;
  2)
    if [ "${MICROVM_LANE:-on}" = off ]; then
      echo "== MICROVM_LANE=off: no embedded-VMM pod lines (this host's KVM cannot boot our guest)"
    else
      echo "== pod, network and density benchmark ($lane_parts) on the embedded VMM, inside the nested lane (L1 under QEMU/TCG)"
      # Transfers of 8 MiB there (32 on the host): runc's pods move about 20 MiB/s in L1, ours
      # are emulated twice; this keeps the lane's network part well within its timeout.
      BENCH_ONLY=$lane_parts BENCH_HYPERVISOR=kvm BENCH_NET_MIB="${BENCH_NET_MIB:-8}" \
        scripts/lane/run-in-l1.sh --timeout "${MICROVM_LANE_TIMEOUT:-3600}" -- "$bin/microvm-bench" \
        || failed+=("the nested lane (exit $?)")
    fi
    ;;
  *) echo "bench: check-host failed (exit $check)" >&2; exit 1 ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${failed[@]}")
  echo "bench: FAILED: ${msg%; }" >&2
  exit 1
fi
