//! A pod's VM ([`VmThread`]) with its connected, checked agent.

use std::path::Path;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::agent::{AgentClient, AgentInfo};
use crate::task::state_dir::StateDir;
use crate::vm::thread::{BootError, VmThread};
use crate::vm::{Backend, GuestSpec, UNKNOWN_STATUS};

/// How long connecting to a ready agent may take.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The exit status reported when the guest ends without being asked to and without a status of
/// its own (see [`crate::vm::EndReason::status`]).
pub const UNEXPECTED_EXIT_STATUS: u32 = UNKNOWN_STATUS;

/// How a task's process (or the VM) ended, as the task API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmExit {
    /// The status the task reports (128 + signal when killed).
    pub status: u32,
    /// When it ended.
    pub at: SystemTime,
}

/// A running pod VM with a checked agent.
pub struct SandboxVm {
    vm: VmThread,
    exited: watch::Receiver<Option<VmExit>>,
    agent: AgentClient,
    info: AgentInfo,
}

impl SandboxVm {
    /// Boots `spec` on `backend` (recording the VM's processes in `state`); returns once the
    /// agent reported ready and answered Check.
    pub async fn boot(
        backend: Backend,
        spec: GuestSpec,
        state: StateDir,
    ) -> Result<SandboxVm, BootError> {
        let record = Box::new(move |pids: &[u32]| {
            state.record_vm_processes(pids).map_err(|e| e.to_string())
        });
        let vm = VmThread::boot(backend, spec, record).await?;
        let connected = async {
            let agent = AgentClient::connect(
                vm.agent_socket(),
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
                let tail = vm.console_tail(20);
                vm.stop(UNEXPECTED_EXIT_STATUS);
                vm.wait().await;
                return Err(BootError::Agent(format!("{e}; console ends with:\n{tail}")));
            }
        };
        let (tx, exited) = watch::channel(None);
        let ended = vm.ended();
        tokio::spawn(async move {
            let end = crate::vm::thread::wait_end(ended).await;
            log::info!("pod VM ended: {}, exit status {}", end.reason, end.status);
            let _ = tx.send(Some(VmExit {
                status: end.status,
                at: end.at,
            }));
        });
        Ok(SandboxVm {
            vm,
            exited,
            agent,
            info,
        })
    }

    /// The guest's console log file.
    pub fn console_log(&self) -> &Path {
        self.vm.console_log()
    }

    /// The guest's facts from the agent's Check.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// One line on how the VM runs (backend, accelerator).
    pub fn detail(&self) -> &str {
        self.vm.detail()
    }

    /// The connected agent.
    pub fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    /// The VM's hybrid-vsock socket (for the agent's stdio streams).
    pub fn agent_socket(&self) -> &Path {
        self.vm.agent_socket()
    }

    /// Asks the VM to stop; it reports `status` as its exit. No-op once it has ended.
    pub fn stop(&self, status: u32) {
        self.vm.stop(status);
    }

    /// A receiver that turns `Some` once the VM has ended (and its thread has cleaned up).
    pub fn exited(&self) -> watch::Receiver<Option<VmExit>> {
        self.exited.clone()
    }

    /// Waits until the VM has ended.
    pub async fn wait(&self) -> VmExit {
        let mut rx = self.exited.clone();
        let exit = match rx.wait_for(Option::is_some).await {
            Ok(exit) => exit.unwrap_or_else(unexpected),
            Err(_) => unexpected(),
        };
        exit
    }
}

fn unexpected() -> VmExit {
    VmExit {
        status: UNEXPECTED_EXIT_STATUS,
        at: SystemTime::now(),
    }
}
