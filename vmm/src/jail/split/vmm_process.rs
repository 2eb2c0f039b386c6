//! The embedder's half of the process split: [`VmmProcess`] starts the VMM process
//! (`clone(CLONE_NEWPID | CLONE_PIDFD)`, then `execve` of the embedder's own binary with
//! [`SUBCOMMAND`]), hands it the description in `Start`, sends the requests of a running VM
//! over the channel, and says how the process ended ([`VmmEnd`]), reaped through its pidfd.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::description::VmDescription;
use super::serve::SUBCOMMAND;
use super::wait::wait_readable;
use crate::jail::channel::{Channel, ChannelError, EndKind, Message};

/// Why the VMM process could not be started or driven.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    #[error("starting the VMM process: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("the VM description: {0}")]
    Description(String),
    #[error(transparent)]
    Channel(#[from] ChannelError),
    #[error("the VMM process: {0}")]
    Failed(String),
    #[error("the VMM process gave no answer within {0:?}")]
    Timeout(Duration),
    #[error("the VM has ended ({0})")]
    Ended(String),
    #[error("the VMM process answered {0:?}")]
    Unexpected(Box<Message>),
}

/// How the VMM process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmEnd {
    /// What the VMM process said before it exited (`Ended`), if it said anything.
    pub said: Option<(EndKind, String)>,
    /// Its exit: `Ok(code)` or `Err(signal)`.
    pub exit: Result<i32, i32>,
}

impl VmmEnd {
    /// Whether a seccomp filter killed the process (`SIGSYS`).
    pub fn by_seccomp(&self) -> bool {
        self.exit == Err(libc::SIGSYS)
    }

    /// One line on how the VM ended, for logs and the pod's exit reason.
    pub fn describe(&self) -> String {
        match (&self.said, self.exit) {
            (_, Err(libc::SIGSYS)) => "the VMM process was killed by its seccomp filter (a thread \
                 made a forbidden system call: the guest may have tried to escape)"
                .to_string(),
            (_, Err(sig)) => format!("the VMM process was killed by signal {sig}"),
            (Some((EndKind::Reset, _)), _) => "the guest reset or powered off".to_string(),
            (Some((EndKind::Stopped, _)), _) => "stopped by the host".to_string(),
            (Some((EndKind::Error, detail)), _) => format!("the VM failed: {detail}"),
            (None, Ok(code)) => format!("the VMM process exited with status {code}"),
        }
    }
}

/// The embedder's handle on a VM in a process of its own. Dropping it kills the process.
#[derive(Debug)]
pub struct VmmProcess {
    channel: Channel,
    pidfd: OwnedFd,
    pid: u32,
    detail: String,
    said: Option<(EndKind, String)>,
    end: Option<VmmEnd>,
    shares_pages: bool,
}

/// Everything the child needs between `clone` and `execve`, prepared before (it may not
/// allocate there).
struct ExecPlan {
    exe: CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    keep: Vec<RawFd>,
    stderr: RawFd,
}

/// In the child of `clone`: only raw system calls, no allocation, then `execve`.
///
/// # Safety
/// Called only in the child of a fork-like `clone`, with `plan`'s pointers valid (they point
/// into strings the parent keeps alive, copied into the child's memory by the clone).
unsafe fn exec_child(plan: &ExecPlan) -> ! {
    // SAFETY: plain system calls on values prepared by the parent; the child has one thread.
    unsafe {
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        // The VMM dies with the thread that started it (the embedder's VM thread).
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        if plan.stderr >= 0 && plan.stderr != 2 {
            libc::dup2(plan.stderr, 2);
        }
        for &fd in &plan.keep {
            libc::fcntl(fd, libc::F_SETFD, 0);
        }
        libc::execve(plan.exe.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr());
        libc::_exit(127)
    }
}

impl VmmProcess {
    /// Starts `exe SUBCOMMAND <fd>` in a new PID namespace, hands it `desc` (whose descriptor
    /// numbers must be open in this process: they are inherited), its standard error on
    /// `stderr` (the embedder's log), and waits up to `timeout` for the VM to run.
    pub fn spawn(
        exe: &Path,
        desc: &VmDescription,
        stderr: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<VmmProcess, SplitError> {
        Self::spawn_as(exe, exe.as_os_str(), desc, stderr, timeout)
    }

    /// [`VmmProcess::spawn`], with `argv0` as the process's name (its `argv[0]`, what ps
    /// shows) where `exe` does not say it: an embedder that execs `/proc/self/exe` (its own
    /// running binary, whatever has since replaced the file at its path) names itself here.
    pub fn spawn_as(
        exe: &Path,
        argv0: &OsStr,
        desc: &VmDescription,
        stderr: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<VmmProcess, SplitError> {
        let description =
            serde_json::to_string(desc).map_err(|e| SplitError::Description(e.to_string()))?;
        for fd in desc.fds() {
            // SAFETY: F_GETFD reads a flag of a descriptor number; no memory.
            if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(SplitError::Description(format!(
                    "descriptor {fd} is not open here"
                )));
            }
        }
        let (ours, theirs) = Channel::pair()?;
        let cstr = |b: &[u8]| {
            CString::new(b).map_err(|_| SplitError::Description("a NUL in an argument".into()))
        };
        let exe_c = cstr(exe.as_os_str().as_bytes())?;
        let args = [
            cstr(argv0.as_bytes())?,
            cstr(SUBCOMMAND.as_bytes())?,
            cstr(theirs.as_fd().as_raw_fd().to_string().as_bytes())?,
            // Not read: names the VM (its work folder) for ps and for leak checks.
            cstr(desc.work_dir.as_os_str().as_bytes())?,
        ];
        let env: Vec<CString> = std::env::vars_os()
            .filter_map(|(k, v)| {
                let mut b = k.as_bytes().to_vec();
                b.push(b'=');
                b.extend_from_slice(v.as_bytes());
                CString::new(b).ok()
            })
            .collect();
        let mut keep = desc.fds();
        keep.push(theirs.as_fd().as_raw_fd());
        let plan = ExecPlan {
            exe: exe_c,
            argv: args
                .iter()
                .map(|a| a.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect(),
            envp: env
                .iter()
                .map(|a| a.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect(),
            keep,
            stderr: stderr.map_or(-1, |f| f.as_raw_fd()),
        };
        // SAFETY: the child only runs `exec_child`, which makes raw system calls and execs or
        // exits.
        let (pidfd, pid) =
            unsafe { crate::jail::process::clone_into_new_pid_namespace(|| exec_child(&plan)) }
                .map_err(SplitError::Spawn)?;
        drop(theirs);
        let mut vmm = VmmProcess {
            channel: ours,
            pidfd,
            pid,
            detail: String::new(),
            said: None,
            end: None,
            shares_pages: desc.page_sharing.is_some(),
        };
        match vmm.request(&Message::Start { description }, &[], timeout)? {
            Message::Started { detail } => {
                vmm.detail = detail;
                Ok(vmm)
            }
            other => Err(SplitError::Unexpected(Box::new(other))),
        }
    }

    /// The VMM process's pid (in the embedder's PID namespace).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the VM shares pages (page sharing was in its description).
    pub fn shares_pages(&self) -> bool {
        self.shares_pages
    }

    /// How the VM boots, as the VMM process said.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Sends `msg` and waits up to `timeout` for its answer (`Failed` is an error). An `Ended`
    /// that arrives first is kept for [`VmmProcess::wait_timeout`] and is an error here.
    pub fn request(
        &mut self,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Message, SplitError> {
        if let Some(end) = &self.end {
            return Err(SplitError::Ended(end.describe()));
        }
        self.channel.send(msg, fds)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SplitError::Timeout(timeout));
            }
            let ready = wait_readable(&[self.channel.as_fd(), self.pidfd.as_fd()], left)
                .map_err(|e| SplitError::Channel(e.into()))?;
            if ready[0] {
                match self.channel.recv() {
                    Ok((Message::Ended { how, detail }, _)) => {
                        self.said = Some((how, detail.clone()));
                        return Err(SplitError::Ended(detail));
                    }
                    Ok((Message::Failed { reason }, _)) => return Err(SplitError::Failed(reason)),
                    Ok((answer, _)) => return Ok(answer),
                    Err(ChannelError::Closed) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if ready[1] || ready[0] {
                // The process is gone (or closed its end): reap it.
                if let Some(end) = self.reap(Duration::from_secs(5)) {
                    return Err(SplitError::Ended(end.describe()));
                }
            }
        }
    }

    /// Waits up to `timeout` for the process to end (reaping it).
    fn reap(&mut self, timeout: Duration) -> Option<VmmEnd> {
        if self.end.is_some() {
            return self.end.clone();
        }
        let deadline = Instant::now() + timeout;
        loop {
            // SAFETY: a zeroed siginfo_t is valid for waitid to fill.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid on our pidfd, writing `info`.
            let r = unsafe {
                libc::waitid(
                    libc::P_PIDFD,
                    self.pidfd.as_raw_fd() as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG,
                )
            };
            // SAFETY: waitid filled `info` (si_pid 0 if nothing ended yet).
            let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
            if r == 0 && pid != 0 {
                let exit = if info.si_code == libc::CLD_EXITED {
                    Ok(status)
                } else {
                    Err(status)
                };
                let end = VmmEnd {
                    said: self.said.take(),
                    exit,
                };
                self.end = Some(end.clone());
                return Some(end);
            }
            if r != 0 {
                // ECHILD: already reaped elsewhere (never by us); count it as gone.
                let end = VmmEnd {
                    said: self.said.take(),
                    exit: Ok(-1),
                };
                self.end = Some(end.clone());
                return Some(end);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let _ = wait_readable(&[self.pidfd.as_fd()], left);
        }
    }

    /// Waits up to `timeout` for the VM to end by itself; how, once it has.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<VmmEnd> {
        if let Some(end) = &self.end {
            return Some(end.clone());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ready = wait_readable(&[self.channel.as_fd(), self.pidfd.as_fd()], left)
                .unwrap_or(vec![false, true]);
            if ready[0] {
                match self.channel.recv() {
                    Ok((Message::Ended { how, detail }, _)) => self.said = Some((how, detail)),
                    Ok((other, _)) => log::warn!("the VMM process said {other:?} unasked"),
                    Err(ChannelError::Closed) => {}
                    Err(e) => log::warn!("the VMM process's channel: {e}"),
                }
            }
            if ready[0] || ready[1] {
                // It said it ended, closed its end or died: it exits right after.
                if let Some(end) = self.reap(Duration::from_secs(5)) {
                    return Some(end);
                }
                self.kill();
                return self.reap(Duration::from_secs(5));
            }
            if left.is_zero() {
                return None;
            }
        }
    }

    /// Kills the process (`SIGKILL` through the pidfd).
    pub fn kill(&self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, rustix::process::Signal::KILL);
    }

    /// Stops the VM: asks, waits up to `timeout` for the process to end, kills it past that.
    pub fn stop(&mut self, timeout: Duration) -> VmmEnd {
        if self.end.is_none() {
            let _ = self.channel.send(&Message::Stop, &[]);
            if let Some(end) = self.wait_timeout(timeout) {
                return end;
            }
            self.kill();
        }
        self.reap(Duration::from_secs(10)).unwrap_or(VmmEnd {
            said: None,
            exit: Err(libc::SIGKILL),
        })
    }

    /// One page sharing pass in the VMM process.
    pub fn share_pages(&mut self, timeout: Duration) -> Result<(), SplitError> {
        self.expect_done(&Message::SharePages, &[], timeout)
    }

    /// Whether the kernel text template is still to be captured.
    pub fn kernel_text_template_missing(&mut self, timeout: Duration) -> Result<bool, SplitError> {
        match self.request(&Message::KernelTextMissing, &[], timeout)? {
            Message::Flag { value } => Ok(value),
            other => Err(SplitError::Unexpected(Box::new(other))),
        }
    }

    /// Fills empty disk slot `index` with `file`.
    pub fn attach_block(
        &mut self,
        index: usize,
        serial: String,
        file: &std::fs::File,
        timeout: Duration,
    ) -> Result<(), SplitError> {
        let index = u32::try_from(index).map_err(|_| SplitError::Failed("slot index".into()))?;
        self.expect_done(
            &Message::AttachBlock { index, serial },
            &[file.as_fd()],
            timeout,
        )
    }

    /// Empties disk slot `index`.
    pub fn detach_block(&mut self, index: usize, timeout: Duration) -> Result<(), SplitError> {
        let index = u32::try_from(index).map_err(|_| SplitError::Failed("slot index".into()))?;
        self.expect_done(&Message::DetachBlock { index }, &[], timeout)
    }

    fn expect_done(
        &mut self,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(), SplitError> {
        match self.request(msg, fds, timeout)? {
            Message::Done => Ok(()),
            other => Err(SplitError::Unexpected(Box::new(other))),
        }
    }
}

impl Drop for VmmProcess {
    fn drop(&mut self) {
        if self.end.is_none() {
            self.kill();
            let _ = self.reap(Duration::from_secs(10));
        }
    }
}
