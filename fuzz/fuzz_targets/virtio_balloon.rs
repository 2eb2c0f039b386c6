//! virtio-balloon: the guest's inflate/deflate page-frame lists and free page reports, through
//! the real device (`vmm_devices::virtio::balloon::Balloon`) on real guest memory, whose pages it
//! drops with madvise. Tape: reporting offered/acked, three queue sizes, then operations.
#![no_main]

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::tape::Tape;
use microvm_fuzz::virtq::{queue_size, serve_until_idle, Driver};
use vmm_devices::virtio::balloon::{Balloon, NUM_QUEUES, QUEUE_SIZE};
use vmm_devices::virtio::VirtioDevice;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::virtio_balloon);
    },
    |data: &[u8]| {
    let mut t = Tape::new(data);
    let offer = t.bool();
    let ack_mask = t.u64();
    let sizes: Vec<u16> = (0..NUM_QUEUES)
        .map(|_| queue_size(t.u8(), QUEUE_SIZE))
        .collect();
    let mut driver = Driver::new(&sizes);
    let Ok(mut dev) = Balloon::new(offer) else {
        return;
    };
    let activate = |dev: &mut Balloon, driver: &Driver, ack_mask: u64| {
        dev.set_acked_features(dev.avail_features() & ack_mask);
        let n = dev.queues_in_use();
        let queues = (0..n).map(|i| driver.device_queue(i, QUEUE_SIZE)).collect();
        dev.activate(driver.mem.clone(), queues, driver.irq.clone())
            .expect("activation with the queues in use");
    };
    activate(&mut dev, &driver, ack_mask);
    while !t.is_empty() {
        let op = t.u8() % 8;
        if driver.generic_op(op, &mut t) {
            continue;
        }
        match op {
            4 => {
                let q = usize::from(t.u8()) % NUM_QUEUES;
                serve_until_idle(&driver, &mut dev, q, |d| d.process_queue(q));
                driver.take_all_used();
            }
            5 => {
                let offset = u64::from(t.u8());
                let len = usize::from(t.u8() % 9);
                let bytes = t.bytes(len).to_vec();
                dev.write_config(offset, &bytes);
            }
            6 => {
                let offset = t.u64();
                let mut buf = vec![0u8; usize::from(t.u8() % 16)];
                dev.read_config(offset, &mut buf);
            }
            _ => {
                // Reset and a fresh activation on the same rings: the device starts its used
                // index again from 0, as after any reset (a real driver sets its rings up
                // again), so the driver's count of what it had seen no longer holds.
                dev.reset();
                driver.strict = false;
                let mask = t.u64();
                activate(&mut dev, &driver, mask);
            }
        }
    }
    }
);
