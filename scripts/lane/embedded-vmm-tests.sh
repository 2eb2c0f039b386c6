#!/usr/bin/env bash
# The tests of Linux guests on the embedded VMM, as scripts/run-tests.sh runs them: directly on a
# host whose KVM boots our guest, or inside the nested lane's L1 (scripts/lane/run-in-l1.sh) where
# it does not. Arguments: the test executables (built beforehand with `cargo test --no-run`, see
# run-tests.sh), by their cargo target name first: `kvm_linux_guest=<exe> cri_microvm=<exe> ...`;
# `name=<exe>@<dir>` runs a pod suite against the containerd in <dir> (MICROVM_TEST_CONTAINERD_BIN,
# e.g. the 1.7 or 2.1 that scripts/install-containerd.sh unpacked) instead of the system's.
# Every test binary runs even when one before it failed; the exit status is non-zero if any did.
# The `test result:` lines are what run-tests.sh counts.
set -uo pipefail
cd "$(dirname "$0")/../.."

microvm=${MICROVM_BIN_DIR:?MICROVM_BIN_DIR must name the folder of the built binaries}/microvm
kernel=${MICROVM_KERNEL:?MICROVM_KERNEL must name the guest kernel}

echo "== check-host$([ -n "${MICROVM_IN_LANE:-}" ] && echo " (inside the nested lane's L1)")"
if ! "$microvm" check-host --kernel "$kernel"; then
  echo "embedded-vmm-tests: check-host says the embedded VMM cannot boot our guest here" >&2
  exit 1
fi

# Runs a test binary bounded by `limit` seconds. At the limit it prints every process with what it
# waits on (a hang is diagnosed, not only timed out), then kills the binary: its unfinished tests
# then count as failed in run-tests.sh.
run_bounded() {
  local limit=$1; shift
  "$@" &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ $waited -ge "$limit" ]; then
      echo "embedded-vmm-tests: $1 still runs after ${limit} s: processes and what they wait on:" >&2
      ps -eo pid,ppid,stat,wchan:32,etime,args --forest >&2
      kill -KILL "$pid"
      wait "$pid"
      return 124
    fi
    sleep 1
    waited=$(( waited + 1 ))
  done
  wait "$pid"
}

failed=0
for arg in "$@"; do
  name=${arg%%=*}
  exe=${arg#*=}
  containerd=()
  case "$exe" in
    *@*) containerd=(MICROVM_TEST_CONTAINERD_BIN="${exe#*@}"); exe=${exe%%@*} ;;
  esac
  # Bounds: well above what each binary takes in the lane on a loaded host (10-30 s, 4-12 min,
  # 2.5-7 min), so that a hang costs minutes of CI, not its whole budget. (A frozen L1 is ended
  # sooner by run-in-l1.sh's freeze watch.)
  case "$name" in
    # #[ignore]d where make test cannot run them; here it can.
    kvm_linux_guest) limit=420; args=(--include-ignored --test-threads=1 --color=never); env=() ;;
    # VFIO passthrough of QEMU's edu device (an L1 started with run-in-l1.sh --vfio): bound to
    # vfio-pci here; if that fails the test runs without the device and fails saying so.
    kvm_vfio_passthrough)
      limit=180; args=(--include-ignored --test-threads=1 --color=never); env=()
      if bound=$(scripts/lane/vfio-bind-edu.sh); then
        env=(MICROVM_TEST_VFIO_DEVICE="$(echo "$bound" | sed -n 1p)" MICROVM_TEST_VFIO_ID=1234:11e8)
        echo "embedded-vmm-tests: edu bound to vfio-pci: $(echo "$bound" | tr '\n' ' ')"
      fi
      ;;
    # The pod suites, on the embedded VMM instead of QEMU.
    # Its hot-plug test is #[ignore]d where the QEMU backend runs it (no hot-plug there).
    # Its VFIO test wants edu bound to vfio-pci, as kvm_vfio_passthrough does.
    cri_microvm_devices)
      limit=600; args=(--include-ignored --test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm)
      # Without one (a host of its own, not the lane) that test does not run: run-tests.sh counts
      # it skipped there; in the lane a missing report counts as failed.
      if bound=$(scripts/lane/vfio-bind-edu.sh 2>/dev/null); then
        env+=(MICROVM_TEST_VFIO_DEVICE="$(echo "$bound" | sed -n 1p)" MICROVM_TEST_VFIO_ID=1234:11e8)
      else
        echo "embedded-vmm-tests: no device bound to vfio-pci: cri_microvm_devices' VFIO test does not run"
        args+=(--skip a_vfio_device_the_pod_holds_is_cold_plugged_and_seen_in_the_container)
      fi
      ;;
    # Page sharing runs on the embedded VMM only: #[ignore]d where the pod suites run on QEMU.
    cri_microvm_page_sharing) limit=600; args=(--include-ignored --test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm) ;;
    cri_microvm|cri_microvm_net) limit=900; args=(--test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm) ;;
    *) limit=600; args=(--test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm) ;;
  esac
  env+=("${containerd[@]}")
  echo "== $name on the embedded vmm${containerd[*]:+ (${containerd[*]})}"
  run_bounded "$limit" env "${env[@]}" "$exe" "${args[@]}"
  status=$?
  if [ $status -eq 124 ]; then
    # A rare hang of the embedded VMM path is known and not yet understood (docs/nested-lane.md):
    # the dump above says where it waited. The binary runs once more, said loudly here; only the
    # second run's results count, and a second hang fails its tests.
    echo "RETRY: $name hung (bound of ${limit} s, process dump above); running it once more"
    run_bounded "$limit" env "${env[@]}" "$exe" "${args[@]}"
    status=$?
  fi
  [ $status -eq 0 ] || failed=1
done
exit $failed
