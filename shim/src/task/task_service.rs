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
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExit, TaskIO, TaskOOM, TaskPaused, TaskResumed, TaskStart,
};
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc::{self, r#async::TtrpcContext, Code};
use tokio::sync::{watch, Mutex};

use crate::agent::stdio::{self, Fifos};
use crate::agent::{AgentClient, AgentError};
use crate::config::{Config, Hypervisor};
use crate::task::bundle::{self, Role};
use crate::task::exec::ExecProc;
use crate::task::guest_spec;
use crate::task::options;
use crate::task::sandbox_vm::{SandboxVm, VmExit};
use crate::task::service::timestamp;
use crate::task::share::{self, RootfsMount};
use crate::task::state_dir::{state_root, StateDir};
use crate::vm::{Backend, GuestSpec, QemuPrograms, SharedDir};

pub(crate) type TtrpcResult<T> = Result<T, ttrpc::Error>;

/// Each GetOomEvent long poll to the agent is bounded by this.
const OOM_POLL: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a failed OOM poll waits for the VM's end before it counts as a failure.
const OOM_WATCH_END_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

pub(crate) fn status(code: Code, message: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message.into()))
}

/// Where a container or exec process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Created,
    Running,
    Paused,
    Stopped,
}

/// A container this shim serves: the pod's sandbox (its VM) or an app container in the VM.
pub(crate) struct Container {
    pub(crate) bundle: String,
    pid: u32,
    pub(crate) phase: Phase,
    pub(crate) exit: watch::Receiver<Option<VmExit>>,
    /// For app containers: where their exit is reported (the sandbox's comes from the VM).
    pub(crate) app_exit: Option<Arc<watch::Sender<Option<VmExit>>>>,
    /// App containers: the init's stdin copy (until CloseIO or Delete) and FIFO.
    stdin: Option<stdio::StdinCopy>,
    stdin_fifo: String,
    /// App containers: the init's output copies, until Start hands them to the waiter.
    outputs: Vec<tokio::task::JoinHandle<()>>,
    /// Exec processes by exec id.
    pub(crate) execs: HashMap<String, ExecProc>,
}

impl Container {
    fn new(bundle: &str, pid: u32, exit: watch::Receiver<Option<VmExit>>) -> Self {
        Container {
            bundle: bundle.to_string(),
            pid,
            phase: Phase::Created,
            exit,
            app_exit: None,
            stdin: None,
            stdin_fifo: String::new(),
            outputs: Vec::new(),
            execs: HashMap::new(),
        }
    }
}

/// The pod: its state directory and VM.
struct Pod {
    id: String,
    state: StateDir,
    vm: SandboxVm,
}

#[derive(Default)]
pub(crate) struct Inner {
    pod: Option<Pod>,
    pub(crate) containers: HashMap<String, Container>,
}

impl Inner {
    /// App container `id` (the sandbox is not one: it has no processes of its own).
    pub(crate) fn app(&self, id: &str) -> TtrpcResult<&Container> {
        let c = self.containers.get(id).ok_or_else(|| not_found(id))?;
        if c.app_exit.is_none() {
            return Err(status(
                Code::FAILED_PRECONDITION,
                format!(
                    "microvm: {id} is the pod sandbox (the VM), which runs no processes of its own"
                ),
            ));
        }
        Ok(c)
    }

    /// Exec `exec_id` of app container `id`.
    pub(crate) fn exec(&self, id: &str, exec_id: &str) -> TtrpcResult<&ExecProc> {
        self.app(id)?.execs.get(exec_id).ok_or_else(|| {
            status(
                Code::NOT_FOUND,
                format!("microvm: exec {exec_id} of container {id} not found"),
            )
        })
    }

    /// The pod VM's agent and its hybrid-vsock socket.
    pub(crate) fn pod_agent_and_socket(&self) -> TtrpcResult<(AgentClient, PathBuf)> {
        self.pod
            .as_ref()
            .map(|p| (p.vm.agent(), p.vm.agent_socket().to_path_buf()))
            .ok_or_else(|| status(Code::FAILED_PRECONDITION, "microvm: no pod VM"))
    }
}

/// The task service of one pod's shim.
#[derive(Clone)]
pub struct TaskService {
    namespace: String,
    publisher: Arc<RemotePublisher>,
    exit: Arc<ExitSignal>,
    config_path: Option<PathBuf>,
    pub(crate) inner: Arc<Mutex<Inner>>,
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

    pub(crate) async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
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
        sysctls: HashMap<String, String>,
    ) -> TtrpcResult<u32> {
        let exit = self.boot_pod(req, annotations).await?;
        if !sysctls.is_empty() {
            // The pod's sysctls go to the VM's namespaces, which its containers share, before
            // any container exists; a sysctl the guest refuses fails the pod, naming it.
            let agent = self.pod_agent().await?;
            if let Err(e) = agent_call(
                format!("sandbox {}: setting the pod's sysctls in the guest", req.id),
                agent.set_sysctls(sysctls),
            )
            .await
            {
                self.discard_pod(&req.id).await;
                return Err(e);
            }
        }
        let pid = std::process::id();
        let mut inner = self.inner.lock().await;
        let agent = inner.pod.as_ref().map(|p| p.vm.agent());
        inner.containers.insert(
            req.id.clone(),
            Container::new(&req.bundle, pid, exit.clone()),
        );
        drop(inner);
        self.spawn_exit_monitor(req.id.clone(), pid, exit.clone());
        if let Some(agent) = agent {
            self.spawn_oom_watcher(agent, exit);
        }
        Ok(pid)
    }

    /// A container outside any CRI pod (`ctr run`): a VM of its own, named by the container,
    /// with the container as its only app container. Its exit is the container's; Delete ends
    /// the VM.
    async fn create_standalone(
        &self,
        req: &api::CreateTaskRequest,
        spec: serde_json::Value,
        annotations: &HashMap<String, String>,
    ) -> TtrpcResult<u32> {
        let exit = self.boot_pod(req, annotations).await?;
        let agent = self.pod_agent().await?;
        match self.create_app(req, spec, &req.id).await {
            Ok(pid) => {
                self.spawn_oom_watcher(agent, exit);
                Ok(pid)
            }
            Err(e) => {
                self.discard_pod(&req.id).await;
                Err(e)
            }
        }
    }

    /// Stops this shim's pod VM after a failed create and removes its state directory.
    async fn discard_pod(&self, id: &str) {
        let pod = self.inner.lock().await.pod.take();
        if let Some(pod) = pod {
            pod.vm.stop(137);
            pod.vm.wait().await;
            let state = pod.state.clone();
            drop(pod);
            if let Ok(Err(c)) = tokio::task::spawn_blocking(move || state.cleanup()).await {
                log::warn!("{id}: cleanup after a failed create: {c}");
            }
        }
    }

    /// Boots the VM of pod `req.id` (config, size, state directory, shared directory) and
    /// records it as this shim's pod; returns the VM's exit receiver.
    async fn boot_pod(
        &self,
        req: &api::CreateTaskRequest,
        annotations: &HashMap<String, String>,
    ) -> TtrpcResult<watch::Receiver<Option<VmExit>>> {
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
            Hypervisor::Auto => {
                let report = crate::host_check::probe(Some(&config.kernel));
                let choice = crate::host_check::choose_backend(&report);
                log::info!("sandbox {}: hypervisor auto -> {choice}", req.id);
                choice.backend
            }
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
        let mut spec = GuestSpec::new(
            config.kernel.clone(),
            config.initrd.clone(),
            size.vcpus,
            size.memory_mib,
            state.vm_dir(),
        );
        spec.agent_log_level = Some(config.log_level.clone());
        spec.hostname = bundle::read_spec(std::path::Path::new(&req.bundle))
            .ok()
            .and_then(|spec| spec["hostname"].as_str().map(str::to_owned));
        spec.qemu = QemuPrograms {
            qemu: config.qemu.binary.clone(),
            vhost_vsock: config.qemu.vhost_vsock_binary.clone(),
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
        spec.shared = Some(SharedDir {
            tag: crate::task::guest_spec::SHARED_FS_TAG.to_string(),
            host_dir: shared_dir,
        });
        let vm = match SandboxVm::boot(backend, spec, state.clone()).await {
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
        let exit = vm.exited();
        self.inner.lock().await.pod = Some(Pod {
            id: req.id.clone(),
            state,
            vm,
        });
        Ok(exit)
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

    /// Publishes TaskOOM for each OOM kill the agent reports, until the VM ends.
    fn spawn_oom_watcher(&self, agent: AgentClient, exit: watch::Receiver<Option<VmExit>>) {
        let service = self.clone();
        tokio::spawn(async move {
            let mut warned = false;
            while exit.borrow().is_none() {
                match agent.get_oom_event(OOM_POLL).await {
                    Ok(Some(container_id)) => {
                        log::info!("container {container_id}: OOM kill in the guest");
                        service
                            .publish(
                                topics::TASK_OOM_EVENT_TOPIC,
                                Box::new(TaskOOM {
                                    container_id,
                                    ..Default::default()
                                }),
                            )
                            .await;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        // The agent's connection ends with the VM: a stopping pod is no
                        // failure. Give the VM's end (or the VM's going away) a moment to be
                        // seen before calling it one.
                        let mut ending = exit.clone();
                        let ended = tokio::time::timeout(
                            OOM_WATCH_END_GRACE,
                            ending.wait_for(|e| e.is_some()),
                        )
                        .await
                        .is_ok();
                        if ended || exit.borrow().is_some() {
                            log::debug!("OOM watcher: the VM ended ({e})");
                            break;
                        }
                        if !warned {
                            log::warn!("watching for OOM kills in the guest: {e}");
                            warned = true;
                        }
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                }
            }
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
            let targets: HashMap<u32, String> = inner
                .containers
                .iter()
                .filter(|(_, c)| c.app_exit.is_some() && c.pid != 0)
                .map(|(id, c)| (c.pid, id.clone()))
                .collect();
            guest_spec::resolve_target_pid_namespace(&mut spec, &targets);
            (
                pod.vm.agent(),
                pod.vm.agent_socket().to_path_buf(),
                pod.state.clone(),
                pod.vm.console_log().to_path_buf(),
            )
        };
        let binds = guest_spec::rewrite_for_guest(&mut spec, &req.id, std::process::id())
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
        let shared = {
            let state = state.clone();
            let id = id.clone();
            tokio::task::spawn_blocking(move || {
                share::share_container(&state, &id, &rootfs, &bundle_rootfs, &binds)
            })
            .await
            .map_err(|e| status(Code::INTERNAL, format!("microvm: {e}")))?
        };
        let was_shared = shared.is_ok();
        let created: Result<(u32, stdio::Attached), CreateFailure> = async {
            shared.map_err(|e| CreateFailure::from(e.to_string()))?;
            let json = serde_json::to_vec(&spec).map_err(|e| CreateFailure::from(e.to_string()))?;
            let request = agent_protocol::agent::CreateContainerRequest {
                container_id: id.clone(),
                oci_spec_json: json,
                stdio: Some(fifos.agent_stdio()).into(),
                ..Default::default()
            };
            let pid = agent
                .create_container(request)
                .await
                .map_err(|e| CreateFailure {
                    message: e.to_string(),
                    timed_out: e.is_timeout(),
                })?;
            match stdio::attach(&socket, &id, "", &fifos).await {
                Ok(attached) => Ok((pid, attached)),
                Err(e) => {
                    let _ = agent.remove_container(&id).await;
                    Err(e.to_string().into())
                }
            }
        }
        .await;
        if created.is_err() && was_shared {
            let (state, id) = (state.clone(), id.clone());
            let _ =
                tokio::task::spawn_blocking(move || share::unshare_container(&state, &id)).await;
        }
        let stdin_fifo = req.stdin.clone();
        let (pid, attached) = created.map_err(|CreateFailure { message, timed_out }| {
            let tail = crate::vm::console_tail(&console, CONSOLE_TAIL_LINES);
            log::warn!(
                "creating container {} failed: {message}; guest console ends with:\n{tail}",
                req.id
            );
            // A timeout says nothing by itself: the guest's last words go to the user too.
            let detail = if timed_out {
                format!("{message}; guest console ends with:\n{tail}")
            } else {
                message
            };
            status(
                Code::UNKNOWN,
                format!("microvm: creating container {}: {detail}", req.id),
            )
        })?;
        let (tx, rx) = watch::channel(None);
        let mut container = Container::new(&req.bundle, pid, rx);
        container.app_exit = Some(Arc::new(tx));
        container.stdin = attached.stdin;
        container.stdin_fifo = stdin_fifo;
        container.outputs = attached.outputs;
        self.inner
            .lock()
            .await
            .containers
            .insert(req.id.clone(), container);
        Ok(pid)
    }

    async fn pod_agent(&self) -> TtrpcResult<AgentClient> {
        Ok(self.inner.lock().await.pod_agent_and_socket()?.0)
    }

    /// Pause (`paused`) or Resume of app container `id` through the agent (cgroup freezer).
    async fn set_paused(&self, id: &str, paused: bool) -> TtrpcResult<()> {
        let agent = {
            let inner = self.inner.lock().await;
            let c = inner.app(id)?;
            let want = if paused {
                Phase::Running
            } else {
                Phase::Paused
            };
            if c.phase != want || c.exit.borrow().is_some() {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!(
                        "microvm: container {id} is {:?}; cannot {}",
                        c.phase,
                        if paused { "pause" } else { "resume" }
                    ),
                ));
            }
            inner.pod_agent_and_socket()?.0
        };
        let cid = id.to_string();
        if paused {
            agent_call(
                format!("pausing container {id}"),
                agent.pause_container(&cid),
            )
            .await?;
        } else {
            agent_call(
                format!("resuming container {id}"),
                agent.resume_container(&cid),
            )
            .await?;
        }
        let mut inner = self.inner.lock().await;
        if let Some(c) = inner.containers.get_mut(id) {
            if c.phase != Phase::Stopped {
                c.phase = if paused {
                    Phase::Paused
                } else {
                    Phase::Running
                };
            }
        }
        Ok(())
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

/// Why creating an app container failed, and whether the agent only did not answer in time
/// (then the guest console says more than the error).
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

/// Console lines quoted when a container operation fails.
const CONSOLE_TAIL_LINES: usize = 20;

/// Awaits one agent call; its failure becomes a status naming `what` was being done.
pub(crate) async fn agent_call<T>(
    what: String,
    call: impl std::future::Future<Output = Result<T, AgentError>>,
) -> TtrpcResult<T> {
    call.await
        .map_err(|e| status(Code::UNKNOWN, format!("microvm: {what}: {e}")))
}

/// How long CloseIO lets the stdin copy deliver what containerd wrote.
const STDIN_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// "container X" or "exec E of container X", for errors.
fn process_name(id: &str, exec_id: &str) -> String {
    if exec_id.is_empty() {
        format!("container {id}")
    } else {
        format!("exec {exec_id} of container {id}")
    }
}

fn not_found(id: &str) -> ttrpc::Error {
    status(
        Code::NOT_FOUND,
        format!("microvm: container {id} not found"),
    )
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
            Role::Sandbox => {
                // Before anything is made: a pod that needs the host's namespaces is refused.
                if let Some(refusal) = guest_spec::refuse_host_namespaces(&spec) {
                    log::warn!("sandbox {}: refused: {refusal}", req.id);
                    return Err(status(
                        Code::INVALID_ARGUMENT,
                        format!("microvm: sandbox {}: {refusal}", req.id),
                    ));
                }
                let sysctls = guest_spec::pod_sysctls(&spec)
                    .map_err(|e| status(Code::INVALID_ARGUMENT, format!("microvm: {e}")))?;
                self.create_sandbox(&req, &annotations, sysctls).await?
            }
            Role::App { sandbox_id } => self.create_app(&req, spec, &sandbox_id).await?,
            Role::Standalone => self.create_standalone(&req, spec, &annotations).await?,
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
        if !req.exec_id.is_empty() {
            let pid = self.exec_start(&req.id, &req.exec_id).await?;
            return Ok(api::StartResponse {
                pid,
                ..Default::default()
            });
        }
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
            let pid = agent_call(
                format!("starting container {}", req.id),
                agent.start_container(&req.id),
            )
            .await?;
            let outputs = {
                let mut inner = self.inner.lock().await;
                inner
                    .containers
                    .get_mut(&req.id)
                    .map(|c| std::mem::take(&mut c.outputs))
                    .unwrap_or_default()
            };
            self.spawn_process_waiter(req.id.clone(), String::new(), pid, agent, outputs);
        }
        let pid = {
            let mut inner = self.inner.lock().await;
            let c = inner
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            match c.phase {
                Phase::Created => c.phase = Phase::Running,
                Phase::Running | Phase::Paused => {}
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
        if !req.exec_id.is_empty() {
            return self.exec_state(&req).await;
        }
        let inner = self.inner.lock().await;
        let c = inner
            .containers
            .get(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        let mut resp = api::StateResponse {
            id: req.id.clone(),
            bundle: c.bundle.clone(),
            pid: c.pid,
            stdin: c.stdin_fifo.clone(),
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
            (Phase::Paused, None) => resp.set_status(api::Status::PAUSED),
            (Phase::Stopped, None) => resp.set_status(api::Status::STOPPED),
        }
        Ok(resp)
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        if !req.exec_id.is_empty() {
            self.exec_kill(&req).await?;
            return Ok(api::Empty::new());
        }
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
            agent_call(
                format!("signalling container {}", req.id),
                agent.signal_process(&req.id, "", req.signal, req.all),
            )
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
        let rx = if req.exec_id.is_empty() {
            self.exit_of(&req.id).await?
        } else {
            self.exec_exit(&req.id, &req.exec_id).await?
        };
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
            return self.exec_delete(&req).await;
        }
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
        // Stdin copies still waiting for containerd to open a FIFO end now.
        stdio::release_stdin_fifo(&container.stdin_fifo);
        for e in container.execs.values() {
            stdio::release_stdin_fifo(&e.fifos.stdin);
        }
        let exit = if let Some(pod) = pod {
            // A sandbox deleted while its VM runs (e.g. a failed RunPodSandbox): stop it first.
            if pod.vm.exited().borrow().is_none() {
                pod.vm.stop(137);
            }
            let vm_exit = pod.vm.wait().await;
            // A standalone container's own VM: the exit is the container's.
            let exit = if container.app_exit.is_some() {
                (*container.exit.borrow()).unwrap_or(vm_exit)
            } else {
                vm_exit
            };
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
                if let Err(e) = agent.remove_container(&req.id).await {
                    log::warn!("removing container {} in the guest: {e}", req.id);
                }
                let id = req.id.clone();
                let undone =
                    tokio::task::spawn_blocking(move || share::unshare_container(&state, &id))
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
        let (pid, agent) = {
            let inner = self.inner.lock().await;
            let c = inner
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            let agent = match c.app_exit {
                Some(_) => Some(inner.pod_agent_and_socket()?.0),
                None => None,
            };
            (c.pid, agent)
        };
        // The sandbox's process is the shim, which runs the VM; an app container's are the
        // guest pids in its cgroup.
        let pids = match agent {
            None => vec![pid],
            Some(agent) => {
                agent_call(
                    format!("listing the pids of container {}", req.id),
                    agent.list_pids(&req.id),
                )
                .await?
            }
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
            if req.exec_id.is_empty() {
                inner.app(&req.id)?;
            } else {
                inner.exec(&req.id, &req.exec_id)?;
            }
            inner.pod_agent_and_socket()?.0
        };
        agent_call(
            format!(
                "resizing the terminal of {}",
                process_name(&req.id, &req.exec_id)
            ),
            agent.resize_pty(&req.id, &req.exec_id, req.width, req.height),
        )
        .await?;
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
            if req.exec_id.is_empty() {
                inner.app(&req.id)?;
            } else {
                inner.exec(&req.id, &req.exec_id)?;
            }
            let agent = inner.pod_agent_and_socket()?.0;
            let c = inner
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            let copy = if req.exec_id.is_empty() {
                c.stdin.take()
            } else {
                c.execs.get_mut(&req.exec_id).and_then(|e| e.stdin.take())
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
        agent_call(
            format!(
                "closing the stdin of {}",
                process_name(&req.id, &req.exec_id)
            ),
            agent.close_stdin(&req.id, &req.exec_id),
        )
        .await?;
        Ok(api::Empty::new())
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        // The sandbox (the VM) answers with the whole guest's figures (agent Stats of ""):
        // containerd asks every task for its metrics (ListContainerStats without a filter) and
        // logs an error for each that fails.
        let (agent, agent_id, what) = {
            let inner = self.inner.lock().await;
            let c = inner
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            if c.app_exit.is_some() {
                let what = format!("reading the stats of container {}", req.id);
                (inner.pod_agent_and_socket()?.0, req.id.clone(), what)
            } else {
                if c.exit.borrow().is_some() {
                    return Err(status(
                        Code::NOT_FOUND,
                        format!("microvm: the VM of sandbox {} has ended", req.id),
                    ));
                }
                let what = format!("reading the guest's stats for sandbox {}", req.id);
                (inner.pod_agent_and_socket()?.0, String::new(), what)
            }
        };
        let stats = agent_call(what, agent.stats(&agent_id)).await?;
        let any = crate::task::metrics::metrics_any(&stats)
            .map_err(|e| status(Code::INTERNAL, format!("microvm: {e}")))?;
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
        let agent = {
            let inner = self.inner.lock().await;
            inner.app(&req.id)?;
            inner.pod_agent_and_socket()?.0
        };
        let resources = req
            .resources
            .as_ref()
            .map(|any| any.value.clone())
            .ok_or_else(|| {
                status(
                    Code::INVALID_ARGUMENT,
                    format!("microvm: update of {} without resources", req.id),
                )
            })?;
        agent_call(
            format!("updating the resources of container {}", req.id),
            agent.update_container(&req.id, resources),
        )
        .await?;
        Ok(api::Empty::new())
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, true).await?;
        self.publish(
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
        self.publish(
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
