//! Loading the guest: the ELF kernel, the initrd, the command line, and the boot information
//! for the entry protocol (Linux zero page with E820, or PVH hvm_start_info with a memory map).

use std::fs::File;
use std::io::{Seek, SeekFrom};

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, KernelLoader};
use vm_memory::{ByteValued, Bytes, GuestAddress};

use crate::boot_files::{self, LoadStats};
use crate::config::BootFiles;
use crate::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START, HIMEM_START, MMIO_GAP_END, MMIO_GAP_START,
    PVH_INFO_START, PVH_MEMMAP_START, PVH_MODLIST_START, ZERO_PAGE_START,
};
use crate::memory::GuestMemory;

/// E820 type of usable RAM.
pub const E820_RAM: u32 = 1;
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
const PAGE_SIZE: u64 = 4096;

/// Errors of the boot path.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open: {0}")]
    Open(std::io::Error),
    #[error("not a loadable ELF kernel: {0}")]
    Load(linux_loader::loader::Error),
    #[error("the kernel has no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY), PVH boot impossible")]
    NoPvhEntry,
    #[error("initrd of {size} bytes does not fit in guest memory between the kernel end {kernel_end:#x} and {top:#x}")]
    InitrdTooLarge {
        size: u64,
        kernel_end: u64,
        top: u64,
    },
    #[error("cannot read the initrd: {0}")]
    InitrdRead(String),
    #[error("kernel command line: {0}")]
    Cmdline(String),
    #[error("placing the file in guest memory: {0}")]
    Place(#[source] crate::boot_files::BootFileError),
    #[error("cannot write the {0} to guest memory")]
    Write(&'static str),
}

/// What the ELF loader found.
#[derive(Debug, Clone)]
pub struct LoadedKernel {
    /// The 64-bit entry point (ELF e_entry).
    pub entry: u64,
    /// First byte after the loaded image.
    pub end: u64,
    /// The PVH 32-bit entry point, if the ELF has one.
    pub pvh_entry: Option<u64>,
    /// How much was mapped from the file and copied ([`BootFiles::Map`]); `None`: copied whole
    /// by linux-loader's ELF loader.
    pub mapped: Option<LoadStats>,
}

/// Where the initrd went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitrdPlacement {
    pub addr: u64,
    pub size: u64,
}

/// Loads the ELF kernel in `file` (the embedder's, or opened from its path: never opened here)
/// into `mem`: with [`BootFiles::Map`] its segments' whole pages are mapped from the file
/// ([`crate::boot_files`]); a file whose headers that path does not take, and
/// [`BootFiles::Copy`], go through linux-loader's ELF loader (a copy). Every read says where
/// it reads: the file's offset does not count.
pub fn load_kernel(
    mem: &GuestMemory,
    file: &mut File,
    files: BootFiles,
) -> Result<LoadedKernel, BootError> {
    if files == BootFiles::Map {
        match boot_files::read_elf(file) {
            Ok(k) => {
                let stats = boot_files::load_elf_mapped(mem, file, &k).map_err(BootError::Place)?;
                return Ok(LoadedKernel {
                    entry: k.entry,
                    end: k.end,
                    pvh_entry: k.pvh_entry,
                    mapped: Some(stats),
                });
            }
            Err(e) => log::debug!(
                "the kernel is not mapped from its file ({e}); copying it with the ELF loader"
            ),
        }
    }
    // linux-loader's loader rewinds the file itself.
    let r = Elf::load(mem, None, file, Some(GuestAddress(HIMEM_START))).map_err(BootError::Load)?;
    let pvh_entry = match r.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(a) => Some(a.0),
        _ => None,
    };
    Ok(LoadedKernel {
        entry: r.kernel_load.0,
        end: r.kernel_end,
        pvh_entry,
        mapped: None,
    })
}

/// Where an initrd of `size` bytes goes: as high as possible below the MMIO gap (and the end of
/// RAM), page aligned, above the kernel.
pub fn initrd_address(mem_size: u64, kernel_end: u64, size: u64) -> Result<u64, BootError> {
    let top = mem_size.min(MMIO_GAP_START);
    let too_large = BootError::InitrdTooLarge {
        size,
        kernel_end,
        top,
    };
    let addr = top.checked_sub(size).ok_or(too_large)? & !(PAGE_SIZE - 1);
    let floor = kernel_end
        .checked_add(PAGE_SIZE - 1)
        .map(|e| e & !(PAGE_SIZE - 1))
        .unwrap_or(u64::MAX);
    if addr < floor {
        return Err(BootError::InitrdTooLarge {
            size,
            kernel_end,
            top,
        });
    }
    Ok(addr)
}

/// Loads the initrd in `file` (the embedder's, or opened from its path: never opened here) high
/// in guest memory, all of it from its start: mapped from the file where [`BootFiles::Map`]
/// (its page-aligned start makes every whole page mappable; the partial last page is copied),
/// else copied. Returns where it went and, when mapped, how.
pub fn load_initrd(
    mem: &GuestMemory,
    mem_size: u64,
    kernel_end: u64,
    file: &mut File,
    files: BootFiles,
) -> Result<(InitrdPlacement, Option<LoadStats>), BootError> {
    let size = file
        .metadata()
        .map_err(|e| BootError::InitrdRead(e.to_string()))?
        .len();
    let addr = initrd_address(mem_size, kernel_end, size)?;
    let placement = InitrdPlacement { addr, size };
    if files == BootFiles::Map {
        let mut stats = LoadStats::default();
        boot_files::place_range(mem, file, 0, addr, size, &mut stats).map_err(BootError::Place)?;
        return Ok((placement, Some(stats)));
    }
    let len = usize::try_from(size).map_err(|e| BootError::InitrdRead(e.to_string()))?;
    file.seek(SeekFrom::Start(0))
        .map_err(|e| BootError::InitrdRead(e.to_string()))?;
    mem.read_exact_volatile_from(GuestAddress(addr), file, len)
        .map_err(|e| BootError::InitrdRead(e.to_string()))?;
    Ok((placement, None))
}

/// The kernel command line: the user's part, then the VMM's device arguments.
pub fn build_cmdline(user: &str, device_args: &[String]) -> Result<Cmdline, BootError> {
    let err = |e: linux_loader::cmdline::Error| BootError::Cmdline(e.to_string());
    let mut c = Cmdline::new(CMDLINE_MAX_SIZE).map_err(err)?;
    let user = user.trim();
    if !user.is_empty() {
        c.insert_str(user).map_err(err)?;
    }
    for a in device_args {
        c.insert_str(a).map_err(err)?;
    }
    Ok(c)
}

/// Writes the command line at its fixed address; returns its length with the NUL.
pub fn write_cmdline(mem: &GuestMemory, cmdline: &Cmdline) -> Result<usize, BootError> {
    let cstr = cmdline
        .as_cstring()
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    Ok(cstr.as_bytes_with_nul().len())
}

/// The RAM map both protocols report: low memory up to the EBDA, then from 1 MiB to the gap (or
/// the end of RAM), then above 4 GiB. Entries are (address, size).
pub fn ram_map(mem_size: u64) -> Vec<(u64, u64)> {
    let mut map = vec![(0, EBDA_START)];
    let low_end = mem_size.min(MMIO_GAP_START);
    if low_end > HIMEM_START {
        map.push((HIMEM_START, low_end - HIMEM_START));
    }
    if mem_size > MMIO_GAP_START {
        map.push((MMIO_GAP_END, mem_size - MMIO_GAP_START));
    }
    map
}

#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct ZeroPage(boot_params);
// SAFETY: boot_params is a plain-old-data C struct (integers and arrays of them) with no
// implicit padding (it is packed); any byte pattern is a valid value.
unsafe impl ByteValued for ZeroPage {}

#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct StartInfo(hvm_start_info);
// SAFETY: a C struct of integers with explicit reserved fields; any byte pattern is valid.
unsafe impl ByteValued for StartInfo {}

#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct MemmapEntry(hvm_memmap_table_entry);
// SAFETY: as above.
unsafe impl ByteValued for MemmapEntry {}

#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct ModlistEntry(hvm_modlist_entry);
// SAFETY: as above.
unsafe impl ByteValued for ModlistEntry {}

/// The zero page of the 64-bit Linux boot protocol.
fn zero_page(mem_size: u64, cmdline_len: usize, initrd: Option<InitrdPlacement>) -> ZeroPage {
    let mut p = boot_params::default();
    p.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    p.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    p.hdr.header = KERNEL_HDR_MAGIC;
    p.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    p.hdr.cmd_line_ptr = CMDLINE_START as u32;
    p.hdr.cmdline_size = cmdline_len as u32;
    if let Some(i) = initrd {
        p.hdr.ramdisk_image = i.addr as u32;
        p.hdr.ramdisk_size = i.size as u32;
    }
    let map = ram_map(mem_size);
    let mut table = p.e820_table;
    for (slot, (addr, size)) in table.iter_mut().zip(&map) {
        slot.addr = *addr;
        slot.size = *size;
        slot.type_ = E820_RAM;
    }
    p.e820_table = table;
    p.e820_entries = map.len() as u8;
    ZeroPage(p)
}

/// Writes the zero page for the 64-bit Linux entry.
pub fn write_linux_boot_info(
    mem: &GuestMemory,
    mem_size: u64,
    cmdline_len: usize,
    initrd: Option<InitrdPlacement>,
) -> Result<u64, BootError> {
    mem.write_obj(
        zero_page(mem_size, cmdline_len, initrd),
        GuestAddress(ZERO_PAGE_START),
    )
    .map_err(|_| BootError::Write("zero page"))?;
    Ok(ZERO_PAGE_START)
}

/// Writes hvm_start_info, the module list (the initrd) and the memory map for the PVH entry.
pub fn write_pvh_boot_info(
    mem: &GuestMemory,
    mem_size: u64,
    initrd: Option<InitrdPlacement>,
) -> Result<u64, BootError> {
    let map = ram_map(mem_size);
    for (i, (addr, size)) in map.iter().enumerate() {
        let e = MemmapEntry(hvm_memmap_table_entry {
            addr: *addr,
            size: *size,
            type_: E820_RAM,
            reserved: 0,
        });
        let at = PVH_MEMMAP_START + (i * std::mem::size_of::<MemmapEntry>()) as u64;
        mem.write_obj(e, GuestAddress(at))
            .map_err(|_| BootError::Write("PVH memory map"))?;
    }
    let mut info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: map.len() as u32,
        ..Default::default()
    };
    if let Some(i) = initrd {
        let m = ModlistEntry(hvm_modlist_entry {
            paddr: i.addr,
            size: i.size,
            ..Default::default()
        });
        mem.write_obj(m, GuestAddress(PVH_MODLIST_START))
            .map_err(|_| BootError::Write("PVH module list"))?;
        info.nr_modules = 1;
        info.modlist_paddr = PVH_MODLIST_START;
    }
    mem.write_obj(StartInfo(info), GuestAddress(PVH_INFO_START))
        .map_err(|_| BootError::Write("PVH start info"))?;
    Ok(PVH_INFO_START)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;

    #[test]
    fn ram_map_leaves_holes() {
        assert_eq!(
            ram_map(64 << 20),
            vec![(0, EBDA_START), (HIMEM_START, (64 << 20) - HIMEM_START)]
        );
        let big = ram_map(5 << 30);
        assert_eq!(big.len(), 3);
        assert_eq!(big[1], (HIMEM_START, MMIO_GAP_START - HIMEM_START));
        assert_eq!(big[2], (MMIO_GAP_END, 2 << 30));
    }

    #[test]
    fn zero_page_has_e820_and_cmdline() {
        let zp = zero_page(
            512 << 20,
            12,
            Some(InitrdPlacement {
                addr: 0x1000_0000,
                size: 77,
            }),
        );
        let p = zp.0;
        assert_eq!({ p.e820_entries }, 2);
        let t = p.e820_table;
        assert_eq!(
            ({ t[1].addr }, { t[1].size }, { t[1].type_ }),
            (HIMEM_START, (512 << 20) - HIMEM_START, E820_RAM)
        );
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ p.hdr.cmdline_size }, 12);
        assert_eq!({ p.hdr.ramdisk_image }, 0x1000_0000);
        assert_eq!({ p.hdr.boot_flag }, 0xaa55);
        // The cmdline pointer sits at offset 0x228 of the zero page, where guests read it.
        let bytes = zp.as_slice();
        assert_eq!(&bytes[0x228..0x22c], &(CMDLINE_START as u32).to_le_bytes());
    }

    #[test]
    fn initrd_goes_high_and_page_aligned() {
        let a = initrd_address(64 << 20, 0x20_0000, 5000).unwrap();
        assert_eq!(a % PAGE_SIZE, 0);
        assert!(a + 5000 <= 64 << 20 && a >= (64 << 20) - 2 * PAGE_SIZE);
        // Below the gap for large memory.
        assert!(initrd_address(8 << 30, 0x20_0000, 4096).unwrap() < MMIO_GAP_START);
        assert!(initrd_address(4 << 20, 0x20_0000, 3 << 20).is_err());
        assert!(initrd_address(4 << 20, 0x20_0000, u64::MAX).is_err());
    }

    #[test]
    fn cmdline_appends_device_args() {
        let c = build_cmdline(
            " console=ttyS0 ",
            &["virtio_mmio.device=4K@0xd0000000:5".into()],
        )
        .unwrap();
        assert_eq!(
            c.as_cstring().unwrap().to_str().unwrap(),
            "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5"
        );
        assert!(build_cmdline(&"x".repeat(CMDLINE_MAX_SIZE), &[]).is_err());
        let mem = create_guest_memory(1 << 20).unwrap();
        let n = write_cmdline(&mem, &build_cmdline("a=b", &[]).unwrap()).unwrap();
        assert_eq!(n, 4);
        let mut buf = [0u8; 4];
        mem.read_slice(&mut buf, GuestAddress(CMDLINE_START))
            .unwrap();
        assert_eq!(&buf, b"a=b\0");
    }

    #[test]
    fn pvh_start_info() {
        let mem = create_guest_memory(64 << 20).unwrap();
        let at = write_pvh_boot_info(
            &mem,
            64 << 20,
            Some(InitrdPlacement {
                addr: 0x300_0000,
                size: 10,
            }),
        )
        .unwrap();
        let info: StartInfo = mem.read_obj(GuestAddress(at)).unwrap();
        assert_eq!(info.0.magic, XEN_HVM_START_MAGIC);
        assert_eq!(info.0.memmap_entries, 2);
        assert_eq!(info.0.nr_modules, 1);
        let cmdline_off: u64 = mem.read_obj(GuestAddress(at + 0x18)).unwrap();
        assert_eq!(cmdline_off, CMDLINE_START);
        let m: ModlistEntry = mem.read_obj(GuestAddress(PVH_MODLIST_START)).unwrap();
        assert_eq!((m.0.paddr, m.0.size), (0x300_0000, 10));
    }
}
