//! What templates are called: a template's name is a hash of what decides its bytes (the
//! initrd file's sum; the kernel file's sum with the command line words, vCPU count and CPUID
//! that decide how the guest patches its text), so VMs that would hold the same pages find
//! the same file. File sums are remembered in the captures' directory by the file's identity
//! ([`cached_file_sha256`]), so that every VM does not read the whole kernel again.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;

use sha2::{Digest, Sha256};

use super::error::{io, PageSharingError};
use super::store::TemplateDir;

/// A hex SHA-256 of the parts, each prefixed by its length (so parts cannot run into each other).
pub(super) fn digest(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The words of the command line that decide how the kernel patches itself: all but the ones of
/// our agent's `microvm.` namespace (per-pod values such as the hostname, which the kernel hands
/// on untouched) and the VMM's `virtio_mmio.device=` words (where each virtio device sits: the
/// VM the template is captured from has the devices of no pod, only vsock and the balloon).
fn kernel_cmdline_words(cmdline: &str) -> String {
    cmdline
        .split_whitespace()
        .filter(|w| !w.starts_with("microvm.") && !w.starts_with("virtio_mmio.device="))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The name of the kernel text template of a kernel file (its bytes), command line, vCPU
/// count and CPUID (the bytes of the entries vCPU 0 got).
pub fn kernel_template_name(kernel_sha256: &str, cmdline: &str, vcpus: u8, cpuid: &[u8]) -> String {
    let words = kernel_cmdline_words(cmdline);
    let key = digest(&[
        b"kernel-text-v1",
        kernel_sha256.as_bytes(),
        words.as_bytes(),
        &[vcpus],
        cpuid,
    ]);
    format!("kernel-text-{key}")
}

/// The name of the initrd template of an initrd (its bytes).
pub fn initrd_template_name(initrd_sha256: &str) -> String {
    format!(
        "initrd-files-{}",
        digest(&[b"initrd-files-v1", initrd_sha256.as_bytes()])
    )
}

/// SHA-256 of a whole file, read from its start.
pub fn file_sha256(file: &mut File) -> Result<String, PageSharingError> {
    file.seek(SeekFrom::Start(0)).map_err(io("seek"))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(io("read"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The size of a remembered file sum (64 hex digits).
const SUM_LEN: u64 = 64;

/// [`file_sha256`], remembered in `dir` by the file's identity (device, inode, size, change
/// and modification times), so that every VM does not read the whole kernel again. A file
/// replaced by renaming has a new inode, one rewritten in place new times. (Only template
/// names come from it: a stale sum means a template miss, never a wrong page.)
pub fn cached_file_sha256(dir: &TemplateDir, file: &mut File) -> Result<String, PageSharingError> {
    let m = file.metadata().map_err(io("stat"))?;
    let name = format!(
        "sum-{:x}-{:x}-{}-{}.{}-{}.{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    );
    if let Some(mut f) = dir.get(&name, Some(SUM_LEN))? {
        let mut sum = String::new();
        if f.read_to_string(&mut sum).is_ok()
            && sum.len() == 64
            && sum.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Ok(sum);
        }
    }
    let sum = file_sha256(file)?;
    dir.put(&name, sum.as_bytes())?;
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_sharing::test_fixtures::temp_dir;

    #[test]
    fn template_keys_change_with_what_patches_the_kernel_only() {
        let k = |sum: &str, cmd: &str, vcpus: u8, cpuid: &[u8]| {
            kernel_template_name(sum, cmd, vcpus, cpuid)
        };
        let base = k("aa", "console=ttyS0 microvm.hostname=a", 1, &[1, 2]);
        assert_eq!(
            base,
            k("aa", "console=ttyS0  microvm.hostname=b", 1, &[1, 2])
        );
        // Where the VMM put its virtio devices does not count either.
        assert_eq!(
            base,
            k(
                "aa",
                "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6",
                1,
                &[1, 2]
            )
        );
        assert_ne!(base, k("ab", "console=ttyS0", 1, &[1, 2]));
        assert_ne!(base, k("aa", "console=ttyS0 mitigations=off", 1, &[1, 2]));
        assert_ne!(base, k("aa", "console=ttyS0", 2, &[1, 2]));
        assert_ne!(base, k("aa", "console=ttyS0", 1, &[1, 3]));
        assert!(base.starts_with("kernel-text-") && base.len() == 12 + 64);
        assert_ne!(initrd_template_name("aa"), initrd_template_name("ab"));
    }

    #[test]
    fn sums_are_remembered_by_the_files_identity() {
        let d_tmp = temp_dir("sums");
        let d = d_tmp.path().to_path_buf();
        let dir = TemplateDir::open(&d.join("t")).unwrap();
        dir.put("x", b"first").unwrap();
        let mut data = dir.put("data", b"abc").unwrap();
        let sum = cached_file_sha256(&dir, &mut data).unwrap();
        assert_eq!(sum, file_sha256(&mut data).unwrap());
        assert_eq!(std::fs::read_dir(d.join("t")).unwrap().count(), 3);
        assert_eq!(cached_file_sha256(&dir, &mut data).unwrap(), sum);
    }
}
