//! virtio-vsock: the guest's TX packets and RX buffers, and the muxer's connection state
//! machine, through the real device (`vmm_devices::virtio::vsock::Vsock`) with its real
//! hybrid-vsock backend: host peers are Unix streams on the device's socket (`CONNECT <port>`),
//! guest connections reach Unix listeners at `<uds>_<port>`, all in a scratch directory.
//!
//! Tape: the connection limit, three queue sizes, then operations: raw chains and ring entries
//! (the shared driver), structured guest packets (so headers are valid often enough to drive
//! the state machine), replies to the last packet the guest received (with its ports, so
//! handshakes complete), RX buffers, host connects, writes, reads and closes, listeners.
#![no_main]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;
use microvm_fuzz::virtq::{queue_size, serve_until_idle, Desc, Driver, DATA_BASE, DATA_SIZE};

const _: () = assert!(0x3_0000 + RX_SLOTS as u64 * RX_SLOT <= DATA_SIZE);
use vmm_devices::virtio::vsock::packet::HDR_SIZE;
use vmm_devices::virtio::vsock::{
    op, Vsock, VsockHeader, QUEUE_SIZE, RX_QUEUE, TX_QUEUE, VSOCK_HOST_CID,
};
use vmm_devices::virtio::VirtioDevice;

const GUEST_CID: u64 = 3;
/// Ports the structured operations pick from (the agent's, the ready port, two others).
const PORTS: [u32; 4] = [1024, 1026, 52, 7];
/// RX buffers take turns in slots of the data region after the TX buffers.
const RX_SLOTS: usize = 16;
const RX_SLOT: u64 = 0xc000;

fn slot_offset(slot: usize) -> u64 {
    0x3_0000 + slot as u64 * RX_SLOT
}

struct Harness {
    driver: Driver,
    dev: Vsock,
    uds: PathBuf,
    peers: Vec<UnixStream>,
    listeners: HashMap<u32, (PathBuf, UnixListener)>,
    /// RX chain heads: their buffer's slot, and whether it is still theirs alone.
    rx_bufs: HashMap<u16, (usize, bool)>,
    next_slot: usize,
    /// The last packet header the guest received.
    last_rx: Option<VsockHeader>,
    max_conns: usize,
}

impl Harness {
    fn port(t: &mut Tape<'_>) -> u32 {
        let b = t.u8();
        if b & 0x80 != 0 {
            t.u32()
        } else {
            PORTS[usize::from(b) % PORTS.len()]
        }
    }

    fn send(&mut self, hdr: &VsockHeader, data: &[u8], split: bool) {
        let mut bytes = hdr.to_bytes().to_vec();
        bytes.extend_from_slice(data);
        let chain = if split && !data.is_empty() {
            vec![
                Desc::readable(0x1_0000, &bytes[..HDR_SIZE]),
                Desc::readable(0x2_0000, &bytes[HDR_SIZE..]),
            ]
        } else {
            vec![Desc::readable(0x1_0000, &bytes)]
        };
        self.driver.add_chain(TX_QUEUE, &chain);
        self.process_tx();
    }

    fn process_tx(&mut self) {
        serve_until_idle(&self.driver, &mut self.dev, TX_QUEUE, |d| d.process_tx());
        self.collect();
    }

    fn process_rx(&mut self) {
        serve_until_idle(&self.driver, &mut self.dev, RX_QUEUE, |d| d.process_rx());
        self.collect();
    }

    /// Reads what the device returned: the TX chains, and the RX packets (their headers are
    /// checked and remembered).
    fn collect(&mut self) {
        self.driver.take_used(TX_QUEUE);
        for (head, len) in self.driver.take_used(RX_QUEUE) {
            let Some((slot, own)) = self.rx_bufs.remove(&(head as u16)) else {
                continue;
            };
            if len == 0 {
                continue;
            }
            let raw = self
                .driver
                .read_mem(DATA_BASE + slot_offset(slot), HDR_SIZE);
            let hdr = VsockHeader::from_bytes(raw.as_slice().try_into().expect("header"));
            if self.driver.strict && own {
                assert_eq!(hdr.src_cid, VSOCK_HOST_CID, "RX packet not from the host");
                assert_eq!(hdr.dst_cid, GUEST_CID, "RX packet not for the guest");
                assert_eq!(
                    hdr.len as usize + HDR_SIZE,
                    len as usize,
                    "RX header length and used length differ"
                );
            }
            self.last_rx = Some(hdr);
        }
        assert!(
            self.dev.connection_count() <= self.max_conns,
            "{} connections, the limit is {}",
            self.dev.connection_count(),
            self.max_conns
        );
    }

    fn op(&mut self, op: u8, t: &mut Tape<'_>) {
        match op {
            // A structured guest packet.
            4 => {
                let flags = t.u8();
                let src_cid = if flags & 1 != 0 { t.u64() } else { GUEST_CID };
                let dst_cid = if flags & 2 != 0 {
                    t.u64()
                } else {
                    VSOCK_HOST_CID
                };
                let src_port = Self::port(t);
                let dst_port = Self::port(t);
                let op_code = u16::from(t.u8() % 9);
                let type_ = if flags & 4 != 0 { t.u16() } else { 1 };
                let pkt_flags = if flags & 8 != 0 {
                    t.u32()
                } else {
                    u32::from(t.u8() % 4)
                };
                let buf_alloc = t.u32();
                let fwd_cnt = t.u32();
                let data = t.blob().to_vec();
                let len = if flags & 16 != 0 {
                    t.u32()
                } else {
                    data.len() as u32
                };
                let hdr = VsockHeader {
                    src_cid,
                    dst_cid,
                    src_port,
                    dst_port,
                    len,
                    type_,
                    op: op_code,
                    flags: pkt_flags,
                    buf_alloc,
                    fwd_cnt,
                };
                self.send(&hdr, &data, flags & 32 != 0);
            }
            // A reply to the last packet the guest received, on its connection.
            5 => {
                let Some(last) = self.last_rx else {
                    return;
                };
                let op_code = [op::RESPONSE, op::RW, op::CREDIT_UPDATE, op::CREDIT_REQUEST]
                    [usize::from(t.u8() % 4)];
                let op_code = match t.u8() % 8 {
                    0 => op::SHUTDOWN,
                    1 => op::RST,
                    _ => op_code,
                };
                let hdr = VsockHeader {
                    src_cid: GUEST_CID,
                    dst_cid: VSOCK_HOST_CID,
                    src_port: last.dst_port,
                    dst_port: last.src_port,
                    len: 0,
                    type_: 1,
                    op: op_code,
                    flags: u32::from(t.u8() % 4),
                    buf_alloc: t.u32(),
                    fwd_cnt: t.u32(),
                };
                let data = if op_code == op::RW {
                    t.blob().to_vec()
                } else {
                    Vec::new()
                };
                let hdr = VsockHeader {
                    len: data.len() as u32,
                    ..hdr
                };
                self.send(&hdr, &data, false);
            }
            // RX buffers.
            6 => {
                let n = 1 + t.u8() % 4;
                for _ in 0..n {
                    let len = u32::from(t.u16()).min(RX_SLOT as u32);
                    let slot = self.next_slot;
                    self.next_slot = (slot + 1) % RX_SLOTS;
                    // A buffer whose slot is taken again may be overwritten before it is read.
                    for v in self.rx_bufs.values_mut() {
                        if v.0 == slot {
                            v.1 = false;
                        }
                    }
                    let buf = Desc::writable(slot_offset(slot), len);
                    if let Some(head) = self.driver.add_chain(RX_QUEUE, &[buf]) {
                        self.rx_bufs.insert(head, (slot, true));
                    }
                }
                self.process_rx();
            }
            7 => {
                self.dev.process_backend();
                self.collect();
            }
            // A host connection, with a CONNECT line or anything.
            8 => {
                let Ok(s) = UnixStream::connect(&self.uds) else {
                    return;
                };
                let _ = s.set_nonblocking(true);
                let mut s = s;
                if t.bool() {
                    let _ = s.write_all(t.blob());
                } else {
                    let port = Self::port(t);
                    let _ = writeln!(s, "CONNECT {port}");
                }
                self.peers.push(s);
            }
            // A host peer writes.
            9 => {
                let i = usize::from(t.u8());
                let bytes = t.blob();
                if let Some(s) = self.peer(i) {
                    let _ = s.write(bytes);
                }
            }
            // A host peer reads what is there.
            10 => {
                let i = usize::from(t.u8());
                if let Some(s) = self.peer(i) {
                    let mut buf = [0u8; 4096];
                    for _ in 0..128 {
                        match s.read(&mut buf) {
                            Ok(n) if n > 0 => {}
                            _ => break,
                        }
                    }
                }
            }
            // A host peer closes or half-closes.
            11 => {
                let i = usize::from(t.u8());
                let how = t.u8() % 3;
                if !self.peers.is_empty() {
                    let i = i % self.peers.len();
                    match how {
                        0 => drop(self.peers.swap_remove(i)),
                        1 => {
                            let _ = self.peers[i].shutdown(Shutdown::Write);
                        }
                        _ => {
                            let _ = self.peers[i].shutdown(Shutdown::Read);
                        }
                    }
                }
            }
            // A host listener for guest connections to a port.
            12 => {
                let port = Self::port(t);
                if self.listeners.contains_key(&port) {
                    return;
                }
                let mut path = self.uds.clone().into_os_string();
                path.push(format!("_{port}"));
                let path = PathBuf::from(path);
                if let Ok(l) = UnixListener::bind(&path) {
                    let _ = l.set_nonblocking(true);
                    self.listeners.insert(port, (path, l));
                }
            }
            // Accept the guest's connections waiting on the listeners.
            13 => {
                for (_, l) in self.listeners.values() {
                    while let Ok((s, _)) = l.accept() {
                        let _ = s.set_nonblocking(true);
                        self.peers.push(s);
                    }
                }
            }
            // The driver resets the device and sets it up again on the same rings.
            14 => {
                self.dev.reset();
                self.driver.strict = false;
                self.rx_bufs.clear();
                self.activate();
            }
            _ => {
                let q = usize::from(t.u8() % 2);
                if q == RX_QUEUE {
                    self.process_rx();
                } else {
                    self.process_tx();
                }
            }
        }
    }

    fn peer(&mut self, i: usize) -> Option<&mut UnixStream> {
        if self.peers.is_empty() {
            return None;
        }
        let n = self.peers.len();
        self.peers.get_mut(i % n)
    }

    fn activate(&mut self) {
        self.dev.set_acked_features(self.dev.avail_features());
        let queues = (0..3)
            .map(|i| self.driver.device_queue(i, QUEUE_SIZE))
            .collect();
        self.dev
            .activate(self.driver.mem.clone(), queues, self.driver.irq.clone())
            .expect("activation");
    }
}

fn remove_listeners(listeners: &HashMap<u32, (PathBuf, UnixListener)>) {
    for (path, _) in listeners.values() {
        let _ = std::fs::remove_file(path);
    }
}

fn run(dir: &Path, data: &[u8]) {
    let mut t = Tape::new(data);
    let max_conns = 1 + usize::from(t.u8() % 8);
    let sizes: Vec<u16> = (0..3).map(|_| queue_size(t.u8(), QUEUE_SIZE)).collect();
    let uds = dir.join("v.sock");
    let dev = Vsock::with_max_connections(GUEST_CID, &uds, max_conns).expect("vsock device");
    let mut h = Harness {
        driver: Driver::new(&sizes),
        dev,
        uds,
        peers: Vec::new(),
        listeners: HashMap::new(),
        rx_bufs: HashMap::new(),
        next_slot: 0,
        last_rx: None,
        max_conns,
    };
    h.activate();
    while !t.is_empty() {
        let op = t.u8() % 16;
        if h.driver.generic_op(op, &mut t) {
            continue;
        }
        h.op(op, &mut t);
    }
    remove_listeners(&h.listeners);
}

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::virtio_vsock);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("vsock");
        run(dir.path(), data);
    }
);
