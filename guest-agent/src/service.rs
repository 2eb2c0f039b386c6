//! The `Agent` ttrpc service: Check answers from [`crate::check`]; Shutdown replies and asks the
//! main thread, through a channel, to end the VM once the reply is on its way; the container
//! calls go to [`crate::containers`].

use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use agent_protocol::agent::*;
use agent_protocol::agent_ttrpc::Agent;
use ttrpc::{Code, TtrpcContext};

use crate::containers::{ContainerError, Containers, StdioRequest};
use crate::oom::OomEvents;

/// Longest a blocking call (WaitProcess, GetOomEvent) waits when the caller set no timeout.
const DEFAULT_LONG_POLL: Duration = Duration::from_secs(60);
/// Answer a blocking call this much before the caller's deadline.
const DEADLINE_MARGIN: Duration = Duration::from_millis(200);

/// Sent to the main thread when the host asked for a shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownRequested;

pub struct AgentService {
    shutdown: Sender<ShutdownRequested>,
    containers: Arc<Containers>,
    oom: Arc<OomEvents>,
}

impl AgentService {
    pub fn new(
        shutdown: Sender<ShutdownRequested>,
        containers: Arc<Containers>,
        oom: Arc<OomEvents>,
    ) -> Self {
        Self {
            shutdown,
            containers,
            oom,
        }
    }
}

fn rpc_error(code: Code, message: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message))
}

fn failed(method: &str, err: ContainerError) -> ttrpc::Error {
    log::warn!("{method}: {err}");
    rpc_error(err.code(), err)
}

fn stdio(req: Option<&Stdio>) -> StdioRequest {
    req.map(|s| StdioRequest {
        terminal: s.terminal,
        stdin: s.stdin,
        stdout: s.stdout,
        stderr: s.stderr,
    })
    .unwrap_or_default()
}

/// How long a blocking call may wait: the caller's timeout minus a margin.
fn long_poll(ctx: &TtrpcContext) -> Duration {
    if ctx.timeout_nano <= 0 {
        return DEFAULT_LONG_POLL;
    }
    Duration::from_nanos(u64::try_from(ctx.timeout_nano).unwrap_or(0))
        .saturating_sub(DEADLINE_MARGIN)
}

impl Agent for AgentService {
    fn check(&self, _ctx: &TtrpcContext, _req: CheckRequest) -> ttrpc::Result<CheckResponse> {
        let facts = crate::check::gather().map_err(|e| {
            log::warn!("check: {e}");
            rpc_error(Code::INTERNAL, e)
        })?;
        Ok(CheckResponse {
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            kernel_release: facts.kernel_release,
            online_vcpus: facts.online_vcpus,
            mem_total_kib: facts.mem_total_kib,
            boot_id: facts.boot_id,
            ..Default::default()
        })
    }

    fn shutdown(
        &self,
        _ctx: &TtrpcContext,
        _req: ShutdownRequest,
    ) -> ttrpc::Result<ShutdownResponse> {
        log::info!("shutdown requested by the host");
        self.shutdown
            .send(ShutdownRequested)
            .map_err(|_| rpc_error(Code::UNAVAILABLE, "the agent is already stopping"))?;
        Ok(ShutdownResponse::new())
    }

    fn create_container(
        &self,
        _ctx: &TtrpcContext,
        req: CreateContainerRequest,
    ) -> ttrpc::Result<CreateContainerResponse> {
        #[cfg(feature = "hostile-test-hooks")]
        crate::hostile::on_create(&req.container_id, &req.oci_spec_json);
        let pid = self
            .containers
            .create(
                &req.container_id,
                &req.oci_spec_json,
                stdio(req.stdio.as_ref()),
                &req.block_devices
                    .iter()
                    .map(|b| crate::blockdev::BlockRequest {
                        container_path: b.container_path.clone(),
                        serial: b.serial.clone(),
                        read_only: b.read_only,
                    })
                    .collect::<Vec<_>>(),
            )
            .map_err(|e| failed("CreateContainer", e))?;
        log::info!("container {} created (pid {pid})", req.container_id);
        Ok(CreateContainerResponse {
            pid,
            ..Default::default()
        })
    }

    fn start_container(
        &self,
        _ctx: &TtrpcContext,
        req: StartContainerRequest,
    ) -> ttrpc::Result<StartContainerResponse> {
        #[cfg(feature = "hostile-test-hooks")]
        if let Some(e) = crate::hostile::start_reply(&req.container_id) {
            return Err(e);
        }
        let pid = self
            .containers
            .start(&req.container_id)
            .map_err(|e| failed("StartContainer", e))?;
        Ok(StartContainerResponse {
            pid,
            ..Default::default()
        })
    }

    fn exec_process(
        &self,
        _ctx: &TtrpcContext,
        req: ExecProcessRequest,
    ) -> ttrpc::Result<ExecProcessResponse> {
        self.containers
            .add_exec(
                &req.container_id,
                &req.exec_id,
                &req.process_json,
                stdio(req.stdio.as_ref()),
            )
            .map_err(|e| failed("ExecProcess", e))?;
        Ok(ExecProcessResponse::new())
    }

    fn start_exec(
        &self,
        _ctx: &TtrpcContext,
        req: StartExecRequest,
    ) -> ttrpc::Result<StartExecResponse> {
        let pid = self
            .containers
            .start_exec(&req.container_id, &req.exec_id)
            .map_err(|e| failed("StartExec", e))?;
        Ok(StartExecResponse {
            pid,
            ..Default::default()
        })
    }

    fn signal_process(
        &self,
        _ctx: &TtrpcContext,
        req: SignalProcessRequest,
    ) -> ttrpc::Result<SignalProcessResponse> {
        self.containers
            .signal(&req.container_id, &req.exec_id, req.signal, req.all)
            .map_err(|e| failed("SignalProcess", e))?;
        Ok(SignalProcessResponse::new())
    }

    fn wait_process(
        &self,
        ctx: &TtrpcContext,
        req: WaitProcessRequest,
    ) -> ttrpc::Result<WaitProcessResponse> {
        #[cfg(feature = "hostile-test-hooks")]
        if let Some(reply) = crate::hostile::wait_reply(&req.container_id, &req.exec_id) {
            return reply;
        }
        let cell = self
            .containers
            .exit_cell(&req.container_id, &req.exec_id)
            .map_err(|e| failed("WaitProcess", e))?;
        let status = cell
            .wait(long_poll(ctx))
            .ok_or_else(|| rpc_error(Code::DEADLINE_EXCEEDED, "the process is still running"))?;
        if req.exec_id.is_empty() {
            // An OOM kill of the init is queued before the shim hears of the exit.
            self.oom.check(&req.container_id);
            self.containers.init_exited(&req.container_id);
        }
        Ok(WaitProcessResponse {
            exit_status: status.code,
            exited_at_unix_nanos: status.at_unix_nanos,
            ..Default::default()
        })
    }

    fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: ResizePtyRequest,
    ) -> ttrpc::Result<ResizePtyResponse> {
        self.containers
            .resize(&req.container_id, &req.exec_id, req.width, req.height)
            .map_err(|e| failed("ResizePty", e))?;
        Ok(ResizePtyResponse::new())
    }

    fn close_stdin(
        &self,
        _ctx: &TtrpcContext,
        req: CloseStdinRequest,
    ) -> ttrpc::Result<CloseStdinResponse> {
        self.containers
            .close_stdin(&req.container_id, &req.exec_id)
            .map_err(|e| failed("CloseStdin", e))?;
        Ok(CloseStdinResponse::new())
    }

    fn list_pids(
        &self,
        _ctx: &TtrpcContext,
        req: ListPidsRequest,
    ) -> ttrpc::Result<ListPidsResponse> {
        let pids = self
            .containers
            .pids(&req.container_id)
            .map_err(|e| failed("ListPids", e))?;
        Ok(ListPidsResponse {
            pids,
            ..Default::default()
        })
    }

    fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> ttrpc::Result<StatsResponse> {
        let s = if req.container_id.is_empty() {
            crate::containers::guest_stats()
        } else {
            self.containers
                .stats(&req.container_id)
                .map_err(|e| failed("Stats", e))?
        };
        Ok(StatsResponse {
            cpu_usage_usec: s.cpu_usage_usec,
            cpu_user_usec: s.cpu_user_usec,
            cpu_system_usec: s.cpu_system_usec,
            memory_usage_bytes: s.memory_usage_bytes,
            memory_limit_bytes: s.memory_limit_bytes,
            pids_current: s.pids_current,
            oom_kills: s.oom_kills,
            ..Default::default()
        })
    }

    fn update_container(
        &self,
        _ctx: &TtrpcContext,
        req: UpdateContainerRequest,
    ) -> ttrpc::Result<UpdateContainerResponse> {
        self.containers
            .update(&req.container_id, &req.resources_json)
            .map_err(|e| failed("UpdateContainer", e))?;
        Ok(UpdateContainerResponse::new())
    }

    fn pause_container(
        &self,
        _ctx: &TtrpcContext,
        req: PauseContainerRequest,
    ) -> ttrpc::Result<PauseContainerResponse> {
        self.containers
            .pause(&req.container_id)
            .map_err(|e| failed("PauseContainer", e))?;
        Ok(PauseContainerResponse::new())
    }

    fn resume_container(
        &self,
        _ctx: &TtrpcContext,
        req: ResumeContainerRequest,
    ) -> ttrpc::Result<ResumeContainerResponse> {
        self.containers
            .resume(&req.container_id)
            .map_err(|e| failed("ResumeContainer", e))?;
        Ok(ResumeContainerResponse::new())
    }

    fn remove_container(
        &self,
        _ctx: &TtrpcContext,
        req: RemoveContainerRequest,
    ) -> ttrpc::Result<RemoveContainerResponse> {
        #[cfg(feature = "hostile-test-hooks")]
        crate::hostile::on_remove(&req.container_id);
        self.oom.check(&req.container_id);
        self.containers
            .remove(&req.container_id)
            .map_err(|e| failed("RemoveContainer", e))?;
        self.oom.forget(&req.container_id);
        crate::share_forget::removed(&req.container_id);
        log::info!("container {} removed", req.container_id);
        Ok(RemoveContainerResponse::new())
    }

    fn remove_exec(
        &self,
        _ctx: &TtrpcContext,
        req: RemoveExecRequest,
    ) -> ttrpc::Result<RemoveExecResponse> {
        self.containers
            .remove_exec(&req.container_id, &req.exec_id)
            .map_err(|e| failed("RemoveExec", e))?;
        log::debug!("exec {} of {} removed", req.exec_id, req.container_id);
        Ok(RemoveExecResponse::new())
    }

    fn set_sysctls(
        &self,
        _ctx: &TtrpcContext,
        req: SetSysctlsRequest,
    ) -> ttrpc::Result<SetSysctlsResponse> {
        crate::sysctl::apply(&req.sysctls).map_err(|e| {
            log::warn!("SetSysctls: {e}");
            let code = match e {
                crate::sysctl::SysctlError::Write { .. } => Code::FAILED_PRECONDITION,
                _ => Code::INVALID_ARGUMENT,
            };
            rpc_error(code, e)
        })?;
        Ok(SetSysctlsResponse::new())
    }

    fn configure_network(
        &self,
        _ctx: &TtrpcContext,
        req: ConfigureNetworkRequest,
    ) -> ttrpc::Result<ConfigureNetworkResponse> {
        crate::network::configure(&req).map_err(|e| {
            log::warn!("ConfigureNetwork: {e}");
            let code = match e {
                _ if e.is_invalid_request() => Code::INVALID_ARGUMENT,
                crate::network::NetworkError::NicNotFound { .. } => Code::NOT_FOUND,
                _ => Code::FAILED_PRECONDITION,
            };
            rpc_error(code, e)
        })?;
        Ok(ConfigureNetworkResponse::new())
    }

    fn get_oom_event(
        &self,
        ctx: &TtrpcContext,
        _req: GetOomEventRequest,
    ) -> ttrpc::Result<GetOomEventResponse> {
        #[cfg(feature = "hostile-test-hooks")]
        if let Some(reply) = crate::hostile::oom_reply() {
            return reply;
        }
        let container_id = self
            .oom
            .next(long_poll(ctx))
            .ok_or_else(|| rpc_error(Code::DEADLINE_EXCEEDED, "no OOM event"))?;
        Ok(GetOomEventResponse {
            container_id,
            ..Default::default()
        })
    }
}
