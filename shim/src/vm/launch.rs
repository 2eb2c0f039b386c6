//! A [`GuestSpec`] turned into each backend's config and started: the embedded VMM in this
//! process or in a jailed process of its own, or QEMU. Each start gives the running [`Vm`] and
//! one line on how the guest runs.

use std::os::fd::AsFd;
use std::path::Path;

use super::console::CONSOLE_LOG_BYTES;
use super::error::GuestVmError;
use super::process;
use super::qemu::{Accel, QemuConfig, QemuDisk, QemuNic, QemuSharedFs, QemuVm};
use super::running::Vm;
use super::spec::{DiskBacking, GuestSpec, GUEST_CID};

/// The kernel command line our Linux guest gets under the embedded VMM (the VMM appends its
/// virtio-mmio devices). `reboot=k` makes the guest's reboot go through the i8042, which ends
/// the VM cleanly. `no_timer_check` skips the kernel's boot-time check that the IO-APIC delivers
/// timer interrupts within a few ticks: on a starved host CPU (an overcommitted node; software
/// emulation on a busy test host) the check can miss those ticks and the guest panics with
/// `IO-APIC + timer doesn't work!` (seen on the QEMU backend under TCG in a loaded CI run),
/// although the VMM's timer works; the same on both backends.
pub const KVM_GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet no_timer_check";

/// The embedded VMM in this process: the spec as a `vmm::VmConfig`.
pub(super) fn start_kvm(
    spec: &GuestSpec,
    console_log: &Path,
    uds: &Path,
) -> Result<(Vm, String), GuestVmError> {
    let mut cfg = vmm::VmConfig::new(&spec.kernel);
    cfg.vcpus = spec.vcpus;
    cfg.memory_mib = spec.memory_mib;
    cfg.initrd = Some(spec.initrd.clone().into());
    cfg.boot_files = spec.boot_files;
    cfg.cmdline = format!("{KVM_GUEST_CMDLINE} {}", spec.cmdline_extra())
        .trim_end()
        .to_string();
    cfg.serial = vmm::SerialSink::File {
        path: console_log.to_path_buf(),
        max_bytes: CONSOLE_LOG_BYTES,
    };
    cfg.vsock = Some(vmm::VsockConfig {
        guest_cid: GUEST_CID,
        uds_path: uds.to_path_buf(),
    });
    cfg.shared_fs = spec.shared.as_ref().map(|s| vmm::SharedFsConfig {
        tag: s.tag.clone(),
        host_dir: s.host_dir.clone(),
    });
    for nic in &spec.nics {
        let tap = nic
            .tap
            .as_fd()
            .try_clone_to_owned()
            .map_err(GuestVmError::Tap)?;
        cfg.nets.push(vmm::NetConfig {
            tap,
            mac: nic.mac,
            mtu: Some(nic.mtu),
        });
    }
    // Host PCI devices (bound to vfio-pci) the pod holds, on the VM's PCI root
    // (docs/vfio.md); the VMM opens their IOMMU groups.
    cfg.vfio = spec
        .vfio
        .iter()
        .map(|sysfs_path| vmm::VfioConfig {
            sysfs_path: sysfs_path.clone(),
        })
        .collect();
    cfg.page_sharing = spec.page_sharing_config();
    cfg.balloon = spec.wants_balloon().then_some(vmm::BalloonConfig {
        free_page_reporting: true,
    });
    for d in &spec.disks {
        let backing = match &d.backing {
            DiskBacking::Empty { read_only } => vmm::BlockBacking::Empty {
                read_only: *read_only,
            },
            DiskBacking::File { file, read_only } => vmm::BlockBacking::File {
                file: file.try_clone().map_err(GuestVmError::Disk)?,
                read_only: *read_only,
            },
        };
        cfg.blocks.push(vmm::BlockConfig {
            serial: d.serial.clone(),
            backing,
        });
    }
    let handle = vmm::Vm::start(cfg)?;
    let detail = format!("embedded vmm on /dev/kvm, {} entry", handle.boot_entry());
    Ok((Vm::Embedded(handle), detail))
}

/// The embedded VMM in a jailed process of its own ([`process`]).
pub(super) fn start_kvm_process(
    spec: &GuestSpec,
    console_log: &Path,
    uds: &Path,
) -> Result<(Vm, String), GuestVmError> {
    let cmdline = format!("{KVM_GUEST_CMDLINE} {}", spec.cmdline_extra())
        .trim_end()
        .to_string();
    let p = process::start(spec, cmdline, console_log, uds)?;
    let detail = format!("{} (pid {})", p.detail(), p.pid());
    Ok((Vm::Process(Box::new(std::sync::Mutex::new(p))), detail))
}

/// QEMU: the spec as a [`QemuConfig`], on the accelerator the spec carries (the one
/// `vm::backend` chose: nothing here probes the host).
pub(super) fn start_qemu(
    spec: &GuestSpec,
    console_log: &Path,
) -> Result<(Vm, String), GuestVmError> {
    let memory_mib =
        u32::try_from(spec.memory_mib).map_err(|_| GuestVmError::Memory(spec.memory_mib))?;
    let mut cfg = QemuConfig::new(
        &spec.kernel,
        &spec.initrd,
        &spec.qemu.vhost_vsock,
        &spec.work_dir,
    );
    cfg.qemu_binary = spec.qemu.qemu.clone();
    cfg.virtiofsd_binary = spec.qemu.virtiofsd.clone();
    cfg.vcpus = u32::from(spec.vcpus);
    cfg.memory_mib = memory_mib;
    cfg.guest_cid = GUEST_CID;
    cfg.accel = spec.qemu.accel;
    cfg.jail_id = spec.qemu.jail_id;
    cfg.console_log = Some(console_log.to_path_buf());
    cfg.console_log_bytes = CONSOLE_LOG_BYTES;
    cfg.cmdline_extra = spec.cmdline_extra();
    cfg.shared_fs = spec.shared.as_ref().map(|s| QemuSharedFs {
        tag: s.tag.clone(),
        host_dir: s.host_dir.clone(),
    });
    if !spec.vfio.is_empty() {
        return Err(GuestVmError::Unsupported(
            "VFIO devices on the QEMU backend",
        ));
    }
    cfg.free_page_reporting = spec.wants_balloon();
    cfg.disks = spec
        .disks
        .iter()
        .map(|d| match &d.backing {
            DiskBacking::File { file, read_only } => Ok(QemuDisk {
                serial: d.serial.clone(),
                file: file.clone(),
                read_only: *read_only,
            }),
            DiskBacking::Empty { .. } => Err(GuestVmError::Unsupported(
                "empty block slots on the QEMU backend (it cannot hot-plug)",
            )),
        })
        .collect::<Result<_, _>>()?;
    cfg.nics = spec
        .nics
        .iter()
        .map(|n| QemuNic {
            tap: n.tap.clone(),
            mac: n.mac,
            mtu: n.mtu,
        })
        .collect();
    let accel = match cfg.accel {
        Accel::Kvm => "KVM",
        Accel::Tcg => "TCG (software emulation)",
    };
    let vm = QemuVm::start(cfg)?;
    let detail = format!("qemu -M microvm, {accel}");
    Ok((Vm::Qemu(Box::new(vm)), detail))
}
