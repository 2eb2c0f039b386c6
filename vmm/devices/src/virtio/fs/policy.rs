//! What the guest may plant on the host's disk through the share: a [`FileSystem`] wrapper that
//! refuses device nodes, set-user-ID / set-group-ID files and file capabilities, and the
//! serving thread's capability drop behind it.
//!
//! The passthrough file system runs as host root and does what the guest asks inside the shared
//! directory. A file it creates is a real host file: a character device with `/dev/mem`'s
//! numbers, a set-user-ID-root shell or a `security.capability` xattr would work on the host
//! for anyone who reaches the file there (a hostPath volume, a host process that walks the
//! share), whatever mount options the guest's view had. [`HostPolicy`] wraps the file system
//! and checks every request that can create such a file or give an existing one such a bit;
//! everything else is delegated unchanged. A refused request gets `EPERM`. The checks read the
//! decoded request and the host inode (its type from `getattr`), never the guest's idea of it,
//! so no phrasing gets around them: a mode's file-type bits, the umask and the open flags are
//! all looked at as the host would apply them.
//!
//! | request | refused (`EPERM`) | allowed |
//! |---|---|---|
//! | MKNOD | character devices other than 0:0, block devices, any other type than the allowed ones, any mode with `S_ISUID` or `S_ISGID` | regular files, FIFOs, sockets, the overlayfs whiteout (character device 0:0) |
//! | CREATE | a mode with `S_ISUID` or `S_ISGID`; `O_TMPFILE` | everything else |
//! | MKDIR | a mode with `S_ISUID` | `S_ISGID` (the kernel ignores both in `mkdir(2)` and a new directory inherits its parent's `S_ISGID`) |
//! | SETATTR (mode) | `S_ISUID` on anything; `S_ISGID` on anything but a directory | `S_ISGID` on a directory, the sticky bit, any permission bits |
//! | SETXATTR | `security.capability` | other names (xattrs are off in this device today: `ENOSYS` for all) |
//! | OPEN, OPENDIR | `O_CREAT`, `O_TMPFILE` (Linux never sends them: creation is CREATE) | everything else |
//!
//! Why these:
//! - **Device nodes.** A character or block device on the host's disk is access to the host's
//!   memory or disks for whoever opens it. The one character device a guest needs is the
//!   whiteout (0:0): overlayfs in the guest creates it on an upper directory, which may live on
//!   the share (a volume), to hide a lower file; it is no device (opening it fails: no driver
//!   has 0:0). FIFOs and sockets are in-memory objects of the host kernel: no privilege.
//! - **Set-user-ID and set-group-ID files.** A set-user-ID-root file is root for whoever runs it
//!   on the host; a set-group-ID file owned by group root (or `shadow`, `disk`) is that group.
//!   Both are refused wherever they come from (CREATE, MKNOD, SETATTR). A set-group-ID
//!   *directory* is allowed: it only makes new entries inherit its group (and new
//!   subdirectories the bit), which grants nothing the creator could not set by `chown` anyway,
//!   and images and workloads use it (Debian's `/var/local`, `/var/mail`, shared project
//!   directories). `S_ISUID` on a directory means nothing on Linux; it is refused to keep the
//!   rule simple ("no new `S_ISUID` anywhere"). The cost: a guest cannot install a set-ID
//!   program into the share (`chmod u+s`, `dpkg` unpacking `sudo`, `install -m 4755` get
//!   `EPERM`); set-ID files that came with the container image keep their bits.
//! - **File capabilities.** `security.capability` is a set-user-ID with finer grain: refused.
//! - **Writing an existing set-ID file** (one from the image): an OPEN or CREATE that can
//!   write (`O_WRONLY`, `O_RDWR`, `O_TRUNC`) and a SETATTR that changes the size first clear
//!   `S_ISUID`, and `S_ISGID` when group-execute is set, as the kernel does on a write by an
//!   unprivileged process. Otherwise the guest could put its own code into a set-user-ID-root
//!   binary (the host's root keeps the bits on write). Writes need a handle, and handles that
//!   can write come only from those requests.
//!
//! Left to the kernel, and checked by the tests: `chown` of a set-ID file clears the bits (for
//! every caller); a hard link (LINK) names an inode the guest already reached inside the share
//! and cannot cross to another mount (`EXDEV`), and adds no bit; RENAME (with `RENAME_EXCHANGE`
//! or `RENAME_WHITEOUT`, which makes a 0:0 whiteout) moves names inside the share only; the
//! `umask` can only remove bits. Nothing here changes owners: guest root creates root-owned
//! files, which is why the bits matter.
//!
//! **The umask stays on the serving thread.** The passthrough clears the umask (`umask(0)`)
//! when the guest sends FUSE INIT, so that it can apply the guest's own umask exactly. A umask
//! belongs to the whole process unless a thread has a file-system context of its own: the
//! serving thread takes one first (`unshare(CLONE_FS)` in [`confine_serving_thread`]), or a
//! guest would clear the umask of the shim (which embeds the VMM) at a moment of its choosing,
//! and every file and directory the shim made afterwards would be writable by everyone. Found by
//! the virtio_fs fuzz target (docs/fuzzing.md).
//!
//! **The kernel as last line.** The thread that serves the requests gives up `CAP_MKNOD`,
//! `CAP_SETFCAP` and `CAP_FSETID` from its effective, permitted and inheritable sets
//! ([`confine_serving_thread`], called by the device before its first request on a thread).
//! Linux capabilities are per thread, so this touches only that thread (the VMM's device
//! thread). Without `CAP_MKNOD` the host kernel refuses every device node but the whiteout;
//! without `CAP_SETFCAP` it refuses `security.capability`; without `CAP_FSETID` it clears
//! set-ID bits on every write, truncate and `fallocate`, also through overlayfs. They are
//! dropped from the permitted set, not only the effective one, because the passthrough switches
//! its effective uid per request (`setresuid`), and returning to uid 0 refills the effective
//! set from the permitted one. The passthrough's own `CAP_FSETID` juggling is used only with
//! `FUSE_HANDLE_KILLPRIV_V2`, which this device does not enable.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use caps::{CapSet, Capability};
use fuse_backend_rs::abi::fuse_abi::{stat64, statvfs64, CreateIn};
use fuse_backend_rs::abi::virtio_fs::RemovemappingOne;
use fuse_backend_rs::api::filesystem::{
    Context, DirEntry, Entry, FileLock, FileSystem, FsOptions, GetxattrReply, IoctlData,
    ListxattrReply, OpenOptions, SetattrValid, ZeroCopyReader, ZeroCopyWriter,
};
use fuse_backend_rs::transport::FsCacheReqHandler;

/// The file-capability xattr (`XATTR_NAME_CAPS`).
pub const XATTR_CAPABILITY: &[u8] = b"security.capability";

/// Capabilities the serving thread gives up (see the module doc).
pub const DROPPED_CAPABILITIES: [Capability; 3] = [
    Capability::CAP_MKNOD,
    Capability::CAP_SETFCAP,
    Capability::CAP_FSETID,
];

/// The set-ID bits.
const SET_ID: u32 = libc::S_ISUID | libc::S_ISGID;
/// `O_TMPFILE` without the `O_DIRECTORY` it includes (the kernel's `__O_TMPFILE`).
const TMPFILE_BIT: u32 = (libc::O_TMPFILE & !libc::O_DIRECTORY) as u32;

fn refused() -> io::Error {
    io::Error::from_raw_os_error(libc::EPERM)
}

/// Whether MKNOD may create a node of `mode` and `rdev` (the raw request values).
pub fn mknod_allowed(mode: u32, rdev: u32) -> bool {
    if mode & SET_ID != 0 {
        return false;
    }
    match mode & libc::S_IFMT {
        // Type 0 is a regular file for mknod(2).
        0 | libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK => true,
        // The overlayfs whiteout. FUSE carries the device number as a u32 (the guest's
        // new_encode_dev); 0 is 0:0 in every encoding.
        libc::S_IFCHR => rdev == 0,
        _ => false,
    }
}

/// Whether a SETATTR may give an inode of type `file_type` (`S_IFMT` bits of the host inode)
/// the mode `mode`.
pub fn mode_allowed(file_type: u32, mode: u32) -> bool {
    if mode & libc::S_ISUID != 0 {
        return false;
    }
    mode & libc::S_ISGID == 0 || file_type == libc::S_IFDIR
}

/// Whether an open with these flags (OPEN, OPENDIR) may go on: it must not create anything,
/// and it must not ask for an `O_PATH` descriptor (no FUSE open needs one, and the passthrough's
/// READ and WRITE would fail on it in a way that closes the handle's descriptor: see
/// [`HostPolicy`]'s handle flags).
pub fn open_flags_allowed(flags: u32) -> bool {
    flags & (libc::O_CREAT as u32 | TMPFILE_BIT | libc::O_PATH as u32) == 0
}

/// Whether an open with these flags can change the file's content.
fn open_can_write(flags: u32) -> bool {
    flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 || flags & libc::O_TRUNC as u32 != 0
}

/// The set-ID bits a write would make the kernel clear on a file of `mode` (for an
/// unprivileged writer): `S_ISUID`, and `S_ISGID` with group-execute; regular files only.
pub fn bits_killed_by_write(mode: u32) -> u32 {
    if mode & libc::S_IFMT != libc::S_IFREG {
        return 0;
    }
    let mut kill = mode & libc::S_ISUID;
    if mode & libc::S_ISGID != 0 && mode & libc::S_IXGRP != 0 {
        kill |= libc::S_ISGID;
    }
    kill
}

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
/// [`HostPolicy`] does not depend on it.
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
    inner: F,
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

    fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u32>> {
        // A panic while holding the lock leaves a map that is still whole (inserts and
        // removes only): go on with it.
        self.handle_flags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn remember(&self, handle: Option<u64>, flags: u32) {
        if let Some(h) = handle {
            self.handles().insert(h, flags);
        }
    }

    /// The flags `handle` was opened with; EBADF for a handle the guest does not hold.
    fn opened_flags(&self, handle: u64) -> io::Result<u32> {
        self.handles()
            .get(&handle)
            .copied()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
    }

    /// Requests refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn refuse<T>(&self, what: std::fmt::Arguments<'_>) -> io::Result<T> {
        self.refused.fetch_add(1, Ordering::Relaxed);
        log::debug!("virtio-fs: refused {what}");
        Err(refused())
    }

    /// Clears the set-ID bits a write would clear (see [`bits_killed_by_write`]) on `inode`.
    fn kill_set_id(&self, ctx: &Context, inode: u64, handle: Option<u64>) -> io::Result<()> {
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
    fn kill_after_open(
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

impl<F> FileSystem for HostPolicy<F>
where
    F: FileSystem<Inode = u64, Handle = u64>,
{
    type Inode = u64;
    type Handle = u64;

    fn mknod(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        if !mknod_allowed(mode, rdev) {
            return self.refuse(format_args!("MKNOD {name:?} mode {mode:#o} rdev {rdev:#x}"));
        }
        self.inner.mknod(ctx, parent, name, mode, rdev, umask)
    }

    fn create(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        args: CreateIn,
    ) -> io::Result<(Entry, Option<u64>, OpenOptions, Option<u32>)> {
        if args.mode & SET_ID != 0 || args.flags & (TMPFILE_BIT | libc::O_PATH as u32) != 0 {
            return self.refuse(format_args!(
                "CREATE {name:?} mode {:#o} flags {:#x}",
                args.mode, args.flags
            ));
        }
        let flags = args.flags;
        let (entry, handle, opts, passthrough) = self.inner.create(ctx, parent, name, args)?;
        self.remember(handle, flags);
        // Without O_EXCL an existing file is opened (and maybe truncated): it may carry bits.
        if open_can_write(flags) {
            self.kill_after_open(ctx, entry.inode, flags, handle)?;
        }
        Ok((entry, handle, opts, passthrough))
    }

    fn mkdir(
        &self,
        ctx: &Context,
        parent: u64,
        name: &CStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        if mode & libc::S_ISUID != 0 {
            return self.refuse(format_args!("MKDIR {name:?} mode {mode:#o}"));
        }
        self.inner.mkdir(ctx, parent, name, mode, umask)
    }

    fn setattr(
        &self,
        ctx: &Context,
        inode: u64,
        attr: stat64,
        handle: Option<u64>,
        valid: SetattrValid,
    ) -> io::Result<(stat64, Duration)> {
        if valid.contains(SetattrValid::MODE) {
            // The type of the host inode, not the one the guest put in the mode.
            let (st, _) = self.inner.getattr(ctx, inode, handle)?;
            if !mode_allowed(st.st_mode & libc::S_IFMT, attr.st_mode) {
                return self.refuse(format_args!(
                    "SETATTR mode {:#o} on a {:#o}",
                    attr.st_mode,
                    st.st_mode & libc::S_IFMT
                ));
            }
        }
        if valid.contains(SetattrValid::SIZE) {
            self.kill_set_id(ctx, inode, handle)?;
        }
        self.inner.setattr(ctx, inode, attr, handle, valid)
    }

    fn setxattr(
        &self,
        ctx: &Context,
        inode: u64,
        name: &CStr,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        if name.to_bytes() == XATTR_CAPABILITY {
            return self.refuse(format_args!("SETXATTR {name:?}"));
        }
        self.inner.setxattr(ctx, inode, name, value, flags)
    }

    fn open(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions, Option<u32>)> {
        if !open_flags_allowed(flags) {
            return self.refuse(format_args!("OPEN flags {flags:#x}"));
        }
        let (handle, opts, passthrough) = self.inner.open(ctx, inode, flags, fuse_flags)?;
        self.remember(handle, flags);
        if open_can_write(flags) {
            self.kill_after_open(ctx, inode, flags, handle)?;
        }
        Ok((handle, opts, passthrough))
    }

    fn opendir(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
    ) -> io::Result<(Option<u64>, OpenOptions)> {
        if !open_flags_allowed(flags) {
            return self.refuse(format_args!("OPENDIR flags {flags:#x}"));
        }
        let (handle, opts) = self.inner.opendir(ctx, inode, flags)?;
        self.remember(handle, flags);
        Ok((handle, opts))
    }

    // Everything below is delegated unchanged (each method, so none falls back to the trait's
    // default `ENOSYS`).

    fn init(&self, capable: FsOptions) -> io::Result<FsOptions> {
        self.inner.init(capable)
    }

    fn destroy(&self) {
        self.inner.destroy();
        self.handles().clear();
    }

    fn lookup(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<Entry> {
        self.inner.lookup(ctx, parent, name)
    }

    fn forget(&self, ctx: &Context, inode: u64, count: u64) {
        self.inner.forget(ctx, inode, count)
    }

    fn batch_forget(&self, ctx: &Context, requests: Vec<(u64, u64)>) {
        self.inner.batch_forget(ctx, requests)
    }

    fn getattr(
        &self,
        ctx: &Context,
        inode: u64,
        handle: Option<u64>,
    ) -> io::Result<(stat64, Duration)> {
        self.inner.getattr(ctx, inode, handle)
    }

    fn readlink(&self, ctx: &Context, inode: u64) -> io::Result<Vec<u8>> {
        self.inner.readlink(ctx, inode)
    }

    fn symlink(
        &self,
        ctx: &Context,
        linkname: &CStr,
        parent: u64,
        name: &CStr,
    ) -> io::Result<Entry> {
        self.inner.symlink(ctx, linkname, parent, name)
    }

    fn unlink(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.inner.unlink(ctx, parent, name)
    }

    fn rmdir(&self, ctx: &Context, parent: u64, name: &CStr) -> io::Result<()> {
        self.inner.rmdir(ctx, parent, name)
    }

    fn rename(
        &self,
        ctx: &Context,
        olddir: u64,
        oldname: &CStr,
        newdir: u64,
        newname: &CStr,
        flags: u32,
    ) -> io::Result<()> {
        self.inner
            .rename(ctx, olddir, oldname, newdir, newname, flags)
    }

    fn link(&self, ctx: &Context, inode: u64, newparent: u64, newname: &CStr) -> io::Result<Entry> {
        self.inner.link(ctx, inode, newparent, newname)
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        w: &mut dyn ZeroCopyWriter,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        _flags: u32,
    ) -> io::Result<usize> {
        let flags = self.opened_flags(handle)?;
        self.inner
            .read(ctx, inode, handle, w, size, offset, lock_owner, flags)
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        r: &mut dyn ZeroCopyReader,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        delayed_write: bool,
        _flags: u32,
        fuse_flags: u32,
    ) -> io::Result<usize> {
        let flags = self.opened_flags(handle)?;
        self.inner.write(
            ctx,
            inode,
            handle,
            r,
            size,
            offset,
            lock_owner,
            delayed_write,
            flags,
            fuse_flags,
        )
    }

    fn flush(&self, ctx: &Context, inode: u64, handle: u64, lock_owner: u64) -> io::Result<()> {
        self.inner.flush(ctx, inode, handle, lock_owner)
    }

    fn fsync(&self, ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        self.inner.fsync(ctx, inode, datasync, handle)
    }

    fn fallocate(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        mode: u32,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        self.inner
            .fallocate(ctx, inode, handle, mode, offset, length)
    }

    #[allow(clippy::too_many_arguments)]
    fn release(
        &self,
        ctx: &Context,
        inode: u64,
        flags: u32,
        handle: u64,
        flush: bool,
        flock_release: bool,
        lock_owner: Option<u64>,
    ) -> io::Result<()> {
        let released =
            self.inner
                .release(ctx, inode, flags, handle, flush, flock_release, lock_owner);
        if released.is_ok() {
            self.handles().remove(&handle);
        }
        released
    }

    fn statfs(&self, ctx: &Context, inode: u64) -> io::Result<statvfs64> {
        self.inner.statfs(ctx, inode)
    }

    fn getxattr(
        &self,
        ctx: &Context,
        inode: u64,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        self.inner.getxattr(ctx, inode, name, size)
    }

    fn listxattr(&self, ctx: &Context, inode: u64, size: u32) -> io::Result<ListxattrReply> {
        self.inner.listxattr(ctx, inode, size)
    }

    fn removexattr(&self, ctx: &Context, inode: u64, name: &CStr) -> io::Result<()> {
        self.inner.removexattr(ctx, inode, name)
    }

    fn readdir(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry) -> io::Result<usize>,
    ) -> io::Result<()> {
        self.inner
            .readdir(ctx, inode, handle, size, offset, add_entry)
    }

    fn readdirplus(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry, Entry) -> io::Result<usize>,
    ) -> io::Result<()> {
        self.inner
            .readdirplus(ctx, inode, handle, size, offset, add_entry)
    }

    fn fsyncdir(&self, ctx: &Context, inode: u64, datasync: bool, handle: u64) -> io::Result<()> {
        self.inner.fsyncdir(ctx, inode, datasync, handle)
    }

    fn releasedir(&self, ctx: &Context, inode: u64, flags: u32, handle: u64) -> io::Result<()> {
        let released = self.inner.releasedir(ctx, inode, flags, handle);
        if released.is_ok() {
            self.handles().remove(&handle);
        }
        released
    }

    #[allow(clippy::too_many_arguments)]
    fn setupmapping(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        foffset: u64,
        len: u64,
        flags: u64,
        moffset: u64,
        vu_req: &mut dyn FsCacheReqHandler,
    ) -> io::Result<()> {
        self.inner
            .setupmapping(ctx, inode, handle, foffset, len, flags, moffset, vu_req)
    }

    fn removemapping(
        &self,
        ctx: &Context,
        inode: u64,
        requests: Vec<RemovemappingOne>,
        vu_req: &mut dyn FsCacheReqHandler,
    ) -> io::Result<()> {
        self.inner.removemapping(ctx, inode, requests, vu_req)
    }

    fn access(&self, ctx: &Context, inode: u64, mask: u32) -> io::Result<()> {
        self.inner.access(ctx, inode, mask)
    }

    fn lseek(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        offset: u64,
        whence: u32,
    ) -> io::Result<u64> {
        self.inner.lseek(ctx, inode, handle, offset, whence)
    }

    fn getlk(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        owner: u64,
        lock: FileLock,
        flags: u32,
    ) -> io::Result<FileLock> {
        self.inner.getlk(ctx, inode, handle, owner, lock, flags)
    }

    fn setlk(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        owner: u64,
        lock: FileLock,
        flags: u32,
    ) -> io::Result<()> {
        self.inner.setlk(ctx, inode, handle, owner, lock, flags)
    }

    fn setlkw(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        owner: u64,
        lock: FileLock,
        flags: u32,
    ) -> io::Result<()> {
        self.inner.setlkw(ctx, inode, handle, owner, lock, flags)
    }

    #[allow(clippy::too_many_arguments)]
    fn ioctl(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        flags: u32,
        cmd: u32,
        data: IoctlData,
        out_size: u32,
    ) -> io::Result<IoctlData<'_>> {
        self.inner
            .ioctl(ctx, inode, handle, flags, cmd, data, out_size)
    }

    fn bmap(&self, ctx: &Context, inode: u64, block: u64, blocksize: u32) -> io::Result<u64> {
        self.inner.bmap(ctx, inode, block, blocksize)
    }

    fn poll(
        &self,
        ctx: &Context,
        inode: u64,
        handle: u64,
        khandle: u64,
        flags: u32,
        events: u32,
    ) -> io::Result<u32> {
        self.inner.poll(ctx, inode, handle, khandle, flags, events)
    }

    fn notify_reply(&self) -> io::Result<()> {
        self.inner.notify_reply()
    }

    fn id_remap(&self, ctx: &mut Context) -> io::Result<()> {
        self.inner.id_remap(ctx)
    }
}
