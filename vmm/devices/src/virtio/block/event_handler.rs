//! Glue between the block device and the device event loop (`event_manager`).

use event_manager::{EventOps, Events, MutEventSubscriber};

use super::device::Block;
use crate::virtio::VirtioDevice;

impl MutEventSubscriber for Block {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.process_queue_event();
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.state().register_queue_events(ops);
    }
}
