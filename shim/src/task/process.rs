//! A process as the task API sees it (a container's init, an exec, or the sandbox's "process",
//! its VM): a pid, stdio, and one watched [`State`]. Exits are recorded once, by the watcher
//! that sees them, through a [`StateHandle`]; Wait and State read the watch.

use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::stdio::{Attached, Fifos, StdinCopy};
use crate::vm::{VmEnd, UNKNOWN_STATUS};

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Its exit status (n, or 128 + signal).
    pub status: u32,
    /// When it ended.
    pub at: SystemTime,
}

impl Exit {
    /// An exit now with `status`.
    pub fn now(status: u32) -> Exit {
        Exit {
            status,
            at: SystemTime::now(),
        }
    }
}

impl From<&VmEnd> for Exit {
    fn from(end: &VmEnd) -> Exit {
        Exit {
            status: end.status,
            at: end.at,
        }
    }
}

/// Where a process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Created,
    Running,
    Paused,
    Exited(Exit),
}

/// Records a process's state from outside (its watcher); shared with the [`Process`].
#[derive(Debug, Clone)]
pub struct StateHandle(Arc<watch::Sender<State>>);

impl StateHandle {
    /// Records the exit (the first one wins); whether this one did.
    pub fn exited(&self, exit: Exit) -> bool {
        self.0.send_if_modified(|s| {
            if matches!(s, State::Exited(_)) {
                false
            } else {
                *s = State::Exited(exit);
                true
            }
        })
    }

    /// Whether an exit is recorded.
    pub fn has_exited(&self) -> bool {
        matches!(*self.0.borrow(), State::Exited(_))
    }

    /// A watch of the state.
    pub fn watch(&self) -> watch::Receiver<State> {
        self.0.subscribe()
    }
}

/// One process of a container.
#[derive(Debug)]
pub struct Process {
    /// Its pid (the guest's; the shim's own for the sandbox; 0 until an exec starts).
    pub pid: u32,
    /// containerd's FIFOs for it.
    pub fifos: Fifos,
    state: StateHandle,
    /// The stdin copy, until CloseIO or Delete.
    pub stdin: Option<StdinCopy>,
    /// The output copies, until Start hands them to the waiter.
    pub outputs: Vec<JoinHandle<()>>,
}

impl Process {
    /// A created process with its stdio copies.
    pub fn new(pid: u32, fifos: Fifos, attached: Attached) -> Process {
        let (tx, _) = watch::channel(State::Created);
        Process {
            pid,
            fifos,
            state: StateHandle(Arc::new(tx)),
            stdin: attached.stdin,
            outputs: attached.outputs,
        }
    }

    /// Where it is now.
    pub fn state(&self) -> State {
        *self.state.0.borrow()
    }

    /// Its exit, once it has ended.
    pub fn exit(&self) -> Option<Exit> {
        match self.state() {
            State::Exited(e) => Some(e),
            _ => None,
        }
    }

    /// Moves it to `state`, unless it has exited already.
    pub fn set(&self, state: State) {
        self.state.0.send_if_modified(|s| {
            if matches!(s, State::Exited(_)) || *s == state {
                false
            } else {
                *s = state;
                true
            }
        });
    }

    /// The handle its watcher records the exit through.
    pub fn handle(&self) -> StateHandle {
        self.state.clone()
    }

    /// A watch of its state (Wait).
    pub fn watch(&self) -> watch::Receiver<State> {
        self.state.0.subscribe()
    }
}

/// Waits for the exit a state watch reports; a process whose record went away without one (its
/// container deleted meanwhile) counts as ended now with [`UNKNOWN_STATUS`].
pub async fn wait_exit(mut rx: watch::Receiver<State>) -> Exit {
    let exited = rx.wait_for(|s| matches!(s, State::Exited(_))).await;
    match exited.map(|s| *s) {
        Ok(State::Exited(e)) => e,
        _ => Exit::now(UNKNOWN_STATUS),
    }
}

/// A protobuf timestamp (of a process's creation or exit, for containerd).
pub fn timestamp(
    t: std::time::SystemTime,
) -> containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp {
    let d = t
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_exit_wins_and_wakes_waiters() {
        let p = Process::new(7, Fifos::default(), Attached::default());
        assert_eq!(p.state(), State::Created);
        p.set(State::Running);
        let waiter = tokio::spawn(wait_exit(p.watch()));
        let first = Exit::now(3);
        assert!(!p.handle().has_exited());
        assert!(p.handle().exited(first));
        assert!(!p.handle().exited(Exit::now(9)));
        assert!(p.handle().has_exited());
        p.set(State::Paused);
        assert_eq!(p.state(), State::Exited(first));
        assert_eq!(waiter.await.unwrap(), first);
        // A record dropped without an exit: the waiter is not left hanging.
        let q = Process::new(8, Fifos::default(), Attached::default());
        let rx = q.watch();
        drop(q);
        assert_eq!(wait_exit(rx).await.status, UNKNOWN_STATUS);
    }
}
