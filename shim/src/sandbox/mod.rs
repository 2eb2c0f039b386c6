//! The pod: one VM with its agent and the host resources it uses. Everything that happens to a
//! pod as a whole is here, in the order it happens:
//!
//! - [`boot`]: every step of a pod's boot, in order ([`Sandbox::boot`]), undone on failure;
//! - [`container`]: an app container added to the VM (files shared, spec rewritten, created in
//!   the agent, stdio attached) with its rollback, and removed again;
//! - teardown ([`Sandbox::teardown`]): the VM stopped, the state directory cleaned up;
//! - [`port_forward`]: containerd's PortForward, caught on the pod netns's loopback, carried
//!   to the same port in the guest;
//! - [`pod_config`]: a pod created through containerd 2.x's Sandbox API (no spec: its CRI
//!   `PodSandboxConfig`) as the spec and annotations the boot reads;
//! - [`reclaim`]: a pod whose shim died, reclaimed from its state directory (by `<shim> delete`
//!   and by the sweep each new shim runs);
//! - [`spec`]: the one place that knows both the OCI spec and the VM (the VM's size from the
//!   pod's annotations, a container's spec rewritten for the guest, what a pod may not ask).
//!
//! The sandbox knows nothing of containerd's task API: [`crate::task`] calls it.

pub mod boot;
pub mod container;
pub mod pod_config;
pub mod port_forward;
pub mod reclaim;
pub mod spec;

use std::path::Path;

use containerd_shim_protos::ttrpc::Code;
use tokio::sync::watch;

use crate::agent::{AgentClient, AgentError, AgentInfo};
use crate::config::ConfigError;
use crate::resources::cgroup::oom::HostOom;
use crate::resources::cgroup::{self, CgroupError, HostCgroup, HostUsage};
use crate::resources::devices::{DeviceTable, DevicesError};
use crate::resources::network::{self, NetworkError};
use crate::resources::storage::{PodShare, ShareError};
use crate::state::{StateDir, StateError};
use crate::vm::thread::{BootError, VmThread};
use crate::vm::VmEnd;

pub use boot::BootRequest;
pub use container::NewContainer;

/// Why a pod operation failed; the message is what the CRI user reads.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Backend(#[from] crate::vm::PodBackendError),
    #[error("{0}")]
    Size(String),
    #[error("{0}")]
    StateName(StateError),
    #[error("{0}")]
    State(StateError),
    #[error("the pod's host cgroup: {0}")]
    Cgroup(#[from] CgroupError),
    #[error("setting up the pod network: {0}")]
    Network(#[from] NetworkError),
    #[error("the pod's shared folder: {0}")]
    Share(#[from] ShareError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error("{what}: {source}")]
    Agent { what: String, source: AgentError },
    #[error("{0}")]
    Spec(#[from] spec::SpecError),
    #[error("creating container {id}: {detail}")]
    Create { id: String, detail: String },
    #[error("pod {pod} of container {id} is not served by this shim")]
    OtherPod { pod: String, id: String },
    #[error("{0}")]
    Task(String),
    #[error(transparent)]
    Devices(#[from] DevicesError),
}

impl SandboxError {
    /// The ttrpc status code this failure maps to ([`crate::error::Error::code`]).
    pub fn code(&self) -> Code {
        match self {
            SandboxError::Config(_)
            | SandboxError::Size(_)
            | SandboxError::StateName(_)
            | SandboxError::Spec(_) => Code::INVALID_ARGUMENT,
            SandboxError::Backend(_) | SandboxError::Network(_) | SandboxError::Cgroup(_) => {
                Code::FAILED_PRECONDITION
            }
            SandboxError::State(_) | SandboxError::Share(_) | SandboxError::Task(_) => {
                Code::INTERNAL
            }
            SandboxError::OtherPod { .. } => Code::NOT_FOUND,
            SandboxError::Devices(e) if e.is_refusal() => Code::FAILED_PRECONDITION,
            SandboxError::Devices(_) => Code::UNKNOWN,
            SandboxError::Boot(_) | SandboxError::Agent { .. } | SandboxError::Create { .. } => {
                Code::UNKNOWN
            }
        }
    }
}

/// A running pod: its id, state directory, VM and checked agent.
pub struct Sandbox {
    id: String,
    state: StateDir,
    /// The pod's shared folder (`resources::storage`): where app containers' files go.
    share: std::sync::Arc<PodShare>,
    /// The pod's host cgroup, if it has one (resized by Update).
    host_cgroup: std::sync::Mutex<Option<HostCgroup>>,
    vm: VmThread,
    agent: AgentClient,
    info: AgentInfo,
    devices: DeviceTable,
    /// Whether an app container of the pod has started (the late page sharing pass runs once,
    /// after the first).
    app_started: std::sync::atomic::AtomicBool,
    /// Port-forward into the guest, when the host could catch the pod netns's loopback.
    port_forward: Option<port_forward::PortForward>,
}

impl Sandbox {
    /// The pod's id (the sandbox container's, or a standalone container's own).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The connected agent (clones share its connection).
    pub fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    /// The VM's hybrid-vsock socket (the agent's stdio streams).
    pub fn agent_socket(&self) -> &Path {
        self.vm.agent_socket()
    }

    /// The host cgroup's path, limits and usage, if the pod has one.
    pub fn host_cgroup(&self) -> Option<(HostCgroup, HostUsage)> {
        let cg = self.lock_cgroup().clone()?;
        let usage = cg.usage();
        Some((cg, usage))
    }

    /// Re-applies the host cgroup's limit rule after a container's resources changed (the pod
    /// cgroup kubelet resized); `None` when the pod has no host cgroup.
    pub fn resize_host_cgroup(&self) -> Result<Option<cgroup::overhead::Limits>, CgroupError> {
        let mut guard = self.lock_cgroup();
        match guard.as_mut() {
            Some(cg) => {
                let limits = cg.resize()?;
                log::info!("sandbox {}: resized {}", self.id, cg.describe());
                Ok(Some(limits))
            }
            None => Ok(None),
        }
    }

    /// Whether the host OOM killer ended processes of the pod (its VM's): the kernel's count
    /// in the pod's host cgroup, read while the cgroup exists. `None` without a host cgroup or
    /// without a kill.
    pub fn host_oom(&self) -> Option<HostOom> {
        self.lock_cgroup().as_ref()?.oom()
    }

    fn lock_cgroup(&self) -> std::sync::MutexGuard<'_, Option<HostCgroup>> {
        // A panic while holding it left plain data: keep using it.
        self.host_cgroup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The guest's facts from the agent's Check at boot.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// A receiver that turns `Some` once the VM has ended.
    pub fn ended(&self) -> watch::Receiver<Option<VmEnd>> {
        self.vm.ended()
    }

    /// Whether the VM has ended.
    pub fn has_ended(&self) -> bool {
        self.vm.ended().borrow().is_some()
    }

    /// Tells the pod that one of its app containers started. After the first, the VM runs one
    /// more page sharing pass (docs/page-sharing.md, "The late pass"): between the pass at boot
    /// and the first container the guest zeroes and frees more pages (about 1,400, 5.5 MiB, per
    /// pod in the lane's density run), which that pass drops.
    pub fn app_container_started(&self) {
        use std::sync::atomic::Ordering;
        if !self.app_started.swap(true, Ordering::Relaxed) {
            self.vm.share_pages_again();
        }
    }

    /// Asks the VM to stop; it reports `status` as its exit (128 + the signal of a Kill).
    pub fn stop(&self, status: u32) {
        self.vm.stop(status);
    }

    /// Stops the VM if it still runs (reporting `status`), waits for its end and releases the
    /// pod's host side ([`release_host_resources`]). Returns the VM's end.
    pub async fn teardown(&self, status: u32) -> VmEnd {
        if !self.has_ended() {
            self.vm.stop(status);
        }
        if let Some(forward) = &self.port_forward {
            forward.stop();
        }
        let end = self.vm.wait().await;
        match release_host_resources(&self.state).await {
            Ok(report) => log::info!("sandbox {}: cleaned up {report}", self.id),
            Err(e) => log::warn!("sandbox {}: cleanup: {e}", self.id),
        }
        end
    }
}

/// Undoes the pod's host side after its VM ended (or never started): the pod network (taps and
/// tc filters in the pod netns, from the state directory's record), the recorded VM processes
/// killed, the host cgroup (this process moved back, the cgroup removed), then the state
/// directory (mounts, the directory itself). The same order as `<shim> delete` after a crash.
/// A step that fails does not stop the others from running (a network that cannot be torn down
/// must not leave the VM's processes, its cgroup or the share's mounts behind); the directory
/// itself, with its undo records, is then kept for a later `<shim> delete` to retry, and the
/// failures are reported together.
pub(crate) async fn release_host_resources(state: &StateDir) -> Result<String, String> {
    let network = network::teardown(&state.network_record())
        .await
        .map_err(|e| format!("tearing down the pod network: {e}"));
    let state = state.clone();
    let network_failed = network.is_err();
    let rest = tokio::task::spawn_blocking(move || release_rest(&state, network_failed))
        .await
        .map_err(|e| format!("cleanup task: {e}"))
        .and_then(|r| r);
    match (network, rest) {
        (Ok(network), Ok(report)) => Ok(format!("network {network:?}, {report}")),
        (Err(network), Ok(report)) => Err(format!("{network} (released besides: {report})")),
        (Ok(_), Err(rest)) => Err(rest),
        (Err(network), Err(rest)) => Err(format!("{network}; {rest}")),
    }
}

/// The blocking part of a release (also `<shim> delete`'s): VM processes, host cgroup, state
/// directory, in that order (a cgroup with live processes cannot be removed, and its record
/// lives in the state directory).
pub fn release_cgroup_and_state(state: &StateDir) -> Result<String, String> {
    release_rest(state, false)
}

/// [`release_cgroup_and_state`] after a network teardown that failed if `keep_records`: the
/// mounts are detached either way, the directory removed only when every step succeeded.
fn release_rest(state: &StateDir, keep_records: bool) -> Result<String, String> {
    let killed = state.kill_vm_processes();
    let cgroup = cgroup::release(&state.cgroup_record())
        .map_err(|e| format!("removing the host cgroup: {e}"));
    if keep_records || cgroup.is_err() {
        let detached = state.detach_mounts().map_err(|e| e.to_string());
        return match (cgroup, detached) {
            (Ok(cgroup), Ok(mounts)) => Ok(format!(
                "cgroup {cgroup:?}, killed {killed:?}, {} mounts detached, state directory kept",
                mounts.len()
            )),
            (Err(cgroup), Ok(_)) => Err(cgroup),
            (Ok(_), Err(mounts)) => Err(mounts),
            (Err(cgroup), Err(mounts)) => Err(format!("{cgroup}; {mounts}")),
        };
    }
    let cgroup = cgroup?;
    let mut report = state.cleanup().map_err(|e| e.to_string())?;
    report.killed.extend(killed);
    Ok(format!("cgroup {cgroup:?}, {report:?}"))
}
