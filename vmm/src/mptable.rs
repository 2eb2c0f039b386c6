//! The Intel MultiProcessor table (spec 1.4): how a guest without ACPI finds its CPUs, the
//! IOAPIC and the interrupt routing. Written at the start of the EBDA.
//!
//! Layout: the 16-byte floating pointer structure, then the configuration table header (44
//! bytes) and its entries: one processor entry per vCPU (APIC id = vCPU index, vCPU 0 is the
//! boot processor), the ISA bus, the IOAPIC (id = vCPU count), an I/O interrupt entry per IOAPIC
//! pin (ISA IRQ n -> pin n) and the two local interrupts (ExtINT on LINT0, NMI on LINT1).

use vm_memory::{Bytes, GuestAddress};

use crate::layout::{APIC_START, EBDA_START, IOAPIC_PINS, IOAPIC_START, MAX_VCPUS};
use crate::memory::GuestMemory;

const MPF_SIZE: usize = 16;
const HEADER_SIZE: usize = 44;
const PROCESSOR_SIZE: usize = 20;
const ENTRY_SIZE: usize = 8;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;

const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// Family 6 signature and the FPU + APIC feature bits, as real firmware reports them.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;

/// Errors writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit an MP table (1..={MAX_VCPUS})")]
    VcpuCount(u8),
    #[error("the MP table does not fit guest memory at {EBDA_START:#x}")]
    Write,
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |s, b| s.wrapping_add(*b))
        .wrapping_neg()
}

/// The MP table for `vcpus` processors, to be placed at `base`.
pub fn build(vcpus: u8, base: u64) -> Result<Vec<u8>, MpTableError> {
    if vcpus == 0 || vcpus > MAX_VCPUS {
        return Err(MpTableError::VcpuCount(vcpus));
    }
    let ioapic_id = vcpus;
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for id in 0..vcpus {
        let flags = CPU_ENABLED | if id == 0 { CPU_BSP } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, id, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;
    for pin in 0..IOAPIC_PINS {
        // Type, interrupt type, flags (conforming polarity/trigger), source bus, source IRQ,
        // destination IOAPIC, destination pin.
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            0,
            0,
            0,
            pin,
            ioapic_id,
            pin,
        ]);
        count += 1;
    }
    // Local interrupts go to every local APIC (0xff).
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_len = HEADER_SIZE + entries.len();
    let table_addr = base + MPF_SIZE as u64;
    let mut out = Vec::with_capacity(MPF_SIZE + table_len);

    // Floating pointer structure.
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&(table_addr as u32).to_le_bytes());
    out.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]); // length in 16-byte units, spec 1.4
    let sum = checksum(&out[..MPF_SIZE]);
    out[10] = sum;

    // Configuration table header.
    let mut header = Vec::with_capacity(HEADER_SIZE);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&(table_len as u16).to_le_bytes());
    header.extend_from_slice(&[4, 0]); // spec revision, checksum (below)
    header.extend_from_slice(b"MICROVM ");
    header.extend_from_slice(b"MICROVM     ");
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    header.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    header.extend_from_slice(&count.to_le_bytes());
    header.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    header.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    debug_assert_eq!(header.len(), HEADER_SIZE);
    let table_start = out.len();
    out.extend_from_slice(&header);
    out.extend_from_slice(&entries);
    let sum = checksum(&out[table_start..]);
    out[table_start + 7] = sum;
    debug_assert_eq!(
        out.len(),
        MPF_SIZE
            + PROCESSOR_SIZE * usize::from(vcpus)
            + HEADER_SIZE
            + ENTRY_SIZE * (4 + usize::from(IOAPIC_PINS))
    );
    Ok(out)
}

/// Writes the MP table for `vcpus` processors at the EBDA.
pub fn setup_mptable(mem: &GuestMemory, vcpus: u8) -> Result<(), MpTableError> {
    let table = build(vcpus, EBDA_START)?;
    mem.write_slice(&table, GuestAddress(EBDA_START))
        .map_err(|_| MpTableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |s, x| s.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_layout() {
        for n in [1u8, 2, 4, 254] {
            let t = build(n, EBDA_START).unwrap();
            assert_eq!(&t[..4], b"_MP_");
            assert_eq!(sum(&t[..16]), 0, "floating pointer checksum");
            let table = u32::from_le_bytes(t[4..8].try_into().unwrap()) as u64;
            assert_eq!(table, EBDA_START + 16);
            let cfg = &t[16..];
            assert_eq!(&cfg[..4], b"PCMP");
            let len = u16::from_le_bytes([cfg[4], cfg[5]]) as usize;
            assert_eq!(len, cfg.len());
            assert_eq!(sum(cfg), 0, "table checksum");
            let count = u16::from_le_bytes([cfg[34], cfg[35]]);
            assert_eq!(count as usize, n as usize + 2 + 24 + 2);
            // Walk the entries: the processors come first, vCPU 0 is the BSP.
            let mut off = 44;
            let mut cpus = 0;
            for _ in 0..count {
                match cfg[off] {
                    0 => {
                        assert_eq!(cfg[off + 1], cpus);
                        assert_eq!(cfg[off + 3] & 2 != 0, cpus == 0);
                        cpus += 1;
                        off += 20;
                    }
                    2 => {
                        assert_eq!(cfg[off + 1], n, "IOAPIC id follows the APIC ids");
                        off += 8;
                    }
                    _ => off += 8,
                }
            }
            assert_eq!(off, len);
            assert_eq!(cpus, n);
        }
    }

    #[test]
    fn rejects_bad_counts() {
        assert!(build(0, EBDA_START).is_err());
        assert!(build(255, EBDA_START).is_err());
    }

    #[test]
    fn the_largest_table_stays_below_1_mib() {
        let t = build(MAX_VCPUS, EBDA_START).unwrap();
        assert!(EBDA_START + (t.len() as u64) < crate::layout::HIMEM_START);
    }
}
