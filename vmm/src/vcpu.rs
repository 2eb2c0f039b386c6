//! vCPUs: their boot setup, and the thread that runs each one (KVM_RUN, exits to the buses).
//!
//! Stopping: the VM's stop flag is checked before every KVM_RUN; a vCPU blocked in the guest is
//! kicked out with a signal (kick.rs: no-op handler, no SA_RESTART, so KVM_RUN returns EINTR). The kicker
//! repeats the signal until the thread ends, which closes the race between the flag check and
//! entering KVM_RUN.
//!
//! Pausing ([`crate::VmHandle::with_paused`]) works the same way: the pause gate is checked
//! before every KVM_RUN, and the pauser repeats the kick until every vCPU has parked there.

use std::sync::Arc;

use kvm_bindings::{kvm_lapic_state, CpuId};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_devices::bus::Bus;

use crate::cpuid::filter_cpuid;
use crate::handle::Shared;
use crate::jail::ThreadFilter;
use crate::memory::GuestMemory;
use crate::regs::{boot_fpu, boot_regs, setup_sregs, EntryMode};
use crate::{msrs, VmExit, VmmError};

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;

fn lapic_reg(l: &kvm_lapic_state, off: usize) -> u32 {
    let b = |i: usize| l.regs[off + i] as u8;
    u32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

fn set_lapic_reg(l: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, byte) in v.to_le_bytes().iter().enumerate() {
        l.regs[off + i] = *byte as _;
    }
}

fn set_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// One vCPU and what it needs at run time.
pub struct Vcpu {
    pub id: u8,
    fd: VcpuFd,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
}

impl Vcpu {
    pub fn new(id: u8, fd: VcpuFd, pio: Arc<Bus>, mmio: Arc<Bus>) -> Self {
        Self { id, fd, pio, mmio }
    }

    /// CPUID, MSRs, FPU and local APIC (LINT0 = ExtINT, LINT1 = NMI) for vCPU `id` of `vcpus`.
    pub fn configure_common(&self, base_cpuid: &CpuId, vcpus: u8) -> Result<(), VmmError> {
        let mut cpuid = base_cpuid.clone();
        filter_cpuid(&mut cpuid, self.id, vcpus);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(VmmError::kvm("KVM_SET_CPUID2"))?;
        let msrs = msrs::boot_msrs()
            .ok_or_else(|| VmmError::Config("cannot build the boot MSR list".into()))?;
        let n = self
            .fd
            .set_msrs(&msrs)
            .map_err(VmmError::kvm("KVM_SET_MSRS"))?;
        if n != msrs.as_slice().len() {
            log::warn!(
                "vCPU {}: KVM accepted {n} of {} boot MSRs",
                self.id,
                msrs.as_slice().len()
            );
        }
        self.fd
            .set_fpu(&boot_fpu())
            .map_err(VmmError::kvm("KVM_SET_FPU"))?;
        let mut lapic = self
            .fd
            .get_lapic()
            .map_err(VmmError::kvm("KVM_GET_LAPIC"))?;
        let lvt0 = set_delivery_mode(lapic_reg(&lapic, APIC_LVT0), APIC_MODE_EXTINT);
        let lvt1 = set_delivery_mode(lapic_reg(&lapic, APIC_LVT1), APIC_MODE_NMI);
        set_lapic_reg(&mut lapic, APIC_LVT0, lvt0);
        set_lapic_reg(&mut lapic, APIC_LVT1, lvt1);
        self.fd
            .set_lapic(&lapic)
            .map_err(VmmError::kvm("KVM_SET_LAPIC"))
    }

    /// The boot vCPU's registers for the kernel entry. (The others wait for INIT-SIPI-SIPI.)
    pub fn configure_boot(
        &self,
        mem: &GuestMemory,
        mode: EntryMode,
        entry: u64,
        boot_info: u64,
    ) -> Result<(), VmmError> {
        let mut sregs = self
            .fd
            .get_sregs()
            .map_err(VmmError::kvm("KVM_GET_SREGS"))?;
        setup_sregs(mem, &mut sregs, mode).map_err(|e| VmmError::Memory(e.to_string()))?;
        self.fd
            .set_sregs(&sregs)
            .map_err(VmmError::kvm("KVM_SET_SREGS"))?;
        self.fd
            .set_regs(&boot_regs(mode, entry, boot_info))
            .map_err(VmmError::kvm("KVM_SET_REGS"))
    }

    /// Runs the vCPU until the VM stops or this vCPU ends it. With a `filter`, installs it
    /// first (before the first KVM_RUN); a filter that cannot be installed ends the VM.
    pub fn run(mut self, shared: Arc<Shared>, filter: Option<ThreadFilter>) {
        let id = self.id;
        if let Some(f) = filter {
            if let Err(e) = f.install() {
                shared.finish(Err(VmmError::Jail(e)));
                return;
            }
        }
        while !shared.stopping() {
            if shared.pause_point() {
                continue;
            }
            match self.run_once() {
                Ok(None) => {}
                Ok(Some(exit)) => {
                    shared.finish(Ok(exit));
                    break;
                }
                Err(e) => {
                    log::debug!("vCPU {id} ends the VM: {e}");
                    shared.finish(Err(e));
                    break;
                }
            }
        }
    }

    fn internal_error_reason(&mut self) -> String {
        // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the union member
        // the kernel filled in.
        let internal = unsafe { self.fd.get_kvm_run().__bindgen_anon_1.internal };
        let name = match internal.suberror {
            1 => "emulation failure (an instruction KVM cannot emulate)",
            2 => "simultaneous exceptions",
            3 => "event delivery failure",
            4 => "unexpected exit reason",
            _ => "unknown suberror",
        };
        let n = (internal.ndata as usize).min(internal.data.len());
        let data: Vec<String> = internal.data[..n]
            .iter()
            .map(|d| format!("{d:#x}"))
            .collect();
        format!(
            "KVM_EXIT_INTERNAL_ERROR: {name} (suberror {}, data [{}])",
            internal.suberror,
            data.join(", ")
        )
    }

    /// One KVM_RUN. `Ok(Some(exit))` ends the VM cleanly; errors end it with that error.
    fn run_once(&mut self) -> Result<Option<VmExit>, VmmError> {
        let id = self.id;
        let fault = |reason: String| VmmError::GuestFault { vcpu: id, reason };
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.pio.read(u64::from(port), data) {
                    log::trace!("vCPU {id}: read of unmapped port {port:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                if !self.pio.write(u64::from(port), data) {
                    log::trace!("vCPU {id}: write to unmapped port {port:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !self.mmio.read(addr, data) {
                    log::debug!("vCPU {id}: read of unmapped MMIO {addr:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !self.mmio.write(addr, data) {
                    log::debug!("vCPU {id}: write to unmapped MMIO {addr:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::Intr) | Ok(VcpuExit::IrqWindowOpen) => Ok(None),
            Ok(VcpuExit::Hlt) => Err(fault(
                "halted with no way to wake up (KVM_EXIT_HLT)".into(),
            )),
            Ok(VcpuExit::Shutdown) => Err(fault(
                "triple fault: the guest shut the CPU down (KVM_EXIT_SHUTDOWN)".into(),
            )),
            Ok(VcpuExit::InternalError) => Err(fault(self.internal_error_reason())),
            Ok(VcpuExit::FailEntry(reason, cpu)) => Err(fault(format!(
                "VM entry failed (KVM_EXIT_FAIL_ENTRY): hardware reason {reason:#x} on host cpu {cpu}"
            ))),
            Ok(VcpuExit::SystemEvent(kind, data)) => match kind {
                KVM_SYSTEM_EVENT_SHUTDOWN | KVM_SYSTEM_EVENT_RESET => Ok(Some(VmExit::Reset)),
                other => Err(fault(format!(
                    "system event {other} (KVM_EXIT_SYSTEM_EVENT, data {data:?})"
                ))),
            },
            Ok(other) => Err(fault(format!("unexpected vCPU exit: {other:?}"))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                // Kicked (stop) or interrupted: the loop checks the stop flag.
                self.fd.set_kvm_immediate_exit(0);
                Ok(None)
            }
            Err(e) => Err(VmmError::Kvm {
                op: "KVM_RUN",
                source: e,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_modes() {
        assert_eq!(set_delivery_mode(0x0001_0700, APIC_MODE_NMI), 0x0001_0400);
        assert_eq!(set_delivery_mode(0, APIC_MODE_EXTINT), 0x700);
        let mut l = kvm_lapic_state::default();
        set_lapic_reg(&mut l, APIC_LVT0, 0xdead_beef);
        assert_eq!(lapic_reg(&l, APIC_LVT0), 0xdead_beef);
    }
}
