//! Boot register state of the vCPUs: GDT, segments, control registers, page tables, FPU.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use crate::layout::{
    BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, PDE_START, PDPTE_START, PML4_START,
    ZERO_PAGE_START,
};
use crate::memory::GuestMemory;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Errors writing boot structures to guest memory.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("cannot write the {0} to guest memory")]
    Write(&'static str),
}

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryMode {
    /// 64-bit Linux boot protocol: long mode, our page tables, RSI = zero page.
    Long64,
    /// PVH: 32-bit protected mode, paging off, RBX = hvm_start_info.
    Pvh32,
}

/// A GDT descriptor from its flags (access byte in bits 0-7, flags nibble in bits 12-15), base and
/// limit.
pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = u64::from(base);
    let limit = u64::from(limit);
    ((base & 0xff00_0000) << 32)
        | ((u64::from(flags) & 0xf0ff) << 40)
        | ((limit & 0xf_0000) << 32)
        | ((base & 0xff_ffff) << 16)
        | (limit & 0xffff)
}

/// The KVM segment register for GDT entry `index` holding `entry`.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let bit = |n: u32| ((entry >> n) & 1) as u8;
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    let mut limit = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let g = bit(55);
    if g == 1 {
        limit = (limit << 12) | 0xfff;
    }
    let present = bit(47);
    kvm_segment {
        base,
        limit,
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 3) as u8,
        db: bit(54),
        s: bit(44),
        l: bit(53),
        g,
        avl: bit(52),
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// The boot GDT for an entry mode: null, code, data, TSS.
pub fn boot_gdt(mode: EntryMode) -> [u64; 4] {
    match mode {
        EntryMode::Long64 => [
            0,
            gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code
            gdt_entry(0xc093, 0, 0xfffff), // data
            gdt_entry(0x808b, 0, 0xfffff), // TSS
        ],
        EntryMode::Pvh32 => [
            0,
            gdt_entry(0xc09b, 0, 0xfffff), // 32-bit code
            gdt_entry(0xc093, 0, 0xfffff), // data
            gdt_entry(0x008b, 0, 0x67),    // TSS
        ],
    }
}

/// Writes the identity map of the first GiB (2 MiB pages): PML4 -> PDPT -> PD.
pub fn write_page_tables(mem: &GuestMemory) -> Result<(), RegsError> {
    let w = |v: u64, a: u64| {
        mem.write_obj(v, GuestAddress(a))
            .map_err(|_| RegsError::Write("page tables"))
    };
    w(PDPTE_START | 0x3, PML4_START)?;
    w(PDE_START | 0x3, PDPTE_START)?;
    for i in 0..512u64 {
        w((i << 21) | 0x83, PDE_START + i * 8)?;
    }
    Ok(())
}

/// Writes the GDT and an empty IDT, and sets up `sregs` for `mode` (segments from that GDT,
/// control registers; for long mode the page tables must be written too).
pub fn setup_sregs(
    mem: &GuestMemory,
    sregs: &mut kvm_sregs,
    mode: EntryMode,
) -> Result<(), RegsError> {
    let gdt = boot_gdt(mode);
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + i as u64 * 8))
            .map_err(|_| RegsError::Write("GDT"))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(|_| RegsError::Write("IDT"))?;
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(gdt[3], 3);
    match mode {
        EntryMode::Long64 => {
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG;
            sregs.cr3 = PML4_START;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
        EntryMode::Pvh32 => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr4 = 0;
        }
    }
    Ok(())
}

/// General registers at the kernel entry.
pub fn boot_regs(mode: EntryMode, entry: u64, boot_info: u64) -> kvm_regs {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        ..Default::default()
    };
    match mode {
        EntryMode::Long64 => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = if boot_info == 0 {
                ZERO_PAGE_START
            } else {
                boot_info
            };
        }
        EntryMode::Pvh32 => regs.rbx = boot_info,
    }
    regs
}

/// The FPU as after FNINIT, with SSE exceptions masked.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;

    #[test]
    fn gdt_entries_round_trip_to_segments() {
        let code = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(
            (code.selector, code.type_, code.l, code.db, code.g),
            (8, 0xb, 1, 0, 1)
        );
        assert_eq!(
            (code.present, code.s, code.base, code.limit),
            (1, 1, 0, 0xffff_ffff)
        );
        let tss = segment_from_gdt(gdt_entry(0x008b, 0x1234_5678, 0x67), 3);
        assert_eq!(
            (tss.base, tss.limit, tss.type_, tss.s),
            (0x1234_5678, 0x67, 0xb, 0)
        );
        assert_eq!(segment_from_gdt(0, 0).unusable, 1);
        assert_eq!(gdt_entry(0xc093, 0, 0xfffff), 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn page_tables_identity_map_one_gib() {
        let mem = create_guest_memory(16 << 20).unwrap();
        write_page_tables(&mem).unwrap();
        let r = |a: u64| mem.read_obj::<u64>(GuestAddress(a)).unwrap();
        assert_eq!(r(PML4_START), PDPTE_START | 3);
        assert_eq!(r(PDPTE_START), PDE_START | 3);
        assert_eq!(r(PDE_START), 0x83);
        assert_eq!(r(PDE_START + 511 * 8), (511 << 21) | 0x83);
        assert_eq!(r(PDPTE_START + 8), 0, "only the first GiB is mapped");
    }

    #[test]
    fn long_mode_sregs() {
        let mem = create_guest_memory(16 << 20).unwrap();
        let mut s = kvm_sregs::default();
        setup_sregs(&mem, &mut s, EntryMode::Long64).unwrap();
        assert_eq!(s.cr3, PML4_START);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(s.cs.l, 1);
        let mut p = kvm_sregs::default();
        setup_sregs(&mem, &mut p, EntryMode::Pvh32).unwrap();
        assert_eq!(p.cr0 & X86_CR0_PG, 0);
        assert_eq!((p.cs.l, p.cs.db), (0, 1));
        assert_eq!(boot_regs(EntryMode::Pvh32, 0x100000, 0x6000).rbx, 0x6000);
        assert_eq!(
            boot_regs(EntryMode::Long64, 0x100000, 0).rsi,
            ZERO_PAGE_START
        );
    }
}
