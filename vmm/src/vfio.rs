//! VFIO passthrough of a host PCI device (bound to vfio-pci) to the guest, on our PCI root.
//!
//! The VMM opens the device's IOMMU group and a container (vfio-ioctls), DMA-maps all guest RAM
//! at its guest-physical addresses (so the device's DMA addresses are guest addresses), and
//! presents the device on bus 0:
//! - configuration space is the device's own (read and written through VFIO's config region,
//!   which vfio-pci itself filters), except the BARs, which are emulated: the VMM places them in
//!   the PCI window and the guest may size and move them; the expansion ROM (not offered), the
//!   capability list (hidden: no MSI/MSI-X yet) and the interrupt line/pin (the GSI the VMM
//!   routed the device's INTx pin to, and that pin); the emulated registers and the filter every
//!   guest write goes through are `vmm_devices::pci::PassthroughConfig` (fuzzed on its own);
//! - a BAR region that VFIO lets us mmap is mapped into the guest as a KVM memory slot while the
//!   guest has memory decoding on and the BAR lies in the PCI window (guest accesses then never
//!   leave the CPU); every other BAR (I/O, or not mmap-able) is trapped and forwarded with
//!   pread/pwrite on the device fd.
//!
//! - INTx (the legacy pin interrupt): VFIO signals an eventfd that is a KVM irqfd on the
//!   device's IOAPIC pin, with a resample eventfd that KVM signals when the guest EOIs the
//!   level-triggered interrupt and that VFIO takes as its unmask: the whole assert / mask / EOI /
//!   unmask cycle stays in the kernels, no VMM thread sees it. The guest learns the pin from the
//!   MP table (crate::mptable) and from the Interrupt Line register. MSI and MSI-X are not
//!   offered yet (see docs/vfio.md).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvm_bindings::{
    kvm_create_device, kvm_device_type_KVM_DEV_TYPE_VFIO, kvm_userspace_memory_region,
};
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX,
    VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioDeviceFd, VfioRegionInfoCap};
use vmm_devices::pci::{
    regs, Bar, BarKind, BarSpace, InterruptRegs, PassthroughConfig, PciDevice, BAR_COUNT,
};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

use crate::kvm_vm::KvmVm;
use crate::layout::{PCI_IO_END, PCI_IO_START, PCI_MMIO_END, PCI_MMIO_START};
use crate::memory::GuestMemory;

ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION,
    0xae,
    0x46,
    kvm_userspace_memory_region
);

/// Errors of setting up a passed-through device.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("create the KVM VFIO device: {0}")]
    KvmDevice(#[source] kvm_ioctls::Error),
    #[error("open the VFIO container /dev/vfio/vfio: {0}")]
    Container(#[source] vfio_ioctls::VfioError),
    #[error("open {}: {source}", path.display())]
    Device {
        path: PathBuf,
        #[source]
        source: vfio_ioctls::VfioError,
    },
    #[error("DMA-map guest memory for {}: {source}", path.display())]
    DmaMap {
        path: PathBuf,
        #[source]
        source: vfio_ioctls::VfioError,
    },
    #[error("{}: BAR {index}: {reason}", path.display())]
    Bar {
        path: PathBuf,
        index: usize,
        reason: String,
    },
    #[error("{}: the PCI window has no room for BAR {index} ({size:#x} bytes)", path.display())]
    NoRoom {
        path: PathBuf,
        index: usize,
        size: u64,
    },
    #[error("duplicate the VM fd: {0}")]
    DupVmFd(#[source] std::io::Error),
    #[error("mmap BAR {index} of {}: {source}", path.display())]
    Mmap {
        path: PathBuf,
        index: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: INTx pin {pin}: no IOAPIC pin is left (virtio-mmio devices and PCI INTx share GSIs 5-23)", path.display())]
    NoFreeGsi { path: PathBuf, pin: u8 },
    #[error("{}: INTx eventfd: {source}", path.display())]
    IntxEventFd {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: INTx on GSI {gsi}: KVM irqfd with resample: {source}", path.display())]
    IntxIrqfd {
        path: PathBuf,
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("{}: INTx: {step}: {source}", path.display())]
    IntxVfio {
        path: PathBuf,
        step: &'static str,
        #[source]
        source: vfio_ioctls::VfioError,
    },
}

/// One VFIO container for the VM: every passed-through group shares its IOMMU mappings (all of
/// guest RAM, mapped once).
pub struct VfioContext {
    container: Arc<VfioContainer>,
    /// A duplicate of the VM fd, for the memory slots of BARs (moved by guest writes).
    vm_fd: Arc<OwnedFd>,
    mem_mapped: bool,
    next_slot: u32,
    mmio_next: u64,
    io_next: u64,
    /// IOAPIC pins still free for INTx, next first.
    intx_gsis: std::vec::IntoIter<u32>,
}

impl VfioContext {
    /// Creates KVM's VFIO pseudo-device (so KVM knows DMA is coherent for the groups) and the
    /// container. BAR memory slots are numbered from `first_slot`; devices with an INTx pin take
    /// their IOAPIC pins from `intx_gsis`, in order (crate::layout::pci_intx_gsis).
    pub fn new(
        vm: &KvmVm,
        first_slot: u32,
        intx_gsis: impl IntoIterator<Item = u32>,
    ) -> Result<Self, VfioError> {
        let mut dev = kvm_create_device {
            type_: kvm_device_type_KVM_DEV_TYPE_VFIO,
            fd: 0,
            flags: 0,
        };
        let kvm_dev = vm
            .fd
            .create_device(&mut dev)
            .map_err(VfioError::KvmDevice)?;
        let handle = Arc::new(VfioDeviceFd::new_from_kvm(kvm_dev));
        let container = VfioContainer::new(Some(handle)).map_err(VfioError::Container)?;
        // SAFETY: F_DUPFD_CLOEXEC on the VM fd, which is open for the duration of this call,
        // returns a new fd (or -1) that nothing else owns.
        let fd = unsafe { libc::fcntl(vm.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(VfioError::DupVmFd(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor from fcntl above, owned by nobody else.
        let vm_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Self {
            container: Arc::new(container),
            vm_fd,
            mem_mapped: false,
            next_slot: first_slot,
            mmio_next: PCI_MMIO_START,
            io_next: PCI_IO_START,
            intx_gsis: intx_gsis.into_iter().collect::<Vec<_>>().into_iter(),
        })
    }

    /// Opens the device at `sysfs_path` (e.g. /sys/bus/pci/devices/0000:00:04.0), DMA-maps guest
    /// memory on the first device, places its BARs and routes its INTx pin (if it has one) to
    /// the next free IOAPIC pin of `vm`.
    pub fn open_device(
        &mut self,
        sysfs_path: &Path,
        mem: &GuestMemory,
        vm: &KvmVm,
    ) -> Result<VfioPciDevice, VfioError> {
        let path = sysfs_path.to_path_buf();
        let device = VfioDevice::new(sysfs_path, self.container.clone()).map_err(|source| {
            VfioError::Device {
                path: path.clone(),
                source,
            }
        })?;
        if !self.mem_mapped {
            // SAFETY: guest memory is mapped for the VM's whole life (the VM handle keeps it),
            // is already shared with the guest, and the VMM touches it only through vm-memory's
            // volatile accessors, never through Rust references that DMA could alias.
            unsafe { self.container.vfio_map_guest_memory(mem) }.map_err(|source| {
                VfioError::DmaMap {
                    path: path.clone(),
                    source,
                }
            })?;
            self.mem_mapped = true;
        }
        let mut dev = VfioPciDevice {
            path: path.clone(),
            device,
            config: PassthroughConfig::new(),
            maps: Default::default(),
            vm_fd: self.vm_fd.clone(),
            intx: None,
        };
        self.place_bars(&mut dev)?;
        // The guest starts from the device's own decode bits (vfio-pci usually leaves them off).
        let command = dev.read_device_config(regs::COMMAND / 4) as u16;
        dev.config.set_command(command);
        dev.update_slots();
        if let Some(pin) = dev.intx_pin() {
            let gsi = self.intx_gsis.next().ok_or_else(|| VfioError::NoFreeGsi {
                path: path.clone(),
                pin,
            })?;
            // intx_pin() gave 1..=4 and IOAPIC pins are below 24: this is Some.
            dev.config
                .set_interrupt(InterruptRegs::routed(pin, gsi).unwrap_or_else(InterruptRegs::none));
            dev.intx = Some(Intx::route(&dev.device, &path, vm, pin, gsi)?);
            log::debug!(
                "vfio {}: INT{} on IOAPIC pin {gsi}",
                path.display(),
                char::from(b'A' + pin - 1)
            );
        }
        Ok(dev)
    }

    fn place_bars(&mut self, dev: &mut VfioPciDevice) -> Result<(), VfioError> {
        let mut index = 0;
        while index < BAR_COUNT {
            let region = VFIO_PCI_BAR0_REGION_INDEX + index as u32;
            let size = dev.device.get_region_size(region);
            if size == 0 {
                index += 1;
                continue;
            }
            let kind = BarKind::from_register(dev.read_device_config(regs::BAR0 / 4 + index));
            let bar_err = |reason: String| VfioError::Bar {
                path: dev.path.clone(),
                index,
                reason,
            };
            if !size.is_power_of_two() {
                return Err(bar_err(format!("size {size:#x} is not a power of two")));
            }
            let (next, end) = match kind {
                BarKind::Io => (&mut self.io_next, PCI_IO_END),
                _ => (&mut self.mmio_next, PCI_MMIO_END),
            };
            let addr = next
                .checked_next_multiple_of(size)
                .filter(|a| a.checked_add(size).is_some_and(|e| e <= end))
                .ok_or_else(|| VfioError::NoRoom {
                    path: dev.path.clone(),
                    index,
                    size,
                })?;
            *next = addr + size;
            dev.config
                .set_bar(index, Bar { kind, size, addr })
                .map_err(|e| bar_err(e.to_string()))?;

            let flags = dev.device.get_region_flags(region);
            let sparse = dev
                .device
                .get_region_caps(region)
                .iter()
                .any(|c| matches!(c, VfioRegionInfoCap::SparseMmap(_)));
            if kind != BarKind::Io
                && flags & VFIO_REGION_INFO_FLAG_MMAP != 0
                && !sparse
                && size.is_multiple_of(page_size())
            {
                let mut prot = 0;
                if flags & VFIO_REGION_INFO_FLAG_READ != 0 {
                    prot |= libc::PROT_READ;
                }
                if flags & VFIO_REGION_INFO_FLAG_WRITE != 0 {
                    prot |= libc::PROT_WRITE;
                }
                let len = usize::try_from(size).map_err(|_| bar_err("too large".into()))?;
                let offset = libc::off_t::try_from(dev.device.get_region_offset(region))
                    .map_err(|_| bar_err("region offset out of range".into()))?;
                // SAFETY: a fresh shared mapping of the device fd at the region's offset, at an
                // address the kernel picks; the result is checked, and the mapping is owned by
                // BarMap, which unmaps it on drop.
                let ptr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        prot,
                        libc::MAP_SHARED,
                        dev.device.as_raw_fd(),
                        offset,
                    )
                };
                if ptr == libc::MAP_FAILED {
                    return Err(VfioError::Mmap {
                        path: dev.path.clone(),
                        index,
                        source: std::io::Error::last_os_error(),
                    });
                }
                dev.maps[index] = Some(BarMap {
                    host: ptr as u64,
                    len: size,
                    slot: self.next_slot,
                    mapped_at: None,
                });
                self.next_slot += 1;
            }
            log::debug!(
                "vfio {}: BAR {index} {kind:?} {size:#x} bytes at {addr:#x} ({})",
                dev.path.display(),
                if dev.maps[index].is_some() {
                    "mapped"
                } else {
                    "trapped"
                }
            );
            index += if matches!(kind, BarKind::Memory64 { .. }) {
                2
            } else {
                1
            };
        }
        Ok(())
    }
}

/// A device's INTx pin routed to an IOAPIC pin: VFIO signals `trigger` when the device asserts
/// it (and masks it), KVM's irqfd turns that into the level-triggered GSI; when the guest EOIs
/// it KVM lowers the line and signals `resample`, which VFIO takes as the unmask.
struct Intx {
    /// 1 = INTA# .. 4 = INTD#.
    pin: u8,
    gsi: u32,
    // Kept open for the VM's life: the kernels hold their own references, these make the
    // routing visible here and close after the device (fields of VfioPciDevice drop in order).
    _trigger: EventFd,
    _resample: EventFd,
}

impl Intx {
    fn route(
        device: &VfioDevice,
        path: &Path,
        vm: &KvmVm,
        pin: u8,
        gsi: u32,
    ) -> Result<Self, VfioError> {
        let evt = || {
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(|source| {
                VfioError::IntxEventFd {
                    path: path.to_path_buf(),
                    source,
                }
            })
        };
        let trigger = evt()?;
        let resample = evt()?;
        let vfio_err = |step| {
            move |source| VfioError::IntxVfio {
                path: path.to_path_buf(),
                step,
                source,
            }
        };
        // KVM first, so that an interrupt VFIO signals at once is not lost (the irqfd would pick
        // up a pending count anyway, as VFIO's unmask eventfd does).
        vm.register_irqfd_with_resample(&trigger, &resample, gsi)
            .map_err(|source| VfioError::IntxIrqfd {
                path: path.to_path_buf(),
                gsi,
                source,
            })?;
        device
            .enable_irq(VFIO_PCI_INTX_IRQ_INDEX, vec![&trigger])
            .map_err(vfio_err("VFIO_DEVICE_SET_IRQS trigger eventfd"))?;
        device
            .set_irq_resample_fd(VFIO_PCI_INTX_IRQ_INDEX, vec![&resample])
            .map_err(vfio_err("VFIO_DEVICE_SET_IRQS unmask eventfd"))?;
        Ok(Self {
            pin,
            gsi,
            _trigger: trigger,
            _resample: resample,
        })
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).unwrap_or(4096).max(4096)
}

/// A BAR region mmapped from the device, given to the guest as a memory slot while decoded.
struct BarMap {
    host: u64,
    len: u64,
    slot: u32,
    mapped_at: Option<u64>,
}

impl Drop for BarMap {
    fn drop(&mut self) {
        // SAFETY: `host`/`len` are the mapping made in place_bars, unmapped only here.
        unsafe { libc::munmap(self.host as *mut libc::c_void, self.len as usize) };
    }
}

/// A passed-through PCI device on our PCI root.
pub struct VfioPciDevice {
    path: PathBuf,
    // Fields drop in order: the BAR mappings go before the device (and its group) is released.
    maps: [Option<BarMap>; BAR_COUNT],
    device: VfioDevice,
    /// The emulated registers (BARs, command, interrupt line/pin) and the filter of the guest's
    /// writes (vmm_devices::pci::PassthroughConfig).
    config: PassthroughConfig,
    vm_fd: Arc<OwnedFd>,
    /// The INTx routing, when the device has a pin.
    intx: Option<Intx>,
}

impl VfioPciDevice {
    /// The device's INTx pin (1..=4) when VFIO offers its INTx (one interrupt at the INTx index;
    /// vfio-pci reports none when the pin is 0 or INTx is unusable) and the pin register names
    /// one.
    fn intx_pin(&self) -> Option<u8> {
        let info = self.device.get_irq_info(VFIO_PCI_INTX_IRQ_INDEX)?;
        let pin = pin_from_dword(self.read_device_config(regs::INTERRUPT_LINE / 4));
        (info.count == 1 && (1..=4).contains(&pin)).then_some(pin)
    }

    /// Where the device's INTx goes: its pin (1 = INTA#) and the IOAPIC pin (GSI).
    pub fn intx_route(&self) -> Option<(u8, u32)> {
        self.intx.as_ref().map(|i| (i.pin, i.gsi))
    }

    /// The device's own config dword `reg`.
    fn read_device_config(&self, reg: usize) -> u32 {
        let mut b = [0xffu8; 4];
        self.device
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, &mut b, (reg * 4) as u64);
        u32::from_le_bytes(b)
    }

    /// Puts each mmapped BAR's memory slot where the guest's BAR and command register say it
    /// should be: at its address when memory decoding is on and the BAR lies inside the PCI
    /// window, nowhere otherwise (a BAR being sized holds all ones, for instance).
    fn update_slots(&mut self) {
        for index in 0..BAR_COUNT {
            let Some(bar) = self.config.bars().get(index) else {
                continue;
            };
            let want = (self.config.decodes(bar.kind)
                && bar.addr >= PCI_MMIO_START
                && bar
                    .addr
                    .checked_add(bar.size)
                    .is_some_and(|e| e <= PCI_MMIO_END))
            .then_some(bar.addr);
            let fd = self.vm_fd.clone();
            let Some(map) = self.maps[index].as_mut() else {
                continue;
            };
            if map.mapped_at == want {
                continue;
            }
            if map.mapped_at.is_some() {
                if let Err(e) = set_slot(&fd, map.slot, 0, 0, 0) {
                    log::warn!("vfio {}: unmap BAR {index}: {e}", self.path.display());
                    continue;
                }
                map.mapped_at = None;
            }
            if let Some(gpa) = want {
                match set_slot(&fd, map.slot, gpa, map.len, map.host) {
                    Ok(()) => map.mapped_at = Some(gpa),
                    Err(e) => log::warn!(
                        "vfio {}: map BAR {index} at {gpa:#x}: {e}",
                        self.path.display()
                    ),
                }
            }
        }
    }
}

/// KVM_SET_USER_MEMORY_REGION on the duplicated VM fd (size 0 deletes the slot).
fn set_slot(fd: &OwnedFd, slot: u32, gpa: u64, size: u64, host: u64) -> std::io::Result<()> {
    let region = kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: gpa,
        memory_size: size,
        userspace_addr: host,
    };
    // SAFETY: the ioctl only reads `region`. `host..host + size` is a live mapping owned by a
    // BarMap of the same device; the slot goes when the VM fd closes at teardown, and KVM keeps
    // no reference to the pages once the mapping is gone (its MMU notifier drops them).
    let ret = unsafe { ioctl_with_ref(fd, KVM_SET_USER_MEMORY_REGION(), &region) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl PciDevice for VfioPciDevice {
    fn config_read(&mut self, reg: usize) -> u32 {
        self.config.read(reg, |r| self.read_device_config(r))
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        let action = self.config.write(offset, data);
        if action.forward {
            self.device
                .region_write(VFIO_PCI_CONFIG_REGION_INDEX, data, offset as u64);
        }
        if action.remap {
            self.update_slots();
        }
    }

    fn bar_read(&mut self, space: BarSpace, addr: u64, data: &mut [u8]) -> bool {
        let Some((index, offset)) = self.config.find_bar(space, addr, data.len()) else {
            return false;
        };
        data.fill(0xff);
        self.device
            .region_read(VFIO_PCI_BAR0_REGION_INDEX + index as u32, data, offset);
        true
    }

    fn bar_write(&mut self, space: BarSpace, addr: u64, data: &[u8]) -> bool {
        let Some((index, offset)) = self.config.find_bar(space, addr, data.len()) else {
            return false;
        };
        self.device
            .region_write(VFIO_PCI_BAR0_REGION_INDEX + index as u32, data, offset);
        true
    }
}

/// The Interrupt Pin byte of the dword at 0x3c.
fn pin_from_dword(value: u32) -> u8 {
    (value >> 8) as u8
}
