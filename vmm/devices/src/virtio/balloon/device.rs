//! The virtio-balloon device: config space (`num_pages` fixed at 0, `actual` as the driver
//! writes it) and the three queues, served on the device event loop.
//!
//! Each pass over a queue handles at most one queue's worth of chains, then re-signals itself,
//! so a guest that keeps a queue full cannot hold the event loop.

use std::sync::Arc;

use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::request::{check_deflate, release_inflate, release_report, Released};
use super::{
    CONFIG_SIZE, DEFLATE_QUEUE, INFLATE_QUEUE, NUM_QUEUES, QUEUE_SIZE, REPORTING_QUEUE,
    VIRTIO_BALLOON_F_REPORTING,
};
use crate::virtio::queues::{drain_queue, kick, ActiveQueues};
use crate::virtio::{
    device_type, read_config_bytes, ActivateError, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1,
};
use crate::GuestMemory;

const QUEUE_SIZES: [u16; NUM_QUEUES] = [QUEUE_SIZE; NUM_QUEUES];

/// Offset of `actual` (u32 LE) in the config space.
const ACTUAL_OFFSET: u64 = 4;

/// Counters of what the device did (for tests and diagnostics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BalloonStats {
    /// Free page reports (chains) served.
    pub reports: u64,
    /// Bytes of reported free memory whose host pages were dropped.
    pub reported_bytes: u64,
    /// Bytes of inflated pages whose host pages were dropped.
    pub inflated_bytes: u64,
    /// Ranges, frame numbers or descriptors refused (hostile or malformed).
    pub refused: u64,
}

/// The virtio-balloon device.
pub struct Balloon {
    free_page_reporting: bool,
    acked_features: u64,
    /// The driver's `actual` (pages it holds in the balloon), as it last wrote it.
    actual: u32,
    queue_events: Vec<EventFd>,
    active: Option<ActiveQueues>,
    stats: BalloonStats,
}

impl Balloon {
    /// A balloon that offers free page reporting when `free_page_reporting` is set.
    pub fn new(free_page_reporting: bool) -> std::io::Result<Self> {
        let queue_events = (0..NUM_QUEUES)
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            free_page_reporting,
            acked_features: 0,
            actual: 0,
            queue_events,
            active: None,
            stats: BalloonStats::default(),
        })
    }

    /// The features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Whether the driver negotiated free page reporting.
    pub fn reporting(&self) -> bool {
        self.acked_features & (1 << VIRTIO_BALLOON_F_REPORTING) != 0
    }

    /// What the device has done so far.
    pub fn stats(&self) -> BalloonStats {
        self.stats
    }

    /// Serves the available chains of `queue` (at most one queue's worth per call).
    pub fn process_queue(&mut self, queue: usize) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let ActiveQueues {
            mem,
            queues,
            interrupt,
        } = active;
        let Some(q) = queues.get_mut(queue) else {
            return;
        };
        let stats = &mut self.stats;
        let more = drain_queue(q, mem, interrupt, "virtio-balloon", |chain| {
            let r: Released = match queue {
                INFLATE_QUEUE => {
                    let r = release_inflate(mem, chain);
                    stats.inflated_bytes += r.bytes;
                    r
                }
                DEFLATE_QUEUE => check_deflate(mem, chain),
                _ => {
                    let r = release_report(mem, chain);
                    stats.reports += 1;
                    stats.reported_bytes += r.bytes;
                    r
                }
            };
            stats.refused += r.refused;
            // The device writes nothing into any of its chains.
            0
        });
        if more {
            kick(&self.queue_events, queue, "virtio-balloon");
        }
    }

    /// The queue eventfd of `queue` was signalled: consume it and serve the queue.
    pub fn process_queue_event(&mut self, queue: usize) {
        let Some(evt) = self.queue_events.get(queue) else {
            return;
        };
        if let Err(e) = evt.read() {
            if e.kind() != std::io::ErrorKind::WouldBlock {
                log::error!("virtio-balloon: reading queue {queue} event: {e}");
            }
        }
        self.process_queue(queue);
    }

    fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        // num_pages (bytes 0..4) stays 0: the host never asks the guest to inflate.
        c[4..8].copy_from_slice(&self.actual.to_le_bytes());
        c
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        device_type::BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }

    fn avail_features(&self) -> u64 {
        let mut f = 1 << VIRTIO_F_VERSION_1;
        if self.free_page_reporting {
            f |= 1 << VIRTIO_BALLOON_F_REPORTING;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn queues_in_use(&self) -> usize {
        if self.reporting() {
            NUM_QUEUES
        } else {
            REPORTING_QUEUE
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` is the driver's to write, and only whole.
        match <[u8; 4]>::try_from(data) {
            Ok(v) if offset == ACTUAL_OFFSET => self.actual = u32::from_le_bytes(v),
            _ => log::debug!(
                "virtio-balloon: ignoring a {}-byte config write at {offset:#x}",
                data.len()
            ),
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        let want = self.queues_in_use();
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

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
        self.actual = 0;
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }
}
