//! Boot files in guest RAM without a copy per VM: the kernel's loadable ELF segments and the
//! initrd are mapped from their files over the guest RAM mapping (`MAP_PRIVATE | MAP_FIXED`,
//! same host address), so the host's page cache holds one copy of their pages for every VM
//! booted from the same files. A page the guest writes is copied then, into that VM's own
//! memory (copy-on-write): the guest may write anything anywhere, as with copied files.
//!
//! What may be mapped ([`plan`], unit-tested):
//! - only whole pages: a guest page maps a file page when the file offset and the guest address
//!   agree modulo the page size and the page lies wholly inside the range's file bytes;
//! - the partial pages at either end of a range are copied: past a segment's file data the
//!   guest expects zeros (bss) where a mapped page would show the file's next bytes, and a
//!   segment starting mid-page shares that page with what lies before it;
//! - a range whose file offset and guest address disagree modulo the page size is copied whole;
//! - memory past a segment's file data (bss) is left alone: anonymous, zero.
//!
//! When: before the memory slots are registered with KVM and before any device (VFIO's DMA map
//! pins pages) sees guest memory, so nothing ever saw the anonymous pages replaced. A range
//! whose mapping fails (a filesystem without mmap) is copied instead; [`LoadStats`] says how
//! much went which way, and the VM's debug log prints it.
//!
//! The files must not be truncated or rewritten in place while VMs run from them (a guest page
//! not yet written reads the file's current page; past a truncated end the guest's access
//! fails): replace them by renaming a new file over the old (`install`, `mv`), which leaves the
//! running VMs the old inode.
//!
//! The kernel's ELF headers are read into linux-loader's types (`linux_loader::elf`:
//! `Elf64_Ehdr`, `Elf64_Phdr`, `Elf64_Nhdr` and their constants) with the same checks as its
//! loader ([`read_elf`]), every offset and length checked against what was read, though the
//! operator supplies the file. Its loader itself is not used for this: it copies each segment
//! into guest memory as it reads the headers, where this maps whole pages; and it takes the
//! last PT_NOTE segment's answer on the PVH entry, where this keeps the first PVH note found.
//! What its bindings leave out (the ELF class byte, the PVH note type) is spelled here.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::mem::size_of;
use std::os::fd::AsRawFd;

use linux_loader::elf::{
    Elf64_Ehdr, Elf64_Nhdr, Elf64_Phdr, EI_DATA, EI_MAG0, EI_MAG1, EI_MAG2, EI_MAG3, ELFDATA2LSB,
    ELFMAG0, ELFMAG1, ELFMAG2, ELFMAG3, PT_LOAD, PT_NOTE,
};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemory as _};

use crate::layout::HIMEM_START;
use crate::memory::{mark_guest_ram, GuestMemory};

/// Errors of reading an ELF kernel's headers or placing a file range in guest memory.
#[derive(Debug, thiserror::Error)]
pub enum BootFileError {
    #[error("reading {what}: {source}")]
    Read {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("not an ELF kernel we load: {0}")]
    Elf(&'static str),
    #[error("{what} ({offset:#x}+{len:#x}) goes past the end of the file ({file_size:#x} bytes)")]
    PastEnd {
        what: &'static str,
        offset: u64,
        len: u64,
        file_size: u64,
    },
    #[error("the range {guest:#x}+{len:#x} is not in guest memory")]
    OutOfMemory { guest: u64, len: u64 },
    #[error("address arithmetic overflows")]
    Overflow,
    #[error("restoring anonymous guest memory after a failed file mapping: {0}")]
    Restore(std::io::Error),
}

/// How one part of a file range gets into guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// Whole pages mapped from the file (private, copy-on-write).
    Map {
        file_offset: u64,
        guest: u64,
        len: u64,
    },
    /// Bytes copied from the file.
    Copy {
        file_offset: u64,
        guest: u64,
        len: u64,
    },
}

/// Plans how `len` bytes of a file at `file_offset` land at guest address `guest` with pages of
/// `page` bytes (a power of two): see the module doc for the rules.
pub fn plan(
    file_offset: u64,
    guest: u64,
    len: u64,
    page: u64,
) -> Result<Vec<Piece>, BootFileError> {
    if !page.is_power_of_two() {
        return Err(BootFileError::Elf("page size not a power of two"));
    }
    file_offset
        .checked_add(len)
        .ok_or(BootFileError::Overflow)?;
    let end = guest.checked_add(len).ok_or(BootFileError::Overflow)?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let mask = page - 1;
    let whole = Piece::Copy {
        file_offset,
        guest,
        len,
    };
    if file_offset & mask != guest & mask {
        return Ok(vec![whole]);
    }
    let first_full = match guest.checked_add(mask) {
        Some(a) => a & !mask,
        None => return Ok(vec![whole]),
    };
    let last_full_end = end & !mask;
    if first_full >= last_full_end {
        return Ok(vec![whole]);
    }
    let mut pieces = Vec::with_capacity(3);
    if guest < first_full {
        pieces.push(Piece::Copy {
            file_offset,
            guest,
            len: first_full - guest,
        });
    }
    pieces.push(Piece::Map {
        file_offset: file_offset + (first_full - guest),
        guest: first_full,
        len: last_full_end - first_full,
    });
    if last_full_end < end {
        pieces.push(Piece::Copy {
            file_offset: file_offset + (last_full_end - guest),
            guest: last_full_end,
            len: end - last_full_end,
        });
    }
    Ok(pieces)
}

/// How much of the boot files went into guest memory which way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Bytes mapped from the file.
    pub mapped: u64,
    /// Bytes copied.
    pub copied: u64,
    /// Why pieces that could have been mapped were copied (the first mmap error), if any.
    pub map_failed: Option<String>,
}

impl std::fmt::Display for LoadStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} KiB mapped from the file (shared, copy-on-write), {} KiB copied",
            self.mapped >> 10,
            self.copied >> 10
        )?;
        if let Some(e) = &self.map_failed {
            write!(f, " (mapping failed, copied instead: {e})")?;
        }
        Ok(())
    }
}

/// The host's page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Places `len` bytes of `file` at `file_offset` at guest address `guest`: whole pages mapped
/// where [`plan`] allows, the rest copied. The range must lie inside the file.
pub fn place_range(
    mem: &GuestMemory,
    file: &mut File,
    file_offset: u64,
    guest: u64,
    len: u64,
    stats: &mut LoadStats,
) -> Result<(), BootFileError> {
    let file_size = file
        .metadata()
        .map_err(|source| BootFileError::Read {
            what: "the file's size",
            source,
        })?
        .len();
    match file_offset.checked_add(len) {
        Some(end) if end <= file_size => {}
        _ => {
            return Err(BootFileError::PastEnd {
                what: "the range",
                offset: file_offset,
                len,
                file_size,
            })
        }
    }
    for piece in plan(file_offset, guest, len, page_size())? {
        match piece {
            Piece::Map {
                file_offset,
                guest,
                len,
            } => match map_pages(mem, file, file_offset, guest, len) {
                Ok(()) => stats.mapped += len,
                Err(MapFailed::Map(e)) => {
                    stats.map_failed.get_or_insert_with(|| e.to_string());
                    copy_range(mem, file, file_offset, guest, len)?;
                    stats.copied += len;
                }
                Err(MapFailed::Fatal(e)) => return Err(e),
            },
            Piece::Copy {
                file_offset,
                guest,
                len,
            } => {
                copy_range(mem, file, file_offset, guest, len)?;
                stats.copied += len;
            }
        }
    }
    Ok(())
}

fn copy_range(
    mem: &GuestMemory,
    file: &mut File,
    file_offset: u64,
    guest: u64,
    len: u64,
) -> Result<(), BootFileError> {
    let n = usize::try_from(len).map_err(|_| BootFileError::Overflow)?;
    file.seek(SeekFrom::Start(file_offset))
        .map_err(|source| BootFileError::Read {
            what: "the file (seek)",
            source,
        })?;
    mem.read_exact_volatile_from(GuestAddress(guest), file, n)
        .map_err(|_| BootFileError::OutOfMemory { guest, len })
}

enum MapFailed {
    /// mmap refused; the range is anonymous memory again and may be copied into.
    Map(std::io::Error),
    /// The range is not guest memory, or could not be made anonymous again.
    Fatal(BootFileError),
}

/// Maps `len` bytes (whole pages) of `file` at `file_offset` over guest memory at `guest`.
fn map_pages(
    mem: &GuestMemory,
    file: &File,
    file_offset: u64,
    guest: u64,
    len: u64,
) -> Result<(), MapFailed> {
    let out_of_memory = || MapFailed::Fatal(BootFileError::OutOfMemory { guest, len });
    let n = usize::try_from(len).map_err(|_| out_of_memory())?;
    let offset = libc::off_t::try_from(file_offset)
        .map_err(|_| MapFailed::Fatal(BootFileError::Overflow))?;
    // One region holds the whole range (get_slice fails otherwise).
    let slice = mem
        .get_slice(GuestAddress(guest), n)
        .map_err(|_| out_of_memory())?;
    let guard = slice.ptr_guard_mut();
    let host = guard.as_ptr();
    // SAFETY: `host..host + n` lies inside one guest RAM mapping that `mem` owns (get_slice
    // checked it) and that is unmapped only when `mem` drops (vm-memory munmaps the whole
    // region, these pages included). Guest memory is only ever accessed through raw/volatile
    // pointers, never Rust references, and nothing else uses it yet: this runs before the memory
    // is registered with KVM or handed to any device. The new mapping has the same protection
    // and privacy (read-write, private), so every later access stays valid. `n` and `offset` are
    // page-aligned (plan), `host` is (guest RAM mappings start page-aligned and `guest` is
    // page-aligned).
    let r = unsafe {
        libc::mmap(
            host.cast(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            offset,
        )
    };
    if r == libc::MAP_FAILED {
        let err = std::io::Error::last_os_error();
        // A failed MAP_FIXED may have unmapped the old pages already: make the range anonymous
        // zeroed memory again before anything touches it.
        // SAFETY: as above; an anonymous private mapping over the same range.
        let back = unsafe {
            libc::mmap(
                host.cast(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if back == libc::MAP_FAILED {
            return Err(MapFailed::Fatal(BootFileError::Restore(
                std::io::Error::last_os_error(),
            )));
        }
        mark_guest_ram(host, n);
        return Err(MapFailed::Map(err));
    }
    mark_guest_ram(host, n);
    Ok(())
}

/// One loadable segment of an ELF kernel (PT_LOAD with file data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub paddr: u64,
    pub filesz: u64,
    pub memsz: u64,
}

/// What the ELF headers of a kernel say, read as linux-loader's `Elf::load` reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfKernel {
    /// e_entry.
    pub entry: u64,
    /// The PVH 32-bit entry (XEN_ELFNOTE_PHYS32_ENTRY), if a note has one.
    pub pvh_entry: Option<u64>,
    /// PT_LOAD segments with file data, in header order (loaded at p_paddr).
    pub segments: Vec<Segment>,
    /// The first byte after the highest segment (p_paddr + p_memsz).
    pub end: u64,
}

/// `e_ident[EI_CLASS]` and its 64-bit value: linux-loader's ELF bindings leave them out (its
/// loader does not check the class), so they are spelled here.
const EI_CLASS: usize = 4;
const ELFCLASS64: u8 = 2;
/// The note type of the PVH entry (linux-loader keeps its own private).
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
/// Notes larger than this are not read (the kernel's are a few hundred bytes).
const MAX_NOTE_SEGMENT: u64 = 1 << 20;

/// An ELF header (`Elf64_Ehdr`, `Elf64_Phdr`, `Elf64_Nhdr`) from its bytes, which are exactly
/// its size (callers take them from a checked range). Fields are read in the host's byte order,
/// little-endian on x86-64, the only host linux-loader's ELF types exist for; `read_elf` refuses
/// a file that says it is not little-endian.
fn header<T: ByteValued + Default>(bytes: &[u8]) -> T {
    let mut h = T::default();
    h.as_mut_slice().copy_from_slice(bytes);
    h
}

fn read_at(
    file: &mut File,
    offset: u64,
    buf: &mut [u8],
    what: &'static str,
) -> Result<(), BootFileError> {
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_exact(buf))
        .map_err(|source| BootFileError::Read { what, source })
}

/// Reads the ELF header, program headers and notes of a kernel: the same checks and results
/// as linux-loader's loader (64-bit little-endian, entry at or above 1 MiB), without loading.
pub fn read_elf(file: &mut File) -> Result<ElfKernel, BootFileError> {
    let mut ehdr = Elf64_Ehdr::default();
    read_at(file, 0, ehdr.as_mut_slice(), "the ELF header")?;
    let ident = ehdr.e_ident;
    if ident[EI_MAG0 as usize] != ELFMAG0 as u8
        || ident[EI_MAG1 as usize] != ELFMAG1
        || ident[EI_MAG2 as usize] != ELFMAG2
        || ident[EI_MAG3 as usize] != ELFMAG3
    {
        return Err(BootFileError::Elf("no ELF magic"));
    }
    if ident[EI_CLASS] != ELFCLASS64 {
        return Err(BootFileError::Elf("not a 64-bit ELF"));
    }
    if ident[EI_DATA as usize] != ELFDATA2LSB as u8 {
        return Err(BootFileError::Elf("not little-endian"));
    }
    let phdr_size = size_of::<Elf64_Phdr>();
    if usize::from(ehdr.e_phentsize) != phdr_size {
        return Err(BootFileError::Elf("unexpected program header size"));
    }
    if ehdr.e_phoff < size_of::<Elf64_Ehdr>() as u64 {
        return Err(BootFileError::Elf("program headers overlap the ELF header"));
    }
    if ehdr.e_entry < HIMEM_START {
        return Err(BootFileError::Elf("entry point below 1 MiB"));
    }
    let mut phdrs = vec![0u8; usize::from(ehdr.e_phnum) * phdr_size];
    read_at(file, ehdr.e_phoff, &mut phdrs, "the program headers")?;
    let mut kernel = ElfKernel {
        entry: ehdr.e_entry,
        pvh_entry: None,
        segments: Vec::new(),
        end: 0,
    };
    for bytes in phdrs.chunks_exact(phdr_size) {
        let ph: Elf64_Phdr = header(bytes);
        if ph.p_type == PT_NOTE && kernel.pvh_entry.is_none() {
            kernel.pvh_entry = pvh_note(file, ph.p_offset, ph.p_filesz)?;
        }
        if ph.p_type != PT_LOAD || ph.p_filesz == 0 {
            continue;
        }
        let end = ph
            .p_paddr
            .checked_add(ph.p_memsz)
            .ok_or(BootFileError::Overflow)?;
        kernel.end = kernel.end.max(end);
        kernel.segments.push(Segment {
            offset: ph.p_offset,
            paddr: ph.p_paddr,
            filesz: ph.p_filesz,
            memsz: ph.p_memsz,
        });
    }
    Ok(kernel)
}

/// The PVH entry of a PT_NOTE segment, if it has the note.
fn pvh_note(file: &mut File, offset: u64, filesz: u64) -> Result<Option<u64>, BootFileError> {
    if filesz > MAX_NOTE_SEGMENT {
        return Err(BootFileError::Elf("note segment too large"));
    }
    let mut notes = vec![0u8; filesz as usize];
    read_at(file, offset, &mut notes, "the ELF notes")?;
    let nhdr_size = size_of::<Elf64_Nhdr>();
    let align4 = |n: u32| -> usize { (n as usize).div_ceil(4) * 4 };
    let mut at = 0usize;
    while notes.len().saturating_sub(at) >= nhdr_size {
        let nhdr: Elf64_Nhdr = header(&notes[at..at + nhdr_size]);
        let name_at = at + nhdr_size;
        let desc_at = name_at
            .checked_add(align4(nhdr.n_namesz))
            .ok_or(BootFileError::Overflow)?;
        let next = desc_at
            .checked_add(align4(nhdr.n_descsz))
            .ok_or(BootFileError::Overflow)?;
        if nhdr.n_type == XEN_ELFNOTE_PHYS32_ENTRY
            && nhdr.n_namesz == 4
            && notes.get(name_at..name_at + 4) == Some(&b"Xen\0"[..])
        {
            if nhdr.n_descsz < 4 {
                return Err(BootFileError::Elf("PVH note shorter than 4 bytes"));
            }
            let desc = notes
                .get(desc_at..desc_at + 4)
                .ok_or(BootFileError::Elf("PVH note cut short"))?;
            let mut entry = [0u8; 4];
            entry.copy_from_slice(desc);
            return Ok(Some(u64::from(u32::from_le_bytes(entry))));
        }
        at = next;
    }
    Ok(None)
}

/// Loads the kernel's segments: whole pages mapped from the file, the rest copied.
pub fn load_elf_mapped(
    mem: &GuestMemory,
    file: &mut File,
    kernel: &ElfKernel,
) -> Result<LoadStats, BootFileError> {
    let mut stats = LoadStats::default();
    for s in &kernel.segments {
        place_range(mem, file, s.offset, s.paddr, s.filesz, &mut stats)?;
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;
    use linux_loader::loader::elf::{Elf, PvhBootCapability};
    use linux_loader::loader::KernelLoader;
    use std::io::Write;
    use std::os::fd::FromRawFd;

    const P: u64 = 4096;

    #[test]
    fn aligned_whole_pages_map() {
        assert_eq!(
            plan(0x20_0000, 0x100_0000, 3 * P, P).unwrap(),
            vec![Piece::Map {
                file_offset: 0x20_0000,
                guest: 0x100_0000,
                len: 3 * P
            }]
        );
    }

    #[test]
    fn the_partial_last_page_is_copied() {
        // An initrd of 2.5 pages at a page-aligned address.
        assert_eq!(
            plan(0, 0x7000, 2 * P + 100, P).unwrap(),
            vec![
                Piece::Map {
                    file_offset: 0,
                    guest: 0x7000,
                    len: 2 * P
                },
                Piece::Copy {
                    file_offset: 2 * P,
                    guest: 0x9000,
                    len: 100
                }
            ]
        );
    }

    #[test]
    fn a_segment_starting_mid_page_copies_its_head() {
        assert_eq!(
            plan(0x1800, 0x10_1800, 3 * P, P).unwrap(),
            vec![
                Piece::Copy {
                    file_offset: 0x1800,
                    guest: 0x10_1800,
                    len: 0x800
                },
                Piece::Map {
                    file_offset: 0x2000,
                    guest: 0x10_2000,
                    len: 2 * P
                },
                Piece::Copy {
                    file_offset: 0x4000,
                    guest: 0x10_4000,
                    len: 0x800
                }
            ]
        );
    }

    #[test]
    fn disagreeing_offsets_or_no_whole_page_copy_everything() {
        let copy = |o, g, l| {
            vec![Piece::Copy {
                file_offset: o,
                guest: g,
                len: l,
            }]
        };
        assert_eq!(
            plan(0x1001, 0x10_0000, 8 * P, P).unwrap(),
            copy(0x1001, 0x10_0000, 8 * P)
        );
        assert_eq!(plan(0x1800, 0x1800, P, P).unwrap(), copy(0x1800, 0x1800, P));
        assert_eq!(plan(0, 0, P - 1, P).unwrap(), copy(0, 0, P - 1));
        assert_eq!(plan(5, 5, 0, P).unwrap(), vec![]);
    }

    #[test]
    fn plans_cover_the_range_exactly_and_never_overflow() {
        assert!(plan(u64::MAX - 10, 0, 100, P).is_err());
        assert!(plan(0, u64::MAX - 10, 100, P).is_err());
        assert!(plan(0, 0, P, 3000).is_err());
        for (o, g, l) in [
            (0, 0, 1),
            (7, 7, 3 * P),
            (0x1234, 0x5234, 9 * P + 17),
            (1, 2, P),
        ] {
            let pieces = plan(o, g, l, P).unwrap();
            let mut next = (o, g);
            for p in &pieces {
                let (Piece::Map {
                    file_offset,
                    guest,
                    len,
                }
                | Piece::Copy {
                    file_offset,
                    guest,
                    len,
                }) = *p;
                assert_eq!((file_offset, guest), next, "{pieces:?}");
                if let Piece::Map { .. } = p {
                    assert_eq!((file_offset % P, guest % P, len % P), (0, 0, 0));
                }
                next = (file_offset + len, guest + len);
            }
            assert_eq!(next, (o + l, g + l));
        }
    }

    /// A file in memory (memfd): mappable like a file on disk.
    fn memfd(bytes: &[u8]) -> File {
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor (or -1).
        let fd = unsafe { libc::memfd_create(c"boot-files-test".as_ptr(), 0) };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let mut f = unsafe { File::from_raw_fd(fd) };
        f.write_all(bytes).unwrap();
        f
    }

    fn put(b: &mut [u8], at: usize, v: &[u8]) {
        b[at..at + v.len()].copy_from_slice(v);
    }

    /// A small ELF kernel: a page-aligned segment with bss, a segment starting mid-page right
    /// after it, one whose offset disagrees with its address, a PVH note; recognisable bytes.
    fn test_elf() -> Vec<u8> {
        let mut b: Vec<u8> = (0..0x9000u32)
            .map(|i| (i.wrapping_mul(7) >> 3) as u8 | 1)
            .collect();
        put(&mut b, 0, b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
        put(&mut b, 16, &2u16.to_le_bytes()); // ET_EXEC
        put(&mut b, 18, &62u16.to_le_bytes()); // EM_X86_64
        put(&mut b, 20, &1u32.to_le_bytes());
        put(&mut b, 24, &0x20_0000u64.to_le_bytes()); // e_entry
        put(&mut b, 32, &64u64.to_le_bytes()); // e_phoff
        put(&mut b, 40, &0u64.to_le_bytes());
        put(&mut b, 52, &64u16.to_le_bytes());
        put(&mut b, 54, &56u16.to_le_bytes());
        put(&mut b, 56, &4u16.to_le_bytes()); // e_phnum
        put(&mut b, 58, &[0; 6]);
        let phdr =
            |b: &mut Vec<u8>, i: usize, t: u32, off: u64, paddr: u64, filesz: u64, memsz: u64| {
                let at = 64 + i * 56;
                put(b, at, &t.to_le_bytes());
                put(b, at + 4, &5u32.to_le_bytes());
                put(b, at + 8, &off.to_le_bytes());
                put(b, at + 16, &(paddr | 0xffff_ffff_0000_0000).to_le_bytes());
                put(b, at + 24, &paddr.to_le_bytes());
                put(b, at + 32, &filesz.to_le_bytes());
                put(b, at + 40, &memsz.to_le_bytes());
                put(b, at + 48, &0x1000u64.to_le_bytes());
            };
        // 2.5 pages of file data, 4 pages in memory: the last half page and more is bss.
        phdr(&mut b, 0, PT_LOAD, 0x1000, 0x20_0000, 0x2800, 0x4000);
        // Mid-page, right after the first one's memory; its tail is a partial page.
        phdr(&mut b, 1, PT_LOAD, 0x4800, 0x20_4800, 0x2900, 0x2900);
        // Offset and address disagree modulo the page size.
        phdr(&mut b, 2, PT_LOAD, 0x7010, 0x30_0000, 0x1800, 0x1800);
        phdr(&mut b, 3, PT_NOTE, 0x8f00, 0, 24, 24);
        // The note: namesz 4, descsz 4, type 18, "Xen\0", entry 0x200123.
        put(&mut b, 0x8f00, &4u32.to_le_bytes());
        put(&mut b, 0x8f04, &4u32.to_le_bytes());
        put(&mut b, 0x8f08, &18u32.to_le_bytes());
        put(&mut b, 0x8f0c, b"Xen\0");
        put(&mut b, 0x8f10, &0x20_0123u32.to_le_bytes());
        b
    }

    fn guest_bytes(mem: &GuestMemory, size: usize) -> Vec<u8> {
        let mut v = vec![0u8; size];
        mem.read_slice(&mut v, GuestAddress(0)).unwrap();
        v
    }

    #[test]
    fn mapped_load_equals_linux_loaders_copy_byte_for_byte() {
        let elf = test_elf();
        let size = 4 << 20;
        let copied = create_guest_memory(size as u64).unwrap();
        let r = Elf::load(
            &copied,
            None,
            &mut memfd(&elf),
            Some(GuestAddress(HIMEM_START)),
        )
        .unwrap();

        let mapped = create_guest_memory(size as u64).unwrap();
        let mut file = memfd(&elf);
        let k = read_elf(&mut file).unwrap();
        assert_eq!(k.entry, r.kernel_load.0);
        assert_eq!(k.end, r.kernel_end);
        assert_eq!(
            r.pvh_boot_cap,
            PvhBootCapability::PvhEntryPresent(GuestAddress(0x20_0123))
        );
        assert_eq!(k.pvh_entry, Some(0x20_0123));
        assert_eq!(k.segments.len(), 3);
        let stats = load_elf_mapped(&mapped, &mut file, &k).unwrap();
        // Pages 0x200000 and 0x201000 of the first segment and 0x205000, 0x206000 of the second.
        assert_eq!(stats.mapped, 4 * P, "{stats}");
        assert_eq!(stats.copied, 0x800 + 0x800 + 0x100 + 0x1800, "{stats}");
        assert_eq!(stats.map_failed, None);
        assert!(guest_bytes(&copied, size) == guest_bytes(&mapped, size));

        // The guest writes a mapped page: its copy changes, the file and a second VM do not.
        let other = create_guest_memory(size as u64).unwrap();
        load_elf_mapped(&other, &mut file, &k).unwrap();
        mapped
            .write_obj(0xdead_beef_u32, GuestAddress(0x20_0010))
            .unwrap();
        assert_eq!(
            mapped.read_obj::<u32>(GuestAddress(0x20_0010)).unwrap(),
            0xdead_beef
        );
        assert_eq!(
            other.read_obj::<u32>(GuestAddress(0x20_0010)).unwrap(),
            u32::from_le_bytes(elf[0x1010..0x1014].try_into().unwrap())
        );
        let mut again = vec![0u8; 4];
        read_at(&mut file, 0x1010, &mut again, "test").unwrap();
        assert_eq!(again, elf[0x1010..0x1014]);
    }

    /// A second PT_NOTE segment without the PVH note does not hide the first one's entry:
    /// linux-loader 0.13 takes the last PT_NOTE segment's answer (here: none, so it would boot
    /// the 64-bit entry), we take the first note found (found by the boot_elf fuzz target).
    #[test]
    fn a_later_note_segment_without_the_pvh_note_keeps_the_entry() {
        let mut elf = test_elf();
        put(&mut elf, 56, &5u16.to_le_bytes()); // e_phnum
        let at = 64 + 4 * 56;
        put(&mut elf, at, &PT_NOTE.to_le_bytes());
        put(&mut elf, at + 8, &0x8f20u64.to_le_bytes()); // p_offset
        put(&mut elf, at + 32, &16u64.to_le_bytes()); // p_filesz
                                                      // One note: namesz 4, descsz 0, type 1, "GNU\0".
        put(&mut elf, 0x8f20, &4u32.to_le_bytes());
        put(&mut elf, 0x8f24, &0u32.to_le_bytes());
        put(&mut elf, 0x8f28, &1u32.to_le_bytes());
        put(&mut elf, 0x8f2c, b"GNU\0");
        let k = read_elf(&mut memfd(&elf)).unwrap();
        assert_eq!(k.pvh_entry, Some(0x20_0123));
        let mem = create_guest_memory(4 << 20).unwrap();
        let r = Elf::load(
            &mem,
            None,
            &mut memfd(&elf),
            Some(GuestAddress(HIMEM_START)),
        )
        .unwrap();
        assert_eq!(r.pvh_boot_cap, PvhBootCapability::PvhEntryNotPresent);
    }

    #[test]
    fn mapped_pages_are_file_backed_and_marked() {
        let elf = test_elf();
        let mem = create_guest_memory(4 << 20).unwrap();
        let mut file = memfd(&elf);
        let k = read_elf(&mut file).unwrap();
        load_elf_mapped(&mem, &mut file, &k).unwrap();
        let host = mem.get_host_address(GuestAddress(0x20_0000)).unwrap() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{host:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        let header = lines.next().expect("the mapped range starts a mapping");
        assert!(header.contains("memfd:boot-files-test"), "{header}");
        let flags = lines.find(|l| l.starts_with("VmFlags:")).unwrap();
        assert!(flags.split_whitespace().any(|f| f == "dd"), "{flags}");
    }

    #[test]
    fn bad_headers_and_ranges_are_errors() {
        let mut elf = test_elf();
        elf[4] = 1;
        assert!(read_elf(&mut memfd(&elf)).is_err());
        let mut elf = test_elf();
        put(&mut elf, 24, &0x1000u64.to_le_bytes());
        assert!(read_elf(&mut memfd(&elf)).is_err());
        // A segment running past the end of the file.
        let mut elf = test_elf();
        put(&mut elf, 64 + 32, &0x10_0000u64.to_le_bytes());
        let mut f = memfd(&elf);
        let k = read_elf(&mut f).unwrap();
        let mem = create_guest_memory(4 << 20).unwrap();
        assert!(matches!(
            load_elf_mapped(&mem, &mut f, &k),
            Err(BootFileError::PastEnd { .. })
        ));
        // A segment past guest memory.
        let mem = create_guest_memory(2 << 20).unwrap();
        let mut f = memfd(&test_elf());
        let k = read_elf(&mut f).unwrap();
        assert!(matches!(
            load_elf_mapped(&mem, &mut f, &k),
            Err(BootFileError::OutOfMemory { .. })
        ));
        // A note claiming more than it holds is not read past its end.
        let mut elf = test_elf();
        put(&mut elf, 0x8f04, &u32::MAX.to_le_bytes());
        put(&mut elf, 0x8f08, &7u32.to_le_bytes());
        assert_eq!(read_elf(&mut memfd(&elf)).unwrap().pvh_entry, None);
    }
}

/// Properties of [`plan`] over any offsets, lengths and page sizes.
#[cfg(test)]
mod plan_properties {
    use super::*;
    use proptest::prelude::*;

    fn parts(p: &Piece) -> (u64, u64, u64) {
        match *p {
            Piece::Map {
                file_offset,
                guest,
                len,
            }
            | Piece::Copy {
                file_offset,
                guest,
                len,
            } => (file_offset, guest, len),
        }
    }

    /// Offsets near the page grid and near the top of the address space, where the rounding
    /// and the overflow checks are.
    fn address() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..(1 << 24),
            (0u64..1024).prop_map(|k| k * 4096),
            (0u64..(1 << 16)).prop_map(|k| u64::MAX - k),
            any::<u64>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The pieces cover exactly `guest..guest + len`, in order, each from the file offset
        /// that corresponds; mapped pieces are whole pages in the guest and in the file; copies
        /// beside a mapping are shorter than a page; never more than one mapping.
        #[test]
        fn pieces_tile_the_range(
            file_offset in address(),
            guest in address(),
            len in prop_oneof![0u64..(1 << 20), any::<u64>()],
            page_shift in 9u32..22,
        ) {
            let page = 1u64 << page_shift;
            let Ok(pieces) = plan(file_offset, guest, len, page) else {
                // Refused only where an end overflows.
                prop_assert!(
                    file_offset.checked_add(len).is_none() || guest.checked_add(len).is_none()
                );
                return Ok(());
            };
            prop_assert!(pieces.len() <= 3);
            let maps = pieces.iter().filter(|p| matches!(p, Piece::Map { .. })).count();
            prop_assert!(maps <= 1);
            let mut at = guest;
            for p in &pieces {
                let (f, g, l) = parts(p);
                prop_assert_eq!(g, at, "pieces are contiguous and in order");
                prop_assert!(l > 0);
                prop_assert_eq!(f - file_offset, g - guest, "file offset follows the guest address");
                match p {
                    Piece::Map { .. } => {
                        prop_assert_eq!(g % page, 0);
                        prop_assert_eq!(f % page, 0);
                        prop_assert_eq!(l % page, 0);
                    }
                    Piece::Copy { .. } if maps == 1 => prop_assert!(l < page),
                    Piece::Copy { .. } => {}
                }
                at = g + l;
            }
            prop_assert_eq!(at - guest, len, "the pieces add up to the range");
            // Congruent offsets with a whole page inside the range are mapped.
            let first_full = guest.checked_add(page - 1).map(|a| a & !(page - 1));
            if file_offset % page == guest % page
                && first_full.is_some_and(|a| a.checked_add(page).is_some_and(|e| e <= guest + len))
            {
                prop_assert_eq!(maps, 1);
            }
        }

        /// A page size that is no power of two is refused, never planned with.
        #[test]
        fn odd_page_sizes_are_refused(page in any::<u64>().prop_filter("not 2^n", |p| !p.is_power_of_two())) {
            prop_assert!(plan(0, 0, 4096, page).is_err());
        }
    }
}
