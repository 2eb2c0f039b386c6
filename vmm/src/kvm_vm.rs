//! The KVM VM: the VM fd with its in-kernel interrupt controllers and PIT, guest memory slots,
//! and irqfd / ioeventfd registration for devices.

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES,
    KVM_PIT_SPEAKER_DUMMY,
};
use std::os::fd::{AsFd, BorrowedFd, IntoRawFd, OwnedFd};

use kvm_ioctls::{IoEventAddress, Kvm, NoDatamatch, VmFd};
use vm_memory::{GuestMemory as _, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::layout::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS};
use crate::memory::GuestMemory;
use crate::VmmError;

/// Where the VMM opens KVM when the embedder gives no descriptor.
pub const KVM_PATH: &str = "/dev/kvm";
/// `/dev/kvm`'s device number: misc (major 10), `KVM_MINOR` 232 (linux/miscdevice.h).
const KVM_MAJOR: u32 = 10;
const KVM_MINOR: u32 = 232;
/// `KVM_GET_API_VERSION`'s only answer since Linux 2.6.22.
const KVM_API_VERSION: i32 = 12;

/// Opens `/dev/kvm` read-write, close-on-exec, for an embedder that hands the VM its KVM
/// ([`crate::VmConfig::kvm`], a VMM process's description).
pub fn open_kvm() -> Result<OwnedFd, VmmError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(KVM_PATH)
        .map_err(VmmError::io(format!("open {KVM_PATH}")))?;
    let fd = OwnedFd::from(file);
    check_kvm_device(fd.as_fd())?;
    Ok(fd)
}

/// Whether `fd` is KVM's device (character device 10:232), as a descriptor the embedder gave
/// must be before a KVM ioctl is made on it.
pub(crate) fn check_kvm_device(fd: BorrowedFd<'_>) -> Result<(), VmmError> {
    let st =
        rustix::fs::fstat(fd).map_err(|e| VmmError::io("stat the KVM descriptor")(e.into()))?;
    let char_device =
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::CharacterDevice;
    let (major, minor) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
    if !char_device || (major, minor) != (KVM_MAJOR, KVM_MINOR) {
        return Err(VmmError::Config(format!(
            "the KVM descriptor is not {KVM_PATH} (a {} {major}:{minor}, not the character \
             device {KVM_MAJOR}:{KVM_MINOR})",
            if char_device {
                "character device"
            } else {
                "file or device"
            }
        )));
    }
    Ok(())
}

/// The KVM system handle of `fd` (checked to be `/dev/kvm`), or of `/dev/kvm` opened now.
fn kvm_handle(fd: Option<OwnedFd>) -> Result<Kvm, VmmError> {
    let Some(fd) = fd else {
        return Kvm::new().map_err(VmmError::kvm("open /dev/kvm"));
    };
    check_kvm_device(fd.as_fd())?;
    // SAFETY: `fd` is an open descriptor of KVM's device (checked just above), owned by us and
    // given up here: the handle owns and closes it.
    let kvm = unsafe { <Kvm as std::os::fd::FromRawFd>::from_raw_fd(fd.into_raw_fd()) };
    let version = kvm.get_api_version();
    if version != KVM_API_VERSION {
        return Err(VmmError::Config(format!(
            "KVM_GET_API_VERSION on the KVM descriptor gave {version}, not {KVM_API_VERSION}"
        )));
    }
    Ok(kvm)
}

/// The KVM system handle and one VM.
pub struct KvmVm {
    pub kvm: Kvm,
    pub fd: VmFd,
}

impl KvmVm {
    /// Creates a VM with an in-kernel IRQ chip (PIC, IOAPIC, LAPICs) and PIT on `kvm` (the
    /// embedder's descriptor of `/dev/kvm`), or on `/dev/kvm` opened now when `None`.
    pub fn new(kvm: Option<OwnedFd>) -> Result<Self, VmmError> {
        let kvm = kvm_handle(kvm)?;
        let fd = kvm.create_vm().map_err(VmmError::kvm("KVM_CREATE_VM"))?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(VmmError::kvm("KVM_SET_TSS_ADDR"))?;
        fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(VmmError::kvm("KVM_SET_IDENTITY_MAP_ADDR"))?;
        fd.create_irq_chip()
            .map_err(VmmError::kvm("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit)
            .map_err(VmmError::kvm("KVM_CREATE_PIT2"))?;
        Ok(Self { kvm, fd })
    }

    /// The most vCPUs this KVM allows in a VM.
    pub fn max_vcpus(&self) -> usize {
        self.kvm.get_max_vcpus()
    }

    /// Gives every region of `mem` to the VM as a memory slot.
    pub fn register_memory(&self, mem: &GuestMemory) -> Result<(), VmmError> {
        for (slot, region) in mem.iter().enumerate() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|e| VmmError::Memory(e.to_string()))?;
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the region is a live mapping of `memory_size` bytes owned by `mem`, which
            // the VM handle keeps alive until the VM fd (and so the slot) is closed.
            unsafe { self.fd.set_user_memory_region(r) }
                .map_err(VmmError::kvm("KVM_SET_USER_MEMORY_REGION"))?;
        }
        Ok(())
    }

    /// Routes writes of `evt` to interrupt line `gsi` (IOAPIC pin / PIC IRQ).
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VmmError> {
        self.fd
            .register_irqfd(evt, gsi)
            .map_err(VmmError::kvm("KVM_IRQFD"))
    }

    /// Routes writes of `evt` to interrupt line `gsi` as a level-triggered interrupt: the line
    /// stays asserted until the guest EOIs it, then KVM lowers it and signals `resample`.
    pub fn register_irqfd_with_resample(
        &self,
        evt: &EventFd,
        resample: &EventFd,
        gsi: u32,
    ) -> Result<(), kvm_ioctls::Error> {
        self.fd.register_irqfd_with_resample(evt, resample, gsi)
    }

    /// Signals `evt` (without a vCPU exit) when the guest writes to MMIO address `addr`.
    pub fn register_mmio_ioeventfd(&self, evt: &EventFd, addr: u64) -> Result<(), VmmError> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), NoDatamatch)
            .map_err(VmmError::kvm("KVM_IOEVENTFD"))
    }

    /// The CPUID leaves KVM supports on this host.
    pub fn supported_cpuid(&self) -> Result<CpuId, VmmError> {
        self.kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(VmmError::kvm("KVM_GET_SUPPORTED_CPUID"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kvms_device_passes_as_the_kvm_descriptor() {
        let null = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let e = check_kvm_device(null.as_fd()).unwrap_err().to_string();
        assert!(e.contains("not /dev/kvm (a character device 1:3"), "{e}");
        let file = OwnedFd::from(std::fs::File::open("/proc/self/status").unwrap());
        let e = kvm_handle(Some(file)).err().unwrap().to_string();
        assert!(e.contains("a file or device 0:0"), "{e}");
    }
}
