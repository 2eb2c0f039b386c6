//! Guest RAM: anonymous memory from 0, with the MMIO gap (3 GiB .. 4 GiB) left out.
//!
//! Each RAM mapping is marked so that the host can tell it from the VMM's own memory in
//! `/proc/<pid>/smaps` (the benchmark splits a pod's host memory that way): `MADV_DONTDUMP`
//! (VmFlags `dd`; it also keeps guest RAM out of core dumps of the VMM) on every kernel, and the
//! name [`GUEST_RAM_VMA_NAME`] (`[anon:microvm-guest-ram]`) where the kernel has
//! CONFIG_ANON_VMA_NAME.

use vm_memory::{GuestAddress, GuestMemory as _, GuestMemoryMmap, GuestMemoryRegion};

use crate::layout::{MMIO_GAP_END, MMIO_GAP_START};

/// The name of guest RAM mappings in `/proc/<pid>/maps` (as `[anon:microvm-guest-ram]`), on
/// kernels that can name anonymous mappings.
pub const GUEST_RAM_VMA_NAME: &str = "microvm-guest-ram";
const GUEST_RAM_VMA_CNAME: &std::ffi::CStr = c"microvm-guest-ram";

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
    let mem = GuestMemoryMmap::from_ranges(&ranges).map_err(|e| MemoryError::Map {
        size_mib: size >> 20,
        reason: e.to_string(),
    })?;
    for region in mem.iter() {
        mark_guest_ram(region.as_ptr(), region.len() as usize);
    }
    Ok(mem)
}

/// Marks one guest RAM mapping (see the module doc; also the file-backed ranges of
/// [`crate::boot_files`], which the kernel does not name). Best effort: neither mark changes how the
/// guest runs, so a kernel refusing one is logged, not an error.
pub(crate) fn mark_guest_ram(addr: *mut u8, len: usize) {
    // SAFETY: `addr..addr + len` is one whole mapping that vm-memory just created and owns;
    // MADV_DONTDUMP only changes whether core dumps include it.
    if unsafe { libc::madvise(addr.cast(), len, libc::MADV_DONTDUMP) } != 0 {
        log::warn!(
            "guest RAM: madvise(MADV_DONTDUMP) failed: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: PR_SET_VMA_ANON_NAME reads the NUL-terminated name (a static) and names the
    // mapping `addr..addr + len`, which we own; it changes nothing else about the mapping.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_VMA,
            libc::PR_SET_VMA_ANON_NAME as libc::c_ulong,
            addr as libc::c_ulong,
            len as libc::c_ulong,
            GUEST_RAM_VMA_CNAME.as_ptr(),
        )
    };
    if r != 0 {
        // EINVAL: a kernel without CONFIG_ANON_VMA_NAME (Debian's 6.1 among them).
        log::debug!(
            "guest RAM: naming the mapping failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn the_name_constant_is_the_name_given() {
        assert_eq!(GUEST_RAM_VMA_CNAME.to_str(), Ok(GUEST_RAM_VMA_NAME));
    }

    #[test]
    fn guest_ram_is_marked_in_smaps() {
        let m = create_guest_memory(24 << 20).unwrap();
        let region = m.iter().next().unwrap();
        let (start, end) = (region.as_ptr() as u64, region.as_ptr() as u64 + (24 << 20));
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        // The entry holding the mapping: its header line up to its VmFlags line. The kernel may
        // have merged it with a neighbour of the same flags (another test's guest RAM), so the
        // entry covers the range rather than equals it.
        let covers = |l: &str| {
            let Some((range, _)) = l.split_once(' ') else {
                return false;
            };
            let Some((a, b)) = range.split_once('-') else {
                return false;
            };
            match (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                (Ok(a), Ok(b)) => a <= start && end <= b,
                _ => false,
            }
        };
        let mut lines = smaps.lines().skip_while(|l| !covers(l));
        let header = lines.next().expect("the guest RAM mapping in smaps");
        let mut entry: Vec<&str> = Vec::new();
        for l in lines {
            entry.push(l);
            if l.starts_with("VmFlags:") {
                break;
            }
        }
        assert!(
            header.ends_with("[anon:microvm-guest-ram]") || !header.contains('['),
            "{header}"
        );
        let flags = entry
            .iter()
            .find(|l| l.starts_with("VmFlags:"))
            .expect("VmFlags line");
        assert!(flags.split_whitespace().any(|f| f == "dd"), "{flags}");
    }
}
