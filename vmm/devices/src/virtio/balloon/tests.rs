//! Whole-device tests: a simulated driver writes chains into real guest memory
//! (`GuestMemoryMmap`, anonymous private like the VMM's) and the device really drops the pages:
//! `mincore` says they left the host's memory, and they read back as zeros.

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemory as _};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::request::{check_range, RangeError};
use super::*;
use crate::virtio::test_chain::{ro, wr, Buf, TestQueue};
use crate::virtio::{device_type, ActivateError, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::GuestMemory;

/// Two RAM regions with a hole between them, like RAM below and above the MMIO gap.
const LOW_SIZE: u64 = 16 << 20;
const HIGH_BASE: u64 = 32 << 20;
const HIGH_SIZE: u64 = 8 << 20;
const QSIZE: u16 = 64;
/// Queue rings: inflate, deflate, reporting.
const Q_BASES: [u64; NUM_QUEUES] = [0x1_0000, 0x4_0000, 0x7_0000];
/// Where the tests' "free" memory starts.
const FREE: u64 = 0x40_0000;
/// Where inflate/deflate frame-number buffers go.
const PFNS: u64 = 0x20_0000;

struct Guest {
    mem: GuestMemory,
    queues: Vec<TestQueue>,
    irq: Arc<IrqTrigger>,
}

fn memory() -> GuestMemory {
    GuestMemory::from_ranges(&[
        (GuestAddress(0), LOW_SIZE as usize),
        (GuestAddress(HIGH_BASE), HIGH_SIZE as usize),
    ])
    .unwrap()
}

fn setup() -> (Guest, Balloon) {
    let mem = memory();
    let mut dev = Balloon::new(true).unwrap();
    dev.set_acked_features(dev.avail_features());
    let queues: Vec<TestQueue> = Q_BASES
        .iter()
        .map(|b| TestQueue::new(&mem, *b, QSIZE))
        .collect();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    dev.activate(
        mem.clone(),
        queues.iter().map(|q| q.queue(QUEUE_SIZE)).collect(),
        irq.clone(),
    )
    .unwrap();
    (Guest { mem, queues, irq }, dev)
}

impl Guest {
    /// Fills `len` bytes at `addr` with a non-zero pattern (the pages become resident).
    fn fill(&self, addr: u64, len: u64) {
        let v = vec![0xa5u8; len as usize];
        self.mem.write_slice(&v, GuestAddress(addr)).unwrap();
    }

    /// Whether every byte of `addr..addr + len` reads as zero.
    fn zeroed(&self, addr: u64, len: u64) -> bool {
        let mut v = vec![0xffu8; len as usize];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v.iter().all(|b| *b == 0)
    }

    /// Whether every byte of `addr..addr + len` still holds the fill pattern.
    fn kept(&self, addr: u64, len: u64) -> bool {
        let mut v = vec![0u8; len as usize];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v.iter().all(|b| *b == 0xa5)
    }

    /// How many of the host pages behind `addr..addr + len` are resident (`mincore`).
    fn resident_pages(&self, addr: u64, len: u64) -> usize {
        let host = self.mem.get_host_address(GuestAddress(addr)).unwrap();
        let pages = (len / PAGE_SIZE) as usize;
        let mut vec = vec![0u8; pages];
        // SAFETY: `host..host + len` lies inside one mapping of the test's guest memory, which
        // outlives the call; mincore only writes `pages` bytes into `vec`.
        let r = unsafe { libc::mincore(host.cast(), len as usize, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|b| **b & 1 != 0).count()
    }

    /// Puts `bufs` on `queue`, lets the device serve it, and returns the used entries.
    fn send(&mut self, dev: &mut Balloon, queue: usize, bufs: &[Buf]) -> Vec<(u32, u32)> {
        let head = self.queues[queue].add_chain(bufs);
        dev.queue_events()[queue].write(1).unwrap();
        dev.process_queue_event(queue);
        let used = self.queues[queue].take_used();
        assert_eq!(
            used,
            vec![(u32::from(head), 0)],
            "the chain comes back, empty"
        );
        used
    }

    /// Writes page frame numbers at PFNS.
    fn pfns(&self, pfns: &[u32]) -> u32 {
        for (i, p) in pfns.iter().enumerate() {
            self.mem
                .write_obj(p.to_le(), GuestAddress(PFNS + 4 * i as u64))
                .unwrap();
        }
        4 * pfns.len() as u32
    }
}

#[test]
fn offers_version_1_and_reporting_only_when_asked() {
    let dev = Balloon::new(true).unwrap();
    assert_eq!(dev.device_type(), device_type::BALLOON);
    assert_eq!(dev.device_type(), 5);
    assert_eq!(
        dev.avail_features(),
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_BALLOON_F_REPORTING)
    );
    assert_eq!(dev.queue_max_sizes(), &[QUEUE_SIZE; 3]);
    let plain = Balloon::new(false).unwrap();
    assert_eq!(plain.avail_features(), 1 << VIRTIO_F_VERSION_1);
}

#[test]
fn the_reporting_queue_exists_only_when_negotiated() {
    let mem = memory();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let qs = |n: usize| -> Vec<_> {
        Q_BASES[..n]
            .iter()
            .map(|b| TestQueue::new(&mem, *b, QSIZE).queue(QUEUE_SIZE))
            .collect()
    };

    let mut dev = Balloon::new(true).unwrap();
    dev.set_acked_features(1 << VIRTIO_F_VERSION_1);
    assert!(!dev.reporting());
    assert_eq!(dev.queues_in_use(), 2);
    match dev.activate(mem.clone(), qs(3), irq.clone()) {
        Err(ActivateError::QueueCount { want: 2, got: 3 }) => {}
        other => panic!("3 queues without REPORTING: {other:?}"),
    }
    dev.activate(mem.clone(), qs(2), irq.clone()).unwrap();
    assert!(dev.is_activated());

    dev.reset();
    assert!(!dev.is_activated());
    dev.set_acked_features(dev.avail_features());
    assert!(dev.reporting());
    assert_eq!(dev.queues_in_use(), 3);
    assert!(dev.activate(mem.clone(), qs(2), irq.clone()).is_err());
    dev.activate(mem.clone(), qs(3), irq).unwrap();
}

#[test]
fn config_has_num_pages_zero_and_keeps_the_drivers_actual() {
    let mut dev = Balloon::new(true).unwrap();
    let mut b = [0xffu8; 8];
    dev.read_config(0, &mut b);
    assert_eq!(b, [0; 8]);
    dev.write_config(4, &7u32.to_le_bytes());
    let mut a = [0u8; 4];
    dev.read_config(4, &mut a);
    assert_eq!(u32::from_le_bytes(a), 7);
    // num_pages is the host's; partial or out-of-range writes change nothing.
    dev.write_config(0, &9u32.to_le_bytes());
    dev.write_config(4, &[1, 2]);
    dev.write_config(u64::MAX, &[1, 2, 3, 4]);
    dev.read_config(0, &mut b);
    assert_eq!(&b[..4], &[0; 4]);
    assert_eq!(u32::from_le_bytes(b[4..].try_into().unwrap()), 7);
    // Past the end reads zero, even at an offset that overflows.
    let mut far = [0xffu8; 4];
    dev.read_config(u64::MAX - 1, &mut far);
    assert_eq!(far, [0; 4]);
    dev.reset();
    dev.read_config(4, &mut a);
    assert_eq!(a, [0; 4]);
}

#[test]
fn a_report_drops_the_host_pages_of_each_block_and_nothing_else() {
    let (mut g, mut dev) = setup();
    let block = 2 << 20;
    g.fill(FREE, 3 * block);
    g.fill(HIGH_BASE, 1 << 20);
    assert_eq!(
        g.resident_pages(FREE, 3 * block),
        (3 * block / PAGE_SIZE) as usize
    );

    // Two blocks of the low region and one of the high, in one report; the middle block stays.
    g.send(
        &mut dev,
        REPORTING_QUEUE,
        &[
            wr(FREE, block as u32),
            wr(FREE + 2 * block, block as u32),
            wr(HIGH_BASE, 1 << 20),
        ],
    );
    assert_eq!(g.resident_pages(FREE, block), 0, "first block dropped");
    assert_eq!(g.resident_pages(FREE + 2 * block, block), 0);
    assert_eq!(g.resident_pages(HIGH_BASE, 1 << 20), 0);
    assert_eq!(
        g.resident_pages(FREE + block, block),
        (block / PAGE_SIZE) as usize,
        "the block between them stays"
    );
    assert!(g.zeroed(FREE, block) && g.zeroed(FREE + 2 * block, block));
    assert!(g.zeroed(HIGH_BASE, 1 << 20));
    assert!(g.kept(FREE + block, block));
    let s = dev.stats();
    assert_eq!(s.reports, 1);
    assert_eq!(s.reported_bytes, 2 * block + (1 << 20));
    assert_eq!(s.refused, 0);
    assert!(g.irq.status() & crate::virtio::INT_VRING != 0);
}

#[test]
fn reports_outside_memory_are_refused_and_returned() {
    let (mut g, mut dev) = setup();
    g.fill(FREE, 1 << 20);
    let cases: &[(&str, Buf)] = &[
        ("past the end of RAM", wr(HIGH_BASE + HIGH_SIZE, 0x1000)),
        ("in the hole between regions", wr(LOW_SIZE, 0x1000)),
        (
            "across the end of the low region",
            wr(LOW_SIZE - 0x1000, 0x2000),
        ),
        (
            "across the end of the high region",
            wr(HIGH_BASE + HIGH_SIZE - 0x1000, 0x2000),
        ),
        ("at the top of the address space", wr(!0xfff_u64, 0x1000)),
    ];
    for (i, (what, buf)) in cases.iter().enumerate() {
        g.send(&mut dev, REPORTING_QUEUE, &[*buf]);
        assert_eq!(dev.stats().refused, i as u64 + 1, "{what}");
    }
    assert_eq!(dev.stats().reported_bytes, 0);
    // The last page of the low region is still there.
    assert!(g.mem.read_obj::<u8>(GuestAddress(LOW_SIZE - 1)).is_ok());
    assert!(g.kept(FREE, 1 << 20));
}

#[test]
fn overflowing_ranges_are_refused_without_panic() {
    let mem = memory();
    let top = !0xfff_u64;
    assert_eq!(
        check_range(&mem, top, 0x2000),
        Err(RangeError::Overflow {
            addr: top,
            len: 0x2000
        })
    );
    assert_eq!(
        check_range(&mem, top, MAX_RANGE_LEN),
        Err(RangeError::Overflow {
            addr: top,
            len: MAX_RANGE_LEN
        })
    );
    // A frame number whose address would pass 4 GiB * 4 KiB is still just outside memory.
    let (mut g, mut dev) = setup();
    let n = g.pfns(&[u32::MAX]);
    g.send(&mut dev, INFLATE_QUEUE, &[ro(PFNS, n)]);
    assert_eq!(dev.stats().refused, 1);
}

#[test]
fn zero_unaligned_and_too_long_ranges_are_refused() {
    let mem = memory();
    assert_eq!(check_range(&mem, FREE, 0), Err(RangeError::BadLength(0)));
    assert_eq!(
        check_range(&mem, FREE, MAX_RANGE_LEN + PAGE_SIZE),
        Err(RangeError::BadLength(MAX_RANGE_LEN + PAGE_SIZE))
    );
    assert!(matches!(
        check_range(&mem, FREE + 0x800, 0x1000),
        Err(RangeError::Unaligned { .. })
    ));
    assert!(matches!(
        check_range(&mem, FREE, 0x1800),
        Err(RangeError::Unaligned { .. })
    ));
    assert!(check_range(&mem, FREE, 0x1000).is_ok());
    assert!(check_range(&mem, 0, LOW_SIZE).is_ok(), "a whole region");

    let (mut g, mut dev) = setup();
    g.fill(FREE, 0x4000);
    g.send(
        &mut dev,
        REPORTING_QUEUE,
        &[wr(FREE, 0), wr(FREE + 0x800, 0x1000), wr(FREE, 0x1800)],
    );
    assert_eq!(dev.stats().refused, 3);
    assert!(g.kept(FREE, 0x4000));
    // A zero-length and a good block in one report: the good one is still dropped.
    g.send(&mut dev, REPORTING_QUEUE, &[wr(FREE, 0), wr(FREE, 0x2000)]);
    assert_eq!(dev.stats().refused, 4);
    assert!(g.zeroed(FREE, 0x2000) && g.kept(FREE + 0x2000, 0x2000));
}

#[test]
fn a_report_the_device_may_not_write_is_refused() {
    let (mut g, mut dev) = setup();
    g.fill(FREE, 0x4000);
    g.send(&mut dev, REPORTING_QUEUE, &[ro(FREE, 0x4000)]);
    assert_eq!(dev.stats().refused, 1);
    assert_eq!(dev.stats().reported_bytes, 0);
    assert!(g.kept(FREE, 0x4000));
    // Inflate buffers are the other way round: a device-writable one is refused.
    let n = g.pfns(&[(FREE / PAGE_SIZE) as u32]);
    g.send(&mut dev, INFLATE_QUEUE, &[wr(PFNS, n)]);
    assert_eq!(dev.stats().refused, 2);
    assert!(g.kept(FREE, 0x4000));
}

#[test]
fn inflate_drops_the_listed_pages_and_deflate_changes_nothing() {
    let (mut g, mut dev) = setup();
    g.fill(FREE, 0x4000);
    let first = (FREE / PAGE_SIZE) as u32;
    let high = (HIGH_BASE / PAGE_SIZE) as u32;
    g.fill(HIGH_BASE, 0x1000);
    let n = g.pfns(&[first, first + 2, high, (LOW_SIZE / PAGE_SIZE) as u32]);
    g.send(&mut dev, INFLATE_QUEUE, &[ro(PFNS, n)]);
    let s = dev.stats();
    assert_eq!(s.inflated_bytes, 3 * PAGE_SIZE);
    assert_eq!(s.refused, 1, "the frame in the hole");
    assert!(g.zeroed(FREE, 0x1000) && g.zeroed(FREE + 0x2000, 0x1000));
    assert!(g.kept(FREE + 0x1000, 0x1000) && g.kept(FREE + 0x3000, 0x1000));
    assert!(g.zeroed(HIGH_BASE, 0x1000));

    g.fill(FREE, 0x4000);
    let n = g.pfns(&[first, first + 1]);
    g.send(&mut dev, DEFLATE_QUEUE, &[ro(PFNS, n)]);
    assert!(g.kept(FREE, 0x4000));
    assert_eq!(dev.stats().inflated_bytes, 3 * PAGE_SIZE);
}

#[test]
fn bad_frame_number_buffers_are_refused() {
    let (mut g, mut dev) = setup();
    g.fill(FREE, 0x2000);
    let first = (FREE / PAGE_SIZE) as u32;
    g.pfns(&[first, first + 1]);
    // Not a whole number of entries.
    g.send(&mut dev, INFLATE_QUEUE, &[ro(PFNS, 6)]);
    assert_eq!(dev.stats().refused, 1);
    // Outside guest memory.
    g.send(&mut dev, INFLATE_QUEUE, &[ro(HIGH_BASE + HIGH_SIZE, 8)]);
    assert_eq!(dev.stats().refused, 2);
    // More than MAX_PFN_BUFFER bytes in one chain: the whole chain is refused, even the
    // frames of its first, good descriptor.
    g.send(
        &mut dev,
        INFLATE_QUEUE,
        &[ro(PFNS, MAX_PFN_BUFFER as u32), ro(PFNS, 4)],
    );
    assert_eq!(dev.stats().refused, 3);
    assert!(g.kept(FREE, 0x2000));
    assert_eq!(dev.stats().inflated_bytes, 0);
}

#[test]
fn a_full_queue_is_served_in_turns_and_every_chain_returns() {
    let (mut g, mut dev) = setup();
    g.fill(FREE, u64::from(QSIZE) * PAGE_SIZE);
    let q = REPORTING_QUEUE;
    let mut heads = Vec::new();
    for i in 0..u64::from(QSIZE) {
        heads.push(g.queues[q].add_chain(&[wr(FREE + i * PAGE_SIZE, PAGE_SIZE as u32)]));
    }
    dev.process_queue(q);
    let used = g.queues[q].take_used();
    let used_heads: Vec<u32> = used.iter().map(|(h, _)| *h).collect();
    assert_eq!(
        used_heads,
        heads.iter().map(|h| u32::from(*h)).collect::<Vec<_>>()
    );
    assert_eq!(dev.stats().reports, u64::from(QSIZE));
    assert!(g.zeroed(FREE, u64::from(QSIZE) * PAGE_SIZE));
}

#[test]
fn nothing_is_served_before_activation_or_after_reset() {
    let mut dev = Balloon::new(true).unwrap();
    dev.process_queue(REPORTING_QUEUE);
    dev.process_queue(99);
    let (mut g, mut dev) = setup();
    g.fill(FREE, 0x1000);
    dev.reset();
    g.queues[REPORTING_QUEUE].add_chain(&[wr(FREE, 0x1000)]);
    dev.process_queue(REPORTING_QUEUE);
    assert!(g.queues[REPORTING_QUEUE].take_used().is_empty());
    assert!(g.kept(FREE, 0x1000));
}

/// The driver's side of virtio-mmio, as Linux's does it: negotiate `features`, set up `queues`
/// queues (only the present ones), DRIVER_OK. Returns the device status register.
fn mmio_bring_up(features: u64, queues: usize) -> (u32, std::sync::Arc<std::sync::Mutex<Balloon>>) {
    use crate::bus::BusDevice;
    use crate::virtio::mmio::{reg, status, MmioTransport};
    let mem = memory();
    let dev = std::sync::Arc::new(std::sync::Mutex::new(Balloon::new(true).unwrap()));
    let mut t = MmioTransport::new(dev.clone(), mem).unwrap();
    let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
    let r = |t: &mut MmioTransport, off: u64| {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    };
    assert_eq!(r(&mut t, reg::DEVICE_ID), 5);
    w(&mut t, reg::STATUS, status::ACKNOWLEDGE);
    w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
    for sel in 0..2u32 {
        w(&mut t, reg::DRIVER_FEATURES_SEL, sel);
        w(
            &mut t,
            reg::DRIVER_FEATURES,
            (features >> (32 * sel)) as u32,
        );
    }
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
    w(&mut t, reg::STATUS, s);
    assert_eq!(r(&mut t, reg::STATUS), s, "features accepted");
    for (i, base) in Q_BASES.iter().take(queues).enumerate() {
        w(&mut t, reg::QUEUE_SEL, i as u32);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), u32::from(QUEUE_SIZE));
        w(&mut t, reg::QUEUE_NUM, u32::from(QSIZE));
        w(&mut t, reg::QUEUE_DESC_LOW, *base as u32);
        w(&mut t, reg::QUEUE_DRIVER_LOW, (*base + 0x1000) as u32);
        w(&mut t, reg::QUEUE_DEVICE_LOW, (*base + 0x2000) as u32);
        w(&mut t, reg::QUEUE_READY, 1);
    }
    w(&mut t, reg::STATUS, s | status::DRIVER_OK);
    (r(&mut t, reg::STATUS), dev)
}

#[test]
fn over_virtio_mmio_the_driver_sets_up_the_queues_its_features_make_present() {
    use crate::virtio::mmio::status;
    let version_1 = 1u64 << VIRTIO_F_VERSION_1;
    let reporting = 1u64 << VIRTIO_BALLOON_F_REPORTING;
    // REPORTING negotiated: three queues.
    let (s, dev) = mmio_bring_up(version_1 | reporting, 3);
    assert_eq!(s & status::DEVICE_NEEDS_RESET, 0);
    assert!(dev.lock().unwrap().is_activated() && dev.lock().unwrap().reporting());
    // Without it the driver sets up inflate and deflate only, and the device activates.
    let (s, dev) = mmio_bring_up(version_1, 2);
    assert_eq!(s & status::DEVICE_NEEDS_RESET, 0);
    assert!(dev.lock().unwrap().is_activated() && !dev.lock().unwrap().reporting());
    // REPORTING negotiated but its queue left out: refused, not activated.
    let (s, dev) = mmio_bring_up(version_1 | reporting, 2);
    assert_ne!(s & status::DEVICE_NEEDS_RESET, 0);
    assert!(!dev.lock().unwrap().is_activated());
}
