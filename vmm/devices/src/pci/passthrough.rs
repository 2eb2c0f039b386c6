//! The configuration space a guest sees of a passed-through device (the VMM's VFIO devices):
//! which registers the VMM emulates and which reach the device itself.
//!
//! Emulated: the BARs (the VMM places them and the guest may size and move them), the
//! expansion ROM (not offered: reads 0), the capability list (hidden: the pointer reads 0 and
//! the status register's capability bit is cleared) and the Interrupt Line / Pin (the GSI and
//! pin the VMM routed). The command register is passed to the device and kept here too (its
//! decode bits say whether the BARs are live). Everything else is the device's own, read and
//! written through VFIO's config region, which vfio-pci filters again.
//!
//! [`PassthroughConfig::write`] is the filter every guest write goes through: it says whether
//! the write reaches the device and whether the BAR mappings must follow; it never forwards a
//! write to an emulated register, an access wider than a dword's rest, or one past the 256
//! bytes of conventional configuration space.

use super::bar::{Bar, BarKind, BarRegs, BAR_COUNT};
use super::interrupt::InterruptRegs;
use super::{merge_dword, regs, BarSpace, CONFIG_SPACE_SIZE};

/// What a guest's configuration write asks of the VMM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteAction {
    /// Forward the write, as it is, to the device's own configuration space.
    pub forward: bool,
    /// The BARs or the decode bits changed: place the BAR mappings again.
    pub remap: bool,
}

/// The emulated part of a passed-through device's configuration space.
#[derive(Debug, Clone)]
pub struct PassthroughConfig {
    bars: BarRegs,
    /// The guest's command register (memory / I/O decode), as last written.
    command: u16,
    /// Interrupt Line / Pin: the GSI and pin the VMM routed; the guest may overwrite the line
    /// (scratch), which changes nothing in the routing.
    interrupt: InterruptRegs,
}

impl Default for PassthroughConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl PassthroughConfig {
    /// No BARs, command 0, no interrupt.
    pub fn new() -> Self {
        Self {
            bars: BarRegs::new(),
            command: 0,
            interrupt: InterruptRegs::none(),
        }
    }

    /// The BARs as the guest last set them.
    pub fn bars(&self) -> &BarRegs {
        &self.bars
    }

    /// Places BAR `index` (set-up, before the guest runs).
    pub fn set_bar(&mut self, index: usize, bar: Bar) -> Result<(), super::BarError> {
        self.bars.set(index, bar)
    }

    /// The command register as the guest last wrote it.
    pub fn command(&self) -> u16 {
        self.command
    }

    /// Sets the command register (set-up: the device's own decode bits).
    pub fn set_command(&mut self, command: u16) {
        self.command = command;
    }

    /// Sets the Interrupt Line / Pin (set-up: the routed INTx).
    pub fn set_interrupt(&mut self, interrupt: InterruptRegs) {
        self.interrupt = interrupt;
    }

    /// Whether the guest has decoding on for BARs of `kind`.
    pub fn decodes(&self, kind: BarKind) -> bool {
        let bit = match kind {
            BarKind::Io => regs::COMMAND_IO,
            _ => regs::COMMAND_MEMORY,
        };
        self.command & bit != 0
    }

    /// The decoding BAR of `space` that holds `[addr, addr + len)`, and the offset into it.
    pub fn find_bar(&self, space: BarSpace, addr: u64, len: usize) -> Option<(usize, u64)> {
        self.bars.iter().find_map(|(i, bar)| {
            (bar.kind.space() == space && self.decodes(bar.kind))
                .then(|| bar.contains(addr, len).map(|o| (i, o)))
                .flatten()
        })
    }

    /// The guest's read of dword `reg`; `device` reads the device's own dword `reg`.
    pub fn read(&self, reg: usize, device: impl FnOnce(usize) -> u32) -> u32 {
        let Some(offset) = reg.checked_mul(4) else {
            return u32::MAX;
        };
        match offset {
            o if (regs::BAR0..regs::BAR0 + 4 * BAR_COUNT).contains(&o) => {
                self.bars.read((o - regs::BAR0) / 4)
            }
            // No expansion ROM is offered.
            regs::ROM => 0,
            // The capability list is hidden (no MSI/MSI-X emulation yet): clear the status bit.
            regs::COMMAND => device(reg) & !(u32::from(regs::STATUS_CAP_LIST) << 16),
            regs::CAPABILITIES => 0,
            // Interrupt line (scratch, initially the GSI) and pin (the routed pin, or none).
            regs::INTERRUPT_LINE => self.interrupt.read(device(reg)),
            o if o < CONFIG_SPACE_SIZE => device(reg),
            _ => u32::MAX,
        }
    }

    /// The guest's write of `data` at byte `offset`: updates the emulated registers and says
    /// what else to do ([`WriteAction`]).
    pub fn write(&mut self, offset: usize, data: &[u8]) -> WriteAction {
        let reg_base = offset & !3;
        let within = offset & 3;
        if !matches!(data.len(), 1 | 2 | 4)
            || within + data.len() > 4
            || offset >= CONFIG_SPACE_SIZE
        {
            return WriteAction::default();
        }
        match reg_base {
            o if (regs::BAR0..regs::BAR0 + 4 * BAR_COUNT).contains(&o) => WriteAction {
                forward: false,
                remap: self
                    .bars
                    .write((o - regs::BAR0) / 4, within, data)
                    .is_some(),
            },
            // The guest may write the line byte (scratch); the pin, Min_Gnt and Max_Lat are
            // read-only. Neither changes where INTx goes.
            regs::INTERRUPT_LINE => {
                self.interrupt.write(within, data);
                WriteAction::default()
            }
            regs::ROM | regs::CAPABILITIES => WriteAction::default(),
            regs::COMMAND => {
                let remap = match merge_dword(u32::from(self.command), within, data) {
                    Some(v) => {
                        self.command = v as u16;
                        true
                    }
                    None => false,
                };
                WriteAction {
                    forward: true,
                    remap,
                }
            }
            _ => WriteAction {
                forward: true,
                remap: false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> PassthroughConfig {
        let mut c = PassthroughConfig::new();
        c.set_bar(
            0,
            Bar {
                kind: BarKind::Memory32 {
                    prefetchable: false,
                },
                size: 0x1000,
                addr: 0xe000_0000,
            },
        )
        .unwrap();
        c.set_interrupt(InterruptRegs::routed(1, 23).unwrap());
        c
    }

    #[test]
    fn emulated_registers_never_reach_the_device() {
        let mut c = config();
        assert_eq!(c.read(0x3c / 4, |_| 0xffff_ffff) & 0xffff, 0x0117);
        for offset in [0x10, 0x14, 0x24, 0x30, 0x33, 0x34, 0x3c, 0x3d, 0x3f] {
            assert!(!c.write(offset, &[0xff]).forward, "offset {offset:#x}");
        }
        assert!(!c.write(0x10, &[0xff; 4]).forward);
        assert_eq!(c.read(0x30 / 4, |_| u32::MAX), 0);
        assert_eq!(c.read(0x34 / 4, |_| u32::MAX), 0);
        // The line byte is the guest's scratch, the pin stays.
        assert_eq!(c.read(0x3c / 4, |_| 0xffff_ffff) & 0xffff, 0x01ff);
        // The status register's capability bit is hidden.
        assert_eq!(c.read(1, |_| 0x0010_0000), 0);
    }

    #[test]
    fn command_and_device_registers_are_forwarded_within_the_space() {
        let mut c = config();
        let a = c.write(0x04, &[0x02, 0x00]);
        assert_eq!(
            a,
            WriteAction {
                forward: true,
                remap: true
            }
        );
        assert!(c.decodes(BarKind::Memory32 {
            prefetchable: false
        }));
        assert_eq!(
            c.find_bar(BarSpace::Memory, 0xe000_0ffc, 4),
            Some((0, 0xffc))
        );
        assert!(c.write(0x40, &[1, 2, 3, 4]).forward);
        assert!(!c.write(0x100, &[1]).forward);
        assert!(!c.write(0x43, &[1, 2]).forward);
        assert!(!c.write(0x40, &[1, 2, 3]).forward);
        assert_eq!(c.read(64, |_| 7), u32::MAX);
        assert_eq!(c.read(usize::MAX, |_| 7), u32::MAX);
    }
}
