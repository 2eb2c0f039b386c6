//! The QEMU backend's processes and files: the work dir's sockets and logs ([`VmPaths`]),
//! the guest console's copy into a bounded log ([`ConsolePump`]), children tied to the
//! spawning thread, and their bounded termination.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use vmm::console_log::ConsoleLog;

use super::{
    disk_fd, QemuConfig, QemuDisk, QemuError, QemuNic, CONSOLE_FD, MAX_DISKS, MAX_NICS,
    MAX_SOCKET_PATH, NIC_FD_BASE, POLL, TERM_GRACE,
};

/// How long a dropped [`ConsolePump`] lets its thread copy what QEMU left in the socket.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);

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
    /// the VM's jail id ([`super::vsock_uds_in`]).
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
        let vsock_uds = super::vsock_uds_in(&cfg.work_dir);
        let vsock_dir = cfg.work_dir.join(super::VSOCK_DIR);
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

/// The guest's serial console under QEMU: QEMU writes it to its end of a socket pair
/// (`-chardev socket,fd=`[`CONSOLE_FD`]), and a thread copies the other end into a bounded
/// [`ConsoleLog`], so a guest flooding its console keeps the host's disk use fixed. The thread
/// ends at the socket's EOF (QEMU gone) or when the pump is dropped.
#[derive(Debug)]
pub(super) struct ConsolePump {
    /// QEMU's end, until it has been handed to QEMU.
    qemu_end: Option<UnixStream>,
    /// A handle on our end, to end a copy that QEMU's exit did not end.
    ours: UnixStream,
    bytes: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl ConsolePump {
    /// Creates the console log at `path` (at most `max_bytes`) and starts the copy.
    pub(super) fn start(path: &Path, max_bytes: u64) -> Result<Self, QemuError> {
        let create_err = |source| QemuError::CreateFile {
            path: path.to_path_buf(),
            source,
        };
        let mut log = ConsoleLog::create(path, max_bytes).map_err(create_err)?;
        let (ours, qemu_end) = UnixStream::pair().map_err(create_err)?;
        let mut reader = ours.try_clone().map_err(create_err)?;
        let bytes = Arc::new(AtomicU64::new(0));
        let counted = bytes.clone();
        let thread = thread::Builder::new()
            .name("microvm-console".into())
            .spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = match reader.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    };
                    if let Err(e) = log.write_all(&buf[..n]) {
                        vmm::limited!(log::Level::Warn, "writing the guest console log: {e}");
                    }
                    counted.fetch_add(n as u64, Ordering::Relaxed);
                }
            })
            .map_err(create_err)?;
        Ok(ConsolePump {
            qemu_end: Some(qemu_end),
            ours,
            bytes,
            thread: Some(thread),
        })
    }

    /// QEMU's end, to pass as [`CONSOLE_FD`] (-1 once released).
    pub(super) fn qemu_fd(&self) -> RawFd {
        self.qemu_end.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// Closes our copy of QEMU's end once QEMU holds its own: its exit then ends the copy.
    pub(super) fn release_qemu_end(&mut self) {
        self.qemu_end = None;
    }

    /// Bytes the guest has written to its console so far.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// A copy of QEMU's end, for a test to write as QEMU would.
    #[cfg(test)]
    pub(super) fn qemu_end_for_test(&self) -> UnixStream {
        self.qemu_end
            .as_ref()
            .expect("not released")
            .try_clone()
            .expect("dup")
    }
}

impl Drop for ConsolePump {
    fn drop(&mut self) {
        self.qemu_end = None;
        let Some(thread) = self.thread.take() else {
            return;
        };
        // QEMU is gone when its VM is dropped: what it left is copied, then EOF ends the
        // thread. A copy still running after the grace is ended.
        let deadline = Instant::now() + CONSOLE_DRAIN;
        while !thread.is_finished() && Instant::now() < deadline {
            thread::sleep(POLL);
        }
        let _ = self.ours.shutdown(Shutdown::Both);
        let _ = thread.join();
    }
}

pub(super) fn create_file(path: &Path) -> Result<File, QemuError> {
    File::create(path).map_err(|source| QemuError::CreateFile {
        path: path.to_path_buf(),
        source,
    })
}

/// Gives the child the NICs' taps as fds [`NIC_FD_BASE`].., the disks' files as fds
/// [`disk_fd`]`(i)` and `console` (unless negative) as [`CONSOLE_FD`] (dup2 clears
/// close-on-exec on the copy only; the shim's own fds stay close-on-exec).
pub(super) fn pass_fds(cmd: &mut Command, nics: &[QemuNic], disks: &[QemuDisk], console: RawFd) {
    const MAX: usize = MAX_NICS + MAX_DISKS + 1;
    let mut pairs: Vec<(RawFd, RawFd)> = nics
        .iter()
        .enumerate()
        .map(|(i, n)| (n.tap.as_raw_fd(), NIC_FD_BASE + i as RawFd))
        .collect();
    pairs.extend(
        disks
            .iter()
            .enumerate()
            .map(|(i, d)| (d.file.as_raw_fd(), disk_fd(i))),
    );
    pairs.truncate(MAX - 1);
    if console >= 0 {
        pairs.push((console, CONSOLE_FD));
    }
    if pairs.is_empty() {
        return;
    }
    // SAFETY: the closure runs in the forked child before exec; fcntl and dup2 are
    // async-signal-safe, the source fds are open (the `Arc`s in `nics` and `disks`, and the
    // console pump holding `console`, outlive the spawn) and the vector was allocated before the fork, so nothing allocates or locks here.
    unsafe {
        cmd.pre_exec(move || {
            // First above the target range (a source may sit where another copy goes, or at its
            // own target, where dup2 would keep close-on-exec), then into place.
            let above = NIC_FD_BASE + MAX as RawFd;
            let mut moved = [-1; MAX];
            for (slot, (fd, _)) in moved.iter_mut().zip(&pairs) {
                *slot = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, above);
                if *slot < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (tmp, (_, target)) in moved.iter().zip(&pairs) {
                if libc::dup2(*tmp, *target) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Who a helper process runs as.
#[derive(Debug, Clone, Copy)]
pub(super) enum HelperIds {
    /// Root (virtiofsd, which drops capabilities itself), with a capability bounding set of
    /// only these (bit n: capability n) and at most this many files (`RLIMIT_NOFILE`, never
    /// above the shim's own hard limit).
    Root { bounding: u64, max_files: u64 },
    /// The VM's jail id as uid, gid and only group: no capability left.
    #[cfg_attr(
        not(test),
        expect(
            dead_code,
            reason = "the helpers that run as the jail id confine themselves further (QEMU's -runas, vhost-device-vsock's backend_jail); the unit tests confine with this alone"
        )
    )]
    Jail(u32),
}

/// The capabilities virtiofsd may ever hold: what it keeps to serve the guest's files
/// ([`super::VIRTIOFSD_KEPT_CAPS`]) and what it uses once at its start, before it has a thread
/// besides its main one or reads anything of the guest's (`sys_chroot` for `--sandbox chroot`,
/// `setpcap` for emptying its bounding set as it drops the rest). Nothing else is there to
/// keep: no `dac_read_search` (`--inode-file-handles=never`), no `sys_admin` (no
/// `--sandbox namespace`), no `sys_resource` (the shim sets its file limit).
pub(super) const VIRTIOFSD_BOUNDING: u64 = {
    // linux/capability.h
    const CHOWN: u32 = 0;
    const DAC_OVERRIDE: u32 = 1;
    const FOWNER: u32 = 3;
    const SETGID: u32 = 6;
    const SETUID: u32 = 7;
    const SETPCAP: u32 = 8;
    const SYS_CHROOT: u32 = 18;
    (1 << CHOWN)
        | (1 << DAC_OVERRIDE)
        | (1 << FOWNER)
        | (1 << SETGID)
        | (1 << SETUID)
        | (1 << SETPCAP)
        | (1 << SYS_CHROOT)
};

/// virtiofsd's `RLIMIT_NOFILE` at most: what it used to raise its own limit to (it holds a
/// file per inode the guest looks up); the shim sets it (within its own hard limit) so that
/// virtiofsd needs no `CAP_SYS_RESOURCE`.
pub(super) const VIRTIOFSD_MAX_FILES: u64 = 1_000_000;

/// Confines a helper of the VM before it runs: new network, IPC and UTS namespaces (it needs
/// none of the host's: its sockets are Unix sockets by path), the jail id or a capability
/// bounding set and file limit ([`HelperIds`]), and `no_new_privs`. Register it before [`spawn_tied_to_parent`]'s hook: a change of uid clears
/// the parent-death signal, so that must be set after.
pub(super) fn confine_helper(cmd: &mut Command, ids: HelperIds) {
    // The file limit is only ever lowered (raising it past the shim's own hard limit may be
    // refused, e.g. under a containerd whose limit is lower): read before the fork.
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the rlimit we own.
    let have_limit = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut current) } == 0;
    // SAFETY: the closure runs in the forked child before exec and makes only raw system calls
    // (unshare, setgroups, setresgid, setresuid, setrlimit, prctl), which are async-signal-safe; it
    // allocates nothing and takes no lock. The set*id calls are the raw system calls, not
    // glibc's wrappers, which would try to signal the parent's other threads.
    unsafe {
        cmd.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS) != 0 {
                return Err(io::Error::last_os_error());
            }
            match ids {
                HelperIds::Jail(id) => {
                    let id = id as libc::c_long;
                    let no_groups = std::ptr::null::<libc::gid_t>();
                    if libc::syscall(libc::SYS_setgroups, 0 as libc::c_long, no_groups) != 0
                        || libc::syscall(libc::SYS_setresgid, id, id, id) != 0
                        || libc::syscall(libc::SYS_setresuid, id, id, id) != 0
                    {
                        return Err(io::Error::last_os_error());
                    }
                }
                HelperIds::Root {
                    bounding,
                    max_files,
                } => {
                    if have_limit {
                        let files = max_files.min(current.rlim_max);
                        let limit = libc::rlimit {
                            rlim_cur: files,
                            rlim_max: files,
                        };
                        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                            return Err(io::Error::last_os_error());
                        }
                    }
                    for cap in 0..64u32 {
                        if bounding & (1 << cap) != 0 {
                            continue;
                        }
                        // EINVAL: past the kernel's last capability.
                        if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0
                            && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
                        {
                            return Err(io::Error::last_os_error());
                        }
                    }
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Spawns `cmd` so that the kernel sends it SIGKILL when the spawning thread exits (unless it
/// changes its credentials later, as QEMU's `-runas` does: the VM's init covers that). The
/// thread has entered the VM's PID namespace ([`super::init::PodInit::enter`]).
pub(super) fn spawn_tied_to_parent(cmd: &mut Command, binary: &Path) -> Result<Child, QemuError> {
    tie_to_parent(cmd);
    cmd.spawn().map_err(|source| QemuError::Spawn {
        binary: binary.to_path_buf(),
        source,
    })
}

/// [`spawn_tied_to_parent`]'s pre-exec step alone, for a caller with a step of its own to come
/// after it (vhost-device-vsock's exec through its descriptor, [`super::backend_jail`]).
pub(super) fn tie_to_parent(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and calls only async-signal-safe
    // functions (prctl, getppid, _exit); it touches no locks or allocations.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl: then no signal would come. The
            // parent is outside the child's PID namespace, where getppid says 0; had it died,
            // the child would have been given to the namespace's init (1).
            if libc::getppid() != 0 {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// SIGTERM, a bounded wait, then SIGKILL; always reaps.
pub(super) fn terminate(child: &mut Child, binary: &Path) -> Result<ExitStatus, QemuError> {
    let pid = child.id();
    let wait_err = |source| QemuError::Wait {
        binary: binary.to_path_buf(),
        pid,
        source,
    };
    if let Some(status) = child.try_wait().map_err(wait_err)? {
        return Ok(status);
    }
    signal(child, libc::SIGTERM);
    let deadline = Instant::now() + TERM_GRACE;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().map_err(wait_err)? {
            return Ok(status);
        }
        thread::sleep(POLL);
    }
    let _ = child.kill();
    child.wait().map_err(wait_err)
}

fn signal(child: &Child, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return;
    };
    // SAFETY: `child` has not been reaped (we hold it and only reap through it), so `pid` is
    // still our child, not a recycled pid.
    unsafe { libc::kill(pid, sig) };
}

pub(super) fn kill_and_reap(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of a (small) log file; empty if unreadable.
pub(super) fn tail_of_file(path: &Path, lines: usize) -> String {
    let Ok(bytes) = fs::read(path) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
