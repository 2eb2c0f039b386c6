//! A PCI root for the VMM: bus 0 with a host bridge at 00:00.0, configuration access through the
//! legacy port pair 0xCF8 (address) / 0xCFC (data), and BAR windows on the MMIO and port buses
//! that route guest accesses to whichever device decodes them.
//!
//! Only bus 0, function 0 of each slot exists (no bridges, no multi-function devices); config
//! reads of anything else read as all ones, which is how a guest learns a slot is empty. There is
//! no ECAM (MMCONFIG) window: without ACPI the guest kernel uses configuration mechanism #1.
//!
//! Everything here is driven by guest writes: any address, size or value is accepted, and the
//! worst outcome is an access that reads as ones or a write that is dropped.

mod bar;
mod config_io;
mod host_bridge;
mod interrupt;
mod passthrough;

use std::sync::{Arc, Mutex};

pub use bar::{Bar, BarError, BarKind, BarRegs, BAR_COUNT};
pub use config_io::{PciConfigIo, PCI_CONFIG_IO_BASE, PCI_CONFIG_IO_LEN};
pub use host_bridge::HostBridge;
pub use interrupt::{InterruptRegs, NO_INTERRUPT_LINE};
pub use passthrough::{PassthroughConfig, WriteAction};

use crate::bus::{lock, BusDevice};

/// Device slots on bus 0.
pub const PCI_SLOTS: usize = 32;
/// Bytes of (conventional) configuration space reachable through 0xCF8/0xCFC.
pub const CONFIG_SPACE_SIZE: usize = 256;

/// Common configuration-space offsets (type 0 header).
pub mod regs {
    pub const VENDOR_ID: usize = 0x00;
    pub const COMMAND: usize = 0x04;
    pub const STATUS: usize = 0x06;
    pub const CLASS_REVISION: usize = 0x08;
    pub const HEADER_TYPE: usize = 0x0e;
    pub const BAR0: usize = 0x10;
    pub const ROM: usize = 0x30;
    pub const CAPABILITIES: usize = 0x34;
    pub const INTERRUPT_LINE: usize = 0x3c;
    /// Command register: I/O space decode.
    pub const COMMAND_IO: u16 = 1 << 0;
    /// Command register: memory space decode.
    pub const COMMAND_MEMORY: u16 = 1 << 1;
    /// Status register: the capabilities list is present.
    pub const STATUS_CAP_LIST: u16 = 1 << 4;
}

/// Which address space a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarSpace {
    Io,
    Memory,
}

/// A device on the PCI root. Offsets are bytes into its configuration space; `data` is 1, 2 or
/// 4 bytes and never crosses a dword (the root guarantees both).
pub trait PciDevice: Send {
    /// Reads the dword at configuration register `reg` (0..64).
    fn config_read(&mut self, reg: usize) -> u32;
    /// Writes `data` at byte `offset` (0..256) of the configuration space.
    fn config_write(&mut self, offset: usize, data: &[u8]);
    /// A guest read at `addr` of `space`: returns false when none of the device's BARs decodes
    /// it (then the next device is asked).
    fn bar_read(&mut self, space: BarSpace, addr: u64, data: &mut [u8]) -> bool;
    /// A guest write at `addr` of `space`; false when no BAR of the device decodes it.
    fn bar_write(&mut self, space: BarSpace, addr: u64, data: &[u8]) -> bool;
}

/// A shared PCI device.
pub type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

/// Errors of building the PCI root.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciError {
    /// All 32 slots of bus 0 are taken.
    #[error("all {PCI_SLOTS} slots of PCI bus 0 are taken")]
    NoFreeSlot,
}

/// Bus 0: its slots. Built before the VM runs, then shared read-only by the buses.
pub struct PciRoot {
    slots: Vec<Option<SharedPciDevice>>,
}

impl Default for PciRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl PciRoot {
    /// Bus 0 with the host bridge in slot 0.
    pub fn new() -> Self {
        let mut slots: Vec<Option<SharedPciDevice>> = vec![None; PCI_SLOTS];
        slots[0] = Some(Arc::new(Mutex::new(HostBridge::new())));
        Self { slots }
    }

    /// Puts `device` in the first free slot and returns the slot number (its device number).
    pub fn add_device(&mut self, device: SharedPciDevice) -> Result<u8, PciError> {
        let (i, slot) = self
            .slots
            .iter_mut()
            .enumerate()
            .find(|(_, s)| s.is_none())
            .ok_or(PciError::NoFreeSlot)?;
        *slot = Some(device);
        // PCI_SLOTS is 32: the index fits a u8.
        Ok(i as u8)
    }

    /// The device in `slot` of bus 0, if any.
    pub fn device(&self, slot: usize) -> Option<&SharedPciDevice> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    fn devices(&self) -> impl Iterator<Item = &SharedPciDevice> {
        self.slots.iter().flatten()
    }
}

/// Merges `data` written at byte `offset` of a dword into `current`. None when the access does
/// not fit the dword or has a size other than 1, 2 or 4.
pub fn merge_dword(current: u32, offset: usize, data: &[u8]) -> Option<u32> {
    if !matches!(data.len(), 1 | 2 | 4) || offset.checked_add(data.len())? > 4 {
        return None;
    }
    let mut bytes = current.to_le_bytes();
    bytes[offset..offset + data.len()].copy_from_slice(data);
    Some(u32::from_le_bytes(bytes))
}

/// Copies bytes `offset..offset + data.len()` of `value` into `data` (ones past the dword).
pub fn extract_dword(value: u32, offset: usize, data: &mut [u8]) {
    let bytes = value.to_le_bytes();
    for (i, b) in data.iter_mut().enumerate() {
        *b = offset
            .checked_add(i)
            .and_then(|o| bytes.get(o))
            .copied()
            .unwrap_or(0xff);
    }
}

/// A window of the MMIO or port bus in which BARs are placed: an access inside it goes to the
/// device whose BAR decodes the address, or reads as ones when none does.
pub struct PciBarWindow {
    root: Arc<PciRoot>,
    space: BarSpace,
    base: u64,
}

impl PciBarWindow {
    /// The window that starts at `base` of `space` (its length is given to the bus).
    pub fn new(root: Arc<PciRoot>, space: BarSpace, base: u64) -> Self {
        Self { root, space, base }
    }
}

impl BusDevice for PciBarWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let Some(addr) = self.base.checked_add(offset) {
            for dev in self.root.devices() {
                if lock(dev).bar_read(self.space, addr, data) {
                    return;
                }
            }
        }
        data.fill(0xff);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(addr) = self.base.checked_add(offset) {
            for dev in self.root.devices() {
                if lock(dev).bar_write(self.space, addr, data) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_extract_bytes_of_a_dword() {
        assert_eq!(merge_dword(0x1122_3344, 1, &[0xaa]), Some(0x1122_aa44));
        assert_eq!(
            merge_dword(0x1122_3344, 2, &[0xaa, 0xbb]),
            Some(0xbbaa_3344)
        );
        assert_eq!(merge_dword(0, 0, &[1, 2, 3, 4]), Some(0x0403_0201));
        assert_eq!(merge_dword(0, 3, &[1, 2]), None);
        assert_eq!(merge_dword(0, 0, &[1, 2, 3]), None);
        assert_eq!(merge_dword(0, usize::MAX, &[1]), None);
        let mut b = [0u8; 2];
        extract_dword(0x1122_3344, 2, &mut b);
        assert_eq!(b, [0x22, 0x11]);
        extract_dword(0x1122_3344, 3, &mut b);
        assert_eq!(b, [0x11, 0xff]);
    }

    /// A device with one emulated 16-byte memory BAR backed by a register file, decoding only
    /// while its command register has memory decoding on: what the window routes to.
    struct Scratch {
        bars: BarRegs,
        command: u16,
        data: [u8; 16],
    }

    impl PciDevice for Scratch {
        fn config_read(&mut self, reg: usize) -> u32 {
            match reg {
                1 => u32::from(self.command),
                4..=9 => self.bars.read(reg - 4),
                _ => 0,
            }
        }
        fn config_write(&mut self, offset: usize, data: &[u8]) {
            match offset & !3 {
                regs::COMMAND => {
                    if let Some(v) = merge_dword(u32::from(self.command), offset & 3, data) {
                        self.command = v as u16;
                    }
                }
                o @ 0x10..=0x27 => {
                    self.bars.write((o - 0x10) / 4, offset & 3, data);
                }
                _ => {}
            }
        }
        fn bar_read(&mut self, space: BarSpace, addr: u64, data: &mut [u8]) -> bool {
            let Some(bar) = self.bars.get(0) else {
                return false;
            };
            match bar.contains(addr, data.len()) {
                Some(o)
                    if space == BarSpace::Memory && self.command & regs::COMMAND_MEMORY != 0 =>
                {
                    let o = o as usize;
                    data.copy_from_slice(&self.data[o..o + data.len()]);
                    true
                }
                _ => false,
            }
        }
        fn bar_write(&mut self, space: BarSpace, addr: u64, data: &[u8]) -> bool {
            let Some(bar) = self.bars.get(0) else {
                return false;
            };
            match bar.contains(addr, data.len()) {
                Some(o)
                    if space == BarSpace::Memory && self.command & regs::COMMAND_MEMORY != 0 =>
                {
                    let o = o as usize;
                    self.data[o..o + data.len()].copy_from_slice(data);
                    true
                }
                _ => false,
            }
        }
    }

    #[test]
    fn the_window_routes_to_the_bar_the_guest_placed_and_enabled() {
        let mut bars = BarRegs::new();
        let kind = BarKind::Memory32 {
            prefetchable: false,
        };
        bars.set(
            0,
            Bar {
                kind,
                size: 16,
                addr: 0x1000,
            },
        )
        .unwrap();
        let mut root = PciRoot::new();
        let dev = Arc::new(Mutex::new(Scratch {
            bars,
            command: 0,
            data: [0; 16],
        }));
        assert_eq!(root.add_device(dev).unwrap(), 1);
        let root = Arc::new(root);
        let mut io = PciConfigIo::new(root.clone());
        let mut window = PciBarWindow::new(root, BarSpace::Memory, 0x1000);
        let select = |io: &mut PciConfigIo, reg: u32| {
            io.write(0, &(0x8000_0000u32 | (1 << 11) | (reg << 2)).to_le_bytes())
        };

        let mut d = [0u8; 4];
        window.write(4, &[1, 2, 3, 4]);
        window.read(4, &mut d);
        assert_eq!(d, [0xff; 4], "decoding off: nothing answers");

        select(&mut io, 1);
        io.write(4, &(regs::COMMAND_MEMORY as u32).to_le_bytes());
        window.write(4, &[1, 2, 3, 4]);
        window.read(4, &mut d);
        assert_eq!(d, [1, 2, 3, 4]);
        window.read(14, &mut d);
        assert_eq!(
            d, [0xff; 4],
            "an access running past the BAR is not decoded"
        );

        // The guest moves the BAR up by 0x100: the old address goes dead, the new one answers.
        select(&mut io, 4);
        io.write(4, &0x1100u32.to_le_bytes());
        window.read(4, &mut d);
        assert_eq!(d, [0xff; 4]);
        window.read(0x104, &mut d);
        assert_eq!(d, [1, 2, 3, 4]);
        // An offset that overflows the window's base is dropped, not wrapped.
        window.read(u64::MAX, &mut d);
        assert_eq!(d, [0xff; 4]);
    }

    #[test]
    fn slots_fill_in_order_and_run_out() {
        let mut root = PciRoot::new();
        for want in 1..PCI_SLOTS {
            let d: SharedPciDevice = Arc::new(Mutex::new(HostBridge::new()));
            assert_eq!(root.add_device(d).unwrap() as usize, want);
        }
        let d: SharedPciDevice = Arc::new(Mutex::new(HostBridge::new()));
        assert_eq!(root.add_device(d), Err(PciError::NoFreeSlot));
    }
}
