//! The files of one QEMU VM in its work dir ([`VmPaths`]): the vhost-user and hybrid-vsock
//! sockets, the helpers' stderr logs, the console log, the vsock folder handed to the VM's jail
//! id and QEMU's empty chroot; made before the VM starts and removed on every path after it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::config::QemuConfig;
use super::error::{QemuError, MAX_SOCKET_PATH};

/// Where a VM started in `work_dir` has its hybrid-vsock socket: in a folder of its own that the
/// jailed vhost-device-vsock may write (it binds its sockets there), so that nothing else in
/// the work dir is writable by it. Listeners the caller binds at `<uds>_<port>` before
/// `QemuVm::start` are handed to the VM's id when it starts.
pub fn vsock_uds_in(work_dir: &Path) -> PathBuf {
    work_dir.join(VSOCK_DIR).join("vsock.sock")
}

/// The folder of [`vsock_uds_in`].
const VSOCK_DIR: &str = "vsock";

/// The files of one VM in its work dir.
#[derive(Debug, Clone)]
pub(super) struct VmPaths {
    /// vhost-user control socket between QEMU and vhost-device-vsock.
    pub(super) vhost_socket: PathBuf,
    /// The hybrid-vsock host socket.
    pub(super) vsock_uds: PathBuf,
    /// vhost-user socket between QEMU and virtiofsd.
    pub(super) virtiofs_socket: PathBuf,
    /// The pid file virtiofsd writes (and locks) beside its socket.
    pub(super) virtiofsd_pid_file: PathBuf,
    pub(super) qemu_stderr: PathBuf,
    pub(super) backend_stderr: PathBuf,
    pub(super) virtiofsd_stderr: PathBuf,
    pub(super) console_log: PathBuf,
    /// The folder of the two vsock sockets and the caller's `<uds>_<port>` listeners, handed to
    /// the VM's jail id ([`vsock_uds_in`]).
    pub(super) vsock_dir: PathBuf,
    /// QEMU's chroot: an empty, root-owned, read-only folder.
    pub(super) jail_root: PathBuf,
    /// Whether `console_log` is ours to remove.
    pub(super) console_is_ours: bool,
    pub(super) work_dir: PathBuf,
    /// Whether we created the work dir (then it is removed when empty).
    pub(super) work_dir_is_ours: bool,
}

impl VmPaths {
    pub(super) fn new(cfg: &QemuConfig) -> Result<Self, QemuError> {
        let work_dir_is_ours = !cfg.work_dir.exists();
        fs::create_dir_all(&cfg.work_dir).map_err(|source| QemuError::CreateFile {
            path: cfg.work_dir.clone(),
            source,
        })?;
        let console_is_ours = cfg.console_log.is_none();
        let vsock_uds = vsock_uds_in(&cfg.work_dir);
        let vsock_dir = cfg.work_dir.join(VSOCK_DIR);
        let paths = VmPaths {
            vhost_socket: vsock_dir.join("vhost-user.sock"),
            vsock_uds,
            virtiofs_socket: cfg.work_dir.join("virtiofsd.sock"),
            virtiofsd_pid_file: cfg.work_dir.join("virtiofsd.sock.pid"),
            qemu_stderr: cfg.work_dir.join("qemu.stderr"),
            backend_stderr: cfg.work_dir.join("vhost-device-vsock.stderr"),
            virtiofsd_stderr: cfg.work_dir.join("virtiofsd.stderr"),
            console_log: cfg
                .console_log
                .clone()
                .unwrap_or_else(|| cfg.work_dir.join("console.log")),
            console_is_ours,
            jail_root: cfg.work_dir.join("qemu-root"),
            vsock_dir,
            work_dir: cfg.work_dir.clone(),
            work_dir_is_ours,
        };
        for sock in [
            &paths.vhost_socket,
            &paths.vsock_uds,
            &paths.virtiofs_socket,
        ] {
            let len = sock.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                paths.remove_all();
                return Err(QemuError::SocketPathTooLong {
                    path: sock.clone(),
                    len,
                });
            }
        }
        // Leftovers of a VM that died with its parent: the sockets are re-created below.
        for stale in [
            &paths.vhost_socket,
            &paths.vsock_uds,
            &paths.virtiofs_socket,
            &paths.virtiofsd_pid_file,
        ] {
            let _ = fs::remove_file(stale);
        }
        if let Err(e) = paths.make_folders() {
            paths.remove_all();
            return Err(e);
        }
        Ok(paths)
    }

    /// The vsock folder (root's until [`VmPaths::hand_vsock_dir_to`]) and QEMU's empty chroot
    /// (0555, root's: QEMU, once it is the jail id, can neither write nor leave it).
    fn make_folders(&self) -> Result<(), QemuError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let create = |path: &Path, mode: u32| -> Result<(), QemuError> {
            let err = |source| QemuError::CreateFile {
                path: path.to_path_buf(),
                source,
            };
            match fs::DirBuilder::new().mode(mode).create(path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(err(e)),
            }
            // The work dir is root's and nobody else's: these are the folders just made (or a
            // dead VM's of this work dir), never a link.
            let meta = fs::symlink_metadata(path).map_err(err)?;
            if !meta.is_dir() {
                return Err(err(io::Error::other("not a folder")));
            }
            fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(err)
        };
        create(&self.vsock_dir, 0o700)?;
        create(&self.jail_root, 0o555)?;
        if fs::read_dir(&self.jail_root)
            .map_err(|source| QemuError::CreateFile {
                path: self.jail_root.clone(),
                source,
            })?
            .next()
            .is_some()
        {
            return Err(QemuError::CreateFile {
                path: self.jail_root.clone(),
                source: io::Error::other("QEMU's chroot must be empty"),
            });
        }
        Ok(())
    }

    /// Gives the vsock folder, and the listeners the caller bound in it, to the VM's jail id
    /// (vhost-device-vsock binds its sockets there and connects to the listeners). Nothing of
    /// that id runs yet; entries are changed without following links.
    pub(super) fn hand_vsock_dir_to(&self, id: u32) -> Result<(), QemuError> {
        use rustix::fs::{chownat, AtFlags, Gid, Uid};
        let err = |path: &Path, source: io::Error| QemuError::Jail {
            path: path.to_path_buf(),
            id,
            source,
        };
        let dir = rustix::fs::open(
            &self.vsock_dir,
            rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::NOFOLLOW
                | rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| err(&self.vsock_dir, e.into()))?;
        let owner = (Some(Uid::from_raw(id)), Some(Gid::from_raw(id)));
        rustix::fs::fchown(&dir, owner.0, owner.1).map_err(|e| err(&self.vsock_dir, e.into()))?;
        let entries = fs::read_dir(&self.vsock_dir).map_err(|e| err(&self.vsock_dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| err(&self.vsock_dir, e))?;
            chownat(
                &dir,
                entry.file_name().as_os_str(),
                owner.0,
                owner.1,
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| err(&entry.path(), e.into()))?;
        }
        Ok(())
    }

    /// Removes the sockets (once the VM has ended nobody can use them).
    pub(super) fn remove_sockets(&self) {
        for f in [&self.vhost_socket, &self.vsock_uds, &self.virtiofs_socket] {
            let _ = fs::remove_file(f);
        }
    }

    /// Removes every file we created (the caller's console log excepted).
    pub(super) fn remove_all(&self) {
        let mut files = vec![
            &self.vhost_socket,
            &self.vsock_uds,
            &self.virtiofs_socket,
            &self.virtiofsd_pid_file,
            &self.qemu_stderr,
            &self.backend_stderr,
            &self.virtiofsd_stderr,
        ];
        let previous_console = vmm::console_log::previous_path(&self.console_log);
        if self.console_is_ours {
            files.push(&self.console_log);
            files.push(&previous_console);
        }
        for f in files {
            let _ = fs::remove_file(f);
        }
        // Only when empty: a listener of the caller's may still be there (it removes it).
        let _ = fs::remove_dir(&self.vsock_dir);
        let _ = fs::remove_dir(&self.jail_root);
        if self.work_dir_is_ours {
            // Only succeeds when empty: files others put there are never removed.
            let _ = fs::remove_dir(&self.work_dir);
        }
    }
}
