#!/bin/sh
# In L1 (for scripts/lane/soak.sh): boots L2, our kernel on the embedded VMM, again and again for
# SECONDS with kvm_linux_guest's two boot tests (1 and 2 vCPUs: two L2 boots a round), printing
# L1's SVM flags and kvm_amd's parameters first, each round's time, and at the end how many L2
# boots. Stops at the first failure (exit 1, with the test's output).
#
#   scripts/lane/soak.sh -n 2 -- scripts/lane/l2-boot-loop.sh 420 target/release/deps/kvm_linux_guest-<hash>
#
# The stall of docs/nested-lane.md happened while L2 booted, so this is the loop that measures it.
set -u
[ $# -eq 2 ] || { echo "usage: $0 SECONDS KVM_LINUX_GUEST_EXE" >&2; exit 2; }
secs=$1 exe=$2
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
  grep -E '^(svm|npt|vgif|pausefilter|pfthreshold|nrip_save|v_vmsave_vmload|lbrv|avic|vnmi|tsc_deadline_timer)$' | xargs)
echo "l2-boot-loop: L1 flags: $flags"
echo "l2-boot-loop: kvm_amd: $(cd /sys/module/kvm_amd/parameters && for p in *; do printf '%s=%s ' "$p" "$(cat "$p")"; done)"
out=$(mktemp /tmp/l2-boot-loop.XXXXXX)
end=$(( $(date +%s) + secs ))
n=0
while [ "$(date +%s)" -lt "$end" ]; do
  t0=$(cut -d' ' -f1 /proc/uptime)
  if ! "$exe" --include-ignored --test-threads=1 -q linux_guest_boots_on_embedded_vmm >"$out" 2>&1; then
    cat "$out"
    rm -f "$out"
    echo "l2-boot-loop: failed after $n rounds"
    exit 1
  fi
  t1=$(cut -d' ' -f1 /proc/uptime)
  n=$(( n + 1 ))
  echo "l2-boot-loop: round $n took $(echo "$t1 $t0" | awk '{ printf "%.2f", $1 - $2 }') s"
done
rm -f "$out"
echo "l2-boot-loop: $n rounds, $(( 2 * n )) L2 boots in $secs s"
