//! The QEMU backend's child processes: the guest console's copy into a bounded log
//! ([`ConsolePump`]), the fds QEMU gets, helpers confined ([`confine_helper`]) and tied to the
//! spawning thread, and their bounded termination.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use vmm::console_log::ConsoleLog;

use super::config::{disk_fd, QemuDisk, QemuNic, CONSOLE_FD, MAX_DISKS, MAX_NICS, NIC_FD_BASE};
use super::error::QemuError;

/// How often child processes and files are polled while waiting.
pub(super) const POLL: Duration = Duration::from_millis(10);
/// How long a child gets to exit after SIGTERM before it gets SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(3);

/// How long a dropped [`ConsolePump`] lets its thread copy what QEMU left in the socket.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);

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

#[cfg(test)]
mod tests {
    use std::process::Stdio;

    use super::super::virtiofsd::VIRTIOFSD_BOUNDING;
    use super::*;
    use crate::vm::qemu::test_support::temp_dir;

    #[test]
    fn the_console_pump_keeps_a_flood_within_its_bound_and_drains_at_eof() {
        use std::io::Write;
        let d_tmp = temp_dir("pump");
        let d = d_tmp.path().to_path_buf();
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
            bounding: VIRTIOFSD_BOUNDING,
            max_files: 4096,
        });
        assert_eq!(status_field(&s, "Uid"), "0\t0\t0\t0");
        assert_eq!(
            u64::from_str_radix(status_field(&s, "CapBnd"), 16).unwrap(),
            VIRTIOFSD_BOUNDING
        );
        assert_eq!(
            u64::from_str_radix(status_field(&s, "CapEff"), 16).unwrap(),
            VIRTIOFSD_BOUNDING
        );
        assert_eq!(status_field(&s, "NoNewPrivs"), "1");
    }
}
