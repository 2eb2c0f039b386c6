//! virtio-net (virtio spec 5.1) with a tap backend.
//!
//! The guest sees a network card with two queues (receive 0, transmit 1), the MAC address it is
//! given in config space, the link always up, and an MTU when one is given. On the host side the
//! device moves frames between those queues and a tap file descriptor that the embedder opened
//! (in whatever network namespace it likes: the VMM never enters one) with
//! `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`. The tap is set to a 12-byte vnet header
//! (`virtio_net_hdr_v1`, the header of a virtio 1.x driver), so a frame and its header pass
//! between tap and queues unchanged; on receive the device sets `num_buffers` to 1.
//!
//! What the device does not do yet, and why:
//! - **No offloads** (checksum, TSO/UFO/USO, in either direction): the tap is set to
//!   `TUNSETOFFLOAD 0`, and none of the `CSUM`/`GUEST_*`/`HOST_*` features is offered, so every
//!   frame is a complete, checksummed Ethernet frame of at most MTU + 14 bytes. Offloads need the
//!   guest's and the tap's features kept in step; they are the next step when throughput matters.
//! - **No mergeable receive buffers** (`MRG_RXBUF`): each received frame goes in one descriptor
//!   chain, which the driver sizes for the MTU (Linux does).
//! - **No control queue** (`CTRL_VQ`): no promiscuous/multicast filtering, MAC changes or
//!   multiqueue; the tap delivers every frame it gets.
//!
//! Flow: a readable tap is read only while the guest has receive buffers; when it has none, the
//! device stops watching the tap (epoll interest off) until the driver posts buffers and notifies
//! the receive queue, so frames wait in the tap's queue (and the kernel drops what overflows it)
//! instead of the device spinning. A frame the tap refuses with `EAGAIN` is kept (one frame) and
//! retried when the tap is writable again; the transmit queue waits behind it.
//!
//! The guest is hostile: receive chains must be device-writable, transmit chains device-readable,
//! at least a vnet header plus an Ethernet header long, at most [`MAX_BUFFER_SIZE`] bytes in total
//! (checked arithmetic), every descriptor inside guest memory; loops end when virtio-queue's
//! per-chain descriptor budget runs out. A chain that fails is counted ([`NetStats`]) and returned
//! with length 0; nothing the guest writes makes the host panic or allocate more than the two
//! [`MAX_BUFFER_SIZE`] frame buffers each device owns. The vnet header a guest sends goes to the
//! tap as is: the kernel validates it (the same path as any tap user's).
//!
//! Files: this one (the constants and the [`NetBackend`] trait both others use), [`device`] (the
//! [`VirtioDevice`](super::VirtioDevice), the receive and transmit paths), [`tap`] (the tap
//! backend and its ioctls), `event_handler` (event-loop glue).

pub mod device;
mod event_handler;
pub mod tap;

pub use device::{Net, NetStats};
pub use tap::{open_tap, Tap, TapError};

/// Where frames come from and go to: one frame (vnet header first) per call, non-blocking. The
/// device ([`Net`]) works over it; [`Tap`] is the VMM's, a datagram socket pair the unit tests'.
pub trait NetBackend: std::os::fd::AsRawFd + Send {
    /// Reads one frame into `buf`; `WouldBlock` when none waits.
    fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize>;
    /// Writes one frame; `WouldBlock` when the backend cannot take it now.
    fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize>;
}

/// Receive queue index (device to driver).
pub const RX_QUEUE: usize = 0;
/// Transmit queue index (driver to device).
pub const TX_QUEUE: usize = 1;
/// Maximum size of each queue (the driver may choose fewer entries).
pub const QUEUE_SIZE: u16 = 256;

/// Size of the header before every frame: `struct virtio_net_hdr_v1` (with `num_buffers`).
pub const VNET_HDR_LEN: usize = 12;
/// Offset of `num_buffers` in the header.
pub const VNET_HDR_NUM_BUFFERS: usize = 10;
/// An Ethernet header: destination, source, ethertype.
pub const ETH_HLEN: usize = 14;
/// The largest frame buffer, header included: a 64 KiB payload, the Ethernet header and the vnet
/// header. Bounds both directions (the largest MTU, 65535, fits).
pub const MAX_BUFFER_SIZE: usize = 65536 + ETH_HLEN + VNET_HDR_LEN;
/// The smallest MTU a driver accepts (Linux's `ETH_MIN_MTU`, IPv4's minimum).
pub const MIN_MTU: u16 = 68;

/// Feature bits (virtio spec 5.1.3).
pub mod features {
    /// The device reports its maximum MTU in config space.
    pub const MTU: u32 = 3;
    /// The device has a MAC address in config space.
    pub const MAC: u32 = 5;
    /// The config space's `status` field is valid (link up).
    pub const STATUS: u32 = 16;
}

/// `status` bit: the link is up.
pub const STATUS_LINK_UP: u16 = 1;

/// Errors setting up the net device.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The MAC address is multicast (low bit of the first byte) or all zeros.
    #[error("MAC address {} is not a unicast address", format_mac(.0))]
    InvalidMac([u8; 6]),
    /// The MTU is below [`MIN_MTU`].
    #[error("MTU {0} is below the minimum of {MIN_MTU}")]
    InvalidMtu(u16),
    /// The tap could not be set up.
    #[error("tap backend: {0}")]
    Tap(#[from] TapError),
    /// An eventfd could not be created.
    #[error("creating a queue eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

/// Checks that `mac` can be a station's address: not multicast (nor broadcast), not all zeros.
pub fn validate_mac(mac: &[u8; 6]) -> Result<(), NetError> {
    if mac[0] & 1 != 0 || mac.iter().all(|&b| b == 0) {
        return Err(NetError::InvalidMac(*mac));
    }
    Ok(())
}

/// Checks an MTU: at least [`MIN_MTU`] (any `u16` above it fits [`MAX_BUFFER_SIZE`]).
pub fn validate_mtu(mtu: u16) -> Result<(), NetError> {
    if mtu < MIN_MTU {
        return Err(NetError::InvalidMtu(mtu));
    }
    Ok(())
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests;
