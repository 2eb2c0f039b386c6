//! Unit tests of one connection on its own: a real Unix stream pair, no muxer, no device.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use super::*;

const GUEST_CID: u64 = 3;
const GUEST_PORT: u32 = 5000;
const HOST_PORT: u32 = 1024;

/// Our end (non-blocking, as the muxer sets it) and the host peer's end of a stream.
fn stream_pair() -> (UnixStream, UnixStream) {
    let (ours, peer) = UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    (ours, peer)
}

/// A header from the guest's port to `local_port`.
fn from_guest(op: u16, local_port: u32, buf_alloc: u32, fwd_cnt: u32) -> VsockHeader {
    VsockHeader {
        src_cid: GUEST_CID,
        dst_cid: VSOCK_HOST_CID,
        src_port: GUEST_PORT,
        dst_port: local_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc,
        fwd_cnt,
    }
}

/// A guest-initiated connection whose RESPONSE went out.
fn established(stream: UnixStream, buf_alloc: u32) -> Connection {
    let h = from_guest(op::REQUEST, HOST_PORT, buf_alloc, 0);
    let mut conn = Connection::guest_initiated(stream, &h);
    let (pkt, outcome) = conn.next_rx(GUEST_CID, 4096);
    assert_eq!(pkt.unwrap().hdr.op, op::RESPONSE);
    assert_eq!(outcome, Outcome::Keep);
    conn
}

#[test]
fn connect_line_parsing() {
    assert_eq!(parse_connect(b"CONNECT 1024"), Some(1024));
    assert_eq!(parse_connect(b"CONNECT 1024\r"), Some(1024));
    assert_eq!(parse_connect(b"CONNECT 4294967295"), Some(u32::MAX));
    assert_eq!(parse_connect(b"CONNECT 4294967296"), None);
    assert_eq!(parse_connect(b"CONNECT "), None);
    assert_eq!(parse_connect(b"CONNECT +1"), None);
    assert_eq!(parse_connect(b"connect 1"), None);
    assert_eq!(parse_connect(b"CONNECT 1 2"), None);
    assert_eq!(parse_connect(&[0xff, 0xfe]), None);
}

#[test]
fn host_initiated_handshake_consumes_only_the_connect_line() {
    let (ours, mut host) = stream_pair();
    let mut conn = Connection::accepted(ours);
    assert_eq!(conn.interest(), EventSet::IN);
    assert_eq!(conn.rst_for_guest(GUEST_CID), None);
    host.write_all(b"CONNECT 52").unwrap();
    assert_eq!(conn.read_connect_line(), ConnectLine::Incomplete);
    host.write_all(b"\nrest").unwrap();
    assert_eq!(conn.read_connect_line(), ConnectLine::Port(52));

    conn.request_guest(HOST_PORT, 52);
    assert_eq!(conn.state(), State::LocalInit);
    assert_eq!(conn.ports(), (HOST_PORT, 52));
    assert_eq!(conn.interest(), EventSet::READ_HANG_UP);
    assert_eq!(conn.request_deadline(), None);
    let (pkt, outcome) = conn.next_rx(GUEST_CID, 4096);
    let hdr = pkt.unwrap().hdr;
    assert_eq!(outcome, Outcome::Keep);
    assert_eq!(
        (
            hdr.op,
            hdr.src_port,
            hdr.dst_port,
            hdr.dst_cid,
            hdr.buf_alloc
        ),
        (op::REQUEST, HOST_PORT, 52, GUEST_CID, CONN_BUF_ALLOC)
    );
    assert!(conn.request_deadline().is_some());
    assert!(!conn.has_pending_rx());

    let mut answer = from_guest(op::RESPONSE, HOST_PORT, 4096, 0);
    answer.src_port = 52;
    assert_eq!(conn.on_packet(&answer, Vec::new()), Outcome::Keep);
    assert_eq!(conn.state(), State::Established);
    assert_eq!(conn.request_deadline(), None);
    let mut line = [0u8; 32];
    let n = host.read(&mut line).unwrap();
    assert_eq!(&line[..n], b"OK 1024\n");
    // The OK line is ours: the guest's credit counts only its own data.
    assert_eq!(conn.fwd_cnt.0, 0);

    // What the host wrote after the line is the connection's first data.
    assert!(conn.interest().contains(EventSet::IN));
    assert_eq!(conn.on_stream_event(EventSet::IN, true), Outcome::Keep);
    let (pkt, outcome) = conn.next_rx(GUEST_CID, 4096);
    let pkt = pkt.unwrap();
    assert_eq!(outcome, Outcome::Keep);
    assert_eq!((pkt.hdr.op, &pkt.data[..]), (op::RW, &b"rest"[..]));
}

#[test]
fn connect_lines_too_long_or_cut_short_are_bad() {
    let (ours, mut host) = stream_pair();
    let mut conn = Connection::accepted(ours);
    host.write_all(&[b'1'; MAX_CONNECT_LINE + 1]).unwrap();
    assert_eq!(conn.read_connect_line(), ConnectLine::Bad);

    let (ours, mut host) = stream_pair();
    let mut conn = Connection::accepted(ours);
    host.write_all(b"CONNECT 1").unwrap();
    drop(host);
    assert_eq!(conn.read_connect_line(), ConnectLine::Bad);
}

#[test]
fn host_data_stays_within_the_guest_credit_and_the_rx_buffer() {
    let (ours, mut host) = stream_pair();
    let mut conn = established(ours, 10);
    host.write_all(&[7u8; 25]).unwrap();
    assert!(conn.interest().contains(EventSet::IN));
    assert_eq!(conn.on_stream_event(EventSet::IN, true), Outcome::Keep);
    // A read is pending: no more input until it is done.
    assert!(!conn.interest().contains(EventSet::IN));
    let (pkt, _) = conn.next_rx(GUEST_CID, 4096);
    assert_eq!(pkt.unwrap().data.len(), 10);
    // Out of credit: one CREDIT_REQUEST, and the stream is not polled for input.
    let (pkt, _) = conn.next_rx(GUEST_CID, 4096);
    assert_eq!(pkt.unwrap().hdr.op, op::CREDIT_REQUEST);
    assert!(!conn.interest().contains(EventSet::IN));
    assert!(!conn.has_pending_rx());
    assert_eq!(conn.on_stream_event(EventSet::IN, false), Outcome::Keep);
    assert!(!conn.has_pending_rx());

    // The guest consumed the 10 bytes: credit for 10 more, read 4 at a time.
    let update = from_guest(op::CREDIT_UPDATE, HOST_PORT, 10, 10);
    assert_eq!(conn.on_packet(&update, Vec::new()), Outcome::Keep);
    assert!(conn.interest().contains(EventSet::IN));
    assert_eq!(conn.on_stream_event(EventSet::IN, true), Outcome::Keep);
    let (pkt, _) = conn.next_rx(GUEST_CID, 4);
    assert_eq!(pkt.unwrap().data.len(), 4);
    // An RX buffer with no room for data leaves the read pending.
    assert_eq!(conn.on_stream_event(EventSet::IN, true), Outcome::Keep);
    assert_eq!(conn.next_rx(GUEST_CID, 0), (None, Outcome::Keep));
    assert!(conn.has_pending_rx());
}

#[test]
fn guest_data_is_buffered_up_to_the_advertised_credit_and_no_further() {
    let (ours, _host) = stream_pair();
    let mut conn = established(ours, 4096);
    let rw = from_guest(op::RW, HOST_PORT, 4096, 0);
    // The host peer reads nothing: the socket takes what it can, the rest is buffered.
    let mut sent = 0usize;
    while conn.tx_buf.len() < CONN_BUF_ALLOC as usize {
        let n = MAX_PKT_DATA.min(CONN_BUF_ALLOC as usize - conn.tx_buf.len());
        assert_eq!(conn.on_packet(&rw, vec![1; n]), Outcome::Keep);
        sent += n;
        assert_eq!(conn.fwd_cnt.0 as usize + conn.tx_buf.len(), sent);
    }
    assert!(conn.interest().contains(EventSet::OUT));
    assert_eq!(
        conn.on_packet(&rw, vec![1; OK_LINE_ROOM]),
        Outcome::Keep,
        "the slack for the OK line"
    );
    assert_eq!(conn.on_packet(&rw, vec![1]), Outcome::Kill(true));
}

#[test]
fn guest_credit_requests_and_returned_credit() {
    let (ours, mut host) = stream_pair();
    let mut conn = established(ours, 4096);
    let rw = from_guest(op::RW, HOST_PORT, 4096, 0);
    let chunk = CREDIT_UPDATE_THRESHOLD as usize / 2;
    let mut sink = vec![0u8; CREDIT_UPDATE_THRESHOLD as usize];
    for _ in 0..2 {
        assert!(!conn.has_pending_rx());
        assert_eq!(conn.on_packet(&rw, vec![1; chunk]), Outcome::Keep);
        host.read_exact(&mut sink[..chunk]).unwrap();
    }
    // Threshold reached: a CREDIT_UPDATE without being asked.
    let (pkt, _) = conn.next_rx(GUEST_CID, 4096);
    let hdr = pkt.unwrap().hdr;
    assert_eq!((hdr.op, hdr.fwd_cnt), (op::CREDIT_UPDATE, 2 * chunk as u32));
    // And one whenever the guest asks.
    let ask = from_guest(op::CREDIT_REQUEST, HOST_PORT, 4096, 0);
    assert_eq!(conn.on_packet(&ask, Vec::new()), Outcome::Keep);
    let (pkt, _) = conn.next_rx(GUEST_CID, 4096);
    assert_eq!(pkt.unwrap().hdr.op, op::CREDIT_UPDATE);
}

#[test]
fn shutdowns_and_resets() {
    // Both directions shut with nothing buffered: done, with a RST.
    let (ours, _host) = stream_pair();
    let mut conn = established(ours, 4096);
    let mut shut = from_guest(op::SHUTDOWN, HOST_PORT, 4096, 0);
    shut.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    assert_eq!(conn.on_packet(&shut, Vec::new()), Outcome::Kill(true));
    let rst = conn.rst_for_guest(GUEST_CID).unwrap();
    assert_eq!(
        (rst.op, rst.src_port, rst.dst_port),
        (op::RST, HOST_PORT, GUEST_PORT)
    );

    // The guest stops sending: the host stream's write side is shut; data after it resets.
    let (ours, mut host) = stream_pair();
    let mut conn = established(ours, 4096);
    shut.flags = SHUTDOWN_SEND;
    assert_eq!(conn.on_packet(&shut, Vec::new()), Outcome::Keep);
    let mut rest = Vec::new();
    host.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    let rw = from_guest(op::RW, HOST_PORT, 4096, 0);
    assert_eq!(conn.on_packet(&rw, vec![1]), Outcome::Kill(true));

    // The host closes its end: SHUTDOWN(SEND) to the guest.
    let (ours, host) = stream_pair();
    let mut conn = established(ours, 4096);
    drop(host);
    assert_eq!(
        conn.on_stream_event(EventSet::IN | EventSet::HANG_UP, true),
        Outcome::Keep
    );
    let (pkt, outcome) = conn.next_rx(GUEST_CID, 4096);
    let hdr = pkt.unwrap().hdr;
    assert_eq!((hdr.op, hdr.flags), (op::SHUTDOWN, SHUTDOWN_SEND));
    assert_eq!(outcome, Outcome::Keep);
    assert!(!conn.interest().contains(EventSet::IN));

    // A guest RST ends it silently; an op out of place ends it with a RST.
    let (ours, _host) = stream_pair();
    let mut conn = established(ours, 4096);
    let reset = from_guest(op::RST, HOST_PORT, 0, 0);
    assert_eq!(conn.on_packet(&reset, Vec::new()), Outcome::Kill(false));
    let (ours, _host) = stream_pair();
    let mut conn = established(ours, 4096);
    let answer = from_guest(op::RESPONSE, HOST_PORT, 4096, 0);
    assert_eq!(conn.on_packet(&answer, Vec::new()), Outcome::Kill(true));
}

#[test]
fn a_host_giving_up_during_the_handshake() {
    // Before the REQUEST went out the guest knows nothing: no RST.
    let (ours, _host) = stream_pair();
    let mut conn = Connection::accepted(ours);
    conn.request_guest(HOST_PORT, 52);
    assert_eq!(
        conn.on_stream_event(EventSet::HANG_UP, false),
        Outcome::Kill(false)
    );
    // After it, the guest is told.
    let (ours, _host) = stream_pair();
    let mut conn = Connection::accepted(ours);
    conn.request_guest(HOST_PORT, 52);
    let _ = conn.next_rx(GUEST_CID, 4096);
    assert_eq!(
        conn.on_stream_event(EventSet::HANG_UP, false),
        Outcome::Kill(true)
    );
}
