//! What the unit tests of the folder share: newc archives built from entries, two sample
//! files, and a fresh temporary directory per test.

/// The entries as given (a trailer only if listed), inodes numbered from 1.
pub(super) fn newc(entries: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut cpio = Vec::new();
    for (ino, (name, mode, data)) in (1u32..).zip(entries) {
        testkit::cpio::newc_entry(&mut cpio, ino, *mode, name, data);
    }
    cpio
}

/// Two files of recognisable bytes, none zero: 10 000 and 5000 bytes.
pub(super) fn sample_files() -> (Vec<u8>, Vec<u8>) {
    let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
    let b: Vec<u8> = (0..5000u32).map(|i| (i % 13) as u8 + 7).collect();
    (a, b)
}

/// A fresh temporary folder (mode 0700) for test `tag`, removed when the value is dropped.
pub(super) fn temp_dir(tag: &str) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&format!("page-sharing-{tag}-"))
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .expect("a temporary folder")
}
