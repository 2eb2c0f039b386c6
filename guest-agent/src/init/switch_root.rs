//! Leaving the initramfs: the kernel unpacks our cpio into `rootfs`, the one mount with no
//! parent, and pivot_root(2) refuses to run from it (EINVAL). libcontainer pivots into every
//! container's root, so before anything else PID 1 moves the system onto a tmpfs: copy the tree
//! into a fresh tmpfs, delete the originals (their memory is freed), move the tmpfs over `/` and
//! chroot into it. This is what `switch_root` does in an initrd; the initramfs here is small
//! (the agent binary and empty mount points).
//!
//! Nothing here follows a path outside the initramfs: the walk stays on the root's device and
//! never follows symlinks.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where the new root is assembled, inside the old one.
const NEW_ROOT: &str = "/.microvm-root";

/// statfs f_type of the initramfs: ramfs, or tmpfs when the kernel has it.
const RAMFS_MAGIC: i64 = 0x8584_58f6;
const TMPFS_MAGIC: i64 = 0x0102_1994;

#[derive(Debug, thiserror::Error)]
pub enum SwitchRootError {
    #[error("switching root: {step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("switching root: path {0} contains a NUL byte")]
    Nul(PathBuf),
}

fn io_err(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SwitchRootError {
    let path = path.to_owned();
    move |source| SwitchRootError::Io { step, path, source }
}

fn cstr(path: &Path) -> Result<CString, SwitchRootError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| SwitchRootError::Nul(path.to_owned()))
}

fn check(rc: libc::c_int, step: &'static str, path: &Path) -> Result<(), SwitchRootError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(SwitchRootError::Io {
            step,
            path: path.to_owned(),
            source: io::Error::last_os_error(),
        })
    }
}

/// Whether `/` is the kernel's initramfs (ramfs or tmpfs that is not yet ours).
pub fn root_is_initramfs() -> bool {
    if Path::new(NEW_ROOT).exists() {
        return false;
    }
    // SAFETY: statfs writes only into `st`, a properly sized, zeroed struct; the path is a valid
    // NUL-terminated string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statfs(c"/".as_ptr(), &mut st) };
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    let kind = st.f_type as i64;
    rc == 0 && (kind == RAMFS_MAGIC || kind == TMPFS_MAGIC)
}

/// Moves the system from the initramfs onto a tmpfs root. Only for PID 1, before any other
/// mount (callers go through [`super::setup_system`]).
pub fn switch_to_tmpfs() -> Result<(), SwitchRootError> {
    let new_root = Path::new(NEW_ROOT);
    fs::DirBuilder::new()
        .mode(0o755)
        .create(new_root)
        .map_err(io_err("creating", new_root))?;
    let target = cstr(new_root)?;
    // SAFETY: valid NUL-terminated strings that outlive the call; mount(2) keeps no pointer.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            c"mode=0755".as_ptr().cast(),
        )
    };
    check(rc, "mounting a tmpfs on", new_root)?;
    let root_dev = fs::symlink_metadata("/")
        .map_err(io_err("reading", Path::new("/")))?
        .dev();
    move_tree(Path::new("/"), new_root, root_dev, new_root)?;
    std::env::set_current_dir(new_root).map_err(io_err("entering", new_root))?;
    // SAFETY: "." and "/" are valid NUL-terminated strings; MS_MOVE takes no data.
    let rc = unsafe {
        libc::mount(
            c".".as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_MOVE,
            std::ptr::null(),
        )
    };
    check(rc, "moving the new root over", Path::new("/"))?;
    // SAFETY: "." is a valid NUL-terminated string.
    let rc = unsafe { libc::chroot(c".".as_ptr()) };
    check(rc, "chroot into", new_root)?;
    std::env::set_current_dir("/").map_err(io_err("entering", Path::new("/")))?;
    Ok(())
}

/// Copies every entry of directory `from` into `to` and deletes the original, depth first.
/// Entries on another device than `root_dev` (mounts) and `skip` (the new root) stay put.
fn move_tree(from: &Path, to: &Path, root_dev: u64, skip: &Path) -> Result<(), SwitchRootError> {
    let entries = fs::read_dir(from).map_err(io_err("listing", from))?;
    for entry in entries {
        let entry = entry.map_err(io_err("listing", from))?;
        let src = entry.path();
        if src == skip {
            continue;
        }
        let dst = to.join(entry.file_name());
        let meta = fs::symlink_metadata(&src).map_err(io_err("reading", &src))?;
        let kind = meta.file_type();
        let mode = meta.permissions().mode() & 0o7777;
        if kind.is_dir() {
            fs::DirBuilder::new()
                .mode(mode)
                .create(&dst)
                .map_err(io_err("creating", &dst))?;
            fs::set_permissions(&dst, fs::Permissions::from_mode(mode))
                .map_err(io_err("setting the mode of", &dst))?;
            if meta.dev() != root_dev {
                continue; // a mount point: its contents are not the initramfs's
            }
            move_tree(&src, &dst, root_dev, skip)?;
            fs::remove_dir(&src).map_err(io_err("removing", &src))?;
            continue;
        }
        if kind.is_symlink() {
            let link = fs::read_link(&src).map_err(io_err("reading the link", &src))?;
            std::os::unix::fs::symlink(&link, &dst).map_err(io_err("creating", &dst))?;
        } else if kind.is_file() {
            fs::copy(&src, &dst).map_err(io_err("copying to", &dst))?;
            fs::set_permissions(&dst, fs::Permissions::from_mode(mode))
                .map_err(io_err("setting the mode of", &dst))?;
        } else if kind.is_char_device() || kind.is_block_device() || kind.is_fifo() {
            let path = cstr(&dst)?;
            // SAFETY: `path` is a valid NUL-terminated string; mode and device come from the
            // original node.
            let rc = unsafe {
                libc::mknod(
                    path.as_ptr(),
                    meta.mode() as libc::mode_t,
                    meta.rdev() as libc::dev_t,
                )
            };
            check(rc, "creating the node", &dst)?;
        } else {
            continue; // sockets: nothing listens yet
        }
        fs::remove_file(&src).map_err(io_err("removing", &src))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_a_tree_of_files_dirs_links_and_fifos() {
        let base = std::env::temp_dir().join(format!("switch-root-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let from = base.join("from");
        let to = base.join("to");
        fs::create_dir_all(from.join("a/b")).unwrap();
        fs::create_dir_all(&to).unwrap();
        fs::write(from.join("init"), b"binary").unwrap();
        fs::set_permissions(from.join("init"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(from.join("a/b/file"), b"x").unwrap();
        std::os::unix::fs::symlink("a/b/file", from.join("link")).unwrap();
        let fifo = cstr(&from.join("a/fifo")).unwrap();
        // SAFETY: valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        fs::set_permissions(from.join("a"), fs::Permissions::from_mode(0o700)).unwrap();
        let dev = fs::symlink_metadata(&from).unwrap().dev();
        move_tree(&from, &to, dev, &from.join("skip-me")).unwrap();

        assert_eq!(fs::read(to.join("init")).unwrap(), b"binary");
        assert_eq!(
            fs::metadata(to.join("init")).unwrap().permissions().mode() & 0o777,
            0o755
        );
        assert_eq!(fs::read(to.join("a/b/file")).unwrap(), b"x");
        assert_eq!(
            fs::read_link(to.join("link")).unwrap(),
            Path::new("a/b/file")
        );
        assert!(fs::symlink_metadata(to.join("a/fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        assert_eq!(
            fs::metadata(to.join("a")).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // the originals are gone
        assert_eq!(fs::read_dir(&from).unwrap().count(), 0);
        fs::remove_dir_all(&base).unwrap();
    }
}
