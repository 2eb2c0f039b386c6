//! virtio-balloon (virtio spec 1.2, 5.5) used for free page reporting: the guest tells the host
//! which of its pages are free, and the host drops them (`madvise(MADV_DONTNEED)` on the guest
//! RAM mapping), so memory a pod's guest once touched and then freed stops costing the host.
//!
//! Features offered: `VIRTIO_F_VERSION_1` and `VIRTIO_BALLOON_F_REPORTING` (bit 5). Queues, in
//! the order Linux's driver numbers the present ones: inflate (0), deflate (1), and the reporting
//! queue (2) when REPORTING is negotiated (no stats queue, no free-page-hint queue: those
//! features are not offered).
//!
//! - **Reporting queue:** each chain is one report, a scatter list of free blocks the guest's
//!   page allocator took off its free lists (Linux: `page_reporting`, up to 32 blocks of order
//!   `page_reporting_order` or larger, added as device-writable buffers). The device drops each
//!   block's host pages and returns the chain (used length 0); the guest puts the blocks back
//!   on its free lists, and the next touch of such a page gets a zero page from the host.
//! - **Inflate queue:** a buffer of 32-bit page frame numbers (4 KiB pages) the guest gives up;
//!   each page is dropped the same way. **Deflate queue:** page frame numbers the guest takes
//!   back; nothing to do (the next touch maps a page again). The config's `num_pages` stays 0,
//!   so a well-behaved guest never inflates: reporting is the point of the device.
//!
//! The guest is hostile: every range is checked before the host touches its mapping, in
//! [`request`]: device-writable (reporting) or device-readable (inflate, deflate) as the queue
//! requires, page-aligned address and length, a length from one page to
//! [`MAX_RANGE_LEN`], no overflow, wholly inside one guest RAM region. A range that fails is
//! skipped and counted; the chain still goes back on the used ring, so the guest never waits
//! for it. A chain has at most [`QUEUE_SIZE`] descriptors (virtio-queue ends loops), and an
//! inflate or deflate chain at most [`MAX_PFN_BUFFER`] bytes of frame numbers (one that breaks
//! a rule of its buffers is refused as a whole).
//!
//! Files: [`request`] (parsing a chain into checked ranges, and dropping them), [`device`] (the
//! [`VirtioDevice`](super::VirtioDevice) and its queue processing), `event_handler` (event-loop
//! glue).

pub mod device;
mod event_handler;
pub mod request;

pub use device::{Balloon, BalloonStats};
pub use request::RangeError;

/// Feature bit: the device has a reporting queue for free pages (virtio 1.2 5.5.3).
pub const VIRTIO_BALLOON_F_REPORTING: u32 = 5;

/// Index of the inflate queue.
pub const INFLATE_QUEUE: usize = 0;
/// Index of the deflate queue.
pub const DEFLATE_QUEUE: usize = 1;
/// Index of the reporting queue (present when REPORTING is negotiated).
pub const REPORTING_QUEUE: usize = 2;
/// Queues when REPORTING is negotiated.
pub const NUM_QUEUES: usize = 3;

/// Maximum size of each queue. Linux's page reporting needs at least 32 entries on the
/// reporting queue (`PAGE_REPORTING_CAPACITY`) and refuses the device otherwise.
pub const QUEUE_SIZE: u16 = 256;

/// The balloon's page size: page frame numbers count 4 KiB pages, whatever the guest's own page
/// size; reported ranges must be aligned to it too.
pub const PAGE_SIZE: u64 = 4096;

/// Longest range one descriptor may report. Linux reports one free block per descriptor, at most
/// of order `MAX_ORDER - 1` (4 MiB on x86); this bounds what one descriptor can make the event
/// loop do while leaving room for larger guest orders.
pub const MAX_RANGE_LEN: u64 = 256 << 20;

/// Most bytes of page frame numbers in one inflate or deflate chain (Linux sends at most 256
/// numbers, 1 KiB, at a time).
pub const MAX_PFN_BUFFER: usize = 4096;

/// Size of the config space this device serves: `num_pages` then `actual` (u32 LE each); the
/// free-page-hint and poison fields of later features read as zero.
pub const CONFIG_SIZE: usize = 8;

#[cfg(test)]
mod tests;
