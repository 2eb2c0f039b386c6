//! A pod's VM, owned by one long-lived OS thread.
//!
//! The thread boots the guest with [`GuestVm`], records the VM's host processes in the pod's
//! state directory, waits for the agent's ready line (never knocking earlier: vhost-device-vsock
//! 0.3.0 can wedge, docs/qemu-backend.md), connects and checks the agent, then watches the VM
//! until it is told to stop or the guest ends by itself. Owning the VM on a plain thread, not a
//! tokio blocking task, matters: QEMU's children get `PR_SET_PDEATHSIG` tied to the thread that
//! spawned them, so that thread must live exactly as long as the VM.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};

use crate::agent::{AgentClient, AgentInfo};
use crate::guest_vm::{Backend, GuestSpec, GuestVm, SharedDir};
use crate::task::state_dir::StateDir;

/// How long the agent may take to print its ready line after the VM started.
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long connecting to a ready agent may take.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the VM thread looks whether the guest ended by itself.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);
/// The exit status reported when the guest ends without being asked to (crash, reboot).
pub const UNEXPECTED_EXIT_STATUS: u32 = 255;

/// How the VM ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmExit {
    /// The status the sandbox task reports (128 + signal when killed).
    pub status: u32,
    /// When it ended.
    pub at: SystemTime,
}

/// Why the VM could not be booted; the message is what the CRI user reads.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot start the pod's VM: {0}")]
    Start(String),
    #[error("the pod's VM booted but its agent did not come up: {0}")]
    Agent(String),
    #[error("cannot record the VM in the pod's state directory: {0}")]
    State(String),
    #[error("cannot start the VM thread: {0}")]
    Thread(std::io::Error),
    #[error("the VM thread ended before reporting")]
    ThreadGone,
}

enum Command {
    Stop { status: u32 },
}

/// A running pod VM with a checked agent.
pub struct SandboxVm {
    commands: mpsc::Sender<Command>,
    exited: watch::Receiver<Option<VmExit>>,
    agent: AgentClient,
    agent_socket: PathBuf,
    console_log: PathBuf,
    info: AgentInfo,
    detail: String,
}

impl SandboxVm {
    /// Boots `spec` on `backend` from a new VM thread, exporting `shared` over virtio-fs;
    /// returns once the agent answered Check.
    pub async fn boot(
        backend: Backend,
        spec: GuestSpec,
        shared: Option<SharedDir>,
        state: StateDir,
    ) -> Result<SandboxVm, SandboxError> {
        let console_log = crate::guest_vm::console_log_in(&spec.work_dir);
        let (ready_tx, ready_rx) = oneshot::channel();
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (exit_tx, exit_rx) = watch::channel(None);
        std::thread::Builder::new()
            .name("microvm-vm".to_string())
            .spawn(move || vm_thread(backend, spec, shared, state, ready_tx, cmd_rx, exit_tx))
            .map_err(SandboxError::Thread)?;
        let (agent_socket, detail) = ready_rx.await.map_err(|_| SandboxError::ThreadGone)??;
        let connected = async {
            let agent = AgentClient::connect(
                &agent_socket,
                agent_protocol::AGENT_VSOCK_PORT,
                AGENT_CONNECT_TIMEOUT,
            )
            .await?;
            let info = agent.check().await?;
            Ok::<_, crate::agent::AgentError>((agent, info))
        }
        .await;
        let (agent, info) = match connected {
            Ok(pair) => pair,
            Err(e) => {
                let tail = crate::guest_vm::console_tail(&console_log, 20);
                let _ = cmd_tx.send(Command::Stop {
                    status: UNEXPECTED_EXIT_STATUS,
                });
                let mut ended = exit_rx.clone();
                let _ = ended.wait_for(|e| e.is_some()).await;
                return Err(SandboxError::Agent(format!(
                    "{e}; console ends with:\n{tail}"
                )));
            }
        };
        log::info!(
            "agent ready: kernel {}, boot id {}",
            info.kernel_release,
            info.boot_id
        );
        Ok(SandboxVm {
            commands: cmd_tx,
            exited: exit_rx,
            agent,
            agent_socket,
            console_log,
            info,
            detail,
        })
    }

    /// The guest's console log file (for [`crate::guest_vm::console_tail`] off the async runtime).
    pub fn console_tail_source(&self) -> PathBuf {
        self.console_log.clone()
    }

    /// The last `lines` of the guest's console (kernel and agent log), for error messages.
    pub fn console_tail(&self, lines: usize) -> String {
        crate::guest_vm::console_tail(&self.console_log, lines)
    }

    /// The guest's facts from the agent's Check.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// One line on how the VM runs (backend, accelerator).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The connected agent.
    pub fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    /// The VM's hybrid-vsock socket (for the agent's stdio streams).
    pub fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    /// Asks the VM to stop; it reports `status` as its exit. No-op once it has ended.
    pub fn stop(&self, status: u32) {
        let _ = self.commands.send(Command::Stop { status });
    }

    /// A receiver that turns `Some` once the VM has ended (and its thread has cleaned up).
    pub fn exited(&self) -> watch::Receiver<Option<VmExit>> {
        self.exited.clone()
    }

    /// Waits until the VM has ended.
    pub async fn wait(&self) -> VmExit {
        let mut rx = self.exited.clone();
        loop {
            if let Some(exit) = *rx.borrow_and_update() {
                return exit;
            }
            if rx.changed().await.is_err() {
                // The thread is gone without a report: treat as ended now.
                return VmExit {
                    status: UNEXPECTED_EXIT_STATUS,
                    at: SystemTime::now(),
                };
            }
        }
    }
}

type Ready = Result<(PathBuf, String), SandboxError>;

fn vm_thread(
    backend: Backend,
    spec: GuestSpec,
    shared: Option<SharedDir>,
    state: StateDir,
    ready: oneshot::Sender<Ready>,
    commands: mpsc::Receiver<Command>,
    exited: watch::Sender<Option<VmExit>>,
) {
    let mut vm = match GuestVm::start_with_shared_dir(backend, &spec, shared.as_ref()) {
        Ok(vm) => vm,
        Err(e) => {
            let _ = ready.send(Err(SandboxError::Start(e.to_string())));
            return;
        }
    };
    if let Err(e) = state.record_vm_processes(&vm.pids()) {
        let _ = ready.send(Err(SandboxError::State(e.to_string())));
        return;
    }
    log::info!("pod VM started: {}", vm.detail());
    if let Err(e) = vm.wait_agent_ready(AGENT_READY_TIMEOUT) {
        let _ = ready.send(Err(SandboxError::Agent(e.to_string())));
        return;
    }
    log::info!(
        "agent's ready line {:?} after boot start",
        vm.started_at().elapsed()
    );
    if ready
        .send(Ok((
            vm.agent_socket().to_path_buf(),
            vm.detail().to_string(),
        )))
        .is_err()
    {
        // Nobody waits for this VM any more: it is dropped (stopped) below.
        return;
    }
    let status = loop {
        match commands.recv_timeout(WATCH_INTERVAL) {
            Ok(Command::Stop { status }) => {
                if let Err(e) = vm.stop() {
                    log::warn!("stopping the pod VM: {e}");
                }
                break status;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = vm.stop();
                break UNEXPECTED_EXIT_STATUS;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => match vm.wait_timeout(Duration::ZERO) {
                Ok(false) => {}
                Ok(true) => {
                    log::warn!(
                        "the pod VM ended by itself; console ends with:\n{}",
                        vm.console_tail(20)
                    );
                    break UNEXPECTED_EXIT_STATUS;
                }
                Err(e) => {
                    log::warn!("watching the pod VM: {e}");
                    let _ = vm.stop();
                    break UNEXPECTED_EXIT_STATUS;
                }
            },
        }
    };
    // Dropping the VM removes its work folder.
    drop(vm);
    let _ = state.record_vm_processes(&[]);
    let _ = exited.send(Some(VmExit {
        status,
        at: SystemTime::now(),
    }));
}
