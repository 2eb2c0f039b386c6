//! The kernel as the last line: [`confine_serving_thread`] gives the thread that serves the
//! guest's requests a umask of its own and takes [`DROPPED_CAPABILITIES`] from it, so that a
//! request the policy missed still cannot make a device node, a file capability or keep a
//! set-ID bit on a write (why each: the [module doc](super)).

use std::cell::Cell;
use std::io;

use caps::{CapSet, Capability};

/// Capabilities the serving thread gives up (see the module doc).
pub const DROPPED_CAPABILITIES: [Capability; 3] = [
    Capability::CAP_MKNOD,
    Capability::CAP_SETFCAP,
    Capability::CAP_FSETID,
];

thread_local! {
    static CONFINED: Cell<bool> = const { Cell::new(false) };
}

/// Why the serving thread could not be confined.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// `unshare(CLONE_FS)` failed: the thread shares its umask with the process.
    #[error("giving the serving thread a umask of its own (unshare CLONE_FS): {0}")]
    Umask(#[source] io::Error),
    /// A capability could not be dropped.
    #[error("dropping the serving thread's capabilities: {0}")]
    Caps(#[from] caps::errors::CapsError),
}

/// Confines the calling thread for serving guest requests; only the first call on a thread
/// does anything (and only it can return an error, so a caller that logs it logs once):
///
/// - gives the thread a file-system context of its own (`unshare(CLONE_FS)`: its own umask,
///   working and root directory). The passthrough clears the umask (`umask(0)`) when the guest
///   sends FUSE INIT, so that the modes the guest asks for apply as asked; without this that
///   would clear the umask of the whole process, the shim's or the VMM's, from then on, at a
///   moment of the guest's choosing;
/// - drops [`DROPPED_CAPABILITIES`] from the thread's effective, permitted and inheritable
///   sets. Linux capabilities are per thread: other threads of the process keep theirs.
///
/// [`HostPolicy`](super::HostPolicy) does not depend on it.
pub fn confine_serving_thread() -> Result<(), ConfineError> {
    if CONFINED.with(|c| c.replace(true)) {
        return Ok(());
    }
    // SAFETY: unshare(2) with a flag and no pointers; CLONE_FS only detaches this thread's
    // fs_struct (umask, cwd, root) from the other threads', which nothing here relies on.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(ConfineError::Umask(io::Error::last_os_error()));
    }
    // Effective first: the kernel refuses an effective set larger than the permitted one.
    for set in [CapSet::Effective, CapSet::Permitted, CapSet::Inheritable] {
        for cap in DROPPED_CAPABILITIES {
            caps::drop(None, set, cap)?;
        }
    }
    Ok(())
}
