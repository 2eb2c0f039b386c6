//! Glue between the balloon device and the device event loop (`event_manager`).

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::Balloon;
use crate::virtio::VirtioDevice;

impl MutEventSubscriber for Balloon {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        self.process_queue_event(events.data() as usize);
    }

    fn init(&mut self, ops: &mut EventOps) {
        for (q, evt) in self.queue_events().iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(evt, q as u32, EventSet::IN)) {
                log::error!("virtio-balloon: registering queue {q}: {e:?}");
            }
        }
    }
}
