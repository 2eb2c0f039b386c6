//! Whole-device tests: a simulated driver writes request chains into real guest memory
//! (`GuestMemoryMmap`) and the disk is a real temporary file.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::virtio::test_chain::{ro, wr, Buf, TestQueue, F_NEXT, F_WRITE};
use crate::virtio::{device_type, IrqTrigger, VirtioDevice, INT_CONFIG, VIRTIO_F_VERSION_1};
use crate::GuestMemory;

const MEM_SIZE: usize = 16 << 20;
const Q_BASE: u64 = 0x1_0000;
const QSIZE: u16 = 64;
const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x30_0000;
/// Disk size of the tests: 1 MiB.
const DISK_SECTORS: u64 = 2048;

struct Guest {
    q: TestQueue,
    irq: Arc<IrqTrigger>,
    /// The host file (same open file description as the device's).
    file: File,
}

fn disk_file() -> File {
    let mut f = tempfile::tempfile().unwrap();
    let pattern: Vec<u8> = (0..DISK_SECTORS * SECTOR_SIZE)
        .map(|i| (i % 251) as u8)
        .collect();
    f.write_all(&pattern).unwrap();
    f
}

fn setup_with(file: Option<File>, access: Access) -> (Guest, Block) {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    let q = TestQueue::new(&mem, Q_BASE, QSIZE);
    let mut dev = Block::new("test-disk".into(), file, access).unwrap();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    dev.set_acked_features(dev.avail_features());
    dev.activate(mem, vec![q.queue(QUEUE_SIZE)], irq.clone())
        .unwrap();
    let file = tempfile::tempfile().unwrap();
    (Guest { q, irq, file }, dev)
}

fn setup(access: Access) -> (Guest, Block) {
    let f = disk_file();
    let ours = f.try_clone().unwrap();
    let (mut g, dev) = setup_with(Some(f), access);
    g.file = ours;
    (g, dev)
}

impl Guest {
    fn header(&self, type_: u32, sector: u64) {
        self.q
            .mem
            .write_obj(type_.to_le(), GuestAddress(HDR))
            .unwrap();
        self.q.mem.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        self.q
            .mem
            .write_obj(sector.to_le(), GuestAddress(HDR + 8))
            .unwrap();
        self.q.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    /// Sends header + `data` + status, runs the device, returns (status byte, used length).
    fn request(&mut self, dev: &mut Block, type_: u32, sector: u64, data: &[Buf]) -> (u8, u32) {
        self.header(type_, sector);
        let mut chain = vec![ro(HDR, 16)];
        chain.extend_from_slice(data);
        chain.push(wr(STATUS, 1));
        self.send(dev, &chain)
    }

    /// Sends a raw chain; returns (status byte at STATUS, used length).
    fn send(&mut self, dev: &mut Block, chain: &[Buf]) -> (u8, u32) {
        let head = self.q.add_chain(chain);
        dev.process_queue();
        let used = self.q.take_used();
        assert_eq!(used.len(), 1, "one chain returned");
        assert_eq!(used[0].0, u32::from(head));
        (self.status(), used[0].1)
    }

    fn status(&self) -> u8 {
        self.q.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    fn disk_bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.file.read_exact_at(&mut b, offset).unwrap();
        b
    }
}

fn expected(offset: u64, len: usize) -> Vec<u8> {
    (offset..offset + len as u64)
        .map(|i| (i % 251) as u8)
        .collect()
}

fn config(dev: &Block) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    dev.read_config(0, &mut c);
    c
}

fn u32_at(c: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(c[off..off + 4].try_into().unwrap())
}

#[test]
fn config_space_and_features() {
    let (_g, dev) = setup(Access::ReadWrite);
    assert_eq!(dev.device_type(), device_type::BLOCK);
    assert_eq!(dev.queue_max_sizes(), &[QUEUE_SIZE]);
    let c = config(&dev);
    assert_eq!(
        u64::from_le_bytes(c[0..8].try_into().unwrap()),
        DISK_SECTORS
    );
    assert_eq!(u32_at(&c, 8), SIZE_MAX);
    assert_eq!(u32_at(&c, 12), SEG_MAX);
    assert_eq!(u32_at(&c, 20), 512);
    assert_eq!(u32_at(&c, 36), MAX_DISCARD_SECTORS);
    assert_eq!(u32_at(&c, 40), 1);
    assert_eq!(u32_at(&c, 48), MAX_DISCARD_SECTORS);
    let f = dev.avail_features();
    for bit in [
        VIRTIO_F_VERSION_1,
        feature::SIZE_MAX,
        feature::SEG_MAX,
        feature::BLK_SIZE,
        feature::FLUSH,
        feature::DISCARD,
        feature::WRITE_ZEROES,
    ] {
        assert_ne!(f & (1 << bit), 0, "feature {bit}");
    }
    assert_eq!(f & (1 << feature::RO), 0);
    // A partial read past the end reads zeroes, never panics.
    let mut tail = [0xaau8; 8];
    dev.read_config(56, &mut tail);
    assert_eq!(tail, [0; 8]);
    dev.read_config(u64::MAX, &mut tail);

    let (_g, ro_dev) = setup(Access::ReadOnly);
    let f = ro_dev.avail_features();
    assert_ne!(f & (1 << feature::RO), 0);
    assert_eq!(f & (1 << feature::DISCARD | 1 << feature::WRITE_ZEROES), 0);
}

#[test]
fn reads_and_writes_sectors_over_several_segments() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    // Read sectors 3..6 into two segments (512 + 1024 bytes).
    let (st, len) = g.request(
        &mut dev,
        req_type::IN,
        3,
        &[wr(DATA, 512), wr(DATA + 0x1_0000, 1024)],
    );
    assert_eq!((st, len), (status::OK, 512 + 1024 + 1));
    let mut got = vec![0u8; 512];
    g.q.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, expected(3 * 512, 512));
    let mut got = vec![0u8; 1024];
    g.q.mem
        .read_slice(&mut got, GuestAddress(DATA + 0x1_0000))
        .unwrap();
    assert_eq!(got, expected(4 * 512, 1024));

    // Write sectors 10..12 from two segments; the host file has them.
    g.q.mem
        .write_slice(&[0x11; 512], GuestAddress(DATA))
        .unwrap();
    g.q.mem
        .write_slice(&[0x22; 512], GuestAddress(DATA + 0x1_0000))
        .unwrap();
    let (st, len) = g.request(
        &mut dev,
        req_type::OUT,
        10,
        &[ro(DATA, 512), ro(DATA + 0x1_0000, 512)],
    );
    assert_eq!((st, len), (status::OK, 1));
    assert_eq!(g.disk_bytes(10 * 512, 512), vec![0x11; 512]);
    assert_eq!(g.disk_bytes(11 * 512, 512), vec![0x22; 512]);
    assert_eq!(g.disk_bytes(12 * 512, 512), expected(12 * 512, 512));
    // The last sector is reachable, one past it is not.
    let (st, _) = g.request(&mut dev, req_type::IN, DISK_SECTORS - 1, &[wr(DATA, 512)]);
    assert_eq!(st, status::OK);
    let (st, len) = g.request(&mut dev, req_type::IN, DISK_SECTORS, &[wr(DATA, 512)]);
    assert_eq!((st, len), (status::IOERR, 1));

    let s = dev.stats();
    assert_eq!(s.read_bytes, 1536 + 512);
    assert_eq!(s.write_bytes, 1024);
    assert_eq!(s.requests, 4);
    assert_eq!(s.errors, 1);
}

#[test]
fn flush_and_get_id() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    let (st, len) = g.request(&mut dev, req_type::FLUSH, 0, &[]);
    assert_eq!((st, len), (status::OK, 1));
    g.q.mem
        .write_slice(&[0xee; 32], GuestAddress(DATA))
        .unwrap();
    let (st, len) = g.request(&mut dev, req_type::GET_ID, 0, &[wr(DATA, 32)]);
    assert_eq!((st, len), (status::OK, 21));
    let mut id = [0u8; 32];
    g.q.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..9], b"test-disk");
    assert_eq!(&id[9..20], &[0; 11]);
    assert_eq!(&id[20..], &[0xee; 12], "nothing past 20 bytes");
    // A buffer shorter than 20 bytes gets a truncated id.
    let (st, len) = g.request(&mut dev, req_type::GET_ID, 0, &[wr(DATA, 4)]);
    assert_eq!((st, len), (status::OK, 5));
    assert!(Block::new("x".repeat(21), None, Access::ReadWrite).is_err());
}

fn range_desc(g: &Guest, sector: u64, num: u32, flags: u32) {
    let mut raw = [0u8; 16];
    raw[0..8].copy_from_slice(&sector.to_le_bytes());
    raw[8..12].copy_from_slice(&num.to_le_bytes());
    raw[12..16].copy_from_slice(&flags.to_le_bytes());
    g.q.mem.write_slice(&raw, GuestAddress(DATA)).unwrap();
}

#[test]
fn discard_and_write_zeroes_zero_the_range() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    range_desc(&g, 16, 16, 0);
    let (st, _) = g.request(&mut dev, req_type::DISCARD, 0, &[ro(DATA, 16)]);
    assert_eq!(st, status::OK);
    assert_eq!(g.disk_bytes(16 * 512, 16 * 512), vec![0; 16 * 512]);
    assert_eq!(g.disk_bytes(32 * 512, 512), expected(32 * 512, 512));

    range_desc(&g, 100, 3, 1);
    let (st, _) = g.request(&mut dev, req_type::WRITE_ZEROES, 0, &[ro(DATA, 16)]);
    assert_eq!(st, status::OK);
    assert_eq!(g.disk_bytes(100 * 512, 3 * 512), vec![0; 3 * 512]);
    assert_eq!(g.disk_bytes(103 * 512, 512), expected(103 * 512, 512));
    // The file keeps its size.
    assert_eq!(g.file.metadata().unwrap().len(), DISK_SECTORS * 512);

    // Out of range, flags on discard, two segments, too many sectors.
    range_desc(&g, DISK_SECTORS - 1, 2, 0);
    assert_eq!(
        g.request(&mut dev, req_type::DISCARD, 0, &[ro(DATA, 16)]).0,
        status::IOERR
    );
    range_desc(&g, 0, 1, 1);
    assert_eq!(
        g.request(&mut dev, req_type::DISCARD, 0, &[ro(DATA, 16)]).0,
        status::UNSUPP
    );
    assert_eq!(
        g.request(&mut dev, req_type::DISCARD, 0, &[ro(DATA, 32)]).0,
        status::UNSUPP
    );
    range_desc(&g, 0, MAX_DISCARD_SECTORS + 1, 0);
    assert_eq!(
        g.request(&mut dev, req_type::WRITE_ZEROES, 0, &[ro(DATA, 16)])
            .0,
        status::UNSUPP
    );
}

#[test]
fn read_only_disk_refuses_writes() {
    let (mut g, mut dev) = setup(Access::ReadOnly);
    g.q.mem
        .write_slice(&[0x11; 512], GuestAddress(DATA))
        .unwrap();
    let (st, len) = g.request(&mut dev, req_type::OUT, 0, &[ro(DATA, 512)]);
    assert_eq!((st, len), (status::IOERR, 1));
    range_desc(&g, 0, 1, 0);
    for t in [req_type::DISCARD, req_type::WRITE_ZEROES] {
        assert_eq!(g.request(&mut dev, t, 0, &[ro(DATA, 16)]).0, status::IOERR);
    }
    assert_eq!(g.disk_bytes(0, 1024), expected(0, 1024));
    let (st, _) = g.request(&mut dev, req_type::IN, 0, &[wr(DATA, 512)]);
    assert_eq!(st, status::OK);
    assert_eq!(dev.stats().errors, 3);
}

#[test]
fn hostile_chains_get_an_error_status_and_come_back() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    let mut errors = 0;
    let mut bad = |g: &mut Guest, dev: &mut Block, chain: &[Buf], want: (u8, u32)| {
        g.q.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        assert_eq!(g.send(dev, chain), want, "chain {chain:?}");
        errors += 1;
        assert_eq!(dev.stats().errors, errors);
    };
    g.header(req_type::IN, 0);
    // Status only, no header.
    bad(&mut g, &mut dev, &[wr(STATUS, 1)], (status::IOERR, 1));
    // Header writable.
    bad(
        &mut g,
        &mut dev,
        &[wr(HDR, 16), wr(STATUS, 1)],
        (status::IOERR, 1),
    );
    // Header too short.
    bad(
        &mut g,
        &mut dev,
        &[ro(HDR, 8), wr(STATUS, 1)],
        (status::IOERR, 1),
    );
    // Header outside guest memory.
    bad(
        &mut g,
        &mut dev,
        &[ro(MEM_SIZE as u64 - 8, 16), wr(STATUS, 1)],
        (status::IOERR, 1),
    );
    // Status not writable: nothing written, chain returned with 0 bytes.
    bad(&mut g, &mut dev, &[ro(HDR, 16), ro(STATUS, 1)], (0xff, 0));
    // Status outside guest memory.
    bad(
        &mut g,
        &mut dev,
        &[ro(HDR, 16), wr(MEM_SIZE as u64, 1)],
        (0xff, 0),
    );
    // A read into a read-only segment.
    bad(
        &mut g,
        &mut dev,
        &[ro(HDR, 16), ro(DATA, 512), wr(STATUS, 1)],
        (status::IOERR, 1),
    );
    // A data segment past the end of memory, one overflowing the address space, one too long.
    for seg in [
        wr(MEM_SIZE as u64 - 256, 512),
        wr(u64::MAX - 100, 512),
        wr(DATA, SIZE_MAX + 512),
        wr(DATA, 0),
    ] {
        bad(
            &mut g,
            &mut dev,
            &[ro(HDR, 16), seg, wr(STATUS, 1)],
            (status::IOERR, 1),
        );
    }
    // Not a whole number of sectors.
    bad(
        &mut g,
        &mut dev,
        &[ro(HDR, 16), wr(DATA, 100), wr(STATUS, 1)],
        (status::IOERR, 1),
    );
    // sector * 512 overflows; sector + length past the end.
    for sector in [u64::MAX, u64::MAX / 512, DISK_SECTORS - 1] {
        g.header(req_type::IN, sector);
        bad(
            &mut g,
            &mut dev,
            &[ro(HDR, 16), wr(DATA, 1024), wr(STATUS, 1)],
            (status::IOERR, 1),
        );
    }
    // An unknown type.
    g.header(7, 0);
    bad(
        &mut g,
        &mut dev,
        &[ro(HDR, 16), wr(STATUS, 1)],
        (status::UNSUPP, 1),
    );
    // Nothing was read into DATA by any of them.
    let mut b = [0u8; 4];
    g.q.mem.read_slice(&mut b, GuestAddress(DATA)).unwrap();
    assert_eq!(b, [0; 4]);
    // And the device still works.
    let (st, _) = g.request(&mut dev, req_type::IN, 0, &[wr(DATA, 512)]);
    assert_eq!(st, status::OK);
}

#[test]
fn looping_and_overlong_chains_end() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    g.header(req_type::IN, 0);
    // 0 -> 1 -> 0 ...: virtio-queue ends it; the last descriptor seen is not the status byte
    // in the right place, so nothing is read and the chain comes back.
    g.q.write_desc(0, HDR, 16, F_NEXT, 1);
    g.q.write_desc(1, DATA, 512, F_NEXT | F_WRITE, 0);
    g.q.make_avail(0);
    dev.process_queue();
    let used = g.q.take_used();
    assert_eq!(used.len(), 1);
    assert_eq!(dev.stats().errors, 1);
    assert_eq!(dev.stats().read_bytes, 0);
    // A descriptor pointing past the table.
    g.q.write_desc(2, HDR, 16, F_NEXT, 1000);
    g.q.make_avail(2);
    dev.process_queue();
    assert_eq!(g.q.take_used().len(), 1);
    assert_eq!(dev.stats().errors, 2);
}

#[test]
fn a_full_queue_is_served_in_bounded_batches() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    g.header(req_type::FLUSH, 0);
    for _ in 0..QSIZE / 2 {
        g.q.add_chain(&[ro(HDR, 16), wr(STATUS, 1)]);
    }
    dev.process_queue();
    assert_eq!(g.q.take_used().len(), usize::from(QSIZE / 2));
    assert_eq!(dev.stats().errors, 0);
}

#[test]
fn empty_slot_attach_and_detach_change_the_capacity() {
    let (mut g, mut dev) = setup_with(None, Access::ReadWrite);
    assert_eq!(dev.capacity(), 0);
    assert_eq!(
        u64::from_le_bytes(config(&dev)[0..8].try_into().unwrap()),
        0
    );
    let (st, _) = g.request(&mut dev, req_type::IN, 0, &[wr(DATA, 512)]);
    assert_eq!(st, status::IOERR);
    assert!(matches!(dev.detach(), Err(BlockError::SlotEmpty)));
    let gen0 = dev.config_generation();

    let f = disk_file();
    let host = f.try_clone().unwrap();
    dev.attach("hot-1".into(), f).unwrap();
    assert_eq!(dev.capacity(), DISK_SECTORS);
    assert_eq!(
        u64::from_le_bytes(config(&dev)[0..8].try_into().unwrap()),
        DISK_SECTORS
    );
    assert_ne!(dev.config_generation(), gen0);
    assert_ne!(g.irq.status() & INT_CONFIG, 0, "config interrupt raised");
    g.irq.ack(INT_CONFIG);
    assert!(matches!(
        dev.attach("x".into(), disk_file()),
        Err(BlockError::SlotOccupied)
    ));
    g.q.mem
        .write_slice(&[0x5a; 512], GuestAddress(DATA))
        .unwrap();
    let (st, _) = g.request(&mut dev, req_type::OUT, 5, &[ro(DATA, 512)]);
    assert_eq!(st, status::OK);
    let mut b = vec![0u8; 512];
    host.read_exact_at(&mut b, 5 * 512).unwrap();
    assert_eq!(b, vec![0x5a; 512]);
    let (st, _) = g.request(&mut dev, req_type::GET_ID, 0, &[wr(DATA, 20)]);
    assert_eq!(st, status::OK);
    let mut id = [0u8; 5];
    g.q.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"hot-1");

    let gen1 = dev.config_generation();
    dev.detach().unwrap();
    assert_eq!(dev.capacity(), 0);
    assert_ne!(dev.config_generation(), gen1);
    assert_ne!(g.irq.status() & INT_CONFIG, 0);
    let (st, _) = g.request(&mut dev, req_type::IN, 0, &[wr(DATA, 512)]);
    assert_eq!(st, status::IOERR);
}

#[test]
fn a_short_file_hides_its_partial_sector_and_rejects_non_disks() {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&[1u8; 1000]).unwrap();
    let dev = Block::new("s".into(), Some(f), Access::ReadWrite).unwrap();
    assert_eq!(dev.capacity(), 1);
    let dir = File::open(std::env::temp_dir()).unwrap();
    assert!(matches!(
        Block::new("d".into(), Some(dir), Access::ReadOnly),
        Err(BlockError::Backing(BackingError::NotADisk))
    ));
    let (r, _w) = std::os::unix::net::UnixStream::pair().unwrap();
    let sock = File::from(std::os::fd::OwnedFd::from(r));
    assert!(Block::new("p".into(), Some(sock), Access::ReadOnly).is_err());
}

#[test]
fn works_under_the_event_manager() {
    let (mut g, dev) = setup(Access::ReadWrite);
    let dev = Arc::new(Mutex::new(dev));
    let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
        EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    g.header(req_type::IN, 1);
    g.q.add_chain(&[ro(HDR, 16), wr(DATA, 512), wr(STATUS, 1)]);
    dev.lock().unwrap().queue_events()[0].write(1).unwrap();
    em.run_with_timeout(1000).unwrap();
    assert_eq!(g.q.take_used(), vec![(0, 513)]);
    assert_eq!(g.status(), status::OK);
    let mut got = vec![0u8; 512];
    g.q.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, expected(512, 512));
    let mut f = g.file.try_clone().unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut first = [0u8; 4];
    f.read_exact(&mut first).unwrap();
    assert_eq!(first, [0, 1, 2, 3]);
}

/// xorshift64*, seeded: reproducible pseudo-random guest behaviour.
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
fn random_chains_never_panic_and_always_come_back() {
    let (mut g, mut dev) = setup(Access::ReadWrite);
    let mut rng = Rng(0x5eed_b10c);
    let types = [
        req_type::IN,
        req_type::OUT,
        req_type::FLUSH,
        req_type::GET_ID,
        req_type::DISCARD,
        req_type::WRITE_ZEROES,
        3,
        u32::MAX,
    ];
    let mut sent = 0usize;
    let mut returned = 0usize;
    for round in 0..3000 {
        // A random header: a real or random type, a sector near the end or anywhere.
        let t = types[rng.below(types.len() as u64) as usize];
        let sector = match rng.below(3) {
            0 => rng.below(DISK_SECTORS + 4),
            1 => DISK_SECTORS - rng.below(4),
            _ => rng.next(),
        };
        g.header(t, sector);
        range_desc(&g, rng.below(DISK_SECTORS + 8), rng.next() as u32 % 64, 0);
        let n = 1 + rng.below(5) as usize;
        let chain: Vec<Buf> = (0..n)
            .map(|i| {
                let addr = match rng.below(4) {
                    0 if i == 0 => HDR,
                    0 => DATA,
                    1 => STATUS,
                    2 => rng.below(MEM_SIZE as u64 + 0x1000),
                    _ => rng.next(),
                };
                let len = match rng.below(4) {
                    0 => 512 * (1 + rng.below(4) as u32),
                    1 => 16,
                    2 => 1,
                    _ => rng.next() as u32,
                };
                Buf {
                    addr,
                    len,
                    writable: rng.below(2) == 0,
                }
            })
            .collect();
        g.q.add_chain(&chain);
        sent += 1;
        // Sometimes a raw loop or a wild `next` instead.
        if round % 97 == 0 {
            let head = rng.below(u64::from(QSIZE)) as u16;
            g.q.write_desc(head, DATA, 512, F_NEXT | F_WRITE, rng.next() as u16);
            g.q.make_avail(head);
            sent += 1;
        }
        if rng.below(4) == 0 {
            dev.process_queue();
            returned += g.q.take_used().len();
        }
    }
    dev.process_queue();
    returned += g.q.take_used().len();
    assert_eq!(returned, sent, "every chain comes back");
    let s = dev.stats();
    assert_eq!(s.requests as usize, sent);
    assert!(s.errors > 0 && s.errors < s.requests, "{s:?}");
    // The file is still the size it was.
    assert_eq!(g.file.metadata().unwrap().len(), DISK_SECTORS * 512);
}

#[test]
fn write_zeroes_falls_back_to_writing_zeroes_where_fallocate_cannot() {
    // tmpfs has no FALLOC_FL_ZERO_RANGE: the device writes the zeroes itself.
    let Ok(shm) = tempfile::tempfile_in("/dev/shm") else {
        panic!("/dev/shm (tmpfs) is needed for this test");
    };
    let mut f = shm;
    f.write_all(&vec![0xffu8; 64 * 1024 * 4]).unwrap();
    let host = f.try_clone().unwrap();
    let mut disk = DiskFile::new(f).unwrap();
    let probe = disk.write_zeroes(512, 150 * 1024);
    assert!(probe.is_ok(), "{probe:?}");
    let mut b = vec![0u8; 64 * 1024 * 4];
    host.read_exact_at(&mut b, 0).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0xff));
    assert!(b[512..512 + 150 * 1024].iter().all(|&x| x == 0));
    assert!(b[512 + 150 * 1024..].iter().all(|&x| x == 0xff));
    // Punching a hole works on tmpfs.
    disk.discard(0, 512).unwrap();
    host.read_exact_at(&mut b[..512], 0).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0));
}
