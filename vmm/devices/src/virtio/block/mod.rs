//! virtio-blk (virtio spec 5.2): one request queue over a host file or block device.
//!
//! The embedder opens the backing (the device never opens host paths); a slot may also start
//! empty (capacity 0) and be filled or emptied while the VM runs ([`Block::attach`],
//! [`Block::detach`]): the capacity changes and the guest gets a config-change interrupt.
//!
//! Files: [`request`] parses the guest's descriptor chains (bounds-checked, no I/O), [`backing`]
//! does the I/O on the host file straight between the file and guest memory, [`device`] is the
//! [`VirtioDevice`](super::VirtioDevice), `event_handler` the glue to the device event loop.
//!
//! The guest is hostile: a chain of any shape ends with an error status written when the chain
//! has a writable status byte, the chain returned, and an error counted. A request carries at
//! most [`SEG_MAX`] data segments of at most [`SIZE_MAX`] bytes each; nothing is allocated per
//! request beyond the list of its descriptors (bounded by the queue size).

pub mod backing;
pub mod device;
mod event_handler;
pub mod request;

pub use backing::{BackingError, DiskFile};
pub use device::{Block, BlockStats};
pub use request::{ParseError, Request, RequestType};

/// The sector size of the virtio-blk protocol (addresses and capacity are in these units).
pub const SECTOR_SIZE: u64 = 512;
/// The block size the device reports (`blk_size`).
pub const BLOCK_SIZE: u32 = 512;
/// Size of the single request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most data segments in one request (the header and the status take two descriptors).
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Largest data segment (`size_max`).
pub const SIZE_MAX: u32 = 1 << 20;
/// Longest serial the guest can read (`VIRTIO_BLK_T_GET_ID`).
pub const SERIAL_LEN: usize = 20;
/// Largest discard / write-zeroes range in sectors (1 GiB).
pub const MAX_DISCARD_SECTORS: u32 = 1 << 21;
/// Segments in one discard / write-zeroes request.
pub const MAX_DISCARD_SEG: u32 = 1;
/// Size of the config space we expose (up to `write_zeroes_may_unmap` and its padding).
pub const CONFIG_LEN: usize = 60;

/// Feature bits (virtio spec 5.2.3).
pub mod feature {
    pub const SIZE_MAX: u32 = 1;
    pub const SEG_MAX: u32 = 2;
    pub const RO: u32 = 5;
    pub const BLK_SIZE: u32 = 6;
    pub const FLUSH: u32 = 9;
    pub const DISCARD: u32 = 13;
    pub const WRITE_ZEROES: u32 = 14;
}

/// Request types.
pub mod req_type {
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
    pub const DISCARD: u32 = 11;
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status bytes.
pub mod status {
    pub const OK: u8 = 0;
    pub const IOERR: u8 = 1;
    pub const UNSUPP: u8 = 2;
}

/// Whether a slot can be written; fixed when the device is created (the guest negotiates
/// `VIRTIO_BLK_F_RO` at probe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

/// Errors setting up or changing a block device.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The serial is longer than [`SERIAL_LEN`] bytes.
    #[error("serial {0:?} is longer than {SERIAL_LEN} bytes")]
    SerialTooLong(String),
    /// The backing file cannot be used.
    #[error("backing: {0}")]
    Backing(#[from] BackingError),
    /// Attaching to a slot that has a disk.
    #[error("the slot already has a disk")]
    SlotOccupied,
    /// Detaching from an empty slot.
    #[error("the slot is empty")]
    SlotEmpty,
    /// The queue eventfd could not be created.
    #[error("creating the queue eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

/// Checks a serial for [`SERIAL_LEN`].
pub fn validate_serial(serial: &str) -> Result<(), BlockError> {
    if serial.len() > SERIAL_LEN {
        return Err(BlockError::SerialTooLong(serial.to_owned()));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
