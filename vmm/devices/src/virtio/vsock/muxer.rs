//! The host side of hybrid vsock: the Unix listener at `uds_path`, the connections (found by
//! token for epoll events and by port pair for guest packets), the queue of connections with
//! packets for the guest, and the RSTs that answer packets of no connection.
//!
//! The muxer owns an epoll set (the listener, a connect-timeout timer and the connection
//! streams); the device registers that epoll fd with the device event loop and calls
//! [`VsockMuxer::process_events`] when it is readable. Packets from the guest arrive through
//! [`VsockMuxer::send_pkt`]; packets for the guest are pulled with [`VsockMuxer::recv_pkt`]
//! whenever the guest has posted RX buffers.
//!
//! What happens inside one connection (the handshake, credit flow control, the buffered data)
//! is the `connection` module's; the muxer dispatches events and packets to it and carries out
//! what it asks: keep it polled for the events it wants, queue it for RX buffers, or remove it
//! (with a RST for the guest). It also enforces the limits that span connections: at most
//! `max_connections` of them, and a bounded queue of stray replies.
//!
//! Epoll interest is recomputed after every change, and a connection that cannot make progress
//! is not polled at all, so a readable stream with no credit never spins the event loop.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Instant;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::connection::{ConnectLine, Connection, Outcome, State};
use super::packet::{RxPacket, TxPacket, VsockHeader};
use super::uds::{connect_nonblocking, MAX_SOCKET_PATH};
use super::{op, VsockError, TYPE_STREAM, VSOCK_HOST_CID};

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

/// A connection with the muxer's bookkeeping for it.
struct Entry {
    conn: Connection,
    /// In the muxer's RX queue.
    queued: bool,
    /// The epoll interest currently registered (empty: not registered).
    registered: EventSet,
}

impl Entry {
    fn new(conn: Connection) -> Self {
        Self {
            conn,
            queued: false,
            registered: EventSet::empty(),
        }
    }
}

/// The host side of the vsock device.
pub struct VsockMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    timer: TimerFd,
    conns: HashMap<u64, Entry>,
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
                .insert(token, Entry::new(Connection::accepted(stream)));
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
        let Some(entry) = self.conns.get_mut(&token) else {
            return;
        };
        if entry.conn.state() == State::AwaitingConnect {
            return self.read_connect_line(token);
        }
        let polled_in = entry.registered.contains(EventSet::IN);
        let outcome = entry.conn.on_stream_event(evset, polled_in);
        self.finish(token, outcome);
    }

    /// Reads the host's `CONNECT <port>\n` line; once it is complete, gives the connection a
    /// local port and queues its REQUEST for the guest.
    fn read_connect_line(&mut self, token: u64) {
        let Some(entry) = self.conns.get_mut(&token) else {
            return;
        };
        let port = match entry.conn.read_connect_line() {
            ConnectLine::Incomplete => return,
            ConnectLine::Port(port) => port,
            ConnectLine::Bad => {
                log::warn!("vsock: bad CONNECT line from the host, closing");
                self.remove(token);
                return;
            }
        };
        let local = self.alloc_local_port();
        let Some(entry) = self.conns.get_mut(&token) else {
            return;
        };
        entry.conn.request_guest(local, port);
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
            .filter(|(_, e)| e.conn.request_deadline().is_some_and(|d| d <= now))
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
            .filter_map(|e| e.conn.request_deadline())
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
        if let Some(entry) = self.conns.get_mut(&token) {
            if !entry.queued && entry.conn.has_pending_rx() {
                entry.queued = true;
                self.rxq.push_back(token);
            }
        }
    }

    fn update_interest(&mut self, token: u64) {
        let Some(entry) = self.conns.get_mut(&token) else {
            return;
        };
        let want = entry.conn.interest();
        if want == entry.registered {
            return;
        }
        let fd = entry.conn.as_raw_fd();
        let res = if want.is_empty() {
            self.epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default())
        } else if entry.registered.is_empty() {
            self.epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(want, token))
        } else {
            self.epoll
                .ctl(ControlOperation::Modify, fd, EpollEvent::new(want, token))
        };
        match res {
            Ok(()) => entry.registered = want,
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
        let entry = self.conns.remove(&token)?;
        if !entry.registered.is_empty() {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                entry.conn.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        let key = entry.conn.ports();
        if matches!(self.by_key.get(&key), Some(&t) if t == token) {
            self.by_key.remove(&key);
        }
        Some(entry.conn)
    }

    /// Removes a connection, with a RST to the guest if `rst`.
    fn kill(&mut self, token: u64, rst: bool) {
        if let Some(conn) = self.remove(token) {
            if !rst {
                return;
            }
            if let Some(hdr) = conn.rst_for_guest(self.guest_cid) {
                // Bounded by the connection limit in practice; the cap only guards against bugs.
                if self.stray.len() < MAX_STRAY_REPLIES + self.max_connections {
                    self.stray.push_back(hdr);
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
        let Some(entry) = self.conns.get_mut(&token) else {
            return;
        };
        let outcome = entry.conn.on_packet(&h, pkt.data);
        self.finish(token, outcome);
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
        let conn = Connection::guest_initiated(stream, h);
        self.by_key.insert(conn.ports(), token);
        self.conns.insert(token, Entry::new(conn));
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
            let Some(entry) = self.conns.get_mut(&token) else {
                continue;
            };
            entry.queued = false;
            let (pkt, outcome) = entry.conn.next_rx(self.guest_cid, max_data);
            if pkt.as_ref().is_some_and(|p| p.hdr.op == op::REQUEST) {
                // The REQUEST's connect timeout started as it was handed out.
                self.arm_timer();
            }
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

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

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
