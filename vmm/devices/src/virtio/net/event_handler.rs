//! Glue between the net device and the device event loop (`event_manager`).
//!
//! The queue eventfds are watched all the time; the backend fd only for what
//! [`Net::backend_interest`] asks, re-evaluated after every event the device handles.

use event_manager::{EventOps, Events, MutEventSubscriber};

use super::device::Net;
use super::NetBackend;
use crate::virtio::VirtioDevice;

/// Event data of the backend fd; queue eventfds use their queue index.
const BACKEND: u32 = 100;

impl<B: NetBackend> Net<B> {
    /// Makes the event loop watch the backend for what the device needs now.
    fn sync_backend_interest(&mut self, ops: &mut EventOps) {
        let want = self.backend_interest();
        let fd = self.backend_fd();
        let events = Events::with_data_raw(fd, BACKEND, want);
        let result = match self.registered {
            None if want.is_empty() => return,
            None => ops.add(events),
            Some(_) if want.is_empty() => ops.remove(events),
            Some(now) if now == want => return,
            Some(_) => ops.modify(events),
        };
        match result {
            Ok(()) => self.registered = (!want.is_empty()).then_some(want),
            Err(e) => log::error!("virtio-net: watching the backend for {want:?}: {e:?}"),
        }
    }
}

impl<B: NetBackend> MutEventSubscriber for Net<B> {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            BACKEND => self.process_backend(events.event_set()),
            q => self.process_queue_event(q as usize),
        }
        self.sync_backend_interest(ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.state().register_queue_events(ops);
        self.sync_backend_interest(ops);
    }
}
