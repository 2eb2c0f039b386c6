//! Exec processes of app containers (`ctr task exec`, CRI ExecSync/Exec): Exec registers the
//! OCI process with the agent and attaches its stdio FIFOs to the agent's stdio streams (the
//! agent accepts streams before the start); Start runs it (a missing binary fails here, with the
//! agent's error naming it); a waiter reports its exit (TaskExit with the exec id) once its
//! output reached containerd; Delete forgets it in the agent too.
//!
//! Also here: the waiter shared with the containers' init processes.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use containerd_shim_protos::api;
use containerd_shim_protos::events::task::{TaskExecAdded, TaskExecStarted, TaskExit};
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc::Code;
use tokio::sync::watch;

use crate::agent::stdio::{self, Attached, Fifos};
use crate::agent::{AgentClient, AgentError};
use crate::task::sandbox_vm::{VmExit, UNEXPECTED_EXIT_STATUS};
use crate::task::service::timestamp;
use crate::task::task_service::{agent_call, status, Phase, TaskService, TtrpcResult};

/// Each WaitProcess call to the agent is bounded by this; the wait is renewed until the exit.
const WAIT_SLICE: Duration = Duration::from_secs(3600);
/// How long an exit report waits for the process's output to reach containerd.
const OUTPUT_DRAIN: Duration = Duration::from_secs(5);
/// Largest OCI process JSON accepted from containerd.
const MAX_PROCESS_JSON: usize = 1 << 20;

/// One exec process of an app container, as the shim tracks it.
pub struct ExecProc {
    pub fifos: Fifos,
    pub pid: u32,
    pub phase: Phase,
    pub exit: watch::Receiver<Option<VmExit>>,
    exit_tx: Arc<watch::Sender<Option<VmExit>>>,
    /// The stdin copy, until CloseIO.
    pub stdin: Option<stdio::StdinCopy>,
    /// The output copies, until the waiter takes them.
    outputs: Vec<tokio::task::JoinHandle<()>>,
}

impl ExecProc {
    fn new(fifos: Fifos, attached: Attached) -> Self {
        let (tx, rx) = watch::channel(None);
        ExecProc {
            fifos,
            pid: 0,
            phase: Phase::Created,
            exit: rx,
            exit_tx: Arc::new(tx),
            stdin: attached.stdin,
            outputs: attached.outputs,
        }
    }
}

fn exec_not_found(id: &str, exec_id: &str) -> containerd_shim_protos::ttrpc::Error {
    status(
        Code::NOT_FOUND,
        format!("microvm: exec {exec_id} of container {id} not found"),
    )
}

/// The OCI process JSON containerd sends in the Exec's `spec` Any (typeurl marshals the Go
/// `specs.Process` as JSON), checked to be a JSON object of bounded size.
pub fn process_json(
    spec: Option<&containerd_shim_protos::protobuf::well_known_types::any::Any>,
) -> Result<Vec<u8>, String> {
    let any = spec.ok_or("the exec request has no process spec")?;
    if any.value.len() > MAX_PROCESS_JSON {
        return Err(format!(
            "the exec's process spec is {} bytes (max {MAX_PROCESS_JSON})",
            any.value.len()
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(&any.value).map_err(|e| {
        format!(
            "the exec's process spec ({}) is not JSON: {e}",
            any.type_url
        )
    })?;
    if !value.is_object() {
        return Err("the exec's process spec is not a JSON object".into());
    }
    Ok(any.value.clone())
}

impl TaskService {
    /// Exec: registers the process in the agent, attaches its stdio, publishes TaskExecAdded.
    pub(super) async fn exec_add(&self, req: &api::ExecProcessRequest) -> TtrpcResult<()> {
        let (id, exec_id) = (req.id.clone(), req.exec_id.clone());
        let json = process_json(req.spec.as_ref()).map_err(|e| {
            status(
                Code::INVALID_ARGUMENT,
                format!("microvm: exec {exec_id}: {e}"),
            )
        })?;
        let (agent, socket) = {
            let inner = self.inner.lock().await;
            let c = inner.app(&id)?;
            if c.phase == Phase::Stopped || c.exit.borrow().is_some() {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("microvm: container {id} has stopped; cannot exec {exec_id}"),
                ));
            }
            if c.execs.contains_key(&exec_id) {
                return Err(status(
                    Code::ALREADY_EXISTS,
                    format!("microvm: exec {exec_id} of container {id} exists"),
                ));
            }
            inner.pod_agent_and_socket()?
        };
        let fifos = Fifos {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let attached = agent_call(format!("adding exec {exec_id} to container {id}"), async {
            let request = agent_protocol::agent::ExecProcessRequest {
                container_id: id.clone(),
                exec_id: exec_id.clone(),
                process_json: json,
                stdio: Some(fifos.agent_stdio()).into(),
                ..Default::default()
            };
            agent.exec_process(request).await?;
            match stdio::attach(&socket, &id, &exec_id, &fifos).await {
                Ok(attached) => Ok(attached),
                Err(e) => {
                    if let Err(r) = agent.remove_exec(&id, &exec_id).await {
                        log::warn!("forgetting exec {exec_id} of {id} after a failed attach: {r}");
                    }
                    Err(AgentError::BadReply {
                        method: "stdio",
                        reason: e.to_string(),
                    })
                }
            }
        })
        .await?;
        {
            let mut inner = self.inner.lock().await;
            match inner.containers.get_mut(&id) {
                Some(c) => {
                    c.execs
                        .insert(exec_id.clone(), ExecProc::new(fifos, attached));
                }
                None => {
                    // The container was deleted meanwhile: nothing will start this exec.
                    stdio::release_stdin_fifo(&fifos.stdin);
                    return Err(status(
                        Code::NOT_FOUND,
                        format!("microvm: container {id} was deleted during exec {exec_id}"),
                    ));
                }
            }
        }
        self.publish(
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: id,
                exec_id,
                ..Default::default()
            }),
        )
        .await;
        Ok(())
    }

    /// Start of an exec: runs it in the agent, publishes TaskExecStarted, waits for its exit.
    pub(super) async fn exec_start(&self, id: &str, exec_id: &str) -> TtrpcResult<u32> {
        let agent = {
            let inner = self.inner.lock().await;
            let e = inner.exec(id, exec_id)?;
            if e.phase != Phase::Created {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("microvm: exec {exec_id} of container {id} was already started"),
                ));
            }
            inner.pod_agent_and_socket()?.0
        };
        let pid = agent_call(
            format!("starting exec {exec_id} in container {id}"),
            agent.start_exec(id, exec_id),
        )
        .await?;
        let outputs = {
            let mut inner = self.inner.lock().await;
            let e = inner
                .containers
                .get_mut(id)
                .and_then(|c| c.execs.get_mut(exec_id))
                .ok_or_else(|| exec_not_found(id, exec_id))?;
            e.pid = pid;
            e.phase = Phase::Running;
            std::mem::take(&mut e.outputs)
        };
        self.publish(
            topics::TASK_EXEC_STARTED_EVENT_TOPIC,
            Box::new(TaskExecStarted {
                container_id: id.to_string(),
                exec_id: exec_id.to_string(),
                pid,
                ..Default::default()
            }),
        )
        .await;
        self.spawn_process_waiter(id.to_string(), exec_id.to_string(), pid, agent, outputs);
        Ok(pid)
    }

    /// State of an exec.
    pub(super) async fn exec_state(
        &self,
        req: &api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let inner = self.inner.lock().await;
        let c = inner.app(&req.id)?;
        let e = inner.exec(&req.id, &req.exec_id)?;
        let mut resp = api::StateResponse {
            id: req.exec_id.clone(),
            bundle: c.bundle.clone(),
            pid: e.pid,
            stdin: e.fifos.stdin.clone(),
            stdout: e.fifos.stdout.clone(),
            stderr: e.fifos.stderr.clone(),
            terminal: e.fifos.terminal,
            exec_id: req.exec_id.clone(),
            ..Default::default()
        };
        match (*e.exit.borrow(), e.phase) {
            (Some(x), _) => {
                resp.set_status(api::Status::STOPPED);
                resp.exit_status = x.status;
                resp.exited_at = Some(timestamp(x.at)).into();
            }
            (None, Phase::Created) => resp.set_status(api::Status::CREATED),
            (None, Phase::Stopped) => resp.set_status(api::Status::STOPPED),
            (None, _) => resp.set_status(api::Status::RUNNING),
        }
        Ok(resp)
    }

    /// The exit watch of an exec (Wait).
    pub(super) async fn exec_exit(
        &self,
        id: &str,
        exec_id: &str,
    ) -> TtrpcResult<watch::Receiver<Option<VmExit>>> {
        let inner = self.inner.lock().await;
        Ok(inner.exec(id, exec_id)?.exit.clone())
    }

    /// Kill of an exec: the signal goes to its process in the guest.
    pub(super) async fn exec_kill(&self, req: &api::KillRequest) -> TtrpcResult<()> {
        let agent = {
            let inner = self.inner.lock().await;
            let e = inner.exec(&req.id, &req.exec_id)?;
            if e.exit.borrow().is_some() || e.phase == Phase::Stopped {
                return Err(status(
                    Code::NOT_FOUND,
                    format!(
                        "microvm: exec {} of container {} already finished",
                        req.exec_id, req.id
                    ),
                ));
            }
            if e.phase == Phase::Created {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!(
                        "microvm: exec {} of container {} is not started",
                        req.exec_id, req.id
                    ),
                ));
            }
            inner.pod_agent_and_socket()?.0
        };
        if req.signal == 0 {
            return Ok(());
        }
        agent_call(
            format!("signalling exec {} of container {}", req.exec_id, req.id),
            agent.signal_process(&req.id, &req.exec_id, req.signal, false),
        )
        .await
    }

    /// Delete of an exec: it must not run; the agent forgets it; its stdio threads end.
    pub(super) async fn exec_delete(
        &self,
        req: &api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        let (exec, agent) = {
            let mut inner = self.inner.lock().await;
            let e = inner.exec(&req.id, &req.exec_id)?;
            if e.phase == Phase::Running && e.exit.borrow().is_none() {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!(
                        "microvm: exec {} of container {} is still running",
                        req.exec_id, req.id
                    ),
                ));
            }
            let agent = inner.pod_agent_and_socket().ok().map(|(a, _)| a);
            let exec = inner
                .containers
                .get_mut(&req.id)
                .and_then(|c| c.execs.remove(&req.exec_id))
                .ok_or_else(|| exec_not_found(&req.id, &req.exec_id))?;
            (exec, agent)
        };
        stdio::release_stdin_fifo(&exec.fifos.stdin);
        if let Some(agent) = agent {
            match agent.remove_exec(&req.id, &req.exec_id).await {
                // An exec whose start failed was already forgotten by the agent.
                Err(e) if exec.phase == Phase::Created => {
                    log::debug!("exec {} of {}: {e}", req.exec_id, req.id)
                }
                Err(e) => log::warn!(
                    "forgetting exec {} of {} in the guest: {e}",
                    req.exec_id,
                    req.id
                ),
                Ok(()) => {}
            }
        }
        let exit = (*exec.exit.borrow()).unwrap_or(VmExit {
            status: 0,
            at: SystemTime::now(),
        });
        Ok(api::DeleteResponse {
            pid: exec.pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    /// Waits (in the agent) for process (`id`, `exec_id`; "" = the init) to exit; then lets
    /// its output reach containerd (bounded), records the exit and publishes TaskExit.
    pub(super) fn spawn_process_waiter(
        &self,
        id: String,
        exec_id: String,
        pid: u32,
        agent: AgentClient,
        outputs: Vec<tokio::task::JoinHandle<()>>,
    ) {
        let service = self.clone();
        tokio::spawn(async move {
            let status = loop {
                match agent.wait_process(&id, &exec_id, WAIT_SLICE).await {
                    Ok((status, _)) => break status,
                    Err(e) if e.is_timeout() => continue,
                    Err(e) => {
                        log::warn!("waiting for process {exec_id:?} of container {id}: {e}");
                        break UNEXPECTED_EXIT_STATUS;
                    }
                }
            };
            let mut copies = Attached {
                stdin: None,
                outputs,
            };
            if !copies.wait_outputs(OUTPUT_DRAIN).await {
                log::warn!(
                    "process {exec_id:?} of container {id} exited; its output streams are \
                     still open after {OUTPUT_DRAIN:?} (a child holds them?)"
                );
            }
            let exit = VmExit {
                status,
                at: SystemTime::now(),
            };
            {
                let mut inner = service.inner.lock().await;
                if let Some(c) = inner.containers.get_mut(&id) {
                    if exec_id.is_empty() {
                        c.phase = Phase::Stopped;
                        if let Some(tx) = &c.app_exit {
                            let _ = tx.send(Some(exit));
                        }
                    } else if let Some(e) = c.execs.get_mut(&exec_id) {
                        e.phase = Phase::Stopped;
                        let _ = e.exit_tx.send(Some(exit));
                    }
                }
            }
            log::info!(
                "container {id}{}: exited with status {status}",
                if exec_id.is_empty() {
                    String::new()
                } else {
                    format!(" exec {exec_id}")
                }
            );
            let process_id = if exec_id.is_empty() {
                id.clone()
            } else {
                exec_id
            };
            service
                .publish(
                    topics::TASK_EXIT_EVENT_TOPIC,
                    Box::new(TaskExit {
                        container_id: id,
                        id: process_id,
                        pid,
                        exit_status: status,
                        exited_at: Some(timestamp(exit.at)).into(),
                        ..Default::default()
                    }),
                )
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim_protos::protobuf::well_known_types::any::Any;

    #[test]
    fn process_json_is_checked() {
        let any = |v: &[u8]| Any {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/Process".into(),
            value: v.to_vec(),
            ..Default::default()
        };
        let good = br#"{"args":["sh"],"cwd":"/"}"#;
        assert_eq!(process_json(Some(&any(good))).unwrap(), good.to_vec());
        assert!(process_json(None).unwrap_err().contains("no process spec"));
        assert!(process_json(Some(&any(b"[1]"))).is_err());
        assert!(process_json(Some(&any(b"{nope")))
            .unwrap_err()
            .contains("not JSON"));
        let huge = vec![b' '; MAX_PROCESS_JSON + 1];
        assert!(process_json(Some(&any(&huge))).unwrap_err().contains("max"));
    }
}
