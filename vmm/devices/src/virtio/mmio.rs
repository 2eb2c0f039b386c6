//! The virtio-mmio transport (virtio 1.x, section 4.2; "modern" register layout, version 2).
//!
//! [`MmioTransport`] is the register file of one virtio-mmio device: the driver negotiates
//! features, configures the queues and drives the device status through it. When the driver
//! sets `DRIVER_OK`, the transport checks every queue against guest memory and hands them to the
//! [`VirtioDevice`]. A `QueueNotify` write signals the device's queue eventfd; interrupts go
//! through the shared [`IrqTrigger`].
//!
//! Every register value comes from the (hostile) guest: odd-sized or misaligned accesses read as
//! zero and are otherwise ignored, out-of-order status transitions are refused, and nothing here
//! panics on guest input.

use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{ActivateError, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::bus::{lock, BusDevice};
use crate::GuestMemory;

/// "virt" in little endian.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// The modern virtio-mmio version.
pub const MMIO_VERSION: u32 = 2;
/// Our vendor id ("uVMM" is as good as any; Linux ignores it).
pub const VENDOR_ID: u32 = 0x4d56_4d75;
/// Size of one virtio-mmio device window.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;

/// Register offsets (virtio spec 4.2.2).
pub mod reg {
    pub const MAGIC_VALUE: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const SHM_SEL: u64 = 0x0ac;
    pub const SHM_LEN_LOW: u64 = 0x0b0;
    pub const SHM_LEN_HIGH: u64 = 0x0b4;
    pub const SHM_BASE_LOW: u64 = 0x0b8;
    pub const SHM_BASE_HIGH: u64 = 0x0bc;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Device status bits (virtio spec 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 64;
    pub const FAILED: u32 = 128;
}

/// Errors creating a transport.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    /// The interrupt eventfd could not be created.
    #[error("creating the interrupt eventfd: {0}")]
    InterruptEventFd(#[source] std::io::Error),
    /// The device reports a queue size virtio-queue refuses.
    #[error("queue {index} has an invalid maximum size {size}")]
    QueueSize { index: usize, size: u16 },
}

/// The virtio-mmio register file of one device.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemory,
    interrupt: Arc<IrqTrigger>,
    queues: Vec<Queue>,
    device_type: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    /// The driver acked a feature bit past 63 (none is offered): FEATURES_OK will fail.
    acked_beyond_64: bool,
    queue_sel: u32,
    status: u32,
    config_generation: u32,
}

impl MmioTransport {
    /// A transport for `device` over guest memory `mem`, with a fresh interrupt eventfd (wire
    /// [`MmioTransport::interrupt`]`().eventfd()` to the device's GSI as an irqfd).
    pub fn new(device: Arc<Mutex<dyn VirtioDevice>>, mem: GuestMemory) -> Result<Self, MmioError> {
        let evt = EventFd::new(EFD_NONBLOCK).map_err(MmioError::InterruptEventFd)?;
        let (device_type, queue_max_sizes) = {
            let d = lock(&device);
            (d.device_type(), d.queue_max_sizes().to_vec())
        };
        let queues = queue_max_sizes
            .iter()
            .enumerate()
            .map(|(index, &size)| {
                Queue::new(size).map_err(|_| MmioError::QueueSize { index, size })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            device,
            mem,
            interrupt: Arc::new(IrqTrigger::new(evt)),
            queues,
            device_type,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            acked_beyond_64: false,
            queue_sel: 0,
            status: 0,
            config_generation: 0,
        })
    }

    /// The device's interrupt line.
    pub fn interrupt(&self) -> Arc<IrqTrigger> {
        self.interrupt.clone()
    }

    /// The device behind the transport.
    pub fn device(&self) -> Arc<Mutex<dyn VirtioDevice>> {
        self.device.clone()
    }

    /// The current device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    fn has_status(&self, set: u32, clear: u32) -> bool {
        self.status & set == set && self.status & clear == 0
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    /// Applies `f` to the selected queue, only while the driver may configure queues
    /// (FEATURES_OK set, DRIVER_OK and FAILED clear).
    fn update_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if !self.has_status(status::FEATURES_OK, status::DRIVER_OK | status::FAILED) {
            log::debug!("virtio-mmio: queue configured in status {:#x}", self.status);
            return;
        }
        match self.queues.get_mut(self.queue_sel as usize) {
            Some(q) => f(q),
            None => log::debug!("virtio-mmio: queue {} does not exist", self.queue_sel),
        }
    }

    fn reset(&mut self) {
        {
            let mut d = lock(&self.device);
            if d.is_activated() {
                d.reset();
            }
        }
        for q in &mut self.queues {
            q.reset();
        }
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.acked_beyond_64 = false;
        self.queue_sel = 0;
        self.status = 0;
        self.interrupt.ack(u32::MAX);
    }

    fn read_reg(&self, offset: u64) -> u32 {
        match offset {
            reg::MAGIC_VALUE => MMIO_MAGIC_VALUE,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device_type,
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => {
                let features = lock(&self.device).avail_features();
                match self.device_features_sel {
                    0 => features as u32,
                    1 => (features >> 32) as u32,
                    _ => 0,
                }
            }
            reg::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size().into()),
            reg::QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready().into()),
            reg::INTERRUPT_STATUS => self.interrupt.status(),
            reg::STATUS => self.status,
            // No shared memory regions: a length of all ones means "absent".
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH => u32::MAX,
            reg::SHM_BASE_LOW | reg::SHM_BASE_HIGH => u32::MAX,
            reg::CONFIG_GENERATION => self
                .config_generation
                .wrapping_add(lock(&self.device).config_generation()),
            _ => {
                log::debug!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES => {
                if !self.has_status(status::DRIVER, status::FEATURES_OK | status::FAILED) {
                    log::debug!("virtio-mmio: features written in status {:#x}", self.status);
                    return;
                }
                match self.driver_features_sel {
                    0 => self.acked_features = (self.acked_features & !0xffff_ffff) | u64::from(v),
                    1 => {
                        self.acked_features =
                            (self.acked_features & 0xffff_ffff) | (u64::from(v) << 32)
                    }
                    // Feature words past 64 bits: nothing offered there, so only zero is valid;
                    // a nonzero value makes FEATURES_OK fail.
                    _ if v != 0 => self.acked_beyond_64 = true,
                    _ => {}
                }
            }
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM => match u16::try_from(v) {
                Ok(size) => self.update_queue(|q| q.set_size(size)),
                Err(_) => log::debug!("virtio-mmio: queue size {v} too large"),
            },
            reg::QUEUE_READY => self.update_queue(|q| q.set_ready(v == 1)),
            reg::QUEUE_DESC_LOW => self.update_queue(|q| q.set_desc_table_address(Some(v), None)),
            reg::QUEUE_DESC_HIGH => self.update_queue(|q| q.set_desc_table_address(None, Some(v))),
            reg::QUEUE_DRIVER_LOW => self.update_queue(|q| q.set_avail_ring_address(Some(v), None)),
            reg::QUEUE_DRIVER_HIGH => {
                self.update_queue(|q| q.set_avail_ring_address(None, Some(v)))
            }
            reg::QUEUE_DEVICE_LOW => self.update_queue(|q| q.set_used_ring_address(Some(v), None)),
            reg::QUEUE_DEVICE_HIGH => self.update_queue(|q| q.set_used_ring_address(None, Some(v))),
            reg::QUEUE_NOTIFY => self.notify(v),
            reg::INTERRUPT_ACK => self.interrupt.ack(v),
            reg::STATUS => self.write_status(v),
            reg::SHM_SEL => {}
            _ => log::debug!("virtio-mmio: write of unknown register {offset:#x}"),
        }
    }

    fn avail_features(&self) -> u64 {
        lock(&self.device).avail_features()
    }

    fn notify(&self, index: u32) {
        if !self.has_status(
            status::DRIVER_OK,
            status::FAILED | status::DEVICE_NEEDS_RESET,
        ) {
            log::debug!("virtio-mmio: notify in status {:#x}", self.status);
            return;
        }
        let d = lock(&self.device);
        match d.queue_events().get(index as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    log::error!("virtio-mmio: signalling queue {index}: {e}");
                }
            }
            None => log::debug!("virtio-mmio: notify of unknown queue {index}"),
        }
    }

    /// The device status state machine (virtio spec 3.1.1): bits are added one step at a time.
    fn write_status(&mut self, v: u32) {
        use status::*;
        if v == 0 {
            self.reset();
            return;
        }
        if v & FAILED != 0 {
            self.status |= FAILED;
            return;
        }
        // The driver may only add bits; clearing any (other than by a reset) is invalid.
        if v & self.status != self.status {
            log::debug!(
                "virtio-mmio: status {v:#x} clears bits of {:#x}",
                self.status
            );
            return;
        }
        let added = v & !self.status;
        match (self.status, added) {
            (0, ACKNOWLEDGE) => self.status = v,
            (s, DRIVER) if s == ACKNOWLEDGE => self.status = v,
            (s, FEATURES_OK) if s == ACKNOWLEDGE | DRIVER => {
                let avail = self.avail_features();
                let modern = self.acked_features & (1 << VIRTIO_F_VERSION_1) != 0;
                if self.acked_features & !avail == 0 && modern && !self.acked_beyond_64 {
                    lock(&self.device).set_acked_features(self.acked_features);
                    self.status = v;
                } else {
                    // Leaving FEATURES_OK clear tells the driver the features were refused.
                    crate::limited!(
                        log::Level::Warn,
                        "virtio-mmio: refused features {:#x} (offered {avail:#x})",
                        self.acked_features
                    );
                }
            }
            (s, DRIVER_OK) if s == ACKNOWLEDGE | DRIVER | FEATURES_OK => {
                self.status = v;
                if let Err(e) = self.activate() {
                    crate::limited!(log::Level::Error, "virtio-mmio: activating device: {e}");
                    self.status |= DEVICE_NEEDS_RESET;
                    if let Err(e) = self.interrupt.trigger(super::INT_CONFIG) {
                        log::error!("virtio-mmio: raising interrupt: {e}");
                    }
                }
            }
            _ => log::debug!(
                "virtio-mmio: invalid status transition {:#x} -> {v:#x}",
                self.status
            ),
        }
    }

    fn activate(&mut self) -> Result<(), ActivateError> {
        let in_use = lock(&self.device).queues_in_use().min(self.queues.len());
        let mut queues = Vec::with_capacity(in_use);
        for (index, q) in self.queues.iter().take(in_use).enumerate() {
            if !q.is_valid(&self.mem) {
                return Err(ActivateError::InvalidQueue {
                    index,
                    reason: format!(
                        "ready={} size={} desc={:#x} avail={:#x} used={:#x}",
                        q.ready(),
                        q.size(),
                        q.desc_table(),
                        q.avail_ring(),
                        q.used_ring()
                    ),
                });
            }
            let copy = Queue::try_from(q.state()).map_err(|e| ActivateError::InvalidQueue {
                index,
                reason: e.to_string(),
            })?;
            queues.push(copy);
        }
        lock(&self.device).activate(self.mem.clone(), queues, self.interrupt.clone())
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            lock(&self.device).read_config(offset - reg::CONFIG, data);
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            log::debug!(
                "virtio-mmio: {}-byte read at {offset:#x} refused",
                data.len()
            );
            data.fill(0);
            return;
        }
        let v = self.read_reg(offset);
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            if self.has_status(status::DRIVER, status::FAILED) {
                lock(&self.device).write_config(offset - reg::CONFIG, data);
                self.config_generation = self.config_generation.wrapping_add(1);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            log::debug!(
                "virtio-mmio: {}-byte write at {offset:#x} refused",
                data.len()
            );
            return;
        };
        if !offset.is_multiple_of(4) {
            log::debug!("virtio-mmio: misaligned write at {offset:#x} refused");
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::DeviceState;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use vm_memory::GuestAddress;

    /// A device that records what the transport did to it: two queues of 16, features
    /// VERSION_1 and bit 3.
    struct Recorder {
        state: DeviceState,
        activations: Arc<AtomicUsize>,
        config: [u8; 8],
        generation: u32,
    }

    impl VirtioDevice for Recorder {
        fn state(&self) -> &DeviceState {
            &self.state
        }
        fn state_mut(&mut self) -> &mut DeviceState {
            &mut self.state
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = offset
                    .checked_add(i as u64)
                    .and_then(|o| self.config.get(o as usize))
                    .copied()
                    .unwrap_or(0);
            }
        }
        fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
        fn on_activate(&mut self) {
            self.activations.fetch_add(1, Ordering::SeqCst);
        }
        fn config_generation(&self) -> u32 {
            self.generation
        }
    }

    fn setup() -> (MmioTransport, Arc<Mutex<Recorder>>, Arc<AtomicUsize>) {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let activations = Arc::new(AtomicUsize::new(0));
        let dev = Arc::new(Mutex::new(Recorder {
            state: DeviceState::new(
                "recorder",
                super::super::device_type::VSOCK,
                1 << VIRTIO_F_VERSION_1 | 1 << 3,
                &[16, 16],
            )
            .unwrap(),
            activations: activations.clone(),
            config: [1, 2, 3, 4, 5, 6, 7, 8],
            generation: 0,
        }));
        let t = MmioTransport::new(dev.clone(), mem).unwrap();
        (t, dev, activations)
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    fn negotiate(t: &mut MmioTransport) {
        w(t, reg::STATUS, status::ACKNOWLEDGE);
        w(t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(t, reg::DRIVER_FEATURES_SEL, 1);
        w(t, reg::DRIVER_FEATURES, 1);
        w(
            t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
    }

    fn setup_queue(t: &mut MmioTransport, index: u32, base: u64) {
        w(t, reg::QUEUE_SEL, index);
        w(t, reg::QUEUE_NUM, 16);
        w(t, reg::QUEUE_DESC_LOW, base as u32);
        w(t, reg::QUEUE_DRIVER_LOW, (base + 0x1000) as u32);
        w(t, reg::QUEUE_DEVICE_LOW, (base + 0x2000) as u32);
        w(t, reg::QUEUE_READY, 1);
    }

    #[test]
    fn config_generation_counts_driver_writes_and_device_changes() {
        let (mut t, dev, _) = setup();
        let g0 = r(&mut t, reg::CONFIG_GENERATION);
        // The device changed its config on its own (a disk's new capacity).
        dev.lock().unwrap().generation = u32::MAX;
        let g1 = r(&mut t, reg::CONFIG_GENERATION);
        assert_ne!(g1, g0);
        assert_eq!(g1, g0.wrapping_add(u32::MAX));
        // A driver's config write counts too, and the sum wraps without a panic.
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE);
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, reg::CONFIG, 0);
        assert_eq!(r(&mut t, reg::CONFIG_GENERATION), g1.wrapping_add(1));
    }

    #[test]
    fn identity_registers() {
        let (mut t, _, _) = setup();
        assert_eq!(r(&mut t, reg::MAGIC_VALUE), MMIO_MAGIC_VALUE);
        assert_eq!(r(&mut t, reg::VERSION), 2);
        assert_eq!(r(&mut t, reg::DEVICE_ID), 19);
        assert_eq!(r(&mut t, reg::VENDOR_ID), VENDOR_ID);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1 << 3);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 7);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 0);
        w(&mut t, reg::QUEUE_SEL, 1);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 16);
        w(&mut t, reg::QUEUE_SEL, 2);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 0);
        let mut cfg = [0u8; 8];
        t.read(reg::CONFIG, &mut cfg);
        assert_eq!(cfg, [1, 2, 3, 4, 5, 6, 7, 8]);
        let mut cfg = [0u8; 4];
        t.read(reg::CONFIG + 6, &mut cfg);
        assert_eq!(cfg, [7, 8, 0, 0]);
    }

    #[test]
    fn odd_accesses_are_refused() {
        let (mut t, _, _) = setup();
        let mut b = [0xaau8; 2];
        t.read(reg::MAGIC_VALUE, &mut b);
        assert_eq!(b, [0, 0]);
        let mut b = [0xaau8; 4];
        t.read(reg::MAGIC_VALUE + 1, &mut b);
        assert_eq!(b, [0; 4]);
        let mut b = [0xaau8; 8];
        t.read(reg::MAGIC_VALUE, &mut b);
        assert_eq!(b, [0; 8]);
        t.write(reg::STATUS, &[1]);
        t.write(reg::STATUS + 2, &[1, 0, 0, 0]);
        assert_eq!(r(&mut t, reg::STATUS), 0);
        // Writes to read-only registers change nothing.
        w(&mut t, reg::MAGIC_VALUE, 0);
        assert_eq!(r(&mut t, reg::MAGIC_VALUE), MMIO_MAGIC_VALUE);
    }

    #[test]
    fn status_machine_and_activation() {
        let (mut t, dev, activations) = setup();
        // Skipping ACKNOWLEDGE is refused.
        w(&mut t, reg::STATUS, status::DRIVER);
        assert_eq!(t.status(), 0);
        negotiate(&mut t);
        assert_eq!(t.status() & status::FEATURES_OK, status::FEATURES_OK);
        assert_eq!(lock(&dev).acked_features(), 1 << VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, 0x1_0000);
        // Queue 1 left unconfigured: DRIVER_OK fails and asks for a reset.
        w(&mut t, reg::STATUS, 0xf);
        assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(activations.load(Ordering::SeqCst), 0);
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), super::super::INT_CONFIG);
        // Reset and do it properly.
        w(&mut t, reg::STATUS, 0);
        assert_eq!(t.status(), 0);
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), 0);
        negotiate(&mut t);
        setup_queue(&mut t, 0, 0x1_0000);
        setup_queue(&mut t, 1, 0x2_0000);
        w(&mut t, reg::QUEUE_SEL, 1);
        assert_eq!(r(&mut t, reg::QUEUE_READY), 1);
        w(&mut t, reg::STATUS, 0xf);
        assert_eq!(t.status(), 0xf);
        assert_eq!(activations.load(Ordering::SeqCst), 1);
        assert!(lock(&dev).is_activated());
        // Queue config is frozen after DRIVER_OK.
        w(&mut t, reg::QUEUE_READY, 0);
        assert_eq!(r(&mut t, reg::QUEUE_READY), 1);
        // Notify signals the queue's eventfd; unknown queues are ignored.
        w(&mut t, reg::QUEUE_NOTIFY, 1);
        w(&mut t, reg::QUEUE_NOTIFY, 9);
        assert_eq!(lock(&dev).queue_events()[1].read().unwrap(), 1);
        assert!(lock(&dev).queue_events()[0].read().is_err());
        // Interrupt status and ACK.
        t.interrupt().trigger(super::super::INT_VRING).unwrap();
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), 1);
        w(&mut t, reg::INTERRUPT_ACK, 1);
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), 0);
        // Reset deactivates the device.
        w(&mut t, reg::STATUS, 0);
        assert!(!lock(&dev).is_activated());
    }

    #[test]
    fn refuses_unoffered_or_legacy_features() {
        let (mut t, _, _) = setup();
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE);
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, reg::DRIVER_FEATURES, 1 << 3 | 1 << 5);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(&mut t, reg::STATUS, 0xb);
        assert_eq!(t.status() & status::FEATURES_OK, 0);
        // Without VERSION_1 the driver is legacy: refused too.
        w(&mut t, reg::DRIVER_FEATURES_SEL, 0);
        w(&mut t, reg::DRIVER_FEATURES, 1 << 3);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        w(&mut t, reg::DRIVER_FEATURES, 0);
        w(&mut t, reg::STATUS, 0xb);
        assert_eq!(t.status() & status::FEATURES_OK, 0);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(&mut t, reg::STATUS, 0xb);
        assert_eq!(t.status(), 0xb);
    }

    #[test]
    fn queue_outside_memory_is_not_activated() {
        let (mut t, _, activations) = setup();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 0x1_0000);
        // Rings past the end of the 1 MiB of guest memory.
        setup_queue(&mut t, 1, 0xf_f000);
        w(&mut t, reg::QUEUE_DESC_HIGH, 0xffff_ffff);
        w(&mut t, reg::STATUS, 0xf);
        assert_ne!(t.status() & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(activations.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn random_register_traffic_never_panics() {
        let (mut t, dev, _) = setup();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200_000 {
            let r = next();
            let offset = match r % 4 {
                0 => r >> 8 & 0xfc,
                1 => r >> 8 & 0x1ff,
                2 => reg::STATUS,
                _ => r >> 8,
            };
            let len = [1usize, 2, 4, 8, 3][(r >> 40) as usize % 5];
            if r & 1 == 0 {
                let mut b = vec![0u8; len];
                t.read(offset, &mut b);
            } else {
                let v = if offset == reg::STATUS {
                    (next() % 16) as u32
                } else {
                    next() as u32
                };
                let b = v.to_le_bytes();
                let mut data = b.to_vec();
                data.resize(len, 0);
                t.write(offset, &data);
            }
            // The device is only ever active while the driver says DRIVER_OK.
            if lock(&dev).is_activated() {
                assert_ne!(t.status() & status::DRIVER_OK, 0);
            }
        }
    }
}
