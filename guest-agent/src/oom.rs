//! OOM events: a thread compares each container's `memory.events` `oom_kill` counter every
//! [`POLL`] and queues the id of a container whose counter grew; GetOomEvent long-polls the queue.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::containers::{cgroup_dir, read_stats, Containers};

const POLL: Duration = Duration::from_millis(500);
/// Events kept while nobody asks; older ones are dropped.
const MAX_QUEUED: usize = 1024;

#[derive(Default)]
pub struct OomEvents {
    queue: Mutex<VecDeque<String>>,
    ready: Condvar,
    /// The `oom_kill` counter last seen per container.
    seen: Mutex<HashMap<String, u64>>,
}

impl OomEvents {
    fn push(&self, id: String) {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if queue.len() >= MAX_QUEUED {
            queue.pop_front();
        }
        queue.push_back(id);
        self.ready.notify_one();
    }

    /// Queues an event if container `id`'s `oom_kill` counter grew since last seen. Called by
    /// the watcher, and when a container's init exits or the container is removed: the shim
    /// removes a container right after its exit, often before the next poll would see it.
    pub fn check(&self, id: &str) {
        if !agent_protocol::stdio::valid_id(id) {
            return;
        }
        let kills = read_stats(&cgroup_dir(id)).oom_kills;
        let grew = {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let before = seen.insert(id.to_owned(), kills).unwrap_or(0);
            kills > before
        };
        if grew {
            log::info!("container {id}: OOM kill");
            self.push(id.to_owned());
        }
    }

    /// Forgets a removed container's counter.
    pub fn forget(&self, id: &str) {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// The next event, or None after `timeout`.
    pub fn next(&self, timeout: Duration) -> Option<String> {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let (mut queue, _) = self
            .ready
            .wait_timeout_while(queue, timeout, |q| q.is_empty())
            .unwrap_or_else(|e| e.into_inner());
        queue.pop_front()
    }

    /// Starts the watcher thread.
    pub fn watch(self: &Arc<Self>, containers: Arc<Containers>) -> std::io::Result<()> {
        let events = self.clone();
        std::thread::Builder::new()
            .name("oom-watch".into())
            .spawn(move || loop {
                std::thread::sleep(POLL);
                for id in containers.ids() {
                    events.check(&id);
                }
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_is_bounded_and_times_out() {
        let events = OomEvents::default();
        assert_eq!(events.next(Duration::from_millis(10)), None);
        for i in 0..(MAX_QUEUED + 5) {
            events.push(format!("c{i}"));
        }
        assert_eq!(events.next(Duration::ZERO).as_deref(), Some("c5"));
    }
}
