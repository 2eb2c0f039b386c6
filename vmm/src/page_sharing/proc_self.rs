//! What the pass reads of this process in /proc: its mappings (/proc/self/maps: which guest
//! pages lie in a file mapping, where a dropped page would show the file again) and the bits
//! of its page map (/proc/self/pagemap: which pages are resident, private and anonymous).

use super::error::{io, PageSharingError};

/// One mapping in the process (from /proc/self/maps): its range and whether it has a file.
#[derive(Debug, Clone, Copy)]
pub(super) struct Vma {
    start: u64,
    end: u64,
    file: bool,
}

/// The process's mappings, sorted by start (lines it cannot read are left out).
pub(super) fn read_maps() -> Result<Vec<Vma>, PageSharingError> {
    let text = std::fs::read_to_string("/proc/self/maps").map_err(io("read /proc/self/maps"))?;
    let mut v = Vec::new();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        let (Some(range), Some(_perms), Some(_off), Some(_dev), Some(inode)) =
            (w.next(), w.next(), w.next(), w.next(), w.next())
        else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        v.push(Vma {
            start,
            end,
            file: inode != "0",
        });
    }
    v.sort_by_key(|m| m.start);
    Ok(v)
}

/// Whether `addr` lies in a mapping of a file (`vmas` from [`read_maps`]).
pub(super) fn in_file_mapping(vmas: &[Vma], addr: u64) -> bool {
    let i = vmas.partition_point(|m| m.start <= addr);
    i > 0 && vmas[i - 1].end > addr && vmas[i - 1].file
}

/// /proc/self/pagemap bits.
const PM_PRESENT: u64 = 1 << 63;
pub(super) const PM_FILE_OR_SHARED: u64 = 1 << 61;
const PM_EXCLUSIVE: u64 = 1 << 56;

/// Whether a pagemap entry is a resident private anonymous page that only this mapping holds
/// (not a file page, not the shared zero page).
pub(super) fn is_private_resident(entry: u64) -> bool {
    entry & PM_PRESENT != 0 && entry & PM_FILE_OR_SHARED == 0 && entry & PM_EXCLUSIVE != 0
}
