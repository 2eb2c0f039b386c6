//! Events to containerd (TaskCreate, TaskStart, TaskExit, TaskOOM, ...) and the watchers that
//! turn what happens in the VM into them: the sandbox's exit when its VM ends, a process's exit
//! when the agent reports it (after its output reached containerd), and OOM kills in the guest.
//!
//! The guest is hostile and answers as often as it likes, so the watchers believe it only so
//! far: an OOM event becomes TaskOOM only for a live app container of this pod (one the shim
//! created and has not deleted), at most once per container per [`OOM_COALESCE`] and at most
//! [`OOM_BUDGET`] per [`OOM_BUDGET_WINDOW`] for the pod ([`OomFilter`]); each long poll loop
//! (GetOomEvent, WaitProcess) runs at a bounded rate however fast the agent answers, so an agent
//! that answers at once, in a loop, cannot make the shim spin. An exit is asked for one process
//! the shim started, by its ids, so the agent cannot report another's; the exit time is the
//! shim's own clock; and a process the host SIGKILLed counts as exited (137) when the guest has
//! not reported its exit within [`KILL_REPORT_GRACE`], so a guest that never reports exits
//! cannot hold a pod's stop ([`watch_kill`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use containerd_shim::publisher::RemotePublisher;
use containerd_shim_protos::events::task::{TaskExit, TaskOOM};
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc;
use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use crate::agent::stdio::Attached;
use crate::agent::AgentClient;
use crate::sandbox::Sandbox;
use crate::task::container::Containers;
use crate::task::process::timestamp;
use crate::task::process::{Exit, StateHandle};
use crate::vm::{VmEnd, UNKNOWN_STATUS};

/// Each GetOomEvent long poll to the agent is bounded by this.
const OOM_POLL: Duration = Duration::from_secs(30);
/// How long a failed agent call (an OOM poll, a process wait) waits for the VM's end before
/// it counts as a failure.
const VM_END_GRACE: Duration = Duration::from_secs(3);
/// The exit status of a process its pod's VM took with it: killed (128 + SIGKILL).
const KILLED_WITH_VM: u32 = 137;
/// Each WaitProcess call to the agent is bounded by this; the wait is renewed until the exit.
const WAIT_SLICE: Duration = Duration::from_secs(3600);
/// How long an exit report waits for the process's output to reach containerd.
const OUTPUT_DRAIN: Duration = Duration::from_secs(5);
/// How long after a SIGKILL the shim waits for the guest to report the process's exit before
/// it counts the process as killed ([`watch_kill`]).
pub const KILL_REPORT_GRACE: Duration = Duration::from_secs(30);
/// The shortest time between two GetOomEvent polls: the most OOM events read per second is
/// its inverse, however fast the agent answers.
const OOM_POLL_GAP: Duration = Duration::from_millis(100);
/// The shortest time between two WaitProcess calls for one process (a real one waits up to
/// [`WAIT_SLICE`]; an agent that ends each at once is held to this rate).
const WAIT_GAP: Duration = Duration::from_secs(1);
/// One TaskOOM per container within this time; later events of the same container are
/// dropped (containerd records the reason once).
pub const OOM_COALESCE: Duration = Duration::from_secs(10);
/// At most this many TaskOOM per [`OOM_BUDGET_WINDOW`] for the whole pod.
pub const OOM_BUDGET: u32 = 16;
/// The window of [`OOM_BUDGET`].
pub const OOM_BUDGET_WINDOW: Duration = Duration::from_secs(60);

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

    /// TaskOOM of container `container_id` (containerd records the container's reason as
    /// OOMKilled when it exits).
    pub async fn oom(&self, container_id: &str) {
        self.publish(
            topics::TASK_OOM_EVENT_TOPIC,
            Box::new(TaskOOM {
                container_id: container_id.to_string(),
                ..Default::default()
            }),
        )
        .await;
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
/// TaskExit; a VM the host's OOM killer ended is told as such first ([`told_host_oom`]).
pub fn watch_vm_exit(events: Events, id: String, pid: u32, state: StateHandle, pod: Arc<Sandbox>) {
    tokio::spawn(async move {
        let end = crate::vm::thread::wait_end(pod.ended()).await;
        let exit = Exit::from(&end);
        state.exited(exit);
        log::info!(
            "sandbox {id}: VM ended, exit status {} ({})",
            end.status,
            end.reason
        );
        told_host_oom(&events, &pod, &id).await;
        events.exit(&id, &id, pid, exit).await;
    });
}

/// After the pod's VM ended: if the host's OOM killer ended it (the kernel counted a kill in
/// the pod's host cgroup), says so in a warn line naming the limit, the peak and what to
/// raise, and publishes TaskOOM for `container_id` (the sandbox's own, or an app container
/// whose process the VM's end took). Returns whether it did.
pub async fn told_host_oom(events: &Events, pod: &Sandbox, container_id: &str) -> bool {
    let Some(oom) = pod.host_oom() else {
        return false;
    };
    if container_id == pod.id() {
        log::warn!("sandbox {container_id}: {oom}");
    } else {
        log::warn!("container {container_id}: ended with its pod's VM: {oom}");
    }
    events.oom(container_id).await;
    true
}

/// A process's exit (`exec_id` "" = the container's init): waits in the agent for it, lets its
/// output reach containerd (bounded), records it and publishes TaskExit.
pub fn watch_process_exit(
    events: Events,
    pod: Arc<Sandbox>,
    ids: (String, String),
    pid: u32,
    state: StateHandle,
    outputs: Vec<JoinHandle<()>>,
) {
    let (id, exec_id) = ids;
    let agent = pod.agent();
    tokio::spawn(async move {
        let mut pace = tokio::time::interval(WAIT_GAP);
        pace.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let status = loop {
            pace.tick().await;
            if state.has_exited() {
                // Counted as killed already (watch_kill), TaskExit published.
                return;
            }
            match agent.wait_process(&id, &exec_id, WAIT_SLICE).await {
                Ok((status, _)) => break status,
                Err(e) if e.is_timeout() => continue,
                Err(e) => {
                    // The agent's connection ends with the VM, which takes the process with
                    // it: counted as killed (137), with the VM's end in a warn line; a VM the
                    // host's OOM killer ended is told as such (TaskOOM for the container's
                    // init: TaskOOM is a container's).
                    if let Some(end) = vm_end(&pod).await {
                        if pod.host_oom().is_some() {
                            if exec_id.is_empty() {
                                told_host_oom(&events, &pod, &id).await;
                            }
                        } else {
                            let what = if exec_id.is_empty() {
                                format!("container {id}")
                            } else {
                                format!("container {id} exec {exec_id}")
                            };
                            log::warn!(
                                "{what}: ended with its pod's VM ({}, VM exit status {}); \
                                 counted as killed ({KILLED_WITH_VM})",
                                end.reason,
                                end.status
                            );
                        }
                        break KILLED_WITH_VM;
                    }
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
        if !state.exited(exit) {
            // Counted as killed meanwhile: its TaskExit is out already.
            return;
        }
        if exec_id.is_empty() {
            log::info!("container {id}: exited with status {status}");
            events.exit(&id, &id, pid, exit).await;
        } else {
            log::info!("container {id} exec {exec_id}: exited with status {status}");
            events.exit(&id, &exec_id, pid, exit).await;
        }
    });
}

/// The pod's VM's end, if it has ended (waiting up to [`VM_END_GRACE`] for it: a lost agent
/// connection comes first).
async fn vm_end(pod: &Sandbox) -> Option<VmEnd> {
    let mut ended = pod.ended();
    let _ = tokio::time::timeout(VM_END_GRACE, ended.wait_for(Option::is_some)).await;
    let end = ended.borrow().clone();
    end
}

/// After the host's SIGKILL of a process (`id` = the container's id for its init, else the
/// exec id): if the guest has not reported its exit within [`KILL_REPORT_GRACE`], records it
/// as killed (137) and publishes TaskExit, as containerd waits for that before it can delete
/// the process or stop the pod.
pub fn watch_kill(events: Events, ids: (String, String), pid: u32, state: StateHandle) {
    let (container_id, id) = ids;
    tokio::spawn(async move {
        let exited = crate::task::process::wait_exit(state.watch());
        if tokio::time::timeout(KILL_REPORT_GRACE, exited)
            .await
            .is_ok()
        {
            return;
        }
        let exit = Exit::now(137);
        if state.exited(exit) {
            log::warn!(
                "{id} of container {container_id}: the guest reported no exit \
                 {KILL_REPORT_GRACE:?} after SIGKILL: counted as killed"
            );
            events.exit(&container_id, &id, pid, exit).await;
        }
    });
}

/// What becomes of an OOM event the guest reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OomVerdict {
    /// Published as TaskOOM.
    Publish,
    /// No live app container of this pod has that id (another pod's, a deleted one, made up).
    NotLive,
    /// The same container had its TaskOOM less than [`OOM_COALESCE`] ago.
    Coalesced,
    /// The pod used its [`OOM_BUDGET`] in this window.
    OverBudget,
}

/// The OOM events the shim believes (module doc): the state behind [`OomVerdict`].
#[derive(Debug, Default)]
pub struct OomFilter {
    /// When each container last had a TaskOOM, within [`OOM_COALESCE`] (live containers only).
    last: HashMap<String, Instant>,
    window_start: Option<Instant>,
    in_window: u32,
}

impl OomFilter {
    /// The verdict on an event for `id` at `now`; `live` says whether `id` is a live app
    /// container of this pod.
    pub fn judge(&mut self, id: &str, live: bool, now: Instant) -> OomVerdict {
        if !live {
            // A deleted container's entry goes with it; nothing else is kept for a dead id.
            self.last.remove(id);
            return OomVerdict::NotLive;
        }
        if self
            .last
            .get(id)
            .is_some_and(|t| now.saturating_duration_since(*t) < OOM_COALESCE)
        {
            return OomVerdict::Coalesced;
        }
        if self
            .window_start
            .is_none_or(|s| now.saturating_duration_since(s) >= OOM_BUDGET_WINDOW)
        {
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window >= OOM_BUDGET {
            return OomVerdict::OverBudget;
        }
        self.in_window += 1;
        // Entries older than the coalescing window decide nothing: at most a budget's worth
        // is kept.
        self.last
            .retain(|_, t| now.saturating_duration_since(*t) < OOM_COALESCE);
        self.last.insert(id.to_string(), now);
        OomVerdict::Publish
    }
}

/// Publishes TaskOOM for each OOM kill the agent reports that [`OomFilter`] lets through,
/// until the VM ends. `containers` is the task service's table: an id is live while it holds
/// an app container of that id.
pub fn watch_oom(
    events: Events,
    agent: AgentClient,
    containers: Arc<Mutex<Containers>>,
    ended: watch::Receiver<Option<VmEnd>>,
) {
    tokio::spawn(async move {
        let mut warned = false;
        let mut filter = OomFilter::default();
        let mut pace = tokio::time::interval(OOM_POLL_GAP);
        pace.set_missed_tick_behavior(MissedTickBehavior::Delay);
        while ended.borrow().is_none() {
            pace.tick().await;
            match agent.get_oom_event(OOM_POLL).await {
                Ok(Some(container_id)) => {
                    let live = containers
                        .lock()
                        .await
                        .map
                        .get(&container_id)
                        .is_some_and(|c| c.is_app());
                    match filter.judge(&container_id, live, Instant::now()) {
                        OomVerdict::Publish => {
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
                        OomVerdict::NotLive => log::warn!(
                            "the guest reported an OOM kill of {container_id:?}, which is no \
                             live container of this pod: ignored"
                        ),
                        OomVerdict::Coalesced => log::debug!(
                            "container {container_id}: another OOM kill within {OOM_COALESCE:?}"
                        ),
                        OomVerdict::OverBudget => log::warn!(
                            "container {container_id}: OOM kill not passed on: the pod had \
                             {OOM_BUDGET} within {OOM_BUDGET_WINDOW:?}"
                        ),
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    // The agent's connection ends with the VM: a stopping pod is no failure.
                    // Give the VM's end a moment to be seen before calling it one.
                    let mut ending = ended.clone();
                    let seen = tokio::time::timeout(VM_END_GRACE, ending.wait_for(Option::is_some))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_live_containers_once_per_window_within_the_pods_budget() {
        let t0 = Instant::now();
        let mut f = OomFilter::default();
        assert_eq!(f.judge("other-pod-c", false, t0), OomVerdict::NotLive);
        assert_eq!(f.judge("c1", true, t0), OomVerdict::Publish);
        // The same container again and again: one TaskOOM per window.
        for i in 1..1000 {
            let at = t0 + Duration::from_millis(i);
            assert_eq!(f.judge("c1", true, at), OomVerdict::Coalesced);
        }
        assert_eq!(f.judge("c1", true, t0 + OOM_COALESCE), OomVerdict::Publish);
        // Many live containers at once: the pod's budget, then nothing until the next window.
        let mut published = 2;
        for i in 0..100 {
            if f.judge(&format!("n{i}"), true, t0 + OOM_COALESCE) == OomVerdict::Publish {
                published += 1;
            }
        }
        assert_eq!(published, OOM_BUDGET);
        assert_eq!(
            f.judge("late", true, t0 + OOM_COALESCE),
            OomVerdict::OverBudget
        );
        assert_eq!(
            f.judge("late", true, t0 + OOM_BUDGET_WINDOW),
            OomVerdict::Publish
        );
        // A container deleted (not live) is forgotten.
        assert_eq!(f.judge("c1", false, t0), OomVerdict::NotLive);
        assert!(!f.last.contains_key("c1"));
    }
}
