//! The MMIO and port-I/O buses: address ranges mapped to devices.
//!
//! A vCPU exit for an MMIO or port access is routed here: the bus finds the device whose range
//! holds the address and calls it with the offset from the range's base. Accesses that hit no
//! device read as all ones and writes are dropped (as on real hardware), which the caller may log.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device on a bus. Offsets are relative to the base of the device's range.
pub trait BusDevice: Send {
    /// A guest read of `data.len()` bytes at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write of `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors of bus set-up.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// A range of zero length.
    #[error("bus range at {base:#x} has zero length")]
    EmptyRange { base: u64 },
    /// The range runs past the end of the address space.
    #[error("bus range at {base:#x} with length {len:#x} overflows the address space")]
    Overflow { base: u64, len: u64 },
    /// The range overlaps one already inserted.
    #[error("bus range {base:#x}+{len:#x} overlaps the device at {other:#x}")]
    Overlap { base: u64, len: u64, other: u64 },
}

/// A shared, lockable device on a bus.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Clone)]
struct Range {
    len: u64,
    device: SharedDevice,
}

/// An address space of devices (one for MMIO, one for port I/O).
#[derive(Clone, Default)]
pub struct Bus {
    ranges: BTreeMap<u64, Range>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `device` at `[base, base + len)`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::EmptyRange { base });
        }
        let end = base
            .checked_add(len - 1)
            .ok_or(BusError::Overflow { base, len })?;
        // The range that starts at or before our end is the only one that can overlap us.
        if let Some((&other, r)) = self.ranges.range(..=end).next_back() {
            if other + (r.len - 1) >= base {
                return Err(BusError::Overlap { base, len, other });
            }
        }
        self.ranges.insert(base, Range { len, device });
        Ok(())
    }

    /// The device holding `addr`, and the offset of `addr` in its range.
    pub fn resolve(&self, addr: u64) -> Option<(SharedDevice, u64)> {
        let (&base, r) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < r.len).then(|| (r.device.clone(), offset))
    }

    /// Routes a read. Returns false (and fills `data` with ones) when no device holds `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((dev, offset)) => {
                lock(&dev).read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Routes a write. Returns false when no device holds `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((dev, offset)) => {
                lock(&dev).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering it if a thread panicked while holding it: a device must stay
/// reachable so the VM can still be stopped and torn down.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scratch([u8; 16]);
    impl BusDevice for Scratch {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            let o = offset as usize;
            data.copy_from_slice(&self.0[o..o + data.len()]);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            let o = offset as usize;
            self.0[o..o + data.len()].copy_from_slice(data);
        }
    }

    fn dev() -> SharedDevice {
        Arc::new(Mutex::new(Scratch([0; 16])))
    }

    #[test]
    fn routes_by_offset() {
        let mut bus = Bus::new();
        bus.insert(dev(), 0x1000, 16).unwrap();
        assert!(bus.write(0x1004, &[7, 8]));
        let mut b = [0u8; 2];
        assert!(bus.read(0x1004, &mut b));
        assert_eq!(b, [7, 8]);
        assert!(!bus.read(0x1010, &mut b));
        assert_eq!(b, [0xff, 0xff]);
        assert!(!bus.read(0xfff, &mut b));
    }

    #[test]
    fn rejects_overlaps_and_bad_ranges() {
        let mut bus = Bus::new();
        bus.insert(dev(), 0x1000, 16).unwrap();
        assert!(matches!(
            bus.insert(dev(), 0x100f, 4),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(dev(), 0xff8, 9),
            Err(BusError::Overlap { .. })
        ));
        bus.insert(dev(), 0xff8, 8).unwrap();
        bus.insert(dev(), 0x1010, 8).unwrap();
        assert_eq!(
            bus.insert(dev(), 0, 0),
            Err(BusError::EmptyRange { base: 0 })
        );
        assert!(matches!(
            bus.insert(dev(), u64::MAX, 2),
            Err(BusError::Overflow { .. })
        ));
    }
}
