//! The sharing pass itself, run with every vCPU and the device thread paused
//! ([`share_paused`]): it walks the resident private pages of guest memory (the page map),
//! drops the all-zero ones (or maps zero memory over them in a boot file's mapping) and maps
//! the template page equal to a page over it, a run of consecutive pages at a time, within a
//! bound on new mappings. A failed mapping puts anonymous memory with the same bytes back.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;

use vm_memory::{GuestMemory as _, GuestMemoryRegion};

use super::error::{io, PageSharingError};
use super::index::TemplateIndex;
use super::page::{is_zero, PAGE};
use super::proc_self::{in_file_mapping, is_private_resident, read_maps};
use super::report::SharingReport;
use crate::memory::{mark_guest_ram, GuestMemory};

/// At most this many new mappings per pass: each costs the process up to two VMAs (one mapped
/// in the middle of another splits it; the kernel's limit is vm.max_map_count, 65530 by default).
const MAX_MAPPINGS_PER_PASS: usize = 16_384;
/// Passes stop mapping while the process has this many VMAs (leaving room under the default
/// vm.max_map_count for threads, allocations and later passes).
const MAX_PROCESS_VMAS: usize = 40_000;

/// The next run of actions to apply (consecutive guest pages, and for sharing consecutive
/// pages of one template).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// Drop `pages` zero pages at `host` (anonymous mapping).
    Drop { host: u64, pages: usize },
    /// Map anonymous zero memory over `pages` pages at `host` (file mapping).
    Zero { host: u64, pages: usize },
    /// Map `pages` pages of template `t` from page `first` at `host`.
    Share {
        host: u64,
        t: usize,
        first: usize,
        pages: usize,
    },
}

impl Run {
    fn extend(&mut self, next: Run) -> bool {
        match (self, next) {
            (Run::Drop { host, pages }, Run::Drop { host: h, .. })
            | (Run::Zero { host, pages }, Run::Zero { host: h, .. })
                if *host + (*pages * PAGE) as u64 == h =>
            {
                *pages += 1;
                true
            }
            (
                Run::Share {
                    host,
                    t,
                    first,
                    pages,
                },
                Run::Share {
                    host: h,
                    t: t2,
                    first: f2,
                    ..
                },
            ) if *host + (*pages * PAGE) as u64 == h && *t == t2 && *first + *pages == f2 => {
                *pages += 1;
                true
            }
            _ => false,
        }
    }

    fn pages(&self) -> usize {
        match *self {
            Run::Drop { pages, .. } | Run::Zero { pages, .. } | Run::Share { pages, .. } => pages,
        }
    }
}

/// Maps anonymous zero memory over `len` bytes at `host` (guest RAM).
///
/// # Safety
/// `host..host + len` must be whole pages of guest RAM whose threads are paused.
unsafe fn map_anonymous(host: u64, len: usize) -> std::io::Result<()> {
    // SAFETY: per the contract, the range is guest RAM owned by the VM's memory (unmapped only
    // when it drops, whole), accessed only through raw pointers, and nobody touches it now.
    let r = unsafe {
        libc::mmap(
            host as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if r == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    mark_guest_ram(host as *mut u8, len);
    Ok(())
}

fn apply(
    run: Run,
    index: &TemplateIndex,
    report: &mut SharingReport,
) -> Result<(), PageSharingError> {
    match run {
        Run::Drop { host, pages } => {
            // SAFETY: whole pages of guest RAM (from its regions) of an anonymous private
            // mapping, all zero, with every thread that uses guest memory paused: dropping them
            // makes the next access read zeros, the same bytes.
            let r = unsafe {
                libc::madvise(host as *mut libc::c_void, pages * PAGE, libc::MADV_DONTNEED)
            };
            if r != 0 {
                log::debug!(
                    "page sharing: madvise(MADV_DONTNEED) at {host:#x}: {}",
                    std::io::Error::last_os_error()
                );
                return Ok(());
            }
            report.zero_dropped += pages as u64;
        }
        Run::Zero { host, pages } => {
            // SAFETY: whole pages of guest RAM, all zero, threads paused; zero memory replaces
            // zero bytes.
            match unsafe { map_anonymous(host, pages * PAGE) } {
                Ok(()) => report.zero_dropped += pages as u64,
                Err(source) => return Err(PageSharingError::Restore { addr: host, source }),
            }
        }
        Run::Share {
            host,
            t,
            first,
            pages,
        } => {
            let view = &index.views()[t];
            let len = pages * PAGE;
            // SAFETY: `host..host + len` are whole pages of guest RAM (from its regions, in one
            // region) that vm-memory unmaps only when it drops (all of the region); guest memory
            // is reached only through raw pointers, and every thread that uses it is paused.
            // Each page equals the template page mapped over it, so the guest sees the same
            // bytes; the mapping is private and read-write like the RAM it replaces (a write
            // copies the page). KVM drops its own view of the old pages (MMU notifier).
            let r = unsafe {
                libc::mmap(
                    host as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    view.file().as_raw_fd(),
                    (first * PAGE) as libc::off_t,
                )
            };
            if r == libc::MAP_FAILED {
                let err = std::io::Error::last_os_error();
                log::debug!("page sharing: mapping {} at {host:#x}: {err}", view.name());
                // A failed MAP_FIXED may have unmapped the old pages: put anonymous memory
                // back with the same bytes (the template's, which were equal).
                // SAFETY: as above.
                unsafe { map_anonymous(host, len) }
                    .map_err(|source| PageSharingError::Restore { addr: host, source })?;
                for i in 0..pages {
                    let src = view.page(first + i);
                    // SAFETY: the destination is the page just mapped (writable, ours, nobody
                    // else touches it while paused); the source is the template page.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            (host as *mut u8).add(i * PAGE),
                            PAGE,
                        )
                    };
                }
                return Ok(());
            }
            mark_guest_ram(host as *mut u8, len);
            report.shared[t] += pages as u64;
        }
    }
    Ok(())
}

/// The sharing pass over `mem`: see the module doc. Every thread that uses guest memory (vCPUs,
/// devices) must be paused for its whole length.
pub(crate) fn share_paused(
    mem: &GuestMemory,
    index: &TemplateIndex,
    report: &mut SharingReport,
) -> Result<(), PageSharingError> {
    share_paused_within(mem, index, report, MAX_MAPPINGS_PER_PASS)
}

/// [`share_paused`] making at most `max_mappings` new mappings.
fn share_paused_within(
    mem: &GuestMemory,
    index: &TemplateIndex,
    report: &mut SharingReport,
    max_mappings: usize,
) -> Result<(), PageSharingError> {
    let vmas = read_maps()?;
    let mut pagemap = File::open("/proc/self/pagemap").map_err(io("open /proc/self/pagemap"))?;
    report.shared = vec![0; index.views().len()];
    report.templates = index.views().iter().map(|v| v.name().to_string()).collect();
    // Mappings this pass may make: its own bound, and what keeps the process's VMAs in bounds.
    let budget = max_mappings.min(MAX_PROCESS_VMAS.saturating_sub(vmas.len()) / 2);
    let mut mappings = 0usize;
    let mut pending: Option<Run> = None;
    const CHUNK: usize = 4096;
    let mut entries = vec![0u8; CHUNK * 8];
    for region in mem.iter() {
        let base = region.as_ptr() as u64;
        let pages = usize::try_from(region.len()).unwrap_or(0) / PAGE;
        let mut done = 0usize;
        while done < pages {
            let n = CHUNK.min(pages - done);
            let first = base + (done * PAGE) as u64;
            pagemap
                .seek(SeekFrom::Start(first / PAGE as u64 * 8))
                .and_then(|_| pagemap.read_exact(&mut entries[..n * 8]))
                .map_err(io("read /proc/self/pagemap"))?;
            for i in 0..n {
                let mut e = [0u8; 8];
                e.copy_from_slice(&entries[i * 8..i * 8 + 8]);
                if !is_private_resident(u64::from_le_bytes(e)) {
                    continue;
                }
                let host = first + (i * PAGE) as u64;
                report.scanned += 1;
                // SAFETY: the page lies inside the region's mapping (i < n pages from `first`),
                // which lives as long as `mem`; every thread that writes guest memory is paused
                // (this function's contract), so the bytes do not change while we read them.
                let page = unsafe { std::slice::from_raw_parts(host as *const u8, PAGE) };
                let run = if is_zero(page) {
                    if in_file_mapping(&vmas, host) {
                        Run::Zero { host, pages: 1 }
                    } else {
                        Run::Drop { host, pages: 1 }
                    }
                } else if let Some((t, p)) = index.find(page) {
                    Run::Share {
                        host,
                        t,
                        first: p,
                        pages: 1,
                    }
                } else {
                    report.misses += 1;
                    continue;
                };
                if let Some(cur) = pending.as_mut() {
                    if cur.extend(run) {
                        continue;
                    }
                }
                if let Some(cur) = pending.replace(run) {
                    flush(cur, index, report, &mut mappings, budget)?;
                }
            }
            done += n;
        }
        // Runs never cross regions.
        if let Some(cur) = pending.take() {
            flush(cur, index, report, &mut mappings, budget)?;
        }
    }
    Ok(())
}

fn flush(
    run: Run,
    index: &TemplateIndex,
    report: &mut SharingReport,
    mappings: &mut usize,
    budget: usize,
) -> Result<(), PageSharingError> {
    if matches!(run, Run::Drop { .. }) {
        return apply(run, index, report);
    }
    if *mappings >= budget {
        report.skipped += run.pages() as u64;
        return Ok(());
    }
    *mappings += 1;
    apply(run, index, report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;
    use crate::page_sharing::proc_self::PM_FILE_OR_SHARED;
    use crate::page_sharing::test_fixtures::{sample_files, temp_dir};
    use crate::page_sharing::{TemplateDir, TemplateView};
    use vm_memory::{Bytes, GuestAddress};

    /// The host pages of guest memory at `guest` (one page) as pagemap sees them.
    fn pagemap_entry(mem: &GuestMemory, guest: u64) -> u64 {
        let host = mem.get_host_address(GuestAddress(guest)).unwrap() as u64;
        let mut f = File::open("/proc/self/pagemap").unwrap();
        f.seek(SeekFrom::Start(host / PAGE as u64 * 8)).unwrap();
        let mut e = [0u8; 8];
        f.read_exact(&mut e).unwrap();
        u64::from_le_bytes(e)
    }

    #[test]
    fn zero_pages_are_dropped_and_equal_pages_mapped_from_the_template() {
        let d_tmp = temp_dir("pass");
        let d = d_tmp.path().to_path_buf();
        let dir = TemplateDir::open(&d).unwrap();
        let (a, _) = sample_files();
        // Template: three pages of `a` (page 2 partly zero) and an all-zero page.
        let mut t = a.clone();
        t.resize(4 * PAGE, 0);
        let view = TemplateView::new("initrd-files-test", dir.put("tpl", &t).unwrap()).unwrap();
        let mut index = TemplateIndex::default();
        index.add(view);

        let mem = create_guest_memory(4 << 20).unwrap();
        // Guest: template pages 0, 1 at 1 MiB (consecutive: one mapping), page 2 alone at
        // 2 MiB, a page that differs from page 0 by one byte, zero pages written, and pages
        // never touched.
        mem.write_slice(&t[..2 * PAGE], GuestAddress(0x10_0000))
            .unwrap();
        mem.write_slice(&t[2 * PAGE..3 * PAGE], GuestAddress(0x20_0000))
            .unwrap();
        let mut near = t[..PAGE].to_vec();
        near[100] ^= 1;
        mem.write_slice(&near, GuestAddress(0x30_0000)).unwrap();
        mem.write_slice(&vec![0u8; 3 * PAGE], GuestAddress(0x38_0000))
            .unwrap();
        // Force them resident and private.
        mem.write_slice(&[0u8], GuestAddress(0x38_0000)).unwrap();
        let before = guest_bytes(&mem);

        let mut report = SharingReport::default();
        share_paused(&mem, &index, &mut report).unwrap();
        assert_eq!(report.shared, vec![3], "{report}");
        assert_eq!(report.zero_dropped, 3, "{report}");
        assert_eq!(report.misses, 1, "{report}");
        assert_eq!(report.scanned, 7, "{report}");
        // The guest sees the same bytes everywhere.
        assert!(guest_bytes(&mem) == before);
        // The shared pages are file pages now, the dropped ones gone.
        assert_ne!(pagemap_entry(&mem, 0x10_0000) & PM_FILE_OR_SHARED, 0);
        // (Read since: the shared zero page, not a page of ours.)
        assert!(!is_private_resident(pagemap_entry(&mem, 0x38_0000)));
        assert!(is_private_resident(pagemap_entry(&mem, 0x30_0000)));
        // A write to a shared page copies it: the template file does not change.
        mem.write_obj(0xdead_beef_u32, GuestAddress(0x10_0010))
            .unwrap();
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x10_0010)).unwrap(),
            0xdead_beef
        );
        assert_eq!(std::fs::read(d.join("tpl")).unwrap(), t);
        assert!(is_private_resident(pagemap_entry(&mem, 0x10_0000)));
        // A second pass finds nothing new to do but the written page's neighbours stay shared.
        let mut again = SharingReport::default();
        share_paused(&mem, &index, &mut again).unwrap();
        assert_eq!(again.shared, vec![0], "{again}");
        assert_eq!(again.zero_dropped, 0, "{again}");
    }

    /// A template directory under `tag` holding one template "x": the first sample file,
    /// padded to two pages. Returns the directory (removed when dropped), the template's bytes
    /// and its index.
    fn two_page_template(tag: &str) -> (tempfile::TempDir, Vec<u8>, TemplateIndex) {
        let d = temp_dir(tag);
        let dir = TemplateDir::open(d.path()).unwrap();
        let (mut t, _) = sample_files();
        t.resize(2 * PAGE, 0);
        let mut index = TemplateIndex::default();
        index.add(TemplateView::new("x", dir.put("tpl", &t).unwrap()).unwrap());
        (d, t, index)
    }

    #[test]
    fn a_wrong_template_shares_nothing() {
        let (_d, t, index) = two_page_template("wrong");
        let mem = create_guest_memory(2 << 20).unwrap();
        // Pages whose hash could match nothing in the template, and one differing at the end.
        let mut p = t[..PAGE].to_vec();
        p[PAGE - 1] ^= 0x80;
        mem.write_slice(&p, GuestAddress(0x10_0000)).unwrap();
        let before = guest_bytes(&mem);
        let mut report = SharingReport::default();
        share_paused(&mem, &index, &mut report).unwrap();
        assert_eq!(report.shared, vec![0]);
        assert_eq!(report.misses, 1);
        assert!(guest_bytes(&mem) == before);
    }

    #[test]
    fn the_mapping_budget_leaves_the_rest_counted() {
        let (_d, t, index) = two_page_template("budget");
        let mem = create_guest_memory(2 << 20).unwrap();
        // Two runs (not adjacent): one mapping allowed.
        mem.write_slice(&t[..PAGE], GuestAddress(0x10_0000))
            .unwrap();
        mem.write_slice(&t[..PAGE], GuestAddress(0x18_0000))
            .unwrap();
        let before = guest_bytes(&mem);
        let mut report = SharingReport::default();
        share_paused_within(&mem, &index, &mut report, 1).unwrap();
        assert_eq!(report.shared, vec![1], "{report}");
        assert_eq!(report.skipped, 1, "{report}");
        assert!(guest_bytes(&mem) == before);
    }

    fn guest_bytes(mem: &GuestMemory) -> Vec<u8> {
        let mut v = vec![0u8; mem.last_addr().0 as usize + 1];
        mem.read_slice(&mut v, GuestAddress(0)).unwrap();
        v
    }

    #[test]
    fn zero_pages_in_a_file_mapping_become_anonymous_zero_memory() {
        let d_tmp = temp_dir("filezero");
        let d = d_tmp.path().to_path_buf();
        let dir = TemplateDir::open(&d).unwrap();
        let (a, _) = sample_files();
        let mut content = a.clone();
        content.resize(4 * PAGE, 0x55);
        let f = dir.put("boot", &content).unwrap();
        let mem = create_guest_memory(2 << 20).unwrap();
        // A boot file mapped over guest RAM (as boot_files does), a page of it zeroed by the
        // guest: dropping it would bring the file's bytes back.
        let host = mem.get_host_address(GuestAddress(0x10_0000)).unwrap();
        // SAFETY: four whole pages of the test's own guest memory, nothing else uses it.
        let r = unsafe {
            libc::mmap(
                host.cast(),
                4 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        mem.write_slice(&vec![0u8; PAGE], GuestAddress(0x10_1000))
            .unwrap();
        let before = guest_bytes(&mem);
        let mut report = SharingReport::default();
        share_paused(&mem, &TemplateIndex::default(), &mut report).unwrap();
        assert_eq!(report.zero_dropped, 1, "{report}");
        assert!(guest_bytes(&mem) == before);
    }

    #[test]
    fn runs_extend_over_consecutive_pages_of_one_template() {
        let mut r = Run::Share {
            host: 0x1000,
            t: 0,
            first: 5,
            pages: 1,
        };
        assert!(r.extend(Run::Share {
            host: 0x2000,
            t: 0,
            first: 6,
            pages: 1
        }));
        assert!(!r.extend(Run::Share {
            host: 0x3000,
            t: 0,
            first: 9,
            pages: 1
        }));
        assert!(!r.extend(Run::Drop {
            host: 0x3000,
            pages: 1
        }));
        assert_eq!(r.pages(), 2);
    }
}
