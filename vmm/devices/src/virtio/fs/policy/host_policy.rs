//! [`HostPolicy`]'s state (the wrapped file system, the count of refused requests, the flags
//! each guest handle was opened with) and the steps its checked requests share: refusing with
//! `EPERM`, clearing set-ID bits after an open that can write. The requests themselves, checked
//! or delegated, are its [`FileSystem`] implementation in `filesystem.rs`.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use fuse_backend_rs::api::filesystem::{Context, FileSystem, SetattrValid};

use super::rules::bits_killed_by_write;

fn refused() -> io::Error {
    io::Error::from_raw_os_error(libc::EPERM)
}

/// A [`FileSystem`] that refuses what would plant privilege on the host (module doc) and
/// delegates everything else to `F`.
///
/// It also keeps the flags each handle was opened with and hands the passthrough those, never
/// the guest's, on READ and WRITE: fuse-backend-rs applies a READ's or WRITE's flags that
/// differ from the open's with `fcntl(F_SETFL)` on the handle's descriptor, and when that fails
/// (`O_DIRECT` where the file system has no direct I/O, `O_APPEND` on an append-only file, any
/// change on an `O_PATH` descriptor) its early return closes the descriptor while the handle
/// keeps its number. The next descriptor the process opens (the shim's, since the VMM runs in
/// it) would then take that number, and the guest's handle would read, write and finally close
/// it. Found by the `virtio_fs` fuzz target. So the guest's flags on READ and WRITE are not
/// applied to the host's descriptor: `fcntl(F_SETFL)` in the guest changes its own view only.
pub struct HostPolicy<F> {
    pub(super) inner: F,
    refused: AtomicU64,
    /// The open flags of each handle the guest holds (OPEN, CREATE, OPENDIR until RELEASE,
    /// RELEASEDIR); one entry per descriptor the passthrough holds for it, so bounded as those.
    handle_flags: Mutex<HashMap<u64, u32>>,
}

impl<F> HostPolicy<F>
where
    F: FileSystem<Inode = u64, Handle = u64>,
{
    /// Wraps `inner`.
    pub fn new(inner: F) -> Self {
        Self {
            inner,
            refused: AtomicU64::new(0),
            handle_flags: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u32>> {
        // A panic while holding the lock leaves a map that is still whole (inserts and
        // removes only): go on with it.
        self.handle_flags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn remember(&self, handle: Option<u64>, flags: u32) {
        if let Some(h) = handle {
            self.handles().insert(h, flags);
        }
    }

    /// The flags `handle` was opened with; EBADF for a handle the guest does not hold.
    pub(super) fn opened_flags(&self, handle: u64) -> io::Result<u32> {
        self.handles()
            .get(&handle)
            .copied()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
    }

    /// Requests refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    pub(super) fn refuse<T>(&self, what: std::fmt::Arguments<'_>) -> io::Result<T> {
        self.refused.fetch_add(1, Ordering::Relaxed);
        log::debug!("virtio-fs: refused {what}");
        Err(refused())
    }

    /// Clears the set-ID bits a write would clear (see [`bits_killed_by_write`]) on `inode`.
    pub(super) fn kill_set_id(
        &self,
        ctx: &Context,
        inode: u64,
        handle: Option<u64>,
    ) -> io::Result<()> {
        let (st, _) = self.inner.getattr(ctx, inode, handle)?;
        let kill = bits_killed_by_write(st.st_mode);
        if kill == 0 {
            return Ok(());
        }
        // SETATTR with MODE reads only `st_mode`.
        let mut attr = st;
        attr.st_mode = st.st_mode & !kill;
        self.inner
            .setattr(ctx, inode, attr, handle, SetattrValid::MODE)
            .map(|_| ())
    }

    /// After an open that can write: clear the set-ID bits, or close the handle and fail.
    pub(super) fn kill_after_open(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
        handle: Option<u64>,
    ) -> io::Result<()> {
        match self.kill_set_id(ctx, inode, handle) {
            Ok(()) => Ok(()),
            Err(e) => {
                if let Some(h) = handle {
                    let _ = self.inner.release(ctx, inode, flags, h, false, false, None);
                }
                Err(e)
            }
        }
    }
}
