//! CPUID for each vCPU: what KVM supports, with this vCPU's APIC id and the VM's topology
//! (every vCPU a core of one socket, one thread per core). The hypervisor leaves
//! (0x4000_0000.., "KVMKVMKVM") are kept so a Linux guest finds kvm-clock.
//!
//! One bit KVM supports but does not report in KVM_GET_SUPPORTED_CPUID: the local APIC timer's
//! TSC-deadline mode (CPUID.1:ECX bit 24). KVM emulates it wherever it has
//! KVM_CAP_TSC_DEADLINE_TIMER and leaves offering it to the VMM ([`offer_tsc_deadline`]). A Linux
//! guest that has it programs its timer by TSC deadline and skips the boot-time calibration of the
//! APIC timer, a loop that spins (`sti; pause`) until 26 of its timer interrupts have come: on
//! hardware a few tens of milliseconds, under nested emulation the one place in the guest's boot
//! that waits for an interrupt without ever exiting to its hypervisor (docs/nested-lane.md).

use kvm_bindings::CpuId;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE: u32 = 0x4;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_EXT_TOPOLOGY: u32 = 0x1f;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;
const TOPOLOGY_LEVEL_THREAD: u32 = 1;
const TOPOLOGY_LEVEL_CORE: u32 = 2;

/// Bits needed to number `n` items.
fn bits_for(n: u32) -> u32 {
    if n <= 1 {
        0
    } else {
        32 - (n - 1).leading_zeros()
    }
}

/// Sets the TSC-deadline timer bit in leaf 1 when `kvm_emulates_it` (the host's KVM answers
/// KVM_CAP_TSC_DEADLINE_TIMER), clears it otherwise: `cpuid` is what KVM_GET_SUPPORTED_CPUID
/// returned, which never sets it.
pub fn offer_tsc_deadline(cpuid: &mut CpuId, kvm_emulates_it: bool) {
    for e in cpuid.as_mut_slice() {
        if e.function == LEAF_FEATURES {
            if kvm_emulates_it {
                e.ecx |= ECX_TSC_DEADLINE;
            } else {
                e.ecx &= !ECX_TSC_DEADLINE;
            }
        }
    }
}

/// Fills in `cpuid` (from KVM_GET_SUPPORTED_CPUID) for vCPU `id` of `vcpus`.
pub fn filter_cpuid(cpuid: &mut CpuId, id: u8, vcpus: u8) {
    let apic_id = u32::from(id);
    let count = u32::from(vcpus.max(1));
    let core_shift = bits_for(count);
    for e in cpuid.as_mut_slice() {
        match e.function {
            LEAF_FEATURES => {
                e.ebx = (e.ebx & 0x0000_ffff) | (apic_id << 24) | ((count & 0xff) << 16);
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE => {
                // Cores per package - 1 in bits 31..26; each cache is private to a core except
                // the last level, which all of them share.
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { count - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | ((sharing & 0xfff) << 14) | (((count - 1) & 0x3f) << 26);
            }
            LEAF_TOPOLOGY | LEAF_EXT_TOPOLOGY => {
                e.edx = apic_id;
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (TOPOLOGY_LEVEL_THREAD << 8) | e.index;
                    }
                    1 => {
                        e.eax = core_shift;
                        e.ebx = count;
                        e.ecx = (TOPOLOGY_LEVEL_CORE << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0xffff_ffff,
            ..Default::default()
        }
    }

    #[test]
    fn apic_id_and_topology() {
        let mut c = CpuId::from_entries(&[
            entry(1, 0),
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0x4000_0000, 0),
        ])
        .unwrap();
        filter_cpuid(&mut c, 3, 4);
        let s = c.as_slice();
        assert_eq!(s[0].ebx >> 24, 3);
        assert_eq!((s[0].ebx >> 16) & 0xff, 4);
        assert_ne!(s[0].edx & EDX_HTT, 0);
        assert_ne!(s[0].ecx & ECX_HYPERVISOR, 0);
        assert_eq!((s[1].edx, s[1].ebx), (3, 1));
        assert_eq!((s[2].eax, s[2].ebx, s[2].ecx >> 8), (2, 4, 2));
        assert_eq!(s[3].ebx, 0xffff_ffff, "hypervisor leaf untouched");
        assert_eq!(bits_for(1), 0);
        assert_eq!(bits_for(5), 3);
    }

    #[test]
    fn tsc_deadline_offered_only_with_the_capability() {
        let leaf1 = |c: &CpuId| c.as_slice().iter().find(|e| e.function == 1).unwrap().ecx;
        let mut c =
            CpuId::from_entries(&[entry(0, 0), entry(1, 0), entry(0x8000_0001, 0)]).unwrap();
        offer_tsc_deadline(&mut c, true);
        assert_ne!(leaf1(&c) & ECX_TSC_DEADLINE, 0);
        assert_eq!(c.as_slice()[0].ecx, 0, "other leaves untouched");
        assert_eq!(c.as_slice()[2].ecx, 0, "other leaves untouched");
        // filter_cpuid keeps it.
        filter_cpuid(&mut c, 1, 2);
        assert_ne!(leaf1(&c) & ECX_TSC_DEADLINE, 0);
        assert_ne!(leaf1(&c) & ECX_HYPERVISOR, 0);

        let mut c = CpuId::from_entries(&[entry(1, 0)]).unwrap();
        c.as_mut_slice()[0].ecx = ECX_TSC_DEADLINE | 1;
        offer_tsc_deadline(&mut c, false);
        assert_eq!(
            leaf1(&c),
            1,
            "without the capability the bit is cleared, nothing else"
        );
    }
}
