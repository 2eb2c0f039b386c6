#!/usr/bin/env bash
# Runs one command inside the nested lane's L1 (docs/nested-lane.md) and exits with its status.
#
#   scripts/lane/run-in-l1.sh [--memory-mib N] [--timeout SECONDS] [--writable DIR] -- CMD [ARG...]
#
# L1 is Debian's kernel under QEMU's software emulation (TCG, `-M q35 -cpu max -smp 1`), which
# emulates AMD SVM with nested paging: inside it kvm_amd runs and our embedded VMM boots Linux
# guests. L1 runs on this host's root, shared read-only over virtio-9p under a writable overlay on
# tmpfs (writes vanish with L1), so CMD sees this machine's files and binaries at their paths. It
# runs as root in the current directory, with this environment's MICROVM_*, BENCH_*, RUST_* and
# PATH; its output streams to stdout. --writable DIR shares DIR read-write at the same path, for
# results that must outlive L1.
#
# Exit status: CMD's; 124 when the timeout (default 3600 s) ended L1; 125 when L1 ended without
# reporting a status (it failed to come up, or crashed: L1's kernel log is printed). L1 always
# powers off; QEMU is killed on timeout or when this script is interrupted.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
memory_mib=${MICROVM_LANE_MEMORY_MIB:-8192}
timeout=${MICROVM_LANE_TIMEOUT:-3600}
writable=

usage() { echo "usage: $0 [--memory-mib N] [--timeout SECONDS] [--writable DIR] -- CMD [ARG...]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --memory-mib) memory_mib=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --writable) writable=$(cd "$2" && pwd); shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ $# -gt 0 ] || usage
[ "$(id -u)" -eq 0 ] || { echo "run-in-l1: needs root (9p shares of the host's root)" >&2; exit 2; }

image=$("$here/build-l1.sh")
lane=$(mktemp -d /tmp/microvm-lane.XXXXXX)
qemu_pid=
cleanup() {
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
    kill -KILL "$qemu_pid" 2>/dev/null || true
    wait "$qemu_pid" 2>/dev/null || true
  fi
  rm -rf "$lane"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The command, with the environment it runs in, as a script L1's stage 2 runs.
{
  echo "set -e"
  env | grep -E '^(MICROVM_[A-Z0-9_]*|BENCH_[A-Z0-9_]*|RUST_[A-Z0-9_]*|PATH)=' | sort | while IFS= read -r kv; do
    printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"
  done
  echo "export MICROVM_IN_LANE=1"
  printf 'cd %q\n' "$PWD"
  printf 'exec'
  printf ' %q' "$@"
  echo
} > "$lane/command"
[ -n "$writable" ] && echo "$writable" > "$lane/writable"
echo "$PWD" > "$lane/cwd"
# L1's own watchdog fires first (boot takes ~10-40 s), dumping what hangs before QEMU is killed.
echo $(( timeout > 180 ? timeout - 90 : timeout * 2 / 3 )) > "$lane/deadline"

fsdevs=(
  -fsdev "local,id=hostroot,path=/,readonly=on,security_model=none,multidevs=remap"
  -device "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot"
  -fsdev "local,id=lane,path=$lane,security_model=none"
  -device "virtio-9p-pci,fsdev=lane,mount_tag=lane"
)
if [ -n "$writable" ]; then
  fsdevs+=(-fsdev "local,id=writable,path=$writable,security_model=none,multidevs=remap"
           -device "virtio-9p-pci,fsdev=writable,mount_tag=writable")
fi

# One L1 vCPU: with two, TCG's SVM emulation sometimes delivers an interrupt right after VMRUN
# and guests or L1 crash (design.md 3b).
echo "run-in-l1: booting L1 ($(cat "$image/package"), ${memory_mib} MiB, 1 vCPU, TCG) for: $*" >&2
timeout --kill-after=15 "$timeout" qemu-system-x86_64 \
  -accel tcg -M q35 -cpu max -smp 1 -m "${memory_mib}M" \
  -nodefaults -no-user-config -nographic -no-reboot -bios qboot.rom \
  -kernel "$image/vmlinuz" -initrd "$image/initrd.cpio.gz" \
  -append "console=ttyS0 loglevel=1 edd=off panic=-1 microvm.lane.image=$image microvm.lane.stage2=$here/l1-stage2.sh" \
  -chardev stdio,id=console,signal=off -serial chardev:console \
  "${fsdevs[@]}" < /dev/null &
qemu_pid=$!
set +e
wait "$qemu_pid"
qemu_status=$?
set -e
qemu_pid=

if [ -s "$lane/status" ]; then
  status=$(cat "$lane/status")
  exit "$status"
fi
if [ "$qemu_status" -eq 124 ] || [ "$qemu_status" -eq 137 ]; then
  echo "run-in-l1: L1 did not finish within ${timeout} s; it was killed" >&2
  [ -s "$lane/dmesg" ] && tail -n 40 "$lane/dmesg" >&2
  exit 124
fi
echo "run-in-l1: L1 ended (QEMU exit $qemu_status) without the command's exit status" >&2
if [ -s "$lane/dmesg" ]; then
  echo "run-in-l1: the end of L1's kernel log:" >&2
  tail -n 40 "$lane/dmesg" >&2
fi
exit 125
