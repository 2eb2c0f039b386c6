//! Work on a device's activated queues that every device model does the same way: serve a
//! bounded batch of chains, return them on the used ring, raise the interrupt when the driver
//! wants it, and come back later if the guest left more.
//!
//! The batch bound is one queue's worth of chains: a guest that keeps a queue full cannot hold
//! the single device event-loop thread, because the rest waits for the next turn of the loop
//! (the queue's eventfd is signalled again).

use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{IrqTrigger, INT_VRING};
use crate::GuestMemory;

/// What a device holds once the driver has activated it.
pub struct ActiveQueues {
    /// Guest memory the queues live in.
    pub mem: GuestMemory,
    /// The queues, in the device's order.
    pub queues: Vec<Queue>,
    /// The device's interrupt line.
    pub interrupt: Arc<IrqTrigger>,
}

/// Raises `interrupt` for `q` unless the driver suppressed notifications (an unreadable
/// event-index field counts as "notify": a spurious interrupt is harmless, a missing one hangs).
pub fn notify_used(q: &mut Queue, mem: &GuestMemory, interrupt: &IrqTrigger, device: &str) {
    match q.needs_notification(mem) {
        Ok(false) => {}
        Ok(true) | Err(_) => {
            if let Err(e) = interrupt.trigger(INT_VRING) {
                log::error!("{device}: raising the interrupt: {e}");
            }
        }
    }
}

/// Serves at most one queue's worth of available chains of `q`. `serve` handles one chain and
/// returns how many bytes it wrote into it; the chain then goes on the used ring. Returns true
/// when chains were left for later: the caller re-signals the queue ([`kick`]).
pub fn drain_queue<F>(
    q: &mut Queue,
    mem: &GuestMemory,
    interrupt: &IrqTrigger,
    device: &str,
    mut serve: F,
) -> bool
where
    F: FnMut(DescriptorChain<&GuestMemory>) -> u32,
{
    let mut used = false;
    let mut more = false;
    for i in 0..=q.size() {
        let Some(chain) = q.pop_descriptor_chain(mem) else {
            break;
        };
        if i == q.size() {
            // Budget spent: put it back and come back later.
            q.go_to_previous_position();
            more = true;
            break;
        }
        let head = chain.head_index();
        let len = serve(chain);
        if let Err(e) = q.add_used(mem, head, len) {
            crate::limited!(log::Level::Error, "{device}: used ring: {e}");
        }
        used = true;
    }
    if used {
        notify_used(q, mem, interrupt, device);
    }
    more
}

/// Signals queue `queue`'s eventfd so the event loop serves it again on its next turn.
pub fn kick(queue_events: &[EventFd], queue: usize, device: &str) {
    if let Some(evt) = queue_events.get(queue) {
        if let Err(e) = evt.write(1) {
            log::error!("{device}: re-signalling queue {queue}: {e}");
        }
    }
}
