//! The virtio-mmio transport's register file (`vmm_devices::virtio::mmio::MmioTransport`) as a
//! guest drives it: any sequence of reads and writes of any size and alignment, the status
//! state machine, feature negotiation, queue set-up with addresses anywhere, notifies, resets,
//! config space; behind it a real device (a balloon, or a disk on a scratch file) that serves
//! the chains of the shared driver once the driver's sequence activated it.
//!
//! Checked: the identification registers never change, a device is activated only while the
//! transport's status has DRIVER_OK, and a notify reaches only a queue of the device.
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;
use microvm_fuzz::virtq::{queue_size, Driver};
use vmm_devices::bus::BusDevice;
use vmm_devices::virtio::balloon::Balloon;
use vmm_devices::virtio::block::{Access, Block};
use vmm_devices::virtio::mmio::{reg, status, MmioTransport, MMIO_MAGIC_VALUE, MMIO_VERSION};
use vmm_devices::virtio::VirtioDevice;

const REGS: [u64; 26] = [
    reg::MAGIC_VALUE,
    reg::VERSION,
    reg::DEVICE_ID,
    reg::VENDOR_ID,
    reg::DEVICE_FEATURES,
    reg::DEVICE_FEATURES_SEL,
    reg::DRIVER_FEATURES,
    reg::DRIVER_FEATURES_SEL,
    reg::QUEUE_SEL,
    reg::QUEUE_NUM_MAX,
    reg::QUEUE_NUM,
    reg::QUEUE_READY,
    reg::QUEUE_NOTIFY,
    reg::INTERRUPT_STATUS,
    reg::INTERRUPT_ACK,
    reg::STATUS,
    reg::QUEUE_DESC_LOW,
    reg::QUEUE_DESC_HIGH,
    reg::QUEUE_DRIVER_LOW,
    reg::QUEUE_DRIVER_HIGH,
    reg::QUEUE_DEVICE_LOW,
    reg::QUEUE_DEVICE_HIGH,
    reg::SHM_SEL,
    reg::SHM_LEN_LOW,
    reg::CONFIG_GENERATION,
    reg::CONFIG,
];

enum Dev {
    Balloon(Arc<Mutex<Balloon>>),
    Block(Arc<Mutex<Block>>),
}

impl Dev {
    fn with<R>(&self, f: impl FnOnce(&mut dyn VirtioDevice) -> R) -> R {
        match self {
            Dev::Balloon(d) => f(&mut *d.lock().expect("device lock")),
            Dev::Block(d) => f(&mut *d.lock().expect("device lock")),
        }
    }

    /// What the event loop does when queue `q`'s eventfd fires.
    fn serve(&self, q: usize) {
        match self {
            Dev::Balloon(d) => d.lock().expect("device lock").process_queue_event(q),
            Dev::Block(d) => d.lock().expect("device lock").process_queue_event(),
        }
    }
}

fn read32(t: &mut MmioTransport, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(offset, &mut b);
    u32::from_le_bytes(b)
}

fn write32(t: &mut MmioTransport, offset: u64, v: u32) {
    t.write(offset, &v.to_le_bytes());
}

/// The driver's whole set-up sequence for the shared driver's rings, with the features the tape
/// picks.
fn standard_setup(mmio: &mut MmioTransport, driver: &Driver, features: u64, nq: usize) {
    write32(mmio, reg::STATUS, 0);
    write32(mmio, reg::STATUS, status::ACKNOWLEDGE);
    write32(mmio, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
    write32(mmio, reg::DEVICE_FEATURES_SEL, 0);
    let lo = read32(mmio, reg::DEVICE_FEATURES);
    write32(mmio, reg::DEVICE_FEATURES_SEL, 1);
    let hi = read32(mmio, reg::DEVICE_FEATURES);
    let offered = u64::from(lo) | u64::from(hi) << 32;
    let acked = offered & features;
    write32(mmio, reg::DRIVER_FEATURES_SEL, 0);
    write32(mmio, reg::DRIVER_FEATURES, acked as u32);
    write32(mmio, reg::DRIVER_FEATURES_SEL, 1);
    write32(mmio, reg::DRIVER_FEATURES, (acked >> 32) as u32);
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
    write32(mmio, reg::STATUS, s);
    for q in 0..nq.min(driver.queues.len()) {
        let (desc, avail, used) = driver.ring_addresses(q);
        write32(mmio, reg::QUEUE_SEL, q as u32);
        write32(mmio, reg::QUEUE_NUM, u32::from(driver.size(q)));
        write32(mmio, reg::QUEUE_DESC_LOW, desc as u32);
        write32(mmio, reg::QUEUE_DESC_HIGH, 0);
        write32(mmio, reg::QUEUE_DRIVER_LOW, avail as u32);
        write32(mmio, reg::QUEUE_DRIVER_HIGH, 0);
        write32(mmio, reg::QUEUE_DEVICE_LOW, used as u32);
        write32(mmio, reg::QUEUE_DEVICE_HIGH, 0);
        write32(mmio, reg::QUEUE_READY, 1);
    }
    write32(mmio, reg::STATUS, s | status::DRIVER_OK);
}

fn run(dir: &std::path::Path, data: &[u8]) {
    let mut t = Tape::new(data);
    let (dev, max, nq): (Dev, u16, usize) = if t.bool() {
        let path = dir.join("disk");
        std::fs::write(&path, vec![0u8; 8192]).expect("disk");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("disk");
        let Ok(b) = Block::new("mmio".into(), Some(file), Access::ReadWrite) else {
            return;
        };
        (Dev::Block(Arc::new(Mutex::new(b))), 256, 1)
    } else {
        let Ok(b) = Balloon::new(t.bool()) else {
            return;
        };
        (Dev::Balloon(Arc::new(Mutex::new(b))), 256, 3)
    };
    let sizes: Vec<u16> = (0..nq).map(|_| queue_size(t.u8(), max)).collect();
    let mut driver = Driver::new(&sizes);
    let shared: Arc<Mutex<dyn VirtioDevice>> = match &dev {
        Dev::Balloon(d) => d.clone(),
        Dev::Block(d) => d.clone(),
    };
    let Ok(mut mmio) = MmioTransport::new(shared, driver.mem.clone()) else {
        return;
    };
    let device_id = read32(&mut mmio, reg::DEVICE_ID);
    while !t.is_empty() {
        let op = t.u8() % 12;
        // The transport may hand the device queues of its own choosing: the shared driver's
        // bookkeeping no longer describes what the device sees.
        driver.strict = false;
        if driver.generic_op(op, &mut t) {
            continue;
        }
        match op {
            // A register write: a known register or any offset, any size.
            4 | 5 => {
                let sel = t.u8();
                let offset = if sel & 0x80 != 0 {
                    u64::from(t.u16())
                } else {
                    REGS[usize::from(sel) % REGS.len()]
                        + u64::from(t.u8() % 4) * u64::from(sel & 0x40 != 0)
                };
                let size = [4usize, 4, 1, 2, 8, 3][usize::from(t.u8() % 6)];
                let bytes = t.bytes(size).to_vec();
                mmio.write(offset, &bytes);
            }
            // A register read.
            6 => {
                let sel = t.u8();
                let offset = if sel & 0x80 != 0 {
                    u64::from(t.u16())
                } else {
                    REGS[usize::from(sel) % REGS.len()]
                };
                let mut buf = vec![0u8; [4usize, 1, 2, 8][usize::from(t.u8() % 4)]];
                mmio.read(offset, &mut buf);
            }
            7 => standard_setup(&mut mmio, &driver, t.u64(), nq),
            // The event loop runs the device's queue work for every signalled queue.
            8 => {
                for q in 0..nq {
                    let fired = dev.with(|d| matches!(d.state().read_queue_event(q), Ok(true)));
                    if fired {
                        dev.with(|d| d.state().kick(q));
                        dev.serve(q);
                    }
                }
                driver.take_all_used();
            }
            9 => {
                let v = t.u32();
                write32(&mut mmio, reg::QUEUE_NOTIFY, v);
            }
            10 => {
                // Host side of a disk slot: detach / attach while the guest runs.
                if let Dev::Block(b) = &dev {
                    let mut b = b.lock().expect("device lock");
                    if b.has_disk() {
                        let _ = b.detach();
                    } else if let Ok(f) = std::fs::File::open(dir.join("disk")) {
                        let _ = b.attach("again".into(), f);
                    }
                }
            }
            _ => {
                let v = t.u32();
                write32(&mut mmio, reg::STATUS, v);
            }
        }
        assert_eq!(read32(&mut mmio, reg::MAGIC_VALUE), MMIO_MAGIC_VALUE);
        assert_eq!(read32(&mut mmio, reg::VERSION), MMIO_VERSION);
        assert_eq!(read32(&mut mmio, reg::DEVICE_ID), device_id);
        if dev.with(|d| d.is_activated()) {
            assert!(
                mmio.status() & status::DRIVER_OK != 0,
                "the device is active in status {:#x}",
                mmio.status()
            );
        }
    }
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::virtio_mmio);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("mmio");
        run(dir.path(), data);
    }
);
