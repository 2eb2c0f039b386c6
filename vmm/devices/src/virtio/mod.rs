//! Virtio devices over the virtio-mmio transport (virtio 1.x, "modern" only).
//!
//! A device model implements [`VirtioDevice`] (what it is, its features and config space, what to
//! do once the driver has set it up) and `event_manager::MutEventSubscriber` (its work on the
//! device event-loop thread: queue notifications and backend I/O). The [`mmio::MmioTransport`]
//! owns the register file the driver sees and hands the configured queues to the device when the
//! driver sets `DRIVER_OK`.
//!
//! What every device keeps the same way lives once, in [`device_state::DeviceState`], which each
//! device embeds: its type, the features offered and acked (masked by the offer), the queue sizes
//! and eventfds, the activated queues (activation checks their count, a reset drops them and the
//! features), consuming a queue event and registering the eventfds on the event loop.
//! [`VirtioDevice`]'s provided methods answer the transport from it, so a device's `device.rs`
//! holds only its own part: config space, its queue work, and what it adds on activation
//! (`on_activate`) and reset (`on_reset`). [`queues`] has the queue work every device does the
//! same way (a bounded batch of chains, the used ring, the interrupt, re-signalling).
//!
//! Files: `mmio.rs` (the transport), `device_state.rs` (the shared device state), `queues.rs`
//! (shared queue work), and one folder per device: `mod.rs` (constants, limits, errors),
//! `device.rs` (the [`VirtioDevice`] and its queue processing), `event_handler.rs` (event-loop
//! glue), the device's request parsing or backend, `tests.rs`.
//!
//! Threads: the transport runs on vCPU threads (register accesses), the device's event handling
//! on the single device event-loop thread; the device is shared between them as `Arc<Mutex<_>>`.

pub mod balloon;
pub mod block;
pub mod device_state;
pub mod fs;
pub mod mmio;
pub mod net;
pub mod queues;
#[cfg(test)]
pub(crate) mod test_chain;
pub mod vsock;

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use crate::GuestMemory;
pub use device_state::DeviceState;

/// Interrupt status bit: a used ring was updated.
pub const INT_VRING: u32 = 0x01;
/// Interrupt status bit: the configuration space changed.
pub const INT_CONFIG: u32 = 0x02;

/// Feature bit every modern device offers: virtio 1.0 or later.
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// Device ids (virtio spec 5).
pub mod device_type {
    /// virtio-net.
    pub const NET: u32 = 1;
    /// virtio-blk.
    pub const BLOCK: u32 = 2;
    /// virtio-balloon.
    pub const BALLOON: u32 = 5;
    /// virtio-vsock.
    pub const VSOCK: u32 = 19;
    /// virtio-fs.
    pub const FS: u32 = 26;
}

/// The interrupt line of one virtio-mmio device: the status register the driver reads and
/// acknowledges, plus the eventfd the VMM wires to the device's GSI as an irqfd.
#[derive(Debug)]
pub struct IrqTrigger {
    status: AtomicU32,
    evt: EventFd,
}

impl IrqTrigger {
    /// A line that signals `evt`.
    pub fn new(evt: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            evt,
        }
    }

    /// Sets `bits` (one of [`INT_VRING`], [`INT_CONFIG`]) in the status and raises the line.
    pub fn trigger(&self, bits: u32) -> io::Result<()> {
        self.status.fetch_or(bits, Ordering::SeqCst);
        self.evt.write(1)
    }

    /// The interrupt status register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// The driver's write to InterruptACK: clears `bits`.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// The eventfd behind the line (for irqfd registration).
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

/// A driver's read of `data.len()` bytes at `offset` of a device's config space `config`: bytes
/// past its end (or an offset that overflows) read as zero, per the [`VirtioDevice::read_config`]
/// contract.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = offset
            .checked_add(i as u64)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| config.get(o))
            .copied()
            .unwrap_or(0);
    }
}

/// Why a device could not be activated.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver configured a different number of queues than the device has.
    #[error("the driver set up {got} queues, the device needs {want}")]
    QueueCount { want: usize, got: usize },
    /// A queue the driver configured is not valid in guest memory.
    #[error("queue {index} is not valid: {reason}")]
    InvalidQueue { index: usize, reason: String },
    /// The device's backend failed to start.
    #[error("device backend: {0}")]
    Backend(#[from] io::Error),
}

/// A virtio device model, as the transport sees it.
///
/// A device embeds a [`DeviceState`] (its type, features, queue sizes and eventfds, activated
/// queues) and hands it out through [`state`](Self::state) / [`state_mut`](Self::state_mut); the
/// provided methods answer the transport from it. A device implements only what is its own: its
/// config space, and, where it has more to do than the shared state, `queues_in_use`,
/// `on_activate`, `on_reset` and `config_generation`.
pub trait VirtioDevice: Send {
    /// The state every device keeps the same way.
    fn state(&self) -> &DeviceState;
    /// The same, to change.
    fn state_mut(&mut self) -> &mut DeviceState;
    /// The virtio device id ([`device_type`]).
    fn device_type(&self) -> u32 {
        self.state().device_type()
    }
    /// The maximum size of each of the device's queues; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16] {
        self.state().queue_sizes()
    }
    /// The eventfds the transport signals on a QueueNotify for each queue (same order).
    fn queue_events(&self) -> &[EventFd] {
        self.state().queue_events()
    }
    /// The feature bits the device offers (must include [`VIRTIO_F_VERSION_1`]).
    fn avail_features(&self) -> u64 {
        self.state().avail_features()
    }
    /// The features the driver accepted (0 before negotiation and after a reset).
    fn acked_features(&self) -> u64 {
        self.state().acked_features()
    }
    /// The features the driver accepted (a subset of the offered ones; the transport checks,
    /// and the device masks them by its offer too).
    fn set_acked_features(&mut self, features: u64) {
        self.state_mut().set_acked_features(features);
    }
    /// How many of the queues (the first ones, in order) the driver sets up with the features
    /// it accepted: a queue that exists only with a feature (e.g. the balloon's reporting queue)
    /// is absent without it. The transport activates the device with these and ignores the rest.
    fn queues_in_use(&self) -> usize {
        self.queue_max_sizes().len()
    }
    /// A read of the device-specific config space. Out-of-range bytes read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// A write to the device-specific config space. Out-of-range writes are ignored; by
    /// default the whole config space is read-only (the write is logged at debug level).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        self.state().ignore_config_write(offset, data);
    }
    /// The driver set DRIVER_OK: start serving `queues` (already checked valid) over `mem`.
    /// Refused with [`ActivateError::QueueCount`] unless there are [`queues_in_use`] of them;
    /// then [`on_activate`] runs.
    ///
    /// [`queues_in_use`]: Self::queues_in_use
    /// [`on_activate`]: Self::on_activate
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: std::sync::Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        let want = self.queues_in_use();
        self.state_mut().activate(want, mem, queues, interrupt)?;
        self.on_activate();
        Ok(())
    }
    /// What the device does once its queues are activated, beyond the shared state.
    fn on_activate(&mut self) {}
    /// The driver reset the device (status 0): drop the queues and the acked features, then
    /// [`on_reset`](Self::on_reset) drops the device's own guest-visible state.
    fn reset(&mut self) {
        self.state_mut().reset();
        self.on_reset();
    }
    /// What the device forgets on a reset, beyond the shared state.
    fn on_reset(&mut self) {}
    /// Whether the device is activated.
    fn is_activated(&self) -> bool {
        self.state().is_activated()
    }
    /// A counter the device bumps when it changes its config space on its own (e.g. a disk's
    /// capacity); the transport adds it to the `ConfigGeneration` register it reports.
    fn config_generation(&self) -> u32 {
        0
    }
}
