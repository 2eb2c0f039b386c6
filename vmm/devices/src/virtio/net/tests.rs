//! Whole-device tests: a simulated guest driver writes descriptor chains into real guest memory
//! (`GuestMemoryMmap`), the host side is a real non-blocking datagram socket pair standing in for
//! the tap (one frame per `recv`/`send`, `EAGAIN` when the peer's queue is full, epoll readiness),
//! and the event-loop tests run the device under a real `EventManager`.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::virtio::test_chain::TestQueue;
use crate::virtio::{device_type, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::GuestMemory;

const MEM_SIZE: usize = 16 << 20;
const Q_BASE: [u64; 2] = [0x1_0000, 0x2_0000];
/// Queue size the simulated driver uses.
const QSIZE: u16 = 64;
const RX_BUF_BASE: u64 = 0x10_0000;
const RX_BUF_SIZE: u32 = 2048;
const TX_BUF_BASE: u64 = 0x40_0000;
const TX_SLOT: u64 = 0x1_0000;
const MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];
const F_NEXT: u16 = VRING_DESC_F_NEXT as u16;
const F_WRITE: u16 = VRING_DESC_F_WRITE as u16;

impl NetBackend for UnixDatagram {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf)
    }
    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.send(frame)
    }
}

/// The driver side: guest memory with the two queues, and the host end of the socket pair.
struct Guest {
    mem: GuestMemory,
    host: UnixDatagram,
    qs: [TestQueue; 2],
}

fn queue(mem: &GuestMemory, base: u64) -> Queue {
    TestQueue::new(mem, base, QSIZE).queue(QUEUE_SIZE)
}

/// A guest driver and an activated device (MTU 1500) on a fresh socket pair.
fn setup() -> (Guest, Net<UnixDatagram>) {
    let (dev_sock, host) = UnixDatagram::pair().unwrap();
    dev_sock.set_nonblocking(true).unwrap();
    host.set_nonblocking(true).unwrap();
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    let mut dev = Net::new(dev_sock, MAC, Some(1500)).unwrap();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let queues = Q_BASE.iter().map(|&b| queue(&mem, b)).collect();
    dev.set_acked_features(dev.avail_features());
    dev.activate(mem.clone(), queues, irq).unwrap();
    let qs = Q_BASE.map(|b| TestQueue::new(&mem, b, QSIZE));
    let g = Guest { mem, host, qs };
    (g, dev)
}

/// The same, with the device run by a real event manager.
fn setup_in_event_loop() -> (Guest, Arc<Mutex<Net<UnixDatagram>>>, Em) {
    let (g, dev) = setup();
    let dev = Arc::new(Mutex::new(dev));
    let mut em: Em = EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    (g, dev, em)
}

impl Guest {
    fn write_desc(&self, q: usize, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.qs[q].write_desc(idx, addr, len, flags, next);
    }

    fn make_avail(&mut self, q: usize, head: u16) {
        self.qs[q].make_avail(head);
    }

    /// New used entries (id, len) of queue `q`.
    fn take_used(&mut self, q: usize) -> Vec<(u32, u32)> {
        self.qs[q].take_used()
    }

    /// Posts receive buffer `i` (one writable descriptor of `RX_BUF_SIZE` bytes).
    fn post_rx(&mut self, i: u16) {
        self.write_desc(
            RX_QUEUE,
            i,
            rx_buf(i),
            RX_BUF_SIZE,
            VRING_DESC_F_WRITE as u16,
            0,
        );
        self.make_avail(RX_QUEUE, i);
    }

    fn read_rx(&self, i: u16, len: u32) -> Vec<u8> {
        let mut b = vec![0u8; len as usize];
        self.mem
            .read_slice(&mut b, GuestAddress(rx_buf(i)))
            .unwrap();
        b
    }

    /// Puts `frame` in transmit slot `slot` split into `parts` descriptors, makes it available.
    fn post_tx(&mut self, slot: u16, frame: &[u8], parts: usize) {
        let base = TX_BUF_BASE + u64::from(slot) * TX_SLOT;
        self.mem.write_slice(frame, GuestAddress(base)).unwrap();
        let chunk = frame.len().div_ceil(parts);
        let n = frame.len().div_ceil(chunk);
        for k in 0..n {
            let idx = (slot * 4 + k as u16) % QSIZE;
            let off = k * chunk;
            let len = chunk.min(frame.len() - off);
            let last = k + 1 == n;
            self.write_desc(
                TX_QUEUE,
                idx,
                base + off as u64,
                len as u32,
                if last { 0 } else { F_NEXT },
                (idx + 1) % QSIZE,
            );
        }
        self.make_avail(TX_QUEUE, (slot * 4) % QSIZE);
    }

    /// Every frame waiting on the host end.
    fn host_frames(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; MAX_BUFFER_SIZE + 100];
        loop {
            match self.host.recv(&mut buf) {
                Ok(n) => out.push(buf[..n].to_vec()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return out,
                Err(e) => panic!("host recv: {e}"),
            }
        }
    }
}

fn rx_buf(i: u16) -> u64 {
    RX_BUF_BASE + u64::from(i) * 0x1000
}

/// A frame as the tap gives it: a vnet header (num_buffers left 0, as tun leaves it) and an
/// Ethernet frame of `len` bytes in all.
fn frame(len: usize, seed: u8) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[VNET_HDR_LEN..VNET_HDR_LEN + 6].copy_from_slice(&MAC);
    f[VNET_HDR_LEN + 6..VNET_HDR_LEN + 12].copy_from_slice(&[2, 0, 0, 0, 0, 0xaa]);
    f[VNET_HDR_LEN + 12..VNET_HDR_LEN + 14].copy_from_slice(&[0x88, 0xb5]);
    for (i, b) in f.iter_mut().enumerate().skip(VNET_HDR_LEN + ETH_HLEN) {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    f
}

/// What the guest should find: the frame with num_buffers = 1.
fn as_received(f: &[u8]) -> Vec<u8> {
    let mut f = f.to_vec();
    f[VNET_HDR_NUM_BUFFERS..VNET_HDR_LEN].copy_from_slice(&1u16.to_le_bytes());
    f
}

#[test]
fn identity_features_and_config_space() {
    let (_g, dev) = setup();
    assert_eq!(dev.device_type(), device_type::NET);
    assert_eq!(dev.queue_max_sizes(), &[QUEUE_SIZE, QUEUE_SIZE]);
    assert_eq!(
        dev.avail_features(),
        1 << VIRTIO_F_VERSION_1 | 1 << features::MAC | 1 << features::STATUS | 1 << features::MTU
    );
    let mut cfg = [0u8; 12];
    dev.read_config(0, &mut cfg);
    assert_eq!(cfg, [2, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0xdc, 0x05]);
    let mut tail = [0xffu8; 4];
    dev.read_config(10, &mut tail);
    assert_eq!(tail, [0xdc, 0x05, 0, 0]);
    dev.read_config(u64::MAX, &mut tail);
    assert_eq!(tail, [0; 4]);

    // Without an MTU: no MTU feature, the field reads 0.
    let (a, _b) = UnixDatagram::pair().unwrap();
    let mut d = Net::new(a, MAC, None).unwrap();
    assert_eq!(d.avail_features() & 1 << features::MTU, 0);
    d.write_config(0, &[9; 6]);
    let mut cfg = [0u8; 12];
    d.read_config(0, &mut cfg);
    assert_eq!(&cfg[..6], &MAC, "config writes are ignored");
    assert_eq!(&cfg[10..], &[0, 0]);
    // Acked features are limited to the offered ones.
    d.set_acked_features(u64::MAX);
    assert_eq!(d.acked_features(), d.avail_features());
}

#[test]
fn rejects_bad_macs_and_mtus() {
    for mac in [
        [0u8; 6],
        [1, 0, 0, 0, 0, 1],
        [0xff; 6],
        [0x33, 0x33, 0, 0, 0, 1],
    ] {
        let (a, _b) = UnixDatagram::pair().unwrap();
        let e = Net::new(a, mac, None).err().expect("refused");
        assert!(e.to_string().contains("not a unicast"), "{e}");
    }
    let (a, _b) = UnixDatagram::pair().unwrap();
    let e = Net::new(a, MAC, Some(67)).err().expect("refused");
    assert!(e.to_string().contains("MTU 67"), "{e}");
    let (a, _b) = UnixDatagram::pair().unwrap();
    Net::new(a, MAC, Some(u16::MAX)).unwrap();
    assert_eq!(
        format_mac(&[0x02, 0xab, 0, 1, 0x10, 0xff]),
        "02:ab:00:01:10:ff"
    );
}

#[test]
fn receives_frames_of_every_size_with_num_buffers_one() {
    let (mut g, mut dev) = setup();
    let sizes = [
        VNET_HDR_LEN + 60,
        VNET_HDR_LEN + 61,
        500,
        1000,
        VNET_HDR_LEN + 1514,
    ];
    for i in 0..sizes.len() as u16 {
        g.post_rx(i);
    }
    let frames: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| frame(n, i as u8))
        .collect();
    for f in &frames {
        g.host.send(f).unwrap();
    }
    dev.process_queue_event(RX_QUEUE);
    let used = g.take_used(RX_QUEUE);
    assert_eq!(used.len(), frames.len());
    for (k, (id, len)) in used.iter().enumerate() {
        assert_eq!(*id as usize, k);
        assert_eq!(*len as usize, frames[k].len());
        assert_eq!(g.read_rx(*id as u16, *len), as_received(&frames[k]));
    }
    let s = dev.stats();
    assert_eq!(s.rx_frames, frames.len() as u64);
    assert_eq!(s.rx_bytes, sizes.iter().sum::<usize>() as u64);
    assert_eq!(s.rx_bad_chains + s.rx_dropped, 0);
}

#[test]
fn receive_buffers_split_over_descriptors() {
    let (mut g, mut dev) = setup();
    // Three writable pieces: 5 bytes (less than the vnet header), 20, 3000, scattered.
    let pieces = [(0x30_0000u64, 5u32), (0x30_8000, 20), (0x31_0000, 3000)];
    for (k, &(addr, len)) in pieces.iter().enumerate() {
        let last = k + 1 == pieces.len();
        g.write_desc(
            RX_QUEUE,
            10 + k as u16,
            addr,
            len,
            F_WRITE | if last { 0 } else { F_NEXT },
            11 + k as u16,
        );
    }
    g.make_avail(RX_QUEUE, 10);
    let f = frame(1526, 7);
    g.host.send(&f).unwrap();
    dev.process_queue_event(RX_QUEUE);
    assert_eq!(g.take_used(RX_QUEUE), vec![(10, 1526)]);
    let want = as_received(&f);
    let mut got = Vec::new();
    let mut left = want.len();
    for &(addr, len) in &pieces {
        let n = (len as usize).min(left);
        let mut b = vec![0u8; n];
        g.mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        got.extend_from_slice(&b);
        left -= n;
    }
    assert_eq!(got, want);
}

#[test]
fn transmits_frames_byte_for_byte_from_any_chain_shape() {
    let (mut g, mut dev) = setup();
    let frames: Vec<_> = [
        (72, 1),
        (600, 2),
        (1526, 3),
        (9014 + 12, 4),
        (MAX_BUFFER_SIZE, 4),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(n, parts))| (frame(n, 100 + i as u8), parts))
    .collect();
    for (slot, (f, parts)) in frames.iter().enumerate() {
        g.post_tx(slot as u16, f, *parts);
    }
    dev.process_queue_event(TX_QUEUE);
    let used = g.take_used(TX_QUEUE);
    assert_eq!(used.len(), frames.len());
    assert!(used.iter().all(|&(_, len)| len == 0), "{used:?}");
    let got = g.host_frames();
    assert_eq!(got.len(), frames.len());
    for (got, (want, _)) in got.iter().zip(&frames) {
        assert!(got == want, "a frame of {} bytes changed", want.len());
    }
    let s = dev.stats();
    assert_eq!(s.tx_frames, frames.len() as u64);
    assert_eq!(s.tx_bad_chains + s.tx_dropped + s.tx_deferred, 0);
}

/// Posts a transmit chain of raw descriptors (addr, len, flags, next) starting at `head`.
fn post_raw(g: &mut Guest, q: usize, head: u16, descs: &[(u64, u32, u16, u16)]) {
    for (k, &(addr, len, flags, next)) in descs.iter().enumerate() {
        g.write_desc(q, head + k as u16, addr, len, flags, next);
    }
    g.make_avail(q, head);
}

#[test]
fn hostile_transmit_chains_are_counted_and_returned_empty() {
    let (mut g, mut dev) = setup();
    let good = frame(100, 9);
    g.mem.write_slice(&good, GuestAddress(TX_BUF_BASE)).unwrap();
    let base = TX_BUF_BASE;
    let end_of_mem = MEM_SIZE as u64;
    let chains: Vec<Vec<(u64, u32, u16, u16)>> = vec![
        // Shorter than a vnet header plus an Ethernet header.
        vec![(base, 25, 0, 0)],
        // Empty.
        vec![(base, 0, 0, 0)],
        // A device-writable descriptor where a readable one is needed.
        vec![(base, 12, F_NEXT, 1), (base + 12, 88, F_WRITE, 0)],
        // Outside guest memory, and straddling its end.
        vec![(1 << 40, 100, 0, 0)],
        vec![(end_of_mem - 50, 100, 0, 0)],
        // A loop: the descriptor points to itself.
        vec![(base, 100, F_NEXT, 0)],
        // A next index past the queue.
        vec![(base, 100, F_NEXT, 300)],
        // Longer than MAX_BUFFER_SIZE: two 40000-byte pieces.
        vec![(base, 40_000, F_NEXT, 1), (base + 40_000, 40_000, 0, 0)],
        // Lengths whose sum overflows 32 bits.
        vec![(base, u32::MAX, F_NEXT, 1), (base, u32::MAX, 0, 0)],
    ];
    // Each chain starts at its own descriptor index; a loop must point to its own head.
    for (k, descs) in chains.iter().enumerate() {
        let head = (k as u16) * 2;
        let descs: Vec<_> = descs
            .iter()
            .map(|&(a, l, f, n)| (a, l, f, if n == 300 { 300 } else { head + n }))
            .collect();
        post_raw(&mut g, TX_QUEUE, head, &descs);
    }
    // And a good frame after them all.
    post_raw(&mut g, TX_QUEUE, 40, &[(base, good.len() as u32, 0, 0)]);
    dev.process_queue_event(TX_QUEUE);
    let used = g.take_used(TX_QUEUE);
    assert_eq!(used.len(), chains.len() + 1);
    assert!(used.iter().all(|&(_, len)| len == 0));
    let s = dev.stats();
    assert_eq!(s.tx_bad_chains, chains.len() as u64, "{s:?}");
    assert_eq!(s.tx_frames, 1);
    assert_eq!(g.host_frames(), vec![good]);
}

#[test]
fn hostile_receive_chains_are_returned_empty_and_the_frame_waits() {
    let (mut g, mut dev) = setup();
    let base = RX_BUF_BASE;
    let chains: Vec<Vec<(u64, u32, u16, u16)>> = vec![
        // Device-readable.
        vec![(base, 2048, 0, 0)],
        vec![(base, 12, F_WRITE | F_NEXT, 1), (base + 12, 2000, 0, 0)],
        // Too short for the headers.
        vec![(base, 25, F_WRITE, 0)],
        // Outside guest memory.
        vec![(1 << 40, 2048, F_WRITE, 0)],
        vec![(MEM_SIZE as u64 - 100, 2048, F_WRITE, 0)],
        // A loop.
        vec![(base, 2048, F_WRITE | F_NEXT, 0)],
        // Lengths whose sum overflows 32 bits.
        vec![
            (base, u32::MAX, F_WRITE | F_NEXT, 1),
            (base, 16, F_WRITE, 0),
        ],
    ];
    for (k, descs) in chains.iter().enumerate() {
        let head = (k as u16) * 2;
        let descs: Vec<_> = descs
            .iter()
            .map(|&(a, l, f, n)| (a, l, f, head + n))
            .collect();
        post_raw(&mut g, RX_QUEUE, head, &descs);
    }
    let f = frame(300, 1);
    g.host.send(&f).unwrap();
    dev.process_queue_event(RX_QUEUE);
    let used = g.take_used(RX_QUEUE);
    assert_eq!(used.len(), chains.len());
    assert!(used.iter().all(|&(_, len)| len == 0), "{used:?}");
    let s = dev.stats();
    assert_eq!(s.rx_bad_chains, chains.len() as u64, "{s:?}");
    assert_eq!(
        s.rx_frames + s.rx_dropped,
        0,
        "the frame is not lost: {s:?}"
    );
    // The next good buffer gets it.
    g.post_rx(20);
    dev.process_queue_event(RX_QUEUE);
    assert_eq!(g.take_used(RX_QUEUE), vec![(20, 300)]);
    assert_eq!(g.read_rx(20, 300), as_received(&f));
}

#[test]
fn a_frame_larger_than_the_buffer_is_dropped_and_the_buffer_reused() {
    let (mut g, mut dev) = setup();
    g.post_rx(0);
    let big = frame(RX_BUF_SIZE as usize + 1, 1);
    let small = frame(80, 2);
    g.host.send(&big).unwrap();
    g.host.send(&small).unwrap();
    // Not even a frame: shorter than the headers.
    g.host.send(&[0u8; 20]).unwrap();
    g.host.send(&small).unwrap();
    dev.process_queue_event(RX_QUEUE);
    assert_eq!(g.take_used(RX_QUEUE), vec![(0, 80)]);
    assert_eq!(g.read_rx(0, 80), as_received(&small));
    g.post_rx(1);
    dev.process_queue_event(RX_QUEUE);
    assert_eq!(g.take_used(RX_QUEUE), vec![(1, 80)]);
    let s = dev.stats();
    assert_eq!((s.rx_frames, s.rx_dropped), (2, 2), "{s:?}");
}

type Em = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

/// Runs the event manager until it has nothing to do; returns the events dispatched.
fn run_until_idle(em: &mut Em) -> usize {
    let mut total = 0;
    for _ in 0..1000 {
        let n = em.run_with_timeout(0).unwrap();
        if n == 0 {
            return total;
        }
        total += n;
    }
    panic!("the event loop never went idle: the device spins");
}

#[test]
fn without_rx_buffers_the_backend_is_not_watched_until_buffers_come() {
    let (mut g, dev, mut em) = setup_in_event_loop();
    g.post_rx(0);
    g.post_rx(1);
    let frames: Vec<_> = (0..5).map(|i| frame(100 + i, i as u8)).collect();
    for f in &frames {
        g.host.send(f).unwrap();
    }
    // The activation kick, then the backend: two frames fit, then the device stops reading.
    assert!(run_until_idle(&mut em) > 0);
    let used = g.take_used(RX_QUEUE);
    assert_eq!(used, vec![(0, 100), (1, 101)]);
    {
        let d = dev.lock().unwrap();
        assert!(!d.backend_interest().contains(EventSet::IN));
        assert!(d.stats().rx_waits_for_buffers >= 1);
    }
    // Three frames wait in the socket, and the loop sleeps instead of spinning on them.
    assert_eq!(em.run_with_timeout(100).unwrap(), 0);
    // The driver posts buffers and notifies: the rest arrives in order.
    for i in 2..5 {
        g.post_rx(i);
    }
    dev.lock().unwrap().queue_events()[RX_QUEUE]
        .write(1)
        .unwrap();
    run_until_idle(&mut em);
    let used = g.take_used(RX_QUEUE);
    assert_eq!(used, vec![(2, 102), (3, 103), (4, 104)]);
    for &(id, len) in &used {
        assert_eq!(g.read_rx(id as u16, len), as_received(&frames[id as usize]));
    }
    // Buffers left over: reading is on again.
    g.post_rx(5);
    dev.lock().unwrap().queue_events()[RX_QUEUE]
        .write(1)
        .unwrap();
    run_until_idle(&mut em);
    assert!(dev
        .lock()
        .unwrap()
        .backend_interest()
        .contains(EventSet::IN));
    let f = frame(200, 9);
    g.host.send(&f).unwrap();
    run_until_idle(&mut em);
    assert_eq!(g.take_used(RX_QUEUE), vec![(5, 200)]);
}

#[test]
fn a_refused_transmit_is_retried_when_the_backend_drains_not_lost() {
    let (mut g, dev, mut em) = setup_in_event_loop();
    run_until_idle(&mut em);
    // A small send buffer on the device's end, so that a few unread frames fill it and the
    // next send fails with EAGAIN, as a tap's would when its queue is full.
    let sndbuf: libc::c_int = 8192;
    let fd = dev.lock().unwrap().backend_fd();
    // SAFETY: SO_SNDBUF reads one c_int through the pointer, valid for the call; `fd` is the
    // device's socket, open for the whole test.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &sndbuf as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "{}", io::Error::last_os_error());

    // More frames than the send buffer holds.
    let frames: Vec<_> = (0..14).map(|i| frame(1000 + i, i as u8)).collect();
    for (i, f) in frames.iter().enumerate() {
        g.post_tx(i as u16, f, 1);
    }
    dev.lock().unwrap().queue_events()[TX_QUEUE]
        .write(1)
        .unwrap();
    run_until_idle(&mut em);
    {
        let d = dev.lock().unwrap();
        let s = d.stats();
        assert!(d.tx_pending(), "{s:?}");
        assert!(
            s.tx_deferred >= 1 && s.tx_frames < frames.len() as u64,
            "{s:?}"
        );
        assert!(d.backend_interest().contains(EventSet::OUT));
    }
    // Nothing to do until the peer reads: the loop sleeps.
    assert_eq!(em.run_with_timeout(100).unwrap(), 0);
    let mut got = Vec::new();
    for _ in 0..10 {
        got.extend(g.host_frames());
        run_until_idle(&mut em);
        if got.len() == frames.len() {
            break;
        }
    }
    assert_eq!(got.len(), frames.len());
    for (got, want) in got.iter().zip(&frames) {
        assert_eq!(got, want);
    }
    let d = dev.lock().unwrap();
    let s = d.stats();
    assert_eq!(
        (s.tx_frames, s.tx_dropped),
        (frames.len() as u64, 0),
        "{s:?}"
    );
    assert!(!d.tx_pending());
    assert!(!d.backend_interest().contains(EventSet::OUT));
    // Every chain went back to the guest.
    drop(d);
    assert_eq!(g.take_used(TX_QUEUE).len(), frames.len());
}

#[test]
fn a_failed_backend_is_dropped_from_the_loop_and_tx_keeps_draining() {
    let (mut g, mut dev) = setup();
    dev.process_backend(EventSet::HANG_UP);
    assert!(dev.backend_interest().is_empty());
    g.post_tx(0, &frame(100, 1), 1);
    dev.process_queue_event(TX_QUEUE);
    assert_eq!(g.take_used(TX_QUEUE), vec![(0, 0)]);
    assert_eq!(dev.stats().tx_dropped, 1);
    assert!(g.host_frames().is_empty());
}

#[test]
fn reset_forgets_the_queues_and_the_backend_interest() {
    let (g, mut dev) = setup();
    assert!(dev.backend_interest().contains(EventSet::IN));
    dev.reset();
    assert!(!dev.is_activated());
    assert!(dev.backend_interest().is_empty());
    assert_eq!(dev.acked_features(), 0);
    // Work after a reset is ignored.
    g.host.send(&frame(100, 1)).unwrap();
    dev.process_queue_event(RX_QUEUE);
    dev.process_queue_event(TX_QUEUE);
    assert_eq!(dev.stats(), NetStats::default());
}

#[test]
fn activation_needs_two_queues() {
    let (a, _b) = UnixDatagram::pair().unwrap();
    let mut d = Net::new(a, MAC, None).unwrap();
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let e = d
        .activate(mem.clone(), vec![queue(&mem, Q_BASE[0])], irq)
        .unwrap_err();
    assert!(e.to_string().contains("needs 2"), "{e}");
    assert!(!d.is_activated());
}

#[test]
fn a_descriptor_that_is_not_a_tap_is_refused() {
    let (a, _b) = UnixDatagram::pair().unwrap();
    let e = Tap::new(a.into()).unwrap_err();
    assert!(e.to_string().contains("TUNGETIFF"), "{e}");
    for bad in ["", "a-name-that-is-too-long", "a/b", "a\0b"] {
        assert!(
            matches!(open_tap(bad), Err(TapError::InvalidName(_))),
            "{bad:?}"
        );
    }
}

/// A small deterministic PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_descriptor_tables_never_panic_and_stay_bounded() {
    let (mut g, mut dev) = setup();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut host_buf = vec![0u8; MAX_BUFFER_SIZE + 100];
    for round in 0..3000u32 {
        let q = (rng.below(2)) as usize;
        // Scribble a few descriptors.
        for _ in 0..1 + rng.below(4) {
            let idx = rng.below(u64::from(QSIZE)) as u16;
            let addr = match rng.below(4) {
                0 => rng.next(),
                1 => MEM_SIZE as u64 - rng.below(4096),
                _ => RX_BUF_BASE + rng.below(0x20_0000),
            };
            let len = match rng.below(4) {
                0 => rng.next() as u32,
                1 => rng.below(70_000) as u32,
                _ => rng.below(3000) as u32,
            };
            let flags = (rng.below(8)) as u16; // NEXT, WRITE, INDIRECT in any mix
            let next = match rng.below(3) {
                0 => rng.next() as u16,
                _ => rng.below(u64::from(QSIZE)) as u16,
            };
            g.write_desc(q, idx, addr, len, flags, next);
        }
        g.make_avail(q, rng.below(u64::from(QSIZE) + 8) as u16);
        if rng.below(3) == 0 {
            let n = 26 + rng.below(3000) as usize;
            let _ = g.host.send(&frame(n, round as u8));
        }
        dev.process_queue_event(q);
        for (id, len) in g.take_used(q) {
            assert!(id < u32::from(QSIZE), "used id {id}");
            if q == TX_QUEUE {
                assert_eq!(len, 0);
            } else {
                assert!(len as usize <= 3026, "rx used len {len}");
            }
        }
        while let Ok(n) = g.host.recv(&mut host_buf) {
            assert!((26..=MAX_BUFFER_SIZE).contains(&n));
        }
    }
    let s = dev.stats();
    assert!(s.tx_bad_chains > 0 && s.rx_bad_chains > 0, "{s:?}");
}

#[test]
fn each_hostile_chain_fails_for_its_own_reason() {
    use super::device::{read_frame, writable_descriptors, ChainError};
    let (mut g, _dev) = setup();
    // A queue of our own, popped by hand.
    let mut q = queue(&g.mem, Q_BASE[TX_QUEUE]);
    let base = TX_BUF_BASE;
    let mem_end = MEM_SIZE as u64;
    type Check = fn(&ChainError) -> bool;
    type Case = (Vec<(u64, u32, u16, u16)>, Check);
    let cases: Vec<Case> = vec![
        (vec![(base, 25, 0, 0)], |e| {
            matches!(e, ChainError::TooShort(25))
        }),
        (vec![(base, 12, F_NEXT, 1), (base, 88, F_WRITE, 0)], |e| {
            matches!(e, ChainError::WritableInTx(1))
        }),
        (vec![(1 << 40, 100, 0, 0)], |e| {
            matches!(e, ChainError::Memory { index: 0, .. })
        }),
        (vec![(mem_end - 50, 100, 0, 0)], |e| {
            matches!(e, ChainError::Memory { index: 0, .. })
        }),
        (vec![(base, 100, F_NEXT, 0)], |e| {
            matches!(e, ChainError::Unterminated)
        }),
        (vec![(base, 100, F_NEXT, 300)], |e| {
            matches!(e, ChainError::Unterminated)
        }),
        (vec![(base, 40_000, F_NEXT, 1), (base, 40_000, 0, 0)], |e| {
            matches!(e, ChainError::TooLong)
        }),
    ];
    let mut buf = vec![0u8; MAX_BUFFER_SIZE];
    for (descs, check) in &cases {
        // Every chain at descriptor 0; a self-reference is a loop.
        post_raw(&mut g, TX_QUEUE, 0, descs);
        let chain = q.pop_descriptor_chain(&g.mem).expect("a chain");
        let e = read_frame(&g.mem, chain, &mut buf).expect_err("refused");
        assert!(check(&e), "{descs:?}: {e}");
    }

    let rx_cases: Vec<Case> = vec![
        (vec![(base, 2048, 0, 0)], |e| {
            matches!(e, ChainError::ReadableInRx(0))
        }),
        (vec![(base, 20, F_WRITE, 0)], |e| {
            matches!(e, ChainError::TooShort(20))
        }),
        (vec![(mem_end - 100, 2048, F_WRITE, 0)], |e| {
            matches!(e, ChainError::OutOfRange { index: 0, .. })
        }),
        (vec![(base, 2048, F_WRITE | F_NEXT, 0)], |e| {
            matches!(e, ChainError::Unterminated)
        }),
    ];
    let mut descs_out = Vec::new();
    for (descs, check) in &rx_cases {
        post_raw(&mut g, TX_QUEUE, 0, descs);
        let chain = q.pop_descriptor_chain(&g.mem).expect("a chain");
        let e = writable_descriptors(&g.mem, chain, &mut descs_out).expect_err("refused");
        assert!(check(&e), "{descs:?}: {e}");
    }
    // A good receive chain lists its pieces and their capacity.
    post_raw(
        &mut g,
        TX_QUEUE,
        0,
        &[
            (base, 12, F_WRITE | F_NEXT, 1),
            (base + 100, 1514, F_WRITE, 0),
        ],
    );
    let chain = q.pop_descriptor_chain(&g.mem).expect("a chain");
    assert_eq!(
        writable_descriptors(&g.mem, chain, &mut descs_out).unwrap(),
        1526
    );
    assert_eq!(
        descs_out,
        vec![(GuestAddress(base), 12), (GuestAddress(base + 100), 1514)]
    );
}
