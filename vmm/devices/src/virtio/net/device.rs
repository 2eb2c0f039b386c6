//! The virtio-net device: a receive and a transmit queue over a [`NetBackend`] (a [`Tap`] in the
//! VMM, a datagram socket pair in the unit tests).
//!
//! Receive: for each guest buffer (at most one queue's worth per pass) the device reads one frame
//! from the backend and copies it, vnet header first, into the buffer. Without buffers it stops
//! watching the backend ([`Net::backend_interest`]) until the driver notifies the receive queue.
//! Transmit: each chain is copied into the device's frame buffer and written to the backend; a
//! frame refused with `EAGAIN` stays there and is written first when the backend is writable
//! again, the queue waiting behind it.

use std::io;
use std::os::fd::RawFd;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory as _};
use vmm_sys_util::epoll::EventSet;

use super::tap::Tap;
use super::{
    features, validate_mac, validate_mtu, NetBackend, NetError, ETH_HLEN, MAX_BUFFER_SIZE,
    QUEUE_SIZE, RX_QUEUE, STATUS_LINK_UP, TX_QUEUE, VNET_HDR_LEN, VNET_HDR_NUM_BUFFERS,
};
use crate::virtio::device_state::DeviceState;
use crate::virtio::queues::notify_used;
use crate::virtio::read_config_bytes;
use crate::virtio::{device_type, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::GuestMemory;

const NUM_QUEUES: usize = 2;
const QUEUE_SIZES: [u16; NUM_QUEUES] = [QUEUE_SIZE; NUM_QUEUES];
/// Config space: mac[6], status u16, max_virtqueue_pairs u16, mtu u16 (all little endian).
/// Read-only: the MAC is read-only for a virtio 1.x driver (changing it needs the control queue).
const CONFIG_SIZE: usize = 12;
/// The smallest chain the device accepts either way: a vnet header and an Ethernet header.
const MIN_CHAIN_LEN: usize = VNET_HDR_LEN + ETH_HLEN;
/// Most descriptors the device follows in one chain (indirect tables included).
const MAX_CHAIN_DESCRIPTORS: usize = QUEUE_SIZE as usize;

/// Counters of what the device did (for tests and diagnostics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetStats {
    /// Frames delivered to the guest, and their bytes (vnet header included).
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// Receive chains returned unused (length 0): not device-writable, shorter than the headers,
    /// outside guest memory, unterminated.
    pub rx_bad_chains: u64,
    /// Frames read from the backend and dropped: larger than the guest's buffer, or shorter than
    /// the headers.
    pub rx_dropped: u64,
    /// Times the receive path stopped reading the backend because the guest had no buffers.
    pub rx_waits_for_buffers: u64,
    /// Frames sent to the backend, and their bytes (vnet header included).
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// Transmit chains rejected (length 0, nothing sent): device-writable descriptors, shorter than
    /// the headers, longer than [`MAX_BUFFER_SIZE`], outside guest memory, unterminated.
    pub tx_bad_chains: u64,
    /// Frames the backend refused with `EAGAIN`, kept and retried later.
    pub tx_deferred: u64,
    /// Frames the backend failed with another error (dropped).
    pub tx_dropped: u64,
}

/// Why a descriptor chain was not used.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// A transmit chain holds a device-writable descriptor.
    #[error("descriptor {0} of a transmit chain is device-writable")]
    WritableInTx(usize),
    /// A receive chain holds a device-readable descriptor.
    #[error("descriptor {0} of a receive chain is device-readable")]
    ReadableInRx(usize),
    /// A descriptor points outside guest memory.
    #[error("descriptor {index} ({len} bytes at {addr:#x}) is outside guest memory")]
    OutOfRange { index: usize, addr: u64, len: u32 },
    /// Copying to or from a descriptor's guest memory failed.
    #[error("descriptor {index} ({len} bytes at {addr:#x}): {source}")]
    Memory {
        index: usize,
        addr: u64,
        len: u32,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The chain holds fewer bytes than a vnet and an Ethernet header.
    #[error("the chain holds {0} bytes, less than the {MIN_CHAIN_LEN} of the headers")]
    TooShort(usize),
    /// A transmit chain holds more than [`MAX_BUFFER_SIZE`] bytes (or its length overflows).
    #[error("the transmit chain holds more than {MAX_BUFFER_SIZE} bytes")]
    TooLong,
    /// The chain has more than [`MAX_CHAIN_DESCRIPTORS`] descriptors.
    #[error("the chain has more than {MAX_CHAIN_DESCRIPTORS} descriptors")]
    TooManyDescriptors,
    /// The last descriptor still points to a next one: a loop, a bad index or a descriptor
    /// table outside guest memory.
    #[error("the chain does not end (a loop, a next index out of range or an unreadable table)")]
    Unterminated,
}

/// Whether the receive path reads the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxState {
    /// Reading whenever the backend is readable.
    Reading,
    /// The guest had no buffers: the backend is not watched until it notifies the queue.
    WaitingForBuffers,
}

/// Whether the backend still works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BackendState {
    Up,
    /// It reported an error or hang-up (e.g. the tap interface was deleted): never used again;
    /// transmitted frames are dropped, nothing is received.
    Failed,
}

/// The virtio-net device.
pub struct Net<B: NetBackend = Tap> {
    backend: B,
    mac: [u8; 6],
    mtu: Option<u16>,
    config: [u8; CONFIG_SIZE],
    state: DeviceState,
    rx_state: RxState,
    backend_state: BackendState,
    /// Frame buffers, [`MAX_BUFFER_SIZE`] bytes each.
    rx_frame: Box<[u8]>,
    tx_frame: Box<[u8]>,
    /// Length of the frame in `tx_frame` that the backend refused with `EAGAIN`.
    tx_pending: Option<usize>,
    /// The writable descriptors of the receive chain being filled (at most
    /// [`MAX_CHAIN_DESCRIPTORS`]; kept to reuse its allocation).
    rx_descs: Vec<(GuestAddress, usize)>,
    /// What the event loop watches on the backend now (`None`: not registered).
    pub(super) registered: Option<EventSet>,
    stats: NetStats,
}

impl<B: NetBackend> Net<B> {
    /// A device with MAC address `mac` (unicast) and, if given, MTU `mtu` (at least 68) on
    /// `backend`.
    pub fn new(backend: B, mac: [u8; 6], mtu: Option<u16>) -> Result<Self, NetError> {
        validate_mac(&mac)?;
        if let Some(m) = mtu {
            validate_mtu(m)?;
        }
        let mut features = 1 << VIRTIO_F_VERSION_1 | 1 << features::MAC | 1 << features::STATUS;
        if mtu.is_some() {
            features |= 1 << features::MTU;
        }
        let state = DeviceState::new("virtio-net", device_type::NET, features, &QUEUE_SIZES)
            .map_err(NetError::EventFd)?;
        let mut config = [0u8; CONFIG_SIZE];
        config[0..6].copy_from_slice(&mac);
        config[6..8].copy_from_slice(&STATUS_LINK_UP.to_le_bytes());
        config[8..10].copy_from_slice(&1u16.to_le_bytes());
        config[10..12].copy_from_slice(&mtu.unwrap_or(0).to_le_bytes());
        Ok(Self {
            backend,
            mac,
            mtu,
            config,
            state,
            rx_state: RxState::Reading,
            backend_state: BackendState::Up,
            rx_frame: vec![0u8; MAX_BUFFER_SIZE].into_boxed_slice(),
            tx_frame: vec![0u8; MAX_BUFFER_SIZE].into_boxed_slice(),
            tx_pending: None,
            rx_descs: Vec::with_capacity(8),
            registered: None,
            stats: NetStats::default(),
        })
    }

    /// The guest's MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The MTU told to the guest, if any.
    pub fn mtu(&self) -> Option<u16> {
        self.mtu
    }

    /// What the device has done so far.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend's fd (watched by the event loop for [`Net::backend_interest`]).
    pub fn backend_fd(&self) -> RawFd {
        self.backend.as_raw_fd()
    }

    /// Whether a transmitted frame waits for the backend to take it.
    pub fn tx_pending(&self) -> bool {
        self.tx_pending.is_some()
    }

    /// What the event loop should watch the backend for now: readable while the device is
    /// active and the guest has receive buffers, writable while a frame waits to be sent,
    /// nothing otherwise (an empty set: not registered at all, so an error or hang-up on the
    /// backend cannot wake the loop over and over).
    pub fn backend_interest(&self) -> EventSet {
        let mut set = EventSet::empty();
        if !self.state.is_activated() || self.backend_state == BackendState::Failed {
            return set;
        }
        if self.rx_state == RxState::Reading {
            set |= EventSet::IN;
        }
        if self.tx_pending.is_some() {
            set |= EventSet::OUT;
        }
        set
    }

    /// The queue eventfd of `queue` was signalled: consume it and do the queue's work.
    pub fn process_queue_event(&mut self, queue: usize) {
        if !self.state.consume_queue_event(queue) {
            return;
        }
        match queue {
            RX_QUEUE => {
                // New buffers (or a spurious notify): read the backend again.
                self.rx_state = RxState::Reading;
                self.process_rx();
            }
            TX_QUEUE => self.process_tx(),
            _ => {}
        }
    }

    /// The backend is ready for `events`.
    pub fn process_backend(&mut self, events: EventSet) {
        if events.intersects(EventSet::ERROR | EventSet::HANG_UP) {
            self.backend_failed(&io::Error::other(format!(
                "the backend reported {events:?}"
            )));
            return;
        }
        if events.contains(EventSet::IN) {
            self.process_rx();
        }
        if events.contains(EventSet::OUT) {
            self.process_tx();
        }
    }

    fn backend_failed(&mut self, e: &io::Error) {
        backend_failed(&mut self.backend_state, e);
    }

    /// Fills the guest's receive buffers with frames from the backend (at most one queue's
    /// worth per call; the level-triggered backend fd brings the loop back for the rest).
    pub fn process_rx(&mut self) {
        if self.backend_state == BackendState::Failed {
            return;
        }
        let Some((rxq, mem, interrupt)) = self.state.queue_mut(RX_QUEUE) else {
            return;
        };
        let mut used = false;
        for _ in 0..rxq.size() {
            let Some(chain) = rxq.pop_descriptor_chain(mem) else {
                // No buffers: stop reading until the driver notifies the queue.
                self.rx_state = RxState::WaitingForBuffers;
                self.stats.rx_waits_for_buffers += 1;
                break;
            };
            let head = chain.head_index();
            let capacity = match writable_descriptors(mem, chain, &mut self.rx_descs) {
                Ok(c) => c,
                Err(e) => {
                    log::debug!("virtio-net: receive chain {head}: {e}");
                    self.stats.rx_bad_chains += 1;
                    add_used(rxq, mem, head, 0);
                    used = true;
                    continue;
                }
            };
            let len = match self.backend.read_frame(&mut self.rx_frame) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    rxq.go_to_previous_position();
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    rxq.go_to_previous_position();
                    continue;
                }
                Err(e) => {
                    rxq.go_to_previous_position();
                    backend_failed(&mut self.backend_state, &e);
                    break;
                }
            };
            if len < MIN_CHAIN_LEN || len > capacity {
                // Not a frame, or one this buffer (sized by the driver for its MTU) cannot
                // hold: drop the frame, keep the buffer for the next one.
                log::debug!("virtio-net: dropping a {len}-byte frame ({capacity}-byte buffer)");
                self.stats.rx_dropped += 1;
                rxq.go_to_previous_position();
                continue;
            }
            let frame = &mut self.rx_frame[..len];
            frame[VNET_HDR_NUM_BUFFERS..VNET_HDR_LEN].copy_from_slice(&1u16.to_le_bytes());
            match write_frame(mem, &self.rx_descs, frame) {
                Ok(()) => {
                    self.stats.rx_frames += 1;
                    self.stats.rx_bytes += len as u64;
                    // len <= MAX_BUFFER_SIZE fits u32.
                    add_used(rxq, mem, head, len as u32);
                }
                Err(e) => {
                    // The guest changed its memory map under us; the frame is lost.
                    log::debug!("virtio-net: receive chain {head}: {e}");
                    self.stats.rx_bad_chains += 1;
                    self.stats.rx_dropped += 1;
                    add_used(rxq, mem, head, 0);
                }
            }
            used = true;
        }
        if used {
            notify_used(rxq, mem, interrupt, "virtio-net");
        }
    }

    /// Sends the guest's frames to the backend: first the one the backend refused last time,
    /// then at most one queue's worth of chains (re-signalling the queue for the rest).
    pub fn process_tx(&mut self) {
        let Some((txq, mem, interrupt)) = self.state.queue_mut(TX_QUEUE) else {
            return;
        };
        if let Some(len) = self.tx_pending {
            match send_frame(
                &mut self.backend,
                &mut self.backend_state,
                &mut self.stats,
                &self.tx_frame[..len],
            ) {
                Sent::Done => self.tx_pending = None,
                Sent::Again => return,
            }
        }
        let mut used = false;
        let mut more = false;
        for i in 0..=txq.size() {
            let Some(chain) = txq.pop_descriptor_chain(mem) else {
                break;
            };
            if i == txq.size() {
                // Budget spent: put it back and come back later.
                txq.go_to_previous_position();
                more = true;
                break;
            }
            let head = chain.head_index();
            let frame = read_frame(mem, chain, &mut self.tx_frame);
            // The frame is copied out (or rejected): the chain goes back to the guest now.
            add_used(txq, mem, head, 0);
            used = true;
            let len = match frame {
                Ok(len) => len,
                Err(e) => {
                    log::debug!("virtio-net: transmit chain {head}: {e}");
                    self.stats.tx_bad_chains += 1;
                    continue;
                }
            };
            match send_frame(
                &mut self.backend,
                &mut self.backend_state,
                &mut self.stats,
                &self.tx_frame[..len],
            ) {
                Sent::Done => {}
                Sent::Again => {
                    // Wait for the backend to be writable; the rest of the queue waits too.
                    self.tx_pending = Some(len);
                    break;
                }
            }
        }
        if used {
            notify_used(txq, mem, interrupt, "virtio-net");
        }
        if more {
            self.state.kick(TX_QUEUE);
        }
    }
}

fn backend_failed(state: &mut BackendState, e: &io::Error) {
    if *state == BackendState::Up {
        log::error!("virtio-net: the backend failed, the link is dead from now on: {e}");
        *state = BackendState::Failed;
    }
}

/// What became of a frame handed to the backend.
enum Sent {
    /// Sent, or dropped for good (counted).
    Done,
    /// Refused with `EAGAIN`: keep it and retry when the backend is writable.
    Again,
}

fn send_frame<B: NetBackend>(
    backend: &mut B,
    state: &mut BackendState,
    stats: &mut NetStats,
    frame: &[u8],
) -> Sent {
    if *state == BackendState::Failed {
        stats.tx_dropped += 1;
        return Sent::Done;
    }
    loop {
        match backend.write_frame(frame) {
            Ok(n) if n == frame.len() => {
                stats.tx_frames += 1;
                stats.tx_bytes += n as u64;
            }
            Ok(n) => {
                log::debug!("virtio-net: the backend took {n} of {} bytes", frame.len());
                stats.tx_dropped += 1;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                stats.tx_deferred += 1;
                return Sent::Again;
            }
            Err(e) => {
                log::debug!("virtio-net: sending a {}-byte frame: {e}", frame.len());
                stats.tx_dropped += 1;
            }
        }
        return Sent::Done;
    }
}

fn add_used(q: &mut Queue, mem: &GuestMemory, head: u16, len: u32) {
    if let Err(e) = q.add_used(mem, head, len) {
        crate::limited!(log::Level::Error, "virtio-net: used ring: {e}");
    }
}

/// Copies the frame (vnet header first) held by transmit chain `chain` into `buf`, whose length
/// is the bound; returns its length.
pub fn read_frame(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    buf: &mut [u8],
) -> Result<usize, ChainError> {
    let mut len = 0usize;
    let mut unterminated = false;
    for (index, desc) in chain.enumerate() {
        if index >= MAX_CHAIN_DESCRIPTORS {
            return Err(ChainError::TooManyDescriptors);
        }
        unterminated = desc.has_next();
        if desc.is_write_only() {
            return Err(ChainError::WritableInTx(index));
        }
        let end = usize::try_from(desc.len())
            .ok()
            .and_then(|l| len.checked_add(l))
            .filter(|&end| end <= buf.len())
            .ok_or(ChainError::TooLong)?;
        let dst = buf.get_mut(len..end).ok_or(ChainError::TooLong)?;
        mem.read_slice(dst, desc.addr())
            .map_err(|source| ChainError::Memory {
                index,
                addr: desc.addr().0,
                len: desc.len(),
                source,
            })?;
        len = end;
    }
    if unterminated {
        return Err(ChainError::Unterminated);
    }
    if len < MIN_CHAIN_LEN {
        return Err(ChainError::TooShort(len));
    }
    Ok(len)
}

/// Checks receive chain `chain` (every descriptor device-writable and inside guest memory) and
/// lists its descriptors in `descs`; returns its capacity in bytes.
pub fn writable_descriptors(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    descs: &mut Vec<(GuestAddress, usize)>,
) -> Result<usize, ChainError> {
    descs.clear();
    let mut capacity = 0usize;
    let mut unterminated = false;
    for (index, desc) in chain.enumerate() {
        if index >= MAX_CHAIN_DESCRIPTORS {
            return Err(ChainError::TooManyDescriptors);
        }
        unterminated = desc.has_next();
        if !desc.is_write_only() {
            return Err(ChainError::ReadableInRx(index));
        }
        let out_of_range = ChainError::OutOfRange {
            index,
            addr: desc.addr().0,
            len: desc.len(),
        };
        let len = usize::try_from(desc.len()).map_err(|_| ChainError::TooLong)?;
        if len > 0 && !mem.check_range(desc.addr(), len) {
            return Err(out_of_range);
        }
        capacity = capacity.checked_add(len).ok_or(ChainError::TooLong)?;
        descs.push((desc.addr(), len));
    }
    if unterminated {
        return Err(ChainError::Unterminated);
    }
    if capacity < MIN_CHAIN_LEN {
        return Err(ChainError::TooShort(capacity));
    }
    Ok(capacity)
}

/// Writes `frame` across `descs` (from [`writable_descriptors`], whose capacity the caller
/// checked).
fn write_frame(
    mem: &GuestMemory,
    descs: &[(GuestAddress, usize)],
    frame: &[u8],
) -> Result<(), ChainError> {
    let mut off = 0usize;
    for (index, &(addr, len)) in descs.iter().enumerate() {
        let rest = frame.get(off..).unwrap_or_default();
        if rest.is_empty() {
            break;
        }
        let n = len.min(rest.len());
        mem.write_slice(&rest[..n], addr)
            .map_err(|source| ChainError::Memory {
                index,
                addr: addr.0,
                len: u32::try_from(len).unwrap_or(u32::MAX),
                source,
            })?;
        off += n;
    }
    if off < frame.len() {
        return Err(ChainError::TooShort(off));
    }
    Ok(())
}

impl<B: NetBackend> VirtioDevice for Net<B> {
    fn state(&self) -> &DeviceState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut DeviceState {
        &mut self.state
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn on_activate(&mut self) {
        self.rx_state = RxState::Reading;
        self.tx_pending = None;
        // Wake the event loop: it starts watching the backend and fills the posted buffers.
        self.state.kick(RX_QUEUE);
    }

    fn on_reset(&mut self) {
        self.tx_pending = None;
        self.rx_state = RxState::Reading;
        // The event loop drops its interest in the backend the next time it looks.
        self.state.kick(RX_QUEUE);
    }
}
