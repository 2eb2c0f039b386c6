//! The virtio-blk device: one request queue, config space per virtio spec 5.2.4.
//!
//! Requests are served synchronously on the device event-loop thread, at most one queue's worth
//! per turn of the loop. The device is shared as `Arc<Mutex<Block>>`; [`Block::attach`] and
//! [`Block::detach`] take the same lock, so they happen between requests: a request in flight
//! always finishes on the disk it started on.

use std::fs::File;

use virtio_queue::DescriptorChain;
use vm_memory::Bytes;

use super::backing::{BackingError, DiskFile};
use super::request::{parse, Request, RequestType};
use super::{
    feature, status, validate_serial, Access, BlockError, BLOCK_SIZE, CONFIG_LEN,
    MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, QUEUE_SIZE, SECTOR_SIZE, SEG_MAX, SERIAL_LEN, SIZE_MAX,
};
use crate::virtio::device_state::DeviceState;
use crate::virtio::{device_type, read_config_bytes, VirtioDevice, INT_CONFIG, VIRTIO_F_VERSION_1};
use crate::GuestMemory;

const QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];

/// Counters of what the device did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BlockStats {
    /// Chains served (good or bad).
    pub requests: u64,
    /// Bytes read from the disk into the guest.
    pub read_bytes: u64,
    /// Bytes written from the guest to the disk.
    pub write_bytes: u64,
    /// Requests that ended with a status other than OK, or without a status byte.
    pub errors: u64,
}

/// A virtio-blk device.
pub struct Block {
    serial: String,
    access: Access,
    disk: Option<DiskFile>,
    state: DeviceState,
    /// Bumped on every device-side config change.
    config_generation: u32,
    stats: BlockStats,
}

impl Block {
    /// A device backed by `file` (`None`: an empty slot of capacity 0).
    pub fn new(serial: String, file: Option<File>, access: Access) -> Result<Self, BlockError> {
        validate_serial(&serial)?;
        let disk = file.map(DiskFile::new).transpose()?;
        let mut features = 1 << VIRTIO_F_VERSION_1
            | 1 << feature::SIZE_MAX
            | 1 << feature::SEG_MAX
            | 1 << feature::BLK_SIZE
            | 1 << feature::FLUSH;
        features |= match access {
            Access::ReadOnly => 1 << feature::RO,
            Access::ReadWrite => 1 << feature::DISCARD | 1 << feature::WRITE_ZEROES,
        };
        let state = DeviceState::new("virtio-blk", device_type::BLOCK, features, &QUEUE_SIZES)
            .map_err(BlockError::EventFd)?;
        Ok(Self {
            serial,
            access,
            disk,
            state,
            config_generation: 0,
            stats: BlockStats::default(),
        })
    }

    /// Capacity in sectors (0 for an empty slot).
    pub fn capacity(&self) -> u64 {
        self.disk.as_ref().map_or(0, DiskFile::sectors)
    }

    /// The serial the guest reads.
    pub fn serial(&self) -> &str {
        &self.serial
    }

    /// Whether the slot has a disk.
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    /// The slot's access mode.
    pub fn access(&self) -> Access {
        self.access
    }

    /// What the device did so far.
    pub fn stats(&self) -> BlockStats {
        self.stats
    }

    /// Fills the empty slot with `file` under `serial`, and tells the driver.
    pub fn attach(&mut self, serial: String, file: File) -> Result<(), BlockError> {
        if self.disk.is_some() {
            return Err(BlockError::SlotOccupied);
        }
        validate_serial(&serial)?;
        self.disk = Some(DiskFile::new(file)?);
        self.serial = serial;
        self.config_changed();
        Ok(())
    }

    /// Empties the slot (its data made durable first), and tells the driver.
    pub fn detach(&mut self) -> Result<(), BlockError> {
        let Some(disk) = self.disk.take() else {
            return Err(BlockError::SlotEmpty);
        };
        if let Err(e) = disk.flush() {
            log::warn!("virtio-blk {:?}: flushing on detach: {e}", self.serial);
        }
        self.config_changed();
        Ok(())
    }

    fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        // The driver's interrupt line, from activation until a reset.
        if let Some(active) = self.state.active() {
            if let Err(e) = active.interrupt.trigger(INT_CONFIG) {
                log::error!("virtio-blk: raising the config interrupt: {e}");
            }
        }
    }

    /// The config space. The driver writes none of it: only `writeback` is writable, and only
    /// with CONFIG_WCE, which we do not offer.
    fn config_bytes(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |off: usize, v: &[u8]| c[off..off + v.len()].copy_from_slice(v);
        put(0, &self.capacity().to_le_bytes());
        put(8, &SIZE_MAX.to_le_bytes());
        put(12, &SEG_MAX.to_le_bytes());
        put(20, &BLOCK_SIZE.to_le_bytes());
        put(36, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(40, &MAX_DISCARD_SEG.to_le_bytes());
        put(44, &1u32.to_le_bytes());
        put(48, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(52, &MAX_DISCARD_SEG.to_le_bytes());
        c
    }

    /// The queue eventfd was signalled: consume it and serve the queue.
    pub fn process_queue_event(&mut self) {
        self.state.consume_queue_event(0);
        self.process_queue();
    }

    /// Serves at most one queue's worth of requests.
    pub fn process_queue(&mut self) {
        let mut server = Server {
            disk: &mut self.disk,
            serial: &self.serial,
            access: self.access,
            stats: &mut self.stats,
        };
        self.state
            .serve_queue(0, |mem, chain| server.serve(mem, chain));
    }
}

/// The parts of the device a request needs (borrowed apart from the queue).
struct Server<'a> {
    disk: &'a mut Option<DiskFile>,
    serial: &'a str,
    access: Access,
    stats: &'a mut BlockStats,
}

impl Server<'_> {
    /// Serves one chain; returns the bytes written into it (for the used ring).
    fn serve(&mut self, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
        self.stats.requests += 1;
        let req = match parse(mem, chain) {
            Ok(r) => r,
            Err((e, status_at)) => {
                log::debug!("virtio-blk: bad request: {e}");
                self.stats.errors += 1;
                return match status_at {
                    Some(at) if mem.write_obj(status::IOERR, at).is_ok() => 1,
                    _ => 0,
                };
            }
        };
        let (st, written) = self.execute(mem, &req);
        if st != status::OK {
            self.stats.errors += 1;
        }
        if mem.write_obj(st, req.status).is_err() {
            // Checked by the parser; only a bug gets here.
            self.stats.errors += 1;
            return 0;
        }
        written.saturating_add(1)
    }

    /// Runs a parsed request: (status, bytes written into the data segments).
    fn execute(&mut self, mem: &GuestMemory, req: &Request) -> (u8, u32) {
        match req.kind {
            RequestType::In => self.read(mem, req),
            RequestType::Out => (self.write(mem, req), 0),
            RequestType::Flush => match self.disk.as_ref().map(DiskFile::flush) {
                Some(Err(e)) => {
                    crate::limited!(log::Level::Warn, "virtio-blk {:?}: flush: {e}", self.serial);
                    (status::IOERR, 0)
                }
                _ => (status::OK, 0),
            },
            RequestType::GetId => self.get_id(mem, req),
            RequestType::Discard | RequestType::WriteZeroes => (self.discard(mem, req), 0),
            RequestType::Unsupported(t) => {
                log::debug!("virtio-blk: unsupported request type {t}");
                (status::UNSUPP, 0)
            }
        }
    }

    /// The byte range `[sector * 512, + len)` if it lies inside the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        let cap = self.disk.as_ref()?.sectors().checked_mul(SECTOR_SIZE)?;
        let start = sector.checked_mul(SECTOR_SIZE)?;
        let end = start.checked_add(len)?;
        (len.is_multiple_of(SECTOR_SIZE) && end <= cap).then_some(start)
    }

    fn read(&mut self, mem: &GuestMemory, req: &Request) -> (u8, u32) {
        let Some(mut off) = self.range(req.sector, req.data_len) else {
            return (status::IOERR, 0);
        };
        let Some(disk) = self.disk.as_mut() else {
            return (status::IOERR, 0);
        };
        let mut done: u32 = 0;
        for seg in &req.data {
            if let Err(e) = disk.read_to_guest(mem, seg.addr, seg.len as usize, off) {
                crate::limited!(
                    log::Level::Warn,
                    "virtio-blk {:?}: read at {off}: {e}",
                    self.serial
                );
                return (status::IOERR, done);
            }
            off += u64::from(seg.len);
            done = done.saturating_add(seg.len);
            self.stats.read_bytes += u64::from(seg.len);
        }
        (status::OK, done)
    }

    fn write(&mut self, mem: &GuestMemory, req: &Request) -> u8 {
        if self.access == Access::ReadOnly {
            return status::IOERR;
        }
        let Some(mut off) = self.range(req.sector, req.data_len) else {
            return status::IOERR;
        };
        let Some(disk) = self.disk.as_mut() else {
            return status::IOERR;
        };
        for seg in &req.data {
            if let Err(e) = disk.write_from_guest(mem, seg.addr, seg.len as usize, off) {
                crate::limited!(
                    log::Level::Warn,
                    "virtio-blk {:?}: write at {off}: {e}",
                    self.serial
                );
                return status::IOERR;
            }
            off += u64::from(seg.len);
            self.stats.write_bytes += u64::from(seg.len);
        }
        status::OK
    }

    fn get_id(&mut self, mem: &GuestMemory, req: &Request) -> (u8, u32) {
        let mut id = [0u8; SERIAL_LEN];
        let s = self.serial.as_bytes();
        let n = s.len().min(SERIAL_LEN);
        id[..n].copy_from_slice(&s[..n]);
        let mut done = 0usize;
        for seg in &req.data {
            if done == SERIAL_LEN {
                break;
            }
            let n = (seg.len as usize).min(SERIAL_LEN - done);
            if mem.write_slice(&id[done..done + n], seg.addr).is_err() {
                return (status::IOERR, done as u32);
            }
            done += n;
        }
        (status::OK, done as u32)
    }

    /// Discard and write-zeroes: one 16-byte segment descriptor in the data.
    fn discard(&mut self, mem: &GuestMemory, req: &Request) -> u8 {
        if self.access == Access::ReadOnly {
            return status::IOERR;
        }
        let [seg] = req.data.as_slice() else {
            return status::UNSUPP;
        };
        if seg.len != 16 {
            return status::UNSUPP;
        }
        let mut raw = [0u8; 16];
        if mem.read_slice(&mut raw, seg.addr).is_err() {
            return status::IOERR;
        }
        let sector = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
        let num = u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default());
        let flags = u32::from_le_bytes(raw[12..16].try_into().unwrap_or_default());
        let zeroes = req.kind == RequestType::WriteZeroes;
        // Discard has no flags; write-zeroes has UNMAP (bit 0), which we may ignore.
        let allowed = if zeroes { 1 } else { 0 };
        if flags & !allowed != 0 || num > MAX_DISCARD_SECTORS {
            return status::UNSUPP;
        }
        let len = u64::from(num) * SECTOR_SIZE;
        let Some(off) = self.range(sector, len) else {
            return status::IOERR;
        };
        let Some(disk) = self.disk.as_mut() else {
            return status::IOERR;
        };
        let r = if zeroes {
            disk.write_zeroes(off, len)
        } else {
            disk.discard(off, len)
        };
        match r {
            Ok(()) => status::OK,
            Err(BackingError::Unsupported) => status::UNSUPP,
            Err(e) => {
                crate::limited!(
                    log::Level::Warn,
                    "virtio-blk {:?}: discard/zeroes at {off}: {e}",
                    self.serial
                );
                status::IOERR
            }
        }
    }
}

impl VirtioDevice for Block {
    fn state(&self) -> &DeviceState {
        &self.state
    }

    fn state_mut(&mut self) -> &mut DeviceState {
        &mut self.state
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_bytes(), offset, data);
    }

    fn config_generation(&self) -> u32 {
        self.config_generation
    }
}
