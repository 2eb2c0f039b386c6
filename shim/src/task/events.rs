//! Events to containerd (TaskCreate, TaskStart, TaskExit, TaskOOM, ...) and the watchers that
//! turn what happens in the VM into them: the sandbox's exit when its VM ends, a process's exit
//! when the agent reports it (after its output reached containerd), and OOM kills in the guest.

use std::sync::Arc;
use std::time::Duration;

use containerd_shim::publisher::RemotePublisher;
use containerd_shim_protos::events::task::{TaskExit, TaskOOM};
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::stdio::Attached;
use crate::agent::AgentClient;
use crate::task::process::{Exit, StateHandle};
use crate::task::shim::timestamp;
use crate::vm::{VmEnd, UNKNOWN_STATUS};

/// Each GetOomEvent long poll to the agent is bounded by this.
const OOM_POLL: Duration = Duration::from_secs(30);
/// How long a failed OOM poll waits for the VM's end before it counts as a failure.
const OOM_WATCH_END_GRACE: Duration = Duration::from_secs(3);
/// Each WaitProcess call to the agent is bounded by this; the wait is renewed until the exit.
const WAIT_SLICE: Duration = Duration::from_secs(3600);
/// How long an exit report waits for the process's output to reach containerd.
const OUTPUT_DRAIN: Duration = Duration::from_secs(5);

/// containerd's event publisher for this shim's namespace.
#[derive(Clone)]
pub struct Events {
    publisher: Arc<RemotePublisher>,
    namespace: String,
}

impl Events {
    pub fn new(publisher: RemotePublisher, namespace: String) -> Events {
        Events {
            publisher: Arc::new(publisher),
            namespace,
        }
    }

    /// Publishes `event` on `topic`; a failure is logged (containerd may be restarting).
    pub async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let ctx = ttrpc::context::Context::default();
        if let Err(e) = self
            .publisher
            .publish(ctx, topic, &self.namespace, event)
            .await
        {
            log::warn!("publishing {topic}: {e}");
        }
    }

    /// TaskExit of process `id` (the container's id for its init) of container `container_id`.
    pub async fn exit(&self, container_id: &str, id: &str, pid: u32, exit: Exit) {
        self.publish(
            topics::TASK_EXIT_EVENT_TOPIC,
            Box::new(TaskExit {
                container_id: container_id.to_string(),
                id: id.to_string(),
                pid,
                exit_status: exit.status,
                exited_at: Some(timestamp(exit.at)).into(),
                ..Default::default()
            }),
        )
        .await;
    }
}

/// The sandbox's exit: once the VM has ended, records it on the sandbox's process and publishes
/// TaskExit.
pub fn watch_vm_exit(
    events: Events,
    id: String,
    pid: u32,
    state: StateHandle,
    ended: watch::Receiver<Option<VmEnd>>,
) {
    tokio::spawn(async move {
        let end = crate::vm::thread::wait_end(ended).await;
        let exit = Exit::from(&end);
        state.exited(exit);
        log::info!(
            "sandbox {id}: VM ended, exit status {} ({})",
            end.status,
            end.reason
        );
        events.exit(&id, &id, pid, exit).await;
    });
}

/// A process's exit (`exec_id` "" = the container's init): waits in the agent for it, lets its
/// output reach containerd (bounded), records it and publishes TaskExit.
pub fn watch_process_exit(
    events: Events,
    agent: AgentClient,
    ids: (String, String),
    pid: u32,
    state: StateHandle,
    outputs: Vec<JoinHandle<()>>,
) {
    let (id, exec_id) = ids;
    tokio::spawn(async move {
        let status = loop {
            match agent.wait_process(&id, &exec_id, WAIT_SLICE).await {
                Ok((status, _)) => break status,
                Err(e) if e.is_timeout() => continue,
                Err(e) => {
                    log::warn!("waiting for process {exec_id:?} of container {id}: {e}");
                    break UNKNOWN_STATUS;
                }
            }
        };
        let mut copies = Attached {
            stdin: None,
            outputs,
        };
        if !copies.wait_outputs(OUTPUT_DRAIN).await {
            // containerd waits for its FIFOs' EOF before it deletes a process: copies left
            // running would hold them open for as long as whatever holds the guest's side.
            log::warn!(
                "process {exec_id:?} of container {id} exited; its output streams are still \
                 open after {OUTPUT_DRAIN:?} (a child holds them?): the rest of its output is \
                 dropped"
            );
            copies.abort_outputs();
        }
        let exit = Exit::now(status);
        state.exited(exit);
        if exec_id.is_empty() {
            log::info!("container {id}: exited with status {status}");
            events.exit(&id, &id, pid, exit).await;
        } else {
            log::info!("container {id} exec {exec_id}: exited with status {status}");
            events.exit(&id, &exec_id, pid, exit).await;
        }
    });
}

/// Publishes TaskOOM for each OOM kill the agent reports, until the VM ends.
pub fn watch_oom(events: Events, agent: AgentClient, ended: watch::Receiver<Option<VmEnd>>) {
    tokio::spawn(async move {
        let mut warned = false;
        while ended.borrow().is_none() {
            match agent.get_oom_event(OOM_POLL).await {
                Ok(Some(container_id)) => {
                    log::info!("container {container_id}: OOM kill in the guest");
                    events
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
                    // The agent's connection ends with the VM: a stopping pod is no failure.
                    // Give the VM's end a moment to be seen before calling it one.
                    let mut ending = ended.clone();
                    let seen =
                        tokio::time::timeout(OOM_WATCH_END_GRACE, ending.wait_for(Option::is_some))
                            .await
                            .is_ok();
                    if seen || ended.borrow().is_some() {
                        log::debug!("OOM watcher: the VM ended ({e})");
                        break;
                    }
                    if !warned {
                        log::warn!("watching for OOM kills in the guest: {e}");
                        warned = true;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    });
}
