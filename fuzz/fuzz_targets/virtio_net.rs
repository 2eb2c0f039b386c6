//! virtio-net: the guest's transmit chains (vnet header and frame) and receive buffers, through
//! the real device (`vmm_devices::virtio::net::Net`) on a datagram socket pair standing in for
//! the tap (one frame per datagram, `EAGAIN` when the peer's queue is full, as a tap does), with
//! the host side writing frames of any size and reading what the guest sent.
//!
//! Checked: every frame the device hands the backend is at least a vnet header and an Ethernet
//! header and at most the device's buffer; every receive chain comes back with at most its
//! capacity (the shared driver's check).
#![no_main]

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::tape::Tape;
use microvm_fuzz::virtq::{queue_size, serve_until_idle, Desc, Driver};
use vmm_devices::virtio::net::{
    Net, NetBackend, ETH_HLEN, MAX_BUFFER_SIZE, QUEUE_SIZE, RX_QUEUE, TX_QUEUE, VNET_HDR_LEN,
};
use vmm_devices::virtio::VirtioDevice;
use vmm_sys_util::epoll::EventSet;

/// The device's end of the pair.
struct Backend(UnixDatagram);

impl AsRawFd for Backend {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl NetBackend for Backend {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.recv(buf)
    }
    fn write_frame(&mut self, frame: &[u8]) -> io::Result<usize> {
        self.0.send(frame)
    }
}

const MACS: [[u8; 6]; 2] = [[0x02, 0, 0, 0, 0, 1], [0x52, 0x54, 0, 0x12, 0x34, 0x56]];

fn drain_host(host: &UnixDatagram) {
    let mut buf = vec![0u8; MAX_BUFFER_SIZE + 1];
    for _ in 0..1024 {
        match host.recv(&mut buf) {
            Ok(n) => {
                assert!(
                    n >= VNET_HDR_LEN + ETH_HLEN,
                    "a {n}-byte frame reached the tap"
                );
                assert!(n <= MAX_BUFFER_SIZE, "a {n}-byte frame reached the tap");
            }
            Err(_) => return,
        }
    }
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::virtio_net);
    },
    |data: &[u8]| {
    let mut t = Tape::new(data);
    let mtu = match t.u16() {
        0 => None,
        m => Some(m),
    };
    let mac = MACS[usize::from(t.u8() % 2)];
    let ack_mask = t.u64();
    let sizes = [queue_size(t.u8(), QUEUE_SIZE), queue_size(t.u8(), QUEUE_SIZE)];
    let (dev_end, host) = UnixDatagram::pair().expect("socket pair");
    dev_end.set_nonblocking(true).expect("nonblocking");
    host.set_nonblocking(true).expect("nonblocking");
    let Ok(mut dev) = Net::new(Backend(dev_end), mac, mtu) else {
        return;
    };
    let mut driver = Driver::new(&sizes);
    let activate = |dev: &mut Net<Backend>, driver: &Driver, mask: u64| {
        dev.set_acked_features(dev.avail_features() & mask);
        let queues = (0..2)
            .map(|i| driver.device_queue(i, QUEUE_SIZE))
            .collect();
        dev.activate(driver.mem.clone(), queues, driver.irq.clone())
            .expect("activation");
    };
    activate(&mut dev, &driver, ack_mask);
    while !t.is_empty() {
        let op = t.u8() % 12;
        if driver.generic_op(op, &mut t) {
            continue;
        }
        match op {
            // A frame to send: vnet header and frame in one or two descriptors.
            4 | 5 => {
                let hdr = t.bytes(VNET_HDR_LEN).to_vec();
                let frame = t.blob().to_vec();
                let chain = if t.bool() {
                    vec![
                        Desc::readable(0x1000, &hdr),
                        Desc::readable(0x2000, &frame),
                    ]
                } else {
                    let mut all = hdr;
                    all.extend_from_slice(&frame);
                    vec![Desc::readable(0x1000, &all)]
                };
                driver.add_chain(TX_QUEUE, &chain);
                serve_until_idle(&driver, &mut dev, TX_QUEUE, |d| d.process_tx());
                driver.take_all_used();
            }
            // Receive buffers, in one to three descriptors.
            6 => {
                let n = 1 + t.u8() % 3;
                let chain: Vec<Desc> = (0..n)
                    .map(|i| Desc::writable(0x2_0000 + u64::from(i) * 0x1_0000, u32::from(t.u16())))
                    .collect();
                driver.add_chain(RX_QUEUE, &chain);
                // The driver's notify: the device reads the backend again.
                dev.state().kick(RX_QUEUE);
                serve_until_idle(&driver, &mut dev, RX_QUEUE, |d| {
                    d.process_queue_event(RX_QUEUE)
                });
                driver.take_all_used();
            }
            // The host sends a frame of any size.
            7 => {
                let _ = host.send(t.blob());
            }
            8 => drain_host(&host),
            // The backend is ready (as the event loop reports it).
            9 => {
                let bits = t.u8();
                let mut ev = EventSet::empty();
                if bits & 1 != 0 {
                    ev |= EventSet::IN;
                }
                if bits & 2 != 0 {
                    ev |= EventSet::OUT;
                }
                if bits & 0x80 != 0 {
                    ev |= EventSet::HANG_UP;
                }
                dev.process_backend(ev);
                driver.take_all_used();
            }
            10 => {
                let mut buf = vec![0u8; usize::from(t.u8() % 16)];
                dev.read_config(u64::from(t.u8()), &mut buf);
                let n = usize::from(t.u8() % 8);
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
    drain_host(&host);
    }
);
