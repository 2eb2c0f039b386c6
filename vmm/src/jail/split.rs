//! The process split: a VM in a process of its own, started by the embedder from its own
//! binary (a hidden subcommand, [`SUBCOMMAND`]), jailed before any thread of the VM exists,
//! driven over the control [`Channel`] (docs/security.md, "The VMM's confinement").
//!
//! The embedder's half is [`VmmProcess`]: it makes the channel, starts the process with
//! `clone(CLONE_NEWPID | CLONE_PIDFD)` then `execve` (the VMM is PID 1 of a PID namespace of its
//! own; the pidfd says when it died, without a race on the pid), hands it the VM's
//! [`VmDescription`] in `Start` and the descriptors the description names, and sends the
//! requests of a running VM. The embedder opens every host resource that lies outside the VM's
//! work folder and gives it as a descriptor: the kernel and the initrd (read-only) and
//! `/dev/kvm` ([`HostFiles`]), the taps, the disk files. The VMM process's half is [`serve`]: it
//! takes the descriptors the description names and closes every other, boots the kernel and
//! initrd it was given (whatever is at their paths by then: it never opens them, nor
//! `/dev/kvm`), opens what stays a path (the console log and the vsock socket in the work
//! folder, VFIO devices by the sysfs paths the embedder names) and builds its devices, then,
//! still before any thread of the VM exists ([`crate::Vm::start_then`]): new mount, IPC, UTS
//! and network namespaces, `pivot_root` into an empty read-only tmpfs that holds only the VM's
//! work folder (vsock's guest-to-host sockets), the page templates' folder and its own slave
//! copy of the shared directory, each at its own path, the limits, the capabilities the
//! virtio-fs server needs (none without a shared directory), `no_new_privs`; the virtio-fs
//! server is opened then, inside that root. Then the VM's threads start under their filters, a
//! page sharing thread installs its filter, and the main thread installs the control filter
//! and serves the channel until the VM ends; it then says how (`Ended`) and exits.
//!
//! The descriptors of the start are inherited through `execve`, named by number in the
//! description, rather than sent over the channel with `SCM_RIGHTS` (as a disk attached later
//! is): every descriptor of the embedder stays close-on-exec in the embedder, and only the
//! child, between `clone` and `execve`, clears the flag on its own copies of the named ones,
//! so no other process the embedder starts meanwhile inherits them; they are in place before
//! the VMM process reads its first message, and the description and its descriptors cannot
//! part (one `Start`, whatever the count, within the channel's limit of descriptors per
//! message or not).

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::channel::{Channel, ChannelError, EndKind, Message};
use super::process::{
    detached_tree, enter_namespaces, keep_capabilities, pivot_to_root_holding, set_limits,
    set_no_new_privs, Limits, FS_SERVER_CAPABILITIES,
};
use super::{Needs, Role, ThreadFilter};
use crate::config::{
    BalloonConfig, BlockBacking, BlockConfig, BootFile, BootFiles, NetConfig, SerialSink,
    SharedFsConfig, VfioConfig, VmConfig, VsockConfig,
};
use crate::page_sharing::PageSharingConfig;
use crate::{Vm, VmExit, VmHandle, VmmError};

/// The hidden first argument of the embedder's binary that runs [`serve`]:
/// `<binary> __vmm <channel descriptor> <work folder>` (the folder only names the VM in `ps`).
pub const SUBCOMMAND: &str = "__vmm";

/// The folder of the VM's work folder the VMM process mounts its empty root on (in its own
/// mount namespace only).
const ROOT_MOUNT_POINT: &str = ".vmm-root";

/// How often the control thread looks whether the VM ended by itself.
const END_POLL: Duration = Duration::from_millis(100);

/// The VM a VMM process runs: what [`VmConfig`] says, with descriptor numbers (inherited
/// through `execve`) where the embedder opened the resource.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmDescription {
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The kernel, opened read-only by the embedder ([`HostFiles`]).
    pub kernel: FileDescription,
    /// The initrd, opened read-only by the embedder.
    pub initrd: Option<FileDescription>,
    /// `/dev/kvm`, opened read-write by the embedder.
    pub kvm_fd: RawFd,
    /// Copy the boot files instead of mapping them ([`BootFiles::Copy`]).
    pub copy_boot_files: bool,
    pub cmdline: String,
    /// The console log (a bounded pair, [`crate::console_log`]) and its bound.
    pub console_log: PathBuf,
    pub console_log_bytes: u64,
    /// The VM's work folder: its vsock socket is in it, and vsock's guest-to-host connections
    /// go to sockets next to it. The only host folder of the jail besides the templates'.
    pub work_dir: PathBuf,
    pub vsock: Option<VsockDescription>,
    pub shared_fs: Option<SharedFsDescription>,
    pub nets: Vec<NetDescription>,
    pub blocks: Vec<BlockDescription>,
    /// Host PCI devices (sysfs paths) passed through with VFIO.
    pub vfio: Vec<PathBuf>,
    /// A virtio-balloon, with free page reporting or not.
    pub balloon: Option<bool>,
    pub page_sharing: Option<PageSharingDescription>,
}

/// A file the embedder opened: its descriptor number (in the embedder and, inherited, in the
/// VMM process) and the path it was opened from, which only names it in messages.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileDescription {
    pub fd: RawFd,
    pub name: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VsockDescription {
    pub guest_cid: u32,
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SharedFsDescription {
    pub tag: String,
    pub host_dir: PathBuf,
}

/// A network card: the tap's descriptor number in the embedder (and, inherited, in the VMM
/// process).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetDescription {
    pub fd: RawFd,
    pub mac: [u8; 6],
    pub mtu: Option<u16>,
}

/// A disk slot: its file's descriptor number, or none for an empty slot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BlockDescription {
    pub serial: String,
    pub read_only: bool,
    pub fd: Option<RawFd>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PageSharingDescription {
    pub template_dir: PathBuf,
    pub domain: String,
    pub capture_kernel_text: bool,
}

impl VmDescription {
    /// The descriptor numbers the description names, in order (the kernel, the initrd, KVM,
    /// the taps, the disk files).
    pub fn fds(&self) -> Vec<RawFd> {
        std::iter::once(self.kernel.fd)
            .chain(self.initrd.as_ref().map(|i| i.fd))
            .chain(std::iter::once(self.kvm_fd))
            .chain(self.nets.iter().map(|n| n.fd))
            .chain(self.blocks.iter().filter_map(|b| b.fd))
            .collect()
    }
}

/// The host files the embedder opens for a VMM process, which gets them as descriptors and
/// never their paths: the kernel and the initrd read-only, `/dev/kvm` read-write, each
/// close-on-exec here. Keep it until [`VmmProcess::spawn`] returned (the process has its copies
/// then); dropping it closes the embedder's.
#[derive(Debug)]
pub struct HostFiles {
    kernel: (std::fs::File, PathBuf),
    initrd: Option<(std::fs::File, PathBuf)>,
    kvm: OwnedFd,
}

impl HostFiles {
    /// Opens the kernel at `kernel`, the initrd at `initrd` (regular files, read-only) and
    /// `/dev/kvm`; an error names the file that failed and why.
    pub fn open(kernel: &Path, initrd: Option<&Path>) -> Result<HostFiles, VmmError> {
        let open = |path: &Path| match BootFile::open_path(path)? {
            BootFile::Open { file, name } => Ok((file, name)),
            BootFile::Path(_) => Err("not opened".to_string()),
        };
        let kernel = open(kernel).map_err(|reason| VmmError::Kernel {
            path: kernel.to_path_buf(),
            reason,
        })?;
        let initrd = match initrd {
            Some(p) => Some(open(p).map_err(|reason| VmmError::Initrd {
                path: p.to_path_buf(),
                reason,
            })?),
            None => None,
        };
        let kvm = crate::kvm_vm::open_kvm()?;
        Ok(HostFiles {
            kernel,
            initrd,
            kvm,
        })
    }

    /// The kernel's part of a description.
    pub fn kernel(&self) -> FileDescription {
        FileDescription {
            fd: self.kernel.0.as_raw_fd(),
            name: self.kernel.1.clone(),
        }
    }

    /// The initrd's part of a description.
    pub fn initrd(&self) -> Option<FileDescription> {
        self.initrd.as_ref().map(|(file, name)| FileDescription {
            fd: file.as_raw_fd(),
            name: name.clone(),
        })
    }

    /// KVM's descriptor number.
    pub fn kvm_fd(&self) -> RawFd {
        self.kvm.as_raw_fd()
    }
}

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

fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Duration) -> std::io::Result<Vec<bool>> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    loop {
        // SAFETY: `polls` is a valid array of its length; the timeout and no signal mask.
        let n = unsafe {
            libc::ppoll(
                polls.as_mut_ptr(),
                polls.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        if n >= 0 {
            return Ok(polls.iter().map(|p| p.revents != 0).collect());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
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
            exe_c.clone(),
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
            unsafe { super::process::clone_into_new_pid_namespace(|| exec_child(&plan)) }
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

// ---- The VMM process's half ----

/// Why the VMM process could not run its VM.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the channel descriptor {0:?}")]
    ChannelFd(String),
    #[error(transparent)]
    Channel(#[from] ChannelError),
    #[error("the first message was not Start")]
    NoStart,
    #[error("the VM description: {0}")]
    Description(String),
    #[error(transparent)]
    Vmm(#[from] VmmError),
    #[error(transparent)]
    Jail(#[from] super::JailError),
}

/// Takes descriptor `fd` (named by the description) as ours: open, not standard I/O, not the
/// channel, close-on-exec from now on.
fn take_fd(fd: RawFd, channel: RawFd, taken: &mut Vec<RawFd>) -> Result<OwnedFd, ServeError> {
    let cloexec = |fd: RawFd| {
        // SAFETY: F_SETFD on a descriptor number touches no memory; a number that is not open
        // gives EBADF.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) }
    };
    if fd < 3 || fd == channel || taken.contains(&fd) || cloexec(fd) != 0 {
        return Err(ServeError::Description(format!(
            "descriptor {fd} is not one the VMM process was given"
        )));
    }
    taken.push(fd);
    // SAFETY: an open descriptor named once by the embedder, owned by nothing else here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Closes every descriptor above 2 but `keep`. It allocates nothing (a forked child of a
/// process with threads may call it: the unit tests do).
fn close_others(keep: &[RawFd]) {
    let mut from: u32 = 3;
    // The kept descriptors in rising order: the smallest one at or above `from`, each round.
    while let Some(fd) = keep
        .iter()
        .filter_map(|&f| u32::try_from(f).ok())
        .filter(|&f| f >= from)
        .min()
    {
        if fd > from {
            // SAFETY: close_range on descriptor numbers we do not use.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0u32) };
        }
        from = fd.saturating_add(1);
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
}

enum ShareRequest {
    Pass,
    TextMissing,
}

/// Runs the VMM process's half: `channel_fd` from the command line. Returns the exit code;
/// when the VM ran, it never returns (the process exits without dropping the VM: a confined
/// thread may not remove its socket file, and the embedder removes the work folder).
pub fn serve(channel_fd: &str) -> i32 {
    serve_with(channel_fd, None)
}

/// Code an embedder runs in its VMM process on a thread of its own ([`serve_with`]).
pub type ExtraThread = Box<dyn FnOnce() + Send + 'static>;

/// [`serve`], with `extra` run on a thread of its own once the VM runs, in the jail (the
/// process's namespaces, root, limits, capabilities and `no_new_privs`), started before the
/// control thread installs its filter (which forbids starting threads); the thread has no
/// filter but what `extra` installs. The product binary passes none: the jail's tests play a
/// hijacked thread of the VM there, under that thread's filter
/// (shim/tests/kvm_vmm_process_climb.rs).
pub fn serve_with(channel_fd: &str, extra: Option<ExtraThread>) -> i32 {
    let Ok(fd) = channel_fd.parse::<RawFd>() else {
        eprintln!("vmm: {}", ServeError::ChannelFd(channel_fd.into()));
        return 2;
    };
    // SAFETY: F_SETFD on a descriptor number; no memory.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        eprintln!("vmm: {}", ServeError::ChannelFd(channel_fd.into()));
        return 2;
    }
    // SAFETY: the embedder handed this descriptor (its end of the channel) to us alone.
    let channel = Channel::from_fd(unsafe { OwnedFd::from_raw_fd(fd) });
    match run(&channel, fd, extra) {
        Ok(never) => match never {},
        Err(e) => {
            log::error!("vmm: {e}");
            let _ = channel.send(
                &Message::Failed {
                    reason: e.to_string(),
                },
                &[],
            );
            1
        }
    }
}

enum Never {}

fn run(
    channel: &Channel,
    channel_fd: RawFd,
    extra: Option<ExtraThread>,
) -> Result<Never, ServeError> {
    let description = match channel.recv()? {
        (Message::Start { description }, _) => description,
        _ => return Err(ServeError::NoStart),
    };
    let desc: VmDescription =
        serde_json::from_str(&description).map_err(|e| ServeError::Description(e.to_string()))?;
    // Only what the description names stays open.
    let mut keep = desc.fds();
    keep.push(channel_fd);
    close_others(&keep);
    let mut taken = Vec::new();
    // The kernel, the initrd and KVM are the embedder's open files: nothing here opens their
    // paths, which only name them in messages.
    let mut boot_file = |f: &FileDescription| -> Result<BootFile, ServeError> {
        Ok(BootFile::Open {
            file: take_fd(f.fd, channel_fd, &mut taken)?.into(),
            name: f.name.clone(),
        })
    };
    let mut cfg = VmConfig::new(boot_file(&desc.kernel)?);
    cfg.initrd = desc.initrd.as_ref().map(&mut boot_file).transpose()?;
    cfg.kvm = Some(take_fd(desc.kvm_fd, channel_fd, &mut taken)?);
    cfg.vcpus = desc.vcpus;
    cfg.memory_mib = desc.memory_mib;
    cfg.boot_files = if desc.copy_boot_files {
        BootFiles::Copy
    } else {
        BootFiles::Map
    };
    cfg.cmdline = desc.cmdline.clone();
    cfg.serial = SerialSink::File {
        path: desc.console_log.clone(),
        max_bytes: desc.console_log_bytes,
    };
    cfg.vsock = desc.vsock.as_ref().map(|v| VsockConfig {
        guest_cid: v.guest_cid,
        uds_path: v.uds_path.clone(),
    });
    // The share is served by its path, which the jail's root holds: the process's own copy
    // of the host's share mount (a slave of it, so the containers' files the shim mounts
    // there later appear), mounted at the same path. The file server opens its root and
    // /proc/self/fd after the jail (`VirtioFs::open_backend`), so `..` from either stops at
    // the jail's root (docs/security.md, "The share in the VMM process").
    cfg.shared_fs = desc.shared_fs.as_ref().map(|s| SharedFsConfig {
        tag: s.tag.clone(),
        host_dir: s.host_dir.clone(),
    });
    for n in &desc.nets {
        cfg.nets.push(NetConfig {
            tap: take_fd(n.fd, channel_fd, &mut taken)?,
            mac: n.mac,
            mtu: n.mtu,
        });
    }
    for b in &desc.blocks {
        let backing = match b.fd {
            None => BlockBacking::Empty {
                read_only: b.read_only,
            },
            Some(fd) => BlockBacking::File {
                file: take_fd(fd, channel_fd, &mut taken)?.into(),
                read_only: b.read_only,
            },
        };
        cfg.blocks.push(BlockConfig {
            serial: b.serial.clone(),
            backing,
        });
    }
    cfg.vfio = desc
        .vfio
        .iter()
        .map(|p| VfioConfig {
            sysfs_path: p.clone(),
        })
        .collect();
    cfg.balloon = desc.balloon.map(|free_page_reporting| BalloonConfig {
        free_page_reporting,
    });
    cfg.page_sharing = desc.page_sharing.as_ref().map(|p| PageSharingConfig {
        template_dir: p.template_dir.clone(),
        domain: p.domain.clone(),
        capture_kernel_text: p.capture_kernel_text,
    });
    cfg.jail = true;

    // The folders the jail keeps, cloned while this process still sees the host's mounts.
    let io = |what: &'static str| move |e: std::io::Error| VmmError::io(what)(e);
    let mount_point = desc.work_dir.join(ROOT_MOUNT_POINT);
    match std::fs::create_dir(&mount_point) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("make the empty root's mount point")(e).into()),
    }
    let mut trees: Vec<(PathBuf, OwnedFd)> = vec![(
        desc.work_dir.clone(),
        detached_tree(&desc.work_dir).map_err(VmmError::from)?,
    )];
    if let Some(p) = &desc.page_sharing {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&p.template_dir)
            .map_err(io("make the page templates' folder"))?;
        trees.push((
            p.template_dir.clone(),
            detached_tree(&p.template_dir).map_err(VmmError::from)?,
        ));
    }
    let serves_fs = desc.shared_fs.is_some();
    let mut limits = Limits::for_vm(desc.vcpus, serves_fs);
    if desc.page_sharing.is_some() {
        // Template files are as large as the initrd's files and the kernel text.
        limits.file_size = None;
    }
    let share_dir = desc.shared_fs.as_ref().map(|s| s.host_dir.clone());
    // The process's own procfs: the file server's `/proc/self/fd`, and page sharing's
    // `/proc/self/maps` and `/proc/self/pagemap`.
    let with_proc = serves_fs || desc.page_sharing.is_some();
    let jail = || -> Result<(), VmmError> {
        enter_namespaces()?;
        // The share is cloned from this namespace's copy of it, a slave of the host's mount
        // since `enter_namespaces`: the clone is a slave too (the host's later mounts under it
        // reach it, nothing goes back), never a peer of the host's.
        if let Some(dir) = &share_dir {
            trees.push((dir.clone(), detached_tree(dir)?));
        }
        let mounts: Vec<(&Path, &OwnedFd)> = trees.iter().map(|(p, t)| (p.as_path(), t)).collect();
        pivot_to_root_holding(&mount_point, &mounts, with_proc)?;
        set_limits(&limits)?;
        keep_capabilities(if serves_fs {
            &FS_SERVER_CAPABILITIES
        } else {
            &[]
        })?;
        set_no_new_privs()?;
        Ok(())
    };
    let handle = Vm::start_then(cfg, jail)?;
    handle.keep_devices_after_end();
    let control = ThreadFilter::new(Role::Control, Needs::default())?;
    std::thread::scope(|scope| -> Result<Never, ServeError> {
        // The page sharing passes run on a thread of their own under their filter: the control
        // thread, filtered, cannot start threads.
        let (share_tx, share_rx) = mpsc::channel::<(ShareRequest, mpsc::Sender<Message>)>();
        let handle = &handle;
        if handle.sharing_filter().is_some() {
            std::thread::Builder::new()
                .name("vmm-sharing".into())
                .spawn_scoped(scope, move || share_thread(handle, share_rx))
                .map_err(io("spawn the page sharing thread"))?;
        } else {
            drop(share_rx);
        }
        let detail = format!(
            "embedded vmm on /dev/kvm in its own process, {} entry",
            handle.boot_entry()
        );
        if let Some(extra) = extra {
            std::thread::Builder::new()
                .name("vmm-extra".into())
                .spawn(extra)
                .map_err(io("spawn the embedder's extra thread"))?;
        }
        control.install()?;
        channel.send(&Message::Started { detail }, &[])?;
        serve_requests(channel, handle, &share_tx);
        // The VM has ended and the embedder knows: exit without dropping anything.
        // SAFETY: _exit ends the process; nothing of it is used after.
        unsafe { libc::_exit(0) }
    })
}

fn share_thread(
    handle: &VmHandle,
    requests: mpsc::Receiver<(ShareRequest, mpsc::Sender<Message>)>,
) {
    if let Some(filter) = handle.sharing_filter() {
        if let Err(e) = filter.install() {
            log::error!("vmm: the page sharing thread's filter: {e}");
            return;
        }
    }
    for (request, reply) in requests {
        let answer = match request {
            ShareRequest::Pass => match handle.share_pages_on_this_thread() {
                Ok(_) => Message::Done,
                Err(e) => Message::Failed {
                    reason: e.to_string(),
                },
            },
            ShareRequest::TextMissing => match handle.kernel_text_template_missing() {
                Ok(value) => Message::Flag { value },
                Err(e) => Message::Failed {
                    reason: e.to_string(),
                },
            },
        };
        let _ = reply.send(answer);
    }
}

fn ended(result: Result<VmExit, VmmError>) -> Message {
    let (how, detail) = match result {
        Ok(VmExit::Reset) => (EndKind::Reset, String::new()),
        Ok(VmExit::Stopped) | Err(VmmError::AlreadyWaited) => (EndKind::Stopped, String::new()),
        Err(e) => (EndKind::Error, e.to_string()),
    };
    let mut detail = detail;
    detail.truncate(super::channel::MAX_STRING);
    while !detail.is_char_boundary(detail.len()) {
        detail.pop();
    }
    Message::Ended { how, detail }
}

/// The control thread's loop: the embedder's requests until the VM ends.
fn serve_requests(
    channel: &Channel,
    handle: &VmHandle,
    share: &mpsc::Sender<(ShareRequest, mpsc::Sender<Message>)>,
) {
    let ask_share = |request| {
        let (tx, rx) = mpsc::channel();
        match share.send((request, tx)).ok().and_then(|()| rx.recv().ok()) {
            Some(m) => m,
            None => Message::Failed {
                reason: "this VM has no page sharing".into(),
            },
        }
    };
    loop {
        if let Some(result) = handle.wait_timeout(Duration::ZERO) {
            let _ = channel.send(&ended(result), &[]);
            return;
        }
        match wait_readable(&[channel.as_fd()], END_POLL) {
            Ok(r) if r[0] => {}
            _ => continue,
        }
        let answer = match channel.recv() {
            Ok((Message::Stop, _)) => {
                handle.stop();
                let _ = channel.send(&ended(handle.wait()), &[]);
                return;
            }
            Ok((Message::SharePages, _)) => ask_share(ShareRequest::Pass),
            Ok((Message::KernelTextMissing, _)) => ask_share(ShareRequest::TextMissing),
            Ok((Message::AttachBlock { index, serial }, mut fds)) => {
                let file = std::fs::File::from(fds.remove(0));
                match handle.attach_block(index as usize, serial, file) {
                    Ok(()) => Message::Done,
                    Err(e) => Message::Failed {
                        reason: e.to_string(),
                    },
                }
            }
            Ok((Message::DetachBlock { index }, _)) => match handle.detach_block(index as usize) {
                Ok(()) => Message::Done,
                Err(e) => Message::Failed {
                    reason: e.to_string(),
                },
            },
            Ok((other, _)) => Message::Failed {
                reason: format!("not a request: {other:?}"),
            },
            Err(ChannelError::Closed) | Err(ChannelError::Io(_)) => {
                // The embedder is gone: so is the VM.
                handle.stop();
                let _ = handle.wait();
                return;
            }
            Err(e) => Message::Failed {
                reason: e.to_string(),
            },
        };
        let _ = channel.send(&answer, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Write;

    /// A regular file with `bytes`, open read-only, and what names it.
    fn boot_file(bytes: &[u8]) -> (File, tempfile::TempPath) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        let path = f.into_temp_path();
        (File::open(&path).unwrap(), path)
    }

    fn file_description(file: &File, path: &Path) -> FileDescription {
        FileDescription {
            fd: file.as_raw_fd(),
            name: path.to_path_buf(),
        }
    }

    #[test]
    fn the_kernel_initrd_and_kvm_descriptors_are_named_and_close_others_keeps_them() {
        let (kernel, kernel_path) = boot_file(b"\x7fELF kernel");
        let (initrd, initrd_path) = boot_file(b"070701 initrd");
        // Stands for /dev/kvm: what is checked here is the descriptor's number and life.
        let kvm = File::open("/dev/null").unwrap();
        let tap = File::open("/dev/zero").unwrap();
        let disk = tempfile::tempfile().unwrap();
        let desc = VmDescription {
            kernel: file_description(&kernel, &kernel_path),
            initrd: Some(file_description(&initrd, &initrd_path)),
            kvm_fd: kvm.as_raw_fd(),
            nets: vec![NetDescription {
                fd: tap.as_raw_fd(),
                mac: [2, 0, 0, 0, 0, 1],
                mtu: None,
            }],
            blocks: vec![
                BlockDescription {
                    serial: "a".into(),
                    read_only: false,
                    fd: Some(disk.as_raw_fd()),
                },
                BlockDescription {
                    serial: "empty".into(),
                    read_only: false,
                    fd: None,
                },
            ],
            ..VmDescription::default()
        };
        assert_eq!(
            desc.fds(),
            [
                kernel.as_raw_fd(),
                initrd.as_raw_fd(),
                kvm.as_raw_fd(),
                tap.as_raw_fd(),
                disk.as_raw_fd()
            ]
        );
        // The description survives its trip as JSON with its numbers and names.
        let json = serde_json::to_string(&desc).unwrap();
        assert_eq!(serde_json::from_str::<VmDescription>(&json).unwrap(), desc);

        // Descriptors the description does not name, below, between and above the named ones.
        let (channel, theirs) = Channel::pair().unwrap();
        let others: Vec<File> = (0..3).map(|_| File::open("/dev/null").unwrap()).collect();
        let mut keep = desc.fds();
        keep.push(channel.as_fd().as_raw_fd());
        keep.reverse(); // any order
        let closed: Vec<RawFd> = others
            .iter()
            .map(|f| f.as_raw_fd())
            .chain(std::iter::once(theirs.as_fd().as_raw_fd()))
            .collect();
        // SAFETY: the child makes raw system calls only (close_range, fcntl, exit): the test
        // harness has other threads, so it must not allocate or take a lock.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            close_others(&keep);
            let open = |fd: RawFd| {
                // SAFETY: F_GETFD reads a descriptor's flags; no memory.
                unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
            };
            let mut code = 0;
            for (i, &fd) in keep.iter().enumerate() {
                if !open(fd) {
                    code = 10 + i as i32;
                }
            }
            for (i, &fd) in closed.iter().enumerate() {
                if open(fd) {
                    code = 20 + i as i32;
                }
            }
            // SAFETY: ends this single-threaded child.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above; `status` is a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "{status:#x}");
        let code = libc::WEXITSTATUS(status);
        assert_eq!(
            code, 0,
            "10+i: kept descriptor i ({keep:?}) closed; 20+i: descriptor i ({closed:?}) left open"
        );
    }

    #[test]
    fn a_descriptor_named_twice_or_the_channels_is_refused() {
        let (kernel, _path) = boot_file(b"\x7fELF");
        let fd = kernel.as_raw_fd();
        let mut taken = Vec::new();
        // take_fd owns what it takes: give it a copy.
        let copy_fd = std::os::fd::IntoRawFd::into_raw_fd(kernel.try_clone().unwrap());
        let first = take_fd(copy_fd, fd, &mut taken).unwrap();
        let e = take_fd(copy_fd, fd, &mut taken).unwrap_err().to_string();
        assert!(e.contains("is not one the VMM process was given"), "{e}");
        let e = take_fd(fd, fd, &mut taken).unwrap_err().to_string();
        assert!(e.contains(&format!("descriptor {fd} ")), "{e}");
        let e = take_fd(2, fd, &mut taken).unwrap_err().to_string();
        assert!(e.contains("descriptor 2 "), "{e}");
        drop(first);
    }
}
