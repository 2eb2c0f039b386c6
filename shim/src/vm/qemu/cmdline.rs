//! QEMU's command line and the guest kernel's: the `-M microvm` machine, its devices, and the
//! timing words the kernel needs there (its TSC rate, measured on the host).

use std::fs;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::OnceLock;
use std::thread;
use std::time::Duration;

use super::process::VmPaths;
use super::{disk_fd, Accel, QemuConfig, CONSOLE_FD, DEFAULT_HZ, NIC_FD_BASE};

/// `console=ttyS0 reboot=t panic=-1 tsc_early_khz=… lpj=…` plus the caller's extra.
///
/// `-M microvm` has no timer the kernel can calibrate the TSC against, so the TSC frequency is
/// given: under TCG and KVM the guest's TSC ticks at the host's TSC rate, measured here once.
/// `lpj` (loops per jiffy; the delay loop uses the TSC) = TSC Hz / CONFIG_HZ skips the slow
/// delay-loop calibration. `reboot=t`: a guest reboot triple-faults, and `-no-reboot` makes QEMU
/// exit. `panic=-1`: a panic reboots at once, so QEMU exits instead of hanging.
pub(super) fn kernel_cmdline(cfg: &QemuConfig) -> String {
    let tsc_khz = host_tsc_khz();
    let hz = kernel_hz(&cfg.kernel).unwrap_or(DEFAULT_HZ);
    let lpj = tsc_khz.saturating_mul(1000) / hz.max(1);
    let mut cmdline = format!("console=ttyS0 reboot=t panic=-1 tsc_early_khz={tsc_khz} lpj={lpj}");
    let extra = cfg.cmdline_extra.trim();
    if !extra.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    cmdline
}

pub(super) fn qemu_args(cfg: &QemuConfig, paths: &VmPaths, cmdline: &str) -> Vec<String> {
    let mem = format!("{}M", cfg.memory_mib);
    let mut args: Vec<String> = Vec::new();
    let mut push = |a: &[&str]| args.extend(a.iter().map(|s| s.to_string()));
    // acpi=off: our kernel has no ACPI; QEMU then puts the virtio-mmio devices on the kernel
    // command line (auto-kernel-cmdline) and its firmware (qboot) writes an MP table listing
    // every vCPU. The guest RAM is a shared memfd so vhost-device-vsock can map it.
    // force-legacy=false: QEMU's virtio-mmio defaults to the legacy (0.9) transport, which
    // libvhost-user (virtiofsd) refuses with a panic at the first request; our kernel and
    // vhost-device-vsock speak virtio 1.x.
    push(&[
        "-M",
        "microvm,acpi=off,memory-backend=mem",
        "-global",
        "virtio-mmio.force-legacy=false",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
    ]);
    match cfg.accel.resolve() {
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        _ => push(&["-accel", "tcg"]),
    }
    // Confined before the guest runs: the seccomp filter from the start, then, once QEMU has
    // opened everything on this command line (kernel, initrd, /dev/kvm, the vhost-user
    // sockets, the memfd), chroot into an empty folder and the jail id (QEMU's os_setup_post).
    let runas = format!("{}:{}", cfg.jail_id, cfg.jail_id);
    let chroot = paths.jail_root.display().to_string();
    push(&[
        "-sandbox",
        super::QEMU_SANDBOX,
        "-runas",
        &runas,
        "-chroot",
        &chroot,
    ]);
    let smp = cfg.vcpus.to_string();
    let memfd = format!("memory-backend-memfd,id=mem,size={mem},share=on");
    let chardev = format!(
        "socket,id=vsock,path={}",
        qemu_opt_escape(&paths.vhost_socket)
    );
    // The serial goes to a socket whose other end the shim reads into a bounded log
    // (process.rs `ConsolePump`): a `file:` chardev would grow without bound.
    let console = format!("socket,id=console,fd={CONSOLE_FD}");
    let kernel = cfg.kernel.display().to_string();
    let initrd = cfg.initrd.display().to_string();
    push(&[
        "-m",
        &mem,
        "-smp",
        &smp,
        "-object",
        &memfd,
        "-chardev",
        &chardev,
        "-device",
        "vhost-user-vsock-device,chardev=vsock",
    ]);
    if let Some(shared) = &cfg.shared_fs {
        let chardev = format!(
            "socket,id=fs0,path={}",
            qemu_opt_escape(&paths.virtiofs_socket)
        );
        let device = format!("vhost-user-fs-device,chardev=fs0,tag={}", shared.tag);
        push(&["-chardev", &chardev, "-device", &device]);
    }
    for (i, nic) in cfg.nics.iter().enumerate() {
        // vhost=off: the kernel's vhost-net would be one more host surface for the guest.
        let netdev = format!("tap,id=net{i},fd={},vhost=off", NIC_FD_BASE + i as RawFd);
        let device = format!(
            "virtio-net-device,netdev=net{i},mac={},host_mtu={}",
            mac_string(&nic.mac),
            nic.mtu
        );
        push(&["-netdev", &netdev, "-device", &device]);
    }
    for (i, disk) in cfg.disks.iter().enumerate() {
        // The shim opened the node; QEMU dups the passed fd (same access mode) instead of
        // opening a host path. host_device for a block device, file for a regular file.
        let is_block = disk
            .file
            .metadata()
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()));
        let driver = if is_block { "host_device" } else { "file" };
        let add_fd = format!("fd={},set={}", disk_fd(i), i + 1);
        let ro = if disk.read_only { "on" } else { "off" };
        let blockdev = format!(
            "driver={driver},node-name=disk{i},filename=/dev/fdset/{},read-only={ro}",
            i + 1
        );
        let device = format!("virtio-blk-device,drive=disk{i},serial={}", disk.serial);
        push(&[
            "-add-fd",
            &add_fd,
            "-blockdev",
            &blockdev,
            "-device",
            &device,
        ]);
    }
    if cfg.free_page_reporting {
        // After the disks, as in the embedded VMM. QEMU punches the reported ranges out of the
        // memfd (fallocate), so vhost-device-vsock's and virtiofsd's views drop them too.
        push(&["-device", "virtio-balloon-device,free-page-reporting=on"]);
    }
    push(&[
        "-chardev",
        &console,
        "-serial",
        "chardev:console",
        "-kernel",
        &kernel,
        "-initrd",
        &initrd,
        "-append",
        cmdline,
    ]);
    args
}

/// `aa:bb:cc:dd:ee:ff`.
fn mac_string(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// QEMU option values escape a comma by doubling it.
pub(super) fn qemu_opt_escape(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// The host's TSC frequency in kHz, measured once per process against CLOCK_MONOTONIC_RAW.
pub fn host_tsc_khz() -> u64 {
    static TSC_KHZ: OnceLock<u64> = OnceLock::new();
    *TSC_KHZ.get_or_init(measure_tsc_khz)
}

fn measure_tsc_khz() -> u64 {
    // Three 20 ms windows; the largest estimate is the one least disturbed by preemption
    // between reading the clock and the TSC (a preemption there shortens the TSC delta).
    (0..3)
        .map(|_| {
            let (t0, c0) = clock_and_tsc();
            thread::sleep(Duration::from_millis(20));
            let (t1, c1) = clock_and_tsc();
            let ns = t1.saturating_sub(t0).max(1);
            // cycles * 10^6 / ns = kHz
            (u128::from(c1.wrapping_sub(c0)) * 1_000_000 / u128::from(ns)) as u64
        })
        .max()
        .unwrap_or(1_000_000)
}

fn clock_and_tsc() -> (u64, u64) {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into the timespec we own; CLOCK_MONOTONIC_RAW exists
    // on every Linux since 2.6.28.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_RAW, &mut ts) };
    // SAFETY: rdtsc has no memory effects and exists on every x86_64 CPU.
    let tsc = unsafe { core::arch::x86_64::_rdtsc() };
    let ns = (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64);
    (ns, tsc)
}

/// `CONFIG_HZ` from the kernel config kept beside the kernel (`config`, as kernel-config/build.sh
/// stores it; build/vmlinux is a link into that cache folder).
pub(super) fn kernel_hz(kernel: &Path) -> Option<u64> {
    let real = fs::canonicalize(kernel).ok()?;
    let config = fs::read_to_string(real.parent()?.join("config")).ok()?;
    config
        .lines()
        .find_map(|l| l.strip_prefix("CONFIG_HZ="))
        .and_then(|v| v.trim().parse().ok())
        .filter(|hz: &u64| *hz > 0)
}
