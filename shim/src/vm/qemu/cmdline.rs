//! QEMU's command line and the guest kernel's: the `-M microvm` machine, its devices, and the
//! timing words the kernel needs there (its TSC rate, measured on the host).

use std::fs;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::OnceLock;
use std::thread;
use std::time::Duration;

use super::config::{disk_fd, Accel, QemuConfig, CONSOLE_FD, NIC_FD_BASE};
use super::paths::VmPaths;

/// The kernel's default `CONFIG_HZ` (Kconfig `HZ_250`), used when the kernel's config is not
/// found beside it.
const DEFAULT_HZ: u64 = 250;

/// The bound of QEMU's TCG translation cache, in MiB (`-accel tcg,tb-size=`): all of it
/// counts in the pod's host memory (docs/overhead.md); when full, QEMU flushes it and
/// translates again, which costs time, not memory.
pub const TCG_TB_SIZE_MIB: u32 = 64;

/// QEMU's seccomp filter (`-sandbox`): the obsolete system calls, spawning processes and
/// changing scheduling or resource limits are refused. `elevateprivileges=deny` is left out: it
/// also refuses the set*id calls of QEMU's own `-runas`, which kill QEMU (SIGSYS) at its drop to
/// the jail id; after that drop QEMU has no capability, every uid and gid it holds is the jail
/// id and `no_new_privs` is set, so a set*id call can gain nothing.
pub const QEMU_SANDBOX: &str = "on,obsolete=deny,spawn=deny,resourcecontrol=deny";

/// `console=ttyS0 reboot=t panic=-1 tsc_early_khz=… lpj=… no_timer_check` plus the caller's
/// extra.
///
/// `-M microvm` has no timer the kernel can calibrate the TSC against, so the TSC frequency is
/// given: under TCG and KVM the guest's TSC ticks at the host's TSC rate, measured here once.
/// `lpj` (loops per jiffy; the delay loop uses the TSC) = TSC Hz / CONFIG_HZ skips the slow
/// delay-loop calibration. `reboot=t`: a guest reboot triple-faults, and `-no-reboot` makes QEMU
/// exit. `panic=-1`: a panic reboots at once, so QEMU exits instead of hanging.
/// `no_timer_check`: see [`crate::vm::KVM_GUEST_CMDLINE`].
pub(super) fn kernel_cmdline(cfg: &QemuConfig) -> String {
    let tsc_khz = host_tsc_khz();
    let hz = kernel_hz(&cfg.kernel).unwrap_or(DEFAULT_HZ);
    let lpj = tsc_khz.saturating_mul(1000) / hz.max(1);
    let mut cmdline =
        format!("console=ttyS0 reboot=t panic=-1 tsc_early_khz={tsc_khz} lpj={lpj} no_timer_check");
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
    match cfg.accel {
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        // TCG's translation cache is bounded: QEMU's default (1 GiB) grows with the code the
        // guest runs and is charged to the pod's host cgroup, where over a long life it would
        // outgrow the overhead and have the host's OOM killer end the VM.
        Accel::Tcg => push(&["-accel", &format!("tcg,tb-size={TCG_TB_SIZE_MIB}")]),
    }
    // Confined before the guest runs: the seccomp filter from the start, then, once QEMU has
    // opened everything on this command line (kernel, initrd, /dev/kvm, the vhost-user
    // sockets, the memfd), chroot into an empty folder and the jail id (QEMU's os_setup_post).
    let runas = format!("{}:{}", cfg.jail_id, cfg.jail_id);
    let chroot = paths.jail_root.display().to_string();
    push(&[
        "-sandbox",
        QEMU_SANDBOX,
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

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::config::{QemuDisk, QemuSharedFs, MAX_NICS};
    use super::*;
    use crate::vm::qemu::test_support::{cfg_in, temp_dir};

    #[test]
    fn cmdline_has_timing_and_extra() {
        let d_tmp = temp_dir("cmdline");
        let d = d_tmp.path().to_path_buf();
        let mut c = cfg_in(&d);
        c.cmdline_extra = " quiet ".into();
        let line = kernel_cmdline(&c);
        assert!(line.starts_with("console=ttyS0 reboot=t panic=-1 tsc_early_khz="));
        assert!(line.ends_with(" quiet"), "{line}");
        let khz = host_tsc_khz();
        assert!(
            (100_000..20_000_000).contains(&khz),
            "implausible TSC {khz} kHz"
        );
    }

    #[test]
    fn reads_hz_beside_the_kernel() {
        let d_tmp = temp_dir("hz");
        let d = d_tmp.path().to_path_buf();
        fs::write(d.join("vmlinux"), b"x").unwrap();
        fs::write(d.join("config"), "CONFIG_X=y\nCONFIG_HZ=100\n").unwrap();
        assert_eq!(kernel_hz(&d.join("vmlinux")), Some(100));
        fs::remove_file(d.join("config")).unwrap();
        assert_eq!(kernel_hz(&d.join("vmlinux")), None);
    }

    #[test]
    fn disks_are_passed_as_fds_with_their_serial_and_mode() {
        let dir_tmp = temp_dir("disks");
        let dir = dir_tmp.path().to_path_buf();
        let mut cfg = cfg_in(&dir);
        let file = |name: &str| {
            let p = dir.join(name);
            fs::write(&p, [0u8; 512]).unwrap();
            std::sync::Arc::new(fs::File::open(&p).unwrap())
        };
        cfg.disks = vec![
            QemuDisk {
                serial: "microvm-cold0".into(),
                file: file("a.img"),
                read_only: false,
            },
            QemuDisk {
                serial: "microvm-cold1".into(),
                file: file("b.img"),
                read_only: true,
            },
        ];
        cfg.validate().unwrap();
        let paths = VmPaths::new(&cfg).unwrap();
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        let (fd0, fd1) = (disk_fd(0), disk_fd(1));
        assert!(
            args.contains(&format!(
                "-add-fd fd={fd0},set=1 -blockdev driver=file,node-name=disk0,\
                 filename=/dev/fdset/1,read-only=off -device \
                 virtio-blk-device,drive=disk0,serial=microvm-cold0"
            )),
            "{args}"
        );
        assert!(args.contains(&format!("-add-fd fd={fd1},set=2")), "{args}");
        assert!(
            args.contains("filename=/dev/fdset/2,read-only=on"),
            "{args}"
        );
        assert!(fd0 >= NIC_FD_BASE + MAX_NICS as std::os::fd::RawFd);
        for bad in ["", "a,b", "x=y", &"s".repeat(21)] {
            cfg.disks[0].serial = bad.to_string();
            assert!(cfg.validate().is_err(), "{bad:?}");
        }
        paths.remove_all();
    }

    #[test]
    fn free_page_reporting_adds_the_balloon_after_the_disks() {
        let dir_tmp = temp_dir("balloon");
        let dir = dir_tmp.path().to_path_buf();
        let mut cfg = cfg_in(&dir);
        cfg.validate().unwrap();
        let paths = VmPaths::new(&cfg).unwrap();
        let balloon = "-device virtio-balloon-device,free-page-reporting=on";
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        assert!(!args.contains("virtio-balloon"), "{args}");
        cfg.free_page_reporting = true;
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        assert!(args.contains(balloon), "{args}");
        assert!(
            args.find(balloon) < args.find("-serial"),
            "before the console and kernel: {args}"
        );
        paths.remove_all();
    }

    #[test]
    fn commas_in_paths_are_escaped() {
        assert_eq!(qemu_opt_escape(Path::new("/a,b/s")), "/a,,b/s");
    }

    #[test]
    fn shared_fs_adds_the_vhost_user_fs_device_and_checks_its_tag() {
        let dir_tmp = temp_dir("shared-fs");
        let dir = dir_tmp.path().to_path_buf();
        let mut cfg = cfg_in(&dir);
        cfg.shared_fs = Some(QemuSharedFs {
            tag: "microvm-shared".into(),
            host_dir: dir.clone(),
        });
        cfg.validate().unwrap();
        let paths = VmPaths::new(&cfg).unwrap();
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        assert!(
            args.contains("-device vhost-user-fs-device,chardev=fs0,tag=microvm-shared"),
            "{args}"
        );
        assert!(args.contains("virtiofsd.sock"), "{args}");
        for bad in ["", "a,b", &"t".repeat(37)] {
            cfg.shared_fs.as_mut().unwrap().tag = bad.to_string();
            assert!(cfg.validate().is_err(), "{bad:?}");
        }
        cfg.shared_fs = Some(QemuSharedFs {
            tag: "t".into(),
            host_dir: dir.join("missing"),
        });
        assert!(cfg.validate().is_err());
        paths.remove_all();
    }
}
