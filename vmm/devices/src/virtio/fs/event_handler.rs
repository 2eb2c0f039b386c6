//! Glue between the virtio-fs device and the device event loop (`event_manager`).

use event_manager::{EventOps, Events, MutEventSubscriber};

use super::device::VirtioFs;
use crate::virtio::VirtioDevice;

impl MutEventSubscriber for VirtioFs {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        self.process_queue_event(events.data() as usize);
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.state().register_queue_events(ops);
    }
}
