//! A hostile virtio driver on real guest memory: the fuzzer's tape says which descriptor
//! chains it writes (well-formed or not), what the device-readable buffers hold, what it puts on
//! the available ring and what memory it scribbles on, and the target hands the queues to the
//! real device and calls the device's own queue processing.
//!
//! Memory layout (all of it guest RAM from 0): queue `i`'s descriptor table at
//! `i * QUEUE_AREA`, its available ring 0x1000 further, its used ring 0x2000 further; buffers in
//! `DATA_BASE..MEM_SIZE`. Addresses the tape gives are mostly folded into the data region (so
//! most chains are usable and the device's parsing is reached), with a flag for a raw 64-bit
//! address (outside memory, straddling its end, overflowing).
//!
//! Checks on the device (whatever the driver did): every used entry names a descriptor of the
//! queue, the device returns no more entries than were made available, and a chain the driver
//! wrote cleanly (no raw field) is never reported as more written bytes than its writable
//! buffers hold.

use std::collections::HashMap;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_devices::virtio::IrqTrigger;
use vmm_devices::GuestMemory;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::tape::{Tape, TapeWriter};

/// Guest RAM size.
pub const MEM_SIZE: u64 = 1 << 20;
/// Room of one queue's rings.
pub const QUEUE_AREA: u64 = 0x4000;
/// Most queues a device has here.
pub const MAX_QUEUES: usize = 4;
/// Start of the buffers.
pub const DATA_BASE: u64 = QUEUE_AREA * MAX_QUEUES as u64;
/// Size of the buffer region.
pub const DATA_SIZE: u64 = MEM_SIZE - DATA_BASE;
/// Largest queue the driver sets up (the device may allow more).
pub const MAX_DRIVER_QUEUE: u16 = 256;

/// Descriptor flags (virtio 1.x split ring).
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// Descriptor kind bits on the tape.
pub mod kind {
    /// Device-writable.
    pub const WRITE: u8 = 1;
    /// The address is a raw u64 from the tape.
    pub const RAW_ADDR: u8 = 2;
    /// The length is a raw u32 from the tape (else a u16).
    pub const RAW_LEN: u8 = 4;
    /// `next` and the NEXT flag are raw from the tape (loops, jumps, early ends).
    pub const RAW_NEXT: u8 = 8;
    /// The descriptor claims to be an indirect table.
    pub const INDIRECT: u8 = 16;
}

/// One descriptor as the tape describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desc {
    pub kind: u8,
    /// Raw address, or offset into the data region.
    pub addr: u64,
    pub len: u32,
    pub raw_next: u16,
    pub raw_flags: u16,
    /// What a device-readable buffer holds (written at its address, cut to its length).
    pub payload: Vec<u8>,
}

impl Desc {
    /// A device-readable buffer at `offset` of the data region holding `payload`.
    pub fn readable(offset: u64, payload: &[u8]) -> Self {
        Self {
            kind: 0,
            addr: offset,
            len: payload.len() as u32,
            raw_next: 0,
            raw_flags: 0,
            payload: payload.to_vec(),
        }
    }

    /// A device-writable buffer of `len` bytes at `offset` of the data region.
    pub fn writable(offset: u64, len: u32) -> Self {
        Self {
            kind: kind::WRITE,
            addr: offset,
            len,
            raw_next: 0,
            raw_flags: 0,
            payload: Vec::new(),
        }
    }

    /// Reads one descriptor from the tape.
    pub fn read(t: &mut Tape<'_>) -> Self {
        let kind = t.u8();
        let addr = if kind & kind::RAW_ADDR != 0 {
            t.u64()
        } else {
            u64::from(t.u32())
        };
        let len = if kind & kind::RAW_LEN != 0 {
            t.u32()
        } else {
            u32::from(t.u16())
        };
        let (raw_next, raw_flags) = if kind & kind::RAW_NEXT != 0 {
            (t.u16(), t.u16())
        } else {
            (0, 0)
        };
        let payload = if kind & kind::WRITE == 0 {
            t.blob().to_vec()
        } else {
            Vec::new()
        };
        Self {
            kind,
            addr,
            len,
            raw_next,
            raw_flags,
            payload,
        }
    }

    /// Writes it back in tape form.
    pub fn write(&self, w: &mut TapeWriter) {
        w.u8(self.kind);
        if self.kind & kind::RAW_ADDR != 0 {
            w.u64(self.addr);
        } else {
            w.u32(self.addr as u32);
        }
        if self.kind & kind::RAW_LEN != 0 {
            w.u32(self.len);
        } else {
            w.u16(self.len as u16);
        }
        if self.kind & kind::RAW_NEXT != 0 {
            w.u16(self.raw_next).u16(self.raw_flags);
        }
        if self.kind & kind::WRITE == 0 {
            w.blob(&self.payload);
        }
    }

    fn is_raw(&self) -> bool {
        self.kind & (kind::RAW_ADDR | kind::RAW_LEN | kind::RAW_NEXT | kind::INDIRECT) != 0
    }

    /// The guest address it points at.
    pub fn guest_addr(&self) -> u64 {
        if self.kind & kind::RAW_ADDR != 0 {
            self.addr
        } else {
            DATA_BASE + self.addr % DATA_SIZE
        }
    }
}

/// Tape form of a whole chain: a count byte (1 + n % 16 descriptors), then each descriptor.
pub fn read_chain(t: &mut Tape<'_>) -> Vec<Desc> {
    let n = 1 + usize::from(t.u8() % 16);
    (0..n).map(|_| Desc::read(t)).collect()
}

/// Writes a chain in tape form (at most 16 descriptors).
pub fn write_chain(w: &mut TapeWriter, descs: &[Desc]) {
    assert!(!descs.is_empty() && descs.len() <= 16);
    w.u8((descs.len() - 1) as u8);
    for d in descs {
        d.write(w);
    }
}

struct Inflight {
    descs: Vec<u16>,
    writable: u64,
}

/// The driver side of one queue.
pub struct DriverQueue {
    base: u64,
    size: u16,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    /// Entries made available, less used entries seen.
    outstanding: u64,
    /// Which chain head last wrote each descriptor.
    owner: Vec<u16>,
    inflight: HashMap<u16, Inflight>,
}

/// The driver: guest memory, its queues and the interrupt line the device raises.
pub struct Driver {
    pub mem: GuestMemory,
    pub queues: Vec<DriverQueue>,
    pub irq: Arc<IrqTrigger>,
    /// False once the tape wrote anything raw (descriptor fields, ring entries, memory over the
    /// rings): the per-chain checks are off for the rest of the input.
    pub strict: bool,
}

/// A power-of-two queue size from a tape byte, at most `max`.
pub fn queue_size(byte: u8, max: u16) -> u16 {
    let max = max.min(MAX_DRIVER_QUEUE);
    let size = 1u16 << (byte % 9);
    size.min(max).max(1)
}

impl Driver {
    /// Fresh guest memory with `sizes.len()` queues of those sizes (powers of two).
    pub fn new(sizes: &[u16]) -> Self {
        assert!(sizes.len() <= MAX_QUEUES);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
            .expect("guest memory");
        let queues = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| DriverQueue {
                base: i as u64 * QUEUE_AREA,
                size,
                next_desc: 0,
                avail_idx: 0,
                used_seen: 0,
                outstanding: 0,
                owner: vec![u16::MAX; usize::from(size)],
                inflight: HashMap::new(),
            })
            .collect();
        let irq = Arc::new(IrqTrigger::new(
            EventFd::new(EFD_NONBLOCK).expect("interrupt eventfd"),
        ));
        Self {
            mem,
            queues,
            irq,
            strict: true,
        }
    }

    /// The device's view of queue `i` (ready and valid), for `activate`.
    pub fn device_queue(&self, i: usize, max_size: u16) -> Queue {
        let q = &self.queues[i];
        let mut dq = Queue::new(max_size).expect("device queue size");
        dq.set_size(q.size);
        dq.set_desc_table_address(Some(q.base as u32), Some(0));
        dq.set_avail_ring_address(Some((q.base + 0x1000) as u32), Some(0));
        dq.set_used_ring_address(Some((q.base + 0x2000) as u32), Some(0));
        dq.set_ready(true);
        assert!(
            dq.is_valid(&self.mem),
            "the driver's queue {i} is not valid"
        );
        dq
    }

    /// The ring addresses of queue `i`: descriptors, available, used.
    pub fn ring_addresses(&self, i: usize) -> (u64, u64, u64) {
        let b = self.queues[i].base;
        (b, b + 0x1000, b + 0x2000)
    }

    /// The size the driver gave queue `i`.
    pub fn size(&self, i: usize) -> u16 {
        self.queues[i].size
    }

    fn write_desc(&self, q: usize, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let a = self.queues[q].base + u64::from(idx) * 16;
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..].copy_from_slice(&next.to_le_bytes());
        self.mem
            .write_slice(&raw, GuestAddress(a))
            .expect("descriptor table is in memory");
    }

    /// Writes `bytes` at guest address `addr`, cut to guest memory.
    pub fn write_mem(&self, addr: u64, bytes: &[u8]) {
        let Some(room) = MEM_SIZE.checked_sub(addr) else {
            return;
        };
        let n = bytes.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let _ = self.mem.write_slice(&bytes[..n], GuestAddress(addr));
    }

    /// Reads `len` bytes at guest address `addr` (zeros past the end of memory).
    pub fn read_mem(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let room = MEM_SIZE.saturating_sub(addr);
        let n = len.min(usize::try_from(room).unwrap_or(usize::MAX));
        let _ = self.mem.read_slice(&mut out[..n], GuestAddress(addr));
        out
    }

    /// Writes `descs` as a chain on queue `q`'s next descriptors (wrapping), fills the readable
    /// buffers, and publishes the head. Returns the head. A chain longer than the queue is cut.
    pub fn add_chain(&mut self, q: usize, descs: &[Desc]) -> Option<u16> {
        let qs = self.queues.get(q)?;
        let size = qs.size;
        let n = descs.len().min(usize::from(size));
        if n == 0 {
            return None;
        }
        let head = qs.next_desc;
        let mut idx = head;
        let mut used = Vec::with_capacity(n);
        let mut writable = 0u64;
        let mut raw = false;
        for (i, d) in descs[..n].iter().enumerate() {
            let next = (idx + 1) % size;
            let addr = d.guest_addr();
            let (flags, next_field) = if d.kind & kind::RAW_NEXT != 0 {
                (d.raw_flags, d.raw_next)
            } else {
                let mut f = if d.kind & kind::WRITE != 0 {
                    F_WRITE
                } else {
                    0
                };
                if d.kind & kind::INDIRECT != 0 {
                    f |= F_INDIRECT;
                }
                if i + 1 < n {
                    f |= F_NEXT;
                }
                (f, next)
            };
            self.write_desc(q, idx, addr, d.len, flags, next_field);
            if d.kind & kind::WRITE == 0 {
                let k = d.payload.len().min(d.len as usize);
                self.write_mem(addr, &d.payload[..k]);
            } else {
                writable += u64::from(d.len);
            }
            raw |= d.is_raw();
            used.push(idx);
            idx = next;
        }
        let qs = &mut self.queues[q];
        qs.next_desc = idx;
        for &d in &used {
            qs.owner[usize::from(d)] = head;
        }
        if raw {
            self.strict = false;
        }
        qs.inflight.insert(
            head,
            Inflight {
                descs: used,
                writable,
            },
        );
        self.make_avail(q, head);
        Some(head)
    }

    /// Puts `head` on queue `q`'s available ring and bumps its index.
    pub fn make_avail(&mut self, q: usize, head: u16) {
        let Some(qs) = self.queues.get_mut(q) else {
            return;
        };
        let avail = qs.base + 0x1000;
        let slot = u64::from(qs.avail_idx % qs.size);
        qs.avail_idx = qs.avail_idx.wrapping_add(1);
        qs.outstanding += 1;
        let idx = qs.avail_idx;
        self.write_mem(avail + 4 + 2 * slot, &head.to_le_bytes());
        self.write_mem(avail + 2, &idx.to_le_bytes());
    }

    /// A raw available-ring entry (any head, even past the table), published.
    pub fn raw_avail(&mut self, q: usize, head: u16) {
        self.strict = false;
        self.make_avail(q, head);
    }

    /// Sets queue `q`'s available index to anything (a hostile jump).
    pub fn raw_avail_idx(&mut self, q: usize, idx: u16) {
        let Some(qs) = self.queues.get_mut(q) else {
            return;
        };
        self.strict = false;
        qs.avail_idx = idx;
        let at = qs.base + 0x1000 + 2;
        self.write_mem(at, &idx.to_le_bytes());
    }

    /// Reads the used entries the device added to queue `q` since the last call, checks them,
    /// frees their descriptors, and returns them (head, length).
    pub fn take_used(&mut self, q: usize) -> Vec<(u32, u32)> {
        let Some(qs) = self.queues.get(q) else {
            return Vec::new();
        };
        let used = qs.base + 0x2000;
        let idx = u16::from_le_bytes(self.read_mem(used + 2, 2).try_into().expect("two bytes"));
        let size = qs.size;
        let mut out = Vec::new();
        // A page the guest gave back (the balloon's inflate and free page reporting discard
        // what the guest names, its own rings included) reads as zeros: the driver's count of
        // that ring no longer holds, as after a reset (found by virtio_balloon's long run).
        let seen = idx.wrapping_sub(self.queues[q].used_seen);
        if self.strict
            && u64::from(seen) > self.queues[q].outstanding
            && idx == 0
            && self.read_mem(used & !0xfff, 0x1000).iter().all(|&b| b == 0)
        {
            self.strict = false;
        }
        let strict = self.strict;
        let qs = &mut self.queues[q];
        let fresh = idx.wrapping_sub(qs.used_seen);
        if strict {
            assert!(
                u64::from(fresh) <= qs.outstanding,
                "queue {q}: the device returned {fresh} used entries, only {} were available",
                qs.outstanding
            );
        }
        // Without the check above a hostile avail index can make the device lap the ring:
        // read at most one ring's worth.
        let fresh = fresh.min(size);
        for _ in 0..fresh {
            let e = used + 4 + 8 * u64::from(qs.used_seen % size);
            let mut entry = [0u8; 8];
            let _ = self.mem.read_slice(&mut entry, GuestAddress(e));
            let id = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
            let len = u32::from_le_bytes([entry[4], entry[5], entry[6], entry[7]]);
            // Out of strict mode the guest may have written the ring itself (a raw buffer or a
            // scribble over it: the long run's virtio_net wrote a received frame there).
            if strict {
                assert!(
                    id < u32::from(size),
                    "queue {q}: used entry names descriptor {id}, the queue has {size}"
                );
            } else if id >= u32::from(size) {
                qs.outstanding = qs.outstanding.saturating_sub(1);
                qs.used_seen = qs.used_seen.wrapping_add(1);
                continue;
            }
            let head = id as u16;
            if let Some(chain) = qs.inflight.remove(&head) {
                let intact = chain
                    .descs
                    .iter()
                    .all(|&d| qs.owner[usize::from(d)] == head);
                if strict && intact {
                    assert!(
                        u64::from(len) <= chain.writable,
                        "queue {q}: the device says it wrote {len} bytes into chain {head}, \
                         whose writable buffers hold {}",
                        chain.writable
                    );
                }
            }
            qs.outstanding = qs.outstanding.saturating_sub(1);
            qs.used_seen = qs.used_seen.wrapping_add(1);
            out.push((id, len));
        }
        out
    }

    /// The common driver operations a target's tape can ask for. Returns false when `op` is
    /// not one of them (the target handles it).
    pub fn generic_op(&mut self, op: u8, t: &mut Tape<'_>) -> bool {
        let nq = self.queues.len().max(1);
        match op {
            // A chain on a queue.
            0 => {
                let q = usize::from(t.u8()) % nq;
                let chain = read_chain(t);
                self.add_chain(q, &chain);
            }
            // A raw available entry.
            1 => {
                let q = usize::from(t.u8()) % nq;
                let head = t.u16();
                self.raw_avail(q, head);
            }
            // A raw available index.
            2 => {
                let q = usize::from(t.u8()) % nq;
                let idx = t.u16();
                self.raw_avail_idx(q, idx);
            }
            // Scribble on memory (in the data region, or anywhere with the high bit).
            3 => {
                let at = t.u32();
                let bytes = t.blob();
                let addr = if at & 0x8000_0000 != 0 {
                    self.strict = false;
                    u64::from(at & 0x7fff_ffff) % MEM_SIZE
                } else {
                    DATA_BASE + u64::from(at) % DATA_SIZE
                };
                self.write_mem(addr, bytes);
            }
            _ => return false,
        }
        true
    }

    /// Collects every queue's used entries (checking them).
    pub fn take_all_used(&mut self) {
        for q in 0..self.queues.len() {
            self.take_used(q);
        }
    }
}

/// Writes the generic "chain" op in tape form.
pub fn write_chain_op(w: &mut TapeWriter, q: u8, descs: &[Desc]) {
    w.u8(0).u8(q);
    write_chain(w, descs);
}

/// Most passes a device gets to empty a queue it keeps re-signalling. A device serves at most
/// a queue's worth of chains per pass and re-signals while chains are left; with no new chains
/// from the driver it must be done well within this.
pub const MAX_PASSES: usize = 64;

/// Runs `pass` (the device's serving of queue `q`), then again while the device re-signalled
/// the queue (chains left), as the event loop would. In strict mode a device that keeps
/// re-signalling with nothing new from the driver fails the input (it would spin the event
/// loop).
pub fn serve_until_idle<D: vmm_devices::virtio::VirtioDevice + ?Sized>(
    driver: &Driver,
    dev: &mut D,
    q: usize,
    mut pass: impl FnMut(&mut D),
) {
    pass(dev);
    for _ in 0..MAX_PASSES {
        if !matches!(dev.state().read_queue_event(q), Ok(true)) {
            return;
        }
        pass(dev);
    }
    if driver.strict {
        panic!("queue {q}: the device re-signals itself after {MAX_PASSES} passes");
    }
}
