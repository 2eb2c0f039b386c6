//! The host side of hybrid vsock: the Unix listener at `uds_path`, one Unix stream per
//! connection, and the per-connection state machine with virtio-vsock credit flow control.
//!
//! The muxer owns an epoll set (the listener, a connect-timeout timer and the connection
//! streams); the device registers that epoll fd with the device event loop and calls
//! [`VsockMuxer::process_events`] when it is readable. Packets from the guest arrive through
//! [`VsockMuxer::send_pkt`]; packets for the guest are pulled with [`VsockMuxer::recv_pkt`]
//! whenever the guest has posted RX buffers.
//!
//! Flow control (virtio spec 5.10.6.3):
//! - guest to host: each connection advertises `buf_alloc` = [`CONN_BUF_ALLOC`] and `fwd_cnt` =
//!   bytes written to the Unix stream. Data the stream does not take at once is buffered, never
//!   more than `buf_alloc`: a guest sending past its credit is reset. Credit is returned with a
//!   CREDIT_UPDATE after [`CREDIT_UPDATE_THRESHOLD`] bytes, or on CREDIT_REQUEST.
//! - host to guest: the stream is read only while the guest has credit (`peer_buf_alloc -
//!   (rx_cnt - peer_fwd_cnt)`) and only as much as the credit and the RX buffer allow; at zero
//!   credit the connection sends one CREDIT_REQUEST and stops polling the stream.
//!
//! Epoll interest is recomputed after every change, and a connection that cannot make progress
//! is not polled at all, so a readable stream with no credit never spins the event loop.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Instant;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::packet::{TxPacket, VsockHeader};
use super::{
    op, VsockError, CONNECT_TIMEOUT, CONN_BUF_ALLOC, CREDIT_UPDATE_THRESHOLD, MAX_CONNECT_LINE,
    MAX_PKT_DATA, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM, VSOCK_HOST_CID,
};

/// A packet for the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RxPacket {
    /// The header; `len` is set when it is written to the guest.
    pub hdr: VsockHeader,
    pub data: Vec<u8>,
}

/// Longest path of a `sockaddr_un` (without the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;
/// Epoll token of the listener.
const TOKEN_LISTENER: u64 = 0;
/// Epoll token of the connect-timeout timer.
const TOKEN_TIMER: u64 = 1;
/// First token of a connection.
const FIRST_CONN_TOKEN: u64 = 2;
/// First local port handed to host-initiated connections.
const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// Cap on replies to stray packets waiting for RX buffers; more are dropped.
const MAX_STRAY_REPLIES: usize = 1024;
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
enum State {
    /// Accepted on the listener, reading `CONNECT <port>\n`.
    AwaitingConnect,
    /// REQUEST queued or sent to the guest, waiting for its RESPONSE.
    LocalInit,
    /// Data flows.
    Established,
    /// The guest shut down both directions: flush what is buffered, then RST.
    Closing,
}

struct Connection {
    stream: UnixStream,
    state: State,
    local_port: u32,
    peer_port: u32,
    pending: u8,
    /// In the muxer's RX queue.
    queued: bool,
    /// The epoll interest currently registered (empty: not registered).
    registered: EventSet,
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
            queued: false,
            registered: EventSet::empty(),
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

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn interest(&self) -> EventSet {
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
}

/// What to do with a connection after handling something for it.
enum Outcome {
    Keep,
    /// Remove it; with `true`, tell the guest with a RST.
    Kill(bool),
}

/// The host side of the vsock device.
pub struct VsockMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    timer: TimerFd,
    conns: HashMap<u64, Connection>,
    /// (local port, guest port) to token.
    by_key: HashMap<(u32, u32), u64>,
    next_token: u64,
    next_local_port: u32,
    /// Connections with packets for the guest.
    rxq: VecDeque<u64>,
    /// Replies (RST) to packets of no connection.
    stray: VecDeque<VsockHeader>,
    max_connections: usize,
}

impl VsockMuxer {
    /// Binds the listener at `uds_path` (replacing a stale socket there) for a guest with
    /// `guest_cid`, serving at most `max_connections` connections at a time.
    pub fn new(
        guest_cid: u64,
        uds_path: &Path,
        max_connections: usize,
    ) -> Result<Self, VsockError> {
        if uds_path.as_os_str().as_bytes().len() > MAX_SOCKET_PATH {
            return Err(VsockError::PathTooLong(uds_path.to_path_buf()));
        }
        match std::fs::symlink_metadata(uds_path) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(uds_path)
                .map_err(|e| VsockError::RemoveStale(uds_path.to_path_buf(), e))?,
            Ok(_) => return Err(VsockError::PathInUse(uds_path.to_path_buf())),
            Err(_) => {}
        }
        let listener =
            UnixListener::bind(uds_path).map_err(|e| VsockError::Bind(uds_path.into(), e))?;
        let undo = |e| {
            let _ = std::fs::remove_file(uds_path);
            e
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| undo(VsockError::Sys("listener", e)))?;
        let epoll = Epoll::new().map_err(|e| undo(VsockError::Sys("epoll", e)))?;
        let timer = TimerFd::new().map_err(|e| undo(VsockError::Sys("timer", e.into())))?;
        // A read of an unexpired timer (re-armed after it fired) must not block the event loop.
        // SAFETY: fcntl on a descriptor we own, no pointers involved; the result is checked.
        if unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } < 0 {
            return Err(undo(VsockError::Sys("timer", io::Error::last_os_error())));
        }
        for (fd, token) in [
            (listener.as_raw_fd(), TOKEN_LISTENER),
            (timer.as_raw_fd(), TOKEN_TIMER),
        ] {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )
                .map_err(|e| undo(VsockError::Sys("epoll", e)))?;
        }
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            epoll,
            timer,
            conns: HashMap::new(),
            by_key: HashMap::new(),
            next_token: FIRST_CONN_TOKEN,
            next_local_port: FIRST_LOCAL_PORT,
            rxq: VecDeque::new(),
            stray: VecDeque::new(),
            max_connections,
        })
    }

    /// The listener's path.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// Connections open now (including handshakes in progress).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Whether packets for the guest are waiting for RX buffers.
    pub fn has_pending_rx(&self) -> bool {
        !self.stray.is_empty() || !self.rxq.is_empty()
    }

    /// Drops every connection (device reset: the guest side is gone, so no RST is sent).
    pub fn reset(&mut self) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for t in tokens {
            self.remove(t);
        }
        self.rxq.clear();
        self.stray.clear();
    }

    /// Handles whatever is ready on the listener, the timer and the connection streams.
    pub fn process_events(&mut self) {
        let mut events = [EpollEvent::default(); 64];
        let n = match self.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) => {
                log::error!("vsock: epoll_wait: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_LISTENER => self.accept(),
                TOKEN_TIMER => self.expire_requests(),
                token => self.conn_event(token, ev.event_set()),
            }
        }
    }

    fn accept(&mut self) {
        // Bounded: at most the free connection slots plus one refused per event.
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::warn!("vsock: accept: {e}");
                    return;
                }
            };
            if self.conns.len() >= self.max_connections {
                crate::limited!(
                    log::Level::Warn,
                    "vsock: connection limit reached, refusing a host connection"
                );
                // Dropping the stream closes it. Stop here so a flood cannot hold the loop.
                return;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                log::warn!("vsock: {e}");
                continue;
            }
            let token = self.new_token();
            self.conns
                .insert(token, Connection::new(stream, State::AwaitingConnect));
            self.update_interest(token);
        }
    }

    fn new_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(FIRST_CONN_TOKEN);
        t
    }

    fn alloc_local_port(&mut self) -> u32 {
        loop {
            let p = self.next_local_port;
            self.next_local_port = self.next_local_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if !self.by_key.keys().any(|&(local, _)| local == p) {
                return p;
            }
        }
    }

    fn conn_event(&mut self, token: u64, evset: EventSet) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let outcome = match conn.state {
            State::AwaitingConnect => return self.read_connect_line(token),
            // The host gave up before the guest answered.
            State::LocalInit => Outcome::Kill(conn.pending & pending::REQUEST == 0),
            State::Established | State::Closing => {
                let mut outcome = Outcome::Keep;
                if evset.intersects(EventSet::OUT | EventSet::HANG_UP | EventSet::ERROR)
                    && !conn.tx_buf.is_empty()
                {
                    outcome = self.flush(token);
                }
                if let (Outcome::Keep, Some(conn)) = (&outcome, self.conns.get_mut(&token)) {
                    if conn.registered.contains(EventSet::IN)
                        && evset.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR)
                    {
                        conn.pending |= pending::RW;
                        self.enqueue(token);
                    }
                }
                outcome
            }
        };
        self.finish(token, outcome);
    }

    /// Reads the `CONNECT <port>\n` line a byte at a time, so nothing past it is consumed.
    fn read_connect_line(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        let port = loop {
            match conn.stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => break parse_connect(&conn.line),
                Ok(1) if conn.line.len() < MAX_CONNECT_LINE => conn.line.push(byte[0]),
                Ok(_) => break None,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break None,
            }
        };
        let Some(port) = port else {
            log::warn!("vsock: bad CONNECT line from the host, closing");
            self.remove(token);
            return;
        };
        let local = self.alloc_local_port();
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        conn.local_port = local;
        conn.peer_port = port;
        conn.state = State::LocalInit;
        conn.line = Vec::new();
        conn.pending |= pending::REQUEST;
        self.by_key.insert((local, port), token);
        self.enqueue(token);
        self.update_interest(token);
    }

    /// Kills host-initiated connections the guest did not answer in time.
    fn expire_requests(&mut self) {
        match self.timer.wait() {
            Ok(_) => {}
            Err(e) if e.errno() == libc::EAGAIN => {}
            Err(e) => log::warn!("vsock: timer: {e}"),
        }
        let now = Instant::now();
        let expired: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state == State::LocalInit && c.deadline.is_some_and(|d| d <= now))
            .map(|(&t, _)| t)
            .collect();
        for t in expired {
            crate::limited!(
                log::Level::Info,
                "vsock: guest did not answer a connection request in time"
            );
            self.kill(t, true);
        }
        self.arm_timer();
    }

    fn arm_timer(&mut self) {
        let next = self
            .conns
            .values()
            .filter(|c| c.state == State::LocalInit)
            .filter_map(|c| c.deadline)
            .min();
        let Some(next) = next else {
            return;
        };
        let wait = next
            .saturating_duration_since(Instant::now())
            .max(std::time::Duration::from_millis(1));
        if let Err(e) = self.timer.reset(wait, None) {
            log::error!("vsock: arming the timer: {e}");
        }
    }

    fn enqueue(&mut self, token: u64) {
        if let Some(conn) = self.conns.get_mut(&token) {
            if !conn.queued && conn.pending != 0 {
                conn.queued = true;
                self.rxq.push_back(token);
            }
        }
    }

    fn update_interest(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let want = conn.interest();
        if want == conn.registered {
            return;
        }
        let fd = conn.stream.as_raw_fd();
        let res = if want.is_empty() {
            self.epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default())
        } else if conn.registered.is_empty() {
            self.epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(want, token))
        } else {
            self.epoll
                .ctl(ControlOperation::Modify, fd, EpollEvent::new(want, token))
        };
        match res {
            Ok(()) => conn.registered = want,
            Err(e) => {
                log::error!("vsock: epoll_ctl: {e}");
                self.kill(token, true);
            }
        }
    }

    fn finish(&mut self, token: u64, outcome: Outcome) {
        match outcome {
            Outcome::Keep => {
                self.enqueue(token);
                self.update_interest(token);
            }
            Outcome::Kill(rst) => self.kill(token, rst),
        }
    }

    /// Removes a connection without telling the guest.
    fn remove(&mut self, token: u64) -> Option<Connection> {
        let conn = self.conns.remove(&token)?;
        if !conn.registered.is_empty() {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                conn.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        if matches!(self.by_key.get(&(conn.local_port, conn.peer_port)), Some(&t) if t == token) {
            self.by_key.remove(&(conn.local_port, conn.peer_port));
        }
        Some(conn)
    }

    /// Removes a connection, with a RST to the guest if `rst`.
    fn kill(&mut self, token: u64, rst: bool) {
        if let Some(conn) = self.remove(token) {
            if rst && conn.state != State::AwaitingConnect {
                // Bounded by the connection limit in practice; the cap only guards against bugs.
                if self.stray.len() < MAX_STRAY_REPLIES + self.max_connections {
                    self.stray.push_back(conn.header(self.guest_cid, op::RST));
                }
            }
        }
    }

    fn reply_rst(&mut self, h: &VsockHeader) {
        if h.op == op::RST {
            return;
        }
        if self.stray.len() >= MAX_STRAY_REPLIES {
            log::debug!("vsock: dropping a RST reply, too many pending");
            return;
        }
        self.stray.push_back(VsockHeader {
            src_cid: VSOCK_HOST_CID,
            dst_cid: self.guest_cid,
            src_port: h.dst_port,
            dst_port: h.src_port,
            len: 0,
            type_: TYPE_STREAM,
            op: op::RST,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        });
    }

    /// Writes buffered guest data to the host stream.
    fn flush(&mut self, token: u64) -> Outcome {
        let Some(conn) = self.conns.get_mut(&token) else {
            return Outcome::Keep;
        };
        while !conn.tx_buf.is_empty() {
            let (front, _) = conn.tx_buf.as_slices();
            match conn.stream.write(front) {
                Ok(0) => return Outcome::Kill(true),
                Ok(n) => {
                    conn.tx_buf.drain(..n);
                    let own = n.min(conn.tx_own);
                    conn.tx_own -= own;
                    // n - own <= CONN_BUF_ALLOC, fits u32.
                    conn.fwd_cnt += Wrapping((n - own) as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!("vsock: writing to the host stream: {e}");
                    return Outcome::Kill(true);
                }
            }
        }
        if (conn.fwd_cnt - conn.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            conn.pending |= pending::CREDIT_UPDATE;
        }
        if conn.tx_buf.is_empty() {
            if conn.state == State::Closing || (conn.peer_shut_send && conn.host_eof) {
                return Outcome::Kill(true);
            }
            if conn.peer_shut_send {
                let _ = conn.stream.shutdown(Shutdown::Write);
            }
        }
        Outcome::Keep
    }

    /// Takes a packet the guest sent.
    pub fn send_pkt(&mut self, pkt: TxPacket) {
        let h = pkt.hdr;
        if h.src_cid != self.guest_cid {
            log::debug!("vsock: dropping a packet from CID {}", h.src_cid);
            return;
        }
        if h.dst_cid != VSOCK_HOST_CID || h.type_ != TYPE_STREAM {
            self.reply_rst(&h);
            return;
        }
        let Some(&token) = self.by_key.get(&(h.dst_port, h.src_port)) else {
            match h.op {
                op::REQUEST => self.guest_connect(&h),
                _ => self.reply_rst(&h),
            }
            return;
        };
        let outcome = self.conn_packet(token, &h, pkt.data);
        self.finish(token, outcome);
    }

    fn conn_packet(&mut self, token: u64, h: &VsockHeader, data: Vec<u8>) -> Outcome {
        let Some(conn) = self.conns.get_mut(&token) else {
            return Outcome::Keep;
        };
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(h.fwd_cnt);
        if conn.peer_credit() > 0 {
            conn.credit_requested = false;
        }
        match (conn.state, h.op) {
            (_, op::RST) => Outcome::Kill(false),
            (State::LocalInit, op::RESPONSE) => {
                conn.state = State::Established;
                conn.deadline = None;
                let line = format!("OK {}\n", conn.local_port);
                conn.tx_own += line.len();
                conn.tx_buf.extend(line.as_bytes());
                self.flush(token)
            }
            (State::Established | State::Closing, op::RW) => {
                if conn.state == State::Closing || conn.peer_shut_send {
                    return Outcome::Kill(true);
                }
                let buffered = conn.tx_buf.len() + data.len();
                if buffered > CONN_BUF_ALLOC as usize + OK_LINE_ROOM {
                    log::debug!(
                        "vsock: guest exceeded its credit on port {}",
                        conn.local_port
                    );
                    return Outcome::Kill(true);
                }
                let mut rest = &data[..];
                if conn.tx_buf.is_empty() {
                    // The common case: the stream takes it all, nothing is buffered.
                    while !rest.is_empty() {
                        match conn.stream.write(rest) {
                            Ok(0) => return Outcome::Kill(true),
                            Ok(n) => {
                                rest = &rest[n..];
                                // n <= MAX_PKT_DATA.
                                conn.fwd_cnt += Wrapping(n as u32);
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
                let buffered = conn.tx_buf.len() + rest.len();
                if conn.tx_buf.capacity() < buffered {
                    // Allocate the whole bounded buffer once, not a doubling of it.
                    let full = CONN_BUF_ALLOC as usize + OK_LINE_ROOM;
                    conn.tx_buf.reserve_exact(full - conn.tx_buf.len());
                }
                conn.tx_buf.extend(rest);
                self.flush(token)
            }
            (State::Established | State::Closing, op::CREDIT_UPDATE) => Outcome::Keep,
            (State::Established | State::Closing, op::CREDIT_REQUEST) => {
                conn.pending |= pending::CREDIT_UPDATE;
                Outcome::Keep
            }
            (State::Established, op::SHUTDOWN) => {
                conn.peer_shut_rcv |= h.flags & SHUTDOWN_RCV != 0;
                conn.peer_shut_send |= h.flags & SHUTDOWN_SEND != 0;
                if conn.peer_shut_rcv && conn.peer_shut_send {
                    conn.state = State::Closing;
                }
                if conn.peer_shut_rcv {
                    conn.pending &= !pending::RW;
                }
                if conn.tx_buf.is_empty() {
                    self.flush(token)
                } else {
                    Outcome::Keep
                }
            }
            (State::Closing, op::SHUTDOWN) => Outcome::Keep,
            _ => {
                log::debug!(
                    "vsock: unexpected op {} in state {:?}, resetting",
                    h.op,
                    conn.state
                );
                Outcome::Kill(true)
            }
        }
    }

    fn guest_connect(&mut self, h: &VsockHeader) {
        if self.conns.len() >= self.max_connections {
            log::debug!(
                "vsock: connection limit reached, refusing guest port {}",
                h.src_port
            );
            self.reply_rst(h);
            return;
        }
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{}", h.dst_port));
        let stream = match connect_nonblocking(Path::new(&path)) {
            Ok(s) => s,
            Err(e) => {
                log::debug!("vsock: guest connect to {path:?}: {e}");
                self.reply_rst(h);
                return;
            }
        };
        let token = self.new_token();
        let mut conn = Connection::new(stream, State::Established);
        conn.local_port = h.dst_port;
        conn.peer_port = h.src_port;
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(h.fwd_cnt);
        conn.pending = pending::RESPONSE;
        self.conns.insert(token, conn);
        self.by_key.insert((h.dst_port, h.src_port), token);
        self.enqueue(token);
        self.update_interest(token);
    }

    /// The next packet for the guest, with at most `max_data` bytes of data.
    pub fn recv_pkt(&mut self, max_data: usize) -> Option<RxPacket> {
        if let Some(hdr) = self.stray.pop_front() {
            return Some(RxPacket {
                hdr,
                data: Vec::new(),
            });
        }
        // Each connection is visited at most once per call.
        for _ in 0..self.rxq.len() {
            let token = self.rxq.pop_front()?;
            let Some(conn) = self.conns.get_mut(&token) else {
                continue;
            };
            conn.queued = false;
            let (pkt, outcome) = self.conn_rx(token, max_data);
            self.finish(token, outcome);
            if let Some(pkt) = pkt {
                return Some(pkt);
            }
            // A connection killed while producing nothing leaves its RST in `stray`.
            if let Some(hdr) = self.stray.pop_front() {
                return Some(RxPacket {
                    hdr,
                    data: Vec::new(),
                });
            }
        }
        None
    }

    fn conn_rx(&mut self, token: u64, max_data: usize) -> (Option<RxPacket>, Outcome) {
        let guest_cid = self.guest_cid;
        let Some(conn) = self.conns.get_mut(&token) else {
            return (None, Outcome::Keep);
        };
        let control = |conn: &mut Connection, bit: u8, op: u16| {
            conn.pending &= !bit;
            let hdr = conn.header(guest_cid, op);
            conn.last_fwd_cnt_sent = conn.fwd_cnt;
            conn.pending &= !pending::CREDIT_UPDATE;
            Some(RxPacket {
                hdr,
                data: Vec::new(),
            })
        };
        if conn.pending & pending::REQUEST != 0 {
            conn.deadline = Some(Instant::now() + CONNECT_TIMEOUT);
            let p = control(conn, pending::REQUEST, op::REQUEST);
            self.arm_timer();
            return (p, Outcome::Keep);
        }
        if conn.pending & pending::RESPONSE != 0 {
            return (
                control(conn, pending::RESPONSE, op::RESPONSE),
                Outcome::Keep,
            );
        }
        if conn.pending & pending::CREDIT_UPDATE != 0 {
            return (
                control(conn, pending::CREDIT_UPDATE, op::CREDIT_UPDATE),
                Outcome::Keep,
            );
        }
        if conn.pending & pending::CREDIT_REQUEST != 0 {
            return (
                control(conn, pending::CREDIT_REQUEST, op::CREDIT_REQUEST),
                Outcome::Keep,
            );
        }
        if conn.pending & pending::RW == 0 {
            return (None, Outcome::Keep);
        }
        if conn.state != State::Established || conn.host_eof || conn.peer_shut_rcv {
            conn.pending &= !pending::RW;
            return (None, Outcome::Keep);
        }
        let credit = conn.peer_credit() as usize;
        if credit == 0 {
            conn.pending &= !pending::RW;
            if !conn.credit_requested {
                conn.credit_requested = true;
                return (
                    control(conn, pending::CREDIT_REQUEST, op::CREDIT_REQUEST),
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
            match conn.stream.read(&mut data) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => break r,
            }
        };
        conn.pending &= !pending::RW;
        match read {
            Ok(0) => {
                conn.host_eof = true;
                let mut hdr = conn.header(guest_cid, op::SHUTDOWN);
                hdr.flags = SHUTDOWN_SEND;
                conn.last_fwd_cnt_sent = conn.fwd_cnt;
                let outcome = if conn.peer_shut_send && conn.tx_buf.is_empty() {
                    Outcome::Kill(true)
                } else {
                    Outcome::Keep
                };
                (Some(RxPacket { hdr, data }), outcome)
            }
            Ok(n) => {
                data.truncate(n);
                // n <= MAX_PKT_DATA.
                conn.rx_cnt += Wrapping(n as u32);
                if conn.peer_credit() == 0 && !conn.credit_requested {
                    // Stalled from now on: ask once, in case the guest does not volunteer.
                    conn.credit_requested = true;
                    conn.pending |= pending::CREDIT_REQUEST;
                }
                let hdr = conn.header(guest_cid, op::RW);
                conn.last_fwd_cnt_sent = conn.fwd_cnt;
                conn.pending &= !pending::CREDIT_UPDATE;
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

impl AsRawFd for VsockMuxer {
    /// The epoll fd to watch (readable when the muxer has work).
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}

impl Drop for VsockMuxer {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.uds_path) {
            log::debug!("vsock: removing {:?}: {e}", self.uds_path);
        }
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

/// Connects to a Unix stream socket without blocking: a listener with a full backlog gives
/// `WouldBlock` instead of stalling the event loop.
fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() > MAX_SOCKET_PATH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    // SAFETY: plain syscall with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket we own; OwnedFd closes it on every path.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un, NUL-terminated (the path is at most 107 bytes of
    // the zeroed 108), and `len` does not exceed its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn path_checks() {
        let dir = std::env::temp_dir().join(format!("vsock-mux-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let long = dir.join("x".repeat(120));
        assert!(matches!(
            VsockMuxer::new(3, &long, 4),
            Err(VsockError::PathTooLong(_))
        ));
        let file = dir.join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(matches!(
            VsockMuxer::new(3, &file, 4),
            Err(VsockError::PathInUse(_))
        ));
        // A stale socket is replaced, and the socket is removed on drop.
        let sock = dir.join("v.sock");
        let stale = UnixListener::bind(&sock).unwrap();
        drop(stale);
        assert!(sock.exists());
        let m = VsockMuxer::new(3, &sock, 4).unwrap();
        UnixStream::connect(&sock).unwrap();
        drop(m);
        assert!(!sock.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
