//! The PCI root as a guest drives it: configuration mechanism #1 (`PciConfigIo`, the ports
//! 0xCF8/0xCFC..0xCFF) with any address, offset, size and value, the host bridge, and two
//! passed-through devices behind the VFIO filter (`PassthroughConfig`: the emulated BARs,
//! command, ROM, capability pointer and interrupt line/pin, and which writes reach the device),
//! plus guest accesses to the memory and I/O BAR windows (`PciBarWindow`) wherever the guest
//! moved the BARs.
//!
//! The devices are the VMM's `VfioPciDevice` glue over a 256-byte array standing for the
//! hardware's configuration space (the real one needs a device bound to vfio-pci). Checked:
//! no write to an emulated register, none wider than the rest of its dword and none past 256
//! bytes ever reaches the device; the ROM and capability pointer read 0 and the status register
//! never shows a capability list; a BAR access reaches a device only inside a decoding BAR;
//! the host bridge's identity never changes.
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::tape::Tape;
use vmm_devices::bus::BusDevice;
use vmm_devices::pci::{
    regs, Bar, BarKind, BarSpace, InterruptRegs, PassthroughConfig, PciBarWindow, PciConfigIo,
    PciDevice, PciRoot, CONFIG_SPACE_SIZE,
};

const MMIO_BASE: u64 = 0xe000_0000;
const IO_BASE: u64 = 0xc000;

/// A passed-through device: the real filter over a stand-in for the hardware's config space.
struct Passthrough {
    config: PassthroughConfig,
    hardware: [u8; CONFIG_SPACE_SIZE],
}

fn emulated(offset: usize) -> bool {
    (regs::BAR0..regs::BAR0 + 24).contains(&offset)
        || (regs::ROM..regs::ROM + 8).contains(&offset)
        || (regs::INTERRUPT_LINE..regs::INTERRUPT_LINE + 4).contains(&offset)
}

impl Passthrough {
    fn new(bars: &[(usize, Bar)], pin: u8, seed: u8) -> Self {
        let mut config = PassthroughConfig::new();
        for &(i, bar) in bars {
            config.set_bar(i, bar).expect("bar");
        }
        if let Some(r) = InterruptRegs::routed(pin, 23) {
            config.set_interrupt(r);
        }
        let mut hardware = [0u8; CONFIG_SPACE_SIZE];
        for (i, b) in hardware.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(seed).wrapping_add(1);
        }
        // A capability list the guest must not see.
        hardware[regs::STATUS] |= regs::STATUS_CAP_LIST as u8;
        hardware[regs::CAPABILITIES] = 0x40;
        Self { config, hardware }
    }

    fn hw_dword(hw: &[u8; CONFIG_SPACE_SIZE], reg: usize) -> u32 {
        hw.get(reg * 4..reg * 4 + 4).map_or(u32::MAX, |b| {
            u32::from_le_bytes(b.try_into().expect("4 bytes"))
        })
    }
}

impl PciDevice for Passthrough {
    fn config_read(&mut self, reg: usize) -> u32 {
        let hw = &self.hardware;
        let v = self.config.read(reg, |r| Self::hw_dword(hw, r));
        match reg * 4 {
            regs::ROM | regs::CAPABILITIES => assert_eq!(v, 0, "register {reg} shows the device's"),
            regs::COMMAND => assert_eq!(
                v & (u32::from(regs::STATUS_CAP_LIST) << 16),
                0,
                "the capability list shows"
            ),
            _ => {}
        }
        v
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        let action = self.config.write(offset, data);
        if action.forward {
            assert!(
                !emulated(offset),
                "a write at {offset:#x} reached the device"
            );
            assert!(
                (offset & 3) + data.len() <= 4 && offset + data.len() <= CONFIG_SPACE_SIZE,
                "a {}-byte write at {offset:#x} reached the device",
                data.len()
            );
            self.hardware[offset..offset + data.len()].copy_from_slice(data);
        }
    }

    fn bar_read(&mut self, space: BarSpace, addr: u64, data: &mut [u8]) -> bool {
        let Some((index, offset)) = self.config.find_bar(space, addr, data.len()) else {
            return false;
        };
        check_inside(&self.config, index, offset, data.len());
        data.fill(index as u8);
        true
    }

    fn bar_write(&mut self, space: BarSpace, addr: u64, data: &[u8]) -> bool {
        let Some((index, offset)) = self.config.find_bar(space, addr, data.len()) else {
            return false;
        };
        check_inside(&self.config, index, offset, data.len());
        true
    }
}

fn check_inside(config: &PassthroughConfig, index: usize, offset: u64, len: usize) {
    let bar = config.bars().get(index).expect("the BAR exists");
    assert!(
        config.decodes(bar.kind),
        "an access to a BAR that is not decoded"
    );
    assert!(
        offset + len as u64 <= bar.size,
        "an access past the end of BAR {index}"
    );
}

fn mem32(size: u64, addr: u64) -> Bar {
    Bar {
        kind: BarKind::Memory32 {
            prefetchable: false,
        },
        size,
        addr,
    }
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::pci_config);
    },
    |data: &[u8]| {
    let mut t = Tape::new(data);
    let mut root = PciRoot::new();
    let a = Passthrough::new(
        &[
            (0, mem32(0x1000, MMIO_BASE)),
            (
                2,
                Bar {
                    kind: BarKind::Memory64 { prefetchable: true },
                    size: 0x10_0000,
                    addr: MMIO_BASE + 0x10_0000,
                },
            ),
            (
                4,
                Bar {
                    kind: BarKind::Io,
                    size: 0x20,
                    addr: IO_BASE,
                },
            ),
        ],
        1,
        3,
    );
    let b = Passthrough::new(&[(1, mem32(0x10, MMIO_BASE + 0x2000))], 0, 7);
    for d in [a, b] {
        let d: Arc<Mutex<dyn PciDevice>> = Arc::new(Mutex::new(d));
        root.add_device(d).expect("slot");
    }
    let root = Arc::new(root);
    let mut cfg = PciConfigIo::new(root.clone());
    let mut mmio = PciBarWindow::new(root.clone(), BarSpace::Memory, MMIO_BASE);
    let mut io = PciBarWindow::new(root.clone(), BarSpace::Io, IO_BASE);
    let bridge_id = {
        cfg.write(0, &0x8000_0000u32.to_le_bytes());
        let mut b = [0u8; 4];
        cfg.read(4, &mut b);
        u32::from_le_bytes(b)
    };
    while !t.is_empty() {
        match t.u8() % 8 {
            // The address register: structured (enable, slot, register) or raw.
            0 => {
                let sel = t.u8();
                let v = if sel & 0x80 != 0 {
                    t.u32()
                } else {
                    0x8000_0000 | u32::from(sel % 4) << 11 | u32::from(t.u8()) & 0xfc
                };
                cfg.write(0, &v.to_le_bytes());
            }
            // A data write: offset 4..=7 (or anything), size 1, 2, 4 (or others).
            1 | 2 => {
                let offset = 4 + u64::from(t.u8() % 5);
                let size = [1usize, 2, 4, 4, 3, 8][usize::from(t.u8() % 6)];
                let bytes = t.bytes(size).to_vec();
                cfg.write(offset, &bytes);
            }
            3 => {
                let offset = u64::from(t.u8() % 9);
                let size = [1usize, 2, 4, 4, 3, 8][usize::from(t.u8() % 6)];
                let mut buf = vec![0u8; size];
                cfg.read(offset, &mut buf);
            }
            // The guest moves a BAR: the address register, then the BAR's dword.
            4 => {
                let slot = 1 + u32::from(t.u8() % 2);
                let bar = u32::from(t.u8() % 6);
                cfg.write(
                    0,
                    &(0x8000_0000 | slot << 11 | (0x10 + 4 * bar)).to_le_bytes(),
                );
                let v = match t.u8() % 4 {
                    0 => u32::MAX,
                    1 => (MMIO_BASE as u32).wrapping_add(u32::from(t.u16()) << 4),
                    2 => u32::from(t.u16()) << 4,
                    _ => t.u32(),
                };
                cfg.write(4, &v.to_le_bytes());
            }
            // Memory decoding on or off.
            5 => {
                let slot = 1 + u32::from(t.u8() % 2);
                cfg.write(0, &(0x8000_0000 | slot << 11 | 4).to_le_bytes());
                cfg.write(4, &[t.u8() & 3, 0]);
            }
            // BAR window accesses.
            6 => {
                let offset = u64::from(t.u32() % 0x20_0000);
                let size = [1usize, 2, 4, 8][usize::from(t.u8() % 4)];
                let mut buf = vec![0u8; size];
                if t.bool() {
                    mmio.read(offset, &mut buf);
                    mmio.write(offset, &buf);
                } else {
                    io.read(offset % 0x100, &mut buf);
                    io.write(offset % 0x100, &buf);
                }
            }
            _ => {
                let mut buf = [0u8; 4];
                cfg.write(0, &0x8000_0000u32.to_le_bytes());
                cfg.read(4, &mut buf);
                assert_eq!(u32::from_le_bytes(buf), bridge_id, "the host bridge changed");
            }
        }
    }
    }
);
