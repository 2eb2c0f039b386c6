//! Glue between the block device and the device event loop (`event_manager`).

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::Block;

impl MutEventSubscriber for Block {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.process_queue_event();
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Some(evt) = self.queue_events_ref().first() {
            if let Err(e) = ops.add(Events::with_data(evt, 0, EventSet::IN)) {
                log::error!("virtio-blk: registering the queue: {e:?}");
            }
        }
    }
}
