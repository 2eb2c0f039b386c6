#!/usr/bin/env bash
# The long soak (make soak; not in CI, whose `make test` runs the short one): the soak suite
# (tests/tests/cri_microvm_soak.rs) with MICROVM_SOAK_CONTAINER_CYCLES container cycles in one pod
# and MICROVM_SOAK_POD_CYCLES pod cycles (default 1000 and 300), on the QEMU backend on this host
# and on the embedded VMM (directly where this host's KVM boots our guest, else inside the nested
# lane's L1). Each run's samples go as CSV to MICROVM_SOAK_OUT (default build/soak), one file per
# part and backend; its summary lines and any bound it broke are printed (docs/benchmarks.md,
# "Soak"). Exit status: 0 when every run held its bounds.
set -uo pipefail
cd "$(dirname "$0")/.."
export MICROVM_SOAK_CONTAINER_CYCLES=${MICROVM_SOAK_CONTAINER_CYCLES:-1000}
export MICROVM_SOAK_POD_CYCLES=${MICROVM_SOAK_POD_CYCLES:-300}
export MICROVM_SOAK_OUT=${MICROVM_SOAK_OUT:-$PWD/build/soak}
export MICROVM_KERNEL=${MICROVM_KERNEL:-$PWD/build/vmlinux}
export MICROVM_INITRD=${MICROVM_INITRD:-$PWD/build/initrd.cpio}
export MICROVM_GUEST_DIR=${MICROVM_GUEST_DIR:-$PWD/build/guests}
mkdir -p "$MICROVM_SOAK_OUT"
failed=()

exe=$(cargo test --release --no-run --message-format=json --workspace --test cri_microvm_soak |
  jq -r 'select(.reason == "compiler-artifact" and .target.kind == ["test"] and .executable != null) | .executable')
[ -x "$exe" ] || { echo "soak: the soak suite did not build" >&2; exit 1; }
# The lane reads the binaries from a copy (nothing it runs may be rebuilt while it runs).
bin=$PWD/target/soak-bin
rm -rf "$bin" && mkdir -p "$bin" &&
  find target/release -maxdepth 1 -type f -perm -u+x -exec cp -p {} "$bin/" \; && cp -p "$exe" "$bin/"
export MICROVM_BIN_DIR=$bin
suite=$bin/$(basename "$exe")

echo "== soak on the QEMU backend, this host: $MICROVM_SOAK_CONTAINER_CYCLES container cycles, $MICROVM_SOAK_POD_CYCLES pod cycles"
MICROVM_TEST_HYPERVISOR=qemu "$suite" --test-threads=1 --nocapture || failed+=("QEMU backend")

set +e
"$bin/microvm" check-host --kernel "$MICROVM_KERNEL" >/dev/null
check=$?
set -e
case $check in
  0)
    echo "== soak on the embedded VMM, this host's KVM"
    MICROVM_TEST_HYPERVISOR=kvm "$suite" --test-threads=1 --nocapture || failed+=("embedded VMM")
    ;;
  2)
    echo "== soak on the embedded VMM, inside the nested lane (L1 under QEMU/TCG)"
    MICROVM_TEST_HYPERVISOR=kvm scripts/lane/run-in-l1.sh --timeout "${MICROVM_LANE_TIMEOUT:-43200}" -- \
      "$suite" --test-threads=1 --nocapture || failed+=("embedded VMM in the lane (exit $?)")
    ;;
  *) echo "soak: check-host failed (exit $check)" >&2; exit 1 ;;
esac
echo "== samples in $MICROVM_SOAK_OUT:" "$MICROVM_SOAK_OUT"/*.csv
if python3 -c 'import matplotlib' 2>/dev/null; then
  python3 scripts/soak-plot.py "$MICROVM_SOAK_OUT"/container-cycles-*.csv
else
  echo "== no matplotlib: for the curves, pip install matplotlib; scripts/soak-plot.py $MICROVM_SOAK_OUT/container-cycles-*.csv"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "soak: FAILED: ${failed[*]}" >&2
  exit 1
fi
