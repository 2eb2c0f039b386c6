//! What every virtio device model keeps the same way: its identity (device type, the name its
//! logs use), the features it offers and those the driver accepted, its queue sizes and the
//! eventfds the transport signals on a QueueNotify, and, once the driver set `DRIVER_OK`, the
//! activated queues ([`ActiveQueues`]).
//!
//! A device embeds one [`DeviceState`] and keeps only what is its own (config space, backend,
//! counters); [`VirtioDevice`](super::VirtioDevice)'s provided methods answer the transport from
//! it. The rules live here once: the acked features are masked by the offer, activation checks
//! the number of queues, a reset forgets the queues and the features, and a queue event that was
//! not pending is no error.

use std::io;
use std::sync::Arc;

use event_manager::{EventOps, Events};
use virtio_queue::{DescriptorChain, Queue};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::queues::{drain_queue, kick, ActiveQueues};
use super::{ActivateError, IrqTrigger};
use crate::GuestMemory;

/// Why reading a queue's eventfd did not consume an event.
#[derive(Debug, thiserror::Error)]
pub enum QueueEventError {
    /// The device has no queue of that index.
    #[error("the device has no queue {0}")]
    NoSuchQueue(usize),
    /// Reading the eventfd failed (other than "nothing pending").
    #[error("reading queue {queue} event: {source}")]
    Read {
        queue: usize,
        #[source]
        source: io::Error,
    },
}

/// The state every virtio device keeps the same way (see the module docs).
pub struct DeviceState {
    name: &'static str,
    device_type: u32,
    avail_features: u64,
    acked_features: u64,
    queue_sizes: Vec<u16>,
    queue_events: Vec<EventFd>,
    active: Option<ActiveQueues>,
}

impl DeviceState {
    /// The state of a device of type `device_type` ([`super::device_type`]) offering
    /// `avail_features`, with one queue (and one non-blocking eventfd) per entry of
    /// `queue_sizes`. `name` starts the device's log lines ("virtio-blk", "vsock", ...).
    pub fn new(
        name: &'static str,
        device_type: u32,
        avail_features: u64,
        queue_sizes: &[u16],
    ) -> io::Result<Self> {
        let queue_events = queue_sizes
            .iter()
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self {
            name,
            device_type,
            avail_features,
            acked_features: 0,
            queue_sizes: queue_sizes.to_vec(),
            queue_events,
            active: None,
        })
    }

    /// The name the device's log lines start with.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The virtio device id.
    pub fn device_type(&self) -> u32 {
        self.device_type
    }

    /// The feature bits the device offers.
    pub fn avail_features(&self) -> u64 {
        self.avail_features
    }

    /// The features the driver accepted (0 before negotiation and after a reset).
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Whether the driver accepted feature bit `bit`.
    pub fn has_acked(&self, bit: u32) -> bool {
        1u64.checked_shl(bit)
            .is_some_and(|f| self.acked_features & f != 0)
    }

    /// Records the driver's features, less any the device does not offer.
    pub fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features;
    }

    /// The maximum size of each queue; its length is the number of queues.
    pub fn queue_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    /// The queue eventfds, in queue order.
    pub fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }

    /// Takes the driver's queues: exactly `want` of them (the device's queues in use), or
    /// [`ActivateError::QueueCount`] and nothing changes.
    pub fn activate(
        &mut self,
        want: usize,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        if queues.len() != want {
            return Err(ActivateError::QueueCount {
                want,
                got: queues.len(),
            });
        }
        self.active = Some(ActiveQueues {
            mem,
            queues,
            interrupt,
        });
        Ok(())
    }

    /// The driver reset the device: the queues and the acked features are gone.
    pub fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
    }

    /// Whether the driver activated the device (and has not reset it since).
    pub fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    /// The activated queues, if any.
    pub fn active(&self) -> Option<&ActiveQueues> {
        self.active.as_ref()
    }

    /// Queue `index` with what serving it needs: (the queue, the guest memory it lives in, the
    /// device's interrupt line); `None` before activation or for a queue the driver did not set
    /// up.
    pub fn queue_mut(&mut self, index: usize) -> Option<(&mut Queue, &GuestMemory, &IrqTrigger)> {
        let ActiveQueues {
            mem,
            queues,
            interrupt,
        } = self.active.as_mut()?;
        Some((queues.get_mut(index)?, mem, interrupt))
    }

    /// Serves at most one queue's worth of the available chains of queue `index` with `serve`
    /// (which returns the bytes it wrote into the chain), and re-signals the queue when chains
    /// are left: [`drain_queue`] for a device that handles each chain on its own. Nothing
    /// happens before activation.
    pub fn serve_queue<F>(&mut self, index: usize, mut serve: F)
    where
        F: FnMut(&GuestMemory, DescriptorChain<&GuestMemory>) -> u32,
    {
        let name = self.name;
        let Some((queue, mem, interrupt)) = self.queue_mut(index) else {
            return;
        };
        if drain_queue(queue, mem, interrupt, name, |chain| serve(mem, chain)) {
            self.kick(index);
        }
    }

    /// A driver's write to a config space (or a part of it) that is read-only: logged, ignored.
    pub fn ignore_config_write(&self, offset: u64, data: &[u8]) {
        log::debug!(
            "{}: ignoring a {}-byte config write at {offset:#x}",
            self.name,
            data.len()
        );
    }

    /// Signals queue `index`'s eventfd so the event loop serves it again on its next turn.
    pub fn kick(&self, index: usize) {
        kick(&self.queue_events, index, self.name);
    }

    /// Reads (and so clears) queue `index`'s eventfd: `Ok(true)` when an event was pending,
    /// `Ok(false)` when none was (a spurious wake-up or an event already consumed: not an
    /// error).
    pub fn read_queue_event(&self, index: usize) -> Result<bool, QueueEventError> {
        let evt = self
            .queue_events
            .get(index)
            .ok_or(QueueEventError::NoSuchQueue(index))?;
        match evt.read() {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(source) => Err(QueueEventError::Read {
                queue: index,
                source,
            }),
        }
    }

    /// The event loop woke the device for queue `index`: consumes the event, logging a failed
    /// read. Returns false when the device has no such queue (nothing to serve).
    pub fn consume_queue_event(&self, index: usize) -> bool {
        match self.read_queue_event(index) {
            Ok(_) => true,
            Err(QueueEventError::NoSuchQueue(_)) => false,
            Err(e) => {
                log::error!("{}: {e}", self.name);
                true
            }
        }
    }

    /// Registers every queue eventfd on the device event loop, with its queue index as the
    /// event data.
    pub fn register_queue_events(&self, ops: &mut EventOps) {
        for (q, evt) in self.queue_events.iter().enumerate() {
            let Ok(data) = u32::try_from(q) else {
                break;
            };
            if let Err(e) = ops.add(Events::with_data(evt, data, EventSet::IN)) {
                log::error!("{}: registering queue {q}: {e:?}", self.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_chain::{ro, wr, TestQueue};
    use crate::virtio::{device_type, INT_VRING, VIRTIO_F_VERSION_1};
    use virtio_queue::QueueT;
    use vm_memory::GuestAddress;

    const OFFER: u64 = 1 << VIRTIO_F_VERSION_1 | 1 << 5;

    fn state(queues: usize) -> DeviceState {
        DeviceState::new("test", device_type::VSOCK, OFFER, &vec![16; queues]).unwrap()
    }

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn queues(n: usize) -> Vec<Queue> {
        (0..n).map(|_| Queue::new(16).unwrap()).collect()
    }

    fn irq() -> Arc<IrqTrigger> {
        Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()))
    }

    #[test]
    fn new_has_one_eventfd_per_queue_and_nothing_negotiated() {
        let s = state(3);
        assert_eq!(s.name(), "test");
        assert_eq!(s.device_type(), device_type::VSOCK);
        assert_eq!(s.queue_sizes(), &[16, 16, 16]);
        assert_eq!(s.queue_events().len(), 3);
        assert_eq!(s.avail_features(), OFFER);
        assert_eq!(s.acked_features(), 0);
        assert!(!s.is_activated());
        assert!(s.active().is_none());
    }

    #[test]
    fn acked_features_are_masked_by_the_offer() {
        let mut s = state(1);
        s.set_acked_features(u64::MAX);
        assert_eq!(s.acked_features(), OFFER);
        assert!(s.has_acked(5));
        assert!(!s.has_acked(4));
        // A bit number past 63 is never acked (and does not overflow).
        assert!(!s.has_acked(64));
        assert!(!s.has_acked(u32::MAX));
    }

    #[test]
    fn activate_with_a_wrong_count_is_refused_and_changes_nothing() {
        let mut s = state(2);
        for got in [0, 1, 3] {
            match s.activate(2, mem(), queues(got), irq()) {
                Err(ActivateError::QueueCount { want: 2, got: g }) => assert_eq!(g, got),
                other => panic!("activating with {got} queues: {other:?}"),
            }
            assert!(!s.is_activated());
        }
        // The count asked for is the device's in-use count, not the number of queues it has.
        s.activate(1, mem(), queues(1), irq()).unwrap();
        assert!(s.is_activated());
        assert!(s.queue_mut(0).is_some());
        assert!(s.queue_mut(1).is_none());
    }

    #[test]
    fn reset_clears_acked_features_and_queues() {
        let mut s = state(2);
        s.set_acked_features(OFFER);
        s.activate(2, mem(), queues(2), irq()).unwrap();
        assert!(s.is_activated());
        s.reset();
        assert!(!s.is_activated());
        assert_eq!(s.acked_features(), 0);
        assert!(s.queue_mut(0).is_none());
        // The eventfds stay: the transport keeps signalling them after a reset.
        assert_eq!(s.queue_events().len(), 2);
    }

    #[test]
    fn queue_event_read_when_none_is_pending_is_not_an_error() {
        let s = state(2);
        assert!(matches!(s.read_queue_event(0), Ok(false)));
        assert!(s.consume_queue_event(0));
        s.queue_events()[1].write(1).unwrap();
        assert!(matches!(s.read_queue_event(1), Ok(true)));
        // Consumed: the next read finds nothing pending.
        assert!(matches!(s.read_queue_event(1), Ok(false)));
        s.queue_events()[1].write(1).unwrap();
        assert!(s.consume_queue_event(1));
        assert!(matches!(s.read_queue_event(1), Ok(false)));
    }

    #[test]
    fn queue_event_of_an_unknown_queue_is_refused() {
        let s = state(2);
        assert!(matches!(
            s.read_queue_event(2),
            Err(QueueEventError::NoSuchQueue(2))
        ));
        assert!(!s.consume_queue_event(2));
        assert!(!s.consume_queue_event(usize::MAX));
    }

    #[test]
    fn kick_signals_the_queue_and_ignores_unknown_ones() {
        let s = state(2);
        s.kick(1);
        s.kick(7);
        assert!(matches!(s.read_queue_event(0), Ok(false)));
        assert!(matches!(s.read_queue_event(1), Ok(true)));
    }

    #[test]
    fn serve_queue_before_activation_does_nothing() {
        let mut s = state(1);
        let mut served = 0;
        s.serve_queue(0, |_, _| {
            served += 1;
            0
        });
        assert_eq!(served, 0);
        // An activated queue the driver left empty serves nothing either, and is not re-signalled.
        let mut q = Queue::new(16).unwrap();
        q.set_ready(true);
        s.activate(1, mem(), vec![q], irq()).unwrap();
        s.serve_queue(0, |_, _| {
            served += 1;
            0
        });
        s.serve_queue(5, |_, _| {
            served += 1;
            0
        });
        assert_eq!(served, 0);
        assert!(matches!(s.read_queue_event(0), Ok(false)));
    }

    #[test]
    fn serve_queue_returns_each_chain_with_its_length_and_raises_the_interrupt() {
        let mem = mem();
        let mut tq = TestQueue::new(&mem, 0x1_0000, 16);
        let a = tq.add_chain(&[wr(0x8_0000, 64)]);
        let b = tq.add_chain(&[ro(0x8_1000, 8), wr(0x8_2000, 32)]);
        let mut s = state(1);
        let irq = irq();
        s.activate(1, mem.clone(), vec![tq.queue(16)], irq.clone())
            .unwrap();
        let mut lens = vec![];
        s.serve_queue(0, |_, chain| {
            let n = chain.count() as u32;
            lens.push(n);
            n * 10
        });
        assert_eq!(lens, [1, 2]);
        assert_eq!(tq.take_used(), [(u32::from(a), 10), (u32::from(b), 20)]);
        assert_eq!(irq.status() & INT_VRING, INT_VRING);
        // Everything was served within the budget: the queue is not re-signalled.
        assert!(matches!(s.read_queue_event(0), Ok(false)));
    }
}
