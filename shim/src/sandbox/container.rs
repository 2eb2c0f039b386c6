//! An app container in the pod's VM. Adding one, in order: its spec rewritten for the guest
//! ([`spec::rewrite_for_guest`]), its rootfs and bind sources mounted into the pod's shared
//! folder (`resources::storage`), the container created in the agent, its stdio FIFOs attached to
//! the agent's streams. Adding is one transaction: each step marks what it acquired, and a failed
//! step has one undo of what is marked, in reverse. Removing one undoes them all.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::agent::stdio::{self, Attached, Fifos};
use crate::resources::devices::{self, DevicesError};
use crate::resources::storage::RootfsMount;

use super::{spec, Sandbox, SandboxError};

/// Console lines quoted when a container operation fails.
const CONSOLE_TAIL_LINES: usize = 20;

/// An app container to add.
pub struct NewContainer {
    pub id: String,
    /// The bundle folder (its `rootfs` is the root when containerd passes no rootfs mounts).
    pub bundle: PathBuf,
    /// The container's OCI spec, as containerd wrote it.
    pub spec: crate::oci::Spec,
    pub rootfs: Vec<RootfsMount>,
    pub fifos: Fifos,
    /// The pod's app containers by pid, for a spec that joins another's PID namespace.
    pub pids: HashMap<u32, String>,
}

/// Why creating an app container in the guest failed, and whether the agent only did not
/// answer in time (then the guest console says more than the error).
struct CreateFailure {
    message: String,
    timed_out: bool,
}

impl From<String> for CreateFailure {
    fn from(message: String) -> Self {
        CreateFailure {
            message,
            timed_out: false,
        }
    }
}

/// What adding a container has acquired so far, each marked when it is acquired and undone
/// in reverse by [`Sandbox::undo_add`] on any error: the devices it holds (disk slots filled),
/// its files in the shared folder, the container in the agent.
#[derive(Default)]
struct Acquired {
    devices: bool,
    shared: bool,
    created: bool,
}

/// Why adding a container failed: before its files were shared (the error as it is), or from
/// sharing on (a create failure, which quotes the guest's console where it says more).
enum AddFailure {
    Early(SandboxError),
    Create(CreateFailure),
}

impl From<SandboxError> for AddFailure {
    fn from(e: SandboxError) -> Self {
        AddFailure::Early(e)
    }
}

impl From<CreateFailure> for AddFailure {
    fn from(f: CreateFailure) -> Self {
        AddFailure::Create(f)
    }
}

impl Sandbox {
    /// Adds app container `c` to the VM; returns its init's guest pid and stdio copies. One
    /// transaction: a step that fails has one undo ([`Self::undo_add`]).
    pub async fn add_container(&self, c: NewContainer) -> Result<(u32, Attached), SandboxError> {
        let id = c.id.clone();
        let mut acquired = Acquired::default();
        match self.add_steps(c, &mut acquired).await {
            Ok(added) => Ok(added),
            Err(failure) => Err(self.undo_add(&id, acquired, failure).await),
        }
    }

    /// The steps of adding `c`, in order, each marked in `acquired` once it holds something.
    async fn add_steps(
        &self,
        c: NewContainer,
        acquired: &mut Acquired,
    ) -> Result<(u32, Attached), AddFailure> {
        let NewContainer {
            id,
            bundle,
            mut spec,
            rootfs,
            fifos,
            pids,
        } = c;
        // Devices first: a refused device fails the create before anything is shared.
        let mut prepared = self
            .devices
            .prepare(&id, &spec)
            .map_err(SandboxError::from)?;
        acquired.devices = true;
        for a in std::mem::take(&mut prepared.attach) {
            if let Err(detail) = self.vm.attach_block(a.index, a.serial, a.file).await {
                return Err(SandboxError::Devices(DevicesError::Attach {
                    device: a.device,
                    detail,
                })
                .into());
            }
        }
        devices::oci::remove_devices(&mut spec, &prepared.removed);
        let block_devices: Vec<agent_protocol::agent::BlockDevice> = prepared
            .blocks
            .iter()
            .map(|b| agent_protocol::agent::BlockDevice {
                container_path: b.container_path.clone(),
                serial: b.serial.clone(),
                read_only: b.read_only,
                ..Default::default()
            })
            .collect();
        spec::resolve_target_pid_namespace(&mut spec, &pids);
        let binds = spec::rewrite_for_guest(&mut spec, &id, std::process::id())
            .map_err(SandboxError::from)?;
        // The container's files in the shared folder.
        let shared = {
            let (share, id) = (self.share.clone(), id.clone());
            let bundle_rootfs = bundle.join("rootfs");
            tokio::task::spawn_blocking(move || {
                share.share_container(&id, &rootfs, &bundle_rootfs, &binds)
            })
            .await
            .map_err(|e| SandboxError::Task(e.to_string()))?
        };
        shared.map_err(|e| CreateFailure::from(e.to_string()))?;
        acquired.shared = true;
        // The container in the agent.
        let json = serde_json::to_vec(&spec).map_err(|e| CreateFailure::from(e.to_string()))?;
        let request = agent_protocol::agent::CreateContainerRequest {
            container_id: id.clone(),
            oci_spec_json: json,
            stdio: Some(fifos.agent_stdio()).into(),
            block_devices,
            ..Default::default()
        };
        let pid = self
            .agent
            .create_container(request)
            .await
            .map_err(|e| CreateFailure {
                message: e.to_string(),
                timed_out: e.is_timeout(),
            })?;
        acquired.created = true;
        // Its stdio.
        let attached = stdio::attach(self.agent_socket(), &id, "", &fifos)
            .await
            .map_err(|e| CreateFailure::from(e.to_string()))?;
        Ok((pid, attached))
    }

    /// The one undo of a failed add: what `acquired` marks, in reverse (the container removed
    /// in the agent, its files unshared, its devices released). Returns the error for the CRI
    /// user; a create failure quotes the guest console when the agent only timed out.
    async fn undo_add(&self, id: &str, acquired: Acquired, failure: AddFailure) -> SandboxError {
        if acquired.created {
            if let Err(e) = self.agent.remove_container(id).await {
                log::warn!("container {id}: removing it in the guest after a failed create: {e}");
            }
        }
        if acquired.shared {
            self.unshare(id).await;
        }
        if acquired.devices {
            self.release_devices(id).await;
        }
        let CreateFailure { message, timed_out } = match failure {
            AddFailure::Early(e) => return e,
            AddFailure::Create(f) => f,
        };
        let tail = self.vm.console_tail(CONSOLE_TAIL_LINES);
        log::warn!("creating container {id} failed: {message}; guest console ends with:\n{tail}");
        // A timeout says nothing by itself: the guest's last words go to the user too.
        let detail = if timed_out {
            format!("{message}; guest console ends with:\n{tail}")
        } else {
            message
        };
        SandboxError::Create {
            id: id.to_string(),
            detail,
        }
    }

    /// Removes app container `id` from the guest and its files from the shared folder.
    pub async fn remove_container(&self, id: &str) {
        if let Err(e) = self.agent.remove_container(id).await {
            log::warn!("removing container {id} in the guest: {e}");
        }
        self.unshare(id).await;
        self.release_devices(id).await;
    }

    /// Container `id` no longer holds its devices: the slots nobody holds any more are emptied.
    async fn release_devices(&self, id: &str) {
        for index in self.devices.release(id) {
            if let Err(e) = self.vm.detach_block(index).await {
                log::warn!("container {id}: emptying disk slot {index}: {e}");
            }
        }
    }

    async fn unshare(&self, id: &str) {
        let (share, cid) = (self.share.clone(), id.to_string());
        let undone = tokio::task::spawn_blocking(move || share.unshare_container(&cid)).await;
        match undone {
            Ok(Err(e)) => log::warn!("unsharing container {id}: {e}"),
            Err(e) => log::warn!("unsharing container {id}: {e}"),
            Ok(Ok(())) => {}
        }
    }
}
