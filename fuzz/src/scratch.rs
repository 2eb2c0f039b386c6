//! Scratch space for the targets that need host files and sockets (vsock's Unix sockets, the
//! virtio-fs share, disks, the ready listener, CDI spec files).
//!
//! As root, [`init`] moves the fuzzing process into a mount namespace of its own and mounts a
//! small tmpfs there: whatever an input makes (a 1 TiB sparse file, a million entries) is bounded
//! by that tmpfs and vanishes with the process, and nothing is left in the host's /tmp. Without
//! the privilege it falls back to a directory under the system's temporary folder, removed by
//! [`Scratch`]'s drop when the process ends normally.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Size of the private tmpfs.
const TMPFS_SIZE: &str = "size=256m,nr_inodes=65536";

static ROOT: OnceLock<PathBuf> = OnceLock::new();

/// Sets up the scratch root; call from the target's `init` (before any thread is started: a
/// mount namespace cannot be unshared by one thread of many).
pub fn init() {
    ROOT.get_or_init(make_root);
}

fn make_root() -> PathBuf {
    // One mount point for every fuzzing process: each mounts its own tmpfs over it, in its own
    // mount namespace, so on the host it stays an empty folder (scripts/fuzz.sh removes it).
    let shared = std::env::temp_dir().join("microvm-fuzz-scratch");
    if std::fs::create_dir_all(&shared).is_ok() && private_tmpfs(&shared) {
        return shared;
    }
    let dir = std::env::temp_dir().join(format!("microvm-fuzz-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// Mounts a tmpfs on `dir` in a new private mount namespace: true if that worked.
fn private_tmpfs(dir: &Path) -> bool {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    let (Ok(path), Ok(opts)) = (
        CString::new(dir.as_os_str().as_bytes()),
        CString::new(TMPFS_SIZE),
    ) else {
        return false;
    };
    // SAFETY: unshare(2) with a flag and no pointers; it changes only this process.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return false;
    }
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call; MS_REC|MS_PRIVATE on
    // "/" changes propagation in our own (new) mount namespace only, so nothing we mount later
    // reaches the host's.
    let private = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if private != 0 {
        return false;
    }
    // SAFETY: as above: a tmpfs on `dir` in our own mount namespace only.
    unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            path.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID,
            opts.as_ptr().cast(),
        ) == 0
    }
}

/// The scratch root (set up on first use if the target had no `init`).
pub fn root() -> &'static Path {
    ROOT.get_or_init(make_root)
}

/// A fresh, empty directory under the scratch root, removed (with everything in it) when
/// dropped.
pub struct Scratch {
    path: PathBuf,
}

impl Scratch {
    /// `name` must be unique among the live scratch directories of the process.
    pub fn new(name: &str) -> Self {
        let path = root().join(name);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("scratch directory");
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
