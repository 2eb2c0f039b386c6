//! The Intel MultiProcessor table (spec 1.4): how a guest without ACPI finds its CPUs, the
//! IOAPIC and the interrupt routing. Written at the start of the EBDA.
//!
//! Layout: the 16-byte floating pointer structure, then the configuration table header (44
//! bytes) and its entries: one processor entry per vCPU (APIC id = vCPU index, vCPU 0 is the
//! boot processor), the buses, the IOAPIC (id = vCPU count), the I/O interrupt entries and the
//! two local interrupts (ExtINT on LINT0, NMI on LINT1).
//!
//! Without PCI there is one bus, ISA (id 0), and every IOAPIC pin n is ISA IRQ n (conforming:
//! edge, active high; virtio-mmio uses pins 5 and up that way). With a PCI root, bus id 0 is PCI
//! (the MP bus id of a PCI bus is its bus number, which Linux matches) and ISA becomes id 1; each
//! routed PCI interrupt pin gets a PCI entry (source IRQ = slot << 2 | pin - 1, level-triggered,
//! active low) instead of the ISA entry of its IOAPIC pin.

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
/// I/O interrupt flags: polarity active low (bits 1:0 = 3), trigger level (bits 3:2 = 3).
const FLAGS_LEVEL_ACTIVE_LOW: u8 = 0x0f;
/// Conforming to the bus: ISA is edge / active high.
const FLAGS_CONFORMING: u8 = 0;
/// The PCI bus number of our root (and so its MP bus id).
const PCI_BUS_ID: u8 = 0;
/// Slots and interrupt pins (INTA..INTD = 1..=4) of a PCI bus.
const PCI_SLOTS: u8 = 32;
const PCI_PINS: std::ops::RangeInclusive<u8> = 1..=4;
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;

/// Errors writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit an MP table (1..={MAX_VCPUS})")]
    VcpuCount(u8),
    #[error("the MP table does not fit guest memory at {EBDA_START:#x}")]
    Write,
    #[error("PCI interrupt {0:?}: slot 0..32, pin 1..=4 (INTA..INTD) and IOAPIC pin 0..{IOAPIC_PINS} only")]
    PciInterrupt(PciInterrupt),
    #[error("{0} PCI interrupts: more than bus 0's slots have pins")]
    TooManyPciInterrupts(usize),
}

/// A PCI device's interrupt pin on bus 0, routed to an IOAPIC pin (its GSI).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciInterrupt {
    /// The device number on bus 0.
    pub slot: u8,
    /// 1 = INTA# .. 4 = INTD#, as the device's Interrupt Pin register says.
    pub pin: u8,
    /// The IOAPIC pin (= GSI) it drives.
    pub ioapic_pin: u8,
}

impl PciInterrupt {
    fn valid(&self) -> bool {
        self.slot < PCI_SLOTS && PCI_PINS.contains(&self.pin) && self.ioapic_pin < IOAPIC_PINS
    }

    /// The MP table's source bus IRQ of a PCI interrupt: device number and pin (0 = INTA#).
    fn source_irq(&self) -> u8 {
        (self.slot << 2) | (self.pin - 1)
    }
}

/// The buses of the table: with PCI (`pci` is Some), PCI is bus 0 and ISA bus 1.
fn isa_bus_id(pci: Option<&[PciInterrupt]>) -> u8 {
    if pci.is_some() {
        PCI_BUS_ID + 1
    } else {
        0
    }
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |s, b| s.wrapping_add(*b))
        .wrapping_neg()
}

/// The MP table for `vcpus` processors, to be placed at `base`. `pci` is None without a PCI
/// root, else the PCI interrupt pins routed to IOAPIC pins (possibly none).
pub fn build(vcpus: u8, base: u64, pci: Option<&[PciInterrupt]>) -> Result<Vec<u8>, MpTableError> {
    if vcpus == 0 || vcpus > MAX_VCPUS {
        return Err(MpTableError::VcpuCount(vcpus));
    }
    let pci_irqs = pci.unwrap_or_default();
    if let Some(bad) = pci_irqs.iter().find(|p| !p.valid()) {
        return Err(MpTableError::PciInterrupt(*bad));
    }
    if pci_irqs.len() > usize::from(PCI_SLOTS) * PCI_PINS.clone().count() {
        return Err(MpTableError::TooManyPciInterrupts(pci_irqs.len()));
    }
    let isa_bus = isa_bus_id(pci);
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
    if pci.is_some() {
        entries.extend_from_slice(&[ENTRY_BUS, PCI_BUS_ID]);
        entries.extend_from_slice(b"PCI   ");
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, isa_bus]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;
    // Type, interrupt type, flags (polarity/trigger), reserved, source bus, source IRQ,
    // destination IOAPIC, destination pin.
    for p in pci_irqs {
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            FLAGS_LEVEL_ACTIVE_LOW,
            0,
            PCI_BUS_ID,
            p.source_irq(),
            ioapic_id,
            p.ioapic_pin,
        ]);
        count += 1;
    }
    // A pin that a PCI interrupt drives is not also an ISA IRQ (Linux takes a pin's trigger and
    // polarity from the first entry naming it).
    for pin in (0..IOAPIC_PINS).filter(|pin| pci_irqs.iter().all(|p| p.ioapic_pin != *pin)) {
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            FLAGS_CONFORMING,
            0,
            isa_bus,
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
            + ENTRY_SIZE * usize::from(count - u16::from(vcpus))
    );
    Ok(out)
}

/// Writes the MP table for `vcpus` processors (and the PCI interrupt routing, with a PCI root)
/// at the EBDA.
pub fn setup_mptable(
    mem: &GuestMemory,
    vcpus: u8,
    pci: Option<&[PciInterrupt]>,
) -> Result<(), MpTableError> {
    let table = build(vcpus, EBDA_START, pci)?;
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
            let t = build(n, EBDA_START, None).unwrap();
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
        assert!(build(0, EBDA_START, None).is_err());
        assert!(build(255, EBDA_START, None).is_err());
    }

    #[test]
    fn the_largest_table_stays_below_1_mib() {
        let all_pins: Vec<PciInterrupt> = (0..PCI_SLOTS)
            .flat_map(|slot| {
                PCI_PINS.map(move |pin| PciInterrupt {
                    slot,
                    pin,
                    ioapic_pin: 23,
                })
            })
            .collect();
        let t = build(MAX_VCPUS, EBDA_START, Some(&all_pins)).unwrap();
        assert!(EBDA_START + (t.len() as u64) < crate::layout::HIMEM_START);
    }

    /// The entries after the header: (type, the entry's bytes).
    fn entries(t: &[u8]) -> Vec<Vec<u8>> {
        let cfg = &t[16..];
        assert_eq!(sum(&t[..16]), 0);
        assert_eq!(sum(cfg), 0);
        let count = u16::from_le_bytes([cfg[34], cfg[35]]);
        let mut off = 44;
        let mut out = Vec::new();
        for _ in 0..count {
            let len = if cfg[off] == ENTRY_PROCESSOR { 20 } else { 8 };
            out.push(cfg[off..off + len].to_vec());
            off += len;
        }
        assert_eq!(off, cfg.len());
        out
    }

    fn buses(e: &[Vec<u8>]) -> Vec<(u8, String)> {
        e.iter()
            .filter(|e| e[0] == ENTRY_BUS)
            .map(|e| (e[1], String::from_utf8_lossy(&e[2..8]).into_owned()))
            .collect()
    }

    /// I/O interrupt entries naming IOAPIC pin `pin`: (flags, source bus, source IRQ).
    fn routes_to(e: &[Vec<u8>], pin: u8) -> Vec<(u8, u8, u8)> {
        e.iter()
            .filter(|e| e[0] == ENTRY_IO_INTERRUPT && e[7] == pin)
            .map(|e| {
                assert_eq!(e[1], INT_TYPE_INT);
                (e[2], e[4], e[5])
            })
            .collect()
    }

    #[test]
    fn without_pci_the_isa_bus_is_bus_0_and_owns_every_pin() {
        let e = entries(&build(2, EBDA_START, None).unwrap());
        assert_eq!(buses(&e), [(0, "ISA   ".to_string())]);
        for pin in 0..IOAPIC_PINS {
            assert_eq!(routes_to(&e, pin), [(0, 0, pin)]);
        }
    }

    #[test]
    fn pci_interrupts_replace_the_isa_entries_of_their_pins() {
        let pci = [
            PciInterrupt {
                slot: 1,
                pin: 1,
                ioapic_pin: 23,
            },
            PciInterrupt {
                slot: 2,
                pin: 2,
                ioapic_pin: 22,
            },
        ];
        let e = entries(&build(1, EBDA_START, Some(&pci)).unwrap());
        // PCI bus 0 (its number is its MP bus id), ISA moves to 1.
        assert_eq!(
            buses(&e),
            [(0, "PCI   ".to_string()), (1, "ISA   ".to_string())]
        );
        // Slot 1 INTA#: source IRQ 1 << 2 | 0; slot 2 INTB#: 2 << 2 | 1. Level, active low.
        assert_eq!(routes_to(&e, 23), [(0x0f, 0, 4)]);
        assert_eq!(routes_to(&e, 22), [(0x0f, 0, 9)]);
        for pin in 0..22 {
            assert_eq!(routes_to(&e, pin), [(0, 1, pin)], "ISA IRQ {pin}");
        }
        // A PCI root without routed pins still declares the PCI bus.
        let e = entries(&build(1, EBDA_START, Some(&[])).unwrap());
        assert_eq!(buses(&e).len(), 2);
        assert_eq!(routes_to(&e, 23), [(0, 1, 23)]);
    }

    #[test]
    fn rejects_pci_interrupts_out_of_range() {
        let ok = PciInterrupt {
            slot: 31,
            pin: 4,
            ioapic_pin: 23,
        };
        assert!(build(1, EBDA_START, Some(&[ok])).is_ok());
        for bad in [
            PciInterrupt { slot: 32, ..ok },
            PciInterrupt { pin: 0, ..ok },
            PciInterrupt { pin: 5, ..ok },
            PciInterrupt {
                ioapic_pin: IOAPIC_PINS,
                ..ok
            },
        ] {
            assert!(matches!(
                build(1, EBDA_START, Some(&[bad])),
                Err(MpTableError::PciInterrupt(b)) if b == bad
            ));
        }
        let too_many = vec![ok; 129];
        assert!(matches!(
            build(1, EBDA_START, Some(&too_many)),
            Err(MpTableError::TooManyPciInterrupts(129))
        ));
    }
}
