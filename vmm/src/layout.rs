//! The guest physical layout (x86_64), a fixed contract with the guests and the CLI.

/// The GDT the VMM writes for the boot vCPU.
pub const BOOT_GDT_START: u64 = 0x500;
/// An empty IDT (the guest installs its own).
pub const BOOT_IDT_START: u64 = 0x520;
/// PVH: the hvm_start_info structure.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH: the module list (the initrd), right after the start info.
pub const PVH_MODLIST_START: u64 = 0x6040;
/// PVH: the memory map.
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Linux: the zero page (boot_params).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer of the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page tables: PML4, then the PDPT and the PD mapping the first GiB with 2 MiB pages.
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Where the kernel command line is written, and its maximum size (with the NUL).
pub const CMDLINE_START: u64 = 0x20000;
pub const CMDLINE_MAX_SIZE: usize = 4096;
/// Start of the extended BIOS data area: the MP table lives here; RAM below it is usable.
pub const EBDA_START: u64 = 0x9fc00;
/// Kernels are loaded at or above 1 MiB.
pub const HIMEM_START: u64 = 0x10_0000;
/// The MMIO gap: no RAM between 3 GiB and 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// virtio-mmio devices: one 4 KiB window each from here, interrupt GSI 5 + index.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
pub const VIRTIO_MMIO_FIRST_GSI: u32 = 5;
/// How many virtio-mmio devices fit (GSIs 5..=23 on the IOAPIC).
pub const VIRTIO_MMIO_MAX_DEVICES: u32 = 19;
/// PCI (only when the VM has PCI devices): BARs are placed in this window of the MMIO gap, above
/// the virtio-mmio slots and below the IOAPIC; I/O BARs in ports 0xc000..0x10000.
pub const PCI_MMIO_START: u64 = 0xe000_0000;
pub const PCI_MMIO_END: u64 = 0xfec0_0000;
pub const PCI_IO_START: u64 = 0xc000;
pub const PCI_IO_END: u64 = 0x1_0000;
/// KVM memory slots for mmap-able BARs start here (guest RAM takes slots 0 and 1).
pub const PCI_BAR_FIRST_SLOT: u32 = 16;
/// PCI INTx (passed-through devices' pin interrupts): one IOAPIC pin each, taken from the top
/// (23, 22, ...) down, so the first eight are above the ISA IRQs (no PIC input) and they never
/// meet the virtio-mmio GSIs, which count up from 5. Level-triggered, active low (MP table).
pub const PCI_INTX_LAST_GSI: u32 = IOAPIC_PINS as u32 - 1;
/// The IOAPIC and the local APICs.
pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const APIC_START: u64 = 0xfee0_0000;
/// KVM's TSS (three pages) and identity-map page, at the top of the MMIO gap.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;
/// COM1.
pub const SERIAL_PORT: u64 = 0x3f8;
pub const SERIAL_GSI: u32 = 4;
/// IOAPIC pins.
pub const IOAPIC_PINS: u8 = 24;
/// The largest guest RAM we accept.
pub const MAX_MEMORY_MIB: u64 = 64 * 1024;
/// The most vCPUs: APIC ids 0..=253, the IOAPIC takes the next id and 0xff is broadcast.
pub const MAX_VCPUS: u8 = 254;

/// The IOAPIC pins free for PCI INTx once `virtio_devices` virtio-mmio devices hold GSIs
/// 5, 6, ...: from 23 down to the first pin above the last virtio-mmio GSI (empty when they fill
/// the IOAPIC).
pub fn pci_intx_gsis(virtio_devices: u32) -> impl Iterator<Item = u32> {
    let lowest = VIRTIO_MMIO_FIRST_GSI.saturating_add(virtio_devices);
    (lowest..=PCI_INTX_LAST_GSI).rev()
}

// The PCI window sits in the MMIO gap, clear of the virtio-mmio slots and of the APICs.
const _: () =
    assert!(VIRTIO_MMIO_BASE + VIRTIO_MMIO_SIZE * VIRTIO_MMIO_MAX_DEVICES as u64 <= PCI_MMIO_START);
const _: () = assert!(PCI_MMIO_START >= MMIO_GAP_START && PCI_MMIO_END <= IOAPIC_START);
const _: () = assert!(SERIAL_PORT + 8 <= PCI_IO_START);
const _: () = assert!(
    VIRTIO_MMIO_FIRST_GSI + VIRTIO_MMIO_MAX_DEVICES - 1 == PCI_INTX_LAST_GSI
        && SERIAL_GSI < VIRTIO_MMIO_FIRST_GSI
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_intx_gsis_come_from_the_top_and_never_meet_virtio_or_serial() {
        assert_eq!(pci_intx_gsis(0).take(3).collect::<Vec<_>>(), [23, 22, 21]);
        assert_eq!(pci_intx_gsis(0).count(), 19);
        for virtio in 0..=VIRTIO_MMIO_MAX_DEVICES + 2 {
            let virtio_gsis = VIRTIO_MMIO_FIRST_GSI..VIRTIO_MMIO_FIRST_GSI + virtio;
            for gsi in pci_intx_gsis(virtio) {
                assert!(
                    !virtio_gsis.contains(&gsi),
                    "{gsi} with {virtio} virtio devices"
                );
                assert!(gsi != SERIAL_GSI && gsi < u32::from(IOAPIC_PINS));
            }
            assert_eq!(
                pci_intx_gsis(virtio).count() as u32,
                VIRTIO_MMIO_MAX_DEVICES.saturating_sub(virtio)
            );
        }
        assert_eq!(pci_intx_gsis(u32::MAX).count(), 0);
    }
}
