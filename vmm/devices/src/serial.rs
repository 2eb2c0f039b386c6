//! COM1: a 16550A UART (vm-superio's model) on the port bus, output only.
//!
//! The guest's transmit bytes go to a host writer (stdout, a file, a pipe the caller reads...).
//! Interrupts (THR empty, when the guest enables them) are raised by writing an `EventFd` that the
//! VMM registers as an irqfd on the serial GSI. Input from the host is not wired: the guest sees an
//! empty receive buffer.

use std::io::{self, Write};

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Size of the UART's register window on the port bus.
pub const SERIAL_PORT_LEN: u64 = 8;

/// An interrupt line backed by an eventfd (registered as an irqfd by the VMM).
#[derive(Debug)]
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    /// A trigger that writes `evt`.
    pub fn new(evt: EventFd) -> Self {
        Self(evt)
    }

    /// The eventfd behind the line.
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }
}

impl Trigger for EventFdTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// The serial console device.
pub struct SerialDevice {
    uart: Serial<EventFdTrigger, vm_superio::serial::NoEvents, Box<dyn Write + Send>>,
}

impl SerialDevice {
    /// A UART whose output goes to `out` and whose interrupt line is `irq`.
    pub fn new(irq: EventFdTrigger, out: Box<dyn Write + Send>) -> Self {
        Self {
            uart: Serial::new(irq, out),
        }
    }

    /// The interrupt eventfd (for irqfd registration).
    pub fn irq_eventfd(&self) -> &EventFd {
        self.uart.interrupt_evt().eventfd()
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let len = data.len();
        match (u8::try_from(offset), data) {
            (Ok(off), [first]) if offset < SERIAL_PORT_LEN => *first = self.uart.read(off),
            _ => log::debug!("serial: ignored read of {len} bytes at {offset:#x}"),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (u8::try_from(offset), data) {
            (Ok(off), [value]) if offset < SERIAL_PORT_LEN => {
                if let Err(e) = self.uart.write(off, *value) {
                    crate::limited!(log::Level::Warn, "serial: write failed: {e:?}");
                }
            }
            _ => log::debug!(
                "serial: ignored write of {} bytes at {offset:#x}",
                data.len()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            crate::bus::lock(&self.0).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn device() -> (SerialDevice, Shared) {
        let out = Shared::default();
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (
            SerialDevice::new(EventFdTrigger::new(evt), Box::new(out.clone())),
            out,
        )
    }

    #[test]
    fn transmitted_bytes_reach_the_writer() {
        let (mut dev, out) = device();
        for b in b"hi\n" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*crate::bus::lock(&out.0), b"hi\n");
        // Line status: transmitter empty.
        let mut lsr = [0u8];
        dev.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0);
    }

    #[test]
    fn thr_empty_interrupt_signals_the_eventfd() {
        let (mut dev, _out) = device();
        dev.write(1, &[0x02]); // IER: THR empty interrupt
        dev.write(0, b"x");
        assert!(dev.irq_eventfd().read().unwrap() >= 1);
    }

    #[test]
    fn odd_accesses_are_ignored() {
        let (mut dev, out) = device();
        dev.write(0, &[1, 2]);
        dev.write(300, &[1]);
        let mut d = [0xaa; 2];
        dev.read(0, &mut d);
        assert_eq!(d, [0, 0]);
        assert!(crate::bus::lock(&out.0).is_empty());
    }
}
