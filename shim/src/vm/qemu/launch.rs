//! [`QemuVm`]: a guest under QEMU with its helpers, started in order (the VM's init,
//! vhost-device-vsock, virtiofsd, QEMU), watched, and stopped; everything it started is killed
//! and reaped, and every file it made removed, on every path (failed start, stop, drop).

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::backend_jail::BackendJail;
use super::cmdline::{kernel_cmdline, qemu_args};
use super::config::QemuConfig;
use super::error::QemuError;
use super::init::PodInit;
use super::paths::VmPaths;
use super::process::{
    confine_helper, create_file, kill_and_reap, pass_fds, spawn_tied_to_parent, tail_of_file,
    terminate, tie_to_parent, ConsolePump, HelperIds, POLL,
};
use super::virtiofsd::{virtiofsd_args, VIRTIOFSD_BOUNDING, VIRTIOFSD_MAX_FILES};

/// How long vhost-device-vsock may take to create its vhost-user socket.
const BACKEND_SOCKET_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of stderr / console carried in errors.
const TAIL_LINES: usize = 20;
/// Bytes of the console's end read for an error message.
const CONSOLE_TAIL_BYTES: usize = 4096;
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
                bounding: VIRTIOFSD_BOUNDING,
                max_files: VIRTIOFSD_MAX_FILES,
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
    use super::super::backend_jail::{self, BackendJailError};
    use super::super::config::QemuSharedFs;
    use super::super::init::{self, PodInitError};
    use super::*;
    use crate::vm::qemu::test_support::{cfg_in, real_vsock_backend, shim_binary, temp_dir};

    #[test]
    fn a_binary_that_is_not_an_init_is_refused_and_leaves_nothing() {
        let d_tmp = temp_dir("not-init");
        let d = d_tmp.path().to_path_buf();
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
    }

    #[test]
    fn the_vms_processes_die_with_the_thread_that_started_them_whatever_their_uid() {
        if !rustix::process::geteuid().is_root() {
            panic!("this test needs root");
        }
        let d_tmp = temp_dir("init-dies");
        let d = d_tmp.path().to_path_buf();
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
        assert!(
            !child_left,
            "the jailed child {child} outlived the thread that started it"
        );
        assert!(
            !init_left,
            "the init {init_pid} outlived the thread that started it"
        );
    }

    #[test]
    fn rejects_bad_sizes_and_cid() {
        let d_tmp = temp_dir("sizes");
        let d = d_tmp.path().to_path_buf();
        for (vcpus, mem, cid) in [(0, 256, 3), (256, 256, 3), (1, 0, 3), (1, 256, 2)] {
            let mut c = cfg_in(&d);
            c.vcpus = vcpus;
            c.memory_mib = mem;
            c.guest_cid = cid;
            let err = QemuVm::start(c).unwrap_err();
            assert!(matches!(err, QemuError::InvalidConfig(_)), "{err}");
        }
    }

    #[test]
    fn missing_kernel_is_named() {
        let d_tmp = temp_dir("missing");
        let d = d_tmp.path().to_path_buf();
        let mut c = cfg_in(&d);
        c.kernel = d.join("no-such-vmlinux");
        let err = QemuVm::start(c).unwrap_err().to_string();
        assert!(
            err.contains("kernel") && err.contains("no-such-vmlinux"),
            "{err}"
        );
        assert!(!d.join("w").exists(), "work dir created before validation");
    }

    #[test]
    fn missing_backend_binary_fails_and_cleans_up() {
        let d_tmp = temp_dir("nobackend");
        let d = d_tmp.path().to_path_buf();
        let err = QemuVm::start(cfg_in(&d)).unwrap_err();
        assert!(
            matches!(err, QemuError::BackendJail(BackendJailError::Open { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("/nonexistent/vhost-device-vsock"));
        assert!(!d.join("w").exists(), "work dir left behind");
    }

    #[test]
    fn a_dynamically_linked_or_script_backend_fails_naming_why_and_cleans_up() {
        let d_tmp = temp_dir("dynamic-backend");
        let d = d_tmp.path().to_path_buf();
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
        let d_tmp = temp_dir("filter-kills");
        let d = d_tmp.path().to_path_buf();
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
    }

    #[test]
    fn long_socket_path_is_refused() {
        let d_tmp = temp_dir("long");
        let d = d_tmp.path().to_path_buf();
        let mut c = cfg_in(&d);
        c.work_dir = d.join("x".repeat(120));
        let err = QemuVm::start(c).unwrap_err();
        assert!(matches!(err, QemuError::SocketPathTooLong { .. }), "{err}");
    }

    #[test]
    fn missing_virtiofsd_fails_and_cleans_up() {
        let dir_tmp = temp_dir("no-virtiofsd");
        let dir = dir_tmp.path().to_path_buf();
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
    }

    #[test]
    fn a_virtiofsd_refusing_our_options_fails_naming_the_rust_one_and_cleans_up() {
        let dir_tmp = temp_dir("old-virtiofsd");
        let dir = dir_tmp.path().to_path_buf();
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
    }
}
