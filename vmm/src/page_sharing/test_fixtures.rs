//! What the unit tests of the folder share: newc archives built from entries, two sample
//! files, and a fresh temporary directory per test.

use std::path::PathBuf;

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

/// A path in the temporary directory for test `tag` of this process and thread, removed if it
/// was there.
pub(super) fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "page-sharing-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}
