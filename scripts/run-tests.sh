#!/usr/bin/env bash
# `make test`: lint, every unit and integration test (real /dev/kvm with our test guests, our
# Linux guest under QEMU/TCG), then the Linux-guest-under-our-VMM tests where this host can boot
# a Linux guest. Where it cannot, those are printed as skipped with check-host's reason: never
# counted as passed.
set -euo pipefail
cd "$(dirname "$0")/.."
export MICROVM_KERNEL=${MICROVM_KERNEL:-$PWD/build/vmlinux}
export MICROVM_INITRD=${MICROVM_INITRD:-$PWD/build/initrd.cpio}
export MICROVM_GUEST_DIR=${MICROVM_GUEST_DIR:-$PWD/build/guests}

echo "== lint"
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings

results=$(mktemp)
trap 'rm -f "$results"' EXIT

echo "== tests"
# Integration tests boot VMs; two at a time is what two cores carry without timeouts.
cargo test --release --workspace -- --test-threads=2 2>&1 | tee -a "$results"

echo "== linux guest under the embedded vmm"
set +e
verdict=$(target/release/microvm check-host --kernel "$MICROVM_KERNEL")
status=$?
set -e
echo "$verdict"
# The pod tests through containerd run once on the QEMU backend above; where this host can boot
# our guest they run again on the embedded VMM (MICROVM_TEST_HYPERVISOR=kvm), else they are
# counted skipped with the reason.
pod_tests=(cri_microvm cri_microvm_exec)
n_pod=0
for t in "${pod_tests[@]}"; do
  n_pod=$(( n_pod + $(grep -c '^#\[tokio::test' "tests/tests/$t.rs") ))
done
skipped_pod=0
if [ $status -eq 0 ]; then
  cargo test --release -p microvm-tests --test kvm_linux_guest -- --include-ignored --test-threads=1 2>&1 | tee -a "$results"
  ran_linux=$(grep -c '^#\[ignore' tests/tests/kvm_linux_guest.rs || true)
  echo "== pods through containerd on the embedded vmm"
  MICROVM_TEST_HYPERVISOR=kvm cargo test --release -p microvm-tests \
    $(printf -- '--test %s ' "${pod_tests[@]}") -- --test-threads=1 2>&1 | tee -a "$results"
elif [ $status -eq 2 ]; then
  reason=$(echo "$verdict" | sed -n 's/^verdict: //p')
  ran_linux=0
  n=$(grep -c '^#\[ignore' tests/tests/kvm_linux_guest.rs || true)
  echo "SKIPPED: $n linux-guest-under-kvm tests: $reason"
  skipped_pod=$n_pod
  echo "SKIPPED: $n_pod pod tests on the embedded vmm (${pod_tests[*]} with MICROVM_TEST_HYPERVISOR=kvm; they ran on QEMU above): $reason"
else
  echo "check-host failed (exit $status)" >&2
  exit 1
fi

echo "== leftovers"
left=$(pgrep -a -f 'qemu-system-x86_64|vhost-device-vsock|microvm-agent|containerd-shim|containerd --config /tmp/microvm-ctrd' || true)
if [ -n "$left" ]; then
  echo "processes left behind by the tests:" >&2
  echo "$left" >&2
  exit 1
fi
echo "no VM processes left behind"

# One closing line over every cargo test binary. Every ignored test counts as skipped, never as
# passed: the linux-guest-under-kvm ones where this host cannot boot them (when it can, they ran
# in their own run above and are counted there), and tests of work not finished yet (each says
# why in its #[ignore] reason, printed by cargo above). The embedded-VMM run of the pod tests
# counts as skipped where it could not run.
sum() { sed -n "s/^test result: .* \([0-9][0-9]*\) $1.*/\1/p" "$results" | paste -sd+ | bc; }
passed=$(sum passed)
failed=$(sum failed)
ignored=$(sum ignored)
skipped=$(( ${ignored:-0} - ran_linux + skipped_pod ))
echo "tests: ${passed:-0} passed, ${failed:-0} failed, ${skipped} skipped"
