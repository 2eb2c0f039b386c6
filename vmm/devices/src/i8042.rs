//! A minimal i8042 keyboard controller: enough for a guest to probe it and to reset the machine.
//!
//! Ports 0x60 (data) and 0x64 (status / command); the device is mapped at 0x60 with length 5, so
//! offset 4 is port 0x64 and offset 1 (port 0x61, system control port B) reads as zero.
//! Command 0xFE on port 0x64 (pulse the reset line) signals the reset `EventFd`: the VMM ends the
//! VM cleanly. No keyboard or mouse is attached: data reads return the last controller reply.

use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Base port of the controller.
pub const I8042_PORT_BASE: u64 = 0x60;
/// Length of its window (0x60..=0x64).
pub const I8042_PORT_LEN: u64 = 5;

const OFF_DATA: u64 = 0;
const OFF_STATUS: u64 = 4;

const STATUS_OUTPUT_FULL: u8 = 0x01;
const STATUS_SYSTEM_FLAG: u8 = 0x04;
const STATUS_COMMAND: u8 = 0x08;

const CMD_READ_CONFIG: u8 = 0x20;
const CMD_WRITE_CONFIG: u8 = 0x60;
const CMD_DISABLE_AUX: u8 = 0xa7;
const CMD_ENABLE_AUX: u8 = 0xa8;
const CMD_TEST_AUX: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_TEST_KBD: u8 = 0xab;
const CMD_DISABLE_KBD: u8 = 0xad;
const CMD_ENABLE_KBD: u8 = 0xae;
const CMD_READ_OUTPUT_PORT: u8 = 0xd0;
const CMD_RESET: u8 = 0xfe;

/// The controller.
pub struct I8042 {
    reset_evt: EventFd,
    status: u8,
    config: u8,
    output: Option<u8>,
    /// The last command expects a data byte on port 0x60.
    pending_write: Option<u8>,
}

impl I8042 {
    /// A controller that signals `reset_evt` when the guest asks for a reset.
    pub fn new(reset_evt: EventFd) -> Self {
        Self {
            reset_evt,
            status: STATUS_SYSTEM_FLAG,
            config: 0x45, // keyboard interrupt, system flag, translation
            output: None,
            pending_write: None,
        }
    }

    fn reply(&mut self, byte: u8) {
        self.output = Some(byte);
    }

    fn command(&mut self, cmd: u8) {
        self.status |= STATUS_COMMAND;
        match cmd {
            CMD_READ_CONFIG => self.reply(self.config),
            CMD_WRITE_CONFIG => self.pending_write = Some(cmd),
            CMD_SELF_TEST => self.reply(0x55),
            CMD_TEST_KBD | CMD_TEST_AUX => self.reply(0x00),
            CMD_READ_OUTPUT_PORT => self.reply(0x01), // A20 off-bit clear, reset line high
            CMD_DISABLE_AUX | CMD_ENABLE_AUX | CMD_DISABLE_KBD | CMD_ENABLE_KBD => {}
            CMD_RESET => {
                if let Err(e) = self.reset_evt.write(1) {
                    log::error!("i8042: cannot signal the reset: {e}");
                }
            }
            other => log::debug!("i8042: ignored command {other:#x}"),
        }
    }

    fn status(&self) -> u8 {
        let full = if self.output.is_some() {
            STATUS_OUTPUT_FULL
        } else {
            0
        };
        self.status | full
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Some(first) = data.first_mut() else {
            return;
        };
        match offset {
            OFF_DATA => *first = self.output.take().unwrap_or(0),
            OFF_STATUS => *first = self.status(),
            _ => {}
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else {
            return;
        };
        match offset {
            OFF_STATUS => self.command(value),
            OFF_DATA => {
                self.status &= !STATUS_COMMAND;
                if self.pending_write.take() == Some(CMD_WRITE_CONFIG) {
                    self.config = value;
                }
                // Bytes for a keyboard that is not there are dropped.
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev() -> I8042 {
        I8042::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())
    }

    fn read(d: &mut I8042, off: u64) -> u8 {
        let mut b = [0xff];
        d.read(off, &mut b);
        b[0]
    }

    #[test]
    fn reset_command_signals_the_eventfd() {
        let mut d = dev();
        assert!(d.reset_evt.read().is_err(), "nothing signalled yet");
        d.write(OFF_STATUS, &[CMD_RESET]);
        assert_eq!(d.reset_evt.read().unwrap(), 1);
    }

    #[test]
    fn status_is_sane_and_self_test_answers() {
        let mut d = dev();
        assert_eq!(read(&mut d, OFF_STATUS) & STATUS_OUTPUT_FULL, 0);
        d.write(OFF_STATUS, &[CMD_SELF_TEST]);
        assert_ne!(read(&mut d, OFF_STATUS) & STATUS_OUTPUT_FULL, 0);
        assert_eq!(read(&mut d, OFF_DATA), 0x55);
        assert_eq!(read(&mut d, OFF_STATUS) & STATUS_OUTPUT_FULL, 0);
        assert!(d.reset_evt.read().is_err());
    }

    #[test]
    fn config_byte_round_trips() {
        let mut d = dev();
        d.write(OFF_STATUS, &[CMD_WRITE_CONFIG]);
        d.write(OFF_DATA, &[0x12]);
        d.write(OFF_STATUS, &[CMD_READ_CONFIG]);
        assert_eq!(read(&mut d, OFF_DATA), 0x12);
        // Port 0x61 and empty accesses are harmless.
        assert_eq!(read(&mut d, 1), 0);
        d.write(OFF_DATA, &[]);
        d.read(OFF_DATA, &mut []);
    }
}
