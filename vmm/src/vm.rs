//! Building and starting a VM, step by step:
//!
//! 1. check the config;
//! 2. guest memory, the kernel and the initrd in it (mapped from their files where possible,
//!    [`crate::boot_files`]: before KVM or a device sees the memory), then the KVM VM (irqchip,
//!    PIT, memory slots);
//! 3. devices (serial, i8042, virtio, and a PCI root with VFIO devices);
//! 4. command line, boot information, MP table, page tables;
//! 5. vCPUs;
//! 6. the device event-loop thread, then one thread per vCPU, each installing its seccomp
//!    filter ([`crate::jail`]) before it touches guest data.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use vmm_devices::pci::PciRoot;
use vmm_devices::virtio::balloon::Balloon;
use vmm_devices::virtio::block::{Access, Block};
use vmm_devices::virtio::fs::VirtioFs;
use vmm_devices::virtio::net::{Net, Tap};
use vmm_devices::virtio::vsock::Vsock;

use crate::boot::{self, BootError};
use crate::config::{BlockBacking, BootProtocol, VmConfig};
use crate::cpuid::{filter_cpuid, offer_tsc_deadline};
use crate::devices::DeviceManager;
use crate::event_loop::{self, Control};
use crate::handle::{abort_start, new_running, HandleDevices, Running, Shared, VmHandle};
use crate::jail::{Needs, Role, ThreadFilter};
use crate::kick::install_kick_handler;
use crate::kvm_vm::KvmVm;
use crate::layout::{pci_intx_gsis, PCI_BAR_FIRST_SLOT};
use crate::memory::create_guest_memory;
use crate::page_sharing::{self, PageSharingConfig, VmSharing};
use crate::regs::{write_page_tables, EntryMode};
use crate::vcpu::Vcpu;
use crate::{mptable, VmmError};

/// The embedded VMM's entry point.
pub struct Vm;

impl Vm {
    /// Boots a VM from `cfg` and returns its handle once every vCPU thread runs.
    pub fn start(cfg: VmConfig) -> Result<VmHandle, VmmError> {
        Self::start_then(cfg, || Ok(()))
    }

    /// [`Vm::start`], calling `before_threads` once every host resource of the VM is open and
    /// every device built, and before any thread of the VM exists (so before anything reads
    /// guest data): a VMM in a process of its own jails the process there
    /// ([`crate::jail::split`]). Its error fails the start.
    pub fn start_then(
        mut cfg: VmConfig,
        before_threads: impl FnOnce() -> Result<(), VmmError>,
    ) -> Result<VmHandle, VmmError> {
        let started_at = Instant::now();
        cfg.validate()?;
        install_kick_handler()?;
        let mem_size = cfg.memory_mib << 20;
        let mem = create_guest_memory(mem_size).map_err(|e| VmmError::Memory(e.to_string()))?;
        // The boot files go in before KVM or any device sees guest memory: mapped from their
        // files, they replace pages of the RAM mapping (boot_files). Each is opened once (or is
        // the embedder's open file): page sharing reads the same files later.
        let kernel_name = cfg.kernel.name().to_path_buf();
        let kernel_err = |e: BootError| VmmError::Kernel {
            path: kernel_name.clone(),
            reason: e.to_string(),
        };
        let mut kernel_file = cfg
            .kernel
            .open()
            .map_err(|e| kernel_err(BootError::Open(e)))?;
        let kernel =
            boot::load_kernel(&mem, &mut kernel_file, cfg.boot_files).map_err(kernel_err)?;
        let (mode, entry) = match (cfg.boot_protocol, kernel.pvh_entry) {
            (BootProtocol::Pvh, Some(e)) | (BootProtocol::Auto, Some(e)) => (EntryMode::Pvh32, e),
            (BootProtocol::Pvh, None) => return Err(kernel_err(BootError::NoPvhEntry)),
            (BootProtocol::Linux64, _) | (BootProtocol::Auto, None) => {
                (EntryMode::Long64, kernel.entry)
            }
        };
        match &kernel.mapped {
            Some(stats) => log::debug!("kernel {}: {stats}", kernel_name.display()),
            None => log::debug!("kernel {}: copied by the ELF loader", kernel_name.display()),
        }
        let (initrd, initrd_file) = match &cfg.initrd {
            Some(boot_file) => {
                let name = boot_file.name();
                let initrd_err = |e: BootError| VmmError::Initrd {
                    path: name.to_path_buf(),
                    reason: e.to_string(),
                };
                let mut file = boot_file
                    .open()
                    .map_err(|e| initrd_err(BootError::Open(e)))?;
                let (placed, mapped) =
                    boot::load_initrd(&mem, mem_size, kernel.end, &mut file, cfg.boot_files)
                        .map_err(initrd_err)?;
                match mapped {
                    Some(stats) => log::debug!("initrd {}: {stats}", name.display()),
                    None => log::debug!("initrd {}: copied", name.display()),
                }
                (Some(placed), Some(file))
            }
            None => (None, None),
        };
        let vm = KvmVm::new(cfg.kvm.take())?;
        if usize::from(cfg.vcpus) > vm.max_vcpus() {
            return Err(VmmError::Config(format!(
                "{} vCPUs requested, this KVM allows at most {}",
                cfg.vcpus,
                vm.max_vcpus()
            )));
        }
        vm.register_memory(&mem)?;

        let shared = Arc::new(Shared::new()?);
        let mut devices = DeviceManager::new()?;
        devices.add_serial(&vm, cfg.serial.into_writer()?)?;
        let reset_evt = devices.add_i8042()?;
        devices.add_subscriber(Arc::new(Mutex::new(Control::new(
            shared.clone(),
            reset_evt,
        ))));
        if let Some(v) = &cfg.vsock {
            let dev = Vsock::new(u64::from(v.guest_cid), &v.uds_path)
                .map_err(|e| VmmError::Device(format!("vsock on {}: {e}", v.uds_path.display())))?;
            devices.attach_virtio_device(&vm, &mem, Arc::new(Mutex::new(dev)))?;
        }
        // The file server is opened after `before_threads` (the jail of a VMM process): it
        // opens its root and /proc/self/fd by path then, inside the process's root.
        let shared_fs = match &cfg.shared_fs {
            Some(fs) => {
                let dev = VirtioFs::without_backend(&fs.tag, &fs.host_dir)
                    .map_err(|e| VmmError::Device(format!("virtio-fs {:?}: {e}", fs.tag)))?;
                let dev = Arc::new(Mutex::new(dev));
                devices.attach_virtio_device(&vm, &mem, dev.clone())?;
                Some(dev)
            }
            None => None,
        };
        for (i, net) in std::mem::take(&mut cfg.nets).into_iter().enumerate() {
            let dev = Tap::new(net.tap)
                .map_err(Into::into)
                .and_then(|tap| Net::new(tap, net.mac, net.mtu))
                .map_err(|e| VmmError::Device(format!("virtio-net {i}: {e}")))?;
            log::debug!(
                "virtio-net {i}: tap {}, MAC {}, MTU {:?}",
                dev.backend().name(),
                vmm_devices::virtio::net::format_mac(&net.mac),
                net.mtu
            );
            devices.attach_virtio_device(&vm, &mem, Arc::new(Mutex::new(dev)))?;
        }
        let mut blocks = Vec::with_capacity(cfg.blocks.len());
        for (i, b) in std::mem::take(&mut cfg.blocks).into_iter().enumerate() {
            let access = if b.backing.read_only() {
                Access::ReadOnly
            } else {
                Access::ReadWrite
            };
            let file = match b.backing {
                BlockBacking::Empty { .. } => None,
                BlockBacking::File { file, .. } => Some(file),
            };
            let dev = Block::new(b.serial, file, access)
                .map_err(|e| VmmError::Device(format!("virtio-blk {i}: {e}")))?;
            log::debug!(
                "virtio-blk {i}: serial {:?}, {} sectors, {access:?}",
                dev.serial(),
                dev.capacity()
            );
            let dev = Arc::new(Mutex::new(dev));
            devices.attach_virtio_device(&vm, &mem, dev.clone())?;
            blocks.push(dev);
        }
        let balloon = match cfg.balloon {
            Some(b) => {
                let dev = Balloon::new(b.free_page_reporting)
                    .map_err(|e| VmmError::Device(format!("virtio-balloon: {e}")))?;
                let dev = Arc::new(Mutex::new(dev));
                devices.attach_virtio_device(&vm, &mem, dev.clone())?;
                Some(dev)
            }
            None => None,
        };

        // With a PCI root: the INTx pins routed to IOAPIC pins, for the MP table.
        let mut pci_irqs: Option<Vec<mptable::PciInterrupt>> = None;
        if !cfg.vfio.is_empty() {
            let intx_gsis = pci_intx_gsis(devices.virtio_device_count());
            let mut vfio = crate::vfio::VfioContext::new(&vm, PCI_BAR_FIRST_SLOT, intx_gsis)?;
            let mut root = PciRoot::new();
            let irqs = pci_irqs.insert(Vec::new());
            for v in &cfg.vfio {
                let dev = vfio.open_device(&v.sysfs_path, &mem, &vm)?;
                let intx = dev.intx_route();
                let slot = root
                    .add_device(Arc::new(Mutex::new(dev)))
                    .map_err(|e| VmmError::Device(e.to_string()))?;
                log::debug!("vfio {}: PCI 00:{slot:02x}.0", v.sysfs_path.display());
                if let Some((pin, gsi)) = intx {
                    irqs.push(mptable::PciInterrupt {
                        slot,
                        pin,
                        ioapic_pin: u8::try_from(gsi).unwrap_or(u8::MAX),
                    });
                }
            }
            devices.attach_pci(root)?;
        }

        let cmdline = boot::build_cmdline(&cfg.cmdline, &devices.cmdline_args)
            .map_err(|e| VmmError::Config(e.to_string()))?;
        let cmdline_text = cmdline
            .as_cstring()
            .map_err(|e| VmmError::Config(format!("kernel command line: {e}")))?
            .into_string()
            .unwrap_or_default();
        let cmdline_len =
            boot::write_cmdline(&mem, &cmdline).map_err(|e| VmmError::Memory(e.to_string()))?;
        let boot_info = match mode {
            EntryMode::Long64 => boot::write_linux_boot_info(&mem, mem_size, cmdline_len, initrd),
            EntryMode::Pvh32 => boot::write_pvh_boot_info(&mem, mem_size, initrd),
        }
        .map_err(|e| VmmError::Memory(e.to_string()))?;
        // Every virtio-mmio device is attached by now: none may share an INTx pin.
        if let Some(irqs) = &pci_irqs {
            let free: Vec<u32> = pci_intx_gsis(devices.virtio_device_count()).collect();
            if let Some(p) = irqs
                .iter()
                .find(|p| !free.contains(&u32::from(p.ioapic_pin)))
            {
                return Err(VmmError::Device(format!(
                    "PCI 00:{:02x}.0's INTx on IOAPIC pin {} clashes with a virtio-mmio device",
                    p.slot, p.ioapic_pin
                )));
            }
        }
        mptable::setup_mptable(&mem, cfg.vcpus, pci_irqs.as_deref())
            .map_err(|e| VmmError::Memory(e.to_string()))?;
        write_page_tables(&mem).map_err(|e| VmmError::Memory(e.to_string()))?;

        let mut cpuid = vm.supported_cpuid()?;
        offer_tsc_deadline(
            &mut cpuid,
            vm.kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer),
        );
        let vcpu0_cpuid = cpuid.clone();
        let pio = Arc::new(devices.pio.clone());
        let mmio = Arc::new(devices.mmio.clone());
        let mut vcpus = Vec::with_capacity(usize::from(cfg.vcpus));
        for id in 0..cfg.vcpus {
            let fd = vm
                .fd
                .create_vcpu(u64::from(id))
                .map_err(VmmError::kvm("KVM_CREATE_VCPU"))?;
            let vcpu = Vcpu::new(id, fd, pio.clone(), mmio.clone());
            vcpu.configure_common(&cpuid, cfg.vcpus)?;
            if id == 0 {
                vcpu.configure_boot(&mem, mode, entry, boot_info)?;
            }
            vcpus.push(vcpu);
        }

        let page_sharing = match &cfg.page_sharing {
            Some(config) => {
                let mut first = vcpu0_cpuid.clone();
                filter_cpuid(&mut first, 0, cfg.vcpus);
                Some(sharing_state(
                    SharingInputs {
                        kernel: BootFileRef {
                            file: &kernel_file,
                            name: &kernel_name,
                        },
                        initrd: initrd_file
                            .as_ref()
                            .zip(cfg.initrd.as_ref())
                            .map(|(file, b)| BootFileRef {
                                file,
                                name: b.name(),
                            }),
                        vcpus: cfg.vcpus,
                        cmdline: &cmdline_text,
                    },
                    config.clone(),
                    &first,
                )?)
            }
            None => None,
        };
        // The seccomp filters of the VM's threads (crate::jail), built here so that a thread
        // only installs its own before it touches guest data.
        let sharing_filter = match (&page_sharing, cfg.jail) {
            (Some(_), true) => Some(ThreadFilter::new(Role::PageSharing, Needs::default())?),
            _ => None,
        };
        let (vcpu_filter, loop_filter) = if cfg.jail {
            let needs = Needs {
                vfio: !cfg.vfio.is_empty(),
                shared_fs: cfg.shared_fs.is_some(),
            };
            (
                Some(ThreadFilter::new(Role::Vcpu, needs)?),
                Some(ThreadFilter::new(Role::DeviceLoop, needs)?),
            )
        } else {
            (None, None)
        };
        before_threads()?;
        if let Some(dev) = &shared_fs {
            let mut dev = dev.lock().unwrap_or_else(|p| p.into_inner());
            dev.open_backend()
                .map_err(|e| VmmError::Device(format!("virtio-fs {:?}: {e}", dev.tag())))?;
        }
        drop(shared_fs);
        let mut running = new_running();
        running.mem = Some(mem);
        // The buses (and through them every device) outlive the VM's threads: a device's last
        // reference must not drop on a confined thread (a vsock device removes its socket file
        // when dropped, which no confined thread may do). The handle keeps them; on a failed
        // start, `pio` and `mmio` here do until the threads are joined.
        let buses = vec![pio.clone(), mmio.clone()];
        let events = devices.events;
        let s = shared.clone();
        let serves_fs = cfg.shared_fs.is_some();
        match std::thread::Builder::new()
            .name("vmm-devices".into())
            .spawn(move || event_loop::run(events, s, loop_filter, serves_fs))
        {
            Ok(t) => running.event_thread = Some(t),
            Err(e) => {
                return Err(abort(
                    running,
                    vm,
                    &shared,
                    VmmError::io("spawn the device thread")(e),
                ))
            }
        }
        for vcpu in vcpus {
            let s = shared.clone();
            let name = format!("vmm-vcpu{}", vcpu.id);
            let filter = vcpu_filter.clone();
            match std::thread::Builder::new()
                .name(name)
                .spawn(move || vcpu.run(s, filter))
            {
                Ok(t) => running.vcpu_threads.push(t),
                Err(e) => {
                    return Err(abort(
                        running,
                        vm,
                        &shared,
                        VmmError::io("spawn a vCPU thread")(e),
                    ))
                }
            }
        }
        running.vm = Some(vm);
        let boot_time = started_at.elapsed();
        log::debug!(
            "VM started in {boot_time:?}: {} vCPUs, {} MiB, entry {mode:?} at {entry:#x}",
            cfg.vcpus,
            cfg.memory_mib
        );
        Ok(VmHandle {
            shared,
            running: Mutex::new(Some(running)),
            vsock_uds_path: cfg.vsock.map(|v| v.uds_path.into_boxed_path()),
            devices: Box::new(HandleDevices {
                blocks,
                balloon,
                page_sharing: page_sharing.map(Mutex::new),
                sharing_filter,
                keep_buses: std::sync::atomic::AtomicBool::new(false),
                buses: Mutex::new(buses),
            }),
            boot_time,
            started_at,
            vcpus: cfg.vcpus,
            memory_mib: cfg.memory_mib,
            cmdline: cmdline_text.into_boxed_str(),
            entry: mode,
        })
    }
}

/// A boot file the VM booted from: its open file and what names it in messages.
struct BootFileRef<'a> {
    file: &'a std::fs::File,
    name: &'a std::path::Path,
}

/// What page sharing keeps of the VM: the boot files (the open files the VM booted from, never
/// opened again by their paths), the kernel's text range, and the facts that decide how the
/// kernel patched its text.
struct SharingInputs<'a> {
    kernel: BootFileRef<'a>,
    initrd: Option<BootFileRef<'a>>,
    vcpus: u8,
    cmdline: &'a str,
}

fn sharing_state(
    cfg: SharingInputs<'_>,
    config: PageSharingConfig,
    cpuid: &kvm_bindings::CpuId,
) -> Result<VmSharing, VmmError> {
    let mut kernel = cfg.kernel.file.try_clone().map_err(|e| VmmError::Kernel {
        path: cfg.kernel.name.to_path_buf(),
        reason: format!("duplicate its descriptor: {e}"),
    })?;
    let text = page_sharing::kernel_text_range(&mut kernel);
    let initrd = match cfg.initrd {
        Some(r) => Some(r.file.try_clone().map_err(|e| VmmError::Initrd {
            path: r.name.to_path_buf(),
            reason: format!("duplicate its descriptor: {e}"),
        })?),
        None => None,
    };
    let mut cpuid_bytes = Vec::new();
    for e in cpuid.as_slice() {
        for v in [e.function, e.index, e.flags, e.eax, e.ebx, e.ecx, e.edx] {
            cpuid_bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    Ok(VmSharing {
        config,
        kernel,
        initrd,
        text,
        cmdline: cfg.cmdline.to_string(),
        vcpus: cfg.vcpus,
        cpuid: cpuid_bytes,
        index: None,
    })
}

fn abort(mut running: Running, vm: KvmVm, shared: &Shared, err: VmmError) -> VmmError {
    running.vm = Some(vm);
    abort_start(running, shared, err)
}
