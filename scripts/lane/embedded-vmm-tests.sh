#!/usr/bin/env bash
# The tests of Linux guests on the embedded VMM, as scripts/run-tests.sh runs them: directly on a
# host whose KVM boots our guest, or inside the nested lane's L1 (scripts/lane/run-in-l1.sh) where
# it does not. Arguments: the test executables (built beforehand with `cargo test --no-run`, see
# run-tests.sh), by their cargo target name first: `kvm_linux_guest=<exe> cri_microvm=<exe> ...`;
# `name=<exe>@<dir>` runs a pod suite against the containerd in <dir> (MICROVM_TEST_CONTAINERD_BIN,
# e.g. the 1.7 or 2.1 that scripts/install-containerd.sh unpacked) instead of the system's.
# `--queue DIR` takes them from a queue instead, one after the other until it is empty: DIR/todo
# holds one file a binary (its argument as above), taken in the order of their names by moving it
# to DIR/taken (a rename: of two L1s reaching for the same file, one gets it;
# scripts/lane/run-lane.sh fills the queue and runs two L1s on it once the host has a core free).
# Every test binary runs even when one before it failed; the exit status is non-zero if any did.
# The `test result:` lines are what run-tests.sh counts. `--limit NAME` prints the bound (seconds)
# the binary NAME runs under, for scripts/lane/run-lane.sh's bound of its L1; `--expected NAME`
# what it takes in a CI lane (seconds), the order in which run-lane.sh queues them.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=SCRIPTDIR/../lib.sh
. scripts/lib.sh

# Each binary's bound: well above what it takes in the lane on a busy host (in make test the lane
# runs beside the host's own tests: kvm_linux_guest 1-4 min, cri_microvm 4-15 min,
# cri_microvm_net 6-12 min, the others 1-8 min), so that a hang costs minutes of CI, not its
# whole budget. (A stuck L1 is ended sooner, by run-in-l1.sh's heartbeat watch on the host.)
limit_of() {
  case "$1" in
    kvm_linux_guest) echo 600 ;;
    kvm_vfio_passthrough) echo 300 ;;
    cri_microvm|cri_microvm_net) echo 1500 ;;
    *) echo 900 ;;
  esac
}
# What each takes in a CI lane (one L1 beside the host's tests, 2026-11-28): run-lane.sh queues
# the longest first, so that the short ones are left for the end, when a second L1 shares them.
expected_of() {
  case "$1" in
    cri_microvm) echo 700 ;;
    cri_microvm_net|cri_microvm_share_attack) echo 400 ;;
    cri_microvm_cgroup|cri_microvm_exec) echo 350 ;;
    cri_microvm_soak) echo 250 ;;
    cri_microvm_privileged|cri_microvm_hostile_agent) echo 200 ;;
    kvm_linux_guest|cri_microvm_devices|cri_microvm_fs_policy) echo 150 ;;
    cri_microvm_page_sharing|cri_microvm_sandbox_api) echo 100 ;;
    cri_microvm_vmm_process) echo 40 ;;
    *) echo 20 ;;
  esac
}
case "${1:-}" in
  --limit) limit_of "${2:?--limit NAME}"; exit 0 ;;
  --expected) expected_of "${2:?--expected NAME}"; exit 0 ;;
esac
queue=
if [ "${1:-}" = --queue ]; then
  queue=${2:?--queue DIR}
  shift 2
fi

microvm=${MICROVM_BIN_DIR:?MICROVM_BIN_DIR must name the folder of the built binaries}/microvm
kernel=${MICROVM_KERNEL:?MICROVM_KERNEL must name the guest kernel}

echo "== check-host$([ -n "${MICROVM_IN_LANE:-}" ] && echo " (inside the nested lane's L1)")"
if ! "$microvm" check-host --kernel "$kernel"; then
  log "check-host says the embedded VMM cannot boot our guest here"
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
      log "$1 still runs after ${limit} s: processes and what they wait on:"
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

# run_one NAME=EXE[@DIR] [TEST...]: one test binary, bounded, without the TESTs named (they passed
# in an L1 that got stuck: run-lane.sh); sets failed=1 when it did not pass.
failed=0
run_one() {
  local arg=$1 name exe containerd limit args env bound status t
  shift
  name=${arg%%=*}
  exe=${arg#*=}
  containerd=()
  case "$exe" in
    *@*) containerd=(MICROVM_TEST_CONTAINERD_BIN="${exe#*@}"); exe=${exe%%@*} ;;
  esac
  limit=$(limit_of "$name")
  case "$name" in
    # #[ignore]d where make test cannot run them; here it can.
    kvm_linux_guest) args=(--include-ignored --test-threads=1 --color=never); env=() ;;
    # VFIO passthrough of QEMU's edu device (an L1 started with run-in-l1.sh --vfio): bound to
    # vfio-pci here; if that fails the test runs without the device and fails saying so.
    kvm_vfio_passthrough)
      args=(--include-ignored --test-threads=1 --color=never); env=()
      if bound=$(scripts/lane/vfio-bind-edu.sh); then
        env=(MICROVM_TEST_VFIO_DEVICE="$(echo "$bound" | sed -n 1p)" MICROVM_TEST_VFIO_ID=1234:11e8)
        echo "embedded-vmm-tests: edu bound to vfio-pci: $(echo "$bound" | tr '\n' ' ')"
      fi
      ;;
    # The pod suites, on the embedded VMM instead of QEMU.
    # Its hot-plug test is #[ignore]d where the QEMU backend runs it (no hot-plug there).
    # Its VFIO test wants edu bound to vfio-pci, as kvm_vfio_passthrough does.
    cri_microvm_devices)
      args=(--include-ignored --test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm)
      # Without one (a host of its own, not the lane) that test does not run: run-tests.sh counts
      # it skipped there; in the lane a missing report counts as failed.
      if bound=$(scripts/lane/vfio-bind-edu.sh 2>/dev/null); then
        env+=(MICROVM_TEST_VFIO_DEVICE="$(echo "$bound" | sed -n 1p)" MICROVM_TEST_VFIO_ID=1234:11e8)
      else
        echo "embedded-vmm-tests: no device bound to vfio-pci: cri_microvm_devices' VFIO test does not run"
        args+=(--skip a_vfio_device_the_pod_holds_is_cold_plugged_and_seen_in_the_container)
      fi
      ;;
    # In L1 its console flood (1.5 MiB through the UART of a guest that L1 itself emulates)
    # outlasts the suite's bound; the embedded VMM's console bound is tested on /dev/kvm by
    # vmm/tests/kvm_console.rs. run-tests.sh counts it skipped, saying so.
    cri_microvm_hostile_agent)
      args=(--test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm)
      if [ -n "${MICROVM_IN_LANE:-}" ]; then
        echo "embedded-vmm-tests: in the lane, cri_microvm_hostile_agent's console flood test does not run"
        args+=(--skip a_console_flood_keeps_the_host_console_log_within_its_bound)
      fi
      ;;
    # Page sharing runs on the embedded VMM only: #[ignore]d where the pod suites run on QEMU.
    # So does the VMM in a process of its own (vmm_process = true, which that test sets for its
    # pods).
    cri_microvm_page_sharing|cri_microvm_vmm_process) args=(--include-ignored --test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm) ;;
    *) args=(--test-threads=1 --color=never); env=(MICROVM_TEST_HYPERVISOR=kvm) ;;
  esac
  env+=("${containerd[@]}")
  echo "== $name on the embedded vmm${containerd[*]:+ (${containerd[*]})}"
  if [ $# -gt 0 ]; then
    # (--exact: each --skip, these and the ones above, names one whole test.)
    args+=(--exact)
    for t in "$@"; do args+=(--skip "$t"); done
    echo "embedded-vmm-tests: $name: not run again, passed in an L1 that got stuck: $*"
  fi
  run_bounded "$limit" env "${env[@]}" "$exe" "${args[@]}"
  status=$?
  # A binary that reached its bound is not run again: its unreported tests count as failed (a
  # test that hangs for our reasons must not be retried into a pass). Only a stuck L1, which the
  # host sees and this script never does, is retried (scripts/lane/run-lane.sh).
  [ $status -eq 0 ] || failed=1
}

# take_next: the next entry of the queue, moved to DIR/taken: its binary's argument, then the tests
# not to run again (one a line); fails when the queue is empty.
take_next() {
  local f
  for f in "$queue"/todo/*; do
    if [ -e "$f" ] && mv "$f" "$queue/taken/" 2>/dev/null; then
      cat "$queue/taken/${f##*/}"
      return 0
    fi
  done
  return 1
}

if [ -n "$queue" ]; then
  while entry=$(take_next); do
    mapfile -t entry_lines <<<"$entry"
    run_one "${entry_lines[@]}"
  done
else
  for arg in "$@"; do run_one "$arg"; done
fi
exit $failed
