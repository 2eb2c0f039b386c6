//! File and mount operations on the host that never follow a symlink and never leave the
//! directory tree they start from (docs/security.md).
//!
//! The shim runs as root in the host's mount namespace, and some of the trees it works in are
//! seen by a hostile guest (the pod's shared directory, exported over virtio-fs). Resolving a
//! path again at every step (create, mount, unmount) would let whoever can change a component
//! in between redirect the shim anywhere on the host. So every operation here starts from a
//! directory file descriptor and resolves with `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`: no symlink anywhere on the way, never above the starting
//! directory. Files and directories are created with `O_CREAT | O_EXCL` or `mkdirat` relative to
//! their parent's descriptor; mounts are cloned (`open_tree`), given their flags while still
//! detached (`mount_setattr`) and attached to a target descriptor (`move_mount`); an unmount
//! goes through a descriptor checked to be the root of a mount.
//!
//! `mount_setattr` has no wrapper in rustix yet: it is the one raw system call here.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{
    fstat, mkdirat, openat2, statx, unlinkat, AtFlags, FileType, Mode, OFlags, ResolveFlags,
    StatxAttributes, StatxFlags, CWD,
};
use rustix::mount::{
    fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount, open_tree, unmount,
    FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

/// How every path under a starting directory is resolved: no symlink (nor `/proc` magic link)
/// anywhere, never above the starting directory.
const BENEATH: ResolveFlags = ResolveFlags::NO_SYMLINKS
    .union(ResolveFlags::BENEATH)
    .union(ResolveFlags::NO_MAGICLINKS);

/// How deep [`remove_tree_beneath`] goes; the trees it removes are the shim's own, a few
/// levels deep.
const MAX_REMOVE_DEPTH: usize = 8;

/// How many mounts stacked on one mount point [`unmount_beneath`] takes off.
const MAX_STACKED_MOUNTS: usize = 16;

/// Mount propagation of a tree the shim attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// Nothing propagates in or out.
    Private,
    /// Mounts made later under the source (on the host) propagate in; nothing goes back.
    Slave,
    /// A member of a peer group (a new one, if the mount was private): mounts made under it
    /// propagate to its peers and slaves (copies made later, by `open_tree`, a bind or a new
    /// mount namespace), and unmounts too.
    Shared,
}

/// A relative path made of plain names only (no `/` at the start, no `.` or `..`), as every
/// path handed to this module must be.
fn check_relative(rel: &Path) -> io::Result<()> {
    let plain = rel.components().next().is_some()
        && rel.components().all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a plain relative path", rel.display()),
        ))
    }
}

/// Opens the directory at `path` as an `O_PATH` descriptor; its last component must not be a
/// symlink. For the roots the shim owns (a pod's state directory): everything under them is
/// then reached through [`open_beneath`].
pub fn open_root_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens `rel` under `dir` with `flags` (plus `O_CLOEXEC`), refusing any symlink on the way,
/// the last component included, and anything outside `dir`.
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    check_relative(rel)?;
    Ok(openat2(
        dir,
        rel,
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        BENEATH,
    )?)
}

/// The parent of `rel` under `dir`, opened (`dir` itself for a single name), and the last name.
fn parent_beneath<'a>(
    dir: BorrowedFd<'_>,
    rel: &'a Path,
) -> io::Result<(Option<OwnedFd>, &'a std::ffi::OsStr)> {
    check_relative(rel)?;
    let name = rel
        .file_name()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let parent = match rel.parent() {
        Some(p) if !p.as_os_str().is_empty() => {
            Some(open_beneath(dir, p, OFlags::PATH | OFlags::DIRECTORY)?)
        }
        _ => None,
    };
    Ok((parent, name))
}

/// Creates directory `rel` under `dir` (its parent must exist). An existing directory is fine;
/// anything else there (a file, a symlink) is an error.
pub fn mkdir_beneath(dir: BorrowedFd<'_>, rel: &Path, mode: u32) -> io::Result<()> {
    let (parent, name) = parent_beneath(dir, rel)?;
    let at = parent.as_ref().map_or(dir, AsFd::as_fd);
    match mkdirat(at, name, Mode::from_raw_mode(mode)) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::EXIST) => {
            // O_DIRECTORY with RESOLVE_NO_SYMLINKS: a symlink or a file there fails.
            open_beneath(dir, rel, OFlags::PATH | OFlags::DIRECTORY).map(drop)
        }
        Err(e) => Err(e.into()),
    }
}

/// Creates `rel` and each missing directory above it under `dir`.
pub fn mkdir_all_beneath(dir: BorrowedFd<'_>, rel: &Path, mode: u32) -> io::Result<()> {
    check_relative(rel)?;
    let mut prefix = PathBuf::new();
    for c in rel.components() {
        prefix.push(c);
        mkdir_beneath(dir, &prefix, mode)?;
    }
    Ok(())
}

/// Creates the empty file `rel` under `dir`; it must not exist (`O_CREAT | O_EXCL`: an existing
/// name, a symlink included, is an error and is never followed).
pub fn create_file_beneath(dir: BorrowedFd<'_>, rel: &Path, mode: u32) -> io::Result<()> {
    let (parent, name) = parent_beneath(dir, rel)?;
    let at = parent.as_ref().map_or(dir, AsFd::as_fd);
    rustix::fs::openat(
        at,
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::WRONLY | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    )?;
    Ok(())
}

/// The names in directory `rel` under `dir` (`.` and `..` left out).
pub fn list_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<Vec<std::ffi::OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let fd = open_beneath(dir, rel, OFlags::RDONLY | OFlags::DIRECTORY)?;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(&fd)? {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(std::ffi::OsStr::from_bytes(name).to_owned());
        }
    }
    Ok(names)
}

/// Removes `rel` under `dir` and everything in it, never following a symlink and never entering
/// another mount (a mount still there fails the removal: nothing of a mounted tree is deleted).
/// A missing `rel` is fine.
pub fn remove_tree_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<()> {
    let (parent, name) = parent_beneath(dir, rel)?;
    let at = parent.as_ref().map_or(dir, AsFd::as_fd);
    remove_entry(at, Path::new(name), 0)
}

fn remove_entry(parent: BorrowedFd<'_>, name: &Path, depth: usize) -> io::Result<()> {
    let resolve = BENEATH | ResolveFlags::NO_XDEV;
    let fd = match openat2(
        parent,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        resolve,
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if is_mount_root(fd.as_fd())? {
        return Err(io::Error::new(
            io::ErrorKind::ResourceBusy,
            format!("{} is still a mount point", name.display()),
        ));
    }
    if FileType::from_raw_mode(fstat(&fd)?.st_mode) != FileType::Directory {
        return Ok(unlinkat(parent, name, AtFlags::empty())?);
    }
    if depth >= MAX_REMOVE_DEPTH {
        return Err(io::Error::other(format!(
            "{} is nested deeper than {MAX_REMOVE_DEPTH} levels",
            name.display()
        )));
    }
    let dir = openat2(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        resolve,
    )?;
    let mut children = Vec::new();
    for entry in rustix::fs::Dir::read_from(&dir)? {
        let entry = entry?;
        let child = entry.file_name().to_bytes();
        if child != b"." && child != b".." {
            use std::os::unix::ffi::OsStrExt;
            children.push(PathBuf::from(std::ffi::OsStr::from_bytes(child)));
        }
    }
    for child in children {
        remove_entry(dir.as_fd(), &child, depth + 1)?;
    }
    Ok(unlinkat(parent, name, AtFlags::REMOVEDIR)?)
}

/// Whether `fd` is the root of a mount (`STATX_ATTR_MOUNT_ROOT`, Linux 5.8).
pub fn is_mount_root(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let st = statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::empty())?;
    let (attrs, mask) = (st.stx_attributes, st.stx_attributes_mask);
    if !mask.contains(StatxAttributes::MOUNT_ROOT) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this kernel does not report mount roots (statx STATX_ATTR_MOUNT_ROOT, Linux 5.8)",
        ));
    }
    Ok(attrs.contains(StatxAttributes::MOUNT_ROOT))
}

/// Detaches (`MNT_DETACH`) the mount whose root `fd` is, with every mount under it. `fd` must
/// be the root of a mount.
pub fn unmount_fd(fd: BorrowedFd<'_>) -> io::Result<()> {
    if !is_mount_root(fd)? {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not the root of a mount",
        ));
    }
    // umount2 takes a path: the descriptor's own magic link names exactly the mount checked
    // above, whatever happened to its path since.
    Ok(unmount(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        UnmountFlags::DETACH,
    )?)
}

/// Detaches whatever is mounted at `rel` under `dir` (every mount stacked there, and the mounts
/// under them); returns how many it took off. `rel` itself is resolved beneath `dir` without
/// symlinks; a missing `rel` takes nothing off.
pub fn unmount_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<usize> {
    let mut taken = 0;
    while taken < MAX_STACKED_MOUNTS {
        let fd = match open_beneath(dir, rel, OFlags::PATH) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(taken),
            Err(e) => return Err(e),
        };
        if !is_mount_root(fd.as_fd())? {
            return Ok(taken);
        }
        unmount_fd(fd.as_fd())?;
        taken += 1;
    }
    Err(io::Error::other(format!(
        "more than {MAX_STACKED_MOUNTS} mounts stacked on {}",
        rel.display()
    )))
}

/// A detached copy of the mount tree at host path `source` (`open_tree(OPEN_TREE_CLONE |
/// AT_RECURSIVE)`), to be given its flags ([`set_mount_attrs`]) and attached ([`attach`]).
pub fn clone_tree(source: &Path) -> io::Result<OwnedFd> {
    Ok(open_tree(
        CWD,
        source,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_RECURSIVE,
    )?)
}

/// A detached copy of the mount whose root `fd` is, without the mounts under it.
pub fn clone_mount(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    Ok(open_tree(
        fd,
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )?)
}

/// Sets `attrs` (read-only, nosuid, nodev, noexec, ...) and, if given, the propagation of the
/// mount whose root `mount` is (attached or detached); with `recursive`, of every mount under it
/// too.
pub fn set_mount_attrs(
    mount: BorrowedFd<'_>,
    attrs: MountAttrFlags,
    propagation: Option<Propagation>,
    recursive: bool,
) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: u64::from(attrs.bits()),
        attr_clr: 0,
        propagation: match propagation {
            None => 0,
            Some(Propagation::Private) => libc::MS_PRIVATE,
            Some(Propagation::Slave) => libc::MS_SLAVE,
            Some(Propagation::Shared) => libc::MS_SHARED,
        },
        userns_fd: 0,
    };
    let mut flags = libc::AT_EMPTY_PATH as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    // SAFETY: mount_setattr(2) on a descriptor we hold, with an empty NUL-terminated path
    // (AT_EMPTY_PATH: the descriptor itself), a fully initialised `struct mount_attr` and its
    // exact size; the kernel only reads the struct during the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            c"".as_ptr(),
            flags,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Attaches the detached mount tree `tree` on the directory or file `target`
/// (`move_mount` from descriptor to descriptor: no path is resolved).
pub fn attach(tree: BorrowedFd<'_>, target: BorrowedFd<'_>) -> io::Result<()> {
    Ok(move_mount(
        tree,
        "",
        target,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )?)
}

/// A new, detached tmpfs with `options` (`size`, `nr_inodes`, `mode`, ...) and mount `attrs`.
pub fn new_tmpfs(options: &[(&str, &str)], attrs: MountAttrFlags) -> io::Result<OwnedFd> {
    let fs = fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
    for (key, value) in options {
        fsconfig_set_string(&fs, *key, *value)?;
    }
    fsconfig_create(&fs)?;
    Ok(fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs)?)
}

/// The path that names what `fd` is open on, for system calls that only take a path (a mount's
/// target in the legacy `mount(2)`): `/proc/self/fd/<fd>`. Valid while `fd` is open.
pub fn fd_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn root_dir(tmp: &tempfile::TempDir) -> OwnedFd {
        open_root_dir(tmp.path()).unwrap()
    }

    #[test]
    fn paths_must_be_plain_and_relative() {
        for bad in ["", "/etc", "a/../b", "./a", ".."] {
            assert!(check_relative(Path::new(bad)).is_err(), "{bad:?}");
        }
        check_relative(Path::new("c1/mounts/0")).unwrap();
    }

    #[test]
    fn nothing_is_reached_through_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("c1")).unwrap();
        // The attacker's plant: a directory the shim walks replaced by a symlink out of the tree.
        symlink(outside.path(), tmp.path().join("c1/mounts")).unwrap();
        symlink(outside.path().join("f"), tmp.path().join("c1/file")).unwrap();
        let dir = root_dir(&tmp);
        let d = dir.as_fd();
        assert!(mkdir_beneath(d, Path::new("c1/mounts/0"), 0o755).is_err());
        assert!(mkdir_all_beneath(d, Path::new("c1/mounts/0"), 0o755).is_err());
        assert!(create_file_beneath(d, Path::new("c1/mounts/1"), 0o644).is_err());
        assert!(create_file_beneath(d, Path::new("c1/file"), 0o644).is_err());
        assert!(open_beneath(d, Path::new("c1/mounts"), OFlags::PATH).is_err());
        assert!(list_beneath(d, Path::new("c1/mounts")).is_err());
        assert_eq!(unmount_beneath(d, Path::new("c1/file")).ok(), None);
        assert!(
            fs::read_dir(outside.path()).unwrap().next().is_none(),
            "nothing was created outside the tree"
        );
        // Removing the tree removes the links, not what they point at.
        fs::write(outside.path().join("keep"), "x").unwrap();
        remove_tree_beneath(d, Path::new("c1")).unwrap();
        assert!(!tmp.path().join("c1").exists());
        assert!(outside.path().join("keep").exists());
    }

    #[test]
    fn creates_lists_and_removes_a_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = root_dir(&tmp);
        let d = dir.as_fd();
        mkdir_all_beneath(d, Path::new("c1/mounts"), 0o755).unwrap();
        mkdir_all_beneath(d, Path::new("c1/mounts"), 0o755).unwrap();
        create_file_beneath(d, Path::new("c1/mounts/0"), 0o644).unwrap();
        assert!(
            create_file_beneath(d, Path::new("c1/mounts/0"), 0o644).is_err(),
            "O_EXCL"
        );
        mkdir_beneath(d, Path::new("c1/mounts/1"), 0o755).unwrap();
        let mut names = list_beneath(d, Path::new("c1/mounts")).unwrap();
        names.sort();
        assert_eq!(names, ["0", "1"]);
        assert!(
            mkdir_beneath(d, Path::new("c1/mounts/0"), 0o755).is_err(),
            "a file is not a directory"
        );
        remove_tree_beneath(d, Path::new("c1")).unwrap();
        assert!(!tmp.path().join("c1").exists());
        remove_tree_beneath(d, Path::new("c1")).unwrap();
    }

    #[test]
    fn a_read_only_export_with_its_writable_clone_and_a_mounted_tree_is_never_deleted() {
        assert_eq!(
            rustix::process::geteuid().as_raw(),
            0,
            "mounting needs root (make test runs as root)"
        );
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("export")).unwrap();
        let dir = root_dir(&tmp);
        let d = dir.as_fd();
        let fs_mount = new_tmpfs(
            &[("size", "64k"), ("nr_inodes", "64"), ("mode", "0755")],
            MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV,
        )
        .unwrap();
        let target =
            open_beneath(d, Path::new("export"), OFlags::PATH | OFlags::DIRECTORY).unwrap();
        attach(fs_mount.as_fd(), target.as_fd()).unwrap();
        let export =
            open_beneath(d, Path::new("export"), OFlags::PATH | OFlags::DIRECTORY).unwrap();
        assert!(is_mount_root(export.as_fd()).unwrap());
        let rw = clone_mount(export.as_fd()).unwrap();
        set_mount_attrs(
            export.as_fd(),
            MountAttrFlags::MOUNT_ATTR_RDONLY,
            Some(Propagation::Private),
            false,
        )
        .unwrap();
        // Through the path: read-only. Through the detached clone: writable.
        assert!(fs::create_dir(tmp.path().join("export/x")).is_err());
        mkdir_all_beneath(rw.as_fd(), Path::new("c1/vol"), 0o755).unwrap();
        assert!(tmp.path().join("export/c1/vol").is_dir());
        // A tree mounted under the export cannot be removed through the clone.
        let vol_src = tempfile::tempdir().unwrap();
        fs::write(vol_src.path().join("data"), "keep").unwrap();
        let tree = clone_tree(vol_src.path()).unwrap();
        set_mount_attrs(
            tree.as_fd(),
            MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV,
            Some(Propagation::Private),
            true,
        )
        .unwrap();
        let vol = open_beneath(
            export.as_fd(),
            Path::new("c1/vol"),
            OFlags::PATH | OFlags::DIRECTORY,
        )
        .unwrap();
        attach(tree.as_fd(), vol.as_fd()).unwrap();
        assert_eq!(
            fs::read_to_string(tmp.path().join("export/c1/vol/data")).unwrap(),
            "keep"
        );
        assert!(remove_tree_beneath(rw.as_fd(), Path::new("c1")).is_err());
        assert!(vol_src.path().join("data").exists());
        assert_eq!(
            unmount_beneath(export.as_fd(), Path::new("c1/vol")).unwrap(),
            1
        );
        remove_tree_beneath(rw.as_fd(), Path::new("c1")).unwrap();
        assert_eq!(unmount_beneath(d, Path::new("export")).unwrap(), 1);
        assert!(!is_mount_root(
            open_beneath(d, Path::new("export"), OFlags::PATH)
                .unwrap()
                .as_fd()
        )
        .unwrap());
    }
}
