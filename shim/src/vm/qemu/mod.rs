//! The QEMU backend: boots our guest kernel and initrd under Debian's `qemu-system-x86_64`
//! (`-M microvm`), with the guest's vsock device served by `vhost-device-vsock` over vhost-user.
//!
//! vhost-device-vsock speaks the same hybrid-vsock protocol as our VMM on its host Unix socket
//! ([`QemuVm::vsock_uds_path`]): connect, write `CONNECT <port>\n`, read `OK <port>\n`; guest
//! connections to host port P go to `<uds>_<P>`. So the agent is reached exactly as under our VMM.
//! This is how Linux guests run on hosts whose KVM cannot boot them (kvm-pvm, no KVM): QEMU's
//! software emulation (TCG). See docs/qemu-backend.md for the command line and timings.
//!
//! Start-up order: vhost-device-vsock first (QEMU connects to its vhost-user socket while it
//! realizes the device, so the socket must exist), then QEMU. [`QemuVm::start`] returns once the
//! guest has written to its serial console, i.e. the kernel runs. Every child is killed and reaped
//! and every file this module created is removed on every path: failed start, [`QemuVm::stop`],
//! and drop. The children run in a PID namespace of the VM's own whose init ([`init`], the
//! running binary's `__pod-init`) gets SIGKILL from the kernel when the thread that started it
//! exits (`PR_SET_PDEATHSIG` is tied to the spawning *thread*): then the kernel kills every
//! process of the namespace, whatever its uid. Start a VM from a thread that outlives it.

use std::fs;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

mod backend_jail;
mod cmdline;
mod config;
pub mod init;
mod process;

use backend_jail::BackendJail;
pub use backend_jail::BackendJailError;
pub use cmdline::host_tsc_khz;
use cmdline::{kernel_cmdline, qemu_args};
pub use config::{
    disk_fd, QemuConfig, QemuDisk, QemuNic, QemuSharedFs, CONSOLE_FD, MAX_DISKS, MAX_NICS,
    NIC_FD_BASE,
};
use init::{PodInit, PodInitError};
use process::{
    confine_helper, create_file, kill_and_reap, pass_fds, spawn_tied_to_parent, tail_of_file,
    terminate, tie_to_parent, ConsolePump, HelperIds, VmPaths,
};
/// Longest path a Unix socket address holds (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;
/// How often child processes and files are polled while waiting.
const POLL: Duration = Duration::from_millis(10);
/// How long vhost-device-vsock may take to create its vhost-user socket.
const BACKEND_SOCKET_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a child gets to exit after SIGTERM before it gets SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(3);
/// Lines of stderr / console carried in errors.
const TAIL_LINES: usize = 20;
/// Bytes of the console's end read for an error message.
const CONSOLE_TAIL_BYTES: usize = 4096;
/// The kernel's default `CONFIG_HZ` (Kconfig `HZ_250`), used when the kernel's config is not
/// found beside it.
const DEFAULT_HZ: u64 = 250;

/// The QEMU binary, looked up on PATH.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";

/// The first uid (and gid) of the range the QEMU backend's guest-facing processes run as
/// (`[qemu] jail_id_base`): a process's VMs get `base + its pid` ([`jail_id`]). No passwd entry
/// is needed; nothing else on the node may use the range.
pub const DEFAULT_JAIL_ID_BASE: u32 = 2_000_000_000;

/// How many ids the range holds: Linux's largest pid (`PID_MAX_LIMIT` on 64-bit), so that every
/// shim process (one per pod) gets an id of its own.
pub const JAIL_ID_RANGE: u32 = 1 << 22;

/// The uid and gid of this process's VMs: `base` + this process's pid, so two pods' QEMUs never
/// share an id (one shim process per pod). `None` when the range would pass `u32::MAX - 1`
/// (`(uid_t)-1` means "unchanged" to the kernel) or `base` is 0.
pub fn jail_id(base: u32) -> Option<u32> {
    if base == 0 || base.checked_add(JAIL_ID_RANGE)? == u32::MAX {
        return None;
    }
    Some(base + std::process::id() % JAIL_ID_RANGE)
}

/// Where a VM started in `work_dir` has its hybrid-vsock socket: in a folder of its own that the
/// jailed vhost-device-vsock may write (it binds its sockets there), so that nothing else in
/// the work dir is writable by it. Listeners the caller binds at `<uds>_<port>` before
/// [`QemuVm::start`] are handed to the VM's id when it starts.
pub fn vsock_uds_in(work_dir: &Path) -> PathBuf {
    work_dir.join(VSOCK_DIR).join("vsock.sock")
}

/// The folder of [`vsock_uds_in`].
const VSOCK_DIR: &str = "vsock";

/// QEMU's seccomp filter (`-sandbox`): the obsolete system calls, spawning processes and
/// changing scheduling or resource limits are refused. `elevateprivileges=deny` is left out: it
/// also refuses the set*id calls of QEMU's own `-runas`, which kill QEMU (SIGSYS) at its drop to
/// the jail id; after that drop QEMU has no capability, every uid and gid it holds is the jail
/// id and `no_new_privs` is set, so a set*id call can gain nothing.
pub const QEMU_SANDBOX: &str = "on,obsolete=deny,spawn=deny,resourcecontrol=deny";

/// The vhost-device-vsock version scripts/install-vhost-device-vsock.sh installs.
pub const VHOST_DEVICE_VSOCK_VERSION: &str = "0.3.0";

/// Where scripts/install-vhost-device-vsock.sh puts the binary (a static PIE: it runs with its
/// vsock folder as its root, [`backend_jail`]): `MICROVM_VHOST_VSOCK` if set, else
/// `${MICROVM_CACHE:-/var/cache/microvm}/vhost-device-vsock-0.3.0-static/bin/vhost-device-vsock`.
pub fn default_vhost_vsock_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MICROVM_VHOST_VSOCK").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    cache_dir()
        .join(format!(
            "vhost-device-vsock-{VHOST_DEVICE_VSOCK_VERSION}-static"
        ))
        .join("bin/vhost-device-vsock")
}

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// KVM where it rests on VMX/SVM (on bare metal, nested, or SVM emulated by QEMU's TCG one
    /// level down), TCG otherwise: kvm-pvm cannot boot a stock Linux guest.
    Auto,
    /// `-accel kvm -cpu host`.
    Kvm,
    /// `-accel tcg`: software emulation, works everywhere.
    Tcg,
}

impl Accel {
    /// Resolves [`Accel::Auto`] for this host (`host_check::qemu_accel_for`).
    pub fn resolve(self) -> Accel {
        match self {
            Accel::Auto => crate::host_check::qemu_accel_for(crate::host_check::kvm_kind().0),
            other => other,
        }
    }
}

/// Errors of the QEMU backend; each names the binary or file concerned.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("invalid QEMU VM config: {0}")]
    InvalidConfig(String),
    #[error("cannot read the {what} {path}: {source}")]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot create {path}: {source}")]
    CreateFile { path: PathBuf, source: io::Error },
    #[error("socket path {path} is {len} bytes; a Unix socket path holds at most {MAX_SOCKET_PATH}: use a shorter work dir")]
    SocketPathTooLong { path: PathBuf, len: usize },
    #[error("cannot start {binary}: {source}")]
    Spawn { binary: PathBuf, source: io::Error },
    #[error(transparent)]
    BackendJail(#[from] BackendJailError),
    #[error("cannot start {binary} in its jail: {source}; its stderr ends with:\n{stderr}")]
    BackendJailSpawn {
        binary: PathBuf,
        source: io::Error,
        stderr: String,
    },
    #[error("{binary} exited ({status}) before creating its socket {socket}; its stderr ends with:\n{stderr}")]
    BackendExited {
        binary: PathBuf,
        status: ExitStatus,
        socket: PathBuf,
        stderr: String,
    },
    #[error("{binary} exited ({status}) before creating its socket {socket} (the QEMU backend runs the Rust virtiofsd, scripts/install-virtiofsd.sh; QEMU 7.2's C virtiofsd takes other options and is not supported); its stderr ends with:\n{stderr}")]
    VirtiofsdExited {
        binary: PathBuf,
        status: ExitStatus,
        socket: PathBuf,
        stderr: String,
    },
    #[error("{binary} did not create its socket {socket} within {timeout:?}; its stderr ends with:\n{stderr}")]
    BackendTimeout {
        binary: PathBuf,
        socket: PathBuf,
        timeout: Duration,
        stderr: String,
    },
    #[error("{binary} exited ({status}) before the guest wrote to its console; stderr ends with:\n{stderr}\nconsole ends with:\n{console}")]
    QemuExitedEarly {
        binary: PathBuf,
        status: ExitStatus,
        stderr: String,
        console: String,
    },
    #[error("{binary}: the guest wrote nothing to its console ({console_log}) within {timeout:?}; stderr ends with:\n{stderr}")]
    StartTimeout {
        binary: PathBuf,
        console_log: PathBuf,
        timeout: Duration,
        stderr: String,
    },
    #[error("{binary} exited ({status}) while waiting for {needle:?} on the console; console ends with:\n{console}")]
    ExitedWhileWaiting {
        binary: PathBuf,
        status: ExitStatus,
        needle: String,
        console: String,
    },
    #[error("{needle:?} did not appear on the guest console within {timeout:?}; console ends with:\n{console}")]
    ConsoleTimeout {
        needle: String,
        timeout: Duration,
        console: String,
    },
    #[error("cannot prepare {path} for the VM's jail id {id}: {source}")]
    Jail {
        path: PathBuf,
        id: u32,
        source: io::Error,
    },
    #[error(transparent)]
    Init(#[from] PodInitError),
    #[error("cannot wait for {binary} (pid {pid}): {source}")]
    Wait {
        binary: PathBuf,
        pid: u32,
        source: io::Error,
    },
}

/// Capabilities virtiofsd gives up (`--modcaps`): of its default set (`chown`, `dac_override`,
/// `fowner`, `fsetid`, `setgid`, `setuid`, `mknod`, `setfcap`) no device nodes but the 0:0
/// overlay whiteout (`mknod`), no file capabilities (`setfcap`), and set-ID bits cleared on every
/// write and truncate (`fsetid`). It keeps `chown`, `dac_override`, `fowner`, `setgid` and
/// `setuid`, which serving guest root's files as their owners needs ([`VIRTIOFSD_KEPT_CAPS`]).
pub const VIRTIOFSD_MODCAPS: &str = "-mknod:-setfcap:-fsetid";

/// The capabilities virtiofsd's every thread holds once it serves (bit n: capability n of
/// linux/capability.h): `chown`, `dac_override`, `fowner`, `setgid`, `setuid`.
pub const VIRTIOFSD_KEPT_CAPS: u64 = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 6) | (1 << 7);

/// The virtiofsd version scripts/install-virtiofsd.sh installs: the Rust virtiofsd (crates.io
/// `virtiofsd`), which loads its seccomp filter and drops its capabilities before it starts any
/// thread. QEMU 7.2's C virtiofsd (`/usr/lib/qemu/virtiofsd`) is no longer supported: it starts
/// a thread before its filter that keeps every capability it began with (docs/security.md).
pub const VIRTIOFSD_VERSION: &str = "1.14.0";

/// The cache scripts/install-*.sh install into: `MICROVM_CACHE` if set, else
/// `/var/cache/microvm`.
fn cache_dir() -> PathBuf {
    std::env::var_os("MICROVM_CACHE")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/microvm"))
}

/// Where scripts/install-virtiofsd.sh puts the binary: `MICROVM_VIRTIOFSD` if set, else
/// `${MICROVM_CACHE:-/var/cache/microvm}/virtiofsd-1.14.0/bin/virtiofsd`.
pub fn default_virtiofsd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MICROVM_VIRTIOFSD").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    cache_dir()
        .join(format!("virtiofsd-{VIRTIOFSD_VERSION}"))
        .join("bin/virtiofsd")
}

/// The Rust virtiofsd's command line for `source` on `socket` (docs/qemu-backend.md has each
/// option against the C virtiofsd's it replaces):
/// - `--sandbox=chroot`: it serves from the host's mount namespace, so the mounts the shim makes
///   under the directory later (container rootfs, volumes) are seen, and their unmounts too.
///   `--sandbox=namespace` serves from a private copy of the mount namespace, which sees later
///   mounts only through mount propagation (none on hosts whose `/` is private) and would keep
///   unmounted container mounts alive; it also needs `sys_admin` at its start.
/// - `--seccomp=kill`: a system call outside its filter kills the process (its default, made
///   explicit). The filter and the capability drop come before its first thread.
/// - `--inode-file-handles=never`: file handles would add `dac_read_search` to the kept
///   capabilities, and with it `open_by_handle_at`, which opens any inode of the share's file
///   systems whatever the chroot.
/// - `--modcaps`: [`VIRTIOFSD_MODCAPS`].
/// - no `--xattr`, `--posix-acl`, `--security-label` or `--xattrmap`: every SETXATTR is refused,
///   `security.capability` included.
/// - `--no-announce-submounts`: the guest sees the share as one file system, as before (its
///   kernel makes no automount per host mount point).
/// - `--rlimit-nofile=0`: the limit the shim set is kept (its capability bounding set has no
///   `CAP_SYS_RESOURCE`).
/// - `--cache=auto`, `--log-level=warn`.
///
/// What it cannot refuse: `chmod u+s`/`g+s` and set-ID modes at creation (docs/qemu-backend.md).
pub fn virtiofsd_args(socket: &Path, source: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "--shared-dir".into(),
        source.into(),
        "--socket-path".into(),
        socket.into(),
    ];
    let modcaps = format!("--modcaps={VIRTIOFSD_MODCAPS}");
    for opt in [
        "--sandbox=chroot",
        "--seccomp=kill",
        "--inode-file-handles=never",
        modcaps.as_str(),
        "--no-announce-submounts",
        "--cache=auto",
        // The shim sets its file limit (process.rs VIRTIOFSD_MAX_FILES): raising it would need
        // a capability it does not get.
        "--rlimit-nofile=0",
        "--log-level=warn",
    ] {
        args.push(opt.into());
    }
    args
}

/// A running guest under QEMU with its vsock backend. Dropping it kills and reaps both
/// processes and removes its sockets and logs (a caller-named console log excepted).
#[derive(Debug)]
pub struct QemuVm {
    /// PID 1 of the namespace the processes below run in (dropped after them).
    init: Option<PodInit>,
    qemu: Option<Child>,
    backend: Option<Child>,
    virtiofsd: Option<Child>,
    qemu_binary: PathBuf,
    backend_binary: PathBuf,
    virtiofsd_binary: PathBuf,
    paths: VmPaths,
    /// The copy of the guest's console into its bounded log, once QEMU is started.
    console: Option<ConsolePump>,
    exit_status: Option<ExitStatus>,
    cmdline: String,
    qemu_args: Vec<String>,
}

impl QemuVm {
    /// Starts vhost-device-vsock, then QEMU, and returns once the guest has written to its
    /// console. On any error everything started so far is killed, reaped and removed.
    pub fn start(cfg: QemuConfig) -> Result<QemuVm, QemuError> {
        cfg.validate()?;
        let paths = VmPaths::new(&cfg)?;
        let mut vm = QemuVm {
            init: None,
            qemu: None,
            backend: None,
            virtiofsd: None,
            qemu_binary: cfg.qemu_binary.clone(),
            backend_binary: cfg.vhost_vsock_binary.clone(),
            virtiofsd_binary: cfg.virtiofsd_binary.clone(),
            paths,
            console: None,
            exit_status: None,
            cmdline: kernel_cmdline(&cfg),
            qemu_args: Vec::new(),
        };
        // On error `vm` is dropped here, which kills, reaps and removes.
        vm.init = Some(PodInit::start(&cfg.init_binary, &cfg.work_dir)?);
        vm.start_backend(&cfg)?;
        vm.start_virtiofsd(&cfg)?;
        vm.start_qemu(&cfg)?;
        vm.wait_for_first_output(cfg.start_timeout)?;
        Ok(vm)
    }

    fn start_backend(&mut self, cfg: &QemuConfig) -> Result<(), QemuError> {
        // Its paths relative to the vsock folder, its root ([`backend_jail`]). Its argv[0]
        // names that folder, so that `ps` (and a search for the pod's processes by their
        // command line) still tells which VM it serves.
        let name = |p: &Path| p.file_name().map(PathBuf::from).unwrap_or_default();
        let arg0 = self.paths.vsock_dir.join(name(&cfg.vhost_vsock_binary));
        let (socket, uds) = (name(&self.paths.vhost_socket), name(&self.paths.vsock_uds));
        let cid = cfg.guest_cid.to_string();
        // The binary opened and checked, the arguments and the filter made: before the fork.
        let jail = BackendJail::new(
            &cfg.vhost_vsock_binary,
            &self.paths.vsock_dir,
            &[
                arg0.as_os_str(),
                "--socket".as_ref(),
                socket.as_os_str(),
                "--uds-path".as_ref(),
                uds.as_os_str(),
                "--guest-cid".as_ref(),
                cid.as_ref(),
            ],
            cfg.jail_id,
        )?;
        let stderr = create_file(&self.paths.backend_stderr)?;
        // The program is never looked up: the last pre-exec step executes the opened binary.
        let mut cmd = Command::new(&cfg.vhost_vsock_binary);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        self.paths.hand_vsock_dir_to(cfg.jail_id)?;
        // The jail, then the parent-death signal (the drop to the jail id would clear it),
        // then the filter and the exec.
        jail.enter(&mut cmd);
        tie_to_parent(&mut cmd);
        jail.exec_last(&mut cmd);
        let spawned = {
            let init = self.init.as_ref().ok_or_else(|| {
                QemuError::InvalidConfig("the VM's processes start after its init".into())
            })?;
            let _entered = init.enter()?;
            cmd.spawn()
        };
        self.backend = Some(spawned.map_err(|source| QemuError::BackendJailSpawn {
            binary: self.backend_binary.clone(),
            source,
            stderr: tail_of_file(&self.paths.backend_stderr, TAIL_LINES),
        })?);
        let deadline = Instant::now() + BACKEND_SOCKET_TIMEOUT;
        loop {
            // It binds the hybrid-vsock socket first, then the vhost-user socket it serves on.
            if self.paths.vhost_socket.exists() {
                return Ok(());
            }
            if let Some(status) = self.try_wait_backend()? {
                return Err(QemuError::BackendExited {
                    binary: self.backend_binary.clone(),
                    status,
                    socket: self.paths.vhost_socket.clone(),
                    stderr: tail_of_file(&self.paths.backend_stderr, TAIL_LINES),
                });
            }
            if Instant::now() >= deadline {
                return Err(QemuError::BackendTimeout {
                    binary: self.backend_binary.clone(),
                    socket: self.paths.vhost_socket.clone(),
                    timeout: BACKEND_SOCKET_TIMEOUT,
                    stderr: tail_of_file(&self.paths.backend_stderr, TAIL_LINES),
                });
            }
            thread::sleep(POLL);
        }
    }

    /// Starts virtiofsd for the shared directory, if any, and waits for its vhost-user socket.
    fn start_virtiofsd(&mut self, cfg: &QemuConfig) -> Result<(), QemuError> {
        let Some(shared) = &cfg.shared_fs else {
            return Ok(());
        };
        let stderr = create_file(&self.paths.virtiofsd_stderr)?;
        let mut cmd = Command::new(&cfg.virtiofsd_binary);
        cmd.args(virtiofsd_args(
            &self.paths.virtiofs_socket,
            &shared.host_dir,
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
        // It stays root (serving the guest's files as their owners needs its kept
        // capabilities) but gets no network, IPC or UTS namespace of the host's.
        confine_helper(
            &mut cmd,
            HelperIds::Root {
                bounding: process::VIRTIOFSD_BOUNDING,
                max_files: process::VIRTIOFSD_MAX_FILES,
            },
        );
        self.virtiofsd = Some(self.spawn(&mut cmd, &cfg.virtiofsd_binary)?);
        let deadline = Instant::now() + BACKEND_SOCKET_TIMEOUT;
        loop {
            if self.paths.virtiofs_socket.exists() {
                return Ok(());
            }
            let exited = match self.virtiofsd.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status),
                Some(Err(source)) => {
                    return Err(QemuError::Wait {
                        binary: self.virtiofsd_binary.clone(),
                        pid: 0,
                        source,
                    })
                }
                _ => None,
            };
            if let Some(status) = exited {
                self.virtiofsd = None;
                return Err(QemuError::VirtiofsdExited {
                    binary: self.virtiofsd_binary.clone(),
                    status,
                    socket: self.paths.virtiofs_socket.clone(),
                    stderr: tail_of_file(&self.paths.virtiofsd_stderr, TAIL_LINES),
                });
            }
            if Instant::now() >= deadline {
                return Err(QemuError::BackendTimeout {
                    binary: self.virtiofsd_binary.clone(),
                    socket: self.paths.virtiofs_socket.clone(),
                    timeout: BACKEND_SOCKET_TIMEOUT,
                    stderr: tail_of_file(&self.paths.virtiofsd_stderr, TAIL_LINES),
                });
            }
            thread::sleep(POLL);
        }
    }

    fn start_qemu(&mut self, cfg: &QemuConfig) -> Result<(), QemuError> {
        // A fresh console log, so "the guest wrote something" is well defined.
        let console = ConsolePump::start(&self.paths.console_log, cfg.console_log_bytes)?;
        let console_fd = console.qemu_fd();
        self.console = Some(console);
        let stderr = create_file(&self.paths.qemu_stderr)?;
        self.qemu_args = qemu_args(cfg, &self.paths, &self.cmdline);
        let mut cmd = Command::new(&cfg.qemu_binary);
        cmd.args(&self.qemu_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        pass_fds(&mut cmd, &cfg.nics, &cfg.disks, console_fd);
        let spawned = self.spawn(&mut cmd, &cfg.qemu_binary);
        // QEMU has its own copy now (or never will): ours would keep the copy from ending.
        if let Some(console) = self.console.as_mut() {
            console.release_qemu_end();
        }
        self.qemu = Some(spawned?);
        Ok(())
    }

    /// Spawns `cmd` as a child of this thread in the init's PID namespace.
    fn spawn(&self, cmd: &mut Command, binary: &Path) -> Result<Child, QemuError> {
        let init = self.init.as_ref().ok_or_else(|| {
            QemuError::InvalidConfig("the VM's processes start after its init".into())
        })?;
        let _entered = init.enter()?;
        spawn_tied_to_parent(cmd, binary)
    }

    fn wait_for_first_output(&mut self, timeout: Duration) -> Result<(), QemuError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.console.as_ref().is_some_and(|c| c.bytes() > 0) {
                return Ok(());
            }
            if let Some(status) = self.try_wait_qemu()? {
                return Err(QemuError::QemuExitedEarly {
                    binary: self.qemu_binary.clone(),
                    status,
                    stderr: tail_of_file(&self.paths.qemu_stderr, TAIL_LINES),
                    console: self.console_tail(TAIL_LINES),
                });
            }
            if Instant::now() >= deadline {
                return Err(QemuError::StartTimeout {
                    binary: self.qemu_binary.clone(),
                    console_log: self.paths.console_log.clone(),
                    timeout,
                    stderr: tail_of_file(&self.paths.qemu_stderr, TAIL_LINES),
                });
            }
            thread::sleep(POLL);
        }
    }

    /// Waits until `needle` appears on the guest console (e.g. the agent's ready line), QEMU
    /// exits, or `timeout` passes.
    ///
    /// Connecting to the agent only once it listens avoids a hang of vhost-device-vsock 0.3.0:
    /// hybrid-vsock connections refused by a still-booting guest (retried in a loop) can leave
    /// its event thread gone, after which it never reads another `CONNECT` (docs/qemu-backend.md).
    pub fn wait_for_console(&mut self, needle: &str, timeout: Duration) -> Result<(), QemuError> {
        let deadline = Instant::now() + timeout;
        loop {
            // The whole log pair: it is bounded.
            let previous = vmm::console_log::previous_path(&self.paths.console_log);
            let found = [&previous, &self.paths.console_log].iter().any(|p| {
                fs::read(p)
                    .map(|b| String::from_utf8_lossy(&b).contains(needle))
                    .unwrap_or(false)
            });
            if found {
                return Ok(());
            }
            if let Some(status) = self.try_wait_qemu()? {
                return Err(QemuError::ExitedWhileWaiting {
                    binary: self.qemu_binary.clone(),
                    status,
                    needle: needle.to_string(),
                    console: self.console_tail(TAIL_LINES),
                });
            }
            if Instant::now() >= deadline {
                return Err(QemuError::ConsoleTimeout {
                    needle: needle.to_string(),
                    timeout,
                    console: self.console_tail(TAIL_LINES),
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The hybrid-vsock host socket: connect, write `CONNECT <port>\n`, read `OK <port>\n`.
    pub fn vsock_uds_path(&self) -> &Path {
        &self.paths.vsock_uds
    }

    /// The file the guest's serial console is written to (the newer of a bounded pair:
    /// `vmm::console_log`).
    pub fn console_log_path(&self) -> &Path {
        &self.paths.console_log
    }

    /// The last `lines` lines of the guest console (read from its end, bounded).
    pub fn console_tail(&self, lines: usize) -> String {
        vmm::console_log::tail(&self.paths.console_log, CONSOLE_TAIL_BYTES, lines)
    }

    /// The last `lines` lines of QEMU's stderr.
    pub fn qemu_stderr_tail(&self, lines: usize) -> String {
        tail_of_file(&self.paths.qemu_stderr, lines)
    }

    /// The kernel command line given to QEMU (QEMU's microvm adds its virtio-mmio devices).
    pub fn kernel_cmdline(&self) -> &str {
        &self.cmdline
    }

    /// QEMU's arguments, for logs and docs.
    pub fn qemu_args(&self) -> &[String] {
        &self.qemu_args
    }

    /// Pids of the VM's init (killing it kills the rest), QEMU, vhost-device-vsock and
    /// virtiofsd while they run (not yet reaped).
    pub fn pids(&self) -> Vec<u32> {
        self.init
            .iter()
            .map(PodInit::pid)
            .chain(self.qemu.iter().map(Child::id))
            .chain(self.backend.iter().map(Child::id))
            .chain(self.virtiofsd.iter().map(Child::id))
            .collect()
    }

    /// Waits up to `timeout` for QEMU to exit by itself (the guest rebooted, powered off or
    /// QEMU failed). Returns its exit status, or `None` if it still runs. Once QEMU has exited,
    /// the vsock backend, virtiofsd and the VM's init are stopped and the sockets removed; the
    /// logs stay until drop.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>, QemuError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait_qemu()? {
                self.stop_backend();
                self.paths.remove_sockets();
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(POLL);
        }
    }

    /// Stops the VM: SIGTERM to QEMU, SIGKILL if it has not exited within a few seconds; then
    /// the same for vhost-device-vsock and virtiofsd; then ends the VM's init. Removes the
    /// sockets (the logs stay until drop). Returns QEMU's status.
    pub fn stop(&mut self) -> Result<ExitStatus, QemuError> {
        let status = match self.qemu.as_mut() {
            Some(child) => terminate(child, &self.qemu_binary)?,
            None => self.exit_status.unwrap_or_else(|| ExitStatus::from_raw(0)),
        };
        self.qemu = None;
        self.exit_status = Some(status);
        self.stop_backend();
        self.paths.remove_sockets();
        Ok(status)
    }

    /// Polls QEMU; reaps it when it has exited.
    fn try_wait_qemu(&mut self) -> Result<Option<ExitStatus>, QemuError> {
        if let Some(status) = self.exit_status {
            return Ok(Some(status));
        }
        let Some(child) = self.qemu.as_mut() else {
            return Ok(None);
        };
        match child.try_wait() {
            Ok(Some(status)) => {
                self.exit_status = Some(status);
                self.qemu = None;
                Ok(Some(status))
            }
            Ok(None) => Ok(None),
            Err(source) => Err(QemuError::Wait {
                binary: self.qemu_binary.clone(),
                pid: child.id(),
                source,
            }),
        }
    }

    fn try_wait_backend(&mut self) -> Result<Option<ExitStatus>, QemuError> {
        let Some(child) = self.backend.as_mut() else {
            return Ok(None);
        };
        match child.try_wait() {
            Ok(Some(status)) => {
                self.backend = None;
                Ok(Some(status))
            }
            Ok(None) => Ok(None),
            Err(source) => Err(QemuError::Wait {
                binary: self.backend_binary.clone(),
                pid: child.id(),
                source,
            }),
        }
    }

    /// vhost-device-vsock serves forever (it waits for the next VMM after one disconnects):
    /// it is always stopped, not waited for.
    fn stop_backend(&mut self) {
        if let Some(mut child) = self.backend.take() {
            if let Err(e) = terminate(&mut child, &self.backend_binary) {
                log::warn!("{e}");
            }
        }
        // virtiofsd usually ends by itself when QEMU disconnects.
        if let Some(mut child) = self.virtiofsd.take() {
            if let Err(e) = terminate(&mut child, &self.virtiofsd_binary) {
                log::warn!("{e}");
            }
        }
        // Every process of its namespace is reaped now: the init goes too (killed, reaped).
        drop(self.init.take());
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        for child in [self.qemu.take(), self.backend.take(), self.virtiofsd.take()]
            .into_iter()
            .flatten()
        {
            kill_and_reap(child);
        }
        // Nothing of the VM runs now; its init goes last (killed and reaped).
        drop(self.init.take());
        // Its copy ends with QEMU; before the files go, so that it creates none again.
        drop(self.console.take());
        self.paths.remove_all();
    }
}

#[cfg(test)]
mod tests {
    use super::cmdline::{kernel_hz, qemu_opt_escape};
    use super::*;
    use crate::host_check::KvmKind;

    fn cfg_in(dir: &Path) -> QemuConfig {
        let kernel = dir.join("k");
        let initrd = dir.join("i");
        fs::write(&kernel, b"x").unwrap();
        fs::write(&initrd, b"x").unwrap();
        let mut cfg = QemuConfig::new(
            kernel,
            initrd,
            "/nonexistent/vhost-device-vsock",
            dir.join("w"),
        );
        cfg.init_binary = shim_binary();
        cfg
    }

    /// The shim binary of this build (`make build` builds it before the tests): the VM's init
    /// (`__pod-init`); this test binary is not one.
    fn shim_binary() -> PathBuf {
        let exe = std::env::current_exe().unwrap();
        // <target>/<profile>/deps/<test>
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .unwrap()
            .join("containerd-shim-microvm-v1");
        assert!(
            bin.is_file(),
            "{}: build the binaries first (`make build`)",
            bin.display()
        );
        bin
    }

    #[test]
    fn a_binary_that_is_not_an_init_is_refused_and_leaves_nothing() {
        let d = temp_dir("not-init");
        let mut c = cfg_in(&d);
        // This test binary: it runs no test for the arguments `__pod-init <dir>` and exits.
        c.init_binary = PathBuf::from(init::DEFAULT_BINARY);
        let err = QemuVm::start(c).unwrap_err();
        assert!(
            matches!(err, QemuError::Init(PodInitError::NotReady { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("__pod-init"), "{err}");
        assert!(!d.join("w").exists(), "work dir left behind");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_vms_processes_die_with_the_thread_that_started_them_whatever_their_uid() {
        if !rustix::process::geteuid().is_root() {
            panic!("this test needs root");
        }
        let d = temp_dir("init-dies");
        let (tx, rx) = std::sync::mpsc::channel();
        let work = d.clone();
        thread::spawn(move || {
            let init = PodInit::start(&shim_binary(), &work).unwrap();
            // A child of another uid with no parent-death signal (as QEMU after `-runas`).
            let mut cmd = Command::new("sleep");
            cmd.arg("600");
            confine_helper(&mut cmd, HelperIds::Jail(2_000_000_124));
            let child = {
                let _entered = init.enter().unwrap();
                cmd.spawn().unwrap()
            };
            tx.send((init.pid(), child.id())).unwrap();
            // The thread ends without dropping either (as a killed shim would).
            std::mem::forget(child);
            std::mem::forget(init);
        })
        .join()
        .unwrap();
        let (init_pid, child) = rx.recv().unwrap();
        let alive = |pid: u32| crate::state::ProcStat::read(pid).is_some_and(|s| s.is_live());
        // Both are this process's children: each is reaped once it has exited, as the shim's
        // parent would reap them after a kill -9 of the shim. The init's exit waits until every
        // process of its namespace is reaped, so the child's zombie must go first.
        let reap = |pid: u32| {
            let _ = rustix::process::waitpid(
                rustix::process::Pid::from_raw(pid as i32),
                rustix::process::WaitOptions::NOHANG,
            );
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while (alive(child) || alive(init_pid)) && Instant::now() < deadline {
            reap(child);
            reap(init_pid);
            thread::sleep(POLL);
        }
        let (child_left, init_left) = (alive(child), alive(init_pid));
        // Nothing is left behind on failure either: SIGKILL to the init ends its namespace.
        for (pid, left) in [(init_pid, init_left), (child, child_left)] {
            if left {
                // SAFETY: kill(2) on a child of this process that has not been reaped.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while (alive(child) || alive(init_pid)) && Instant::now() < deadline {
            reap(child);
            reap(init_pid);
            thread::sleep(POLL);
        }
        reap(child);
        reap(init_pid);
        fs::remove_dir_all(&d).unwrap();
        assert!(
            !child_left,
            "the jailed child {child} outlived the thread that started it"
        );
        assert!(
            !init_left,
            "the init {init_pid} outlived the thread that started it"
        );
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("qemu-unit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn auto_accel_is_kvm_only_on_real_or_emulated_vmx_svm() {
        for (kind, want) in [
            (KvmKind::Hardware, Accel::Kvm),
            (KvmKind::Nested, Accel::Kvm),
            (KvmKind::SvmEmulatedByQemuTcg, Accel::Kvm),
            (KvmKind::Pvm, Accel::Tcg),
            (KvmKind::Unknown, Accel::Tcg),
            (KvmKind::None, Accel::Tcg),
        ] {
            assert_eq!(crate::host_check::qemu_accel_for(kind), want, "{kind}");
        }
        assert_eq!(Accel::Tcg.resolve(), Accel::Tcg);
        assert_eq!(Accel::Kvm.resolve(), Accel::Kvm);
    }

    #[test]
    fn rejects_bad_sizes_and_cid() {
        let d = temp_dir("sizes");
        for (vcpus, mem, cid) in [(0, 256, 3), (256, 256, 3), (1, 0, 3), (1, 256, 2)] {
            let mut c = cfg_in(&d);
            c.vcpus = vcpus;
            c.memory_mib = mem;
            c.guest_cid = cid;
            let err = QemuVm::start(c).unwrap_err();
            assert!(matches!(err, QemuError::InvalidConfig(_)), "{err}");
        }
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn missing_kernel_is_named() {
        let d = temp_dir("missing");
        let mut c = cfg_in(&d);
        c.kernel = d.join("no-such-vmlinux");
        let err = QemuVm::start(c).unwrap_err().to_string();
        assert!(
            err.contains("kernel") && err.contains("no-such-vmlinux"),
            "{err}"
        );
        assert!(!d.join("w").exists(), "work dir created before validation");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn missing_backend_binary_fails_and_cleans_up() {
        let d = temp_dir("nobackend");
        let err = QemuVm::start(cfg_in(&d)).unwrap_err();
        assert!(
            matches!(err, QemuError::BackendJail(BackendJailError::Open { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("/nonexistent/vhost-device-vsock"));
        assert!(!d.join("w").exists(), "work dir left behind");
        fs::remove_dir_all(&d).unwrap();
    }

    /// The static vhost-device-vsock scripts/install-vhost-device-vsock.sh installs (`make
    /// deps`): the only kind of vsock backend that runs in its jail.
    fn real_vsock_backend() -> PathBuf {
        let bin = default_vhost_vsock_binary();
        assert!(
            bin.is_file(),
            "{}: install it with scripts/install-vhost-device-vsock.sh",
            bin.display()
        );
        bin
    }

    #[test]
    fn a_dynamically_linked_or_script_backend_fails_naming_why_and_cleans_up() {
        let d = temp_dir("dynamic-backend");
        let script = d.join("backend.sh");
        fs::write(&script, "#!/bin/sh\nexec sleep 30\n").unwrap();
        fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        for (binary, why) in [
            (PathBuf::from("/bin/sleep"), "dynamically linked"),
            (script, "script"),
        ] {
            let mut c = cfg_in(&d);
            c.vhost_vsock_binary = binary.clone();
            let err = QemuVm::start(c).unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(
                    err,
                    QemuError::BackendJail(BackendJailError::NotStatic { .. })
                ),
                "{msg}"
            );
            assert!(
                msg.contains(&binary.display().to_string())
                    && msg.contains(why)
                    && msg.contains("scripts/install-vhost-device-vsock.sh"),
                "{msg}"
            );
            assert!(!d.join("w").exists(), "work dir left behind");
        }
        fs::remove_dir_all(&d).unwrap();
    }

    /// A system call outside vhost-device-vsock's filter kills it: the real backend, under its
    /// filter less `bind` (which it makes at its start, binding its sockets), dies of SIGSYS
    /// before it has made its socket, and that is reported. Under the whole filter the same
    /// start gets past it (to QEMU, which the bogus kernel then stops).
    #[test]
    fn a_system_call_outside_the_backends_filter_kills_it() {
        if !rustix::process::geteuid().is_root() {
            panic!("this test needs root (the backend's jail)");
        }
        let d = temp_dir("filter-kills");
        let mut c = cfg_in(&d);
        c.vhost_vsock_binary = real_vsock_backend();
        backend_jail::tests::leave_out_of_filter(Some(libc::SYS_bind));
        let err = QemuVm::start(c.clone());
        backend_jail::tests::leave_out_of_filter(None);
        match err {
            Err(QemuError::BackendExited { status, .. }) => {
                assert_eq!(status.signal(), Some(libc::SIGSYS), "{status}")
            }
            other => panic!("expected the backend killed by SIGSYS: {other:?}"),
        }
        assert!(!d.join("w").exists(), "work dir left behind");
        let err = QemuVm::start(c).unwrap_err();
        assert!(
            !matches!(
                err,
                QemuError::BackendExited { .. }
                    | QemuError::BackendTimeout { .. }
                    | QemuError::BackendJailSpawn { .. }
            ),
            "the backend did not start under its whole filter: {err}"
        );
        assert!(!d.join("w").exists(), "work dir left behind");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn long_socket_path_is_refused() {
        let d = temp_dir("long");
        let mut c = cfg_in(&d);
        c.work_dir = d.join("x".repeat(120));
        let err = QemuVm::start(c).unwrap_err();
        assert!(matches!(err, QemuError::SocketPathTooLong { .. }), "{err}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn cmdline_has_timing_and_extra() {
        let d = temp_dir("cmdline");
        let mut c = cfg_in(&d);
        c.cmdline_extra = " quiet ".into();
        let line = kernel_cmdline(&c);
        assert!(line.starts_with("console=ttyS0 reboot=t panic=-1 tsc_early_khz="));
        assert!(line.ends_with(" quiet"), "{line}");
        let khz = host_tsc_khz();
        assert!(
            (100_000..20_000_000).contains(&khz),
            "implausible TSC {khz} kHz"
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn reads_hz_beside_the_kernel() {
        let d = temp_dir("hz");
        fs::write(d.join("vmlinux"), b"x").unwrap();
        fs::write(d.join("config"), "CONFIG_X=y\nCONFIG_HZ=100\n").unwrap();
        assert_eq!(kernel_hz(&d.join("vmlinux")), Some(100));
        fs::remove_file(d.join("config")).unwrap();
        assert_eq!(kernel_hz(&d.join("vmlinux")), None);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn disks_are_passed_as_fds_with_their_serial_and_mode() {
        let dir = temp_dir("disks");
        let mut cfg = cfg_in(&dir);
        let file = |name: &str| {
            let p = dir.join(name);
            fs::write(&p, [0u8; 512]).unwrap();
            std::sync::Arc::new(fs::File::open(&p).unwrap())
        };
        cfg.disks = vec![
            QemuDisk {
                serial: "microvm-cold0".into(),
                file: file("a.img"),
                read_only: false,
            },
            QemuDisk {
                serial: "microvm-cold1".into(),
                file: file("b.img"),
                read_only: true,
            },
        ];
        cfg.validate().unwrap();
        let paths = VmPaths::new(&cfg).unwrap();
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        let (fd0, fd1) = (disk_fd(0), disk_fd(1));
        assert!(
            args.contains(&format!(
                "-add-fd fd={fd0},set=1 -blockdev driver=file,node-name=disk0,\
                 filename=/dev/fdset/1,read-only=off -device \
                 virtio-blk-device,drive=disk0,serial=microvm-cold0"
            )),
            "{args}"
        );
        assert!(args.contains(&format!("-add-fd fd={fd1},set=2")), "{args}");
        assert!(
            args.contains("filename=/dev/fdset/2,read-only=on"),
            "{args}"
        );
        assert!(fd0 >= NIC_FD_BASE + MAX_NICS as std::os::fd::RawFd);
        for bad in ["", "a,b", "x=y", &"s".repeat(21)] {
            cfg.disks[0].serial = bad.to_string();
            assert!(cfg.validate().is_err(), "{bad:?}");
        }
        paths.remove_all();
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn free_page_reporting_adds_the_balloon_after_the_disks() {
        let dir = temp_dir("balloon");
        let mut cfg = cfg_in(&dir);
        cfg.validate().unwrap();
        let paths = VmPaths::new(&cfg).unwrap();
        let balloon = "-device virtio-balloon-device,free-page-reporting=on";
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        assert!(!args.contains("virtio-balloon"), "{args}");
        cfg.free_page_reporting = true;
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        assert!(args.contains(balloon), "{args}");
        assert!(
            args.find(balloon) < args.find("-serial"),
            "before the console and kernel: {args}"
        );
        paths.remove_all();
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_console_pump_keeps_a_flood_within_its_bound_and_drains_at_eof() {
        use std::io::Write;
        let d = temp_dir("pump");
        let path = d.join("console.log");
        let bound = 16 << 10;
        let mut pump = ConsolePump::start(&path, bound).unwrap();
        let mut qemu = pump.qemu_end_for_test();
        pump.release_qemu_end();
        assert_eq!(pump.qemu_fd(), -1);
        for i in 0..5000 {
            writeln!(qemu, "flood line {i:05} xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx").unwrap();
        }
        // QEMU gone: EOF. Dropping the pump waits for the copy of what was left.
        drop(qemu);
        let deadline = Instant::now() + Duration::from_secs(10);
        while pump.bytes() < 5000 * 50 && Instant::now() < deadline {
            thread::sleep(POLL);
        }
        drop(pump);
        let previous = vmm::console_log::previous_path(&path);
        let size = |p: &Path| fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        assert!(size(&path) + size(&previous) <= bound);
        let tail = vmm::console_log::tail(&path, 4096, 1);
        assert!(tail.starts_with("flood line 04999"), "{tail}");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn commas_in_paths_are_escaped() {
        assert_eq!(qemu_opt_escape(Path::new("/a,b/s")), "/a,,b/s");
    }

    #[test]
    fn shared_fs_adds_the_vhost_user_fs_device_and_checks_its_tag() {
        let dir = temp_dir("shared-fs");
        let mut cfg = cfg_in(&dir);
        cfg.shared_fs = Some(QemuSharedFs {
            tag: "microvm-shared".into(),
            host_dir: dir.clone(),
        });
        cfg.validate().unwrap();
        let paths = VmPaths::new(&cfg).unwrap();
        let args = qemu_args(&cfg, &paths, "console=ttyS0").join(" ");
        assert!(
            args.contains("-device vhost-user-fs-device,chardev=fs0,tag=microvm-shared"),
            "{args}"
        );
        assert!(args.contains("virtiofsd.sock"), "{args}");
        for bad in ["", "a,b", &"t".repeat(37)] {
            cfg.shared_fs.as_mut().unwrap().tag = bad.to_string();
            assert!(cfg.validate().is_err(), "{bad:?}");
        }
        cfg.shared_fs = Some(QemuSharedFs {
            tag: "t".into(),
            host_dir: dir.join("missing"),
        });
        assert!(cfg.validate().is_err());
        paths.remove_all();
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn virtiofsd_gets_the_host_safety_options() {
        let args: Vec<String> = virtiofsd_args(Path::new("/w/fs.sock"), Path::new("/r/shared"))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--shared-dir",
                "/r/shared",
                "--socket-path",
                "/w/fs.sock",
                "--sandbox=chroot",
                "--seccomp=kill",
                "--inode-file-handles=never",
                "--modcaps=-mknod:-setfcap:-fsetid",
                "--no-announce-submounts",
                "--cache=auto",
                "--rlimit-nofile=0",
                "--log-level=warn",
            ]
        );
        // Nothing that turns xattrs on, and none of the C virtiofsd's `-o` options.
        for a in &args {
            assert!(
                ![
                    "--xattr",
                    "--xattrmap",
                    "--posix-acl",
                    "--security-label",
                    "-o"
                ]
                .iter()
                .any(|bad| a.starts_with(bad)),
                "{a}"
            );
        }
        // The kept set is what the default set less the modcaps leaves, and it and the start-up
        // capabilities are all the shim's bounding set holds.
        assert_eq!(
            process::VIRTIOFSD_BOUNDING & !VIRTIOFSD_KEPT_CAPS,
            (1 << 8) | (1 << 18),
            "setpcap and sys_chroot"
        );
    }

    #[test]
    fn missing_virtiofsd_fails_and_cleans_up() {
        let dir = temp_dir("no-virtiofsd");
        let mut cfg = cfg_in(&dir);
        cfg.vhost_vsock_binary = real_vsock_backend();
        cfg.shared_fs = Some(QemuSharedFs {
            tag: "t".into(),
            host_dir: dir.clone(),
        });
        cfg.virtiofsd_binary = PathBuf::from("/nonexistent/virtiofsd");
        let err = QemuVm::start(cfg).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/virtiofsd"), "{err}");
        assert!(!dir.join("w").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_virtiofsd_refusing_our_options_fails_naming_the_rust_one_and_cleans_up() {
        let dir = temp_dir("old-virtiofsd");
        let mut cfg = cfg_in(&dir);
        // The real vsock backend (a stand-in script cannot run in its jail).
        cfg.vhost_vsock_binary = real_vsock_backend();
        let share = dir.join("share");
        fs::create_dir(&share).unwrap();
        cfg.shared_fs = Some(QemuSharedFs {
            tag: "t".into(),
            host_dir: share,
        });
        // What QEMU 7.2's C virtiofsd answers to `--shared-dir <dir>`.
        let old = dir.join("virtiofsd");
        fs::write(
            &old,
            "#!/bin/sh\necho \"fuse: invalid argument \\`$2'\" >&2\nexit 1\n",
        )
        .unwrap();
        fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        cfg.virtiofsd_binary = old;
        let err = QemuVm::start(cfg).unwrap_err().to_string();
        assert!(
            err.contains("Rust virtiofsd")
                && err.contains("scripts/install-virtiofsd.sh")
                && err.contains("fuse: invalid argument"),
            "{err}"
        );
        assert!(!dir.join("w").exists(), "the work dir is left");
        let _ = fs::remove_dir_all(&dir);
    }

    /// The status lines of `cat /proc/self/status` run as a confined helper.
    fn confined_status(ids: HelperIds) -> String {
        let mut cmd = Command::new("cat");
        cmd.arg("/proc/self/status").stderr(Stdio::piped());
        confine_helper(&mut cmd, ids);
        let out = cmd.output().expect("spawning cat");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    fn status_field<'a>(status: &'a str, name: &str) -> &'a str {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap()
    }

    #[test]
    fn jail_ids_are_the_base_plus_the_pid_and_never_root_or_minus_one() {
        let pid = std::process::id();
        assert_eq!(jail_id(5), Some(5 + pid));
        assert_eq!(jail_id(0), None);
        assert_eq!(jail_id(u32::MAX - JAIL_ID_RANGE), None);
        assert_eq!(
            jail_id(u32::MAX - JAIL_ID_RANGE - 1),
            Some(u32::MAX - JAIL_ID_RANGE - 1 + pid)
        );
        let mut cfg = QemuConfig::new("/k", "/i", "/v", "/w");
        assert_eq!(cfg.jail_id, DEFAULT_JAIL_ID_BASE + pid);
        cfg.jail_id = 0;
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("jail_id"), "{e}");
    }

    #[test]
    fn helpers_run_confined_as_asked() {
        if !rustix::process::geteuid().is_root() {
            // Needs root to change ids: tests/tests/cri_microvm_qemu_jail.rs checks the real
            // helpers of a pod.
            panic!("this test needs root");
        }
        let s = confined_status(HelperIds::Jail(2_000_000_123));
        let ids = "2000000123\t2000000123\t2000000123\t2000000123";
        assert_eq!(status_field(&s, "Uid"), ids);
        assert_eq!(status_field(&s, "Gid"), ids);
        assert_eq!(status_field(&s, "Groups"), "");
        assert_eq!(status_field(&s, "CapEff"), "0000000000000000");
        assert_eq!(status_field(&s, "NoNewPrivs"), "1");
        let s = confined_status(HelperIds::Root {
            bounding: process::VIRTIOFSD_BOUNDING,
            max_files: 4096,
        });
        assert_eq!(status_field(&s, "Uid"), "0\t0\t0\t0");
        assert_eq!(
            u64::from_str_radix(status_field(&s, "CapBnd"), 16).unwrap(),
            process::VIRTIOFSD_BOUNDING
        );
        assert_eq!(
            u64::from_str_radix(status_field(&s, "CapEff"), 16).unwrap(),
            process::VIRTIOFSD_BOUNDING
        );
        assert_eq!(status_field(&s, "NoNewPrivs"), "1");
    }
}
