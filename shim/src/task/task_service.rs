//! The containerd task API (shim v2, `containerd.task.v2.Task`) of one pod's shim.
//!
//! The pod's sandbox container is its VM: Create boots it (sized from the sandbox annotations)
//! and checks the agent; Start is a no-op (the pause process is not run: the VM is what holds
//! the pod); Kill stops the VM and the sandbox exits with 128 + the signal (137 for the SIGKILL
//! of StopPodSandbox); Wait, State and Delete follow the VM's life. Events TaskCreate,
//! TaskStart, TaskExit and TaskDelete go to containerd through its publisher.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim_protos::api;
use containerd_shim_protos::events::task::{TaskCreate, TaskDelete, TaskExit, TaskIO, TaskStart};
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc::{self, r#async::TtrpcContext, Code};
use tokio::sync::{watch, Mutex};

use crate::config::{Config, Hypervisor};
use crate::guest_vm::{Backend, GuestSpec, SharedDir};
use crate::task::bundle::{self, Role};
use crate::task::guest_spec;
use crate::task::options;
use crate::task::sandbox_vm::{SandboxVm, VmExit};
use crate::task::service::timestamp;
use crate::task::share::{self, RootfsMount};
use crate::task::state_dir::{state_root, StateDir};
use crate::task::stdio::{self, Fifos};

type TtrpcResult<T> = Result<T, ttrpc::Error>;

/// Each WaitProcess call to the agent is bounded by this; the wait is renewed until the exit.
const APP_WAIT_SLICE: std::time::Duration = std::time::Duration::from_secs(3600);

fn status(code: Code, message: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message.into()))
}

/// Where a container is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Created,
    Running,
    Stopped,
}

/// A container this shim serves: the pod's sandbox (its VM) or an app container in the VM.
struct Container {
    bundle: String,
    pid: u32,
    phase: Phase,
    exit: watch::Receiver<Option<VmExit>>,
    /// For app containers: where their exit is reported (the sandbox's comes from the VM).
    app_exit: Option<Arc<watch::Sender<Option<VmExit>>>>,
}

/// The pod: its state directory and VM.
struct Pod {
    id: String,
    state: StateDir,
    vm: SandboxVm,
}

#[derive(Default)]
struct Inner {
    pod: Option<Pod>,
    containers: HashMap<String, Container>,
}

/// The task service of one pod's shim.
#[derive(Clone)]
pub struct TaskService {
    namespace: String,
    publisher: Arc<RemotePublisher>,
    exit: Arc<ExitSignal>,
    config_path: Option<PathBuf>,
    inner: Arc<Mutex<Inner>>,
}

impl TaskService {
    /// A service publishing to containerd through `publisher`; `config_path` is the handler's
    /// `ConfigPath` given to `start` (a Create's own options win over it).
    pub fn new(
        namespace: String,
        publisher: RemotePublisher,
        exit: Arc<ExitSignal>,
        config_path: Option<PathBuf>,
    ) -> Self {
        TaskService {
            namespace,
            publisher: Arc::new(publisher),
            exit,
            config_path,
            inner: Arc::new(Mutex::new(Inner::default())),
        }
    }

    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let ctx = ttrpc::context::Context::default();
        if let Err(e) = self
            .publisher
            .publish(ctx, topic, &self.namespace, event)
            .await
        {
            log::warn!("publishing {topic}: {e}");
        }
    }

    fn load_config(&self, req: &api::CreateTaskRequest) -> TtrpcResult<Config> {
        let from_request = match req.options.as_ref() {
            Some(any) => options::config_path_from_any(any)
                .map_err(|e| status(Code::INVALID_ARGUMENT, format!("microvm: {e}")))?,
            None => None,
        };
        let path = from_request.or_else(|| self.config_path.clone());
        Config::load(path.as_deref()).map_err(|e| status(Code::INVALID_ARGUMENT, e.to_string()))
    }

    async fn create_sandbox(
        &self,
        req: &api::CreateTaskRequest,
        annotations: &HashMap<String, String>,
    ) -> TtrpcResult<u32> {
        if self.inner.lock().await.pod.is_some() {
            return Err(status(
                Code::ALREADY_EXISTS,
                format!(
                    "microvm: this shim already runs a pod; cannot create sandbox {}",
                    req.id
                ),
            ));
        }
        let config = self.load_config(req)?;
        let backend = match config.hypervisor {
            Hypervisor::Kvm => {
                let report = crate::host_check::probe(Some(&config.kernel));
                if let Some(reason) = report.linux_guest_blocker() {
                    return Err(status(
                        Code::FAILED_PRECONDITION,
                        format!(
                            "microvm: this host cannot boot the guest under KVM: {reason} \
                             (hypervisor = \"qemu\" in the config runs it under QEMU)"
                        ),
                    ));
                }
                Backend::Kvm
            }
            Hypervisor::Qemu => Backend::Qemu,
        };
        let size = config
            .vm_size(annotations)
            .map_err(|e| status(Code::INVALID_ARGUMENT, format!("microvm: {e}")))?;
        let state = StateDir::new(&state_root(), &req.id)
            .map_err(|e| status(Code::INVALID_ARGUMENT, format!("microvm: {e}")))?;
        state
            .create(std::process::id())
            .map_err(|e| status(Code::INTERNAL, format!("microvm: {e}")))?;
        let spec = GuestSpec {
            kernel: config.kernel.clone(),
            initrd: config.initrd.clone(),
            vcpus: size.vcpus,
            memory_mib: size.memory_mib,
            work_dir: state.vm_dir(),
            agent_log_level: Some(config.log_level.clone()),
            hostname: bundle::read_spec(std::path::Path::new(&req.bundle))
                .ok()
                .and_then(|spec| spec["hostname"].as_str().map(str::to_owned)),
        };
        log::info!(
            "sandbox {}: booting a {} VM with {} vCPUs, {} MiB",
            req.id,
            backend,
            size.vcpus,
            size.memory_mib
        );
        let shared_dir = state.shared_dir();
        if let Err(e) = std::fs::create_dir_all(&shared_dir) {
            let _ = state.cleanup();
            return Err(status(
                Code::INTERNAL,
                format!("microvm: creating {}: {e}", shared_dir.display()),
            ));
        }
        let shared = SharedDir {
            tag: crate::task::guest_spec::SHARED_FS_TAG.to_string(),
            host_dir: shared_dir,
        };
        let vm = match SandboxVm::boot(backend, spec, Some(shared), state.clone()).await {
            Ok(vm) => vm,
            Err(e) => {
                if let Err(c) = state.cleanup() {
                    log::warn!("cleaning up after a failed boot: {c}");
                }
                return Err(status(Code::UNKNOWN, format!("microvm: {e}")));
            }
        };
        log::info!(
            "sandbox {}: VM ready ({}), guest kernel {}, boot id {}",
            req.id,
            vm.detail(),
            vm.info().kernel_release,
            vm.info().boot_id
        );
        let pid = std::process::id();
        let exit = vm.exited();
        let mut inner = self.inner.lock().await;
        inner.pod = Some(Pod {
            id: req.id.clone(),
            state,
            vm,
        });
        inner.containers.insert(
            req.id.clone(),
            Container {
                bundle: req.bundle.clone(),
                pid,
                phase: Phase::Created,
                exit: exit.clone(),
                app_exit: None,
            },
        );
        drop(inner);
        self.spawn_exit_monitor(req.id.clone(), pid, exit);
        Ok(pid)
    }

    /// Publishes TaskExit and marks the container stopped once the VM has ended.
    fn spawn_exit_monitor(&self, id: String, pid: u32, mut exit: watch::Receiver<Option<VmExit>>) {
        let service = self.clone();
        tokio::spawn(async move {
            let ended = loop {
                if let Some(e) = *exit.borrow_and_update() {
                    break e;
                }
                if exit.changed().await.is_err() {
                    return;
                }
            };
            if let Some(c) = service.inner.lock().await.containers.get_mut(&id) {
                c.phase = Phase::Stopped;
            }
            log::info!("sandbox {id}: VM ended, exit status {}", ended.status);
            service
                .publish(
                    topics::TASK_EXIT_EVENT_TOPIC,
                    Box::new(TaskExit {
                        container_id: id.clone(),
                        id: id.clone(),
                        pid,
                        exit_status: ended.status,
                        exited_at: Some(timestamp(ended.at)).into(),
                        ..Default::default()
                    }),
                )
                .await;
        });
    }

    /// Create of an app container: its rootfs and bind sources go into the pod's shared
    /// directory, its spec is rewritten for the guest, the agent creates it, and its stdio
    /// FIFOs are attached to the agent's stdio streams.
    async fn create_app(
        &self,
        req: &api::CreateTaskRequest,
        mut spec: serde_json::Value,
        sandbox_id: &str,
    ) -> TtrpcResult<u32> {
        let (agent, socket, state, console) = {
            let inner = self.inner.lock().await;
            if inner.containers.contains_key(&req.id) {
                return Err(status(
                    Code::ALREADY_EXISTS,
                    format!("microvm: container {} exists", req.id),
                ));
            }
            let pod = inner
                .pod
                .as_ref()
                .filter(|p| p.id == sandbox_id)
                .ok_or_else(|| {
                    status(
                        Code::NOT_FOUND,
                        format!(
                            "microvm: pod {sandbox_id} of container {} is not served by this shim",
                            req.id
                        ),
                    )
                })?;
            (
                pod.vm.agent(),
                pod.vm.agent_socket().to_path_buf(),
                pod.state.clone(),
                pod.vm.console_tail_source(),
            )
        };
        let binds = guest_spec::rewrite_for_guest(&mut spec, &req.id)
            .map_err(|e| status(Code::INVALID_ARGUMENT, format!("microvm: {e}")))?;
        let rootfs: Vec<RootfsMount> = req
            .rootfs
            .iter()
            .map(|m| RootfsMount {
                fs_type: m.type_.clone(),
                source: m.source.clone(),
                options: m.options.clone(),
            })
            .collect();
        let fifos = Fifos {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let id = req.id.clone();
        let bundle_rootfs = PathBuf::from(&req.bundle).join("rootfs");
        let created = tokio::task::spawn_blocking(move || -> Result<u32, String> {
            share::share_container(&state, &id, &rootfs, &bundle_rootfs, &binds)
                .map_err(|e| e.to_string())?;
            let undo = |msg: String| {
                let _ = share::unshare_container(&state, &id);
                msg
            };
            let json = serde_json::to_vec(&spec).map_err(|e| undo(e.to_string()))?;
            let request = agent_protocol::agent::CreateContainerRequest {
                container_id: id.clone(),
                oci_spec_json: json,
                stdio: Some(agent_protocol::agent::Stdio {
                    terminal: fifos.terminal,
                    stdin: !fifos.stdin.is_empty(),
                    stdout: !fifos.stdout.is_empty(),
                    stderr: !fifos.stderr.is_empty() && !fifos.terminal,
                    ..Default::default()
                })
                .into(),
                ..Default::default()
            };
            let pid = agent
                .create_container(&request)
                .map_err(|e| undo(e.to_string()))?;
            if let Err(e) = stdio::attach(&socket, &id, "", &fifos) {
                let _ = agent.remove_container(&id);
                return Err(undo(e.to_string()));
            }
            Ok(pid)
        })
        .await
        .map_err(|e| status(Code::INTERNAL, format!("microvm: {e}")))?;
        let pid = created.map_err(|e| {
            let tail = crate::guest_vm::console_tail(&console, CONSOLE_TAIL_LINES);
            log::warn!(
                "creating container {} failed: {e}; guest console ends with:\n{tail}",
                req.id
            );
            // A timeout says nothing by itself: the guest's last words go to the user too.
            let detail = if e.contains("did not reply in time") {
                format!("{e}; guest console ends with:\n{tail}")
            } else {
                e
            };
            status(
                Code::UNKNOWN,
                format!("microvm: creating container {}: {detail}", req.id),
            )
        })?;
        let (tx, rx) = watch::channel(None);
        self.inner.lock().await.containers.insert(
            req.id.clone(),
            Container {
                bundle: req.bundle.clone(),
                pid,
                phase: Phase::Created,
                exit: rx,
                app_exit: Some(Arc::new(tx)),
            },
        );
        Ok(pid)
    }

    async fn pod_agent(&self) -> TtrpcResult<Arc<crate::agent_client::AgentClient>> {
        let inner = self.inner.lock().await;
        inner
            .pod
            .as_ref()
            .map(|p| p.vm.agent())
            .ok_or_else(|| status(Code::FAILED_PRECONDITION, "microvm: no pod VM"))
    }

    /// Waits (in the agent) for app container `id`'s init to exit, then reports it.
    fn spawn_app_waiter(&self, id: String, pid: u32, agent: Arc<crate::agent_client::AgentClient>) {
        let service = self.clone();
        tokio::spawn(async move {
            let wid = id.clone();
            let status = tokio::task::spawn_blocking(move || loop {
                match agent.wait_process(&wid, "", APP_WAIT_SLICE) {
                    Ok((status, _)) => break status,
                    Err(crate::agent_client::AgentError::Rpc {
                        source: ttrpc::Error::Others(ref m),
                        ..
                    }) if m.contains("imeout") => continue,
                    Err(e) => {
                        log::warn!("waiting for container {wid}: {e}");
                        break crate::task::sandbox_vm::UNEXPECTED_EXIT_STATUS;
                    }
                }
            })
            .await
            .unwrap_or(crate::task::sandbox_vm::UNEXPECTED_EXIT_STATUS);
            let exit = VmExit {
                status,
                at: SystemTime::now(),
            };
            if let Some(c) = service.inner.lock().await.containers.get_mut(&id) {
                c.phase = Phase::Stopped;
                if let Some(tx) = &c.app_exit {
                    let _ = tx.send(Some(exit));
                }
            }
            service
                .publish(
                    topics::TASK_EXIT_EVENT_TOPIC,
                    Box::new(TaskExit {
                        container_id: id.clone(),
                        id: id.clone(),
                        pid,
                        exit_status: status,
                        exited_at: Some(timestamp(exit.at)).into(),
                        ..Default::default()
                    }),
                )
                .await;
        });
    }

    async fn exit_of(&self, id: &str) -> TtrpcResult<watch::Receiver<Option<VmExit>>> {
        let inner = self.inner.lock().await;
        inner
            .containers
            .get(id)
            .map(|c| c.exit.clone())
            .ok_or_else(|| not_found(id))
    }
}

/// Console lines quoted when a container operation fails.
const CONSOLE_TAIL_LINES: usize = 20;

/// Runs one (blocking) agent call off the async runtime; its failure becomes a status naming
/// `what` was being done.
async fn agent_call<T, F>(what: String, call: F) -> TtrpcResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, crate::agent_client::AgentError> + Send + 'static,
{
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|e| status(Code::INTERNAL, format!("microvm: {e}")))?
        .map_err(|e| status(Code::UNKNOWN, format!("microvm: {what}: {e}")))
}

fn not_found(id: &str) -> ttrpc::Error {
    status(
        Code::NOT_FOUND,
        format!("microvm: container {id} not found"),
    )
}

fn no_exec(exec_id: &str) -> TtrpcResult<()> {
    if exec_id.is_empty() {
        Ok(())
    } else {
        Err(status(
            Code::NOT_FOUND,
            format!("microvm: exec {exec_id} not found"),
        ))
    }
}

async fn wait_exit(mut rx: watch::Receiver<Option<VmExit>>) -> VmExit {
    loop {
        if let Some(e) = *rx.borrow_and_update() {
            return e;
        }
        if rx.changed().await.is_err() {
            return VmExit {
                status: crate::task::sandbox_vm::UNEXPECTED_EXIT_STATUS,
                at: SystemTime::now(),
            };
        }
    }
}

#[async_trait]
impl Task for TaskService {
    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let spec = bundle::read_spec(std::path::Path::new(&req.bundle))
            .map_err(|e| status(Code::INVALID_ARGUMENT, format!("microvm: {e}")))?;
        let annotations = bundle::annotations(&spec);
        let pid = match Role::from_annotations(&req.id, &annotations) {
            Role::Sandbox => self.create_sandbox(&req, &annotations).await?,
            Role::App { sandbox_id } => self.create_app(&req, spec, &sandbox_id).await?,
            Role::Standalone => {
                return Err(status(
                    Code::UNIMPLEMENTED,
                    format!(
                        "microvm: containers outside a CRI pod (ctr run) are not supported yet (container {})",
                        req.id
                    ),
                ))
            }
        };
        self.publish(
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
        no_exec(&req.exec_id)?;
        let is_app = {
            let inner = self.inner.lock().await;
            let c = inner
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            c.app_exit.is_some() && c.phase == Phase::Created
        };
        if is_app {
            let agent = self.pod_agent().await?;
            let (id, a) = (req.id.clone(), agent.clone());
            let pid = agent_call(format!("starting container {}", req.id), move || {
                a.start_container(&id)
            })
            .await?;
            self.spawn_app_waiter(req.id.clone(), pid, agent);
        }
        let pid = {
            let mut inner = self.inner.lock().await;
            let c = inner
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            match c.phase {
                Phase::Created => c.phase = Phase::Running,
                Phase::Running => {}
                Phase::Stopped => {
                    return Err(status(
                        Code::FAILED_PRECONDITION,
                        format!("microvm: container {} has stopped", req.id),
                    ))
                }
            }
            c.pid
        };
        self.publish(
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
        no_exec(&req.exec_id)?;
        let inner = self.inner.lock().await;
        let c = inner
            .containers
            .get(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        let mut resp = api::StateResponse {
            id: req.id.clone(),
            bundle: c.bundle.clone(),
            pid: c.pid,
            ..Default::default()
        };
        let exit = *c.exit.borrow();
        match (c.phase, exit) {
            (_, Some(e)) => {
                resp.set_status(api::Status::STOPPED);
                resp.exit_status = e.status;
                resp.exited_at = Some(timestamp(e.at)).into();
            }
            (Phase::Created, None) => resp.set_status(api::Status::CREATED),
            (Phase::Running, None) => resp.set_status(api::Status::RUNNING),
            (Phase::Stopped, None) => resp.set_status(api::Status::STOPPED),
        }
        Ok(resp)
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        no_exec(&req.exec_id)?;
        let inner = self.inner.lock().await;
        let c = inner
            .containers
            .get(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        if c.exit.borrow().is_some() {
            return Err(status(
                Code::NOT_FOUND,
                format!("microvm: process of {} already finished", req.id),
            ));
        }
        if req.signal == 0 {
            return Ok(api::Empty::new());
        }
        if c.app_exit.is_some() {
            let agent = inner
                .pod
                .as_ref()
                .map(|p| p.vm.agent())
                .ok_or_else(|| not_found(&req.id))?;
            drop(inner);
            let (id, signal, all) = (req.id.clone(), req.signal, req.all);
            agent_call(format!("signalling container {}", req.id), move || {
                agent.signal_process(&id, "", signal, all)
            })
            .await?;
            return Ok(api::Empty::new());
        }
        let Some(pod) = inner.pod.as_ref().filter(|p| p.id == req.id) else {
            return Err(not_found(&req.id));
        };
        log::info!("sandbox {}: signal {} stops the VM", req.id, req.signal);
        pod.vm.stop(128u32.saturating_add(req.signal));
        Ok(api::Empty::new())
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        no_exec(&req.exec_id)?;
        let exit = wait_exit(self.exit_of(&req.id).await?).await;
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
        no_exec(&req.exec_id)?;
        let (container, pod) = {
            let mut inner = self.inner.lock().await;
            let c = inner
                .containers
                .remove(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            let pod = if inner.pod.as_ref().is_some_and(|p| p.id == req.id) {
                inner.pod.take()
            } else {
                None
            };
            (c, pod)
        };
        let exit = if let Some(pod) = pod {
            // A sandbox deleted while its VM runs (e.g. a failed RunPodSandbox): stop it first.
            if pod.vm.exited().borrow().is_none() {
                pod.vm.stop(137);
            }
            let exit = pod.vm.wait().await;
            let state = pod.state.clone();
            drop(pod);
            match tokio::task::spawn_blocking(move || state.cleanup()).await {
                Ok(Ok(report)) => log::info!("sandbox {}: cleaned up {report:?}", req.id),
                Ok(Err(e)) => log::warn!("sandbox {}: cleanup: {e}", req.id),
                Err(e) => log::warn!("sandbox {}: cleanup task: {e}", req.id),
            }
            exit
        } else {
            let exit = (*container.exit.borrow()).unwrap_or(VmExit {
                status: 0,
                at: SystemTime::now(),
            });
            let pod = {
                let inner = self.inner.lock().await;
                inner.pod.as_ref().map(|p| (p.vm.agent(), p.state.clone()))
            };
            if let Some((agent, state)) = pod {
                let id = req.id.clone();
                let undone = tokio::task::spawn_blocking(move || {
                    if let Err(e) = agent.remove_container(&id) {
                        log::warn!("removing container {id} in the guest: {e}");
                    }
                    share::unshare_container(&state, &id)
                })
                .await;
                if let Ok(Err(e)) = undone {
                    log::warn!("unsharing container {}: {e}", req.id);
                }
            }
            exit
        };
        self.publish(
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: req.id.clone(),
                pid: container.pid,
                exit_status: exit.status,
                exited_at: Some(timestamp(exit.at)).into(),
                ..Default::default()
            }),
        )
        .await;
        Ok(api::DeleteResponse {
            pid: container.pid,
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
        let inner = self.inner.lock().await;
        let c = inner
            .containers
            .get(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        Ok(api::PidsResponse {
            processes: vec![containerd_shim_protos::types::task::ProcessInfo {
                pid: c.pid,
                ..Default::default()
            }],
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let inner = self.inner.lock().await;
        let task_pid = inner.containers.get(&req.id).map(|c| c.pid).unwrap_or(0);
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
        let inner = self.inner.lock().await;
        if !inner.containers.is_empty() {
            return Ok(api::Empty::new());
        }
        log::info!("no containers left: the shim exits");
        self.exit.signal();
        Ok(api::Empty::new())
    }
}
