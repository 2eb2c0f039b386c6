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
            .spawn(move || {
                let mut seen: HashMap<String, u64> = HashMap::new();
                loop {
                    std::thread::sleep(POLL);
                    let ids = containers.ids();
                    seen.retain(|id, _| ids.contains(id));
                    for id in ids {
                        let kills = read_stats(&cgroup_dir(&id)).oom_kills;
                        let before = seen.insert(id.clone(), kills).unwrap_or(0);
                        if kills > before {
                            log::info!("container {id}: OOM kill");
                            events.push(id);
                        }
                    }
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
