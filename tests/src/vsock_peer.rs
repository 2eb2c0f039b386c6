//! The host side of the `vsock-echo` test guest, over the VMM's hybrid-vsock Unix socket.
//!
//! Two directions, matching the guest's two phases:
//! - [`host_initiated_echo`]: the host connects to the guest (`CONNECT <port>\n` on the VM's
//!   socket, answered `OK <host_port>\n`), streams a pseudo-random payload while reading the
//!   echo concurrently, verifies it byte for byte and expects EOF after the last byte.
//! - [`GuestEchoServer`] / [`serve_guest_echo`]: the host listens on `<uds_path>_<port>` for
//!   the guest's connection and echoes everything back until the guest shuts down.
//!
//! Every function is bounded by the timeout it is given and reports what it was doing when it
//! failed.

use std::ffi::OsString;
use std::io::{self, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

/// Pause between attempts while the guest is not listening yet or the socket is not there.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Longest handshake reply we accept (`OK 4294967295\n` is 14 bytes).
const MAX_HANDSHAKE_LINE: usize = 64;
const CHUNK: usize = 64 * 1024;

/// What went wrong talking to the guest.
#[derive(Debug, thiserror::Error)]
pub enum VsockPeerError {
    #[error(
        "the guest did not accept `CONNECT {port}` on {path} within {timeout:?} \
         ({attempts} attempts; last: {last})"
    )]
    NotListening {
        path: PathBuf,
        port: u32,
        timeout: Duration,
        attempts: u32,
        last: String,
    },
    #[error("unexpected answer to `CONNECT {port}` on {path}: {reply:?} (want `OK <port>`)")]
    Handshake {
        path: PathBuf,
        port: u32,
        reply: String,
    },
    #[error("cannot listen on {path}: {source}")]
    Listen { path: PathBuf, source: io::Error },
    #[error("no guest connection on {path} within {timeout:?}")]
    NoConnection { path: PathBuf, timeout: Duration },
    #[error("timed out after {timeout:?} while {during} ({done} bytes done)")]
    Timeout {
        during: &'static str,
        timeout: Duration,
        done: u64,
    },
    #[error("I/O error while {during} ({done} bytes done): {source}")]
    Io {
        during: &'static str,
        done: u64,
        source: io::Error,
    },
    #[error("echo differs from the payload at byte {offset}: got {got:#04x}, want {want:#04x}")]
    Mismatch { offset: u64, got: u8, want: u8 },
    #[error("echo is longer than the {sent}-byte payload")]
    EchoTooLong { sent: u64 },
    #[error("echo ended (EOF) after {got} of {sent} bytes")]
    EchoTooShort { got: u64, sent: u64 },
    #[error("the payload writer thread panicked")]
    WriterPanicked,
}

/// What a completed echo moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EchoReport {
    /// Bytes echoed (each direction carried this many).
    pub bytes: u64,
    /// From the first connection attempt (or accept) to the end of the echo.
    pub elapsed: Duration,
    /// Host-side port the VMM reported (`OK <port>`); `None` for guest-initiated connections.
    pub host_port: Option<u32>,
}

/// The deterministic pseudo-random payload [`host_initiated_echo`] sends: byte `i` of the
/// stream for a given `seed`. Exposed so tests can reason about it.
pub fn payload_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = seed | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let word = x.to_le_bytes();
        let take = (len - out.len()).min(word.len());
        out.extend_from_slice(&word[..take]);
    }
    out
}

/// `<uds_path>_<port>`: where the VMM connects a guest's connection to host port `port`.
pub fn guest_listener_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut s = OsString::from(uds_path.as_os_str());
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Reads one `\n`-terminated line byte by byte (nothing past the newline is consumed).
fn read_line(stream: &mut UnixStream) -> io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte)? {
            0 => {
                return Err(io::Error::new(
                    ErrorKind::UnexpectedEof,
                    format!(
                        "closed after {:?} without a full line",
                        String::from_utf8_lossy(&line)
                    ),
                ))
            }
            _ if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            _ if line.len() >= MAX_HANDSHAKE_LINE => {
                return Err(io::Error::new(
                    ErrorKind::InvalidData,
                    "handshake line too long",
                ))
            }
            _ => line.push(byte[0]),
        }
    }
}

enum Attempt {
    Connected(UnixStream, u32),
    /// Not there yet (no socket, refused, or closed without `OK`): retry.
    Retry(String),
}

fn try_connect(uds_path: &Path, port: u32, deadline: Instant) -> Result<Attempt, VsockPeerError> {
    let mut stream = match UnixStream::connect(uds_path) {
        Ok(s) => s,
        Err(e) => return Ok(Attempt::Retry(format!("connect: {e}"))),
    };
    let Some(left) = remaining(deadline) else {
        return Ok(Attempt::Retry("deadline reached".into()));
    };
    let io_err = |source| VsockPeerError::Io {
        during: "sending CONNECT",
        done: 0,
        source,
    };
    stream.set_read_timeout(Some(left)).map_err(io_err)?;
    stream.set_write_timeout(Some(left)).map_err(io_err)?;
    if let Err(e) = stream.write_all(format!("CONNECT {port}\n").as_bytes()) {
        return Ok(Attempt::Retry(format!("write CONNECT: {e}")));
    }
    let line = match read_line(&mut stream) {
        Ok(line) => line,
        Err(e) => return Ok(Attempt::Retry(format!("reading the answer: {e}"))),
    };
    let host_port = line
        .strip_prefix("OK ")
        .and_then(|p| p.trim().parse::<u32>().ok())
        .ok_or_else(|| VsockPeerError::Handshake {
            path: uds_path.to_path_buf(),
            port,
            reply: line.clone(),
        })?;
    Ok(Attempt::Connected(stream, host_port))
}

/// Connects to guest port `port` through the VM's vsock socket, retrying until the guest
/// listens or `timeout` passes. Returns the stream (past the handshake) and the host port.
pub fn connect_guest(
    uds_path: &Path,
    port: u32,
    timeout: Duration,
) -> Result<(UnixStream, u32), VsockPeerError> {
    let deadline = Instant::now() + timeout;
    let mut attempts = 0u32;
    loop {
        attempts = attempts.saturating_add(1);
        let last = match try_connect(uds_path, port, deadline)? {
            Attempt::Connected(stream, host_port) => return Ok((stream, host_port)),
            Attempt::Retry(why) => why,
        };
        match remaining(deadline) {
            Some(left) if left >= RETRY_PAUSE => {}
            _ => {
                return Err(VsockPeerError::NotListening {
                    path: uds_path.to_path_buf(),
                    port,
                    timeout,
                    attempts,
                    last,
                })
            }
        }
        thread::sleep(RETRY_PAUSE);
    }
}

/// Writes `payload` in chunks, then shuts the write side (the guest sees SHUTDOWN).
fn write_payload(
    mut stream: UnixStream,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), VsockPeerError> {
    let mut done = 0usize;
    while done < payload.len() {
        let left = remaining(deadline).ok_or(VsockPeerError::Timeout {
            during: "sending the payload",
            timeout,
            done: done as u64,
        })?;
        let io_err = |source| VsockPeerError::Io {
            during: "sending the payload",
            done: done as u64,
            source,
        };
        stream.set_write_timeout(Some(left)).map_err(io_err)?;
        let end = (done + CHUNK).min(payload.len());
        match stream.write(&payload[done..end]) {
            Ok(0) => {
                return Err(io_err(io::Error::new(
                    ErrorKind::WriteZero,
                    "socket accepted no bytes",
                )))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(VsockPeerError::Timeout {
                    during: "sending the payload",
                    timeout,
                    done: done as u64,
                })
            }
            Err(e) => return Err(io_err(e)),
        }
    }
    stream
        .shutdown(Shutdown::Write)
        .map_err(|source| VsockPeerError::Io {
            during: "shutting down the write side",
            done: done as u64,
            source,
        })
}

/// Reads the echo until EOF, checking it against `payload` as it arrives.
fn read_echo(
    stream: &mut UnixStream,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<u64, VsockPeerError> {
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0usize;
    loop {
        let left = remaining(deadline).ok_or(VsockPeerError::Timeout {
            during: "reading the echo",
            timeout,
            done: got as u64,
        })?;
        let io_err = |source| VsockPeerError::Io {
            during: "reading the echo",
            done: got as u64,
            source,
        };
        stream.set_read_timeout(Some(left)).map_err(io_err)?;
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) => {
                return Err(VsockPeerError::Timeout {
                    during: "reading the echo",
                    timeout,
                    done: got as u64,
                })
            }
            Err(e) => return Err(io_err(e)),
        };
        if n == 0 {
            if got < payload.len() {
                return Err(VsockPeerError::EchoTooShort {
                    got: got as u64,
                    sent: payload.len() as u64,
                });
            }
            return Ok(got as u64);
        }
        let want = payload
            .get(got..got + n)
            .ok_or(VsockPeerError::EchoTooLong {
                sent: payload.len() as u64,
            })?;
        if let Some(i) = buf[..n].iter().zip(want).position(|(a, b)| a != b) {
            return Err(VsockPeerError::Mismatch {
                offset: (got + i) as u64,
                got: buf[i],
                want: want[i],
            });
        }
        got += n;
    }
}

/// Host-initiated echo: connects to guest port `port` via `uds_path` (retrying until the guest
/// listens), sends `payload_len` pseudo-random bytes while reading the echo, shuts down the
/// write side, and verifies the echo is exactly the payload followed by EOF. All within
/// `timeout`.
pub fn host_initiated_echo(
    uds_path: &Path,
    port: u32,
    payload_len: usize,
    timeout: Duration,
) -> Result<EchoReport, VsockPeerError> {
    let start = Instant::now();
    let deadline = start + timeout;
    let (mut stream, host_port) = connect_guest(uds_path, port, timeout)?;
    let payload = payload_bytes(0x5eed_0000_0000_0000 ^ payload_len as u64, payload_len);
    let writer_stream = stream.try_clone().map_err(|source| VsockPeerError::Io {
        during: "cloning the stream for the writer",
        done: 0,
        source,
    })?;
    let bytes = thread::scope(|scope| {
        let writer = scope.spawn(|| write_payload(writer_stream, &payload, deadline, timeout));
        let read = read_echo(&mut stream, &payload, deadline, timeout);
        if read.is_err() {
            // Unblock the writer if it is stuck on a full socket.
            let _ = stream.shutdown(Shutdown::Both);
        }
        let written = writer.join().map_err(|_| VsockPeerError::WriterPanicked)?;
        // A reader error says more (e.g. the mismatch) than the writer's consequent one.
        let bytes = read?;
        written?;
        Ok(bytes)
    })?;
    Ok(EchoReport {
        bytes,
        elapsed: start.elapsed(),
        host_port: Some(host_port),
    })
}

/// A listener on `<uds_path>_<port>` for guest-initiated connections. Bind it before the guest
/// connects (the guest retries refused connections for a while, but not forever).
#[derive(Debug)]
pub struct GuestEchoServer {
    listener: UnixListener,
    path: PathBuf,
}

impl GuestEchoServer {
    /// Binds `<uds_path>_<port>`, replacing a stale socket file from an earlier run.
    pub fn bind(uds_path: &Path, port: u32) -> Result<Self, VsockPeerError> {
        let path = guest_listener_path(uds_path, port);
        let listen_err = |source| VsockPeerError::Listen {
            path: path.clone(),
            source,
        };
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(listen_err(e)),
        }
        let listener = UnixListener::bind(&path).map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        Ok(Self { listener, path })
    }

    /// The socket path the guest's connection arrives on.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts one guest connection and echoes everything back until the guest shuts down its
    /// send side (EOF), then closes. Bounded by `timeout` from the call.
    pub fn serve(&self, timeout: Duration) -> Result<EchoReport, VsockPeerError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut stream = loop {
            match self.listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if is_timeout(&e) || e.kind() == ErrorKind::Interrupted => {
                    if remaining(deadline).is_none() {
                        return Err(VsockPeerError::NoConnection {
                            path: self.path.clone(),
                            timeout,
                        });
                    }
                    thread::sleep(Duration::from_millis(10));
                }
                Err(source) => {
                    return Err(VsockPeerError::Listen {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
        };
        let bytes = echo_until_eof(&mut stream, deadline, timeout)?;
        Ok(EchoReport {
            bytes,
            elapsed: start.elapsed(),
            host_port: None,
        })
    }
}

impl Drop for GuestEchoServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn echo_until_eof(
    stream: &mut UnixStream,
    deadline: Instant,
    timeout: Duration,
) -> Result<u64, VsockPeerError> {
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    let timed_out = |done| VsockPeerError::Timeout {
        during: "echoing the guest's data",
        timeout,
        done,
    };
    stream
        .set_nonblocking(false)
        .map_err(|source| VsockPeerError::Io {
            during: "configuring the accepted socket",
            done,
            source,
        })?;
    loop {
        let left = remaining(deadline).ok_or_else(|| timed_out(done))?;
        let io_err = |during, source| VsockPeerError::Io {
            during,
            done,
            source,
        };
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| io_err("echoing the guest's data", e))?;
        stream
            .set_write_timeout(Some(left))
            .map_err(|e| io_err("echoing the guest's data", e))?;
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) => return Err(timed_out(done)),
            Err(e) => return Err(io_err("reading the guest's data", e)),
        };
        if n == 0 {
            stream
                .shutdown(Shutdown::Write)
                .map_err(|e| io_err("closing after the guest's EOF", e))?;
            return Ok(done);
        }
        match stream.write_all(&buf[..n]) {
            Ok(()) => done += n as u64,
            Err(e) if is_timeout(&e) => return Err(timed_out(done)),
            Err(e) => return Err(io_err("writing the echo", e)),
        }
    }
}

/// Binds `<uds_path>_<port>` and echoes one guest connection (see [`GuestEchoServer`]).
pub fn serve_guest_echo(
    uds_path: &Path,
    port: u32,
    timeout: Duration,
) -> Result<EchoReport, VsockPeerError> {
    GuestEchoServer::bind(uds_path, port)?.serve(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A socket path in a folder of its own, removed with everything in it when dropped.
    struct TempUds {
        dir: PathBuf,
        path: PathBuf,
    }

    impl std::ops::Deref for TempUds {
        type Target = PathBuf;
        fn deref(&self) -> &PathBuf {
            &self.path
        }
    }

    impl AsRef<std::path::Path> for TempUds {
        fn as_ref(&self) -> &std::path::Path {
            &self.path
        }
    }

    impl Drop for TempUds {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn temp_uds(name: &str) -> TempUds {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vsock-peer-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempUds {
            path: dir.join("vsock.sock"),
            dir,
        }
    }

    /// How the fake VMM side treats each accepted connection.
    #[derive(Clone, Copy)]
    enum Fake {
        /// Close without answering (guest not listening yet).
        Refuse,
        /// Answer OK, then echo faithfully.
        Echo,
        /// Answer OK, echo, but flip the byte at this offset.
        Corrupt(usize),
        /// Answer OK, echo only this many bytes, then close.
        Truncate(usize),
        /// Answer something that is not `OK <port>`.
        BadReply,
        /// Answer OK, then never read or write.
        Stall,
    }

    /// A fake of the VMM's hybrid-vsock socket: one behaviour per accepted connection.
    fn fake_vmm(path: &Path, script: Vec<Fake>) -> thread::JoinHandle<Vec<String>> {
        let listener = UnixListener::bind(path).expect("bind fake vmm");
        thread::spawn(move || {
            let mut requests = Vec::new();
            for behaviour in script {
                let (mut s, _) = listener.accept().expect("accept");
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let line = read_line(&mut s).expect("CONNECT line");
                requests.push(line);
                let echo_limit = match behaviour {
                    Fake::Refuse => continue,
                    Fake::BadReply => {
                        let _ = s.write_all(b"ERR nope\n");
                        continue;
                    }
                    Fake::Stall => {
                        s.write_all(b"OK 1073741824\n").unwrap();
                        thread::sleep(Duration::from_secs(2));
                        continue;
                    }
                    Fake::Truncate(n) => n,
                    Fake::Echo | Fake::Corrupt(_) => usize::MAX,
                };
                s.write_all(b"OK 1073741824\n").unwrap();
                let mut buf = [0u8; 4096];
                let mut off = 0usize;
                // A client that saw corrupted bytes may hang up before the echo
                // ends: then the fake's reads and writes fail, which is expected.
                let peer_may_hang_up = matches!(behaviour, Fake::Corrupt(_));
                loop {
                    let n = match s.read(&mut buf) {
                        Ok(n) => n,
                        Err(_) if peer_may_hang_up => break,
                        Err(e) => panic!("fake read: {e}"),
                    };
                    if n == 0 {
                        break;
                    }
                    if let Fake::Corrupt(at) = behaviour {
                        if (off..off + n).contains(&at) {
                            buf[at - off] ^= 0x5a;
                        }
                    }
                    let keep = n.min(echo_limit.saturating_sub(off));
                    match s.write_all(&buf[..keep]) {
                        Ok(()) => {}
                        Err(_) if peer_may_hang_up => break,
                        Err(e) => panic!("fake write: {e}"),
                    }
                    off += n;
                }
                let _ = s.shutdown(Shutdown::Write);
            }
            requests
        })
    }

    #[test]
    fn payload_is_deterministic_and_not_trivial() {
        let a = payload_bytes(7, 1001);
        assert_eq!(a, payload_bytes(7, 1001));
        assert_eq!(a.len(), 1001);
        assert_ne!(a, payload_bytes(8, 1001));
        assert!(a.windows(2).filter(|w| w[0] == w[1]).count() < 50);
    }

    #[test]
    fn listener_path_appends_port() {
        assert_eq!(
            guest_listener_path(Path::new("/run/vm/v.sock"), 5678),
            PathBuf::from("/run/vm/v.sock_5678")
        );
    }

    #[test]
    fn echo_succeeds_after_retries_until_guest_listens() {
        let uds = temp_uds("retry");
        let fake = fake_vmm(&uds, vec![Fake::Refuse, Fake::Refuse, Fake::Echo]);
        let report = host_initiated_echo(&uds, 1234, 300_000, Duration::from_secs(20))
            .expect("echo should succeed");
        assert_eq!(report.bytes, 300_000);
        assert_eq!(report.host_port, Some(1 << 30));
        let requests = fake.join().unwrap();
        assert_eq!(requests, vec!["CONNECT 1234"; 3]);
    }

    #[test]
    fn echo_retries_until_the_socket_exists() {
        let uds = temp_uds("late");
        let uds2 = uds.clone();
        let late = thread::spawn(move || {
            thread::sleep(Duration::from_millis(300));
            fake_vmm(&uds2, vec![Fake::Echo]).join().unwrap()
        });
        let report = host_initiated_echo(&uds, 1234, 10, Duration::from_secs(10)).unwrap();
        assert_eq!(report.bytes, 10);
        late.join().unwrap();
    }

    #[test]
    fn corrupted_echo_is_reported_with_its_offset() {
        let uds = temp_uds("corrupt");
        let fake = fake_vmm(&uds, vec![Fake::Corrupt(70_001)]);
        let err = host_initiated_echo(&uds, 1234, 100_000, Duration::from_secs(20)).unwrap_err();
        assert!(
            matches!(err, VsockPeerError::Mismatch { offset: 70_001, .. }),
            "{err}"
        );
        fake.join().unwrap();
    }

    #[test]
    fn short_echo_is_an_error() {
        let uds = temp_uds("short");
        let fake = fake_vmm(&uds, vec![Fake::Truncate(5000)]);
        let err = host_initiated_echo(&uds, 1234, 20_000, Duration::from_secs(20)).unwrap_err();
        assert!(
            matches!(
                err,
                VsockPeerError::EchoTooShort {
                    got: 5000,
                    sent: 20_000
                }
            ),
            "{err}"
        );
        fake.join().unwrap();
    }

    #[test]
    fn bad_handshake_reply_is_an_error() {
        let uds = temp_uds("badreply");
        let fake = fake_vmm(&uds, vec![Fake::BadReply]);
        let err = host_initiated_echo(&uds, 1234, 10, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(&err, VsockPeerError::Handshake { reply, .. } if reply == "ERR nope"),
            "{err}"
        );
        fake.join().unwrap();
    }

    #[test]
    fn nobody_listening_times_out_with_attempts() {
        let uds = temp_uds("nobody");
        let start = Instant::now();
        let err = host_initiated_echo(&uds, 1234, 10, Duration::from_millis(500)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        match err {
            VsockPeerError::NotListening { attempts, .. } => assert!(attempts >= 2),
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn stalled_guest_times_out() {
        let uds = temp_uds("stall");
        let fake = fake_vmm(&uds, vec![Fake::Stall]);
        let start = Instant::now();
        let err = host_initiated_echo(&uds, 1234, 10, Duration::from_millis(700)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(matches!(err, VsockPeerError::Timeout { .. }), "{err}");
        fake.join().unwrap();
    }

    #[test]
    fn serves_a_guest_initiated_echo() {
        let uds = temp_uds("serve");
        let server = GuestEchoServer::bind(&uds, 5678).unwrap();
        assert_eq!(server.path(), guest_listener_path(&uds, 5678));
        let path = server.path().to_path_buf();
        let guest = thread::spawn(move || {
            let payload = payload_bytes(3, 262_144);
            let mut s = UnixStream::connect(&path).unwrap();
            let mut r = s.try_clone().unwrap();
            let reader = thread::spawn(move || {
                let mut got = Vec::new();
                r.read_to_end(&mut got).unwrap();
                got
            });
            s.write_all(&payload).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            assert_eq!(reader.join().unwrap(), payload);
        });
        let report = server.serve(Duration::from_secs(20)).unwrap();
        assert_eq!(report.bytes, 262_144);
        guest.join().unwrap();
        drop(server);
        assert!(!guest_listener_path(&uds, 5678).exists());
    }

    #[test]
    fn serve_replaces_a_stale_socket_and_times_out_without_guest() {
        let uds = temp_uds("stale");
        let stale = UnixListener::bind(guest_listener_path(&uds, 5678)).unwrap();
        drop(stale); // leaves the socket file behind
        let start = Instant::now();
        let err = serve_guest_echo(&uds, 5678, Duration::from_millis(300)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(matches!(err, VsockPeerError::NoConnection { .. }), "{err}");
    }

    #[test]
    fn serve_times_out_on_a_silent_guest() {
        let uds = temp_uds("silent");
        let server = GuestEchoServer::bind(&uds, 5678).unwrap();
        let _guest = UnixStream::connect(server.path()).unwrap();
        let err = server.serve(Duration::from_millis(300)).unwrap_err();
        assert!(matches!(err, VsockPeerError::Timeout { .. }), "{err}");
    }
}
