//! virtio-blk: the guest's requests through the real device (`vmm_devices::virtio::block::Block`)
//! on real files: reads, writes, flushes, GET_ID, discards and write-zeroes, in chains of any
//! shape, and the host's attach and detach of the slot in between.
//!
//! Each disk file has a tail shorter than a sector after its last sector, which the guest never
//! sees. Checked after every input: no file changed its size, no tail changed, and a read-only
//! slot's files are byte for byte what they were.
#![no_main]

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;
use microvm_fuzz::virtq::{queue_size, serve_until_idle, Desc, Driver};
use vmm_devices::virtio::block::{req_type, Access, Block, QUEUE_SIZE, SECTOR_SIZE};
use vmm_devices::virtio::VirtioDevice;

const TYPES: [u32; 6] = [
    req_type::IN,
    req_type::OUT,
    req_type::FLUSH,
    req_type::GET_ID,
    req_type::DISCARD,
    req_type::WRITE_ZEROES,
];
const TAIL: usize = 300;

struct Disk {
    path: PathBuf,
    initial: Vec<u8>,
}

impl Disk {
    fn new(dir: &Path, name: &str, sectors: u64, seed: u8) -> Self {
        let len = sectors as usize * SECTOR_SIZE as usize + TAIL;
        let initial: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(seed) ^ 0x5a)
            .collect();
        let path = dir.join(name);
        std::fs::write(&path, &initial).expect("disk file");
        Self { path, initial }
    }

    fn open(&self, access: Access) -> File {
        OpenOptions::new()
            .read(true)
            .write(access == Access::ReadWrite)
            .open(&self.path)
            .expect("open disk")
    }

    fn check(&self, access: Access) {
        let now = std::fs::read(&self.path).expect("disk file");
        assert_eq!(now.len(), self.initial.len(), "the disk file changed size");
        let tail = self.initial.len() - TAIL;
        assert_eq!(
            now[tail..],
            self.initial[tail..],
            "the bytes past the last sector changed"
        );
        if access == Access::ReadOnly {
            assert!(now == self.initial, "a read-only disk was written");
        }
    }
}

fn run(dir: &Path, data: &[u8]) {
    let mut t = Tape::new(data);
    let access = if t.bool() {
        Access::ReadOnly
    } else {
        Access::ReadWrite
    };
    let ack_mask = t.u64();
    let sizes = [queue_size(t.u8(), QUEUE_SIZE)];
    let disks = [
        Disk::new(dir, "a", u64::from(t.u8() % 64), 3),
        Disk::new(dir, "b", u64::from(t.u8() % 64), 7),
    ];
    let start_empty = t.bool();
    let first = (!start_empty).then(|| disks[0].open(access));
    let Ok(mut dev) = Block::new("fuzz-serial".into(), first, access) else {
        return;
    };
    let mut driver = Driver::new(&sizes);
    let activate = |dev: &mut Block, driver: &Driver, mask: u64| {
        dev.set_acked_features(dev.avail_features() & mask);
        let queues = vec![driver.device_queue(0, QUEUE_SIZE)];
        dev.activate(driver.mem.clone(), queues, driver.irq.clone())
            .expect("activation");
    };
    activate(&mut dev, &driver, ack_mask);
    while !t.is_empty() {
        let op = t.u8() % 10;
        if driver.generic_op(op, &mut t) {
            continue;
        }
        match op {
            // A structured request: header, data segments, status.
            4 | 5 => {
                let sel = t.u8();
                let type_ = if sel & 0x80 != 0 {
                    t.u32()
                } else {
                    TYPES[usize::from(sel) % TYPES.len()]
                };
                let sector = if sel & 0x40 != 0 {
                    t.u64()
                } else {
                    u64::from(t.u8())
                };
                let mut header = Vec::with_capacity(16);
                header.extend_from_slice(&type_.to_le_bytes());
                header.extend_from_slice(&0u32.to_le_bytes());
                header.extend_from_slice(&sector.to_le_bytes());
                let mut chain = vec![Desc::readable(0x1000, &header)];
                for i in 0..t.u8() % 4 {
                    let off = 0x1_0000 + u64::from(i) * 0x2_0000;
                    let kind = t.u8();
                    if kind & 1 != 0 {
                        chain.push(Desc::writable(off, u32::from(t.u16())));
                    } else {
                        chain.push(Desc::readable(off, t.blob()));
                    }
                }
                let status_len = if sel & 0x20 != 0 {
                    u32::from(t.u8())
                } else {
                    1
                };
                chain.push(Desc::writable(0x2000, status_len));
                driver.add_chain(0, &chain);
                serve_until_idle(&driver, &mut dev, 0, |d| d.process_queue());
                driver.take_all_used();
            }
            6 => {
                serve_until_idle(&driver, &mut dev, 0, |d| d.process_queue());
                driver.take_all_used();
            }
            // The host empties or fills the slot.
            7 => {
                if dev.has_disk() {
                    let _ = dev.detach();
                } else {
                    let d = &disks[usize::from(t.u8() % 2)];
                    let _ = dev.attach("attached".into(), d.open(access));
                }
            }
            8 => {
                let offset = u64::from(t.u8());
                let mut buf = vec![0u8; usize::from(t.u8() % 16)];
                dev.read_config(offset, &mut buf);
                let n = usize::from(t.u8() % 9);
                let bytes = t.bytes(n).to_vec();
                dev.write_config(u64::from(t.u8()), &bytes);
            }
            _ => {
                dev.reset();
                driver.strict = false;
                activate(&mut dev, &driver, t.u64());
            }
        }
    }
    drop(dev);
    for d in &disks {
        d.check(access);
    }
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::virtio_blk);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("blk");
        run(dir.path(), data);
    }
);
