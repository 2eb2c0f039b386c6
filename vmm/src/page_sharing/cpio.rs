//! The initrd as page sharing reads it: a newc cpio archive ([`parse_newc`], every offset
//! checked against the archive's length), and the initrd template made of its regular files,
//! each laid out from a page boundary as a guest's page cache holds it
//! ([`write_initrd_template`]).

use std::io::Write;
use std::ops::Range;

use super::page::PAGE;

/// Names in an initrd longer than this are refused (PATH_MAX).
const MAX_CPIO_NAME: usize = 4096;
/// An initrd with more entries than this is not made a template.
const MAX_CPIO_ENTRIES: usize = 1 << 20;

/// Errors of reading an initrd as a cpio archive.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CpioError {
    #[error("entry at {at:#x}: not a newc cpio header (compressed initrd?)")]
    Magic { at: usize },
    #[error("entry at {at:#x}: cut short")]
    Truncated { at: usize },
    #[error("entry at {at:#x}: field is not hexadecimal")]
    Field { at: usize },
    #[error("entry at {at:#x}: name of {len} bytes")]
    Name { at: usize, len: usize },
    #[error("more than {MAX_CPIO_ENTRIES} entries")]
    TooManyEntries,
}

/// A regular file of a cpio archive: its name and where its bytes are in the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpioFile {
    pub name: String,
    pub data: Range<usize>,
}

fn hex_field(b: &[u8], at: usize, index: usize) -> Result<usize, CpioError> {
    let start = at + 6 + index * 8;
    let f = b.get(start..start + 8).ok_or(CpioError::Truncated { at })?;
    let s = std::str::from_utf8(f).map_err(|_| CpioError::Field { at })?;
    let v = u32::from_str_radix(s, 16).map_err(|_| CpioError::Field { at })?;
    usize::try_from(v).map_err(|_| CpioError::Field { at })
}

fn align4(n: usize) -> Option<usize> {
    n.checked_add(3).map(|n| n & !3)
}

/// The regular files (with data) of a newc cpio archive, as the kernel unpacks an initramfs:
/// archives may follow each other, with zero padding between them. Every offset is checked
/// against the archive's length; what follows an archive that is not another newc archive (a
/// compressed one) is left out.
pub fn parse_newc(b: &[u8]) -> Result<Vec<CpioFile>, CpioError> {
    const HEADER: usize = 110;
    let mut files = Vec::new();
    let mut at = 0usize;
    let mut entries = 0usize;
    loop {
        // Zero padding between archives (and at the end).
        while b.get(at) == Some(&0) {
            at += 1;
        }
        if at >= b.len() {
            break;
        }
        let magic = b.get(at..at + 6).ok_or(CpioError::Truncated { at })?;
        if magic != b"070701" && magic != b"070702" {
            if files.is_empty() && entries == 0 {
                return Err(CpioError::Magic { at });
            }
            // Something else after a complete archive (e.g. a compressed one): not ours.
            break;
        }
        entries += 1;
        if entries > MAX_CPIO_ENTRIES {
            return Err(CpioError::TooManyEntries);
        }
        if b.len() - at < HEADER {
            return Err(CpioError::Truncated { at });
        }
        let mode = hex_field(b, at, 1)?;
        let size = hex_field(b, at, 6)?;
        let namesize = hex_field(b, at, 11)?;
        if namesize == 0 || namesize > MAX_CPIO_NAME {
            return Err(CpioError::Name { at, len: namesize });
        }
        let name_start = at + HEADER;
        let name_end = name_start
            .checked_add(namesize)
            .filter(|&e| e <= b.len())
            .ok_or(CpioError::Truncated { at })?;
        let name_bytes = &b[name_start..name_end - 1];
        let name = String::from_utf8_lossy(name_bytes).into_owned();
        let data_start = align4(name_end).ok_or(CpioError::Truncated { at })?;
        let data_end = data_start
            .checked_add(size)
            .filter(|&e| e <= b.len())
            .ok_or(CpioError::Truncated { at })?;
        if name == "TRAILER!!!" {
            at = align4(data_end).ok_or(CpioError::Truncated { at })?;
            continue;
        }
        if mode & 0o170000 == 0o100000 && size > 0 {
            files.push(CpioFile {
                name,
                data: data_start..data_end,
            });
        }
        at = align4(data_end).ok_or(CpioError::Truncated { at })?;
    }
    Ok(files)
}

/// The initrd template: every regular file of the archive from a page boundary, its last page
/// filled with zeros (as a guest page cache holds the file).
pub fn initrd_template(initrd: &[u8]) -> Result<Vec<u8>, CpioError> {
    let files = parse_newc(initrd)?;
    let mut out = Vec::new();
    write_initrd_template(initrd, &files, &mut out).map_err(|_| CpioError::Truncated { at: 0 })?;
    Ok(out)
}

/// Writes the initrd template of `files` (from [`parse_newc`] of `initrd`) to `out`.
pub fn write_initrd_template(
    initrd: &[u8],
    files: &[CpioFile],
    out: &mut impl Write,
) -> std::io::Result<()> {
    const ZEROS: [u8; PAGE] = [0; PAGE];
    for f in files {
        let data = initrd
            .get(f.data.clone())
            .ok_or(std::io::ErrorKind::InvalidData)?;
        out.write_all(data)?;
        let pad = data.len().next_multiple_of(PAGE) - data.len();
        out.write_all(&ZEROS[..pad])?;
    }
    Ok(())
}

/// The size of the initrd template of `files` (each file's bytes rounded up to whole pages).
pub fn initrd_template_len(files: &[CpioFile]) -> u64 {
    files
        .iter()
        .map(|f| (f.data.len() as u64).next_multiple_of(PAGE as u64))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_sharing::test_fixtures::{newc, sample_files};

    #[test]
    fn newc_regular_files_only_and_concatenated_archives() {
        let (a, b) = sample_files();
        let mut cpio = newc(&[
            ("dev", 0o040755, b""),
            ("init", 0o100755, &a),
            ("dev/console", 0o020600, b""),
            ("empty", 0o100644, b""),
            ("TRAILER!!!", 0, b""),
        ]);
        cpio.resize(cpio.len() + 512, 0);
        cpio.extend(newc(&[("bin/b", 0o100755, &b), ("TRAILER!!!", 0, b"")]));
        let files = parse_newc(&cpio).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].name, "init");
        assert_eq!(&cpio[files[0].data.clone()], &a[..]);
        assert_eq!(files[1].name, "bin/b");
        assert_eq!(&cpio[files[1].data.clone()], &b[..]);
        // A compressed archive after ours is left alone.
        let mut more = cpio.clone();
        more.extend_from_slice(&[0x1f, 0x8b, 8, 0, 1, 2, 3]);
        assert_eq!(parse_newc(&more).unwrap(), files);
    }

    #[test]
    fn newc_bounds_are_checked() {
        let (a, _) = sample_files();
        let cpio = newc(&[("init", 0o100755, &a), ("TRAILER!!!", 0, b"")]);
        // Every cut of the archive is an error or a prefix of the files, never a panic.
        for cut in 0..cpio.len() {
            if let Ok(files) = parse_newc(&cpio[..cut]) {
                for f in files {
                    assert!(f.data.end <= cut);
                }
            }
        }
        assert_eq!(
            parse_newc(&cpio[..cpio.len() / 2]),
            Err(CpioError::Truncated { at: 0 })
        );
        // A size field claiming 4 GiB.
        let mut big = cpio.clone();
        big[6 + 6 * 8..6 + 7 * 8].copy_from_slice(b"ffffffff");
        assert!(matches!(parse_newc(&big), Err(CpioError::Truncated { .. })));
        let mut bad = cpio.clone();
        bad[6 + 6 * 8] = b'x';
        assert!(matches!(parse_newc(&bad), Err(CpioError::Field { .. })));
        let mut noname = cpio.clone();
        noname[6 + 11 * 8..6 + 12 * 8].copy_from_slice(b"00000000");
        assert!(matches!(parse_newc(&noname), Err(CpioError::Name { .. })));
        assert!(matches!(
            parse_newc(&[0x1f, 0x8b, 8, 0, 0, 0]),
            Err(CpioError::Magic { at: 0 })
        ));
        assert_eq!(parse_newc(&[]), Ok(vec![]));
    }

    #[test]
    fn the_initrd_template_lays_each_file_out_from_a_page() {
        let (a, b) = sample_files();
        let cpio = newc(&[
            ("init", 0o100755, &a),
            ("b", 0o100644, &b),
            ("TRAILER!!!", 0, b""),
        ]);
        let t = initrd_template(&cpio).unwrap();
        assert_eq!(t.len(), 3 * PAGE + 2 * PAGE);
        assert_eq!(&t[..a.len()], &a[..]);
        assert!(t[a.len()..3 * PAGE].iter().all(|&x| x == 0));
        assert_eq!(&t[3 * PAGE..3 * PAGE + b.len()], &b[..]);
    }

    /// Properties of the initrd's cpio parsing and its template over any archive.
    mod properties {
        use super::*;
        use proptest::prelude::*;

        const REGULAR: u32 = 0o100644;

        /// An entry: a name, a regular file, folder or symlink, and its bytes.
        fn entry() -> impl Strategy<Value = (String, u32, Vec<u8>)> {
            (
                "[a-z/]{1,24}",
                prop_oneof![Just(REGULAR), Just(0o040755), Just(0o120777)],
                prop::collection::vec(any::<u8>(), 0..6000),
            )
        }

        fn archive(entries: &[(String, u32, Vec<u8>)]) -> Vec<u8> {
            let e: Vec<(&str, u32, &[u8])> = entries
                .iter()
                .map(|(n, m, d)| (n.as_str(), *m, d.as_slice()))
                .collect();
            newc(&e)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            /// One or two archives (zero padding between them): the regular files with bytes
            /// are found, in order, by name and bytes; their ranges lie inside the archive,
            /// disjoint and increasing.
            #[test]
            fn newc_finds_each_regular_file(
                first in prop::collection::vec(entry(), 0..8),
                second in prop::collection::vec(entry(), 0..4),
                // The kernel takes a header only at a multiple of 4 bytes from the start.
                padding in (0usize..150).prop_map(|k| k * 4),
            ) {
                let mut cpio = archive(&first);
                if !second.is_empty() {
                    cpio.resize(cpio.len() + padding, 0);
                    cpio.extend_from_slice(&archive(&second));
                }
                let files = parse_newc(&cpio);
                let expected: Vec<&(String, u32, Vec<u8>)> = first
                    .iter()
                    .chain(&second)
                    .filter(|(_, m, d)| *m == REGULAR && !d.is_empty())
                    .collect();
                let files = match files {
                    Ok(f) => f,
                    // An empty archive is no archive.
                    Err(e) => {
                        prop_assert!(first.is_empty() && second.is_empty(), "{e}");
                        return Ok(());
                    }
                };
                prop_assert_eq!(files.len(), expected.len());
                let mut end = 0;
                for (f, (name, _, data)) in files.iter().zip(expected) {
                    prop_assert_eq!(&f.name, name);
                    prop_assert!(f.data.start >= end && f.data.end <= cpio.len());
                    prop_assert_eq!(&cpio[f.data.clone()], data.as_slice());
                    end = f.data.end;
                }
            }

            /// The template holds each file from a page boundary, zero-filled to the next, and
            /// is as long as `initrd_template_len` says.
            #[test]
            fn template_pages_hold_each_file(entries in prop::collection::vec(entry(), 1..8)) {
                let cpio = archive(&entries);
                let files = parse_newc(&cpio).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let template = initrd_template(&cpio)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(template.len() as u64, initrd_template_len(&files));
                prop_assert_eq!(template.len() % PAGE, 0);
                let mut at = 0;
                for f in &files {
                    let n = f.data.len();
                    prop_assert_eq!(&template[at..at + n], &cpio[f.data.clone()]);
                    let next = at + n.next_multiple_of(PAGE);
                    prop_assert!(template[at + n..next].iter().all(|&b| b == 0));
                    at = next;
                }
                prop_assert_eq!(at, template.len());
            }

            /// Any bytes: an error or files whose ranges lie inside, disjoint and increasing.
            #[test]
            fn newc_ranges_stay_inside_any_input(
                entries in prop::collection::vec(entry(), 1..4),
                flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..16),
                cut in any::<prop::sample::Index>(),
            ) {
                let mut cpio = archive(&entries);
                for (i, b) in flips {
                    let i = i.index(cpio.len());
                    cpio[i] = b;
                }
                cpio.truncate(cut.index(cpio.len() + 1));
                if let Ok(files) = parse_newc(&cpio) {
                    let mut end = 0;
                    for f in files {
                        prop_assert!(f.data.start >= end && f.data.start < f.data.end);
                        prop_assert!(f.data.end <= cpio.len());
                        end = f.data.end;
                    }
                }
            }
        }
    }
}
