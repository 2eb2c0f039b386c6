//! Emulated base address registers: what the guest reads back when it sizes a BAR (writes all
//! ones), where it has placed it, and which BAR decodes an address.

use super::{extract_dword, merge_dword, BarSpace};

/// BARs of a type 0 header.
pub const BAR_COUNT: usize = 6;

/// The kind of a BAR, as its low bits tell the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Io,
    Memory32 {
        prefetchable: bool,
    },
    /// Takes two registers: this one and the next (the high dword).
    Memory64 {
        prefetchable: bool,
    },
}

impl BarKind {
    fn flags(self) -> u32 {
        match self {
            BarKind::Io => 0b01,
            BarKind::Memory32 { prefetchable } => u32::from(prefetchable) << 3,
            BarKind::Memory64 { prefetchable } => 0b100 | (u32::from(prefetchable) << 3),
        }
    }

    /// The address space it decodes.
    pub fn space(self) -> BarSpace {
        match self {
            BarKind::Io => BarSpace::Io,
            _ => BarSpace::Memory,
        }
    }

    /// The kind a device's BAR register value declares, from its low bits.
    pub fn from_register(value: u32) -> Self {
        if value & 1 == 1 {
            return BarKind::Io;
        }
        let prefetchable = value & 0b1000 != 0;
        if value & 0b110 == 0b100 {
            BarKind::Memory64 { prefetchable }
        } else {
            BarKind::Memory32 { prefetchable }
        }
    }
}

/// One BAR: its kind, its size (a power of two) and the address the guest gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bar {
    pub kind: BarKind,
    pub size: u64,
    pub addr: u64,
}

impl Bar {
    /// The range it decodes, when it fits the address space.
    pub fn contains(&self, addr: u64, len: usize) -> Option<u64> {
        let offset = addr.checked_sub(self.addr)?;
        let end = offset.checked_add(len as u64)?;
        (end <= self.size).then_some(offset)
    }

    fn address_mask(&self) -> u64 {
        let mask = !(self.size - 1);
        match self.kind {
            BarKind::Memory64 { .. } => mask,
            _ => mask & 0xffff_ffff,
        }
    }
}

/// The six BAR registers of a device.
#[derive(Debug, Default, Clone)]
pub struct BarRegs {
    bars: [Option<Bar>; BAR_COUNT],
}

/// Errors of declaring a BAR.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BarError {
    #[error("BAR {0} does not exist (there are {BAR_COUNT})")]
    Index(usize),
    #[error("BAR {index}: size {size:#x} is not a power of two of at least 16 (4 for I/O)")]
    Size { index: usize, size: u64 },
    #[error("BAR {0}: a 64-bit BAR needs the next register for its high dword")]
    NoHighHalf(usize),
    #[error("BAR {0}: the register is taken (a 64-bit BAR's high dword or already set)")]
    Taken(usize),
}

impl BarRegs {
    /// No BARs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares BAR `index` at `addr` (the VMM's initial placement, which the guest may move).
    pub fn set(&mut self, index: usize, bar: Bar) -> Result<(), BarError> {
        let min = if bar.kind == BarKind::Io { 4 } else { 16 };
        if index >= BAR_COUNT {
            return Err(BarError::Index(index));
        }
        if !bar.size.is_power_of_two() || bar.size < min {
            return Err(BarError::Size {
                index,
                size: bar.size,
            });
        }
        if matches!(bar.kind, BarKind::Memory64 { .. }) && index + 1 >= BAR_COUNT {
            return Err(BarError::NoHighHalf(index));
        }
        if self.bars[index].is_some() || self.is_high_half(index) {
            return Err(BarError::Taken(index));
        }
        let mut bar = bar;
        bar.addr &= bar.address_mask();
        self.bars[index] = Some(bar);
        Ok(())
    }

    /// BAR `index`, if declared.
    pub fn get(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    fn is_high_half(&self, index: usize) -> bool {
        index > 0
            && matches!(
                self.bars.get(index - 1),
                Some(Some(Bar {
                    kind: BarKind::Memory64 { .. },
                    ..
                }))
            )
    }

    /// The value of BAR register `index` (0..6), as the guest reads it.
    pub fn read(&self, index: usize) -> u32 {
        if self.is_high_half(index) {
            return self.bars[index - 1].map_or(0, |b| (b.addr >> 32) as u32);
        }
        match self.get(index) {
            Some(b) => (b.addr as u32) | b.kind.flags(),
            None => 0,
        }
    }

    /// Reads bytes of BAR register `index` at byte `offset` of it.
    pub fn read_bytes(&self, index: usize, offset: usize, data: &mut [u8]) {
        extract_dword(self.read(index), offset, data);
    }

    /// A guest write of `data` at byte `offset` of BAR register `index`. Returns the index of
    /// the BAR whose address changed, if one did.
    pub fn write(&mut self, index: usize, offset: usize, data: &[u8]) -> Option<usize> {
        let value = merge_dword(self.read(index), offset, data)?;
        let (bar_index, high) = if self.is_high_half(index) {
            (index - 1, true)
        } else {
            (index, false)
        };
        let bar = self.bars.get_mut(bar_index)?.as_mut()?;
        let old = bar.addr;
        let addr = if high {
            (bar.addr & 0xffff_ffff) | (u64::from(value) << 32)
        } else {
            (bar.addr & !0xffff_ffff) | u64::from(value)
        };
        bar.addr = addr & bar.address_mask();
        (bar.addr != old).then_some(bar_index)
    }

    /// The BARs, with their indices.
    pub fn iter(&self) -> impl Iterator<Item = (usize, Bar)> + '_ {
        self.bars
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.map(|b| (i, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem64(size: u64, addr: u64) -> Bar {
        Bar {
            kind: BarKind::Memory64 {
                prefetchable: false,
            },
            size,
            addr,
        }
    }

    #[test]
    fn sizing_a_32_bit_bar_reads_back_its_size() {
        let mut r = BarRegs::new();
        let bar = Bar {
            kind: BarKind::Memory32 { prefetchable: true },
            size: 0x10_0000,
            addr: 0xe000_0000,
        };
        r.set(0, bar).unwrap();
        assert_eq!(r.read(0), 0xe000_0008);
        assert_eq!(r.write(0, 0, &0xffff_ffffu32.to_le_bytes()), Some(0));
        assert_eq!(r.read(0), 0xfff0_0008);
        assert_eq!(r.write(0, 0, &0xe010_0000u32.to_le_bytes()), Some(0));
        assert_eq!(r.get(0).unwrap().addr, 0xe010_0000);
        // A byte write to the top byte only.
        r.write(0, 3, &[0xd0]);
        assert_eq!(r.get(0).unwrap().addr, 0xd010_0000);
        assert_eq!(r.read(1), 0);
        assert_eq!(r.write(1, 0, &[0xff; 4]), None);
    }

    #[test]
    fn a_64_bit_bar_spans_two_registers() {
        let mut r = BarRegs::new();
        r.set(2, mem64(0x4000, 0x1_2345_8000)).unwrap();
        assert_eq!(r.read(2), 0x2345_8004);
        assert_eq!(r.read(3), 1);
        r.write(2, 0, &[0xff; 4]);
        r.write(3, 0, &[0xff; 4]);
        assert_eq!(r.read(2), 0xffff_c004);
        assert_eq!(r.read(3), 0xffff_ffff);
        assert_eq!(r.set(3, mem64(0x1000, 0)), Err(BarError::Taken(3)));
        assert_eq!(r.set(5, mem64(0x1000, 0)), Err(BarError::NoHighHalf(5)));
    }

    #[test]
    fn io_bars_and_bad_declarations() {
        let mut r = BarRegs::new();
        let io = Bar {
            kind: BarKind::Io,
            size: 0x20,
            addr: 0xc000,
        };
        r.set(1, io).unwrap();
        assert_eq!(r.read(1), 0xc001);
        assert!(r.get(1).unwrap().contains(0xc01f, 1).is_some());
        assert!(r.get(1).unwrap().contains(0xc01f, 2).is_none());
        assert!(r.get(1).unwrap().contains(u64::MAX, 4).is_none());
        assert!(matches!(
            r.set(0, Bar { size: 0x30, ..io }),
            Err(BarError::Size { .. })
        ));
        assert_eq!(r.set(6, io), Err(BarError::Index(6)));
    }

    #[test]
    fn every_write_of_every_size_is_safe() {
        let mut r = BarRegs::new();
        r.set(0, mem64(0x1000, 0xe000_0000)).unwrap();
        r.set(
            2,
            Bar {
                kind: BarKind::Io,
                size: 4,
                addr: 0,
            },
        )
        .unwrap();
        for index in 0..8 {
            for offset in 0..6 {
                for len in 0..6 {
                    let data = vec![0xa5u8; len];
                    r.write(index, offset, &data);
                    let mut out = vec![0u8; len];
                    r.read_bytes(index, offset, &mut out);
                }
            }
        }
        assert_eq!(r.read(0) & 0xfff, 0x004);
    }

    #[test]
    fn kinds_from_register_values() {
        assert_eq!(BarKind::from_register(0xc001), BarKind::Io);
        assert_eq!(
            BarKind::from_register(0xfe00_000c),
            BarKind::Memory64 { prefetchable: true }
        );
        assert_eq!(
            BarKind::from_register(0xfe00_0000),
            BarKind::Memory32 {
                prefetchable: false
            }
        );
    }
}
