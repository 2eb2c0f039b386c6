//! containerd 2.x's Sandbox API (`containerd.runtime.sandbox.v1.Sandbox`), served next to the
//! task API on the pod shim's socket ([`super::serve`]) when the runtime handler has
//! `sandboxer = "shim"`: containerd then creates the pod here instead of through a pause
//! container's task (docs/testing-containerd.md has the calls and their order).
//!
//! Thin, like the task service: CreateSandbox reads the pod (its CRI `PodSandboxConfig`,
//! [`PodConfig`]) and refuses what a VM cannot do; StartSandbox boots the VM through the same
//! [`crate::sandbox`] code as the pause path ([`TaskService::boot_pod`]), after which the task
//! API's Create of app containers lands in it; StopSandbox ends the VM and releases the pod's
//! host side; WaitSandbox and SandboxStatus follow the VM's life; ShutdownSandbox lets the shim
//! exit. The pod is not a task: no task events are published for it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim_protos::protobuf::MessageField;
use containerd_shim_protos::sandbox_api as api;
use containerd_shim_protos::sandbox_async::Sandbox as SandboxApi;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::types::platform::Platform;

use crate::agent::stdio::{Attached, Fifos};
use crate::error::{Error, Result};
use crate::sandbox::pod_config::PodConfig;
use crate::sandbox::{spec, BootRequest, Sandbox};
use crate::task::container::ApiPod;
use crate::task::events;
use crate::task::process::timestamp;
use crate::task::process::{wait_exit, Exit, Process, State};
use crate::task::service::TaskService;

type TtrpcResult<T> = std::result::Result<T, containerd_shim_protos::ttrpc::Error>;

/// The status a pod ended by StopSandbox or ShutdownSandbox reports: it was asked to stop.
const STOPPED: u32 = 0;

/// The Sandbox API of one pod's shim; shares the task service's table (the pod's VM is the
/// one its app containers are created in).
#[derive(Clone)]
pub struct SandboxService {
    task: TaskService,
}

impl SandboxService {
    /// The Sandbox API beside `task`.
    pub fn new(task: TaskService) -> Self {
        SandboxService { task }
    }

    /// Runs `f` on pod `id`'s record; NotFound if this shim holds no such pod.
    async fn with_pod<T>(&self, id: &str, f: impl FnOnce(&ApiPod) -> T) -> Result<T> {
        let inner = self.task.inner.lock().await;
        match inner.api_pod.as_ref().filter(|p| p.id == id) {
            Some(p) => Ok(f(p)),
            None => Err(Error::NotFound(format!("sandbox {id} not found"))),
        }
    }

    /// The running VM of pod `id`, taken from the table (StopSandbox, ShutdownSandbox).
    async fn take_vm(&self, id: &str) -> Option<Arc<Sandbox>> {
        let mut inner = self.task.inner.lock().await;
        if inner.pod.as_ref().is_some_and(|p| p.id() == id) {
            inner.pod.take()
        } else {
            None
        }
    }

    /// Ends pod `id`'s VM if it runs (the host side released) and records the pod's exit.
    async fn stop(&self, id: &str) -> Result<Exit> {
        let handle = self.with_pod(id, |p| p.process.handle()).await?;
        if let Some(vm) = self.take_vm(id).await {
            log::info!("sandbox {id}: stopping its VM");
            let end = vm.teardown(STOPPED).await;
            handle.exited(Exit::from(&end));
        } else {
            // Never started, or its VM already ended (the watcher recorded that).
            handle.exited(Exit::now(STOPPED));
        }
        let rx = self.with_pod(id, |p| p.process.watch()).await?;
        Ok(wait_exit(rx).await)
    }

    async fn create(&self, req: &api::CreateSandboxRequest) -> Result<()> {
        let id = &req.sandbox_id;
        let pod = PodConfig::from_request(id, req.options.as_ref(), &req.netns_path)
            .map_err(|e| Error::InvalidArgument(format!("sandbox {id}: {e}")))?;
        // Before anything is made: what a pod in a VM cannot have.
        if let Some(refusal) = spec::refuse_host_namespaces(&pod.spec) {
            log::warn!("sandbox {id}: refused: {refusal}");
            return Err(Error::InvalidArgument(format!("sandbox {id}: {refusal}")));
        }
        let config = self.task.load_config(None)?;
        let mut inner = self.task.inner.lock().await;
        if let Some(other) = inner.api_pod.as_ref() {
            return Err(Error::AlreadyExists(format!(
                "this shim already holds sandbox {}; cannot create sandbox {id}",
                other.id
            )));
        }
        if inner.pod.is_some() {
            return Err(Error::AlreadyExists(format!(
                "this shim already runs a pod; cannot create sandbox {id}"
            )));
        }
        log::info!(
            "sandbox {id}: created through the Sandbox API (netns {:?})",
            req.netns_path
        );
        inner.api_pod = Some(ApiPod {
            id: id.clone(),
            pod,
            config: Some(config),
            created_at: SystemTime::now(),
            process: Process::new(std::process::id(), Fifos::default(), Attached::default()),
        });
        Ok(())
    }

    async fn start(&self, id: &str) -> Result<(u32, SystemTime)> {
        let (pod, config, handle) = {
            let mut inner = self.task.inner.lock().await;
            let p = inner
                .api_pod
                .as_mut()
                .filter(|p| p.id == id)
                .ok_or_else(|| Error::NotFound(format!("sandbox {id} not found")))?;
            if p.process.state() != State::Created {
                return Err(Error::FailedPrecondition(format!(
                    "sandbox {id} was started already"
                )));
            }
            let config = p.config.take().ok_or_else(|| {
                Error::FailedPrecondition(format!("sandbox {id} was started already"))
            })?;
            (p.pod.clone(), config, p.process.handle())
        };
        let sysctls = spec::pod_sysctls(&pod.spec);
        let vm = self
            .task
            .boot_pod(BootRequest {
                id,
                shim_socket: self.task.shim_socket.as_deref(),
                spec: &pod.spec,
                annotations: &pod.annotations,
                config,
                sysctls,
                overhead: pod.overhead,
            })
            .await?;
        let (pid, created_at) = self
            .with_pod(id, |p| {
                p.process.set(State::Running);
                (p.process.pid, p.created_at)
            })
            .await?;
        // The pod's exit is its VM's; OOM kills in the guest reach containerd as TaskOOM of
        // the app containers, as on the pause path.
        // A VM the host's OOM killer ended is told as such (events::told_host_oom).
        let pod_vm = vm.clone();
        let sandbox_events = self.task.events.clone();
        let sandbox_id = id.to_string();
        tokio::spawn(async move {
            let end = crate::vm::thread::wait_end(pod_vm.ended()).await;
            log::info!(
                "sandbox {sandbox_id}: VM ended, exit status {} ({})",
                end.status,
                end.reason
            );
            events::told_host_oom(&sandbox_events, &pod_vm, &sandbox_id).await;
            handle.exited(Exit::from(&end));
        });
        events::watch_oom(
            self.task.events.clone(),
            vm.agent(),
            self.task.inner.clone(),
            vm.ended(),
        );
        Ok((pid, created_at))
    }
}

/// The `containerd.types.Platform` architecture name of this build's target.
fn architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[async_trait]
impl SandboxApi for SandboxService {
    async fn create_sandbox(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateSandboxRequest,
    ) -> TtrpcResult<api::CreateSandboxResponse> {
        self.create(&req).await?;
        Ok(api::CreateSandboxResponse::default())
    }

    async fn start_sandbox(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartSandboxRequest,
    ) -> TtrpcResult<api::StartSandboxResponse> {
        let (pid, created_at) = self.start(&req.sandbox_id).await?;
        Ok(api::StartSandboxResponse {
            pid,
            created_at: Some(timestamp(created_at)).into(),
            ..Default::default()
        })
    }

    async fn platform(
        &self,
        _ctx: &TtrpcContext,
        req: api::PlatformRequest,
    ) -> TtrpcResult<api::PlatformResponse> {
        self.with_pod(&req.sandbox_id, |_| ()).await?;
        Ok(api::PlatformResponse {
            platform: MessageField::some(Platform {
                os: "linux".into(),
                architecture: architecture().into(),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    async fn stop_sandbox(
        &self,
        _ctx: &TtrpcContext,
        req: api::StopSandboxRequest,
    ) -> TtrpcResult<api::StopSandboxResponse> {
        // The VM holds every process of the pod: ending it is immediate, so the timeout has
        // nothing to wait for (CRI stopped the app containers first).
        self.stop(&req.sandbox_id).await?;
        Ok(api::StopSandboxResponse::default())
    }

    async fn wait_sandbox(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitSandboxRequest,
    ) -> TtrpcResult<api::WaitSandboxResponse> {
        let rx = self
            .with_pod(&req.sandbox_id, |p| p.process.watch())
            .await?;
        let exit = wait_exit(rx).await;
        Ok(api::WaitSandboxResponse {
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn sandbox_status(
        &self,
        _ctx: &TtrpcContext,
        req: api::SandboxStatusRequest,
    ) -> TtrpcResult<api::SandboxStatusResponse> {
        let (pid, created_at, state) = self
            .with_pod(&req.sandbox_id, |p| {
                (p.process.pid, p.created_at, p.process.state())
            })
            .await?;
        let mut info = HashMap::new();
        if req.verbose {
            if let Some(vm) = self.task.inner.lock().await.pod.clone() {
                info.insert("guestKernel".to_string(), vm.info().kernel_release.clone());
                if let Some((cg, _)) = vm.host_cgroup() {
                    info.insert("hostCgroup".to_string(), cg.describe());
                }
            }
        }
        let mut resp = api::SandboxStatusResponse {
            sandbox_id: req.sandbox_id.clone(),
            pid,
            // CRI's PodSandboxState names.
            state: match state {
                State::Running | State::Paused => "SANDBOX_READY",
                State::Created | State::Exited(_) => "SANDBOX_NOTREADY",
            }
            .to_string(),
            info,
            created_at: Some(timestamp(created_at)).into(),
            ..Default::default()
        };
        if let State::Exited(e) = state {
            resp.exited_at = Some(timestamp(e.at)).into();
        }
        Ok(resp)
    }

    async fn ping_sandbox(
        &self,
        _ctx: &TtrpcContext,
        req: api::PingRequest,
    ) -> TtrpcResult<api::PingResponse> {
        self.with_pod(&req.sandbox_id, |_| ()).await?;
        Ok(api::PingResponse::default())
    }

    async fn shutdown_sandbox(
        &self,
        _ctx: &TtrpcContext,
        req: api::ShutdownSandboxRequest,
    ) -> TtrpcResult<api::ShutdownSandboxResponse> {
        // Also after a failed CreateSandbox (containerd shuts the shim down then): no pod is
        // held, and the shim must still go.
        let id = &req.sandbox_id;
        match self.stop(id).await {
            Ok(_) | Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        {
            let mut inner = self.task.inner.lock().await;
            if inner.api_pod.as_ref().is_some_and(|p| p.id == *id) {
                inner.api_pod = None;
            }
        }
        log::info!("sandbox {id}: shut down");
        self.task.shutdown_if_idle().await;
        Ok(api::ShutdownSandboxResponse::default())
    }

    async fn sandbox_metrics(
        &self,
        _ctx: &TtrpcContext,
        req: api::SandboxMetricsRequest,
    ) -> TtrpcResult<api::SandboxMetricsResponse> {
        let id = &req.sandbox_id;
        self.with_pod(id, |_| ()).await?;
        let vm = self
            .task
            .inner
            .lock()
            .await
            .pod
            .clone()
            .filter(|p| p.id() == id)
            .ok_or_else(|| Error::NotFound(format!("the VM of sandbox {id} is not running")))?;
        let stats = vm.agent().stats("").await.map_err(Error::agent(format!(
            "reading the guest's stats for sandbox {id}"
        )))?;
        let host = vm.host_cgroup().map(|(_, usage)| usage);
        let data = crate::task::metrics::metrics_any(&stats, host.as_ref())
            .map_err(|e| Error::Internal(e.to_string()))?;
        let mut resp = api::SandboxMetricsResponse::default();
        let metric = resp.metrics.mut_or_insert_default();
        metric.timestamp = Some(timestamp(SystemTime::now())).into();
        metric.id = id.clone();
        metric.data = Some(data).into();
        Ok(resp)
    }
}
