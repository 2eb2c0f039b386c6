//! The device event loop: one thread running an `EventManager`. Devices that do work off the
//! vCPU threads (virtio queues, backends) subscribe here; a control subscriber ends the loop when
//! the VM ends and turns the i8042 reset line into a clean VM exit.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::handle::Shared;
use crate::jail::ThreadFilter;
use crate::{VmExit, VmmError};

/// A subscriber as the event manager holds it.
pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;
/// The VM's event manager.
pub type DeviceEventManager = EventManager<Subscriber>;

/// How long one epoll wait lasts; the loop re-checks the stop flag after it.
const POLL_MS: i32 = 200;

/// Watches the VM's exit eventfd and the i8042 reset line.
pub(crate) struct Control {
    shared: Arc<Shared>,
    reset_evt: EventFd,
}

impl Control {
    pub(crate) fn new(shared: Arc<Shared>, reset_evt: EventFd) -> Self {
        Self { shared, reset_evt }
    }
}

impl MutEventSubscriber for Control {
    fn init(&mut self, ops: &mut EventOps) {
        for fd in [self.shared.exit_evt.as_raw_fd(), self.reset_evt.as_raw_fd()] {
            if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                log::error!("event loop: cannot watch fd {fd}: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.reset_evt.as_raw_fd() {
            let _ = self.reset_evt.read();
            log::debug!("guest reset through the i8042");
            self.shared.finish(Ok(VmExit::Reset));
        } else if events.fd() == self.shared.exit_evt.as_raw_fd() {
            let _ = self.shared.exit_evt.read();
        }
    }
}

/// Runs the loop until the VM stops. With a `filter`, installs it first (after the virtio-fs
/// server's capability drop when the loop serves a shared directory); a filter that cannot be
/// installed ends the VM.
pub(crate) fn run(
    mut manager: DeviceEventManager,
    shared: Arc<Shared>,
    filter: Option<ThreadFilter>,
    serves_fs: bool,
) {
    if let Some(f) = filter {
        if serves_fs {
            if let Err(e) = vmm_devices::virtio::fs::policy::confine_serving_thread() {
                shared.finish(Err(VmmError::Device(format!(
                    "virtio-fs: dropping the serving thread's capabilities: {e}"
                ))));
                return;
            }
        }
        if let Err(e) = f.install() {
            shared.finish(Err(VmmError::Jail(e)));
            return;
        }
    }
    while !shared.stopping() {
        // Between two batches of device work: a pause parks the thread here (the pauser wakes
        // the epoll wait through the exit eventfd).
        if shared.pause_point() {
            continue;
        }
        if let Err(e) = manager.run_with_timeout(POLL_MS) {
            shared.finish(Err(VmmError::Device(format!("device event loop: {e:?}"))));
            break;
        }
    }
}
