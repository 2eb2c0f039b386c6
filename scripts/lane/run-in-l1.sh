#!/usr/bin/env bash
# Runs one command inside the nested lane's L1 (docs/nested-lane.md) and exits with its status.
#
#   scripts/lane/run-in-l1.sh [--memory-mib N] [--timeout SECONDS] [--writable DIR] [--vfio]
#                             [--events FILE] -- CMD [ARG...]
#
# L1 is Debian's kernel under QEMU's software emulation (TCG, `-M q35 -cpu max -smp 1`), which
# emulates AMD SVM with nested paging: inside it kvm_amd runs and our embedded VMM boots Linux
# guests. L1 runs on this host's root, shared read-only over virtio-9p under a writable overlay on
# tmpfs (writes vanish with L1), so CMD sees this machine's files and binaries at their paths. It
# runs as root in the current directory, with this environment's MICROVM_*, BENCH_*, RUST_* and
# PATH; its output streams to stdout. --writable DIR shares DIR read-write at the same path, for
# results that must outlive L1. --vfio (or MICROVM_LANE_VFIO=1) gives L1 an emulated IOMMU
# (intel-iommu, `intel_iommu=on iommu=pt`) and QEMU's `edu` PCI device (1234:11e8) for VFIO
# passthrough tests; scripts/lane/vfio-bind-edu.sh binds it to vfio-pci inside L1. --events FILE
# appends one line per lane event to FILE: `boot`, `frozen`/`stalled` (L1 stuck and killed),
# `frozen-revived`/`stalled-revived` (stuck, came back after an NMI), `timeout`, `crashed`.
#
# Which L1 (for measurements, docs/nested-lane.md): MICROVM_LANE_QEMU (the L0 QEMU binary; by
# default the one scripts/lane/install-qemu.sh unpacks), MICROVM_LANE_CPU (`-cpu`, default
# `max`), MICROVM_LANE_APPEND (more words for L1's kernel command line, e.g. `idle=poll` or
# `kvm_amd.avic=1`: modprobe takes a module's options from there too).
#
# Exit status: CMD's; 75 when L1 got stuck (its heartbeat stopped: frozen or stalled, state
# printed) and was killed: the command did not fail, L1 did, so a caller may run it again in a
# fresh L1; 124 when the timeout (default 3600 s) ended a live L1; 125 when L1 ended without
# reporting a status (it failed to come up, or crashed: L1's kernel log is printed). L1 always
# powers off; QEMU is killed on timeout, when stuck, or when this script is interrupted.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=SCRIPTDIR/../lib.sh
. "$here/../lib.sh"
memory_mib=${MICROVM_LANE_MEMORY_MIB:-8192}
timeout=${MICROVM_LANE_TIMEOUT:-3600}
writable=
vfio=${MICROVM_LANE_VFIO:-0}
events=
cpu=${MICROVM_LANE_CPU:-max}
append=${MICROVM_LANE_APPEND:-}

usage() { echo "usage: $0 [--memory-mib N] [--timeout SECONDS] [--writable DIR] [--vfio] [--events FILE] -- CMD [ARG...]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --memory-mib) memory_mib=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --writable) writable=$(cd "$2" && pwd); shift 2 ;;
    --vfio) vfio=1; shift ;;
    --events) events=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ $# -gt 0 ] || usage
[ "$(id -u)" -eq 0 ] || { log "needs root (9p shares of the host's root)"; exit 2; }

image=$("$here/build-l1.sh")
qemu=${MICROVM_LANE_QEMU:-qemu-system-x86_64}
qemu_data=()
# A QEMU unpacked outside /usr brings its firmware (qboot.rom, option ROMs) beside it.
if [ -d "$(dirname "$(command -v "$qemu")")/../share/qemu" ]; then
  qemu_data=(-L "$(cd "$(dirname "$(command -v "$qemu")")/../share/qemu" && pwd)")
fi
lane=$(mktemp -d /tmp/microvm-lane.XXXXXX)
qemu_pid=
qemu_child=
watch_pid=
cleanup() {
  if [ -n "$watch_pid" ]; then kill "$watch_pid" 2>/dev/null || true; fi
  # QEMU itself first: `timeout` cannot pass a SIGKILL on, and QEMU would outlive it.
  if [ -n "$qemu_child" ]; then kill -KILL "$qemu_child" 2>/dev/null || true; fi
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

# The VFIO option: an emulated IOMMU as the first device, and the edu device behind it. iommu=pt
# keeps L1's own devices (9p) on identity mappings; a device bound to vfio-pci gets its own
# domain. DMA remapping only: without interrupt remapping vfio_iommu_type1 refuses a group
# (VFIO_SET_IOMMU: EPERM) unless allow_unsafe_interrupts is set, which it is here (our VMM does
# not route the device's MSIs yet, and L1's interrupt path stays as in every other lane run).
# Off by default.
iommu=() iommu_args=
if [ "$vfio" = 1 ]; then
  iommu=(-device "intel-iommu,intremap=off" -device edu)
  iommu_args=" intel_iommu=on iommu=pt vfio_iommu_type1.allow_unsafe_interrupts=1"
fi

# QEMU's human monitor on a pair of FIFOs ($lane/monitor.in, .out), for the watch below.
mkfifo "$lane/monitor.in" "$lane/monitor.out"

# CPU time (clock ticks, 100 a second) QEMU's process has used, all threads.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null; }

# Appends one event to the caller's events file (--events).
event() {
  if [ -n "$events" ]; then echo "$1" >>"$events"; fi
  return 0
}

# What the watch prints of a stuck L1: its vCPU's registers (HLT=1: halted; RFL: IF), local APIC
# (timer mode, vector, counts; IRR/ISR: what is pending), PIC; for a busy vCPU two more register
# samples a second apart and the instructions at RIP, to tell a spin at one place from a vCPU
# that moves.
dump_l1() {
  local i
  : >"$lane/monitor.log"
  printf 'info registers\ninfo lapic\ninfo pic\n' >&7
  if [ "$1" = stalled ]; then
    for i in 1 2; do sleep 1; printf 'info registers\n' >&7; done
    printf 'x/6i $pc\n' >&7
  fi
  sleep 3
  # Without the monitor's echo of the commands (escape sequences) and the FPU/vector registers.
  # A QEMU whose monitor does not answer (its main loop hung, or the process stopped) leaves the
  # log empty: grep finds nothing, which must not end the watch (set -e).
  if [ -s "$lane/monitor.log" ]; then
    sed 's/\r//g' "$lane/monitor.log" | grep -av -e $'\e' -e '^(qemu)' -e '^[YX]MM' -e '^FPR' -e '^DR[0-7]' >&2 || true
  else
    log "QEMU's monitor did not answer"
  fi
}

# The watch. Stage 2 writes a heartbeat into the lane share every 5 s from a shell loop in L1's
# user space (l1-stage2.sh). When it has not moved for 40 s while QEMU used under 5 % of a core,
# or for 90 s however busy QEMU was (180 s before the first heartbeat: L1 boots in 10-40 s), L1
# runs none of its own processes any more, so none of its timeouts or watchdogs can fire either,
# and this watch ends it from the host:
# - frozen: QEMU used under 5 % of a core meanwhile (an idle but live L1 uses ~0.4 % for its
#   timers and beats every 5 s; a frozen one uses none): L1's vCPU sits halted and nothing wakes
#   it, not even its timer. Eight missed beats at no CPU are enough to tell (each second of the
#   wait costs CI a second of the lane);
# - stalled: QEMU kept its core busy, yet L1 never ran its processes: its vCPU runs a nested
#   guest (L2) that L1 never gets the CPU back from.
# Either way it prints L1's state (dump_l1) and sends an NMI (a lost wakeup resumes on it, and
# the run goes on, noted); if the heartbeat does not resume (or L1 gets stuck a third time) it
# kills QEMU: exit 75.
watch_l1() {
  local pid=$1 hb last_hb= since=$SECONDS ticks_since now used secs limit=180 kind tries=0
  exec 7<>"$lane/monitor.in"
  cat <"$lane/monitor.out" >>"$lane/monitor.log" &
  ticks_since=$(cpu_ticks "$pid") || return 0
  while sleep 10; do
    now=$(cpu_ticks "$pid") || return 0
    hb=$(cat "$lane/heartbeat" 2>/dev/null || true)
    if [ -n "$hb" ] && [ "$hb" != "$last_hb" ]; then
      last_hb=$hb since=$SECONDS ticks_since=$now limit=90
      continue
    fi
    # Stage 2 has finished (status written): L1 is powering off, nothing to watch.
    [ -s "$lane/status" ] && return 0
    secs=$(( SECONDS - since ))
    [ "$secs" -ge 40 ] || continue
    used=$(( now - ticks_since ))
    # Clock ticks are 1/100 s: under 5 % of a core is 5 ticks a second.
    if [ "$used" -lt $(( secs * 5 )) ]; then
      kind=frozen
    elif [ "$secs" -ge "$limit" ]; then
      kind=stalled
    else
      continue
    fi
    tries=$(( tries + 1 ))
    log "L1 $kind: no heartbeat for ${secs} s, QEMU used $(( used / secs ))% of a core meanwhile; L1's vCPU and local APIC:"
    dump_l1 "$kind"
    if [ "$tries" -le 2 ]; then
      log "sending L1 an NMI (try $tries)"
      printf 'nmi\n' >&7
      sleep 20
      hb=$(cat "$lane/heartbeat" 2>/dev/null || true)
      if [ -n "$hb" ] && [ "$hb" != "$last_hb" ]; then
        log "L1 came back after the NMI; the run goes on"
        event "$kind-revived"
        echo "$kind" >>"$lane/revived"
        last_hb=$hb since=$SECONDS ticks_since=$(cpu_ticks "$pid") limit=90
        continue
      fi
    fi
    log "L1 stays $kind; killing it"
    echo "$kind" >"$lane/stuck"
    kill -KILL "$pid" 2>/dev/null
    return 0
  done
}

# One L1 vCPU: with two, TCG's SVM emulation sometimes delivers an interrupt right after VMRUN
# and guests or L1 crash.
log "booting L1 ($(cat "$image/package"), ${memory_mib} MiB, 1 vCPU, TCG, $("$qemu" --version | head -n1 | sed 's/ emulator version / /'), -cpu $cpu${append:+, $append}) for: $*"
event boot
timeout --kill-after=15 "$timeout" "$qemu" "${qemu_data[@]}" \
  -accel tcg -M q35 -cpu "$cpu" -smp 1 -m "${memory_mib}M" \
  -nodefaults -no-user-config -nographic -no-reboot -bios qboot.rom \
  -kernel "$image/vmlinuz" -initrd "$image/initrd.cpio.gz" \
  -append "console=ttyS0 loglevel=1 edd=off panic=-1$iommu_args${append:+ $append} microvm.lane.image=$image microvm.lane.stage2=$here/l1-stage2.sh" \
  -chardev stdio,id=console,signal=off -serial chardev:console \
  -chardev "pipe,id=monitor,path=$lane/monitor" -mon chardev=monitor,mode=readline \
  "${iommu[@]}" "${fsdevs[@]}" < /dev/null &
qemu_pid=$!
# QEMU itself is timeout's child.
for _ in $(seq 50); do
  child=$(pgrep -P "$qemu_pid" || true)
  [ -n "$child" ] && break
  sleep 0.1
done
qemu_child=$child
if [ -n "$child" ]; then
  watch_l1 "$child" &
  watch_pid=$!
fi
set +e
wait "$qemu_pid"
qemu_status=$?
set -e
qemu_pid=
qemu_child=
if [ -n "$watch_pid" ]; then
  kill "$watch_pid" 2>/dev/null || true
  wait "$watch_pid" 2>/dev/null || true
  watch_pid=
fi

if [ -s "$lane/status" ]; then
  [ -s "$lane/revived" ] && log "note: L1 got stuck during this run ($(sort "$lane/revived" | uniq -c | xargs)) and came back after an NMI"
  status=$(cat "$lane/status")
  [ "$status" -eq 124 ] && event timeout
  exit "$status"
fi
if [ -s "$lane/stuck" ]; then
  kind=$(cat "$lane/stuck")
  log "L1 $kind and was killed (its vCPU state is above); the command did not finish"
  event "$kind"
  exit 75
fi
if [ "$qemu_status" -eq 124 ] || [ "$qemu_status" -eq 137 ]; then
  log "L1 did not finish within ${timeout} s; it was killed"
  [ -s "$lane/dmesg" ] && tail -n 40 "$lane/dmesg" >&2
  event timeout
  exit 124
fi
log "L1 ended (QEMU exit $qemu_status) without the command's exit status"
if [ -s "$lane/dmesg" ]; then
  log "the end of L1's kernel log:"
  tail -n 40 "$lane/dmesg" >&2
fi
event crashed
exit 125
