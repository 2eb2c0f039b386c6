//! The KVM VM: the VM fd with its in-kernel interrupt controllers and PIT, guest memory slots,
//! and irqfd / ioeventfd registration for devices.

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{IoEventAddress, Kvm, NoDatamatch, VmFd};
use vm_memory::{GuestMemory as _, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::layout::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS};
use crate::memory::GuestMemory;
use crate::VmmError;

/// The KVM system handle and one VM.
pub struct KvmVm {
    pub kvm: Kvm,
    pub fd: VmFd,
}

impl KvmVm {
    /// Opens /dev/kvm and creates a VM with an in-kernel IRQ chip (PIC, IOAPIC, LAPICs) and PIT.
    pub fn new() -> Result<Self, VmmError> {
        let kvm = Kvm::new().map_err(VmmError::kvm("open /dev/kvm"))?;
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
