//! The agent's readiness as an event: before the VM starts, the host listens on the Unix socket
//! `<vsock uds>_<AGENT_READY_PORT>`; the agent, once its ttrpc server is up, connects to host
//! vsock port [`AGENT_READY_PORT`] (hybrid vsock turns that into a connection to our socket:
//! our VMM's muxer and vhost-device-vsock both do) and writes its ready line. Nothing knocks on
//! the guest before that (vhost-device-vsock 0.3.0 can wedge after connections the guest
//! refused, docs/qemu-backend.md).
//!
//! The guest is hostile: one connection is read, its line is bounded in length and time, and
//! anything but the ready line is an error.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use agent_protocol::{AGENT_READY_PORT, AGENT_READY_PREFIX};

/// Longest ready line accepted, newline included.
const MAX_READY_LINE: usize = 128;
/// How long the agent may take to write its line once connected.
const LINE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the waiter looks whether the VM ended meanwhile.
const END_CHECK: Duration = Duration::from_millis(100);

/// Why the agent's ready event did not come.
#[derive(Debug, thiserror::Error)]
pub enum ReadyError {
    #[error("listening on {path} for the agent: {source}")]
    Listen { path: PathBuf, source: io::Error },
    #[error("waiting on {path} for the agent: {source}")]
    Wait { path: PathBuf, source: io::Error },
    #[error("the guest agent did not report ready within {0:?}")]
    TimedOut(Duration),
    #[error("the guest ended before its agent was ready")]
    Ended,
    #[error("the guest sent {0:?} instead of the agent's ready line")]
    BadLine(String),
}

/// The host end of the ready port of one VM; the socket file is removed on drop.
#[derive(Debug)]
pub struct ReadyListener {
    listener: UnixListener,
    path: PathBuf,
}

/// The socket a VM whose hybrid-vsock socket is `vsock_uds` connects to for `port`.
pub fn host_port_path(vsock_uds: &Path, port: u32) -> PathBuf {
    let mut path = vsock_uds.as_os_str().to_owned();
    path.push(format!("_{port}"));
    PathBuf::from(path)
}

impl ReadyListener {
    /// Listens on the ready port of the VM whose hybrid-vsock socket will be `vsock_uds`.
    pub fn bind(vsock_uds: &Path) -> Result<Self, ReadyError> {
        let path = host_port_path(vsock_uds, AGENT_READY_PORT);
        // A leftover of a VM that died with its shim.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|source| ReadyError::Listen {
            path: path.clone(),
            source,
        })?;
        Ok(Self { listener, path })
    }

    /// Waits at most `timeout` for the agent's ready line; `ended` is asked now and then
    /// whether the VM has ended (then waiting is pointless).
    pub fn wait(
        &self,
        timeout: Duration,
        mut ended: impl FnMut() -> bool,
    ) -> Result<(), ReadyError> {
        let deadline = Instant::now() + timeout;
        let wait_err = |source| ReadyError::Wait {
            path: self.path.clone(),
            source,
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadyError::TimedOut(timeout));
            }
            if readable(&self.listener, left.min(END_CHECK)).map_err(wait_err)? {
                let (stream, _) = self.listener.accept().map_err(wait_err)?;
                return read_ready_line(stream);
            }
            if ended() {
                return Err(ReadyError::Ended);
            }
        }
    }
}

impl Drop for ReadyListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether `listener` has a connection to accept within `timeout`.
fn readable(listener: &UnixListener, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: poll(2) on one pollfd that lives across the call; the fd is the listener's own.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(err);
    }
    Ok(n > 0)
}

/// Reads one bounded line from the agent and checks it is the ready line.
fn read_ready_line(mut stream: std::os::unix::net::UnixStream) -> Result<(), ReadyError> {
    let deadline = Instant::now() + LINE_TIMEOUT;
    let mut line = Vec::with_capacity(MAX_READY_LINE);
    let bad = |line: &[u8]| ReadyError::BadLine(String::from_utf8_lossy(line).into_owned());
    let mut buf = [0u8; MAX_READY_LINE];
    while !line.contains(&b'\n') {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(bad(&line));
        }
        let _ = stream.set_read_timeout(Some(left));
        let room = MAX_READY_LINE.saturating_sub(line.len());
        if room == 0 {
            return Err(bad(&line));
        }
        match stream.read(&mut buf[..room]) {
            Ok(0) => break,
            Ok(n) => line.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(bad(&line)),
        }
    }
    let text = line.split(|b| *b == b'\n').next().unwrap_or_default();
    if text.starts_with(AGENT_READY_PREFIX.as_bytes()) {
        Ok(())
    } else {
        Err(bad(&line))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use super::*;

    fn uds(dir: &tempfile::TempDir) -> PathBuf {
        dir.path().join("vsock.sock")
    }

    #[test]
    fn the_ready_line_on_the_port_is_the_event() {
        let dir = tempfile::tempdir().unwrap();
        let ready = ReadyListener::bind(&uds(&dir)).unwrap();
        let path = dir.path().join("vsock.sock_1026");
        assert!(path.exists());
        let agent = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let mut s = UnixStream::connect(&path).unwrap();
            s.write_all(b"microvm-agent: ready (vsock port 1024)\n")
                .unwrap();
        });
        ready.wait(Duration::from_secs(5), || false).unwrap();
        agent.join().unwrap();
        drop(ready);
        assert!(
            !dir.path().join("vsock.sock_1026").exists(),
            "socket file left"
        );
    }

    #[test]
    fn garbage_silence_an_ended_vm_and_the_timeout_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let ready = ReadyListener::bind(&uds(&dir)).unwrap();
        let path = host_port_path(&uds(&dir), AGENT_READY_PORT);
        // Garbage, and an endless line: bounded.
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(b"hello\n").unwrap();
        let err = ready.wait(Duration::from_secs(5), || false).unwrap_err();
        assert!(
            matches!(err, ReadyError::BadLine(ref l) if l == "hello\n"),
            "{err}"
        );
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(&[b'x'; 500]).unwrap();
        let err = ready.wait(Duration::from_secs(5), || false).unwrap_err();
        assert!(
            matches!(err, ReadyError::BadLine(ref l) if l.len() == MAX_READY_LINE),
            "{err}"
        );
        // A VM that ended: told at the next look.
        let started = Instant::now();
        let err = ready.wait(Duration::from_secs(30), || true).unwrap_err();
        assert!(matches!(err, ReadyError::Ended), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
        // Nothing comes at all.
        let err = ready
            .wait(Duration::from_millis(300), || false)
            .unwrap_err();
        assert!(matches!(err, ReadyError::TimedOut(_)), "{err}");
    }
}
