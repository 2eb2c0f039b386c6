//! The virtio-balloon device: config space (`num_pages` fixed at 0, `actual` as the driver
//! writes it) and the three queues, served on the device event loop.
//!
//! Each pass over a queue handles at most one queue's worth of chains, then re-signals itself,
//! so a guest that keeps a queue full cannot hold the event loop.

use super::request::{check_deflate, release_inflate, release_report, Released};
use super::{
    CONFIG_SIZE, DEFLATE_QUEUE, INFLATE_QUEUE, NUM_QUEUES, QUEUE_SIZE, REPORTING_QUEUE,
    VIRTIO_BALLOON_F_REPORTING,
};
use crate::virtio::device_state::DeviceState;
use crate::virtio::{device_type, read_config_bytes, VirtioDevice, VIRTIO_F_VERSION_1};

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
    state: DeviceState,
    /// The driver's `actual` (pages it holds in the balloon), as it last wrote it.
    actual: u32,
    stats: BalloonStats,
}

impl Balloon {
    /// A balloon that offers free page reporting when `free_page_reporting` is set.
    pub fn new(free_page_reporting: bool) -> std::io::Result<Self> {
        let mut features = 1 << VIRTIO_F_VERSION_1;
        if free_page_reporting {
            features |= 1 << VIRTIO_BALLOON_F_REPORTING;
        }
        Ok(Self {
            state: DeviceState::new(
                "virtio-balloon",
                device_type::BALLOON,
                features,
                &QUEUE_SIZES,
            )?,
            actual: 0,
            stats: BalloonStats::default(),
        })
    }

    /// Whether the driver negotiated free page reporting.
    pub fn reporting(&self) -> bool {
        self.state.has_acked(VIRTIO_BALLOON_F_REPORTING)
    }

    /// What the device has done so far.
    pub fn stats(&self) -> BalloonStats {
        self.stats
    }

    /// Serves the available chains of `queue` (at most one queue's worth per call).
    pub fn process_queue(&mut self, queue: usize) {
        let stats = &mut self.stats;
        self.state.serve_queue(queue, |mem, chain| {
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
    }

    /// The queue eventfd of `queue` was signalled: consume it and serve the queue.
    pub fn process_queue_event(&mut self, queue: usize) {
        if self.state.consume_queue_event(queue) {
            self.process_queue(queue);
        }
    }

    fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        // num_pages (bytes 0..4) stays 0: the host never asks the guest to inflate.
        c[4..8].copy_from_slice(&self.actual.to_le_bytes());
        c
    }
}

impl VirtioDevice for Balloon {
    fn state(&self) -> &DeviceState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut DeviceState {
        &mut self.state
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
            _ => self.state.ignore_config_write(offset, data),
        }
    }

    fn on_reset(&mut self) {
        self.actual = 0;
    }
}
