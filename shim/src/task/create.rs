//! Create, for each role a container can have ([`crate::task::bundle::Role`]): the pod's sandbox (boots the VM), an
//! app container (added to the pod's VM), a standalone container (`ctr run`: a VM of its own).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use containerd_shim_protos::api;

use crate::agent::stdio::{Attached, Fifos};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::oci::Spec;
use crate::resources::storage::RootfsMount;
use crate::sandbox::{spec, BootRequest, NewContainer, Sandbox, SandboxError};
use crate::task::container::{Container, Kind};
use crate::task::events;
use crate::task::options;
use crate::task::process::Process;
use crate::task::service::TaskService;

/// The status of a sandbox stopped by a failed create (SIGKILL).
const KILLED: u32 = 137;

impl TaskService {
    /// The shim's config: the path in `options` (a Create's runtime options), else the
    /// handler's `ConfigPath` given to `start`, else the default.
    pub(crate) fn load_config(
        &self,
        options: Option<&containerd_shim_protos::protobuf::well_known_types::any::Any>,
    ) -> Result<Config> {
        let from_request = match options {
            Some(any) => options::config_path_from_any(any)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?,
            None => None,
        };
        let path = from_request.or_else(|| self.config_path.clone());
        Ok(Config::load(path.as_deref())?)
    }

    /// Boots this shim's pod (one per shim) and records it.
    pub(super) async fn boot(
        &self,
        req: &api::CreateTaskRequest,
        spec: &Spec,
        annotations: &HashMap<String, String>,
        sysctls: HashMap<String, String>,
    ) -> Result<Arc<Sandbox>> {
        let config = self.load_config(req.options.as_ref())?;
        self.boot_pod(BootRequest {
            id: &req.id,
            shim_socket: self.shim_socket.as_deref(),
            spec,
            annotations,
            config,
            sysctls,
            overhead: Default::default(),
        })
        .await
    }

    /// Boots pod `req.id` if this shim runs none yet, and records it (the task API's sandbox
    /// and standalone containers, and the Sandbox API's StartSandbox).
    pub(crate) async fn boot_pod(&self, req: BootRequest<'_>) -> Result<Arc<Sandbox>> {
        if self.inner.lock().await.pod.is_some() {
            return Err(Error::AlreadyExists(format!(
                "this shim already runs a pod; cannot create sandbox {}",
                req.id
            )));
        }
        let sandbox = Arc::new(Sandbox::boot(req).await?);
        self.inner.lock().await.pod = Some(sandbox.clone());
        Ok(sandbox)
    }

    /// Create of the pod's sandbox: boots the VM; the sandbox's process is the shim itself.
    pub(super) async fn create_sandbox(
        &self,
        req: &api::CreateTaskRequest,
        spec: &Spec,
        annotations: &HashMap<String, String>,
    ) -> Result<u32> {
        // Before anything is made: a pod that needs the host's namespaces is refused.
        if let Some(refusal) = spec::refuse_host_namespaces(spec) {
            log::warn!("sandbox {}: refused: {refusal}", req.id);
            return Err(Error::InvalidArgument(format!(
                "sandbox {}: {refusal}",
                req.id
            )));
        }
        let sysctls = spec::pod_sysctls(spec);
        let sandbox = self.boot(req, spec, annotations, sysctls).await?;
        let pid = std::process::id();
        let init = Process::new(pid, Fifos::default(), Attached::default());
        events::watch_vm_exit(
            self.events.clone(),
            req.id.clone(),
            pid,
            init.handle(),
            sandbox.clone(),
        );
        events::watch_oom(
            self.events.clone(),
            sandbox.agent(),
            self.inner.clone(),
            sandbox.ended(),
        );
        self.inner.lock().await.map.insert(
            req.id.clone(),
            Container {
                bundle: req.bundle.clone(),
                kind: Kind::Sandbox,
                init,
            },
        );
        Ok(pid)
    }

    /// A container outside any CRI pod (`ctr run`): a VM of its own, named by the container,
    /// with the container as its only app container. Its exit is the container's; Delete ends
    /// the VM.
    pub(super) async fn create_standalone(
        &self,
        req: &api::CreateTaskRequest,
        spec: Spec,
        annotations: &HashMap<String, String>,
    ) -> Result<u32> {
        let sandbox = self.boot(req, &spec, annotations, HashMap::new()).await?;
        match self.create_app(req, spec, &req.id).await {
            Ok(pid) => {
                events::watch_oom(
                    self.events.clone(),
                    sandbox.agent(),
                    self.inner.clone(),
                    sandbox.ended(),
                );
                Ok(pid)
            }
            Err(e) => {
                self.inner.lock().await.pod = None;
                sandbox.teardown(KILLED).await;
                Err(e)
            }
        }
    }

    /// Create of an app container in pod `sandbox_id`'s VM.
    pub(super) async fn create_app(
        &self,
        req: &api::CreateTaskRequest,
        spec: Spec,
        sandbox_id: &str,
    ) -> Result<u32> {
        let (sandbox, pids) = {
            let inner = self.inner.lock().await;
            if inner.map.contains_key(&req.id) {
                return Err(Error::AlreadyExists(format!("container {} exists", req.id)));
            }
            let sandbox = inner
                .pod
                .clone()
                .filter(|p| p.id() == sandbox_id)
                .ok_or_else(|| SandboxError::OtherPod {
                    pod: sandbox_id.to_string(),
                    id: req.id.clone(),
                })?;
            (sandbox, inner.app_pids())
        };
        let fifos = Fifos {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let (pid, attached) = sandbox
            .add_container(NewContainer {
                id: req.id.clone(),
                bundle: PathBuf::from(&req.bundle),
                spec,
                rootfs: req
                    .rootfs
                    .iter()
                    .map(|m| RootfsMount {
                        fs_type: m.type_.clone(),
                        source: m.source.clone(),
                        options: m.options.clone(),
                    })
                    .collect(),
                fifos: fifos.clone(),
                pids,
            })
            .await?;
        self.inner.lock().await.map.insert(
            req.id.clone(),
            Container {
                bundle: req.bundle.clone(),
                kind: Kind::App {
                    execs: HashMap::new(),
                },
                init: Process::new(pid, fifos, attached),
            },
        );
        Ok(pid)
    }
}
