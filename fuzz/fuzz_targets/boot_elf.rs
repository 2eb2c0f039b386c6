//! The kernel ELF as the VMM maps it (`vmm::boot_files`): the header, program headers and PVH
//! note read by `read_elf`, then the segments placed in guest memory by `load_elf_mapped` (whole
//! pages mapped from the file, the rest copied). The kernel file is the host's (the operator's
//! or the image's), not the guest's; still, nothing in it may make the VMM panic or write
//! outside guest memory.
//!
//! Checked against linux-loader's loader, which the VMM uses when it copies the kernel instead:
//! when both accept a file they agree on the entry point and the end, and on the PVH entry when
//! ours finds one (linux-loader also reads a note that runs past its segment's end; we do not).
#![no_main]

use std::io::{Seek, SeekFrom, Write};

use libfuzzer_sys::fuzz_target;
use linux_loader::loader::{Elf, KernelLoader, PvhBootCapability};
use microvm_fuzz::scratch::{self, Scratch};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm::boot_files;

/// Guest RAM for the load: the kernel goes at 1 MiB and up.
const MEM: usize = 32 << 20;
const HIMEM_START: u64 = 0x10_0000;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::boot_elf);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("elf");
        let path = dir.path().join("vmlinux");
        let mut file = std::fs::File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("kernel file");
        file.write_all(data).expect("write");
        let Ok(kernel) = boot_files::read_elf(&mut file) else {
            return;
        };
        let mem: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("memory");
        let mapped = boot_files::load_elf_mapped(&mem, &mut file, &kernel);
        let theirs: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("memory");
        file.seek(SeekFrom::Start(0)).expect("seek");
        let copied = Elf::load(&theirs, None, &mut file, Some(GuestAddress(HIMEM_START)));
        if let (Ok(_), Ok(r)) = (&mapped, &copied) {
            assert_eq!(kernel.entry, r.kernel_load.0, "entry point");
            let pvh = match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(a) => Some(a.0),
                _ => None,
            };
            // Ours reads a PVH note only whole inside its PT_NOTE segment; linux-loader 0.13
            // bounds where a note starts by the segment's size, not where it ends, so it also
            // takes a note that runs past the segment (found by this target: a 20-byte segment
            // whose second note lies half outside). An entry we find, it finds the same, when
            // the file has one PT_NOTE segment: with several, ours keeps the first PVH note
            // found and linux-loader the last segment's answer, note or none (found by this
            // target too; vmm's boot_files test a_later_note_segment_without_the_pvh_note_...).
            if kernel.pvh_entry.is_some() && note_segments(data) == 1 {
                assert_eq!(kernel.pvh_entry, pvh, "PVH entry");
            }
            assert_eq!(kernel.end, r.kernel_end, "kernel end");
        }
    }
);

/// How many program headers of `data` (an ELF that `read_elf` took, so its header and program
/// headers are whole) are PT_NOTE.
fn note_segments(data: &[u8]) -> usize {
    const PT_NOTE: u32 = 4;
    let u64_at = |at: usize| {
        data.get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    let (Some(phoff), Some(phnum)) = (u64_at(32), data.get(56..58)) else {
        return 0;
    };
    let phnum = usize::from(u16::from_le_bytes([phnum[0], phnum[1]]));
    (0..phnum)
        .filter_map(|i| {
            let at = usize::try_from(phoff).ok()?.checked_add(i * 56)?;
            data.get(at..at + 4)
        })
        .filter(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) == PT_NOTE)
        .count()
}
