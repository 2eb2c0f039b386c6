//! Public page templates and the sharing pass (docs/page-sharing.md).
//!
//! Some guest pages hold the same bytes in every pod by construction: the kernel's text as the
//! guest patched it at boot, the files of the initrd once the guest unpacked them into its page
//! cache, and pages the guest zeroed. Each VM holds a private copy of them on the host. The
//! sharing pass replaces such copies:
//! - an all-zero private page is dropped (`MADV_DONTNEED`; in a range mapped from a boot file,
//!   anonymous zero memory is mapped over it instead, since dropping would show the file again);
//! - a private page equal, byte for byte, to a page of a *template file* gets that file page
//!   mapped over it (`MAP_PRIVATE | MAP_FIXED`, read-write): the host's page cache then holds
//!   one copy for every VM, and a guest write copies it again (copy-on-write).
//!
//! Only public content becomes a template, never what another tenant's guest holds: the
//! initrd's regular files (each laid out from a page boundary, as a page cache holds it),
//! computed from the file, and the kernel text captured from a VM that has seen no pod input
//! (started with [`PageSharingConfig::capture_kernel_text`]; a pod's VM never captures).
//! Learning that a page was shared tells a guest nothing about another pod. Still, a shared
//! physical page lets guests time each other's use of it (Flush+Reload), so templates are kept
//! per trust domain ([`PageSharingConfig::domain`]): VMs of different domains map different
//! files, hence share no page.
//!
//! Correctness never depends on a template: a page is replaced only when it is equal to the
//! template page, while every vCPU and the device thread are paused, so a wrong or hostile
//! template means no sharing, never different guest memory.
//!
//! Template files live in directories only root can enter (0700, owned by the VMM's user),
//! reached from a checked directory descriptor without following links, created 0444 through a
//! temporary file and a link, never changed in place (a private mapping of a file still sees
//! later writes to the pages it has not copied), and checked each time they are opened: a
//! regular file of ours, writable by nobody else, of the size expected ([`TemplateDir::get`]).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use sha2::{Digest, Sha256};
use vm_memory::{GuestAddress, GuestMemory as _, GuestMemoryRegion};

use crate::memory::{mark_guest_ram, GuestMemory};

/// Where template files go unless configured otherwise (beside the shim's pod state root
/// /run/microvm, whose directories are pods').
pub const DEFAULT_TEMPLATE_DIR: &str = "/run/microvm-page-templates";
/// The page size the pass works with (x86-64 base pages).
pub const PAGE: usize = 4096;
/// At most this many new mappings per pass: each costs the process up to two VMAs (one mapped
/// in the middle of another splits it; the kernel's limit is vm.max_map_count, 65530 by default).
const MAX_MAPPINGS_PER_PASS: usize = 16_384;
/// Passes stop mapping while the process has this many VMAs (leaving room under the default
/// vm.max_map_count for threads, allocations and later passes).
const MAX_PROCESS_VMAS: usize = 40_000;
/// Names in an initrd longer than this are refused (PATH_MAX).
const MAX_CPIO_NAME: usize = 4096;
/// An initrd with more entries than this is not made a template.
const MAX_CPIO_ENTRIES: usize = 1 << 20;

/// The trust domain of `page_sharing = "node"`: every VM of the node maps the same templates.
pub const NODE_DOMAIN: &str = "node";
/// The subdirectory of the template root holding kernel text captured from VMs that saw no pod
/// input, and the remembered file sums. No VM maps a file of it: each domain maps its own copy.
pub const CAPTURED_DIR: &str = "captured";

/// Page sharing of a VM (on when [`crate::VmConfig::page_sharing`] is set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageSharingConfig {
    /// The root of the template directories (created 0700 if missing; refused unless owned by
    /// this process's user with no access for anybody else).
    pub template_dir: PathBuf,
    /// The VM's trust domain: the subdirectory of `template_dir` whose template files it maps.
    /// VMs of different domains never map the same file, so they share no template page.
    /// [`NODE_DOMAIN`], or [`namespace_domain`] of a Kubernetes namespace.
    pub domain: String,
    /// Whether this VM has seen no pod input (a throwaway boot, a test guest), so that a pass may
    /// capture its kernel text as the template every domain copies. A pod's VM never captures:
    /// a missing kernel text template means no kernel text sharing for it.
    pub capture_kernel_text: bool,
}

impl Default for PageSharingConfig {
    fn default() -> Self {
        Self {
            template_dir: PathBuf::from(DEFAULT_TEMPLATE_DIR),
            domain: NODE_DOMAIN.to_string(),
            capture_kernel_text: false,
        }
    }
}

/// The domain (template subdirectory) of the pods of Kubernetes namespace `namespace`: a hash
/// of the name, since the name is pod input (it never becomes a path itself).
pub fn namespace_domain(namespace: &str) -> String {
    let key = digest(&[b"microvm-page-sharing-namespace-v1", namespace.as_bytes()]);
    format!("ns-{}", &key[..32])
}

/// Whether `domain` can name a template subdirectory: one path component of ASCII letters,
/// digits, `-` and `_`, not the captures' directory.
pub fn valid_domain(domain: &str) -> bool {
    !domain.is_empty()
        && domain.len() <= 64
        && domain
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && domain != CAPTURED_DIR
}

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

/// Errors of page sharing.
#[derive(Debug, thiserror::Error)]
pub enum PageSharingError {
    #[error("template directory {}: {reason}", dir.display())]
    TemplateDir { dir: PathBuf, reason: String },
    #[error("template {name} in {}: {reason}; refused", dir.display())]
    Template {
        dir: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{domain:?} cannot name a page sharing domain")]
    Domain { domain: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not for a VM with VFIO devices: their DMA goes to pinned guest pages")]
    Vfio,
    #[error("page sharing is off for this VM")]
    Off,
    #[error("this VM may not capture a kernel text template: it is a pod's")]
    NoCapture,
    #[error(
        "restoring guest memory at {addr:#x} after a failed mapping failed too: {source}; \
         the VM cannot continue"
    )]
    Restore {
        addr: u64,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PageSharingError {
    let what = what.into();
    move |source| PageSharingError::Io { what, source }
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

/// A hex SHA-256 of the parts, each prefixed by its length (so parts cannot run into each other).
fn digest(parts: &[&[u8]]) -> String {
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

/// A template directory, held open: every file in it is reached from this descriptor, never
/// by a path again, and never through a symbolic link.
#[derive(Debug)]
pub struct TemplateDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// This process's effective user (root for the shim).
fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Why a directory's status makes it unfit to hold templates (`None`: fit): a directory owned
/// by this process's user that nobody else may enter, list or write.
fn unfit_dir(st: &rustix::fs::Stat) -> Option<String> {
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::Directory {
        return Some(format!("not a directory ({kind:?})"));
    }
    let me = euid();
    if st.st_uid != me {
        return Some(format!("owned by uid {}, not {me}", st.st_uid));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o077 != 0 {
        return Some(format!(
            "mode {mode:o}: others may enter or write it (want 0700)"
        ));
    }
    None
}

/// Why a template file's status makes it unfit to be mapped (`None`: fit): a regular file owned
/// by this process's user, writable by nobody else, of the size expected (when known).
fn unfit_file(st: &rustix::fs::Stat, expected: Option<u64>) -> Option<String> {
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::RegularFile {
        return Some(format!("not a regular file ({kind:?})"));
    }
    let me = euid();
    if st.st_uid != me {
        return Some(format!("owned by uid {}, not {me}", st.st_uid));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Some(format!(
            "mode {mode:o}: group or others may write it (templates are 0444)"
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    match expected {
        Some(want) if size != want => Some(format!("{size} bytes, expected {want}")),
        _ => None,
    }
}

impl TemplateDir {
    /// Opens `path`, creating it (0700) if missing. Refused unless it is a directory (not a
    /// symbolic link) owned by this process's user that nobody else may enter or write.
    pub fn open(path: &Path) -> Result<Self, PageSharingError> {
        let bad = |reason: String| PageSharingError::TemplateDir {
            dir: path.to_path_buf(),
            reason,
        };
        if std::fs::symlink_metadata(path).is_err() {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| bad(e.to_string()))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(bad(e.to_string())),
            }
        }
        // openat, not open: rustix's `open` is the `open` system call on x86_64, which the
        // page sharing thread's seccomp filter does not allow.
        let fd = rustix::fs::openat(rustix::fs::CWD, path, Self::dir_flags(), Mode::empty())
            .map_err(|e| bad(Self::open_reason(e)))?;
        Self::checked(path.to_path_buf(), fd)
    }

    /// The subdirectory `name` (one component), created 0700 if missing, with the checks of
    /// [`TemplateDir::open`]. Reached from this directory's descriptor without following links.
    pub fn subdir(&self, name: &str) -> Result<Self, PageSharingError> {
        let path = self.path.join(name);
        let bad = |reason: String| PageSharingError::TemplateDir {
            dir: path.clone(),
            reason,
        };
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(bad("not one path component".into()));
        }
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(bad(std::io::Error::from(e).to_string())),
        }
        let fd = rustix::fs::openat(&self.fd, name, Self::dir_flags(), Mode::empty())
            .map_err(|e| bad(Self::open_reason(e)))?;
        Self::checked(path.clone(), fd)
    }

    fn dir_flags() -> OFlags {
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
    }

    fn open_reason(e: rustix::io::Errno) -> String {
        match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                "a symbolic link or not a directory (links are never followed)".into()
            }
            e => std::io::Error::from(e).to_string(),
        }
    }

    fn checked(path: PathBuf, fd: OwnedFd) -> Result<Self, PageSharingError> {
        let st = rustix::fs::fstat(&fd).map_err(|e| PageSharingError::TemplateDir {
            dir: path.clone(),
            reason: std::io::Error::from(e).to_string(),
        })?;
        if let Some(reason) = unfit_dir(&st) {
            return Err(PageSharingError::TemplateDir { dir: path, reason });
        }
        Ok(Self { path, fd })
    }

    /// The directory's path (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The template `name`, if it exists, checked before it is used: opened without following
    /// a symbolic link, a regular file owned by this process's user that nobody else may write,
    /// of `expected` bytes (when given). A file that fails a check is an error naming why,
    /// never a template.
    pub fn get(&self, name: &str, expected: Option<u64>) -> Result<Option<File>, PageSharingError> {
        let refuse = |reason: String| PageSharingError::Template {
            dir: self.path.clone(),
            name: name.to_string(),
            reason,
        };
        // Non-blocking: a FIFO planted under the name must not hang the open (it is refused
        // below as not a regular file).
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(rustix::io::Errno::LOOP) => {
                return Err(refuse(
                    "a symbolic link (template files are never reached through one)".into(),
                ))
            }
            Err(e) => return Err(refuse(std::io::Error::from(e).to_string())),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| refuse(std::io::Error::from(e).to_string()))?;
        if let Some(reason) = unfit_file(&st, expected) {
            return Err(refuse(reason));
        }
        Ok(Some(File::from(fd)))
    }

    /// Creates the template `name` holding `bytes` (0444, through a temporary file linked into
    /// place), unless it exists already; returns the file now under that name, checked.
    pub fn put(&self, name: &str, bytes: &[u8]) -> Result<File, PageSharingError> {
        self.put_with(name, Some(bytes.len() as u64), |f| f.write_all(bytes))
    }

    /// [`TemplateDir::put`] with the content written by `write` (streamed: no copy of a large
    /// template on the heap, where the allocator would keep it after it is freed), of
    /// `expected` bytes when known.
    pub fn put_with(
        &self,
        name: &str,
        expected: Option<u64>,
        write: impl FnOnce(&mut File) -> std::io::Result<()>,
    ) -> Result<File, PageSharingError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let temp = format!(".{name}.{}.{nanos}.tmp", std::process::id());
        let what = format!("create {}", self.path.join(&temp).display());
        let fd = rustix::fs::openat(
            &self.fd,
            temp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o444),
        )
        .map_err(|e| io(what)(e.into()))?;
        let mut f = File::from(fd);
        let written = write(&mut f).and_then(|()| f.sync_data());
        drop(f);
        let linked = written.and_then(|()| {
            match rustix::fs::linkat(
                &self.fd,
                temp.as_str(),
                &self.fd,
                name,
                rustix::fs::AtFlags::empty(),
            ) {
                // Another VM put the same template first: keep that one.
                Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
                Err(e) => Err(e.into()),
            }
        });
        let _ = rustix::fs::unlinkat(&self.fd, temp.as_str(), rustix::fs::AtFlags::empty());
        linked.map_err(io(format!("write template {name}")))?;
        self.get(name, expected)?
            .ok_or_else(|| io(format!("template {name}"))(std::io::ErrorKind::NotFound.into()))
    }
}

/// A template file mapped read-only into this process, to compare guest pages with.
pub struct TemplateView {
    name: String,
    file: File,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the view is a read-only mapping of a file nobody changes (templates are never
// written in place), owned by the view; reading it from any thread is sound.
unsafe impl Send for TemplateView {}

impl TemplateView {
    /// Maps `file` (whole pages only: a partial last page is left out).
    pub fn new(name: &str, file: File) -> Result<Self, PageSharingError> {
        Self::map(name, file, true)
    }

    /// Maps `file` whole, to read it ([`TemplateView::bytes`]).
    fn map(name: &str, file: File, whole_pages: bool) -> Result<Self, PageSharingError> {
        let size = file.metadata().map_err(io(format!("stat {name}")))?.len();
        let mut len = usize::try_from(size)
            .map_err(|_| io(name.to_string())(std::io::ErrorKind::InvalidData.into()))?;
        if whole_pages {
            len &= !(PAGE - 1);
        }
        let ptr = if len == 0 {
            std::ptr::null()
        } else {
            // SAFETY: a new shared read-only mapping of `len` bytes of an open file, at an
            // address the kernel picks; nothing else is affected.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io(format!("map template {name}"))(
                    std::io::Error::last_os_error(),
                ));
            }
            p as *const u8
        };
        Ok(Self {
            name: name.to_string(),
            file,
            ptr,
            len,
        })
    }

    /// The number of whole pages.
    pub fn pages(&self) -> usize {
        self.len / PAGE
    }

    /// Page `i`'s bytes.
    pub fn page(&self, i: usize) -> &[u8] {
        assert!(i < self.pages());
        // SAFETY: `i < pages()`, so the page lies inside the mapping, which lives as long as
        // `self`; the file is never written (see the module doc), so the bytes do not change
        // under the shared reference.
        unsafe { std::slice::from_raw_parts(self.ptr.add(i * PAGE), PAGE) }
    }

    /// All the mapped bytes.
    fn bytes(&self) -> &[u8] {
        if self.ptr.is_null() {
            return &[];
        }
        // SAFETY: the whole mapping, which lives as long as `self`; the file is not written
        // while mapped (templates never; the initrd is replaced by renaming, docs/density.md).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The template's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TemplateView {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: the mapping made in `new`, unmapped once.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

/// A hash of a page's bytes, to find candidate template pages (equality is then checked).
pub fn page_hash(p: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in p.chunks_exact(8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    h
}

/// Whether a page is all zero.
pub fn is_zero(p: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets the aligned middle.
        unsafe { p.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Where each distinct template page is: hash -> (template, page).
#[derive(Default)]
pub struct TemplateIndex {
    views: Vec<TemplateView>,
    by_hash: HashMap<u64, (usize, usize)>,
}

impl TemplateIndex {
    /// Adds a template's non-zero pages (the first of equal pages wins).
    pub fn add(&mut self, view: TemplateView) {
        let t = self.views.len();
        for i in 0..view.pages() {
            let p = view.page(i);
            if is_zero(p) {
                continue;
            }
            self.by_hash.entry(page_hash(p)).or_insert((t, i));
        }
        self.views.push(view);
    }

    /// The template page equal to `p`, if any.
    pub fn find(&self, p: &[u8]) -> Option<(usize, usize)> {
        let &(t, i) = self.by_hash.get(&page_hash(p))?;
        (self.views[t].page(i) == p).then_some((t, i))
    }

    /// The templates, in the order added.
    pub fn views(&self) -> &[TemplateView] {
        &self.views
    }
}

/// What a sharing pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharingReport {
    /// Private resident guest pages looked at.
    pub scanned: u64,
    /// All-zero pages given back.
    pub zero_dropped: u64,
    /// Pages replaced by a template page, per template (in the order of `templates`).
    pub shared: Vec<u64>,
    /// The templates used, by name.
    pub templates: Vec<String>,
    /// Non-zero pages no template had.
    pub misses: u64,
    /// Pages a template page matched but that were left alone (mapping limit reached).
    pub skipped: u64,
    /// Whether this pass captured the kernel text template.
    pub captured_kernel_text: bool,
    /// Whether the kernel text template was missing (none captured yet, and this VM may not
    /// capture one): the pass shared no kernel text.
    pub kernel_text_missing: bool,
    /// How long the VM was paused.
    pub paused_for: Duration,
    /// How long the whole pass took (with the template preparation).
    pub took: Duration,
}

impl SharingReport {
    /// Pages shared in all.
    pub fn shared_total(&self) -> u64 {
        self.shared.iter().sum()
    }
}

impl std::fmt::Display for SharingReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} private pages scanned: {} zero pages dropped, {} shared (",
            self.scanned,
            self.zero_dropped,
            self.shared_total()
        )?;
        for (i, (n, t)) in self.shared.iter().zip(&self.templates).enumerate() {
            let kind = t.split('-').take(2).collect::<Vec<_>>().join("-");
            write!(f, "{}{kind} {n}", if i > 0 { ", " } else { "" })?;
        }
        write!(
            f,
            "), {} without a template, {} left (mapping limit); paused {:?}, took {:?}{}",
            self.misses,
            self.skipped,
            self.paused_for,
            self.took,
            if self.captured_kernel_text {
                "; captured the kernel text template"
            } else if self.kernel_text_missing {
                "; no kernel text template (none captured yet)"
            } else {
                ""
            }
        )
    }
}

/// One mapping in the process (from /proc/self/maps): its range and whether it has a file.
#[derive(Debug, Clone, Copy)]
struct Vma {
    start: u64,
    end: u64,
    file: bool,
}

fn read_maps() -> Result<Vec<Vma>, PageSharingError> {
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

fn in_file_mapping(vmas: &[Vma], addr: u64) -> bool {
    let i = vmas.partition_point(|m| m.start <= addr);
    i > 0 && vmas[i - 1].end > addr && vmas[i - 1].file
}

/// /proc/self/pagemap bits.
const PM_PRESENT: u64 = 1 << 63;
const PM_FILE_OR_SHARED: u64 = 1 << 61;
const PM_EXCLUSIVE: u64 = 1 << 56;

/// Whether a pagemap entry is a resident private anonymous page that only this mapping holds
/// (not a file page, not the shared zero page).
fn is_private_resident(entry: u64) -> bool {
    entry & PM_PRESENT != 0 && entry & PM_FILE_OR_SHARED == 0 && entry & PM_EXCLUSIVE != 0
}

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
                    view.file.as_raw_fd(),
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

/// What a VM keeps to run sharing passes (made at start when sharing is on).
pub(crate) struct VmSharing {
    pub(crate) config: PageSharingConfig,
    /// The kernel and initrd files the VM booted from (their inodes: a file renamed over them
    /// later does not change what this VM holds).
    pub(crate) kernel: File,
    pub(crate) initrd: Option<File>,
    /// The guest-physical range of the kernel's first loadable segment (its text), whole pages.
    pub(crate) text: Option<Range<u64>>,
    pub(crate) cmdline: String,
    pub(crate) vcpus: u8,
    /// The CPUID entries vCPU 0 got, as bytes.
    pub(crate) cpuid: Vec<u8>,
    /// The templates, once the first pass found or made them.
    pub(crate) index: Option<TemplateIndex>,
}

/// The directories a VM's pass works in.
pub(crate) struct Dirs {
    /// The VM's domain: the templates it maps.
    domain: TemplateDir,
    /// The captured kernel text templates and the remembered sums (never mapped into a guest).
    captured: TemplateDir,
}

/// Where the kernel text template of a VM stands.
pub(crate) enum KernelText {
    /// The kernel has no text range to share.
    None,
    /// The domain's template (found there, or copied there from the captured one).
    Found { name: String, file: File },
    /// No template captured yet.
    Missing { name: String },
}

impl VmSharing {
    /// Opens (and checks) the template root, the captures' directory and the VM's domain.
    pub(crate) fn dirs(&self) -> Result<Dirs, PageSharingError> {
        if !valid_domain(&self.config.domain) {
            return Err(PageSharingError::Domain {
                domain: self.config.domain.clone(),
            });
        }
        let root = TemplateDir::open(&self.config.template_dir)?;
        Ok(Dirs {
            captured: root.subdir(CAPTURED_DIR)?,
            domain: root.subdir(&self.config.domain)?,
        })
    }

    /// The name of this VM's kernel text template and its size, if the kernel has a text range.
    fn kernel_text_key(&mut self, dirs: &Dirs) -> Result<Option<(String, u64)>, PageSharingError> {
        let Some(text) = self.text.clone() else {
            return Ok(None);
        };
        let sum = cached_file_sha256(&dirs.captured, &mut self.kernel)?;
        let name = kernel_template_name(&sum, &self.cmdline, self.vcpus, &self.cpuid);
        Ok(Some((name, text.end - text.start)))
    }

    /// The domain's kernel text template: found there, or copied there from the captured one
    /// (a copy of its own, so that domains map different files), or missing.
    pub(crate) fn kernel_text(&mut self, dirs: &Dirs) -> Result<KernelText, PageSharingError> {
        let Some((name, len)) = self.kernel_text_key(dirs)? else {
            return Ok(KernelText::None);
        };
        if let Some(file) = dirs.domain.get(&name, Some(len))? {
            return Ok(KernelText::Found { name, file });
        }
        let Some(mut captured) = dirs.captured.get(&name, Some(len))? else {
            return Ok(KernelText::Missing { name });
        };
        let file = dirs.domain.put_with(&name, Some(len), |f| {
            std::io::copy(&mut captured, f).map(drop)
        })?;
        Ok(KernelText::Found { name, file })
    }

    /// The initrd template of the domain (made from the initrd file if missing), if the initrd
    /// gives one.
    fn initrd_template(&mut self, dirs: &Dirs) -> Result<Option<TemplateView>, PageSharingError> {
        let Some(initrd) = self.initrd.as_mut() else {
            return Ok(None);
        };
        let sum = cached_file_sha256(&dirs.captured, initrd)?;
        let name = initrd_template_name(&sum);
        let clone = initrd.try_clone().map_err(io("dup the initrd"))?;
        let map = TemplateView::map("initrd", clone, false)?;
        let files = match parse_newc(map.bytes()) {
            Ok(files) if !files.is_empty() => files,
            Ok(_) => return Ok(None),
            Err(e) => {
                log::info!("page sharing: the initrd gives no template: {e}");
                return Ok(None);
            }
        };
        // The size the template must have: a file of another size is refused, never mapped.
        let len = initrd_template_len(&files);
        let file = match dirs.domain.get(&name, Some(len))? {
            Some(f) => f,
            None => dirs.domain.put_with(&name, Some(len), |f| {
                write_initrd_template(map.bytes(), &files, f)
            })?,
        };
        Ok(Some(TemplateView::new(&name, file)?))
    }

    /// Everything the pass prepares while the VM runs: the directories, the initrd template
    /// (made if missing) and the kernel text template if it exists. Returns the kernel
    /// template's name when this VM is to capture it, and whether it is missing.
    pub(crate) fn prepare(&mut self) -> Result<(Option<String>, bool), PageSharingError> {
        if self.index.is_some() {
            return Ok((None, false));
        }
        let dirs = self.dirs()?;
        let mut index = TemplateIndex::default();
        if let Some(view) = self.initrd_template(&dirs)? {
            index.add(view);
        }
        let mut capture = None;
        let mut missing = false;
        match self.kernel_text(&dirs)? {
            KernelText::None => {}
            KernelText::Found { name, file } => index.add(TemplateView::new(&name, file)?),
            KernelText::Missing { name } => {
                if self.config.capture_kernel_text {
                    capture = Some(name);
                } else {
                    missing = true;
                }
            }
        }
        self.index = Some(index);
        Ok((capture, missing))
    }

    /// Whether the kernel text template of this VM is still to be captured (from a VM that has
    /// seen no pod input): neither the domain nor the captures hold it.
    pub(crate) fn kernel_text_missing(&mut self) -> Result<bool, PageSharingError> {
        let dirs = self.dirs()?;
        let Some((name, len)) = self.kernel_text_key(&dirs)? else {
            return Ok(false);
        };
        Ok(dirs.domain.get(&name, Some(len))?.is_none()
            && dirs.captured.get(&name, Some(len))?.is_none())
    }

    /// The name of the kernel text template to capture from this VM, if it is one that may
    /// capture and none was captured yet.
    pub(crate) fn capture_name(&mut self) -> Result<Option<String>, PageSharingError> {
        if !self.config.capture_kernel_text {
            return Err(PageSharingError::NoCapture);
        }
        let dirs = self.dirs()?;
        let Some((name, len)) = self.kernel_text_key(&dirs)? else {
            return Ok(None);
        };
        Ok(dirs
            .captured
            .get(&name, Some(len))?
            .is_none()
            .then_some(name))
    }

    /// With the VM paused: captures the kernel text into the captures' directory as template
    /// `name` (when it had none) and, if the VM has an index, adds the domain's copy to it.
    pub(crate) fn capture_kernel_text(
        &mut self,
        mem: &GuestMemory,
        name: &str,
    ) -> Result<bool, PageSharingError> {
        if !self.config.capture_kernel_text {
            return Err(PageSharingError::NoCapture);
        }
        let Some(range) = self.text.clone() else {
            return Ok(false);
        };
        let Ok(len) = usize::try_from(range.end - range.start) else {
            return Ok(false);
        };
        if !mem.check_range(GuestAddress(range.start), len) {
            return Ok(false);
        }
        let dirs = self.dirs()?;
        // Straight from guest memory into the file.
        dirs.captured.put_with(name, Some(len as u64), |f| {
            vm_memory::Bytes::write_all_volatile_to(mem, GuestAddress(range.start), f, len)
                .map_err(|e| std::io::Error::other(e.to_string()))
        })?;
        if self.index.is_some() {
            if let KernelText::Found { name, file } = self.kernel_text(&dirs)? {
                let view = TemplateView::new(&name, file)?;
                if let Some(index) = self.index.as_mut() {
                    index.add(view);
                }
            }
        }
        Ok(true)
    }
}

/// The guest-physical pages of a kernel's first loadable segment (its text and read-only
/// data), from the ELF headers of `kernel`: every page holding some of its file bytes.
pub(crate) fn kernel_text_range(kernel: &mut File) -> Option<Range<u64>> {
    let k = crate::boot_files::read_elf(kernel).ok()?;
    let s = k.segments.first()?;
    // Whole guest pages holding the segment's file bytes (it is guest memory that is captured:
    // a partial page's rest is whatever the guest keeps there, and shares only if equal).
    let start = s.paddr & !(PAGE as u64 - 1);
    let end = s
        .paddr
        .checked_add(s.filesz)?
        .checked_add(PAGE as u64 - 1)?
        & !(PAGE as u64 - 1);
    (start < end).then_some(start..end)
}

impl VmSharing {
    /// The part of the pass that runs with the VM paused: the kernel text capture (when
    /// `capture` names a missing template) and the sharing itself.
    pub(crate) fn paused_pass(
        &mut self,
        mem: &GuestMemory,
        capture: Option<&str>,
        missing: bool,
    ) -> Result<SharingReport, PageSharingError> {
        let paused_at = Instant::now();
        let mut report = SharingReport {
            kernel_text_missing: missing,
            ..SharingReport::default()
        };
        if let Some(name) = capture {
            report.captured_kernel_text = self.capture_kernel_text(mem, name)?;
        }
        if let Some(index) = self.index.as_ref() {
            share_paused(mem, index, &mut report)?;
        }
        report.paused_for = paused_at.elapsed();
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;
    use std::os::unix::fs::PermissionsExt;
    use vm_memory::Bytes;

    /// The entries as given (a trailer only if listed), inodes numbered from 1.
    fn newc(entries: &[(&str, u32, &[u8])]) -> Vec<u8> {
        let mut cpio = Vec::new();
        for (ino, (name, mode, data)) in (1u32..).zip(entries) {
            testkit::cpio::newc_entry(&mut cpio, ino, *mode, name, data);
        }
        cpio
    }

    fn sample_files() -> (Vec<u8>, Vec<u8>) {
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
        let b: Vec<u8> = (0..5000u32).map(|i| (i % 13) as u8 + 7).collect();
        (a, b)
    }

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

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "page-sharing-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn template_dir_is_private_and_templates_are_read_only() {
        let d = temp_dir("dir");
        let dir = TemplateDir::open(&d.join("t")).unwrap();
        let mode = std::fs::metadata(d.join("t")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        assert!(dir.get("x", None).unwrap().is_none());
        let f = dir.put("x", b"first").unwrap();
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o444);
        // A second put keeps the first file (and checks it: the size is the first one's).
        dir.put("x", b"first").unwrap();
        assert!(matches!(
            dir.put("x", b"second!"),
            Err(PageSharingError::Template { .. })
        ));
        assert_eq!(std::fs::read(d.join("t/x")).unwrap(), b"first");
        // No temporary file left.
        assert_eq!(std::fs::read_dir(d.join("t")).unwrap().count(), 1);
        // A directory others may enter is refused.
        // Sums are remembered by the file's identity.
        let mut data = dir.put("data", b"abc").unwrap();
        let sum = cached_file_sha256(&dir, &mut data).unwrap();
        assert_eq!(sum, file_sha256(&mut data).unwrap());
        assert_eq!(std::fs::read_dir(d.join("t")).unwrap().count(), 3);
        assert_eq!(cached_file_sha256(&dir, &mut data).unwrap(), sum);
        std::fs::set_permissions(d.join("t"), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(
            TemplateDir::open(&d.join("t")),
            Err(PageSharingError::TemplateDir { .. })
        ));
        std::fs::remove_dir_all(&d).unwrap();
    }

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
        let d = temp_dir("pass");
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
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A template directory under `tag` holding one template "x": the first sample file,
    /// padded to two pages. Returns the directory, the template's bytes and its index.
    fn two_page_template(tag: &str) -> (PathBuf, Vec<u8>, TemplateIndex) {
        let d = temp_dir(tag);
        let dir = TemplateDir::open(&d).unwrap();
        let (mut t, _) = sample_files();
        t.resize(2 * PAGE, 0);
        let mut index = TemplateIndex::default();
        index.add(TemplateView::new("x", dir.put("tpl", &t).unwrap()).unwrap());
        (d, t, index)
    }

    #[test]
    fn a_wrong_template_shares_nothing() {
        let (d, t, index) = two_page_template("wrong");
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
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A VM's sharing state for tests: root `root`, domain `domain`, an initrd holding two
    /// files, and (when `text_pages` > 0) a kernel whose text is the first `text_pages` pages
    /// of guest memory (the kernel file is the initrd: only its sum counts).
    fn test_sharing(
        root: &Path,
        domain: &str,
        capture: bool,
        initrd_path: &Path,
        text_pages: u64,
    ) -> VmSharing {
        VmSharing {
            config: PageSharingConfig {
                template_dir: root.to_path_buf(),
                domain: domain.to_string(),
                capture_kernel_text: capture,
            },
            kernel: File::open(initrd_path).unwrap(),
            initrd: Some(File::open(initrd_path).unwrap()),
            text: (text_pages > 0).then(|| 0..text_pages * PAGE as u64),
            cmdline: String::new(),
            vcpus: 1,
            cpuid: Vec::new(),
            index: None,
        }
    }

    /// A newc initrd of two files, written beside `d`; its bytes.
    fn test_initrd(d: &Path) -> (PathBuf, Vec<u8>) {
        let (a, b) = sample_files();
        let cpio = newc(&[
            ("init", 0o100755, &a),
            ("b", 0o100644, &b),
            ("TRAILER!!!", 0, b""),
        ]);
        let initrd_path = d.with_extension("cpio");
        std::fs::write(&initrd_path, &cpio).unwrap();
        (initrd_path, cpio)
    }

    fn inode(f: &File) -> u64 {
        f.metadata().unwrap().ino()
    }

    #[test]
    fn prepare_streams_the_initrd_template_once() {
        let d = temp_dir("prepare");
        let (initrd_path, cpio) = test_initrd(&d);
        let mut sharing = test_sharing(&d, NODE_DOMAIN, false, &initrd_path, 0);
        assert_eq!(
            sharing.prepare().unwrap(),
            (None, false),
            "no kernel text to capture"
        );
        let index = sharing.index.take().unwrap();
        assert_eq!(index.views().len(), 1);
        let name = index.views()[0].name().to_string();
        assert!(name.starts_with("initrd-files-"), "{name}");
        let in_domain = d.join(NODE_DOMAIN).join(&name);
        assert_eq!(
            std::fs::read(&in_domain).unwrap(),
            initrd_template(&cpio).unwrap()
        );
        assert_eq!(
            std::fs::metadata(&in_domain).unwrap().len(),
            initrd_template_len(&parse_newc(&cpio).unwrap())
        );
        // The sum is remembered beside the captures, not in the domain.
        assert_eq!(std::fs::read_dir(d.join(CAPTURED_DIR)).unwrap().count(), 1);
        // A second VM finds it (and the remembered sum): same name, nothing new written.
        let before = std::fs::read_dir(d.join(NODE_DOMAIN)).unwrap().count();
        sharing.prepare().unwrap();
        assert_eq!(sharing.index.as_ref().unwrap().views()[0].name(), name);
        assert_eq!(
            std::fs::read_dir(d.join(NODE_DOMAIN)).unwrap().count(),
            before
        );
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_file(&initrd_path).unwrap();
    }

    /// Every way a template file can be unfit: each is refused with an error naming the
    /// template and why, before anything is mapped (the VM then runs its pass with no sharing
    /// at all: the shim logs the error).
    #[test]
    fn a_template_failing_a_check_is_refused_with_its_reason() {
        let d = temp_dir("checks");
        let (initrd_path, cpio) = test_initrd(&d);
        // A first VM makes the good template; keep its bytes and name.
        let mut sharing = test_sharing(&d, "ns-x", false, &initrd_path, 0);
        sharing.prepare().unwrap();
        let name = sharing.index.take().unwrap().views()[0].name().to_string();
        let path = d.join("ns-x").join(&name);
        let good = std::fs::read(&path).unwrap();
        let elsewhere = d.join("elsewhere");
        std::fs::write(&elsewhere, &good).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o444)).unwrap();

        let replace = |how: &dyn Fn(&Path)| {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_dir(&path);
            how(&path);
        };
        let good_file = |p: &Path| {
            std::fs::write(p, &good).unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o444)).unwrap();
        };
        type Case<'a> = (&'a str, Box<dyn Fn(&Path) + 'a>, &'a str);
        let cases: Vec<Case> = vec![
            (
                "another owner",
                Box::new(|p: &Path| {
                    good_file(p);
                    std::os::unix::fs::chown(p, Some(1000), Some(1000)).unwrap();
                }),
                "owned by uid 1000",
            ),
            (
                "writable by others",
                Box::new(|p: &Path| {
                    good_file(p);
                    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o646)).unwrap();
                }),
                "group or others may write it",
            ),
            (
                "writable by the group",
                Box::new(|p: &Path| {
                    good_file(p);
                    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o464)).unwrap();
                }),
                "group or others may write it",
            ),
            (
                "cut short",
                Box::new(|p: &Path| {
                    std::fs::write(p, &good[..good.len() - PAGE]).unwrap();
                    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o444)).unwrap();
                }),
                "expected",
            ),
            (
                "a symbolic link to a good copy",
                Box::new(|p: &Path| std::os::unix::fs::symlink(&elsewhere, p).unwrap()),
                "symbolic link",
            ),
            (
                "a FIFO",
                Box::new(|p: &Path| {
                    rustix::fs::mknodat(
                        rustix::fs::CWD,
                        p,
                        rustix::fs::FileType::Fifo,
                        Mode::from_raw_mode(0o444),
                        0,
                    )
                    .unwrap()
                }),
                "not a regular file",
            ),
            (
                "a directory",
                Box::new(|p: &Path| std::fs::create_dir(p).unwrap()),
                "not a regular file",
            ),
        ];
        for (what, how, reason) in &cases {
            replace(how.as_ref());
            let mut vm = test_sharing(&d, "ns-x", false, &initrd_path, 0);
            match vm.prepare() {
                Err(e @ PageSharingError::Template { .. }) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(&name) && msg.contains(reason) && msg.contains("refused"),
                        "{what}: {msg}"
                    );
                }
                other => panic!("{what}: {other:?}"),
            }
            assert!(vm.index.is_none(), "{what}: nothing prepared");
        }
        // The good file again: accepted (the checks refuse only what is unfit).
        replace(&good_file);
        let mut vm = test_sharing(&d, "ns-x", false, &initrd_path, 0);
        vm.prepare().unwrap();
        assert_eq!(
            good,
            initrd_template(&cpio).unwrap(),
            "the template is the initrd's files"
        );
        // A remembered sum that is not 64 bytes is refused too.
        let sums: Vec<_> = std::fs::read_dir(d.join(CAPTURED_DIR))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(sums.len(), 1);
        std::fs::remove_file(&sums[0]).unwrap();
        std::fs::write(&sums[0], b"00").unwrap();
        std::fs::set_permissions(&sums[0], std::fs::Permissions::from_mode(0o444)).unwrap();
        let mut vm = test_sharing(&d, "ns-x", false, &initrd_path, 0);
        let e = vm.prepare().unwrap_err().to_string();
        assert!(e.contains("2 bytes, expected 64"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_file(&initrd_path).unwrap();
    }

    /// The directories: a domain or the root that is a symbolic link, or that others may enter,
    /// is refused; a domain name that is not one safe component is refused.
    #[test]
    fn template_directories_are_checked_and_domains_are_safe_names() {
        let d = temp_dir("dirs");
        let (initrd_path, _) = test_initrd(&d);
        std::fs::create_dir_all(d.join("real")).unwrap();
        std::fs::set_permissions(d.join("real"), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(d.join("real"), d.join("link")).unwrap();
        let mut vm = test_sharing(&d.join("link"), "ns-x", false, &initrd_path, 0);
        let e = vm.prepare().unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::create_dir_all(d.join("root")).unwrap();
        std::fs::set_permissions(d.join("root"), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(d.join("real"), d.join("root/ns-x")).unwrap();
        let mut vm = test_sharing(&d.join("root"), "ns-x", false, &initrd_path, 0);
        let e = vm.prepare().unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::create_dir(d.join("root/ns-y")).unwrap();
        std::fs::set_permissions(d.join("root/ns-y"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let mut vm = test_sharing(&d.join("root"), "ns-y", false, &initrd_path, 0);
        let e = vm.prepare().unwrap_err().to_string();
        assert!(e.contains("others may enter"), "{e}");
        for bad in ["", "..", "a/b", "captured", "ns x", &"a".repeat(65)] {
            assert!(!valid_domain(bad), "{bad:?}");
            let mut vm = test_sharing(&d.join("root"), bad, false, &initrd_path, 0);
            assert!(
                matches!(vm.prepare(), Err(PageSharingError::Domain { .. })),
                "{bad:?}"
            );
        }
        let shop = namespace_domain("shop");
        assert!(valid_domain(&shop) && valid_domain(NODE_DOMAIN), "{shop}");
        assert_eq!(shop, namespace_domain("shop"));
        assert_ne!(shop, namespace_domain("shop2"));
        assert_eq!(namespace_domain("../../etc").len(), 3 + 32);
        assert!(valid_domain(&namespace_domain("../../etc")));
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_file(&initrd_path).unwrap();
    }

    /// Domains map different files (so their guests share no template page), VMs of one domain
    /// the same; a pod's VM never captures the kernel text, a capturing VM's capture is copied
    /// into each domain.
    #[test]
    fn domains_map_files_of_their_own_and_only_a_capturing_vm_captures() {
        let d = temp_dir("domains");
        let (initrd_path, _) = test_initrd(&d);
        let mem = create_guest_memory(2 << 20).unwrap();
        let text: Vec<u8> = (0..2 * PAGE).map(|i| (i % 251) as u8 + 1).collect();
        mem.write_slice(&text, GuestAddress(0)).unwrap();
        let (a, b) = (namespace_domain("team-a"), namespace_domain("team-b"));

        // A pod's VM before any capture: the kernel text is missing, and it captures nothing.
        let mut pod = test_sharing(&d, &a, false, &initrd_path, 2);
        assert!(pod.kernel_text_missing().unwrap());
        assert_eq!(pod.prepare().unwrap(), (None, true));
        assert!(matches!(
            pod.capture_kernel_text(&mem, "kernel-text-x"),
            Err(PageSharingError::NoCapture)
        ));
        assert!(matches!(
            pod.capture_name(),
            Err(PageSharingError::NoCapture)
        ));
        let report = pod.paused_pass(&mem, None, true).unwrap();
        assert!(report.kernel_text_missing && !report.captured_kernel_text);
        assert!(
            report.to_string().contains("no kernel text template"),
            "{report}"
        );
        pod.index = None;

        // A VM that saw no pod input captures it, into the captures only.
        let mut throwaway = test_sharing(&d, NODE_DOMAIN, true, &initrd_path, 2);
        let name = throwaway.capture_name().unwrap().expect("to capture");
        assert!(throwaway.capture_kernel_text(&mem, &name).unwrap());
        assert_eq!(
            std::fs::read(d.join(CAPTURED_DIR).join(&name)).unwrap(),
            text
        );
        assert_eq!(throwaway.capture_name().unwrap(), None, "captured once");
        assert!(!pod.kernel_text_missing().unwrap());

        // Pods of two domains, and a second pod of the first.
        let views = |domain: &str| {
            let mut vm = test_sharing(&d, domain, false, &initrd_path, 2);
            assert_eq!(vm.prepare().unwrap(), (None, false));
            let index = vm.index.take().unwrap();
            assert_eq!(index.views().len(), 2);
            index
                .views()
                .iter()
                .map(|v| (v.name().to_string(), inode(&v.file), v.bytes().to_vec()))
                .collect::<Vec<_>>()
        };
        let (a1, a2, b1) = (views(&a), views(&a), views(&b));
        assert_eq!(a1[1].0, name);
        assert_eq!(a1[1].2, text, "the domain's copy holds the capture");
        for i in 0..2 {
            assert_eq!(a1[i].1, a2[i].1, "one domain maps one file");
            assert_ne!(a1[i].1, b1[i].1, "two domains map different files");
            assert_eq!(a1[i].2, b1[i].2, "of the same bytes");
        }
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_file(&initrd_path).unwrap();
    }

    #[test]
    fn the_mapping_budget_leaves_the_rest_counted() {
        let (d, t, index) = two_page_template("budget");
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
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn guest_bytes(mem: &GuestMemory) -> Vec<u8> {
        let mut v = vec![0u8; mem.last_addr().0 as usize + 1];
        mem.read_slice(&mut v, GuestAddress(0)).unwrap();
        v
    }

    #[test]
    fn zero_pages_in_a_file_mapping_become_anonymous_zero_memory() {
        let d = temp_dir("filezero");
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
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn hashes_and_zero_checks() {
        let z = vec![0u8; PAGE];
        assert!(is_zero(&z));
        let mut nz = z.clone();
        nz[PAGE - 1] = 1;
        assert!(!is_zero(&nz));
        assert_ne!(page_hash(&z), page_hash(&nz));
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
