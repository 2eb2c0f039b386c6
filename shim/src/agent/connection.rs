//! The hybrid-vsock handshake: connect to the VM's `uds_path`, write `CONNECT <port>\n`; the VMM
//! (or vhost-device-vsock) answers `OK <host_port>\n` once the guest accepted, or closes the
//! socket (nobody listens in the guest yet: the VM is still booting). [`connect`] retries with a
//! short backoff until its deadline. The reply is bounded in length and time.

use std::io;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::time::Instant;

use super::{AgentError, StreamKind, AGENT_STDIO_PORT};

/// Longest handshake reply accepted, newline included (`OK 4294967295\n` is 14 bytes).
const MAX_HANDSHAKE_LINE: usize = 32;

/// Backoff between connection attempts while the VM boots.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// One failed hybrid-vsock handshake.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connecting to {path}: {source}")]
    Connect {
        path: std::path::PathBuf,
        source: io::Error,
    },
    #[error("sending CONNECT: {0}")]
    Send(io::Error),
    #[error("reading the reply: {0}")]
    Read(io::Error),
    #[error("connection closed before a reply (nobody listens on the guest port yet?)")]
    Closed,
    #[error("no reply line in time")]
    TimedOut,
    #[error("reply longer than {MAX_HANDSHAKE_LINE} bytes without a newline")]
    TooLong,
    #[error("malformed reply {0:?}")]
    Garbage(String),
}

impl HandshakeError {
    /// Whether a later attempt may succeed (the VM or its agent may not be up yet); a reply that
    /// breaks the protocol is final.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Send(_) | Self::Read(_) | Self::Closed => true,
            Self::TimedOut | Self::TooLong | Self::Garbage(_) => false,
        }
    }
}

/// One hybrid-vsock handshake attempt: connect, `CONNECT <port>\n`, read `OK <n>\n` by
/// `deadline`. Returns the stream, positioned right after the reply line.
pub async fn handshake(
    uds_path: &Path,
    port: u32,
    deadline: Instant,
) -> Result<UnixStream, HandshakeError> {
    let attempt = async {
        let mut stream =
            UnixStream::connect(uds_path)
                .await
                .map_err(|source| HandshakeError::Connect {
                    path: uds_path.to_owned(),
                    source,
                })?;
        stream
            .write_all(format!("CONNECT {port}\n").as_bytes())
            .await
            .map_err(HandshakeError::Send)?;
        read_reply(&mut stream).await?;
        Ok(stream)
    };
    tokio::time::timeout_at(deadline, attempt)
        .await
        .map_err(|_| HandshakeError::TimedOut)?
}

/// Reaches guest vsock `port` through the VM's hybrid-vsock socket `uds_path`, retrying while
/// the VM boots, for at most `timeout` in all.
pub async fn connect(
    uds_path: &Path,
    port: u32,
    timeout: Duration,
) -> Result<UnixStream, AgentError> {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let err = match handshake(uds_path, port, deadline).await {
            Ok(stream) => return Ok(stream),
            Err(err) => err,
        };
        if !err.is_transient() {
            return Err(AgentError::Handshake {
                path: uds_path.to_owned(),
                port,
                source: err,
            });
        }
        let now = Instant::now();
        if now + backoff >= deadline {
            return Err(AgentError::ConnectTimeout {
                path: uds_path.to_owned(),
                port,
                waited: now.duration_since(start),
                last: err,
            });
        }
        log::debug!("agent not reachable yet: {err}; retrying in {backoff:?}");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Opens one stdio stream of a process (exec_id "" = the container's init): handshake to
/// [`AGENT_STDIO_PORT`], then the header line. The returned stream carries raw bytes (write to
/// stdin, shut down its write side for EOF; read stdout or stderr to EOF). Call after
/// CreateContainer / ExecProcess.
pub async fn open_stdio_stream(
    uds_path: &Path,
    container_id: &str,
    exec_id: &str,
    which: StreamKind,
    timeout: Duration,
) -> Result<UnixStream, AgentError> {
    let header = agent_protocol::stdio::StreamHeader {
        container_id: container_id.to_owned(),
        exec_id: exec_id.to_owned(),
        kind: which,
    }
    .line()
    .map_err(|e| AgentError::BadReply {
        method: "stdio header",
        reason: e.to_string(),
    })?;
    let handshake_err = |source| AgentError::Handshake {
        path: uds_path.to_owned(),
        port: AGENT_STDIO_PORT,
        source,
    };
    let deadline = Instant::now() + timeout;
    let mut stream = handshake(uds_path, AGENT_STDIO_PORT, deadline)
        .await
        .map_err(handshake_err)?;
    tokio::time::timeout_at(deadline, stream.write_all(header.as_bytes()))
        .await
        .map_err(|_| handshake_err(HandshakeError::TimedOut))?
        .map_err(|e| handshake_err(HandshakeError::Send(e)))?;
    Ok(stream)
}

/// Reads the reply one byte at a time (the bytes after the newline belong to ttrpc) and returns
/// the host-side port it names.
async fn read_reply(stream: &mut UnixStream) -> Result<u32, HandshakeError> {
    let mut line = Vec::with_capacity(MAX_HANDSHAKE_LINE);
    loop {
        let byte = match stream.read_u8().await {
            Ok(b) => b,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                ) =>
            {
                return Err(HandshakeError::Closed)
            }
            Err(e) => return Err(HandshakeError::Read(e)),
        };
        line.push(byte);
        if byte == b'\n' {
            return parse_reply(&line);
        }
        if line.len() >= MAX_HANDSHAKE_LINE {
            return Err(HandshakeError::TooLong);
        }
    }
}

/// Parses `OK <u32>\n`, strictly.
fn parse_reply(line: &[u8]) -> Result<u32, HandshakeError> {
    let garbage = || HandshakeError::Garbage(String::from_utf8_lossy(line).into_owned());
    let text = std::str::from_utf8(line).map_err(|_| garbage())?;
    let number = text
        .strip_prefix("OK ")
        .and_then(|rest| rest.strip_suffix('\n'))
        .ok_or_else(garbage)?;
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(garbage());
    }
    number.parse().map_err(|_| garbage())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::{BufRead, Write};
    use std::os::unix::net::{UnixListener, UnixStream as StdStream};
    use std::path::PathBuf;
    use std::thread::JoinHandle;

    use super::*;

    pub(crate) struct TempDir(pub(crate) PathBuf);

    impl TempDir {
        pub(crate) fn new(name: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("shim-agent-client-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp dir");
            Self(dir)
        }
        pub(crate) fn sock(&self) -> PathBuf {
            self.0.join("vm.sock")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Plays the VMM side: for each of `replies`, accepts one connection, reads the CONNECT line
    /// and asserts it, then writes the reply bytes (None: close at once). Returns the last stream.
    pub(crate) fn vmm(
        listener: UnixListener,
        replies: Vec<Option<&'static [u8]>>,
    ) -> JoinHandle<StdStream> {
        std::thread::spawn(move || {
            let mut last = None;
            for reply in replies {
                let (stream, _) = listener.accept().expect("accept");
                let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
                let mut line = String::new();
                reader.read_line(&mut line).expect("read CONNECT");
                assert_eq!(line, "CONNECT 1024\n");
                let mut stream = stream;
                if let Some(bytes) = reply {
                    stream.write_all(bytes).expect("reply");
                    last = Some(stream);
                }
            }
            last.expect("a last stream")
        })
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn parses_replies() {
        assert_eq!(parse_reply(b"OK 1073741824\n").unwrap(), 1_073_741_824);
        for bad in [
            &b"OK\n"[..],
            b"OK \n",
            b"ok 5\n",
            b"OK -5\n",
            b"OK +5\n",
            b"OK 5 \n",
            b"OK 99999999999\n",
            b"OK 5",
            b"\xff\n",
        ] {
            assert!(
                matches!(parse_reply(bad), Err(HandshakeError::Garbage(_))),
                "{bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn handshake_good_reply_leaves_following_bytes_unread() {
        let dir = TempDir::new("good");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let vmm = vmm(listener, vec![Some(b"OK 52\nrest")]);
        let mut stream = handshake(&dir.sock(), 1024, soon())
            .await
            .expect("handshake");
        let mut rest = [0u8; 4];
        stream.read_exact(&mut rest).await.expect("rest");
        assert_eq!(&rest, b"rest");
        drop(vmm.join());
    }

    #[tokio::test]
    async fn handshake_rejects_garbage_overlong_and_eof() {
        let dir = TempDir::new("bad");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let long: &'static [u8] = &[b'A'; 100];
        let vmm = vmm(
            listener,
            vec![Some(b"NOPE\n"), Some(long), None, Some(b"OK 1")],
        );
        let err = handshake(&dir.sock(), 1024, soon())
            .await
            .expect_err("garbage");
        assert!(
            matches!(err, HandshakeError::Garbage(ref s) if s == "NOPE\n"),
            "{err:?}"
        );
        assert!(!err.is_transient());
        let err = handshake(&dir.sock(), 1024, soon())
            .await
            .expect_err("overlong");
        assert!(matches!(err, HandshakeError::TooLong), "{err:?}");
        let err = handshake(&dir.sock(), 1024, soon()).await.expect_err("eof");
        assert!(matches!(err, HandshakeError::Closed), "{err:?}");
        assert!(err.is_transient());
        // A reply that never ends: bounded in time.
        let started = std::time::Instant::now();
        let err = handshake(
            &dir.sock(),
            1024,
            Instant::now() + Duration::from_millis(200),
        )
        .await
        .expect_err("no newline");
        assert!(matches!(err, HandshakeError::TimedOut), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(vmm.join());
    }

    #[tokio::test]
    async fn connect_fails_fast_on_garbage() {
        let dir = TempDir::new("fast");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let vmm = vmm(listener, vec![Some(b"HELLO\n")]);
        let started = std::time::Instant::now();
        let err = connect(&dir.sock(), 1024, Duration::from_secs(30))
            .await
            .expect_err("garbage is final");
        assert!(
            matches!(
                err,
                AgentError::Handshake {
                    source: HandshakeError::Garbage(_),
                    ..
                }
            ),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(vmm.join());
    }

    #[tokio::test]
    async fn connect_times_out_when_nothing_listens() {
        let dir = TempDir::new("absent");
        let started = std::time::Instant::now();
        let err = connect(&dir.sock(), 1024, Duration::from_millis(300))
            .await
            .expect_err("no socket");
        assert!(
            matches!(
                err,
                AgentError::ConnectTimeout {
                    last: HandshakeError::Connect { .. },
                    ..
                }
            ),
            "{err}"
        );
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(100) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn stdio_stream_handshakes_then_sends_its_header() {
        let dir = TempDir::new("stdio");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let peer = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            reader.read_line(&mut line).expect("CONNECT");
            assert_eq!(line, "CONNECT 1025\n");
            let mut stream = stream;
            stream.write_all(b"OK 9\n").expect("reply");
            let mut header = String::new();
            reader.read_line(&mut header).expect("header");
            header
        });
        let stream = open_stdio_stream(
            &dir.sock(),
            "c1",
            "",
            StreamKind::Stdout,
            Duration::from_secs(5),
        )
        .await
        .expect("stream");
        assert_eq!(peer.join().expect("peer"), "c1 - stdout\n");
        drop(stream);
        let err = open_stdio_stream(
            &dir.sock(),
            "../x",
            "",
            StreamKind::Stdin,
            Duration::from_secs(1),
        )
        .await
        .expect_err("bad id");
        assert!(matches!(err, AgentError::BadReply { .. }), "{err}");
    }
}
