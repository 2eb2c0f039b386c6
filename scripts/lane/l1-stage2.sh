#!/bin/bash
# Stage 2 of the nested lane's L1 (docs/nested-lane.md), PID 1 on the host's root under a
# writable overlay: sets up what our tests need (KVM with nested SVM, cgroup2, tmpfs /tmp and
# /run, loopback, the modules for containerd's overlayfs snapshotter and the CNI bridge), runs the
# one command the host asked for (scripts/lane/run-in-l1.sh wrote it to the lane share), records
# its exit status there, and powers L1 off. Never returns: PID 1 exiting would panic the kernel.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root

lane=/run/microvm-lane

say() { echo "l1: $*" >&2; }
power_off() {
  sync
  # Quiet: the kernel's "Power down" line is not the command's output.
  echo 0 > /proc/sys/kernel/printk
  busybox poweroff -f
  echo o > /proc/sysrq-trigger
  sleep 30
}
fail() {
  say "$*"
  [ -d "$lane" ] && dmesg > "$lane/dmesg" 2>/dev/null
  power_off
}

# /tmp and /run get fresh tmpfs below (containerd's overlayfs snapshotter cannot sit on an
# overlay). The host's view of them stays reachable under /mnt/microvm-host, so that a caller
# whose working directory is there (a clone in /tmp, as CI may make) still finds it; the module
# tree is bound before anything is covered for the same reason.
mkdir -p /mnt/microvm-host/tmp /mnt/microvm-host/run
mount --bind /tmp /mnt/microvm-host/tmp || fail "bind the host's /tmp aside"
mount --bind /run /mnt/microvm-host/run || fail "bind the host's /run aside"
kver=$(uname -r)
mkdir -p "/lib/modules/$kver"
mount --bind "$MICROVM_LANE_IMAGE/modules/$kver" "/lib/modules/$kver" || fail "bind the modules of $kver"
mount -t tmpfs -o mode=1777 tmpfs /tmp || fail "mount /tmp"
mount -t tmpfs -o mode=0755 tmpfs /run || fail "mount /run"
mkdir -p /dev/pts /dev/shm "$lane"
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts || fail "mount /dev/pts"
mount -t tmpfs -o mode=1777 tmpfs /dev/shm || fail "mount /dev/shm"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 lane "$lane" || fail "mount the lane share"
# Output lines end in \n, not \r\n, so the host reads them like a pipe.
stty -F /dev/console -onlcr 2>/dev/null

# kvm_amd with nested=1: SVM emulated by QEMU (TCG) with nested paging; our VMM runs on it.
# vgif=0: KVM does not hand the guest's global interrupt flag to the CPU's virtual GIF. With it
# (kvm_amd's default where the CPU offers vGIF, as QEMU's does), TCG's SVM emulation now and then
# leaves L1 unable to take its own interrupts, and L1 freezes or stalls (docs/nested-lane.md,
# "When L1 gets stuck": measured, with and without). `kvm_amd.vgif=1` on L1's command line
# (run-in-l1.sh's MICROVM_LANE_APPEND) brings the old setting back, for measuring it.
# overlay: containerd's overlayfs snapshotter. bridge, veth: the CNI bridge plugin. tun: tap
# devices. Anything else is loaded on demand (the kernel calls /sbin/modprobe on this root).
kvm_amd="kvm_amd nested=1"
grep -q 'kvm_amd\.vgif=' /proc/cmdline || kvm_amd="$kvm_amd vgif=0"
for m in "$kvm_amd" overlay bridge veth tun; do
  # shellcheck disable=SC2086
  modprobe $m || fail "modprobe $m"
done
[ -c /dev/kvm ] || fail "no /dev/kvm after loading kvm_amd"

mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup || fail "mount cgroup2"
ip link set lo up || fail "bring up lo"
hostname microvm-l1

cwd=$(cat "$lane/cwd")
case "$cwd" in
  /tmp/*|/run/*)
    mkdir -p "$cwd"
    mount --bind "/mnt/microvm-host$cwd" "$cwd" || fail "bind the working directory $cwd"
    ;;
esac

if [ -s "$lane/writable" ]; then
  dir=$(cat "$lane/writable")
  mkdir -p "$dir"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 writable "$dir" || fail "mount $dir"
fi

kvm_params=$(cd /sys/module/kvm_amd/parameters && for p in nested vgif vnmi avic vls pause_filter_count; do
  [ -r "$p" ] && printf ' %s=%s' "$p" "$(cat "$p")"; done)
say "ready ($(uname -r), $(nproc) vCPU, $(awk '/MemTotal/ { printf "%d MiB", $2 / 1024 }' /proc/meminfo), kvm_amd$kvm_params)"
# The heartbeat: a counter written into the lane share every 5 s by this shell loop in L1's user
# space. The host (run-in-l1.sh) watches it: when it stops, L1 no longer runs its own processes
# (frozen, or its CPU held by a nested guest it never gets back), whatever the command was doing,
# and the host ends L1 from outside, since nothing inside it runs any more to do so.
(
  n=0
  while :; do
    n=$(( n + 1 ))
    echo "$n" > "$lane/heartbeat"
    sleep 5
  done
) &
heartbeat=$!
# PID 1 reaps every orphan (bash's SIGCHLD handling waits for any child) while the command runs.
bash "$lane/command" < /dev/null &
command_pid=$!
# The host kills L1 at its timeout; shortly before that, say what every process waits on and what
# the kernel said, then end the command, so a hang is diagnosed and still reported as a timeout.
deadline=$(cat "$lane/deadline")
(
  sleep "$deadline"
  say "the command is still running after ${deadline} s: processes and what they wait on:"
  ps -eo pid,ppid,stat,wchan:32,etime,args --forest >&2
  say "the end of the kernel log:"
  dmesg | tail -n 60 >&2
  echo timeout > "$lane/timed-out"
  kill -KILL "$command_pid"
) &
watchdog=$!
wait $command_pid
status=$?
kill "$watchdog" "$heartbeat" 2>/dev/null
[ -f "$lane/timed-out" ] && status=124
echo "$status" > "$lane/status"
dmesg > "$lane/dmesg" 2>/dev/null
[ -n "${dir:-}" ] && umount "$dir"
umount "$lane"
power_off
