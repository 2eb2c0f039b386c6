//! newc ("070701") cpio archives, as the Linux kernel unpacks an initramfs: the test initrds of
//! the VMM, shim and pod tests, the page sharing unit tests' archives and the fuzz seeds.
//!
//! Each entry is a 110-byte ASCII header (the magic and 13 fields of 8 hex digits), the name
//! with its NUL, padding to 4 bytes, the data, padding to 4 bytes; an archive ends with the
//! entry `TRAILER!!!`.

/// The name of the entry that ends an archive.
pub const TRAILER: &str = "TRAILER!!!";

/// Appends one entry to `out`: inode `ino`, `mode` (file type and permissions, e.g. `0o100644`
/// for a regular file, `0o040755` a directory, `0o120777` a symbolic link whose target is
/// `data`), owner 0:0, one link, time 0, device 0:0.
///
/// # Panics
/// If `data` or `name` is 4 GiB or longer (a newc field holds 32 bits).
pub fn newc_entry(out: &mut Vec<u8>, ino: u32, mode: u32, name: &str, data: &[u8]) {
    let size = u32::try_from(data.len()).unwrap_or_else(|_| panic!("{name}: too large for newc"));
    let namesize =
        u32::try_from(name.len() + 1).unwrap_or_else(|_| panic!("{name}: name too long"));
    // ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor,
    // namesize, check
    let fields = [ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, namesize, 0];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    out.resize(out.len().next_multiple_of(4), 0);
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// Appends the entry that ends an archive.
pub fn newc_trailer(out: &mut Vec<u8>) {
    newc_entry(out, 0, 0, TRAILER, &[]);
}

/// A whole archive of `entries` (name, mode, data), inodes numbered from 1, with its trailer.
pub fn newc_archive(entries: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (ino, (name, mode, data)) in (1u32..).zip(entries) {
        newc_entry(&mut out, ino, *mode, name, data);
    }
    newc_trailer(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_its_header_name_and_data_each_padded_to_four_bytes() {
        let mut out = Vec::new();
        newc_entry(&mut out, 7, 0o100644, "ab", b"hello");
        assert_eq!(&out[..6], b"070701");
        let field = |i: usize| {
            let at = 6 + 8 * i;
            u32::from_str_radix(std::str::from_utf8(&out[at..at + 8]).unwrap(), 16).unwrap()
        };
        assert_eq!(field(0), 7);
        assert_eq!(field(1), 0o100644);
        assert_eq!(field(6), 5);
        assert_eq!(field(11), 3);
        // Header 110 bytes, "ab\0" to 113, padded to 116; data to 121, padded to 124.
        assert_eq!(&out[110..113], b"ab\0");
        assert_eq!(&out[116..121], b"hello");
        assert_eq!(out.len(), 124);
    }

    #[test]
    fn an_archive_numbers_its_inodes_and_ends_with_the_trailer() {
        let archive = newc_archive(&[("a", 0o100644, b"1"), ("b", 0o040755, b"")]);
        let text = String::from_utf8_lossy(&archive);
        assert_eq!(text.matches("070701").count(), 3);
        assert!(text.contains(TRAILER));
        assert_eq!(&archive[6..14], b"00000001");
        assert_eq!(archive.len() % 4, 0);
    }
}
