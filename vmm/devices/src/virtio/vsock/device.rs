//! The virtio-vsock device: three queues (RX, TX, event), config space = the guest CID (u64 le).
//!
//! TX chains are parsed into packets and handed to the [`VsockMuxer`]; RX buffers are filled
//! with whatever the muxer has for the guest. Each pass over a queue handles at most one
//! queue's worth of chains, then re-signals itself, so a guest that keeps the queue full cannot
//! hold the event loop.

use std::path::Path;

use virtio_queue::{QueueOwnedT, QueueT};

use super::muxer::VsockMuxer;
use super::packet::{read_tx_packet, RxBuffer};
use super::{VsockError, MAX_CONNECTIONS, QUEUE_SIZE, RX_QUEUE, TX_QUEUE};
use crate::virtio::device_state::DeviceState;
use crate::virtio::queues::notify_used;
use crate::virtio::read_config_bytes;
use crate::virtio::{device_type, VirtioDevice, VIRTIO_F_VERSION_1};

const QUEUE_SIZES: [u16; 3] = [QUEUE_SIZE; 3];

/// The virtio-vsock device with its hybrid-vsock backend.
pub struct Vsock {
    guest_cid: u64,
    state: DeviceState,
    pub(super) muxer: VsockMuxer,
}

impl Vsock {
    /// A device for a guest with `guest_cid`, listening at `uds_path` (a stale socket there is
    /// replaced; the socket is removed when the device is dropped).
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, VsockError> {
        Self::with_max_connections(guest_cid, uds_path, MAX_CONNECTIONS)
    }

    /// Like [`Vsock::new`], with a limit on simultaneous connections.
    pub fn with_max_connections(
        guest_cid: u64,
        uds_path: &Path,
        max_connections: usize,
    ) -> Result<Self, VsockError> {
        if guest_cid <= 2 || guest_cid >= u64::from(u32::MAX) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        let state = DeviceState::new(
            "vsock",
            device_type::VSOCK,
            1 << VIRTIO_F_VERSION_1,
            &QUEUE_SIZES,
        )
        .map_err(|e| VsockError::Sys("queue eventfd", e))?;
        let muxer = VsockMuxer::new(guest_cid, uds_path, max_connections)?;
        Ok(Self {
            guest_cid,
            state,
            muxer,
        })
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// The host socket the device listens on.
    pub fn uds_path(&self) -> &Path {
        self.muxer.uds_path()
    }

    /// Open connections (including handshakes in progress).
    pub fn connection_count(&self) -> usize {
        self.muxer.connection_count()
    }

    /// The muxer's epoll fd (readable when the backend has work: see [`Vsock::process_backend`]).
    pub fn backend_fd(&self) -> std::os::unix::io::RawFd {
        use std::os::unix::io::AsRawFd;
        self.muxer.as_raw_fd()
    }

    /// Handles guest packets on the TX queue, then sends any replies.
    pub fn process_tx(&mut self) {
        if !self.state.is_activated() {
            return;
        }
        let muxer = &mut self.muxer;
        self.state.serve_queue(TX_QUEUE, |mem, chain| {
            match read_tx_packet(mem, chain) {
                Ok(pkt) => muxer.send_pkt(pkt),
                Err(e) => log::debug!("vsock: bad TX packet: {e}"),
            }
            0
        });
        self.process_rx();
    }

    /// Fills the guest's RX buffers with pending packets.
    pub fn process_rx(&mut self) {
        let Some((rxq, mem, interrupt)) = self.state.queue_mut(RX_QUEUE) else {
            return;
        };
        let mut used = false;
        let mut more = false;
        for i in 0..=rxq.size() {
            if !self.muxer.has_pending_rx() {
                break;
            }
            if i == rxq.size() {
                more = true;
                break;
            }
            let Some(chain) = rxq.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let buf = match RxBuffer::new(mem, chain) {
                Ok(b) => b,
                Err(e) => {
                    // Unusable buffer: give it back empty.
                    log::debug!("vsock: bad RX buffer: {e}");
                    if let Err(e) = rxq.add_used(mem, head, 0) {
                        crate::limited!(log::Level::Error, "vsock: RX used ring: {e}");
                    }
                    used = true;
                    continue;
                }
            };
            let Some(pkt) = self.muxer.recv_pkt(buf.data_capacity()) else {
                rxq.go_to_previous_position();
                break;
            };
            let len = match buf.write(&pkt.hdr, &pkt.data) {
                Ok(n) => n,
                Err(e) => {
                    crate::limited!(log::Level::Error, "vsock: writing an RX packet: {e}");
                    0
                }
            };
            if let Err(e) = rxq.add_used(mem, head, len) {
                crate::limited!(log::Level::Error, "vsock: RX used ring: {e}");
            }
            used = true;
        }
        if used {
            notify_used(rxq, mem, interrupt, "vsock");
        }
        if more {
            self.state.kick(RX_QUEUE);
        }
    }

    /// Handles backend events (host connections), then fills RX buffers.
    pub fn process_backend(&mut self) {
        self.muxer.process_events();
        self.process_rx();
    }

    /// The queue eventfd of `queue` was signalled: consume it and do the queue's work.
    pub fn process_queue_event(&mut self, queue: usize) {
        if !self.state.consume_queue_event(queue) {
            return;
        }
        match queue {
            RX_QUEUE => self.process_rx(),
            TX_QUEUE => self.process_tx(),
            // Only the device writes to the event queue (transport resets), which we never do.
            _ => {}
        }
    }
}

impl VirtioDevice for Vsock {
    fn state(&self) -> &DeviceState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut DeviceState {
        &mut self.state
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn on_activate(&mut self) {
        // Packets may be waiting from before the driver was up (host connections).
        self.state.kick(RX_QUEUE);
    }

    fn on_reset(&mut self) {
        self.muxer.reset();
    }
}
