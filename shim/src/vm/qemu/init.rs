//! The pod's init: PID 1 of a PID namespace of the VM's own, holding every process the QEMU
//! backend starts for it (QEMU, vhost-device-vsock, virtiofsd).
//!
//! Those processes are started by the shim, as its own children (it waits for them and learns
//! QEMU's exit status as from any child), but in the init's PID namespace: the spawning thread
//! enters it for the spawn (`setns` on the init's pidfd only sets where that thread's next
//! children go). The init is started with `clone(CLONE_NEWPID | CLONE_PIDFD)` then `execve` of
//! `<binary> __pod-init <work dir>`, keeps root and the parent-death signal (SIGKILL) it got
//! before the `execve`, reaps what is given to it, and does nothing else. When the shim dies
//! (kill -9 included) the kernel kills the init, and with it, as with the init of any PID
//! namespace, every process of the namespace, whatever its uid: QEMU's own drop to its jail id
//! (`-runas`) clears QEMU's parent-death signal, not the init's.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};
use rustix::thread::ThreadNameSpaceType;
use rustix::thread::{move_into_link_name_space, move_into_thread_name_spaces, LinkNameSpaceType};

/// The hidden first argument that makes the shim's binary the pod's init:
/// `<binary> __pod-init <work dir>` (the folder only names the VM in `ps`).
pub const SUBCOMMAND: &str = "__pod-init";

/// The descriptor the init says "running" on (one byte), then closes.
const READY_FD: RawFd = 3;

/// How long the init may take from its start to "running".
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the pod's init; each names the binary run as the init.
#[derive(Debug, thiserror::Error)]
pub enum PodInitError {
    #[error("cannot prepare the pod's init {binary}: {source}")]
    Prepare { binary: PathBuf, source: io::Error },
    #[error("cannot start the pod's init {binary} in a PID namespace of its own: {source}")]
    Clone { binary: PathBuf, source: io::Error },
    #[error("{binary} did not start as the pod's init (`{binary} {SUBCOMMAND}`): {reason}")]
    NotReady { binary: PathBuf, reason: String },
    #[error("cannot enter the PID namespace of the pod's init (pid {pid}): {source}")]
    Enter { pid: u32, source: io::Error },
}

/// A running pod init. Dropping it kills it (and so every process of its PID namespace) and
/// reaps it.
#[derive(Debug)]
pub(super) struct PodInit {
    pidfd: OwnedFd,
    pid: u32,
}

/// What the clone's child needs, made before the clone: it then only makes system calls.
struct ExecPlan {
    exe: CString,
    argv: Vec<*const libc::c_char>,
    envp: [*const libc::c_char; 1],
    null: RawFd,
    ready: RawFd,
    shim: RawFd,
}

/// The clone's child: the parent-death signal, then (the shim still alive) its standard input
/// and output on /dev/null, the ready socket as [`READY_FD`], and `execve`.
///
/// # Safety
/// Only in the child of a fork-like clone of [`PodInit::start`]: it makes raw system calls only
/// (no allocation, no lock) and never returns.
unsafe fn exec_child(plan: &ExecPlan) -> ! {
    // SAFETY: each call is a raw system call on descriptors and pointers the plan holds open
    // and alive (the parent's copy of the plan outlives the clone; this is a copy of it).
    unsafe {
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            libc::_exit(126);
        }
        // The shim may have died between the clone and the prctl: then no signal would come.
        // (getppid says nothing here: the parent is outside the new namespace, 0 either way.)
        let mut poll = libc::pollfd {
            fd: plan.shim,
            events: libc::POLLIN,
            revents: 0,
        };
        if libc::poll(&mut poll, 1, 0) != 0 {
            libc::_exit(126);
        }
        if libc::dup2(plan.null, 0) < 0 || libc::dup2(plan.null, 1) < 0 {
            libc::_exit(126);
        }
        if plan.ready == READY_FD {
            // dup2 onto itself would keep close-on-exec.
            if libc::fcntl(READY_FD, libc::F_SETFD, 0) != 0 {
                libc::_exit(126);
            }
        } else if libc::dup2(plan.ready, READY_FD) < 0 {
            libc::_exit(126);
        }
        libc::execve(plan.exe.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr());
        libc::_exit(127)
    }
}

impl PodInit {
    /// Starts `binary __pod-init <work_dir>` as PID 1 of a new PID namespace and waits until
    /// it runs. Call it from the thread that spawns the VM's processes and outlives them (the
    /// parent-death signal is tied to the spawning thread).
    pub(super) fn start(binary: &Path, work_dir: &Path) -> Result<PodInit, PodInitError> {
        let prepare = |source| PodInitError::Prepare {
            binary: binary.to_path_buf(),
            source,
        };
        let cstr = |b: &[u8]| CString::new(b).map_err(|_| prepare(io::Error::other("a NUL")));
        let exe = cstr(binary.as_os_str().as_bytes())?;
        // argv[0] names the running binary, not /proc/self/exe, for ps.
        let name = std::env::current_exe()
            .ok()
            .filter(|_| binary == Path::new(DEFAULT_BINARY))
            .unwrap_or_else(|| binary.to_path_buf());
        let args = [
            cstr(name.as_os_str().as_bytes())?,
            cstr(SUBCOMMAND.as_bytes())?,
            cstr(work_dir.as_os_str().as_bytes())?,
        ];
        let null = File::open("/dev/null").map_err(prepare)?;
        let (mut ours, theirs) = UnixStream::pair().map_err(prepare)?;
        let shim = pidfd_open(rustix::process::getpid(), PidfdFlags::empty())
            .map_err(|e| prepare(e.into()))?;
        let plan = ExecPlan {
            exe,
            argv: args
                .iter()
                .map(|a| a.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect(),
            envp: [std::ptr::null()],
            null: null.as_raw_fd(),
            ready: theirs.as_raw_fd(),
            shim: shim.as_raw_fd(),
        };
        // SAFETY: the child only runs `exec_child`, which makes raw system calls and execs or
        // exits.
        let (pidfd, pid) =
            unsafe { vmm::jail::process::clone_into_new_pid_namespace(|| exec_child(&plan)) }
                .map_err(|source| PodInitError::Clone {
                    binary: binary.to_path_buf(),
                    source,
                })?;
        drop(theirs);
        let init = PodInit { pidfd, pid };
        // From here, dropping `init` kills and reaps it.
        let not_ready = |reason: String| PodInitError::NotReady {
            binary: binary.to_path_buf(),
            reason,
        };
        ours.set_read_timeout(Some(READY_TIMEOUT))
            .map_err(|e| not_ready(e.to_string()))?;
        let mut byte = [0u8; 1];
        match ours.read(&mut byte) {
            Ok(1) => Ok(init),
            Ok(_) => Err(not_ready(
                "it exited, or closed its ready descriptor".into(),
            )),
            Err(e) => Err(not_ready(format!("waiting for it: {e}"))),
        }
    }

    /// The init's pid (in the shim's PID namespace): killing it kills the VM's processes.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Makes the calling thread's next children members of the init's PID namespace, until the
    /// guard is dropped.
    pub(super) fn enter(&self) -> Result<Entered, PodInitError> {
        let enter = |source: io::Error| PodInitError::Enter {
            pid: self.pid,
            source,
        };
        let back = File::open("/proc/thread-self/ns/pid_for_children").map_err(enter)?;
        move_into_thread_name_spaces(self.pidfd.as_fd(), ThreadNameSpaceType::PROCESS_ID)
            .map_err(|e| enter(e.into()))?;
        Ok(Entered { back })
    }
}

impl Drop for PodInit {
    fn drop(&mut self) {
        let _ = pidfd_send_signal(self.pidfd.as_fd(), Signal::KILL);
        let _ = rustix::process::waitid(
            rustix::process::WaitId::PidFd(self.pidfd.as_fd()),
            rustix::process::WaitIdOptions::EXITED,
        );
    }
}

/// While alive, the thread's new children go to the pod's PID namespace.
pub(super) struct Entered {
    back: File,
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Err(e) =
            move_into_link_name_space(self.back.as_fd(), Some(LinkNameSpaceType::ProcessID))
        {
            log::error!("leaving the pod's PID namespace for new children: {e}");
        }
    }
}

/// The default init binary: the running one (the shim and the `microvm` tool dispatch
/// [`SUBCOMMAND`] first thing).
pub const DEFAULT_BINARY: &str = "/proc/self/exe";

/// The init's name in the process table (`/proc/<pid>/comm`, at most 15 bytes).
pub const PROCESS_NAME: &std::ffi::CStr = c"microvm-init";

/// `<binary> __pod-init <work dir>`: says "running" on [`READY_FD`], closes every other
/// descriptor but standard error, and reaps the orphans the namespace gives it, until the
/// kernel kills it (the shim died, or the VM ended and the shim killed it). Returns only on
/// a failure to set up, with the exit code.
pub fn pod_init_main() -> i32 {
    if rustix::process::getpid() != Pid::INIT {
        eprintln!("{SUBCOMMAND}: not PID 1 of a PID namespace; only the shim starts this");
        return 2;
    }
    // Its name in ps and top (the kernel's `comm`): the execve of /proc/self/exe named it `exe`.
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes, a static here.
    unsafe { libc::prctl(libc::PR_SET_NAME, PROCESS_NAME.as_ptr()) };
    // SAFETY: a sigset_t we own, filled by sigemptyset/sigaddset; sigprocmask changes only
    // this (single-threaded) process's mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        // Blocked, SIGCHLD stays pending for sigwaitinfo (an init ignores signals it does not
        // handle; a blocked one is queued).
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return 2;
        }
        set
    };
    {
        // SAFETY: READY_FD was put there by the shim for us alone (exec_child).
        let mut ready = unsafe { File::from_raw_fd(READY_FD) };
        if ready.write_all(b"r").is_err() {
            return 2;
        }
    }
    // Nothing else of the shim's is kept (standard error stays: the shim's log).
    // SAFETY: close_range on descriptors nothing in this process uses.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    loop {
        loop {
            match rustix::process::wait(rustix::process::WaitOptions::NOHANG) {
                Ok(Some(_)) => {}
                Err(rustix::io::Errno::INTR) => {}
                Ok(None) | Err(_) => break,
            }
        }
        // SAFETY: waits for a signal of `set` (blocked above); the info is not wanted.
        unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
    }
}
