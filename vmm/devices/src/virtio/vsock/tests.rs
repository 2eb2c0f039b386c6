//! Whole-device tests: a simulated guest driver on fake guest memory, real Unix sockets on the
//! host side.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::packet::{VsockHeader, HDR_SIZE};
use super::*;
use crate::virtio::test_chain::TestQueue;
use crate::virtio::{IrqTrigger, VirtioDevice};
use crate::GuestMemory;

const MEM_SIZE: usize = 16 << 20;
const Q_BASE: [u64; 3] = [0x1_0000, 0x4_0000, 0x7_0000];
const RX_BUFS: u16 = 32;
const RX_DATA: u32 = 4096;
const RX_BUF_BASE: u64 = 0x10_0000;
const TX_SLOTS: u16 = 128;
const TX_BUF_BASE: u64 = 0x20_0000;
const TX_SLOT_SIZE: u64 = 0x1_1000;
const GUEST_CID: u64 = 3;

/// A socket path in a folder of its own, removed with everything in it when dropped.
struct TempSock {
    dir: PathBuf,
    path: PathBuf,
}

impl std::ops::Deref for TempSock {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.path
    }
}

impl AsRef<std::path::Path> for TempSock {
    fn as_ref(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for TempSock {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_sock(name: &str) -> TempSock {
    let dir = std::env::temp_dir().join(format!("vsock-t-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    TempSock {
        path: dir.join(name),
        dir,
    }
}

/// A guest driver: posts RX buffers, sends TX packets, collects what the device wrote.
struct Guest {
    mem: GuestMemory,
    dev: Vsock,
    irq: Arc<IrqTrigger>,
    qs: [TestQueue; 3],
    tx_slot: u16,
    received: VecDeque<(VsockHeader, Vec<u8>)>,
    /// RX buffers given back with length 0 or a bad length.
    bad_rx: usize,
}

impl Guest {
    fn new(path: &std::path::Path, max_conns: usize) -> Self {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let mut dev = Vsock::with_max_connections(GUEST_CID, path, max_conns).unwrap();
        let irq = Arc::new(IrqTrigger::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let qs = Q_BASE.map(|b| TestQueue::new(&mem, b, QUEUE_SIZE));
        let queues = qs.iter().map(|q| q.queue(QUEUE_SIZE)).collect();
        dev.set_acked_features(dev.avail_features());
        dev.activate(mem.clone(), queues, irq.clone()).unwrap();
        let mut g = Self {
            mem,
            dev,
            irq,
            qs,
            tx_slot: 0,
            received: VecDeque::new(),
            bad_rx: 0,
        };
        for i in 0..RX_BUFS {
            g.write_desc(
                RX_QUEUE,
                i,
                RX_BUF_BASE + u64::from(i) * 0x2000,
                HDR_SIZE as u32 + RX_DATA,
                VRING_DESC_F_WRITE as u16,
            );
            g.make_avail(RX_QUEUE, i);
        }
        g
    }

    fn write_desc(&self, q: usize, idx: u16, addr: u64, len: u32, flags: u16) {
        self.qs[q].write_desc(idx, addr, len, flags, 0);
    }

    fn make_avail(&mut self, q: usize, head: u16) {
        self.qs[q].make_avail(head);
    }

    /// New used entries of queue `q`.
    fn take_used(&mut self, q: usize) -> Vec<(u32, u32)> {
        self.qs[q].take_used()
    }

    /// Sends a raw chain of readable descriptors (addr, len) on the TX queue.
    fn send_raw(&mut self, descs: &[(u64, u32)]) {
        let base = self.tx_slot;
        for (i, &(addr, len)) in descs.iter().enumerate() {
            let idx = (base + i as u16) % TX_SLOTS;
            let next = (base + i as u16 + 1) % TX_SLOTS;
            let a = GuestAddress(Q_BASE[TX_QUEUE] + u64::from(idx) * 16);
            let flags: u16 = if i + 1 < descs.len() { 1 } else { 0 };
            self.mem.write_obj(addr, a).unwrap();
            self.mem.write_obj(len, a.unchecked_add(8)).unwrap();
            self.mem.write_obj(flags, a.unchecked_add(12)).unwrap();
            self.mem.write_obj(next, a.unchecked_add(14)).unwrap();
        }
        self.tx_slot = (base + descs.len() as u16) % TX_SLOTS;
        self.make_avail(TX_QUEUE, base % TX_SLOTS);
        self.dev.process_queue_event(TX_QUEUE);
        self.take_used(TX_QUEUE);
        self.collect();
    }

    fn send(&mut self, hdr: VsockHeader, data: &[u8]) {
        let addr = TX_BUF_BASE + u64::from(self.tx_slot) * TX_SLOT_SIZE;
        let mut hdr = hdr;
        hdr.len = data.len() as u32;
        self.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(addr))
            .unwrap();
        self.mem
            .write_slice(data, GuestAddress(addr + HDR_SIZE as u64))
            .unwrap();
        self.send_raw(&[(addr, (HDR_SIZE + data.len()) as u32)]);
    }

    /// Reads the RX used ring and reposts the buffers.
    fn collect(&mut self) {
        for (id, len) in self.take_used(RX_QUEUE) {
            let addr = RX_BUF_BASE + u64::from(id) * 0x2000;
            let mut raw = [0u8; HDR_SIZE];
            self.mem.read_slice(&mut raw, GuestAddress(addr)).unwrap();
            let hdr = VsockHeader::from_bytes(&raw);
            if len as usize != HDR_SIZE + hdr.len as usize || hdr.len > RX_DATA {
                self.bad_rx += 1;
            } else {
                let mut data = vec![0u8; hdr.len as usize];
                self.mem
                    .read_slice(&mut data, GuestAddress(addr + HDR_SIZE as u64))
                    .unwrap();
                self.received.push_back((hdr, data));
            }
            self.make_avail(RX_QUEUE, id as u16);
        }
    }

    /// One round of the event loop: backend events, RX.
    fn pump(&mut self) {
        self.dev.process_backend();
        self.dev.process_queue_event(RX_QUEUE);
        self.collect();
    }

    /// Pumps until a packet arrives (or panics after `secs`).
    fn next_pkt(&mut self, secs: u64) -> (VsockHeader, Vec<u8>) {
        let end = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(p) = self.received.pop_front() {
                return p;
            }
            assert!(Instant::now() < end, "no packet from the device");
            self.pump();
            if self.received.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Pumps for a while and asserts nothing arrives.
    fn assert_quiet(&mut self) {
        for _ in 0..20 {
            self.pump();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(self.received.is_empty(), "unexpected {:?}", self.received);
    }
}

fn ghdr(op: u16, src_port: u32, dst_port: u32) -> VsockHeader {
    VsockHeader {
        src_cid: GUEST_CID,
        dst_cid: VSOCK_HOST_CID,
        src_port,
        dst_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 64 * 1024,
        fwd_cnt: 0,
    }
}

fn read_line(s: &mut UnixStream) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        out.push(b[0]);
    }
    String::from_utf8(out).unwrap()
}

/// Host connects with CONNECT, the guest accepts; returns the stream and the host port.
fn host_connect(g: &mut Guest, port: u32) -> (UnixStream, u32) {
    let mut s = UnixStream::connect(g.dev.uds_path()).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::REQUEST);
    assert_eq!((h.src_cid, h.dst_cid, h.dst_port), (2, GUEST_CID, port));
    assert_eq!(h.type_, TYPE_STREAM);
    let local = h.src_port;
    g.send(ghdr(op::RESPONSE, port, local), &[]);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(read_line(&mut s), format!("OK {local}"));
    (s, local)
}

#[test]
fn host_initiated_connection_carries_data_both_ways() {
    let path = temp_sock("h1.sock");
    let mut g = Guest::new(&path, 8);
    let (mut s, local) = host_connect(&mut g, 1024);
    assert!(g.irq.status() & crate::virtio::INT_VRING != 0);
    s.write_all(b"hello guest").unwrap();
    let (h, d) = g.next_pkt(5);
    assert_eq!((h.op, h.src_port, h.dst_port), (op::RW, local, 1024));
    assert_eq!(h.buf_alloc, CONN_BUF_ALLOC);
    assert_eq!(d, b"hello guest");
    g.send(ghdr(op::RW, 1024, local), b"hello host");
    let mut buf = [0u8; 10];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello host");
    // The guest asks for credit: it gets our fwd_cnt (10 bytes forwarded).
    g.send(ghdr(op::CREDIT_REQUEST, 1024, local), &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!((h.op, h.fwd_cnt), (op::CREDIT_UPDATE, 10));
    assert_eq!(g.bad_rx, 0);
}

#[test]
fn guest_refusal_and_bad_connect_lines_close_the_host_stream() {
    let path = temp_sock("h2.sock");
    let mut g = Guest::new(&path, 8);
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(b"CONNECT 99\n").unwrap();
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::REQUEST);
    g.send(ghdr(op::RST, 99, h.src_port), &[]);
    let mut buf = [0u8; 8];
    assert_eq!(s.read(&mut buf).unwrap(), 0);
    assert_eq!(g.dev.connection_count(), 0);
    for line in [&b"HELLO\n"[..], b"CONNECT x\n", &[b'9'; 100]] {
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(line).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while g.dev.connection_count() > 0 || Instant::now() < end {
            g.pump();
            if g.dev.connection_count() == 0 {
                break;
            }
        }
        // Closed: EOF, or a reset when the device left part of the line unread.
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            r => panic!("host stream still open: {r:?}"),
        }
    }
    g.assert_quiet();
}

#[test]
fn unanswered_request_times_out() {
    let path = temp_sock("h3.sock");
    let mut g = Guest::new(&path, 8);
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(b"CONNECT 5\n").unwrap();
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::REQUEST);
    let (h, _) = g.next_pkt(CONNECT_TIMEOUT.as_secs() + 3);
    assert_eq!(h.op, op::RST);
    let mut buf = [0u8; 8];
    assert_eq!(s.read(&mut buf).unwrap(), 0);
    assert_eq!(g.dev.connection_count(), 0);
}

#[test]
fn guest_initiated_connection_reaches_uds_port_socket() {
    let path = temp_sock("g1.sock");
    let mut g = Guest::new(&path, 8);
    let listener = UnixListener::bind(format!("{}_1234", path.display())).unwrap();
    g.send(ghdr(op::REQUEST, 5000, 1234), &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!(
        (h.op, h.src_port, h.dst_port, h.dst_cid),
        (op::RESPONSE, 1234, 5000, GUEST_CID)
    );
    let (mut s, _) = listener.accept().unwrap();
    g.send(ghdr(op::RW, 5000, 1234), b"ping");
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");
    s.write_all(b"pong").unwrap();
    let (h, d) = g.next_pkt(5);
    assert_eq!((h.op, d.as_slice()), (op::RW, &b"pong"[..]));
    // Nobody listens on port 4321: RST.
    g.send(ghdr(op::REQUEST, 5001, 4321), &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!((h.op, h.src_port, h.dst_port), (op::RST, 4321, 5001));
    // Host closes: the guest learns with SHUTDOWN(SEND); the guest's full shutdown gets a RST.
    drop(s);
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::SHUTDOWN);
    assert_eq!(h.flags, SHUTDOWN_SEND);
    let mut sd = ghdr(op::SHUTDOWN, 5000, 1234);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(sd, &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::RST);
    assert_eq!(g.dev.connection_count(), 0);
    std::fs::remove_file(format!("{}_1234", path.display())).unwrap();
}

#[test]
fn guest_shutdown_flushes_and_resets() {
    let path = temp_sock("g2.sock");
    let mut g = Guest::new(&path, 8);
    let (mut s, local) = host_connect(&mut g, 77);
    g.send(ghdr(op::RW, 77, local), b"last words");
    let mut sd = ghdr(op::SHUTDOWN, 77, local);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(sd, &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!((h.op, h.dst_port), (op::RST, 77));
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    assert_eq!(all, b"last words");
    assert_eq!(g.dev.connection_count(), 0);
    // Packets for the closed connection now get a RST.
    g.send(ghdr(op::RW, 77, local), b"zombie");
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::RST);
}

#[test]
fn host_to_guest_megabyte_respects_guest_credit() {
    const TOTAL: usize = 1 << 20;
    const GUEST_BUF: u32 = 64 * 1024;
    let path = temp_sock("c1.sock");
    let mut g = Guest::new(&path, 8);
    let (s, local) = host_connect(&mut g, 1024);
    let pattern: Vec<u8> = (0..TOTAL).map(|i| (i * 7 + i / 4093) as u8).collect();
    let expected = pattern.clone();
    let writer = std::thread::spawn(move || {
        let mut s = s;
        s.write_all(&pattern).unwrap();
        // Closing makes the device send SHUTDOWN once everything is through.
        s
    });
    let mut got = Vec::with_capacity(TOTAL);
    let mut fwd_cnt: u32 = 0;
    let mut stalls = 0;
    let mut credit_requests = 0;
    let end = Instant::now() + Duration::from_secs(30);
    let mut writer = Some(writer);
    loop {
        assert!(
            Instant::now() < end,
            "transfer stuck at {} bytes",
            got.len()
        );
        g.pump();
        let mut progressed = false;
        while let Some((h, d)) = g.received.pop_front() {
            progressed = true;
            match h.op {
                op::RW => got.extend_from_slice(&d),
                op::CREDIT_REQUEST => credit_requests += 1,
                op::SHUTDOWN => panic!("unexpected shutdown"),
                o => panic!("unexpected op {o}"),
            }
            let in_flight = got.len() as u32 - fwd_cnt;
            assert!(in_flight <= GUEST_BUF, "device overran the guest's credit");
        }
        if got.len() == TOTAL {
            break;
        }
        // The guest app reads only when its buffer is full, then returns all credit.
        if got.len() as u32 - fwd_cnt == GUEST_BUF {
            // Out of credit: the device must stop sending data (it may ask for credit).
            for _ in 0..3 {
                std::thread::sleep(Duration::from_millis(1));
                g.pump();
                while let Some((h, _)) = g.received.pop_front() {
                    assert_eq!(h.op, op::CREDIT_REQUEST, "data sent without credit");
                    credit_requests += 1;
                }
            }
            stalls += 1;
            fwd_cnt = got.len() as u32;
            let mut h = ghdr(op::CREDIT_UPDATE, 1024, local);
            h.buf_alloc = GUEST_BUF;
            h.fwd_cnt = fwd_cnt;
            g.send(h, &[]);
        } else if !progressed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(got == expected, "data corrupted");
    assert!(stalls >= TOTAL / GUEST_BUF as usize - 1);
    assert!(credit_requests > 0, "the device never asked for credit");
    drop(writer.take().map(|w| w.join().unwrap()));
    // The host closed its end: the guest gets SHUTDOWN(SEND).
    let mut h = ghdr(op::CREDIT_UPDATE, 1024, local);
    h.buf_alloc = GUEST_BUF;
    h.fwd_cnt = got.len() as u32;
    g.send(h, &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!((h.op, h.flags), (op::SHUTDOWN, SHUTDOWN_SEND));
    assert_eq!(g.bad_rx, 0);
}

#[test]
fn guest_to_host_megabyte_respects_host_credit() {
    const TOTAL: usize = 1 << 20;
    let path = temp_sock("c2.sock");
    let mut g = Guest::new(&path, 8);
    let listener = UnixListener::bind(format!("{}_2000", path.display())).unwrap();
    g.send(ghdr(op::REQUEST, 6000, 2000), &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!(h.op, op::RESPONSE);
    let (mut peer_buf_alloc, mut peer_fwd_cnt) = (h.buf_alloc, h.fwd_cnt);
    assert_eq!(peer_buf_alloc, CONN_BUF_ALLOC);
    let (s, _) = listener.accept().unwrap();
    let pattern: Vec<u8> = (0..TOTAL).map(|i| (i * 13 + i / 511) as u8).collect();
    // The host app reads nothing for a while, so the socket and then the credit fill up.
    let reader = std::thread::spawn(move || {
        let mut s = s;
        std::thread::sleep(Duration::from_millis(300));
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        all
    });
    let mut sent = 0usize;
    let mut tx_cnt: u32 = 0;
    let mut stalls = 0;
    let end = Instant::now() + Duration::from_secs(30);
    while sent < TOTAL {
        assert!(Instant::now() < end, "transfer stuck at {sent} bytes");
        g.pump();
        while let Some((h, _)) = g.received.pop_front() {
            assert_eq!(h.op, op::CREDIT_UPDATE);
            peer_buf_alloc = h.buf_alloc;
            peer_fwd_cnt = h.fwd_cnt;
        }
        let credit = peer_buf_alloc - (tx_cnt - peer_fwd_cnt);
        if credit == 0 {
            stalls += 1;
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let n = (credit as usize).min(MAX_PKT_DATA).min(TOTAL - sent);
        g.send(ghdr(op::RW, 6000, 2000), &pattern[sent..sent + n]);
        sent += n;
        tx_cnt += n as u32;
    }
    let mut sd = ghdr(op::SHUTDOWN, 6000, 2000);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(sd, &[]);
    let (h, _) = loop {
        let p = g.next_pkt(10);
        if p.0.op != op::CREDIT_UPDATE {
            break p;
        }
    };
    assert_eq!(h.op, op::RST);
    let all = reader.join().unwrap();
    assert!(all == pattern, "data corrupted ({} bytes)", all.len());
    assert!(stalls > 0, "the guest never ran out of credit");
    std::fs::remove_file(format!("{}_2000", path.display())).unwrap();
}

#[test]
fn guest_ignoring_credit_is_reset() {
    let path = temp_sock("c3.sock");
    let mut g = Guest::new(&path, 8);
    let (_s, local) = host_connect(&mut g, 3);
    let chunk = vec![0x5au8; MAX_PKT_DATA];
    let mut reset = false;
    // Socket buffer (a few hundred KiB) + 256 KiB of credit; 64 MiB is far past both.
    for _ in 0..1024 {
        g.send(ghdr(op::RW, 3, local), &chunk);
        if g.received.iter().any(|(h, _)| h.op == op::RST) {
            reset = true;
            break;
        }
    }
    assert!(reset);
    assert_eq!(g.dev.connection_count(), 0);
}

#[test]
fn connection_limit_holds_both_ways() {
    let path = temp_sock("l1.sock");
    let mut g = Guest::new(&path, 2);
    let (_a, _) = host_connect(&mut g, 1);
    let listener = UnixListener::bind(format!("{}_9", path.display())).unwrap();
    g.send(ghdr(op::REQUEST, 100, 9), &[]);
    assert_eq!(g.next_pkt(5).0.op, op::RESPONSE);
    assert_eq!(g.dev.connection_count(), 2);
    // A third host connection is closed at once.
    let mut c = UnixStream::connect(&path).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    g.pump();
    let mut buf = [0u8; 4];
    assert_eq!(c.read(&mut buf).unwrap(), 0);
    // A third guest connection is refused.
    g.send(ghdr(op::REQUEST, 101, 9), &[]);
    let (h, _) = g.next_pkt(5);
    assert_eq!((h.op, h.dst_port), (op::RST, 101));
    assert_eq!(g.dev.connection_count(), 2);
    drop(listener);
    std::fs::remove_file(format!("{}_9", path.display())).unwrap();
    // Reset drops everything.
    g.dev.reset();
    assert_eq!(g.dev.connection_count(), 0);
}

#[test]
fn hostile_packets_get_rst_or_nothing() {
    let path = temp_sock("x1.sock");
    let mut g = Guest::new(&path, 8);
    // Unknown destination CID.
    let mut h = ghdr(op::REQUEST, 1, 2);
    h.dst_cid = 42;
    g.send(h, &[]);
    assert_eq!(g.next_pkt(5).0.op, op::RST);
    // Wrong type (SEQPACKET).
    let mut h = ghdr(op::REQUEST, 1, 2);
    h.type_ = 2;
    g.send(h, &[]);
    assert_eq!(g.next_pkt(5).0.op, op::RST);
    // Data, credit and unknown ops for no connection.
    for o in [
        op::RW,
        op::CREDIT_UPDATE,
        op::SHUTDOWN,
        op::RESPONSE,
        op::INVALID,
        99,
    ] {
        g.send(ghdr(o, 1, 2), b"x");
        let (r, _) = g.next_pkt(5);
        assert_eq!((r.op, r.src_port, r.dst_port), (op::RST, 2, 1));
    }
    // A RST for no connection, and a spoofed source CID: no answer.
    g.send(ghdr(op::RST, 1, 2), &[]);
    let mut h = ghdr(op::REQUEST, 1, 2);
    h.src_cid = 7;
    g.send(h, &[]);
    // Header too short, announced length past the chain, oversized length.
    g.send_raw(&[(TX_BUF_BASE, 20)]);
    let mut h = ghdr(op::RW, 1, 2);
    h.len = 1000;
    g.mem
        .write_slice(&h.to_bytes(), GuestAddress(TX_BUF_BASE))
        .unwrap();
    g.send_raw(&[(TX_BUF_BASE, 100)]);
    h.len = u32::MAX;
    g.mem
        .write_slice(&h.to_bytes(), GuestAddress(TX_BUF_BASE))
        .unwrap();
    g.send_raw(&[(TX_BUF_BASE, 44), (TX_BUF_BASE, u32::MAX)]);
    // Descriptors outside guest memory.
    g.send_raw(&[(MEM_SIZE as u64 - 4, 44)]);
    g.send_raw(&[(u64::MAX - 10, 44)]);
    g.send_raw(&[(TX_BUF_BASE, 44), (1 << 50, 10)]);
    g.assert_quiet();
    // An unexpected op on a live connection resets it.
    let (_s, local) = host_connect(&mut g, 8);
    g.send(ghdr(op::REQUEST, 8, local), &[]);
    assert_eq!(g.next_pkt(5).0.op, op::RST);
    assert_eq!(g.dev.connection_count(), 0);
    // The device still works.
    let _ = host_connect(&mut g, 9);
}

#[test]
fn hostile_rx_buffers_and_avail_index() {
    let path = temp_sock("x2.sock");
    let mut g = Guest::new(&path, 8);
    // Replace all RX buffers by bad ones: too small, out of memory.
    let used_before = g.qs[RX_QUEUE].used_seen();
    for i in 0..RX_BUFS {
        let (addr, len) = if i % 2 == 0 {
            (RX_BUF_BASE, 10)
        } else {
            (u64::MAX - 100, 4096)
        };
        g.write_desc(RX_QUEUE, i, addr, len, VRING_DESC_F_WRITE as u16);
    }
    // A packet is pending (RST for a stray RW); bad buffers are returned empty.
    g.send(ghdr(op::RW, 1, 2), b"x");
    assert!(g.qs[RX_QUEUE].used_seen() != used_before);
    assert!(g.received.is_empty());
    // Restore good buffers: the RST still arrives.
    for i in 0..RX_BUFS {
        g.write_desc(
            RX_QUEUE,
            i,
            RX_BUF_BASE + u64::from(i) * 0x2000,
            HDR_SIZE as u32 + RX_DATA,
            VRING_DESC_F_WRITE as u16,
        );
    }
    g.dev.process_queue_event(RX_QUEUE);
    g.collect();
    assert_eq!(g.next_pkt(5).0.op, op::RST);
    // A wild avail index (more entries than the queue holds) makes the queue unusable, not
    // the host: nothing is processed and nothing panics.
    g.mem
        .write_obj(
            g.qs[TX_QUEUE].avail_idx().wrapping_add(1000),
            GuestAddress(Q_BASE[TX_QUEUE] + 0x1002),
        )
        .unwrap();
    g.dev.process_queue_event(TX_QUEUE);
    g.assert_quiet();
}

#[test]
fn works_under_the_event_manager() {
    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    use std::sync::Mutex;
    let path = temp_sock("e1.sock");
    let g = Guest::new(&path, 8);
    let Guest { dev, mem, .. } = g;
    let dev = Arc::new(Mutex::new(dev));
    let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
        EventManager::new().unwrap();
    em.add_subscriber(dev.clone());
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(b"CONNECT 1024\n").unwrap();
    // The REQUEST lands in the first RX buffer without anyone calling the device directly.
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        em.run_with_timeout(50).unwrap();
        let idx: u16 = mem
            .read_obj(GuestAddress(Q_BASE[RX_QUEUE] + 0x2002))
            .unwrap();
        if idx > 0 {
            break;
        }
        assert!(Instant::now() < end, "no REQUEST through the event manager");
    }
    let mut raw = [0u8; HDR_SIZE];
    mem.read_slice(&mut raw, GuestAddress(RX_BUF_BASE)).unwrap();
    assert_eq!(VsockHeader::from_bytes(&raw).op, op::REQUEST);
}

/// A small deterministic PRNG (xorshift64*), so the fuzz test needs no extra crate.
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
fn random_guest_traffic_never_panics_and_stays_bounded() {
    let path = temp_sock("f1.sock");
    let mut g = Guest::new(&path, 6);
    let listener = UnixListener::bind(format!("{}_1", path.display())).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut accepted = Vec::new();
    let mut hosts = Vec::new();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut buf = vec![0u8; 70_000];
    let mut seen = [0u32; 9];
    for round in 0..20_000u32 {
        match rng.below(10) {
            // A packet with mostly-plausible header fields.
            0..=5 => {
                let mut h = ghdr(
                    rng.below(9) as u16,
                    rng.below(3) as u32,
                    if rng.below(4) == 0 {
                        (1u32 << 30) + rng.below(3) as u32
                    } else {
                        rng.below(3) as u32
                    },
                );
                if rng.below(20) == 0 {
                    h.dst_cid = rng.next();
                }
                if rng.below(20) == 0 {
                    h.type_ = rng.below(4) as u16;
                }
                h.flags = rng.below(4) as u32;
                h.buf_alloc = rng.next() as u32;
                h.fwd_cnt = rng.next() as u32;
                let len = match rng.below(4) {
                    0 => 0,
                    1 => rng.below(64) as usize,
                    2 => rng.below(70_000) as usize,
                    _ => 4096,
                };
                g.send(h, &buf[..len]);
            }
            // A raw chain with random addresses and lengths (and header bytes).
            6 => {
                for b in buf.iter_mut().take(64) {
                    *b = rng.next() as u8;
                }
                g.mem
                    .write_slice(&buf[..64], GuestAddress(TX_BUF_BASE))
                    .unwrap();
                let n = 1 + rng.below(4) as usize;
                let descs: Vec<(u64, u32)> = (0..n)
                    .map(|_| {
                        let addr = match rng.below(3) {
                            0 => TX_BUF_BASE,
                            1 => rng.below(MEM_SIZE as u64 + 0x1000),
                            _ => rng.next(),
                        };
                        (addr, rng.next() as u32 >> rng.below(32))
                    })
                    .collect();
                g.send_raw(&descs);
            }
            // Host side activity.
            7 => {
                if hosts.len() < 8 {
                    if let Ok(mut s) = UnixStream::connect(&path) {
                        s.set_nonblocking(true).unwrap();
                        let _ = s.write_all(format!("CONNECT {}\n", rng.below(3)).as_bytes());
                        hosts.push(s);
                    }
                } else {
                    hosts.remove(rng.below(hosts.len() as u64) as usize);
                }
            }
            8 => {
                while let Ok((s, _)) = listener.accept() {
                    s.set_nonblocking(true).unwrap();
                    accepted.push(s);
                }
                for s in accepted.iter_mut().chain(hosts.iter_mut()) {
                    let _ = s.read(&mut buf);
                    let _ = s.write(&buf[..rng.below(5000) as usize]);
                }
                if accepted.len() > 4 {
                    accepted.remove(0);
                }
            }
            _ => g.pump(),
        }
        // Whatever the device sent must be well formed and addressed to the guest.
        while let Some((h, d)) = g.received.pop_front() {
            assert_eq!((h.src_cid, h.dst_cid, h.type_), (2, GUEST_CID, TYPE_STREAM));
            assert_eq!(h.len as usize, d.len());
            assert!(d.len() <= RX_DATA as usize);
            seen[usize::from(h.op).min(8)] += 1;
        }
        assert!(g.dev.connection_count() <= 6, "round {round}");
    }
    assert_eq!(g.bad_rx, 0);
    eprintln!("ops seen by the guest: {seen:?}");
    // The run reached real connections, not only the stray-packet path.
    for o in [op::REQUEST, op::RESPONSE, op::RST, op::RW] {
        assert!(seen[usize::from(o)] > 0, "op {o} never seen: {seen:?}");
    }
    std::fs::remove_file(format!("{}_1", path.display())).unwrap();
}
