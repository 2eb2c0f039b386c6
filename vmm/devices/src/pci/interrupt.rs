//! The Interrupt Line / Interrupt Pin registers (0x3c, 0x3d) of a device whose INTx the VMM
//! routes: the pin is the device's (read-only), the line starts as the IOAPIC pin (GSI) the VMM
//! chose and is then scratch for the guest (PCI spec: software writes what it likes there). What
//! the guest writes never changes where the interrupt goes; the routing is fixed by the VMM.

use super::merge_dword;

/// Interrupt Line value of a device without INTx: "unknown / not connected" on x86.
pub const NO_INTERRUPT_LINE: u8 = 0xff;

/// The two registers of one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InterruptRegs {
    line: u8,
    pin: u8,
}

impl InterruptRegs {
    /// A device without INTx: pin 0, line "not connected".
    pub fn none() -> Self {
        Self {
            line: NO_INTERRUPT_LINE,
            pin: 0,
        }
    }

    /// A device whose `pin` (1 = INTA# .. 4 = INTD#) drives IOAPIC pin `gsi`. None when the pin
    /// is not 1..=4 or the GSI does not fit the register.
    pub fn routed(pin: u8, gsi: u32) -> Option<Self> {
        let line = u8::try_from(gsi).ok().filter(|l| *l != NO_INTERRUPT_LINE)?;
        (1..=4).contains(&pin).then_some(Self { line, pin })
    }

    /// The pin the guest sees (0 = none).
    pub fn pin(&self) -> u8 {
        self.pin
    }

    /// The dword at 0x3c: `device`'s Min_Gnt and Max_Lat (bytes 2, 3) with our line and pin.
    pub fn read(&self, device: u32) -> u32 {
        (device & 0xffff_0000) | (u32::from(self.pin) << 8) | u32::from(self.line)
    }

    /// A guest write of `data` at byte `within` of the dword: only the line byte takes it.
    pub fn write(&mut self, within: usize, data: &[u8]) {
        if let Some(v) = merge_dword(u32::from(self.line), within, data) {
            self.line = v as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_pin_over_the_devices_other_bytes() {
        let device = 0x3412_010b;
        let r = InterruptRegs::routed(1, 23).unwrap();
        assert_eq!(r.read(device), 0x3412_0117);
        assert_eq!(r.pin(), 1);
        assert_eq!(InterruptRegs::none().read(device), 0x3412_00ff);
        assert_eq!(InterruptRegs::routed(0, 23), None);
        assert_eq!(InterruptRegs::routed(5, 23), None);
        assert_eq!(InterruptRegs::routed(1, 255), None);
        assert_eq!(InterruptRegs::routed(1, 256), None);
        assert!(InterruptRegs::routed(4, 0).is_some());
    }

    #[test]
    fn guest_writes_change_the_line_only() {
        for within in 0..6 {
            for len in 0..6 {
                let mut r = InterruptRegs::routed(2, 22).unwrap();
                r.write(within, &vec![0xa5; len]);
                let want_line = if within == 0 && matches!(len, 1 | 2 | 4) {
                    0xa5
                } else {
                    22
                };
                assert_eq!(r.read(0), (2 << 8) | want_line, "{len} bytes at {within}");
                assert_eq!(r.pin(), 2);
            }
        }
        // The line reads back what was written (scratch), and back again.
        let mut r = InterruptRegs::routed(1, 23).unwrap();
        r.write(0, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(r.read(0) & 0xffff, 0x01ff);
        r.write(0, &[23]);
        assert_eq!(r.read(0) & 0xffff, 0x0117);
    }
}
