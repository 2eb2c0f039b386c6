//! virtio-vsock (virtio spec 5.10) with a hybrid-vsock Unix-socket backend.
//!
//! The guest sees a vsock device with the CID it is given; the host side is a Unix socket at
//! `uds_path` (Firecracker's "hybrid vsock" protocol):
//!
//! - **Host-initiated:** a host process connects to `uds_path` and writes `CONNECT <port>\n`. The
//!   device sends the guest a `REQUEST` to `<port>`; once the guest answers `RESPONSE` it writes
//!   `OK <host_port>\n` back (`host_port` is the local port it chose) and from then on the Unix
//!   stream carries the raw bytes of the connection. If the guest refuses (`RST`) or does not
//!   answer within [`CONNECT_TIMEOUT`], the Unix stream is closed.
//! - **Guest-initiated:** a guest connection to CID 2 port `P` is connected to the Unix socket
//!   `<uds_path>_<P>`; if nothing listens there the guest gets a `RST`.
//!
//! Files: [`packet`] parses the guest's descriptor chains (bounds-checked, no KVM needed),
//! [`muxer`] is the host side (listener, the connections by token and port pair, event and
//! packet dispatch, connection limit), `connection` one connection's state machine with its
//! credit flow control, `uds` the Unix-socket path limit and non-blocking connect, [`device`]
//! the [`VirtioDevice`](super::VirtioDevice) with its three queues, `event_handler` the glue to
//! the device event loop.
//!
//! The guest is hostile: every descriptor is checked by virtio-queue and vm-memory, packet data
//! is bounded by [`MAX_PKT_DATA`], a connection buffers at most [`CONN_BUF_ALLOC`] bytes for the
//! host (the credit it advertised; a guest exceeding it is reset), and the number of connections
//! is bounded.

mod connection;
pub mod device;
mod event_handler;
pub mod muxer;
pub mod packet;
mod uds;

use std::time::Duration;

pub use device::Vsock;
pub use muxer::VsockMuxer;
pub use packet::{PacketError, VsockHeader};

/// The host's CID, to which guest connections for the host are addressed.
pub const VSOCK_HOST_CID: u64 = 2;
/// The default guest CID.
pub const DEFAULT_GUEST_CID: u64 = 3;

/// Queue indices and sizes.
pub const RX_QUEUE: usize = 0;
/// Guest-to-host packets.
pub const TX_QUEUE: usize = 1;
/// Device events (transport reset); never used by us.
pub const EVENT_QUEUE: usize = 2;
/// Maximum size of each of the three queues.
pub const QUEUE_SIZE: u16 = 256;

/// Socket type: stream (the only one we support).
pub const TYPE_STREAM: u16 = 1;

/// Packet operations.
pub mod op {
    pub const INVALID: u16 = 0;
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
}

/// SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;

/// Largest data payload of one packet, either way (Linux uses 64 KiB too).
pub const MAX_PKT_DATA: usize = 64 * 1024;
/// The receive buffer each connection advertises to the guest (`buf_alloc`): the most guest data
/// the host side ever holds for one connection.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Once the host has forwarded this many bytes since it last told the guest, it sends a
/// CREDIT_UPDATE without being asked.
pub const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_ALLOC / 4;
/// Default maximum number of connections (both directions, including handshakes in progress).
/// With [`CONN_BUF_ALLOC`] this bounds what a guest can make the host buffer to 32 MiB.
pub const MAX_CONNECTIONS: usize = 128;
/// How long the guest has to answer a host-initiated REQUEST.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest `CONNECT <port>\n` line accepted from the host.
pub const MAX_CONNECT_LINE: usize = 32;

/// Errors setting up the vsock device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The CID is reserved (0, 1, 2 and `u32::MAX`) or does not fit 32 bits.
    #[error("invalid guest CID {0}")]
    InvalidCid(u64),
    /// The socket path does not fit a `sockaddr_un`.
    #[error("socket path {0:?} is too long for a Unix socket")]
    PathTooLong(std::path::PathBuf),
    /// Something other than a socket is in the way at the path.
    #[error("{0:?} exists and is not a socket")]
    PathInUse(std::path::PathBuf),
    /// Removing a stale socket failed.
    #[error("removing the stale socket {0:?}: {1}")]
    RemoveStale(std::path::PathBuf, #[source] std::io::Error),
    /// Binding the listener failed.
    #[error("binding {0:?}: {1}")]
    Bind(std::path::PathBuf, #[source] std::io::Error),
    /// An epoll, timer or eventfd could not be created.
    #[error("creating the backend's {0}: {1}")]
    Sys(&'static str, #[source] std::io::Error),
}

#[cfg(test)]
mod tests;
