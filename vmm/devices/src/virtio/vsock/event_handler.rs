//! Glue between the vsock device and the device event loop (`event_manager`).

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::device::Vsock;
use crate::virtio::VirtioDevice;

/// Event data of the backend (muxer) fd; queue eventfds use their queue index.
const BACKEND: u32 = 100;

impl MutEventSubscriber for Vsock {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        match events.data() {
            BACKEND => self.process_backend(),
            q => self.process_queue_event(q as usize),
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.state().register_queue_events(ops);
        let fd = self.backend_fd();
        if let Err(e) = ops.add(Events::with_data_raw(fd, BACKEND, EventSet::IN)) {
            log::error!("vsock: registering the backend: {e:?}");
        }
    }
}
