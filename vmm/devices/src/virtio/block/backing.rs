//! The host side of a disk: a regular file or a block device the embedder opened. I/O goes
//! straight between the file and guest memory (`vm-memory`'s volatile reads and writes at the
//! file's position), so a request allocates nothing in the host.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;

use vm_memory::{Bytes, GuestAddress};

use super::SECTOR_SIZE;
use crate::GuestMemory;

/// `BLKDISCARD` = `_IO(0x12, 119)` (linux/fs.h): discard a byte range of a block device.
const BLKDISCARD: libc::c_ulong = 0x1277;
/// `BLKZEROOUT` = `_IO(0x12, 127)`: zero a byte range of a block device.
const BLKZEROOUT: libc::c_ulong = 0x127f;
/// Bytes written per step when zeroes must be written by hand (fallocate not supported).
const ZERO_CHUNK: usize = 64 * 1024;

/// What kind of file backs the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskKind {
    /// A regular file: discard and write-zeroes are `fallocate` calls.
    RegularFile,
    /// A block device: discard and write-zeroes are `BLKDISCARD` / `BLKZEROOUT`.
    BlockDevice,
}

/// Why a file cannot back a disk, or an I/O on it failed.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// Neither a regular file nor a block device.
    #[error("not a regular file or a block device")]
    NotADisk,
    /// Reading the file's type or size failed.
    #[error("reading the file's size: {0}")]
    Size(#[source] io::Error),
    /// A host I/O error.
    #[error("host I/O: {0}")]
    Io(#[from] io::Error),
    /// Guest memory could not be accessed (the request was checked, so the file was short).
    #[error("guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    /// The backing does not support the operation.
    #[error("not supported by the backing")]
    Unsupported,
}

/// A disk's backing file with its capacity.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    kind: DiskKind,
    sectors: u64,
}

impl DiskFile {
    /// Takes `file` as a disk. Its capacity is its size rounded down to whole sectors (a tail
    /// shorter than a sector is not visible to the guest).
    pub fn new(mut file: File) -> Result<Self, BackingError> {
        let ft = file.metadata().map_err(BackingError::Size)?.file_type();
        let kind = if ft.is_file() {
            DiskKind::RegularFile
        } else if ft.is_block_device() {
            DiskKind::BlockDevice
        } else {
            return Err(BackingError::NotADisk);
        };
        let bytes = file.seek(SeekFrom::End(0)).map_err(BackingError::Size)?;
        Ok(Self {
            file,
            kind,
            sectors: bytes / SECTOR_SIZE,
        })
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// What kind of file it is.
    pub fn kind(&self) -> DiskKind {
        self.kind
    }

    /// Reads `len` bytes at byte `offset` of the file into guest memory at `addr`.
    pub fn read_to_guest(
        &mut self,
        mem: &GuestMemory,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> Result<(), BackingError> {
        self.file.seek(SeekFrom::Start(offset))?;
        mem.read_exact_volatile_from(addr, &mut self.file, len)?;
        Ok(())
    }

    /// Writes `len` bytes of guest memory at `addr` to byte `offset` of the file.
    pub fn write_from_guest(
        &mut self,
        mem: &GuestMemory,
        addr: GuestAddress,
        len: usize,
        offset: u64,
    ) -> Result<(), BackingError> {
        self.file.seek(SeekFrom::Start(offset))?;
        mem.write_all_volatile_to(addr, &mut self.file, len)?;
        Ok(())
    }

    /// Makes written data durable (`fdatasync`).
    pub fn flush(&self) -> Result<(), BackingError> {
        self.file.sync_data()?;
        Ok(())
    }

    /// Discards `len` bytes at `offset` (punches a hole / BLKDISCARD).
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), BackingError> {
        match self.kind {
            DiskKind::RegularFile => self.fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ),
            DiskKind::BlockDevice => self.blk_ioctl(BLKDISCARD, offset, len),
        }
    }

    /// Zeroes `len` bytes at `offset` (ZERO_RANGE / BLKZEROOUT, or written zeroes when the
    /// backing has neither).
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), BackingError> {
        let fast = match self.kind {
            DiskKind::RegularFile => self.fallocate(
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ),
            DiskKind::BlockDevice => self.blk_ioctl(BLKZEROOUT, offset, len),
        };
        match fast {
            Err(BackingError::Unsupported) => self.write_zeroes_slow(offset, len),
            other => other,
        }
    }

    fn write_zeroes_slow(&mut self, offset: u64, len: u64) -> Result<(), BackingError> {
        let zeroes = [0u8; ZERO_CHUNK];
        self.file.seek(SeekFrom::Start(offset))?;
        let mut left = len;
        while left > 0 {
            let n = usize::try_from(left).map_or(ZERO_CHUNK, |l| l.min(ZERO_CHUNK));
            self.file.write_all(&zeroes[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> Result<(), BackingError> {
        let (Ok(off), Ok(l)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(BackingError::Io(io::Error::from_raw_os_error(libc::EINVAL)));
        };
        // SAFETY: fallocate on a file descriptor we own; it touches no memory of ours.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, l) };
        if r == 0 {
            return Ok(());
        }
        Err(unsupported_or_io(io::Error::last_os_error()))
    }

    fn blk_ioctl(&self, req: libc::c_ulong, offset: u64, len: u64) -> Result<(), BackingError> {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD / BLKZEROOUT read a `u64[2]` (start, length) from the pointer we
        // pass, which points to a live array of that type; the fd is ours.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), req as _, range.as_ptr()) };
        if r == 0 {
            return Ok(());
        }
        Err(unsupported_or_io(io::Error::last_os_error()))
    }
}

fn unsupported_or_io(e: io::Error) -> BackingError {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) => BackingError::Unsupported,
        _ => BackingError::Io(e),
    }
}
