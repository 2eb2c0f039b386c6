//! The guest-facing part of the balloon: turning a chain into checked guest-physical ranges, and
//! dropping a checked range's host pages. No KVM needed; everything a guest writes is checked
//! here before the host mapping is touched.

use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemory as _, GuestMemoryRegion};

use super::{MAX_PFN_BUFFER, MAX_RANGE_LEN, PAGE_SIZE, QUEUE_SIZE};
use crate::GuestMemory;

/// Why a range (or a descriptor carrying ranges) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// A reporting descriptor the device may not write, or a frame-number buffer it may.
    #[error("a descriptor has the wrong direction for its queue")]
    WrongDirection,
    /// Address or length not a multiple of the 4 KiB balloon page.
    #[error("range {addr:#x}+{len:#x} is not aligned to 4 KiB pages")]
    Unaligned { addr: u64, len: u64 },
    /// Empty, or longer than [`MAX_RANGE_LEN`].
    #[error("range length {0:#x} is 0 or more than {MAX_RANGE_LEN:#x}")]
    BadLength(u64),
    /// Address plus length overflows the address space.
    #[error("range {addr:#x}+{len:#x} overflows")]
    Overflow { addr: u64, len: u64 },
    /// Not wholly inside one guest RAM region.
    #[error("range {addr:#x}+{len:#x} is not inside one guest RAM region")]
    OutsideMemory { addr: u64, len: u64 },
    /// A chain with more than [`MAX_PFN_BUFFER`] bytes of page frame numbers.
    #[error("more than {MAX_PFN_BUFFER} bytes of page frame numbers in one chain")]
    PfnBufferTooLong,
    /// A frame-number buffer that is not a whole number of 32-bit entries.
    #[error("a page frame number buffer of {0} bytes is not a multiple of 4")]
    PfnBufferTruncated(usize),
    /// A frame-number buffer that cannot be read from guest memory.
    #[error("a page frame number buffer is not in guest memory")]
    PfnBufferUnreadable,
    /// The host refused to drop the pages.
    #[error("madvise(MADV_DONTNEED) on range {addr:#x}+{len:#x}: {errno}")]
    Madvise { addr: u64, len: u64, errno: i32 },
}

/// A guest-physical range checked against guest memory: page-aligned, 1 page to
/// [`MAX_RANGE_LEN`], inside one RAM region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckedRange {
    /// Guest-physical start.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the range starts in the VMM's mapping of guest RAM.
    host: *mut u8,
}

/// Checks the guest-physical range `addr..addr + len`.
pub fn check_range(mem: &GuestMemory, addr: u64, len: u64) -> Result<CheckedRange, RangeError> {
    if len == 0 || len > MAX_RANGE_LEN {
        return Err(RangeError::BadLength(len));
    }
    if !addr.is_multiple_of(PAGE_SIZE) || !len.is_multiple_of(PAGE_SIZE) {
        return Err(RangeError::Unaligned { addr, len });
    }
    let end = addr
        .checked_add(len)
        .ok_or(RangeError::Overflow { addr, len })?;
    let outside = || RangeError::OutsideMemory { addr, len };
    let region = mem.find_region(GuestAddress(addr)).ok_or_else(outside)?;
    let start = region.start_addr().0;
    let region_end = start.checked_add(region.len()).ok_or_else(outside)?;
    if end > region_end {
        return Err(outside());
    }
    // find_region put `addr` at or after the region's start.
    let offset = usize::try_from(addr - start).map_err(|_| outside())?;
    // wrapping_add: no dereference; `offset + len` lies within the region's mapping (checked).
    let host = region.as_ptr().wrapping_add(offset);
    Ok(CheckedRange { addr, len, host })
}

/// Drops the host pages behind `range`: the VMM's mapping stays, its pages go back to the host,
/// and the guest's next access to any of them finds zeros (anonymous private memory; a private
/// file mapping reads the file's bytes again).
pub fn discard(range: &CheckedRange) -> Result<(), RangeError> {
    let len = usize::try_from(range.len).map_err(|_| RangeError::BadLength(range.len))?;
    // SAFETY: `check_range` placed `host..host + len` wholly inside one guest RAM mapping that
    // vm-memory owns for as long as `mem` lives (the caller holds it). MADV_DONTNEED neither
    // unmaps nor moves the mapping; it only releases its pages. The VMM reaches guest memory only
    // through volatile accesses and raw pointers, so no Rust reference sees the contents change.
    let r = unsafe { libc::madvise(range.host.cast(), len, libc::MADV_DONTNEED) };
    if r != 0 {
        return Err(RangeError::Madvise {
            addr: range.addr,
            len: range.len,
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        });
    }
    Ok(())
}

/// What one chain released.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Ranges whose host pages were dropped.
    pub ranges: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Ranges or descriptors refused (logged at debug level).
    pub refused: u64,
}

impl Released {
    fn add(&mut self, r: Result<CheckedRange, RangeError>) {
        match r.and_then(|range| discard(&range).map(|()| range)) {
            Ok(range) => {
                self.ranges += 1;
                self.bytes += range.len;
            }
            Err(e) => {
                log::debug!("virtio-balloon: {e}");
                self.refused += 1;
            }
        }
    }
}

/// At most a queue's worth of descriptors of `chain` (virtio-queue already ends chains that
/// loop or leave the table).
fn descriptors(chain: DescriptorChain<&GuestMemory>) -> impl Iterator<Item = Descriptor> + '_ {
    chain.take(usize::from(QUEUE_SIZE))
}

/// A free page report: every descriptor is one free block, device-writable. Drops each block
/// that passes [`check_range`].
pub fn release_report(mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> Released {
    let mut out = Released::default();
    for d in descriptors(chain) {
        if !d.is_write_only() {
            out.add(Err(RangeError::WrongDirection));
            continue;
        }
        out.add(check_range(mem, d.addr().0, u64::from(d.len())));
    }
    out
}

/// Reads the 32-bit page frame numbers of an inflate or deflate chain: device-readable
/// descriptors, each a whole number of entries, in guest memory, at most [`MAX_PFN_BUFFER`]
/// bytes in all. A chain that breaks any of these is refused as a whole.
pub fn read_pfns(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
) -> Result<Vec<u32>, RangeError> {
    let mut pfns = Vec::new();
    let mut total = 0usize;
    for d in descriptors(chain) {
        if d.is_write_only() {
            return Err(RangeError::WrongDirection);
        }
        let len = d.len() as usize;
        total = total.saturating_add(len);
        if total > MAX_PFN_BUFFER {
            return Err(RangeError::PfnBufferTooLong);
        }
        if !len.is_multiple_of(4) {
            return Err(RangeError::PfnBufferTruncated(len));
        }
        let mut buf = vec![0u8; len];
        mem.read_slice(&mut buf, d.addr())
            .map_err(|_| RangeError::PfnBufferUnreadable)?;
        pfns.extend(
            buf.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
    }
    Ok(pfns)
}

/// An inflate chain: drops each 4 KiB page the guest gave up.
pub fn release_inflate(mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> Released {
    let mut out = Released::default();
    match read_pfns(mem, chain) {
        Ok(pfns) => {
            for pfn in pfns {
                out.add(check_range(mem, u64::from(pfn) * PAGE_SIZE, PAGE_SIZE));
            }
        }
        Err(e) => out.add(Err(e)),
    }
    out
}

/// A deflate chain: the guest takes pages back, which needs nothing from the host (the next
/// touch maps them). The numbers are still read and checked, so a bad chain is counted.
pub fn check_deflate(mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> Released {
    let mut out = Released::default();
    let bad = match read_pfns(mem, chain) {
        Ok(pfns) => pfns
            .into_iter()
            .filter_map(|pfn| check_range(mem, u64::from(pfn) * PAGE_SIZE, PAGE_SIZE).err())
            .collect(),
        Err(e) => vec![e],
    };
    for e in bad {
        log::debug!("virtio-balloon: deflate: {e}");
        out.refused += 1;
    }
    out
}
