//! Guest RAM: anonymous memory from 0, with the MMIO gap (3 GiB .. 4 GiB) left out.

use vm_memory::{GuestAddress, GuestMemoryMmap};

use crate::layout::{MMIO_GAP_END, MMIO_GAP_START};

/// The guest memory type of the VMM (the same as the device crate's).
pub type GuestMemory = GuestMemoryMmap<()>;

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("guest memory size {0:#x} bytes does not fit the address space")]
    TooLarge(u64),
    #[error("cannot map {size_mib} MiB of guest memory: {reason}")]
    Map { size_mib: u64, reason: String },
}

/// The RAM ranges for `size` bytes of memory: below the gap, then from 4 GiB.
pub fn ram_ranges(size: u64) -> Result<Vec<(GuestAddress, u64)>, MemoryError> {
    if size <= MMIO_GAP_START {
        return Ok(vec![(GuestAddress(0), size)]);
    }
    let above = size - MMIO_GAP_START;
    MMIO_GAP_END
        .checked_add(above)
        .ok_or(MemoryError::TooLarge(size))?;
    Ok(vec![
        (GuestAddress(0), MMIO_GAP_START),
        (GuestAddress(MMIO_GAP_END), above),
    ])
}

/// Maps `size` bytes of guest RAM.
pub fn create_guest_memory(size: u64) -> Result<GuestMemory, MemoryError> {
    let ranges = ram_ranges(size)?
        .into_iter()
        .map(|(a, s)| usize::try_from(s).map(|s| (a, s)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| MemoryError::TooLarge(size))?;
    GuestMemoryMmap::from_ranges(&ranges).map_err(|e| MemoryError::Map {
        size_mib: size >> 20,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemory as _;

    #[test]
    fn small_memory_is_one_range() {
        assert_eq!(
            ram_ranges(64 << 20).unwrap(),
            vec![(GuestAddress(0), 64 << 20)]
        );
        assert_eq!(ram_ranges(3 << 30).unwrap().len(), 1);
    }

    #[test]
    fn large_memory_skips_the_gap() {
        let r = ram_ranges(5 << 30).unwrap();
        assert_eq!(
            r,
            vec![(GuestAddress(0), 3 << 30), (GuestAddress(4 << 30), 2 << 30)]
        );
        assert!(ram_ranges(u64::MAX).is_err());
    }

    #[test]
    fn maps_memory() {
        let m = create_guest_memory(16 << 20).unwrap();
        assert_eq!(m.num_regions(), 1);
        assert_eq!(m.last_addr(), GuestAddress((16 << 20) - 1));
    }
}
