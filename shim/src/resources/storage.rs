//! Host side of an app container's files in the pod's shared directory: its rootfs (the mounts
//! containerd passes in CreateTaskRequest.rootfs, usually one overlay) at `shared/<cid>/rootfs`,
//! and the spec's bind-mount sources at `shared/<cid>/mounts/<n>` ([`crate::sandbox::spec`]).
//! Every mount point is recorded in the pod's state directory before it is mounted, so a cleanup
//! after a crash finds it; [`unshare_container`] undoes one container.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::sandbox::spec::ShareBind;
use crate::state::{mounts_under, StateDir};

/// One rootfs mount as containerd passes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootfsMount {
    pub fs_type: String,
    pub source: String,
    pub options: Vec<String>,
}

/// Errors of sharing a container's files; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("mounting the rootfs at {path}: {message}")]
    Rootfs { path: PathBuf, message: String },
    #[error(transparent)]
    State(#[from] crate::state::StateError),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ShareError + 'a {
    move |source| ShareError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The host folder of container `cid` in the pod's shared directory.
pub fn container_dir(state: &StateDir, cid: &str) -> PathBuf {
    state.shared_dir().join(cid)
}

/// Mounts container `cid`'s rootfs and bind sources into the shared directory. With no rootfs
/// mounts (the bundle's `rootfs` is already the root), `bundle_rootfs` is bind-mounted. On error
/// what was mounted is undone.
pub fn share_container(
    state: &StateDir,
    cid: &str,
    rootfs: &[RootfsMount],
    bundle_rootfs: &Path,
    binds: &[ShareBind],
) -> Result<PathBuf, ShareError> {
    let result = share_inner(state, cid, rootfs, bundle_rootfs, binds);
    if result.is_err() {
        let _ = unshare_container(state, cid);
    }
    result
}

fn share_inner(
    state: &StateDir,
    cid: &str,
    rootfs: &[RootfsMount],
    bundle_rootfs: &Path,
    binds: &[ShareBind],
) -> Result<PathBuf, ShareError> {
    let target = container_dir(state, cid).join("rootfs");
    fs::create_dir_all(&target).map_err(io_err("create", &target))?;
    state.record_mount(&target)?;
    if rootfs.is_empty() {
        bind(bundle_rootfs, &target, false, false)?;
    }
    for m in rootfs {
        let source = (!m.source.is_empty()).then_some(m.source.as_str());
        containerd_shim::mount::mount_rootfs(Some(&m.fs_type), source, &m.options, &target)
            .map_err(|e| ShareError::Rootfs {
                path: target.clone(),
                message: format!("{} mount of {}: {e}", m.fs_type, m.source),
            })?;
    }
    for b in binds {
        let dest = state.shared_dir().join(&b.relative);
        let meta = fs::metadata(&b.host_source).map_err(io_err("bind source", &b.host_source))?;
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(io_err("create", parent))?;
        }
        if meta.is_dir() {
            fs::create_dir_all(&dest).map_err(io_err("create", &dest))?;
        } else {
            fs::write(&dest, b"").map_err(io_err("create", &dest))?;
        }
        state.record_mount(&dest)?;
        bind(&b.host_source, &dest, b.readonly, b.from_host)?;
    }
    Ok(target)
}

/// Unmounts everything of container `cid` in the shared directory (deepest first) and removes
/// its folder. Harmless if nothing is there.
pub fn unshare_container(state: &StateDir, cid: &str) -> Result<(), ShareError> {
    let dir = container_dir(state, cid);
    let mut mounts = mounts_under(&dir);
    mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    for m in &mounts {
        umount(m).map_err(io_err("unmount", m))?;
    }
    match fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("remove", &dir)(e)),
    }
}

fn cstr(p: &Path) -> Result<CString, ShareError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| ShareError::Io {
        what: "path with NUL",
        path: p.to_path_buf(),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })
}

/// `mount --rbind source target`, then read-only if asked. Private propagation, or with
/// `from_host` slave: mounts made later under a shared source on the host appear in the share,
/// hence in the guest through the shared filesystem (HostToContainer and Bidirectional volumes),
/// while nothing mounted under the share goes back to the source.
fn bind(source: &Path, target: &Path, readonly: bool, from_host: bool) -> Result<(), ShareError> {
    let t = cstr(target)?;
    mount(Some(&cstr(source)?), &t, libc::MS_BIND | libc::MS_REC)
        .map_err(io_err("bind-mount onto", target))?;
    let (propagation, what) = if from_host {
        (libc::MS_SLAVE, "make slave")
    } else {
        (libc::MS_PRIVATE, "make private")
    };
    mount(None, &t, propagation | libc::MS_REC).map_err(io_err(what, target))?;
    if readonly {
        mount(None, &t, libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY)
            .map_err(io_err("remount read-only", target))?;
    }
    Ok(())
}

/// mount(2) of `source` (none: a change to the mount at `target`) with `flags`, no fs type or data.
fn mount(source: Option<&CString>, target: &CString, flags: libc::c_ulong) -> io::Result<()> {
    let source = source.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: mount(2) with valid NUL-terminated paths (or null for the source of a flags-only
    // change) and no fs type or data; the kernel retains none of the pointers.
    let rc = unsafe {
        libc::mount(
            source,
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn umount(target: &Path) -> io::Result<()> {
    let t = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: umount2(2) with a valid NUL-terminated path.
    if unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn require_root() {
        // SAFETY: geteuid(2) has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "mounting needs root (make test runs as root)");
    }

    #[test]
    fn shares_an_overlay_rootfs_and_binds_then_unshares() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path(), "pod").unwrap();
        state.create(std::process::id()).unwrap();
        let layers = tmp.path().join("layers");
        let (lower, upper, work) = (layers.join("l"), layers.join("u"), layers.join("w"));
        for d in [&lower, &upper, &work] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(lower.join("hello"), "from the image").unwrap();
        let hosts = tmp.path().join("hosts");
        fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
        let vol = tmp.path().join("vol");
        fs::create_dir_all(&vol).unwrap();
        fs::write(vol.join("data"), "volume").unwrap();
        let rootfs = [RootfsMount {
            fs_type: "overlay".into(),
            source: "overlay".into(),
            options: vec![
                format!("lowerdir={}", lower.display()),
                format!("upperdir={}", upper.display()),
                format!("workdir={}", work.display()),
            ],
        }];
        let binds = [
            ShareBind {
                host_source: hosts.clone(),
                relative: "c1/mounts/1".into(),
                readonly: true,
                from_host: false,
            },
            ShareBind {
                host_source: vol.clone(),
                relative: "c1/mounts/2".into(),
                readonly: false,
                from_host: false,
            },
        ];
        let root =
            share_container(&state, "c1", &rootfs, Path::new("/nonexistent"), &binds).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("hello")).unwrap(),
            "from the image"
        );
        let shared = state.shared_dir();
        assert_eq!(
            fs::read_to_string(shared.join("c1/mounts/1")).unwrap(),
            "127.0.0.1 localhost\n"
        );
        assert!(
            fs::write(shared.join("c1/mounts/1"), "x").is_err(),
            "read-only bind"
        );
        fs::write(shared.join("c1/mounts/2/new"), "w").unwrap();
        assert!(vol.join("new").exists());
        assert_eq!(mounts_under(&container_dir(&state, "c1")).len(), 3);

        unshare_container(&state, "c1").unwrap();
        assert!(mounts_under(tmp.path()).is_empty());
        assert!(!container_dir(&state, "c1").exists());
        assert!(lower.join("hello").exists() && hosts.exists() && vol.join("new").exists());
        unshare_container(&state, "c1").unwrap();
        state.cleanup().unwrap();
    }

    #[test]
    fn a_failed_share_undoes_what_it_mounted() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::new(tmp.path(), "pod").unwrap();
        state.create(std::process::id()).unwrap();
        let image = tmp.path().join("image");
        fs::create_dir_all(&image).unwrap();
        let binds = [ShareBind {
            host_source: tmp.path().join("missing"),
            relative: "c2/mounts/0".into(),
            readonly: false,
            from_host: false,
        }];
        let err = share_container(&state, "c2", &[], &image, &binds)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        assert!(mounts_under(tmp.path()).is_empty());
        assert!(!container_dir(&state, "c2").exists());
        state.cleanup().unwrap();
    }
}
