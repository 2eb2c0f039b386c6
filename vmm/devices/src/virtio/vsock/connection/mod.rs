//! One hybrid-vsock connection: its state machine, its virtio-vsock credit flow control both
//! ways, and the host Unix stream it is joined to.
//!
//! States: a host-initiated connection starts in `AwaitingConnect` (reading `CONNECT <port>\n`
//! from the host stream), sends the guest a REQUEST in `LocalInit` and becomes `Established` on
//! the guest's RESPONSE; a guest-initiated one starts `Established` with a RESPONSE to send. A
//! guest SHUTDOWN of both directions moves it to `Closing` (flush what is buffered, then RST).
//!
//! Flow control (virtio spec 5.10.6.3):
//! - guest to host: the connection advertises `buf_alloc` = [`CONN_BUF_ALLOC`] and `fwd_cnt` =
//!   bytes written to the Unix stream. Data the stream does not take at once is buffered, never
//!   more than `buf_alloc`: a guest sending past its credit is reset. Credit is returned with a
//!   CREDIT_UPDATE after [`CREDIT_UPDATE_THRESHOLD`] bytes, or on CREDIT_REQUEST.
//! - host to guest: the stream is read only while the guest has credit (`peer_buf_alloc -
//!   (rx_cnt - peer_fwd_cnt)`) and only as much as the credit and the RX buffer allow; at zero
//!   credit the connection sends one CREDIT_REQUEST and stops asking to be polled for input.
//!
//! A connection knows nothing of the others, of epoll or of tokens: it says which events it
//! wants from its stream ([`Connection::interest`]) and, after each step, whether the muxer
//! ([`super::muxer`]) keeps it or kills it ([`Outcome`]). The muxer owns the connections, finds
//! them by port pair, keeps their epoll registration and queues them for RX buffers.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use vmm_sys_util::epoll::EventSet;

use super::packet::{RxPacket, VsockHeader};
use super::{
    op, CONNECT_TIMEOUT, CONN_BUF_ALLOC, CREDIT_UPDATE_THRESHOLD, MAX_CONNECT_LINE, MAX_PKT_DATA,
    SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM, VSOCK_HOST_CID,
};

/// Room for the `OK <port>\n` line on top of the guest's data in a connection's buffer.
const OK_LINE_ROOM: usize = 16;

/// Pending packets of a connection.
mod pending {
    pub const REQUEST: u8 = 1;
    pub const RESPONSE: u8 = 2;
    pub const CREDIT_UPDATE: u8 = 4;
    pub const CREDIT_REQUEST: u8 = 8;
    pub const RW: u8 = 16;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Accepted on the listener, reading `CONNECT <port>\n`.
    AwaitingConnect,
    /// REQUEST queued or sent to the guest, waiting for its RESPONSE.
    LocalInit,
    /// Data flows.
    Established,
    /// The guest shut down both directions: flush what is buffered, then RST.
    Closing,
}

/// What to do with a connection after handling something for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Keep,
    /// Remove it; with `true`, tell the guest with a RST.
    Kill(bool),
}

/// Where reading the host's `CONNECT <port>\n` line stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConnectLine {
    /// The stream has no more bytes for now; the line is not complete yet.
    Incomplete,
    /// The host asked for this guest port.
    Port(u32),
    /// Not a valid line (too long, malformed, or the stream ended or failed).
    Bad,
}

pub(super) struct Connection {
    stream: UnixStream,
    state: State,
    local_port: u32,
    peer_port: u32,
    pending: u8,
    /// The `CONNECT` line read so far.
    line: Vec<u8>,
    /// When a host-initiated REQUEST times out (set once it is handed to the guest).
    deadline: Option<Instant>,
    // Guest to host.
    tx_buf: VecDeque<u8>,
    /// Bytes at the front of `tx_buf` that are ours (the OK line), not the guest's.
    tx_own: usize,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    // Host to guest.
    rx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    credit_requested: bool,
    /// The host stream reached EOF; SHUTDOWN(SEND) went to the guest.
    host_eof: bool,
    peer_shut_rcv: bool,
    peer_shut_send: bool,
}

impl Connection {
    fn new(stream: UnixStream, state: State) -> Self {
        Self {
            stream,
            state,
            local_port: 0,
            peer_port: 0,
            pending: 0,
            line: Vec::new(),
            deadline: None,
            tx_buf: VecDeque::new(),
            tx_own: 0,
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            credit_requested: false,
            host_eof: false,
            peer_shut_rcv: false,
            peer_shut_send: false,
        }
    }

    /// A host connection just accepted on the listener: it has to send `CONNECT <port>\n`.
    pub(super) fn accepted(stream: UnixStream) -> Self {
        Self::new(stream, State::AwaitingConnect)
    }

    /// The connection the guest asked for with the REQUEST `h`, its host stream connected:
    /// established, with the RESPONSE to send.
    pub(super) fn guest_initiated(stream: UnixStream, h: &VsockHeader) -> Self {
        let mut conn = Self::new(stream, State::Established);
        conn.local_port = h.dst_port;
        conn.peer_port = h.src_port;
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(h.fwd_cnt);
        conn.pending = pending::RESPONSE;
        conn
    }

    pub(super) fn state(&self) -> State {
        self.state
    }

    /// (host-side port, guest port): what the guest's packets name the connection by.
    pub(super) fn ports(&self) -> (u32, u32) {
        (self.local_port, self.peer_port)
    }

    /// Whether the connection has packets for the guest (or wants to read its stream for one).
    pub(super) fn has_pending_rx(&self) -> bool {
        self.pending != 0
    }

    /// When the REQUEST sent to the guest times out, while the connection waits for the answer.
    pub(super) fn request_deadline(&self) -> Option<Instant> {
        if self.state == State::LocalInit {
            self.deadline
        } else {
            None
        }
    }

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// The events the connection wants from its stream now (empty: do not poll it). No input
    /// is asked for while the guest has no credit or a read is already pending, so a readable
    /// stream that cannot make progress never spins the event loop.
    pub(super) fn interest(&self) -> EventSet {
        match self.state {
            State::AwaitingConnect => EventSet::IN,
            State::LocalInit => EventSet::READ_HANG_UP,
            State::Established | State::Closing => {
                let mut s = EventSet::empty();
                if !self.tx_buf.is_empty() {
                    s |= EventSet::OUT;
                }
                if self.state == State::Established
                    && !self.host_eof
                    && !self.peer_shut_rcv
                    && self.pending & pending::RW == 0
                    && self.peer_credit() > 0
                {
                    s |= EventSet::IN;
                }
                s
            }
        }
    }

    fn header(&self, guest_cid: u64, op: u16) -> VsockHeader {
        VsockHeader {
            src_cid: VSOCK_HOST_CID,
            dst_cid: guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    /// The RST that tells the guest the connection is gone; none while the guest has not heard
    /// of it (the host has not sent its `CONNECT` line yet).
    pub(super) fn rst_for_guest(&self, guest_cid: u64) -> Option<VsockHeader> {
        (self.state != State::AwaitingConnect).then(|| self.header(guest_cid, op::RST))
    }

    /// Reads the `CONNECT <port>\n` line a byte at a time, so nothing past it is consumed.
    pub(super) fn read_connect_line(&mut self) -> ConnectLine {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => {
                    return match parse_connect(&self.line) {
                        Some(port) => ConnectLine::Port(port),
                        None => ConnectLine::Bad,
                    }
                }
                Ok(1) if self.line.len() < MAX_CONNECT_LINE => self.line.push(byte[0]),
                Ok(_) => return ConnectLine::Bad,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ConnectLine::Incomplete,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return ConnectLine::Bad,
            }
        }
    }

    /// The host asked for guest port `peer_port` and the muxer gave the connection the host-side
    /// port `local_port`: ask the guest with a REQUEST.
    pub(super) fn request_guest(&mut self, local_port: u32, peer_port: u32) {
        self.local_port = local_port;
        self.peer_port = peer_port;
        self.state = State::LocalInit;
        self.line = Vec::new();
        self.pending |= pending::REQUEST;
    }

    /// The stream reported `evset`; `polled_in` says whether input was asked for. Not for a
    /// connection in `AwaitingConnect`: the muxer reads its `CONNECT` line
    /// ([`Connection::read_connect_line`]) instead, since it picks the port.
    pub(super) fn on_stream_event(&mut self, evset: EventSet, polled_in: bool) -> Outcome {
        match self.state {
            State::AwaitingConnect => Outcome::Keep,
            // The host gave up before the guest answered.
            State::LocalInit => Outcome::Kill(self.pending & pending::REQUEST == 0),
            State::Established | State::Closing => {
                let mut outcome = Outcome::Keep;
                if evset.intersects(EventSet::OUT | EventSet::HANG_UP | EventSet::ERROR)
                    && !self.tx_buf.is_empty()
                {
                    outcome = self.flush();
                }
                if outcome == Outcome::Keep
                    && polled_in
                    && evset.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR)
                {
                    self.pending |= pending::RW;
                }
                outcome
            }
        }
    }

    /// Writes buffered guest data to the host stream.
    fn flush(&mut self) -> Outcome {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Outcome::Kill(true),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    let own = n.min(self.tx_own);
                    self.tx_own -= own;
                    // n - own <= CONN_BUF_ALLOC, fits u32.
                    self.fwd_cnt += Wrapping((n - own) as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!("vsock: writing to the host stream: {e}");
                    return Outcome::Kill(true);
                }
            }
        }
        if (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            self.pending |= pending::CREDIT_UPDATE;
        }
        if self.tx_buf.is_empty() {
            if self.state == State::Closing || (self.peer_shut_send && self.host_eof) {
                return Outcome::Kill(true);
            }
            if self.peer_shut_send {
                let _ = self.stream.shutdown(Shutdown::Write);
            }
        }
        Outcome::Keep
    }

    /// Takes a packet the guest sent to this connection: header `h`, its `data`.
    pub(super) fn on_packet(&mut self, h: &VsockHeader, data: Vec<u8>) -> Outcome {
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd_cnt = Wrapping(h.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
        match (self.state, h.op) {
            (_, op::RST) => Outcome::Kill(false),
            (State::LocalInit, op::RESPONSE) => {
                self.state = State::Established;
                self.deadline = None;
                let line = format!("OK {}\n", self.local_port);
                self.tx_own += line.len();
                self.tx_buf.extend(line.as_bytes());
                self.flush()
            }
            (State::Established | State::Closing, op::RW) => self.guest_data(&data),
            (State::Established | State::Closing, op::CREDIT_UPDATE) => Outcome::Keep,
            (State::Established | State::Closing, op::CREDIT_REQUEST) => {
                self.pending |= pending::CREDIT_UPDATE;
                Outcome::Keep
            }
            (State::Established, op::SHUTDOWN) => {
                self.peer_shut_rcv |= h.flags & SHUTDOWN_RCV != 0;
                self.peer_shut_send |= h.flags & SHUTDOWN_SEND != 0;
                if self.peer_shut_rcv && self.peer_shut_send {
                    self.state = State::Closing;
                }
                if self.peer_shut_rcv {
                    self.pending &= !pending::RW;
                }
                if self.tx_buf.is_empty() {
                    self.flush()
                } else {
                    Outcome::Keep
                }
            }
            (State::Closing, op::SHUTDOWN) => Outcome::Keep,
            _ => {
                log::debug!(
                    "vsock: unexpected op {} in state {:?}, resetting",
                    h.op,
                    self.state
                );
                Outcome::Kill(true)
            }
        }
    }

    /// An RW packet's data: written to the host stream, what it does not take buffered within
    /// the credit the connection advertised.
    fn guest_data(&mut self, data: &[u8]) -> Outcome {
        if self.state == State::Closing || self.peer_shut_send {
            return Outcome::Kill(true);
        }
        let buffered = self.tx_buf.len() + data.len();
        if buffered > CONN_BUF_ALLOC as usize + OK_LINE_ROOM {
            log::debug!(
                "vsock: guest exceeded its credit on port {}",
                self.local_port
            );
            return Outcome::Kill(true);
        }
        let mut rest = data;
        if self.tx_buf.is_empty() {
            // The common case: the stream takes it all, nothing is buffered.
            while !rest.is_empty() {
                match self.stream.write(rest) {
                    Ok(0) => return Outcome::Kill(true),
                    Ok(n) => {
                        rest = &rest[n..];
                        // n <= MAX_PKT_DATA.
                        self.fwd_cnt += Wrapping(n as u32);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        log::debug!("vsock: writing to the host stream: {e}");
                        return Outcome::Kill(true);
                    }
                }
            }
        }
        let buffered = self.tx_buf.len() + rest.len();
        if self.tx_buf.capacity() < buffered {
            // Allocate the whole bounded buffer once, not a doubling of it.
            let full = CONN_BUF_ALLOC as usize + OK_LINE_ROOM;
            self.tx_buf.reserve_exact(full - self.tx_buf.len());
        }
        self.tx_buf.extend(rest);
        self.flush()
    }

    /// A control packet (no data) for the guest, clearing its pending `bit`; it carries the
    /// current `fwd_cnt`, so a pending CREDIT_UPDATE is answered by it too.
    fn control(&mut self, guest_cid: u64, bit: u8, op: u16) -> Option<RxPacket> {
        self.pending &= !bit;
        let hdr = self.header(guest_cid, op);
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.pending &= !pending::CREDIT_UPDATE;
        Some(RxPacket {
            hdr,
            data: Vec::new(),
        })
    }

    /// The next packet for the guest, with at most `max_data` bytes of data: pending control
    /// packets first, then data read from the host stream within the guest's credit. A REQUEST
    /// starts its [`CONNECT_TIMEOUT`] when it is handed out.
    pub(super) fn next_rx(
        &mut self,
        guest_cid: u64,
        max_data: usize,
    ) -> (Option<RxPacket>, Outcome) {
        if self.pending & pending::REQUEST != 0 {
            self.deadline = Some(Instant::now() + CONNECT_TIMEOUT);
            let p = self.control(guest_cid, pending::REQUEST, op::REQUEST);
            return (p, Outcome::Keep);
        }
        if self.pending & pending::RESPONSE != 0 {
            return (
                self.control(guest_cid, pending::RESPONSE, op::RESPONSE),
                Outcome::Keep,
            );
        }
        if self.pending & pending::CREDIT_UPDATE != 0 {
            return (
                self.control(guest_cid, pending::CREDIT_UPDATE, op::CREDIT_UPDATE),
                Outcome::Keep,
            );
        }
        if self.pending & pending::CREDIT_REQUEST != 0 {
            return (
                self.control(guest_cid, pending::CREDIT_REQUEST, op::CREDIT_REQUEST),
                Outcome::Keep,
            );
        }
        if self.pending & pending::RW == 0 {
            return (None, Outcome::Keep);
        }
        if self.state != State::Established || self.host_eof || self.peer_shut_rcv {
            self.pending &= !pending::RW;
            return (None, Outcome::Keep);
        }
        let credit = self.peer_credit() as usize;
        if credit == 0 {
            self.pending &= !pending::RW;
            if !self.credit_requested {
                self.credit_requested = true;
                return (
                    self.control(guest_cid, pending::CREDIT_REQUEST, op::CREDIT_REQUEST),
                    Outcome::Keep,
                );
            }
            return (None, Outcome::Keep);
        }
        let n = max_data.min(credit).min(MAX_PKT_DATA);
        if n == 0 {
            // No room in this buffer: stay pending for a larger one.
            return (None, Outcome::Keep);
        }
        let mut data = vec![0u8; n];
        let read = loop {
            match self.stream.read(&mut data) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => break r,
            }
        };
        self.pending &= !pending::RW;
        match read {
            Ok(0) => {
                self.host_eof = true;
                let mut hdr = self.header(guest_cid, op::SHUTDOWN);
                hdr.flags = SHUTDOWN_SEND;
                self.last_fwd_cnt_sent = self.fwd_cnt;
                let outcome = if self.peer_shut_send && self.tx_buf.is_empty() {
                    Outcome::Kill(true)
                } else {
                    Outcome::Keep
                };
                (Some(RxPacket { hdr, data }), outcome)
            }
            Ok(n) => {
                data.truncate(n);
                // n <= MAX_PKT_DATA.
                self.rx_cnt += Wrapping(n as u32);
                if self.peer_credit() == 0 && !self.credit_requested {
                    // Stalled from now on: ask once, in case the guest does not volunteer.
                    self.credit_requested = true;
                    self.pending |= pending::CREDIT_REQUEST;
                }
                let hdr = self.header(guest_cid, op::RW);
                self.last_fwd_cnt_sent = self.fwd_cnt;
                self.pending &= !pending::CREDIT_UPDATE;
                (Some(RxPacket { hdr, data }), Outcome::Keep)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => (None, Outcome::Keep),
            Err(e) => {
                log::debug!("vsock: reading the host stream: {e}");
                (None, Outcome::Kill(true))
            }
        }
    }
}

impl AsRawFd for Connection {
    /// The host stream's fd (what the muxer polls for this connection).
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

/// Parses `CONNECT <port>` (the line without its newline).
fn parse_connect(line: &[u8]) -> Option<u32> {
    let line = std::str::from_utf8(line).ok()?;
    let port = line.strip_prefix("CONNECT ")?.trim_end_matches('\r');
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}

#[cfg(test)]
mod tests;
