//! A simulated driver's side of one split virtqueue in real guest memory, for device tests:
//! write descriptor chains, publish them on the available ring, read the used ring back.
//!
//! Layout from `base`: descriptor table, available ring at `base + 0x1000`, used ring at
//! `base + 0x2000` (room for 256 entries each).

use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::GuestMemory;

/// Descriptor flag: another descriptor follows.
pub(crate) const F_NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// Descriptor flag: the device writes the buffer.
pub(crate) const F_WRITE: u16 = VRING_DESC_F_WRITE as u16;

/// One buffer of a chain: guest address, length, device-writable or not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buf {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

/// A device-readable buffer.
pub(crate) fn ro(addr: u64, len: u32) -> Buf {
    Buf {
        addr,
        len,
        writable: false,
    }
}

/// A device-writable buffer.
pub(crate) fn wr(addr: u64, len: u32) -> Buf {
    Buf {
        addr,
        len,
        writable: true,
    }
}

/// The driver side of one queue.
pub(crate) struct TestQueue {
    pub mem: GuestMemory,
    base: u64,
    size: u16,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

impl TestQueue {
    /// A queue of `size` entries at `base` of `mem`.
    pub fn new(mem: &GuestMemory, base: u64, size: u16) -> Self {
        Self {
            mem: mem.clone(),
            base,
            size,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// The device's view of the queue (ready, valid), for `activate`.
    pub fn queue(&self, max_size: u16) -> Queue {
        let mut q = Queue::new(max_size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.base as u32), Some(0));
        q.set_avail_ring_address(Some((self.base + 0x1000) as u32), Some(0));
        q.set_used_ring_address(Some((self.base + 0x2000) as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(&self.mem));
        q
    }

    /// Writes descriptor `idx` as is (hostile tests build loops and bad flags with it).
    pub fn write_desc(&self, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let a = self.base + u64::from(idx) * 16;
        self.mem.write_obj(addr.to_le(), GuestAddress(a)).unwrap();
        self.mem
            .write_obj(len.to_le(), GuestAddress(a + 8))
            .unwrap();
        self.mem
            .write_obj(flags.to_le(), GuestAddress(a + 12))
            .unwrap();
        self.mem
            .write_obj(next.to_le(), GuestAddress(a + 14))
            .unwrap();
    }

    /// Writes `bufs` as a chain on the next free descriptors (wrapping), publishes it and
    /// returns its head.
    pub fn add_chain(&mut self, bufs: &[Buf]) -> u16 {
        assert!(!bufs.is_empty() && bufs.len() <= usize::from(self.size));
        let head = self.next_desc;
        for (i, b) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            let next = (idx + 1) % self.size;
            let mut flags = if b.writable { F_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= F_NEXT;
            }
            self.write_desc(idx, b.addr, b.len, flags, next);
            self.next_desc = next;
        }
        self.make_avail(head);
        head
    }

    /// Puts `head` on the available ring.
    pub fn make_avail(&mut self, head: u16) {
        let avail = self.base + 0x1000;
        let slot = u64::from(self.avail_idx % self.size);
        self.mem
            .write_obj(head.to_le(), GuestAddress(avail + 4 + 2 * slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx.to_le(), GuestAddress(avail + 2))
            .unwrap();
    }

    /// The driver's available index (entries published so far, wrapping).
    pub fn avail_idx(&self) -> u16 {
        self.avail_idx
    }

    /// Used entries consumed so far (wrapping).
    pub fn used_seen(&self) -> u16 {
        self.used_seen
    }

    /// New used entries (head, written length) since the last call.
    pub fn take_used(&mut self) -> Vec<(u32, u32)> {
        let used = self.base + 0x2000;
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let e = used + 4 + 8 * u64::from(self.used_seen % self.size);
            let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }
}
