//! virtio-fs (virtio spec 5.11): a host directory shared with the guest over FUSE.
//!
//! The guest's FUSE driver (`mount -t virtiofs <tag> <dir>`) puts each FUSE request on a
//! virtqueue as one descriptor chain: device-readable descriptors with the `fuse_in_header` and
//! the operation's arguments, then device-writable descriptors for the reply. The device hands
//! the chain to `fuse-backend-rs`: its [`Server`](fuse_backend_rs::api::server::Server) decodes
//! the request and calls its [`PassthroughFs`](fuse_backend_rs::passthrough::PassthroughFs), which
//! serves the host directory. Requests are resolved by inode (`openat` relative to the parent's
//! `O_PATH` fd, no symlink following, `..` at the root stays at the root), so a guest cannot
//! name anything outside the shared directory.
//!
//! Queues: queue 0 is the high-priority queue (FORGET and INTERRUPT, no replies), queues
//! `1..=NUM_REQUEST_QUEUES` carry the requests. Config space: the tag (36 bytes, NUL-padded)
//! then `num_request_queues` (u32 LE).
//!
//! The guest is hostile. Before fuse-backend-rs sees a chain, [`request`] checks it: at most
//! [`MAX_DESCRIPTORS`] descriptors, readable descriptors before writable ones, at most
//! [`MAX_REQUEST_BYTES`] readable and [`MAX_REPLY_BYTES`] writable bytes, every descriptor inside
//! guest memory, a complete `fuse_in_header` whose `len` equals the readable length. A chain that
//! fails is answered with an error reply (`EINVAL`) when its header and a reply buffer are usable,
//! otherwise returned unanswered (used length 0). fuse-backend-rs's own checks (argument sizes,
//! NUL-terminated names, data bounded by the buffers) return errors, not panics. Guest-caused
//! failures are logged at debug level only.
//!
//! The passthrough runs as host root, so what the guest creates is a real host file: [`policy`]
//! sits between the server and the passthrough and refuses device nodes (the overlayfs whiteout
//! excepted), set-user-ID and set-group-ID files and file capabilities with `EPERM`, and the
//! thread that serves the requests gives up `CAP_MKNOD`, `CAP_SETFCAP` and `CAP_FSETID` and takes
//! a umask of its own (the passthrough clears the umask at the guest's INIT).
//!
//! Files: [`device`] (the [`VirtioDevice`](super::VirtioDevice), queue processing), [`request`]
//! (chain checks and the hand-off to the FUSE server), [`policy`] (host-side file safety),
//! `event_handler` (event-loop glue).

pub mod device;
mod event_handler;
pub mod policy;
pub mod request;

use std::path::PathBuf;

pub use device::VirtioFs;
pub use request::RequestError;

/// Index of the high-priority queue.
pub const HIPRIO_QUEUE: usize = 0;
/// Index of the first (and only) request queue.
pub const REQUEST_QUEUE: usize = 1;
/// Number of request queues the device offers.
pub const NUM_REQUEST_QUEUES: u32 = 1;
/// Maximum size of each queue (the driver may choose fewer entries).
pub const QUEUE_SIZE: u16 = 1024;
/// Longest tag, in bytes (the config-space field; no NUL needed when it is full).
pub const TAG_MAX_LEN: usize = 36;
/// Size of the config space: tag + `num_request_queues`.
pub const CONFIG_SIZE: usize = TAG_MAX_LEN + 4;
/// Most descriptors in one request chain. Linux needs one per page of data (at most
/// `max_pages` = 256, what the server's INIT offers) plus a few for headers and arguments.
pub const MAX_DESCRIPTORS: usize = 512;
/// Most device-readable bytes in one request: the FUSE server's largest message
/// (`MAX_BUFFER_SIZE`, 1 MiB of data) plus a page for headers and arguments.
pub const MAX_REQUEST_BYTES: usize =
    fuse_backend_rs::api::server::MAX_BUFFER_SIZE as usize + 0x1000;
/// Most device-writable bytes in one request (bounds the host buffers a reply may need, e.g.
/// READDIR's).
pub const MAX_REPLY_BYTES: usize = MAX_REQUEST_BYTES;

/// Errors setting up the virtio-fs device.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The tag is empty, longer than [`TAG_MAX_LEN`] bytes, or contains a NUL.
    #[error("invalid virtio-fs tag {0:?}: it must be 1 to {TAG_MAX_LEN} bytes without NUL")]
    InvalidTag(String),
    /// The shared directory cannot be used.
    #[error("shared directory {path:?}: {reason}")]
    HostDir { path: PathBuf, reason: String },
    /// The passthrough file system could not be created.
    #[error("passthrough file system on {path:?}: {source}")]
    Backend {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An eventfd could not be created.
    #[error("creating a queue eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

/// Checks a tag: 1..=[`TAG_MAX_LEN`] bytes, no NUL.
pub fn validate_tag(tag: &str) -> Result<(), FsError> {
    if tag.is_empty() || tag.len() > TAG_MAX_LEN || tag.contains('\0') {
        return Err(FsError::InvalidTag(tag.to_owned()));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
