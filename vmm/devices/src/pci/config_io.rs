//! Configuration mechanism #1: the address register at 0xCF8 and the data window at 0xCFC.

use std::sync::Arc;

use super::{extract_dword, PciRoot};
use crate::bus::{lock, BusDevice};

/// The first port of the pair, and how many ports it takes (0xCF8..=0xCFF).
pub const PCI_CONFIG_IO_BASE: u64 = 0xcf8;
pub const PCI_CONFIG_IO_LEN: u64 = 8;

const ENABLE: u32 = 1 << 31;
/// The bits of the address register that hold something: enable, bus, device, function, dword.
const ADDRESS_MASK: u32 = ENABLE | 0x00ff_fffc;

/// The port pair, on the port-I/O bus.
pub struct PciConfigIo {
    root: Arc<PciRoot>,
    address: u32,
}

impl PciConfigIo {
    pub fn new(root: Arc<PciRoot>) -> Self {
        Self { root, address: 0 }
    }

    /// The slot and dword the address register selects, when it selects a device that exists
    /// (bus 0, function 0, enable bit set).
    fn target(&self) -> Option<(usize, usize)> {
        let a = self.address;
        let bus = (a >> 16) & 0xff;
        let slot = ((a >> 11) & 0x1f) as usize;
        let function = (a >> 8) & 0x7;
        let reg = ((a & 0xfc) >> 2) as usize;
        (a & ENABLE != 0 && bus == 0 && function == 0 && self.root.device(slot).is_some())
            .then_some((slot, reg))
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            // Only whole-dword reads of the address register (byte accesses to 0xCF8..0xCFB
            // belong to the old mechanism #2, which we do not have).
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 => {
                let within = (offset - 4) as usize;
                match self.target() {
                    Some((slot, reg)) => {
                        let value = self
                            .root
                            .device(slot)
                            .map_or(u32::MAX, |d| lock(d).config_read(reg));
                        extract_dword(value, within, data);
                    }
                    None => data.fill(0xff),
                }
            }
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            0 => {
                if let Ok(b) = <[u8; 4]>::try_from(data) {
                    self.address = u32::from_le_bytes(b) & ADDRESS_MASK;
                }
            }
            4..=7 => {
                let within = (offset - 4) as usize;
                if within + data.len() > 4 || !matches!(data.len(), 1 | 2 | 4) {
                    return;
                }
                if let Some((slot, reg)) = self.target() {
                    if let Some(dev) = self.root.device(slot) {
                        lock(dev).config_write(reg * 4 + within, data);
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

    fn select(io: &mut PciConfigIo, slot: u32, function: u32, reg: u32) {
        let a = ENABLE | (slot << 11) | (function << 8) | (reg << 2);
        io.write(0, &a.to_le_bytes());
    }

    #[test]
    fn finds_the_host_bridge_and_nothing_else() {
        let mut io = PciConfigIo::new(Arc::new(PciRoot::new()));
        // Linux's type 1 probe: a byte write to 0xCFB is ignored, the dword write reads back.
        io.write(3, &[1]);
        io.write(0, &ENABLE.to_le_bytes());
        let mut d = [0u8; 4];
        io.read(0, &mut d);
        assert_eq!(u32::from_le_bytes(d), ENABLE);

        select(&mut io, 0, 0, 2);
        io.read(4, &mut d);
        assert_eq!(u32::from_le_bytes(d) >> 16, 0x0600, "host bridge class");
        let mut w = [0u8; 2];
        io.read(6, &mut w);
        assert_eq!(u16::from_le_bytes(w), 0x0600);

        select(&mut io, 1, 0, 0);
        io.read(4, &mut d);
        assert_eq!(d, [0xff; 4], "empty slot");
        select(&mut io, 0, 1, 0);
        io.read(4, &mut d);
        assert_eq!(d, [0xff; 4], "no function 1");
        io.write(0, &(0x0001_0000u32).to_le_bytes());
        io.read(4, &mut d);
        assert_eq!(d, [0xff; 4], "enable bit clear");
    }

    #[test]
    fn odd_accesses_are_harmless() {
        let mut io = PciConfigIo::new(Arc::new(PciRoot::new()));
        select(&mut io, 0, 0, 63);
        for offset in 0..10u64 {
            for len in 0..9 {
                let mut d = vec![0u8; len];
                io.read(offset, &mut d);
                io.write(offset, &vec![0xffu8; len]);
            }
        }
        io.write(0, &u32::MAX.to_le_bytes());
        let mut d = [0u8; 4];
        io.read(4, &mut d);
    }
}
