//! Exec processes of app containers (`ctr task exec`, CRI ExecSync/Exec): Exec registers the
//! OCI process with the agent and attaches its stdio FIFOs to the agent's stdio streams (the
//! agent accepts streams before the start); Start runs it (a missing binary fails here, with the
//! agent's error naming it); a watcher reports its exit (TaskExit with the exec id) once its
//! output reached containerd ([`super::events::watch_process_exit`]); Delete forgets it in the
//! agent too.

use containerd_shim_protos::api;
use containerd_shim_protos::events::task::{TaskExecAdded, TaskExecStarted};
use containerd_shim_protos::topics;
use oci_spec::runtime::Process as OciProcess;

use crate::agent::stdio::{self, Fifos};
use crate::agent::AgentError;
use crate::error::{Error, Result};
use crate::task::container::exec_not_found;
use crate::task::events;
use crate::task::process::{Exit, Process, State};
use crate::task::service::{set_status, TaskService};

/// Largest OCI process JSON accepted from containerd.
const MAX_PROCESS_JSON: usize = 1 << 20;

/// Why an Exec's process spec cannot go to the agent.
#[derive(Debug, thiserror::Error)]
pub enum ProcessSpecError {
    #[error("the exec request has no process spec")]
    Missing,
    #[error("the exec's process spec is {0} bytes (max {MAX_PROCESS_JSON})")]
    TooLarge(usize),
    #[error("the exec's process spec ({type_url}) is not JSON of an OCI process: {source}")]
    Parse {
        type_url: String,
        source: serde_json::Error,
    },
    #[error("the exec's process spec as JSON for the agent: {0}")]
    Serialize(serde_json::Error),
}

/// The OCI process containerd sends in the Exec's `spec` Any (typeurl marshals the Go
/// `specs.Process` as JSON), of bounded size, typed ([`OciProcess`], as the agent types it) and
/// serialized again for the agent.
pub fn process_json(
    spec: Option<&containerd_shim_protos::protobuf::well_known_types::any::Any>,
) -> std::result::Result<Vec<u8>, ProcessSpecError> {
    let any = spec.ok_or(ProcessSpecError::Missing)?;
    if any.value.len() > MAX_PROCESS_JSON {
        return Err(ProcessSpecError::TooLarge(any.value.len()));
    }
    let process: OciProcess =
        serde_json::from_slice(&any.value).map_err(|source| ProcessSpecError::Parse {
            type_url: any.type_url.clone(),
            source,
        })?;
    serde_json::to_vec(&process).map_err(ProcessSpecError::Serialize)
}

impl TaskService {
    /// Exec: registers the process in the agent, attaches its stdio, publishes TaskExecAdded.
    pub(super) async fn exec_add(&self, req: &api::ExecProcessRequest) -> Result<()> {
        let (id, exec_id) = (req.id.clone(), req.exec_id.clone());
        let json = process_json(req.spec.as_ref())
            .map_err(|e| Error::InvalidArgument(format!("exec {exec_id}: {e}")))?;
        let sandbox = {
            let inner = self.inner.lock().await;
            let c = inner.app(&id)?;
            if c.init.exit().is_some() {
                return Err(Error::FailedPrecondition(format!(
                    "container {id} has stopped; cannot exec {exec_id}"
                )));
            }
            if c.execs().is_some_and(|e| e.contains_key(&exec_id)) {
                return Err(Error::AlreadyExists(format!(
                    "exec {exec_id} of container {id} exists"
                )));
            }
            inner.sandbox()?
        };
        let fifos = Fifos {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let agent = sandbox.agent();
        let added = async {
            let request = agent_protocol::agent::ExecProcessRequest {
                container_id: id.clone(),
                exec_id: exec_id.clone(),
                process_json: json,
                stdio: Some(fifos.agent_stdio()).into(),
                ..Default::default()
            };
            agent.exec_process(request).await?;
            match stdio::attach(sandbox.agent_socket(), &id, &exec_id, &fifos).await {
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
        };
        let attached = added.await.map_err(Error::agent(format!(
            "adding exec {exec_id} to container {id}"
        )))?;
        {
            let mut inner = self.inner.lock().await;
            match inner.map.get_mut(&id).and_then(|c| c.execs_mut()) {
                Some(execs) => {
                    execs.insert(exec_id.clone(), Process::new(0, fifos, attached));
                }
                None => {
                    // The container was deleted meanwhile: nothing will start this exec.
                    stdio::release_stdin_fifo(&fifos.stdin);
                    return Err(Error::NotFound(format!(
                        "container {id} was deleted during exec {exec_id}"
                    )));
                }
            }
        }
        self.events
            .publish(
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

    /// Start of an exec: runs it in the agent, publishes TaskExecStarted, watches for its exit.
    pub(super) async fn exec_start(&self, id: &str, exec_id: &str) -> Result<u32> {
        let pod = {
            let inner = self.inner.lock().await;
            if inner.exec(id, exec_id)?.state() != State::Created {
                return Err(Error::FailedPrecondition(format!(
                    "exec {exec_id} of container {id} was already started"
                )));
            }
            inner.sandbox()?
        };
        let agent = pod.agent();
        let pid = agent
            .start_exec(id, exec_id)
            .await
            .map_err(Error::agent(format!(
                "starting exec {exec_id} in container {id}"
            )))?;
        let (outputs, handle) = {
            let mut inner = self.inner.lock().await;
            let e = inner
                .map
                .get_mut(id)
                .and_then(|c| c.execs_mut())
                .and_then(|e| e.get_mut(exec_id))
                .ok_or_else(|| exec_not_found(id, exec_id))?;
            e.pid = pid;
            e.set(State::Running);
            (std::mem::take(&mut e.outputs), e.handle())
        };
        self.events
            .publish(
                topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: id.to_string(),
                    exec_id: exec_id.to_string(),
                    pid,
                    ..Default::default()
                }),
            )
            .await;
        events::watch_process_exit(
            self.events.clone(),
            pod,
            (id.to_string(), exec_id.to_string()),
            pid,
            handle,
            outputs,
        );
        Ok(pid)
    }

    /// State of an exec.
    pub(super) async fn exec_state(&self, req: &api::StateRequest) -> Result<api::StateResponse> {
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
        set_status(&mut resp, e.state());
        Ok(resp)
    }

    /// Kill of an exec: the signal goes to its process in the guest.
    pub(super) async fn exec_kill(&self, req: &api::KillRequest) -> Result<()> {
        let agent = {
            let inner = self.inner.lock().await;
            let exec = inner.exec(&req.id, &req.exec_id)?;
            match exec.state() {
                State::Exited(_) => {
                    return Err(Error::NotFound(format!(
                        "exec {} of container {} already finished",
                        req.exec_id, req.id
                    )))
                }
                State::Created => {
                    return Err(Error::FailedPrecondition(format!(
                        "exec {} of container {} is not started",
                        req.exec_id, req.id
                    )))
                }
                State::Running | State::Paused => {}
            }
            if req.signal == 9 {
                // The host's word, whatever the guest reports (events::watch_kill).
                events::watch_kill(
                    self.events.clone(),
                    (req.id.clone(), req.exec_id.clone()),
                    exec.pid,
                    exec.handle(),
                );
            }
            inner.sandbox()?.agent()
        };
        if req.signal == 0 {
            return Ok(());
        }
        agent
            .signal_process(&req.id, &req.exec_id, req.signal, false)
            .await
            .map_err(Error::agent(format!(
                "signalling exec {} of container {}",
                req.exec_id, req.id
            )))
    }

    /// Delete of an exec: it must not run; the agent forgets it; its stdio copies end.
    pub(super) async fn exec_delete(
        &self,
        req: &api::DeleteRequest,
    ) -> Result<api::DeleteResponse> {
        let (exec, agent) = {
            let mut inner = self.inner.lock().await;
            if inner.exec(&req.id, &req.exec_id)?.state() == State::Running {
                return Err(Error::FailedPrecondition(format!(
                    "exec {} of container {} is still running",
                    req.exec_id, req.id
                )));
            }
            let agent = inner.sandbox().ok().map(|s| s.agent());
            let exec = inner
                .map
                .get_mut(&req.id)
                .and_then(|c| c.execs_mut())
                .and_then(|e| e.remove(&req.exec_id))
                .ok_or_else(|| exec_not_found(&req.id, &req.exec_id))?;
            (exec, agent)
        };
        stdio::release_stdin_fifo(&exec.fifos.stdin);
        if let Some(agent) = agent {
            match agent.remove_exec(&req.id, &req.exec_id).await {
                // An exec whose start failed was already forgotten by the agent.
                Err(e) if exec.state() == State::Created => {
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
        let exit = exec.exit().unwrap_or(Exit::now(0));
        Ok(api::DeleteResponse {
            pid: exec.pid,
            exit_status: exit.status,
            exited_at: Some(timestamp_of(exit)).into(),
            ..Default::default()
        })
    }
}

fn timestamp_of(
    exit: Exit,
) -> containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp {
    crate::task::process::timestamp(exit.at)
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
        // As containerd writes it (Go's specs.Process; user and cwd are always there).
        let good = br#"{"user":{"uid":0,"gid":0},"args":["sh"],"cwd":"/"}"#;
        assert_eq!(process_json(Some(&any(good))).unwrap(), good.to_vec());
        let err = |e: ProcessSpecError| e.to_string();
        assert!(err(process_json(None).unwrap_err()).contains("no process spec"));
        assert!(process_json(Some(&any(b"[1]"))).is_err());
        assert!(err(process_json(Some(&any(b"{nope"))).unwrap_err()).contains("not JSON"));
        let huge = vec![b' '; MAX_PROCESS_JSON + 1];
        assert!(err(process_json(Some(&any(&huge))).unwrap_err()).contains("max"));
    }
}
