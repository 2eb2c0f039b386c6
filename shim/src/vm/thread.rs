//! A pod's VM, owned by one long-lived OS thread.
//!
//! The thread boots the guest with [`GuestVm`], has the caller record the VM's host processes
//! (the pod's state directory, for cleanup after a crash), waits for the agent's ready event,
//! then watches the VM until it is told to stop or the guest ends by itself; the end is
//! published, typed, on a watch channel. Owning the VM on a plain thread, not a tokio blocking
//! task, matters: QEMU's children get `PR_SET_PDEATHSIG` tied to the thread that spawned them,
//! so that thread must live exactly as long as the VM.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};

use super::backend::Backend;
use super::console::{console_log_in, console_tail};
use super::end::{EndReason, VmEnd};
use super::guest::GuestVm;
use super::spec::GuestSpec;

/// How long the agent may take to report ready after the VM started.
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the VM thread looks whether the guest ended by itself.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);
/// Console lines quoted in logs and errors.
const TAIL_LINES: usize = 20;

/// Records the VM's host processes (empty once it has ended) before the VM is used.
pub type RecordPids = Box<dyn Fn(&[u32]) -> Result<(), String> + Send>;

/// Why the VM could not be booted; the message is what the CRI user reads.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot start the pod's VM: {0}")]
    Start(String),
    #[error("the pod's VM booted but its agent did not come up: {0}")]
    Agent(String),
    #[error("cannot record the VM in the pod's state directory: {0}")]
    Record(String),
    #[error("cannot start the VM thread: {0}")]
    Thread(std::io::Error),
    #[error("the VM thread ended before reporting")]
    ThreadGone,
}

/// The answer to a disk command: the error's message.
type DiskReply = oneshot::Sender<Result<(), String>>;

enum Command {
    Stop {
        status: u32,
    },
    AttachBlock {
        index: usize,
        serial: String,
        file: std::fs::File,
        reply: DiskReply,
    },
    DetachBlock {
        index: usize,
        reply: DiskReply,
    },
    /// One more page sharing pass (no answer: the VM thread logs what it did).
    SharePages,
}

/// A pod VM whose agent reported ready, on its own thread.
pub struct VmThread {
    commands: mpsc::Sender<Command>,
    ended: watch::Receiver<Option<VmEnd>>,
    agent_socket: PathBuf,
    console_log: PathBuf,
    detail: String,
}

impl VmThread {
    /// Boots `spec` on `backend` from a new thread; returns once the agent reported ready.
    pub async fn boot(
        backend: Backend,
        spec: GuestSpec,
        record: RecordPids,
    ) -> Result<VmThread, BootError> {
        let console_log = console_log_in(&spec.work_dir);
        let (ready_tx, ready_rx) = oneshot::channel();
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (end_tx, end_rx) = watch::channel(None);
        std::thread::Builder::new()
            .name("microvm-vm".to_string())
            .spawn(move || vm_thread(backend, spec, record, ready_tx, cmd_rx, end_tx))
            .map_err(BootError::Thread)?;
        let (agent_socket, detail) = ready_rx.await.map_err(|_| BootError::ThreadGone)??;
        Ok(VmThread {
            commands: cmd_tx,
            ended: end_rx,
            agent_socket,
            console_log,
            detail,
        })
    }

    /// The last `lines` of the guest's console (kernel and agent log), for error messages.
    pub fn console_tail(&self, lines: usize) -> String {
        console_tail(&self.console_log, lines)
    }

    /// The guest's console log file.
    pub fn console_log(&self) -> &Path {
        &self.console_log
    }

    /// One line on how the VM runs (backend, accelerator).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The VM's hybrid-vsock socket (the agent and its stdio streams).
    pub fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    /// Asks the VM to stop; it reports `status` as its exit. No-op once it has ended.
    pub fn stop(&self, status: u32) {
        let _ = self.commands.send(Command::Stop { status });
    }

    /// Asks the VM thread for one more page sharing pass (docs/page-sharing.md, "The late
    /// pass"), without waiting for it: a no-op for a VM without page sharing, or once it ended.
    pub fn share_pages_again(&self) {
        let _ = self.commands.send(Command::SharePages);
    }

    /// Fills empty disk slot `index` with `file` on the VM's thread.
    pub async fn attach_block(
        &self,
        index: usize,
        serial: String,
        file: std::fs::File,
    ) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::AttachBlock {
                index,
                serial,
                file,
                reply,
            })
            .map_err(|_| "the VM has ended".to_string())?;
        answer.await.map_err(|_| "the VM has ended".to_string())?
    }

    /// Empties disk slot `index` on the VM's thread.
    pub async fn detach_block(&self, index: usize) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::DetachBlock { index, reply })
            .map_err(|_| "the VM has ended".to_string())?;
        answer.await.map_err(|_| "the VM has ended".to_string())?
    }

    /// A receiver that turns `Some` once the VM has ended (and its thread has cleaned up).
    pub fn ended(&self) -> watch::Receiver<Option<VmEnd>> {
        self.ended.clone()
    }

    /// Waits until the VM has ended.
    pub async fn wait(&self) -> VmEnd {
        wait_end(self.ended.clone()).await
    }
}

/// Waits until `ended` says the VM ended; a thread gone without a report counts as lost now.
pub async fn wait_end(mut ended: watch::Receiver<Option<VmEnd>>) -> VmEnd {
    match ended.wait_for(Option::is_some).await {
        Ok(end) => end.clone().unwrap_or_else(|| lost("no report")),
        Err(_) => lost("the VM thread ended without a report"),
    }
}

fn lost(why: &str) -> VmEnd {
    let reason = EndReason::Lost(why.to_string());
    VmEnd {
        status: reason.status(),
        reason,
        at: SystemTime::now(),
    }
}

type Ready = Result<(PathBuf, String), BootError>;

/// A tap in a network namespace made for it alone (empty, and gone with the tap's descriptor,
/// which holds it): a network card of the capture VM exists, as the pod's does, but reaches
/// nothing.
fn isolated_tap() -> std::io::Result<std::os::fd::OwnedFd> {
    std::thread::Builder::new()
        .name("capture-tap".into())
        .spawn(|| {
            // SAFETY: unshare(CLONE_NEWNET) moves only this thread (one of its own, which ends
            // right after) into a new network namespace; no memory is involved.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            crate::resources::network::open_tap("capture0").map_err(std::io::Error::other)
        })?
        .join()
        .map_err(|_| std::io::Error::other("the tap thread panicked"))?
}

/// Boots the VM of [`GuestSpec::kernel_text_capture`] (one that sees no pod input: an empty
/// share, taps that reach nothing, empty disk slots), waits for its agent, captures its kernel
/// text as the template, and stops it. A failure is logged: the pod then shares no kernel text
/// (its pass says so).
fn capture_kernel_text(spec: &GuestSpec) {
    let started = std::time::Instant::now();
    let mut empty = spec.work_dir.clone().into_os_string();
    empty.push("-capture-share");
    let empty = PathBuf::from(empty);
    let result = (|| {
        let taps = spec
            .nics
            .iter()
            .map(|_| isolated_tap().map(std::sync::Arc::new))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| format!("a tap for the capture VM: {e}"))?;
        let _ = std::fs::remove_dir_all(&empty);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&empty)
            .map_err(|e| format!("{}: {e}", empty.display()))?;
        let Some(capture) = spec.kernel_text_capture(&empty, taps) else {
            return Ok(false);
        };
        let mut vm = GuestVm::start(Backend::Kvm, &capture).map_err(|e| e.to_string())?;
        let captured = vm
            .wait_agent_ready(AGENT_READY_TIMEOUT)
            .and_then(|()| vm.capture_kernel_text());
        if let Err(e) = vm.stop() {
            log::warn!("page sharing: stopping the capture VM: {e}");
        }
        captured.map_err(|e| e.to_string())
    })();
    let _ = std::fs::remove_dir_all(&empty);
    match result {
        Ok(true) => log::info!(
            "page sharing: the kernel text template was captured from a VM that saw no pod \
             input in {:?}",
            started.elapsed()
        ),
        Ok(false) => log::info!(
            "page sharing: the capture VM captured no kernel text template (another pod's did, \
             or the kernel has no text range)"
        ),
        Err(e) => log::warn!(
            "page sharing: capturing the kernel text template failed (this pod shares no \
             kernel text): {e}"
        ),
    }
}

fn vm_thread(
    backend: Backend,
    spec: GuestSpec,
    record: RecordPids,
    ready: oneshot::Sender<Ready>,
    commands: mpsc::Receiver<Command>,
    ended: watch::Sender<Option<VmEnd>>,
) {
    let mut vm = match GuestVm::start(backend, &spec) {
        Ok(vm) => vm,
        Err(e) => {
            let _ = ready.send(Err(BootError::Start(e.to_string())));
            return;
        }
    };
    if let Err(e) = record(&vm.pids()) {
        let _ = ready.send(Err(BootError::Record(e)));
        return;
    }
    log::info!("pod VM started: {}", vm.detail());
    if let Err(e) = vm.wait_agent_ready(AGENT_READY_TIMEOUT) {
        let _ = ready.send(Err(BootError::Agent(e.to_string())));
        let _ = record(&[]);
        return;
    }
    log::info!(
        "agent ready {:?} after boot start",
        vm.started_at().elapsed()
    );
    // Page sharing, before the sandbox is reported ready (docs/page-sharing.md). The kernel
    // text template is never taken from this pod's guest: if none was captured yet (the first
    // pod after a host boot), a VM that sees no pod input is booted and captures it first.
    // (The VMM logs what the pass did.)
    match vm.kernel_text_template_missing() {
        Some(Ok(true)) => capture_kernel_text(&spec),
        Some(Err(e)) => log::warn!("page sharing: looking for the kernel text template: {e}"),
        Some(Ok(false)) | None => {}
    }
    if let Some(Err(e)) = vm.share_pages() {
        log::warn!("page sharing failed (the pod runs without it): {e}");
    }
    if ready
        .send(Ok((
            vm.agent_socket().to_path_buf(),
            vm.detail().to_string(),
        )))
        .is_err()
    {
        // Nobody waits for this VM any more: it is dropped (stopped) below.
        let _ = record(&[]);
        return;
    }
    let (reason, asked) = loop {
        match commands.recv_timeout(WATCH_INTERVAL) {
            Ok(Command::AttachBlock {
                index,
                serial,
                file,
                reply,
            }) => {
                let _ = reply.send(
                    vm.attach_block(index, serial, file)
                        .map_err(|e| e.to_string()),
                );
            }
            Ok(Command::DetachBlock { index, reply }) => {
                let _ = reply.send(vm.detach_block(index).map_err(|e| e.to_string()));
            }
            Ok(Command::SharePages) => match vm.share_pages() {
                // No page sharing on this VM (off, or the QEMU backend).
                None => {}
                Some(Ok(())) => log::info!(
                    "page sharing: that was the late pass, after the pod's first app container \
                     started"
                ),
                Some(Err(e)) => {
                    log::warn!("page sharing: the late pass failed (the pod runs on): {e}")
                }
            },
            Ok(Command::Stop { status }) => {
                if let Err(e) = vm.stop() {
                    log::warn!("stopping the pod VM: {e}");
                }
                break (EndReason::Stopped, Some(status));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = vm.stop();
                break (EndReason::Stopped, None);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => match vm.wait_timeout(Duration::ZERO) {
                Ok(None) => {}
                Ok(Some(reason)) => {
                    log::warn!(
                        "the pod VM ended by itself ({reason}); console ends with:\n{}",
                        vm.console_tail(TAIL_LINES)
                    );
                    break (reason, None);
                }
                Err(e) => {
                    log::warn!("watching the pod VM: {e}");
                    let _ = vm.stop();
                    break (EndReason::Lost(e.to_string()), None);
                }
            },
        }
    };
    // Dropping the VM removes its work folder.
    drop(vm);
    let _ = record(&[]);
    let status = asked.unwrap_or_else(|| reason.status());
    let _ = ended.send(Some(VmEnd {
        reason,
        status,
        at: SystemTime::now(),
    }));
}
