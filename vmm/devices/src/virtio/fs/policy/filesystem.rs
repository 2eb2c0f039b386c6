//! [`HostPolicy`] as a FUSE [`FileSystem`]: the requests that could plant privilege on the host
//! (MKNOD, CREATE, MKDIR, SETATTR, SETXATTR, OPEN, OPENDIR) are checked against the rules
//! (`rules.rs`) before they reach the wrapped file system; READ and WRITE get the flags their
//! handle was opened with; RELEASE, RELEASEDIR and DESTROY forget handles; every other request
//! is delegated unchanged. One trait implementation, so one file: it is long because the trait
//! has many methods, each a few lines.

use std::ffi::CStr;
use std::io;
use std::time::Duration;

use fuse_backend_rs::abi::fuse_abi::{stat64, statvfs64, CreateIn};
use fuse_backend_rs::abi::virtio_fs::RemovemappingOne;
use fuse_backend_rs::api::filesystem::{
    Context, DirEntry, Entry, FileLock, FileSystem, FsOptions, GetxattrReply, IoctlData,
    ListxattrReply, OpenOptions, SetattrValid, ZeroCopyReader, ZeroCopyWriter,
};
use fuse_backend_rs::transport::FsCacheReqHandler;

use super::host_policy::HostPolicy;
use super::rules::{
    mknod_allowed, mode_allowed, open_can_write, open_flags_allowed, SET_ID, TMPFILE_BIT,
    XATTR_CAPABILITY,
};

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
