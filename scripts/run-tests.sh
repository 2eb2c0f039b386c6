#!/usr/bin/env bash
# `make test`: lint, every unit and integration test (real /dev/kvm with our test guests, our
# Linux guest and the pod suites under QEMU/TCG), then the tests of Linux guests on the embedded
# VMM (tests/tests/kvm_linux_guest.rs and the pod suites with MICROVM_TEST_HYPERVISOR=kvm):
# directly where this host's KVM boots our guest, else inside the nested lane (an L1 Linux under
# QEMU/TCG whose emulated SVM runs kvm_amd: docs/nested-lane.md), else counted skipped with the
# reason. Closes with one line `tests: N passed, N failed, N skipped` over all of them; a test
# that did not run because its run crashed counts as failed, never as passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export MICROVM_KERNEL=${MICROVM_KERNEL:-$PWD/build/vmlinux}
export MICROVM_INITRD=${MICROVM_INITRD:-$PWD/build/initrd.cpio}
export MICROVM_HOSTILE_INITRD=${MICROVM_HOSTILE_INITRD:-$PWD/build/initrd-hostile.cpio}
export MICROVM_GUEST_DIR=${MICROVM_GUEST_DIR:-$PWD/build/guests}
export MICROVM_BIN_DIR=${MICROVM_BIN_DIR:-$PWD/target/release}

# Each section's header says when it began, in minutes and seconds since this script started
# (after make built what it needs): where a run's time goes (CI's budget is 80 minutes cold).
elapsed() { printf '%dm%02ds' $((SECONDS / 60)) $((SECONDS % 60)); }

echo "== fmt (at $(elapsed))"
cargo fmt --all -- --check || exit 1

# What was on the host before the tests began is not theirs to answer for: a stale shim socket
# or state directory from an earlier run (or another user of the node) is reported as such below,
# and only what appeared during this run counts as left behind.
stale_before=$( (ls -A /run/microvm 2>/dev/null | sed 's|^|state directory /run/microvm/|'
  ls -A /run/containerd/s 2>/dev/null | sed 's|^|stale shim socket /run/containerd/s/|') | sort)

results=$(mktemp)
embedded=$(mktemp)
side_log=$(mktemp)
# Created when the host's own tests are done (before clippy): the nested lane may take the second
# core then.
host_done=$results.host-done
lane_pid=
side_pid=
progress_pid=
# kill_tree PID: PID and every process below it (the lane: run-lane.sh, run-in-l1.sh, QEMU),
# parents first so none starts a next step; run-in-l1.sh kills its QEMU on the signal.
kill_tree() {
  local pids=("$1") i=0 child
  while [ $i -lt ${#pids[@]} ]; do
    for child in $(pgrep -P "${pids[$i]}" 2>/dev/null); do pids+=("$child"); done
    i=$(( i + 1 ))
  done
  kill -TERM "${pids[@]}" 2>/dev/null || true
}
finish() {
  if [ -n "$lane_pid" ] && kill -0 "$lane_pid" 2>/dev/null; then
    echo "== the nested lane, as far as it got (stopped at $(elapsed))"
    cat "$embedded"
    kill_tree "$lane_pid"
  fi
  if [ -n "$side_pid" ]; then kill_tree "$side_pid"; fi
  if [ -n "$progress_pid" ]; then kill_tree "$progress_pid"; fi
  rm -f "$results" "$embedded" "$side_log" "$host_done"
}
trap finish EXIT
trap 'exit 143' TERM INT
status_all=0

# The tests of Linux guests on the embedded VMM: the plain boot tests, VFIO passthrough and the
# pod suites (containerd + CRI), by cargo target name. The first two and the page-sharing and
# VMM-process suites are #[ignore]d in the plain run (counted here, where they run).
embedded_targets=(kvm_linux_guest kvm_vfio_passthrough cri_microvm cri_microvm_exec cri_microvm_net cri_microvm_cgroup cri_microvm_devices cri_microvm_privileged cri_microvm_sandbox_api cri_microvm_fs_policy cri_microvm_share_attack cri_microvm_hostile_agent cri_microvm_page_sharing cri_microvm_vmm_process cri_microvm_soak)

# Their test executables, `name=<exe>`, built first with the workspace's binaries (the lane
# starts on them). Every cargo command here selects the whole workspace (`--workspace`, narrowed
# with `--test`), never one package, and builds at least one test target: features are resolved
# over the selected packages, and a test target turns on the dev-dependencies' features
# (virtio-queue's test-utils, getrandom's std through proptest), which change the crates below
# them. So the binaries are built here, with the tests' features, and not by `make build` before
# (without them): the later `cargo test --no-run --workspace` builds only what is new (the unit
# tests), instead of the shim, VMM, device and CRI crates a second time.
executables() {
  cargo build --release --message-format=json --workspace --bins \
    $(printf -- '--test %s ' "${embedded_targets[@]}") |
    jq -r 'select(.reason == "compiler-artifact" and .target.kind == ["test"] and .executable != null)
           | "\(.target.name)=\(.executable)"'
}
echo "== building the binaries and the tests of the embedded VMM (at $(elapsed))"
mapfile -t all_exes < <(executables)
# They again, one a line (none when none built).
listed_exes() { [ ${#all_exes[@]} -eq 0 ] || printf '%s\n' "${all_exes[@]}"; }

# How many tests they hold, from their own lists (scripts/embedded-test-counts.sh): n_linux (the
# ignored tests of the plain run counted here instead), n_vfio, n_sharing, n_embedded (the tests
# the embedded-VMM run reports). A target whose executable is missing or cannot list its tests
# counts one failure below.
# shellcheck source=SCRIPTDIR/embedded-test-counts.sh
. scripts/embedded-test-counts.sh
count_embedded_tests "${all_exes[@]}"
for t in "${embedded_targets[@]}"; do
  listed_exes | grep -q "^$t=" || unlisted+=("$t")
done
if [ ${#unlisted[@]} -gt 0 ]; then
  echo "FAILED: no list of the tests of ${unlisted[*]} (their executables did not build or cannot list their tests): each counts one failure"
  status_all=1
fi
verdict=$(target/release/microvm check-host --kernel "$MICROVM_KERNEL")
check=$?
echo "$verdict"
reason=$(echo "$verdict" | sed -n 's/^verdict: //p')

# Which containerd each embedded-VMM suite runs against: the lane is the long part of CI, so
# rather than every suite three times, the releases take turns (each is also run with every suite
# on the QEMU backend below): 1.6 for cri_microvm and cri_microvm_net, 1.7 for
# cri_microvm_cgroup, 2.1 for cri_microvm_exec and cri_microvm_devices, and for
# cri_microvm_sandbox_api, whose Sandbox API only 2.x has.
lane_containerd() {
  local line name suite bin
  while IFS= read -r line; do
    name=${line%%=*}
    case "$name" in
      cri_microvm_cgroup) suite=trixie ;;
      cri_microvm_exec|cri_microvm_devices|cri_microvm_sandbox_api) suite=sid ;;
      *) suite= ;;
    esac
    if [ -n "$suite" ]; then
      if bin=$(scripts/install-containerd.sh "$suite"); then
        line="$line@$bin"
      else
        echo "FAILED: could not unpack the containerd of Debian $suite for $name; it runs on the system's" >&2
      fi
    fi
    echo "$line"
  done
}

# Where they run. In the nested lane (this host's KVM cannot boot our guest) they start now, in
# the background, and run beside everything below: the lane's L1 is one TCG vCPU, busy for most
# of CI's time on one core, while the host's own tests use the other (they share nothing with
# it: L1 has its own /run, containerd and network; docs/nested-lane.md). Its output is printed
# when it ends. Directly on this host's KVM they run after the host's pod suites, whose pod state
# directories and processes they would share.
ran_embedded=0
skipped_embedded=0
lane_summary=
direct=0
if [ $check -eq 0 ]; then
  direct=1
elif [ $check -eq 2 ] && [ "${MICROVM_LANE:-on}" != off ]; then
  echo "== linux guests on the embedded vmm: in the nested lane, beside what follows (at $(elapsed); this host's KVM cannot boot our guest: $reason)"
  mapfile -t exes < <(listed_exes | lane_containerd)
  # The lane runs on a copy of the binaries as they are now. Building the other tests below
  # builds the workspace's binaries again (the tests' dev-dependencies turn on other features of
  # shared crates) and puts them at the same paths in target/release: a shim that L1 started
  # from the old file, or a VMM process it starts from its own path, would run a binary replaced
  # under it. (In target/, not /tmp: L1 has its own /tmp.)
  lane_bin=$PWD/target/lane-bin
  rm -rf "$lane_bin" && mkdir -p "$lane_bin" &&
    find "$MICROVM_BIN_DIR" -maxdepth 1 -type f -perm -u+x -exec cp -p {} "$lane_bin/" \; ||
    { echo "FAILED: could not copy the binaries for the nested lane" >&2; exit 1; }
  # embedded-vmm-tests.sh leaves out this one test in L1 (it says why there too).
  n_embedded=$(( n_embedded - 1 ))
  skipped_embedded=1
  echo "SKIPPED: cri_microvm_hostile_agent's a_console_flood_keeps_the_host_console_log_within_its_bound in the lane: 1.5 MiB through an emulated UART of a guest that is itself emulated takes longer than the suite's bound; the embedded VMM's console bound is tested on this host's /dev/kvm by vmm/tests/kvm_console.rs, and the flood through CRI on the QEMU backend below"
  # All binaries in one L1 (--vfio: an emulated IOMMU and QEMU's edu device for the VFIO
  # tests); if that L1 gets stuck, the binaries it had not finished run again in a fresh one,
  # said with a RETRY line; the lane's boots, freezes, stalls and retries are counted in its last line,
  # repeated at the end below.
  (
    # The lane is the long part: its L1 (and everything it starts) runs before the host's
    # tests when both want the CPU (nice -5; root, as the lane needs anyway), so that it keeps one
    # core to itself while the host's tests and builds share the other.
    renice -n -5 -p "$BASHPID" >/dev/null 2>&1 || true
    # The soak's short version is shorter still in the lane (a cycle there takes ~10 s): 8
    # container cycles (the bounds compare the 5 after the warm-up: a leak of one fd a cycle
    # shows) and 2 pod cycles (every suite's pods are checked for leftovers besides).
    # A second L1 joins the first on what is still queued once the host's own tests are done
    # (below: $host_done), so that neither core idles while the lane has work left.
    MICROVM_SOAK_CONTAINER_CYCLES=${MICROVM_SOAK_CONTAINER_CYCLES:-8} \
      MICROVM_SOAK_POD_CYCLES=${MICROVM_SOAK_POD_CYCLES:-2} \
      MICROVM_BIN_DIR=$lane_bin scripts/lane/run-lane.sh --second-l1-when "$host_done" "${exes[@]}"
    status=$?
    echo "== the nested lane ended (at $(elapsed))"
    exit $status
  ) >"$embedded" 2>&1 &
  lane_pid=$!
  ran_embedded=1
  # Its progress as it goes, one line a binary begun or ended (and any retry), marked `[lane at
  # <time>]`:
  # so that a run cut short (CI's time limit) still shows how far the lane got.
  (
    tail -n +1 -F "$embedded" 2>/dev/null |
      grep --line-buffered -E '^(L1 #[0-9]+: )?(== [a-z0-9_]+ on the embedded vmm|test result:|RETRY|lane: |run-in-l1: L1 )' |
      while IFS= read -r line; do echo "[lane at $(elapsed)] $line"; done
  ) &
  progress_pid=$!
elif [ $check -eq 2 ]; then
  skipped_embedded=$n_embedded
  echo "SKIPPED: $n_embedded tests of Linux guests on the embedded vmm (kvm_linux_guest, and the pod suites with MICROVM_TEST_HYPERVISOR=kvm; they run on QEMU below): $reason; and MICROVM_LANE=off"
else
  echo "check-host failed (exit $check)" >&2
  exit 1
fi

# The fuzz smoke run and cargo deny, from here on at the lowest priority: they take the cycles
# the builds and tests below leave idle (the host's tests mostly wait on their VMs). Their
# output is printed at the end. Each fuzz target counts as a test below: passed, or failed when
# it crashed, hung or ran out of memory; a smoke run that ended before its closing line (the
# build failed) counts one failure (docs/fuzzing.md). cargo deny checks licenses, bans and
# sources (deny.toml; no advisory database is reachable offline: docs/security.md) and counts as
# one test. (Clippy on the fuzz package, its own workspace, is `make lint`'s: a check build of
# its own that CI's time does not carry; its format is checked by the smoke run.)
(
  echo "== fuzz smoke (at $(elapsed))"
  nice -n 19 scripts/fuzz-smoke.sh
  echo "== cargo deny (at $(elapsed))"
  if deny=$(INSTALL_NICE=19 scripts/install-cargo-deny.sh | tail -n 1) &&
    "$deny/cargo-deny" --offline check licenses bans sources; then
    echo "cargo deny: ok"
  else
    echo "cargo deny: FAILED"
  fi
  echo "== fuzz and deny: done (at $(elapsed))"
) >"$side_log" 2>&1 &
side_pid=$!

echo "== building the other tests (at $(elapsed))"
# A build that fails fails every section after it.
cargo test --release --workspace --no-run 2>&1 || status_all=1

echo "== tests (at $(elapsed))"
# Integration tests boot VMs; two at a time is what two cores carry without timeouts. Every test
# binary runs even when one before it failed (--no-fail-fast): each one's result line counts.
# The Sandbox API tests (`shim_sandboxer_*`) need containerd 2.x: they run in the 2.1 section below.
cargo test --release --workspace --no-fail-fast -- --test-threads=2 --skip shim_sandboxer_ 2>&1 | tee -a "$results" || status_all=1

echo "== the pod suites on containerd 1.7 and 2.1 (QEMU backend) (at $(elapsed))"
# The suites against trixie's containerd 1.7 and sid's 2.1, unpacked privately into the cache
# (scripts/install-containerd.sh; never installed over the system's). They count like the
# others. Every suite whose path goes through what containerd does runs on both: the pod and
# container lifecycle, exec, the network (CNI in the pod's netns), the pod cgroup, device
# plugins' devices (CDI), privileged specs, the harness's own cleanup and runc beside us
# (docs/testing-containerd.md says where the releases differ: after kill -9 of a shim, 1.7 and
# 2.1 report the app container running for about 2 s, for runc pods as for ours, and kubelet's
# retry removes the pod: the tests retry as kubelet does). The hostile-guest suites
# (cri_microvm_share_attack, cri_microvm_fs_policy, cri_microvm_hostile_agent) run with 1.6
# above and in the nested lane, not again here: what they attack (the pod's share, the agent's
# replies and events, the console) lies between the guest and the shim, which alone holds the
# line; containerd only sees what the shim passes on.
# 2.1 also runs cri_microvm_sandbox_api: its pods go through the shim's Sandbox API
# (`sandboxer = "shim"`, a 2.x key; docs/testing-containerd.md).
pod_suites=cri_microvm,cri_microvm_exec,cri_microvm_net,cri_microvm_cgroup,cri_microvm_devices,cri_microvm_privileged,cri_harness_cleanup,cri_runc
for version in trixie:$pod_suites sid:$pod_suites,cri_microvm_sandbox_api; do
  suite=${version%%:*}
  tests=${version#*:}
  if bin=$(scripts/install-containerd.sh "$suite"); then
    echo "-- containerd $(cat "$bin/../../version") ($suite): ${tests//,/ }"
    MICROVM_TEST_CONTAINERD_BIN=$bin cargo test --release --no-fail-fast --workspace \
      $(printf -- '--test %s ' ${tests//,/ }) -- --test-threads=2 2>&1 | tee -a "$results" || status_all=1
  else
    echo "FAILED: could not unpack the containerd of Debian $suite (scripts/install-containerd.sh)"
    status_all=1
  fi
done


# The host's own tests are done: the nested lane may take the second core for what it still has
# queued (a second L1, at nice -5), and clippy gets what the L1s leave.
if [ -n "$lane_pid" ]; then touch "$host_done"; fi
echo "== clippy (at $(elapsed))"
# After the tests, in their target folder (cargo's lock on it would have held them back), at the
# lowest priority beside the lane; counts as one test.
if nice -n 19 cargo clippy --release --workspace --all-targets -- -D warnings; then
  clippy=ok
else
  clippy=FAILED
fi

if [ $direct -eq 1 ]; then
  echo "== linux guests on the embedded vmm: directly on this host's KVM (at $(elapsed))"
  # VFIO passthrough needs a device bound to vfio-pci behind an IOMMU: the lane makes one (edu);
  # a host of its own has none we may take, so its test counts as skipped here.
  mapfile -t exes < <(listed_exes | grep -v '^kvm_vfio_passthrough=' | lane_containerd)
  # ... and cri_microvm_devices' VFIO pod test.
  n_embedded=$(( n_embedded - n_vfio - 1 ))
  skipped_embedded=$(( n_vfio + 1 ))
  echo "SKIPPED: $n_vfio VFIO passthrough tests (kvm_vfio_passthrough) and cri_microvm_devices' VFIO pod test: they need a device bound to vfio-pci, which only the nested lane (run-in-l1.sh --vfio) provides"
  scripts/lane/embedded-vmm-tests.sh "${exes[@]}" 2>&1 | tee "$embedded" || status_all=1
  ran_embedded=1
fi

if [ -n "$lane_pid" ]; then
  echo "== waiting for the nested lane (at $(elapsed))"
  wait "$lane_pid" || status_all=1
  lane_pid=
  sleep 1
  kill_tree "$progress_pid"
  progress_pid=
  echo "== linux guests on the embedded vmm, in the nested lane (its output)"
  cat "$embedded"
  lane_summary=$(grep '^lane: [0-9]* L1 boots' "$embedded" | tail -n1)
fi

wait $side_pid
side_pid=
cat "$side_log"
fuzz_line=$(grep -E '^fuzz: [0-9]+ targets, [0-9]+ crashed$' "$side_log" | tail -n 1)
fuzz_targets=$(awk '{ print $2 }' <<<"$fuzz_line")
fuzz_crashed=$(awk '{ print $4 }' <<<"$fuzz_line")
if [ -z "$fuzz_line" ]; then
  echo "FAILED: the fuzz smoke run ended before running its targets"
  fuzz_targets=1 fuzz_crashed=1
fi
if grep -qx 'cargo deny: ok' "$side_log"; then deny=ok; else deny=FAILED; fi

echo "== leftovers (at $(elapsed))"
# report_left WHAT NONE LIST: LIST (one item a line) is what the tests left of WHAT; empty: NONE.
report_left() {
  if [ -n "$3" ]; then
    echo "$1 left behind by the tests:" >&2
    echo "$3" >&2
    status_all=1
  else
    echo "$2"
  fi
}
report_left "processes" "no VM processes left behind" \
  "$(pgrep -a -f 'qemu-system-x86_64|vhost-device-vsock|virtiofsd|microvm-agent|containerd-shim|containerd --config /tmp/microvm-ctrd' || true)"
# What a pod holds on the host beyond its processes: its state directory (/run/microvm/<pod>),
# mounts under it, and its shim's socket (one nobody listens on any more).
left_state=$(
  ls -A /run/microvm 2>/dev/null | sed 's|^|state directory /run/microvm/|'
  awk '$5 ~ "^/run/microvm/" { print "mount " $5 }' /proc/self/mountinfo
  listening=$(ss -xlH 2>/dev/null | awk '{ print $5 }')
  for s in /run/containerd/s/*; do
    [ -S "$s" ] || continue
    grep -qxF "$s" <<<"$listening" || echo "stale shim socket $s"
  done
)
if [ -n "$stale_before" ]; then
  echo "on the host before the tests began (not counted):"
  echo "$stale_before"
  left_state=$(grep -vxF -f <(echo "$stale_before") <<<"$left_state" || true)
fi
report_left "pod state" "no pod state directories, mounts or shim sockets left behind" "$left_state"

# One closing line over every cargo test binary. Every ignored test counts as skipped, never as
# passed: kvm_linux_guest's are ignored in the plain run and counted where they ran on the
# embedded VMM (or skipped with the reason above); tests of work not finished yet say why in
# their #[ignore] reason, printed by cargo above. An embedded-VMM run that ended before all its
# tests reported (L1 crashed or timed out) counts the missing ones as failed.
# (The lane's second L1 prefixes its lines with `L1 #2: `.)
sum() { local what=$1; shift; sed -n "s/^\(L1 #[0-9]*: \)\{0,1\}test result: .* \([0-9][0-9]*\) $what.*/\2/p" "$@" | paste -sd+ | bc; }
passed=$(( $(sum passed "$results") + 0 ))
failed=$(( $(sum failed "$results") + 0 ))
ignored=$(( $(sum ignored "$results") + 0 ))
skipped=$(( ignored - n_linux + skipped_embedded ))
if [ $ran_embedded -eq 1 ]; then
  # (With the tests a stuck L1 had passed, which its binary's retry did not run again.)
  e_passed=$(( $(sum passed "$embedded") + $(sed -n 's/^lane: [a-z0-9_]* kept \([0-9][0-9]*\) passed tests .*/\1/p' "$embedded" | paste -sd+ | bc) + 0 ))
  e_failed=$(( $(sum failed "$embedded") + 0 ))
  missing=$(( n_embedded - e_passed - e_failed ))
  if [ $missing -gt 0 ]; then
    echo "embedded vmm: $missing of $n_embedded tests did not report (their run ended early): counted as failed"
    status_all=1
  else
    missing=0
  fi
  passed=$(( passed + e_passed ))
  failed=$(( failed + e_failed + missing ))
fi
passed=$(( passed + fuzz_targets - fuzz_crashed ))
failed=$(( failed + fuzz_crashed + ${#unlisted[@]} ))
for side in "$deny" "$clippy"; do
  if [ "$side" = ok ]; then passed=$(( passed + 1 )); else failed=$(( failed + 1 )); fi
done
[ $failed -eq 0 ] || status_all=1
if [ -n "$lane_summary" ]; then echo "$lane_summary"; fi
echo "time: $(elapsed)"
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped (with ${fuzz_targets} fuzz targets, ${fuzz_crashed} crashed; cargo deny ${deny}; clippy ${clippy})"
exit $status_all
