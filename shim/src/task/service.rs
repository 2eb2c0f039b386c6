//! The containerd task API (shim v2, `containerd.task.v2.Task`) of one pod's shim: each RPC
//! validates, calls the [`Sandbox`] or the agent, and maps errors ([`crate::error`]).
//!
//! The pod's sandbox container is its VM: Create boots it ([`Sandbox::boot`]); Start is a no-op
//! (the pause process is not run: the VM is what holds the pod); Kill stops the VM and the
//! sandbox exits with 128 + the signal (137 for the SIGKILL of StopPodSandbox); Wait, State and
//! Delete follow the VM's life. App containers are added to the VM
//! ([`Sandbox::add_container`]) and their processes run in the guest. Exec processes are in
//! [`super::exec`], Create's three roles in [`super::create`], events and watchers in
//! [`super::events`].
//!
//! One file over 600 lines on purpose: it is the one `impl Task for TaskService` block (a trait
//! impl cannot be split across files), kept to a screenful per RPC by delegating the long parts
//! to the modules above.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim_protos::api;
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskIO, TaskPaused, TaskResumed, TaskStart,
};
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use tokio::sync::Mutex;

use crate::agent::stdio;
use crate::error::{Error, Result};
use crate::oci;
use crate::task::bundle::Role;
use crate::task::container::{process_name, Containers, Kind};
use crate::task::events::{self, Events};
use crate::task::process::timestamp;
use crate::task::process::{wait_exit, Exit, State};

type TtrpcResult<T> = std::result::Result<T, containerd_shim_protos::ttrpc::Error>;

/// How long CloseIO lets the stdin copy deliver what containerd wrote.
const STDIN_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);
/// The status of a sandbox stopped by Delete or a failed create (SIGKILL).
const KILLED: u32 = 137;

/// The task service of one pod's shim.
#[derive(Clone)]
pub struct TaskService {
    pub(crate) events: Events,
    exit: Arc<ExitSignal>,
    pub(super) config_path: Option<PathBuf>,
    /// The socket this shim serves on, recorded in the pod's state directory at boot.
    pub(super) shim_socket: Option<String>,
    pub(crate) inner: Arc<Mutex<Containers>>,
}

impl TaskService {
    /// A service publishing to containerd through `publisher`; `config_path` is the handler's
    /// `ConfigPath` given to `start` (a Create's own options win over it); `shim_socket` is the
    /// socket it serves on.
    pub fn new(
        namespace: String,
        publisher: RemotePublisher,
        exit: Arc<ExitSignal>,
        config_path: Option<PathBuf>,
        shim_socket: Option<String>,
    ) -> Self {
        TaskService {
            events: Events::new(publisher, namespace),
            exit,
            config_path,
            shim_socket,
            inner: Arc::new(Mutex::new(Containers::default())),
        }
    }

    /// Lets the shim exit if it serves nothing any more: no container, and no pod of the
    /// Sandbox API before its ShutdownSandbox.
    pub(crate) async fn shutdown_if_idle(&self) {
        let inner = self.inner.lock().await;
        if inner.map.is_empty() && inner.api_pod.is_none() {
            log::info!("no containers left: the shim exits");
            self.exit.signal();
        }
    }

    /// Pause (`paused`) or Resume of app container `id` through the agent (cgroup freezer).
    async fn set_paused(&self, id: &str, paused: bool) -> Result<()> {
        let agent = {
            let inner = self.inner.lock().await;
            let c = inner.app(id)?;
            let want = if paused {
                State::Running
            } else {
                State::Paused
            };
            let now = c.init.state();
            if now != want {
                return Err(Error::FailedPrecondition(format!(
                    "container {id} is {}; cannot {}",
                    state_name(now),
                    if paused { "pause" } else { "resume" }
                )));
            }
            inner.sandbox()?.agent()
        };
        if paused {
            agent
                .pause_container(id)
                .await
                .map_err(Error::agent(format!("pausing container {id}")))?;
        } else {
            agent
                .resume_container(id)
                .await
                .map_err(Error::agent(format!("resuming container {id}")))?;
        }
        if let Ok(c) = self.inner.lock().await.get(id) {
            c.init.set(if paused {
                State::Paused
            } else {
                State::Running
            });
        }
        Ok(())
    }
}

/// A state as the old phase names read in errors.
fn state_name(s: State) -> &'static str {
    match s {
        State::Created => "Created",
        State::Running => "Running",
        State::Paused => "Paused",
        State::Exited(_) => "Stopped",
    }
}

#[async_trait]
impl Task for TaskService {
    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let spec = oci::read_spec(Path::new(&req.bundle))
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let annotations = oci::annotations(&spec);
        let pid = match Role::from_annotations(&req.id, &annotations) {
            Role::Sandbox => self.create_sandbox(&req, &spec, &annotations).await?,
            Role::App { sandbox_id } => self.create_app(&req, spec, &sandbox_id).await?,
            Role::Standalone => self.create_standalone(&req, spec, &annotations).await?,
        };
        self.events
            .publish(
                topics::TASK_CREATE_EVENT_TOPIC,
                Box::new(TaskCreate {
                    container_id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    rootfs: req.rootfs.clone(),
                    io: Some(TaskIO {
                        stdin: req.stdin.clone(),
                        stdout: req.stdout.clone(),
                        stderr: req.stderr.clone(),
                        terminal: req.terminal,
                        ..Default::default()
                    })
                    .into(),
                    checkpoint: req.checkpoint.clone(),
                    pid,
                    ..Default::default()
                }),
            )
            .await;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    async fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        if !req.exec_id.is_empty() {
            let pid = self.exec_start(&req.id, &req.exec_id).await?;
            return Ok(api::StartResponse {
                pid,
                ..Default::default()
            });
        }
        let app_to_start = {
            let inner = self.inner.lock().await;
            let c = inner.get(&req.id)?;
            c.is_app() && c.init.state() == State::Created
        };
        if app_to_start {
            let pod = self.inner.lock().await.sandbox()?;
            let pid = pod
                .agent()
                .start_container(&req.id)
                .await
                .map_err(Error::agent(format!("starting container {}", req.id)))?;
            let (outputs, handle) = {
                let mut inner = self.inner.lock().await;
                if let Ok(sandbox) = inner.sandbox() {
                    sandbox.app_container_started();
                }
                let c = inner.get_mut(&req.id)?;
                // Running before the watcher can record a (quick) exit.
                c.init.set(State::Running);
                (std::mem::take(&mut c.init.outputs), c.init.handle())
            };
            events::watch_process_exit(
                self.events.clone(),
                pod,
                (req.id.clone(), String::new()),
                pid,
                handle,
                outputs,
            );
        }
        let pid = {
            let inner = self.inner.lock().await;
            let c = inner.get(&req.id)?;
            match c.init.state() {
                State::Created => c.init.set(State::Running),
                State::Running | State::Paused => {}
                State::Exited(_) => {
                    return Err(Error::FailedPrecondition(format!(
                        "container {} has stopped",
                        req.id
                    ))
                    .into())
                }
            }
            c.init.pid
        };
        self.events
            .publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                }),
            )
            .await;
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    async fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        if !req.exec_id.is_empty() {
            return Ok(self.exec_state(&req).await?);
        }
        let inner = self.inner.lock().await;
        let c = inner.get(&req.id)?;
        let mut resp = api::StateResponse {
            id: req.id.clone(),
            bundle: c.bundle.clone(),
            pid: c.init.pid,
            // All of its stdio: a restarted containerd re-attaches the container's log to the
            // FIFOs this names (without them its output after the restart goes nowhere).
            stdin: c.init.fifos.stdin.clone(),
            stdout: c.init.fifos.stdout.clone(),
            stderr: c.init.fifos.stderr.clone(),
            terminal: c.init.fifos.terminal,
            ..Default::default()
        };
        set_status(&mut resp, c.init.state());
        Ok(resp)
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        if !req.exec_id.is_empty() {
            self.exec_kill(&req).await?;
            return Ok(api::Empty::new());
        }
        let inner = self.inner.lock().await;
        let c = inner.get(&req.id)?;
        // After the init's exit only `all` has something left to signal (what the init left in
        // the container), as with runc's `kill --all` of a stopped container.
        let exited = c.init.exit().is_some();
        if exited && !(req.all && c.is_app()) {
            return Err(Error::NotFound(format!("process of {} already finished", req.id)).into());
        }
        if req.signal == 0 {
            return Ok(api::Empty::new());
        }
        if c.is_app() {
            let agent = inner
                .pod
                .as_ref()
                .map(|p| p.agent())
                .ok_or_else(|| Error::container_not_found(&req.id))?;
            // An init that never started (its Start failed: the guest may fail any call) has
            // no exit watcher: a SIGKILL or SIGTERM ends it here, as runc's kill of a created
            // container does, so that containerd's cleanup (kill, wait, delete) can finish.
            let never_started = (c.init.state() == State::Created && matches!(req.signal, 9 | 15))
                .then(|| (c.init.handle(), c.init.pid));
            // A SIGKILL is the host's word: a guest that never reports the exit does not hold
            // the container (events::watch_kill).
            if !exited && never_started.is_none() && req.signal == 9 {
                events::watch_kill(
                    self.events.clone(),
                    (req.id.clone(), req.id.clone()),
                    c.init.pid,
                    c.init.handle(),
                );
            }
            drop(inner);
            let signalled = agent.signal_process(&req.id, "", req.signal, req.all).await;
            if let Some((handle, pid)) = never_started {
                if let Err(e) = &signalled {
                    log::debug!("signalling container {} that never started: {e}", req.id);
                }
                let exit = Exit::now(128u32.saturating_add(req.signal));
                handle.exited(exit);
                self.events.exit(&req.id, &req.id, pid, exit).await;
                return Ok(api::Empty::new());
            }
            return match signalled {
                Ok(()) => Ok(api::Empty::new()),
                // Nothing was left to signal: the process is gone, as containerd expects.
                Err(e) if exited => {
                    log::debug!("signalling what container {} left: {e}", req.id);
                    Err(Error::NotFound(format!("process of {} already finished", req.id)).into())
                }
                Err(e) => Err(Error::agent(format!("signalling container {}", req.id))(e).into()),
            };
        }
        let Some(pod) = inner.pod.as_ref().filter(|p| p.id() == req.id) else {
            return Err(Error::container_not_found(&req.id).into());
        };
        log::info!("sandbox {}: signal {} stops the VM", req.id, req.signal);
        pod.stop(128u32.saturating_add(req.signal));
        Ok(api::Empty::new())
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        let rx = self
            .inner
            .lock()
            .await
            .process(&req.id, &req.exec_id)?
            .watch();
        let exit = wait_exit(rx).await;
        Ok(api::WaitResponse {
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        if !req.exec_id.is_empty() {
            return Ok(self.exec_delete(&req).await?);
        }
        let (container, own_pod, pod) = {
            let mut inner = self.inner.lock().await;
            let c = inner
                .map
                .remove(&req.id)
                .ok_or_else(|| Error::container_not_found(&req.id))?;
            let own = if inner.pod.as_ref().is_some_and(|p| p.id() == req.id) {
                inner.pod.take()
            } else {
                None
            };
            (c, own, inner.pod.clone())
        };
        // Stdin copies still waiting for containerd to open a FIFO end now.
        stdio::release_stdin_fifo(&container.init.fifos.stdin);
        for e in container.execs().into_iter().flat_map(HashMap::values) {
            stdio::release_stdin_fifo(&e.fifos.stdin);
        }
        let exit = if let Some(own) = own_pod {
            // This container's VM (the sandbox, or a standalone container's): a sandbox deleted
            // while its VM runs (e.g. a failed RunPodSandbox) is stopped first.
            let end = own.teardown(KILLED).await;
            // A standalone container's exit is its own.
            match container.kind {
                Kind::App { .. } => container.init.exit().unwrap_or(Exit::from(&end)),
                Kind::Sandbox => Exit::from(&end),
            }
        } else {
            let exit = container.init.exit().unwrap_or(Exit::now(0));
            if let Some(pod) = pod {
                pod.remove_container(&req.id).await;
            }
            exit
        };
        self.events
            .publish(
                topics::TASK_DELETE_EVENT_TOPIC,
                Box::new(TaskDelete {
                    container_id: req.id.clone(),
                    pid: container.init.pid,
                    exit_status: exit.status,
                    exited_at: Some(timestamp(exit.at)).into(),
                    ..Default::default()
                }),
            )
            .await;
        Ok(api::DeleteResponse {
            pid: container.init.pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn pids(
        &self,
        _ctx: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        let (pid, agent) = {
            let inner = self.inner.lock().await;
            let c = inner.get(&req.id)?;
            // An app container whose init has exited (and is not deleted yet) answers with its
            // init's pid, as the sandbox does: a restarted containerd (1.7, 2.x) takes a task
            // whose Pids are empty for a shim left over from a crash and deletes it, so the
            // exit that happened while it was down would be lost (reported 255, "Unknown").
            let agent = if c.is_app() && c.init.exit().is_none() {
                Some(inner.sandbox()?.agent())
            } else {
                None
            };
            (c.init.pid, agent)
        };
        // The sandbox's process is the shim, which runs the VM; a running app container's are
        // the guest pids in its cgroup.
        let pids = match agent {
            None => vec![pid],
            Some(agent) => agent
                .list_pids(&req.id)
                .await
                .map_err(Error::agent(format!(
                    "listing the pids of container {}",
                    req.id
                )))?,
        };
        Ok(api::PidsResponse {
            processes: pids
                .into_iter()
                .map(|pid| containerd_shim_protos::types::task::ProcessInfo {
                    pid,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    async fn exec(
        &self,
        _ctx: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> TtrpcResult<api::Empty> {
        self.exec_add(&req).await?;
        Ok(api::Empty::new())
    }

    async fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let agent = {
            let inner = self.inner.lock().await;
            inner.app(&req.id)?;
            inner.process(&req.id, &req.exec_id)?;
            inner.sandbox()?.agent()
        };
        agent
            .resize_pty(&req.id, &req.exec_id, req.width, req.height)
            .await
            .map_err(Error::agent(format!(
                "resizing the terminal of {}",
                process_name(&req.id, &req.exec_id)
            )))?;
        Ok(api::Empty::new())
    }

    async fn close_io(
        &self,
        _ctx: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> TtrpcResult<api::Empty> {
        if !req.stdin {
            return Ok(api::Empty::new());
        }
        let (copy, agent) = {
            let mut inner = self.inner.lock().await;
            inner.app(&req.id)?;
            inner.process(&req.id, &req.exec_id)?;
            let agent = inner.sandbox()?.agent();
            let c = inner.get_mut(&req.id)?;
            let copy = if req.exec_id.is_empty() {
                c.init.stdin.take()
            } else {
                c.execs_mut()
                    .and_then(|e| e.get_mut(&req.exec_id))
                    .and_then(|e| e.stdin.take())
            };
            (copy, agent)
        };
        // What containerd already wrote goes through first: the copy reads the FIFO until it
        // is empty, then shuts the stream (the process sees EOF after the last byte). Only a
        // copy that does not end in time is cut in the agent.
        if let Some(copy) = copy {
            if copy.close(STDIN_DRAIN).await {
                return Ok(api::Empty::new());
            }
            log::warn!(
                "stdin of {}: copy still busy after {STDIN_DRAIN:?}",
                process_name(&req.id, &req.exec_id)
            );
        }
        agent
            .close_stdin(&req.id, &req.exec_id)
            .await
            .map_err(Error::agent(format!(
                "closing the stdin of {}",
                process_name(&req.id, &req.exec_id)
            )))?;
        Ok(api::Empty::new())
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        // The sandbox (the VM) answers with the whole guest's figures (agent Stats of "") and,
        // when the pod has a host cgroup, that cgroup's usage next to them (task::metrics):
        // containerd asks every task for its metrics (ListContainerStats without a filter) and
        // logs an error for each that fails.
        let (agent, agent_id, host, what) = {
            let inner = self.inner.lock().await;
            let c = inner.get(&req.id)?;
            if c.is_app() {
                let what = format!("reading the stats of container {}", req.id);
                (inner.sandbox()?.agent(), req.id.clone(), None, what)
            } else {
                if c.init.exit().is_some() {
                    return Err(
                        Error::NotFound(format!("the VM of sandbox {} has ended", req.id)).into(),
                    );
                }
                let what = format!("reading the guest's stats for sandbox {}", req.id);
                let sandbox = inner.sandbox()?;
                let host = sandbox.host_cgroup().map(|(_, usage)| usage);
                (sandbox.agent(), String::new(), host, what)
            }
        };
        let stats = agent.stats(&agent_id).await.map_err(Error::agent(what))?;
        let any = crate::task::metrics::metrics_any(&stats, host.as_ref())
            .map_err(|e| Error::Internal(e.to_string()))?;
        Ok(api::StatsResponse {
            stats: Some(any).into(),
            ..Default::default()
        })
    }

    async fn update(
        &self,
        _ctx: &TtrpcContext,
        req: api::UpdateTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        // The guest cgroup of the container first, then the host cgroup resized by the limit
        // rule with the pod cgroup's current limits (resources::cgroup; the VM's own size is
        // fixed at boot).
        let agent = {
            let inner = self.inner.lock().await;
            inner.app(&req.id)?;
            inner.sandbox()?.agent()
        };
        let resources = req
            .resources
            .as_ref()
            .map(|any| any.value.clone())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("update of {} without resources", req.id))
            })?;
        agent
            .update_container(&req.id, resources)
            .await
            .map_err(Error::agent(format!(
                "updating the resources of container {}",
                req.id
            )))?;
        let inner = self.inner.lock().await;
        inner.sandbox()?.resize_host_cgroup().map_err(|e| {
            Error::Internal(format!(
                "resizing the host cgroup after updating container {}: {e}",
                req.id
            ))
        })?;
        Ok(api::Empty::new())
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, true).await?;
        self.events
            .publish(
                topics::TASK_PAUSED_EVENT_TOPIC,
                Box::new(TaskPaused {
                    container_id: req.id.clone(),
                    ..Default::default()
                }),
            )
            .await;
        Ok(api::Empty::new())
    }

    async fn resume(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResumeRequest,
    ) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, false).await?;
        self.events
            .publish(
                topics::TASK_RESUMED_EVENT_TOPIC,
                Box::new(TaskResumed {
                    container_id: req.id.clone(),
                    ..Default::default()
                }),
            )
            .await;
        Ok(api::Empty::new())
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let inner = self.inner.lock().await;
        let task_pid = inner.map.get(&req.id).map(|c| c.init.pid).unwrap_or(0);
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").to_string(),
            ..Default::default()
        })
    }

    async fn shutdown(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ShutdownRequest,
    ) -> TtrpcResult<api::Empty> {
        self.shutdown_if_idle().await;
        Ok(api::Empty::new())
    }
}

/// A process's state as the task API's status, exit status and time.
pub(crate) fn set_status(resp: &mut api::StateResponse, state: State) {
    match state {
        State::Created => resp.set_status(api::Status::CREATED),
        State::Running => resp.set_status(api::Status::RUNNING),
        State::Paused => resp.set_status(api::Status::PAUSED),
        State::Exited(e) => {
            resp.set_status(api::Status::STOPPED);
            resp.exit_status = e.status;
            resp.exited_at = Some(timestamp(e.at)).into();
        }
    }
}
