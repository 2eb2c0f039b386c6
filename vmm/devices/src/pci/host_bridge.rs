//! The host bridge at 00:00.0: what a guest looks for to trust configuration mechanism #1
//! (Linux's sanity check wants a host bridge or a display class on bus 0).

use super::{merge_dword, regs, BarSpace, PciDevice};

/// Red Hat's vendor id and QEMU's "PCIe host bridge" device id, which guests know as a plain
/// host bridge needing no driver.
const VENDOR: u32 = 0x1b36;
const DEVICE: u32 = 0x0008;
/// Class 06 (bridge), subclass 00 (host), prog-if 00, revision 0.
const CLASS_REVISION: u32 = 0x0600_0000;

/// A host bridge with no BARs; only its command register is writable.
pub struct HostBridge {
    command: u16,
}

impl Default for HostBridge {
    fn default() -> Self {
        Self::new()
    }
}

impl HostBridge {
    pub fn new() -> Self {
        Self { command: 0 }
    }
}

impl PciDevice for HostBridge {
    fn config_read(&mut self, reg: usize) -> u32 {
        match reg * 4 {
            regs::VENDOR_ID => (DEVICE << 16) | VENDOR,
            regs::COMMAND => u32::from(self.command),
            regs::CLASS_REVISION => CLASS_REVISION,
            _ => 0,
        }
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        if offset & !3 == regs::COMMAND {
            if let Some(v) = merge_dword(u32::from(self.command), offset & 3, data) {
                // Memory, I/O and bus-master enable: the bits a host bridge keeps.
                self.command = (v as u16) & 0x7;
            }
        }
    }

    fn bar_read(&mut self, _space: BarSpace, _addr: u64, _data: &mut [u8]) -> bool {
        false
    }

    fn bar_write(&mut self, _space: BarSpace, _addr: u64, _data: &[u8]) -> bool {
        false
    }
}
