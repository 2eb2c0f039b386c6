//! Stdio streams: one connection of raw bytes per stream (protocol/agent.proto has the header
//! protocol). A process's [`Streams`] hold the agent's ends of its pipes (or its pty master); a
//! connection that arrives with a valid header is paired with its end, in whichever order the two
//! appear, and one copy thread then moves the bytes until EOF.
//!
//! Before a stream is attached nobody reads the process's pipe: once the pipe's 64 KiB are full
//! the process blocks on output (backpressure, nothing dropped, memory bounded).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_protocol::stdio::{StreamHeader, StreamKind, MAX_HEADER_LEN};

use crate::listener::{self, shutdown, Conn, ListenError};

/// Time a new connection has to send its header.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Copy buffer size.
const COPY_CHUNK: usize = 32 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error("creating a pipe: {0}")]
    Pipe(io::Error),
    #[error("opening /dev/null: {0}")]
    DevNull(io::Error),
    #[error("stdio streams: {0}")]
    Listen(#[from] ListenError),
}

/// One end of a stream inside the agent: a pipe end or a dup of the pty master.
type Endpoint = File;

#[derive(Default)]
struct Slot {
    /// The agent's end, until a copy thread takes it.
    endpoint: Option<Endpoint>,
    /// The host's connection, until a copy thread takes it.
    conn: Option<Conn>,
    /// For stdin once attached: a handle to shut the connection's read side (CloseStdin).
    attached: Option<Conn>,
    /// A connection was attached (a second one is refused) or the stream was closed.
    taken: bool,
}

/// The agent's side of one process's stdio.
#[derive(Default)]
pub struct Streams {
    slots: Mutex<HashMap<StreamKind, Slot>>,
    pty: Mutex<Option<File>>,
}

/// The process's ends, handed to libcontainer (None: inherit nothing, /dev/null is given).
pub struct ChildStdio {
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

fn pipe() -> Result<(File, File), StdioError> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(StdioError::Pipe(io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded: both fds are new and ours.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

fn dev_null() -> Result<OwnedFd, StdioError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map(OwnedFd::from)
        .map_err(StdioError::DevNull)
}

impl Streams {
    /// Pipes for the requested streams (`/dev/null` for the others). With a terminal, no pipes:
    /// the pty master comes later through [`Streams::set_pty`].
    pub fn new(
        terminal: bool,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> Result<(Arc<Self>, Option<ChildStdio>), StdioError> {
        let streams = Arc::new(Self::default());
        let mut slots = HashMap::new();
        if terminal {
            for (kind, wanted) in [(StreamKind::Stdin, stdin), (StreamKind::Stdout, stdout)] {
                if wanted {
                    slots.insert(kind, Slot::default());
                }
            }
            *streams.slots.lock().unwrap_or_else(|e| e.into_inner()) = slots;
            return Ok((streams, None));
        }
        let child_stdin = if stdin {
            let (read, write) = pipe()?;
            slots.insert(
                StreamKind::Stdin,
                Slot {
                    endpoint: Some(write),
                    ..Slot::default()
                },
            );
            OwnedFd::from(read)
        } else {
            dev_null()?
        };
        let mut output = |kind: StreamKind, wanted: bool| -> Result<OwnedFd, StdioError> {
            if !wanted {
                return dev_null();
            }
            let (read, write) = pipe()?;
            slots.insert(
                kind,
                Slot {
                    endpoint: Some(read),
                    ..Slot::default()
                },
            );
            Ok(OwnedFd::from(write))
        };
        let child_stdout = output(StreamKind::Stdout, stdout)?;
        let child_stderr = output(StreamKind::Stderr, stderr)?;
        *streams.slots.lock().unwrap_or_else(|e| e.into_inner()) = slots;
        Ok((
            streams,
            Some(ChildStdio {
                stdin: child_stdin,
                stdout: child_stdout,
                stderr: child_stderr,
            }),
        ))
    }

    /// Gives the pty master (terminal mode): stdin writes to it, stdout reads from it.
    pub fn set_pty(&self, master: File) -> io::Result<()> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        for kind in [StreamKind::Stdin, StreamKind::Stdout] {
            if let Some(slot) = slots.get_mut(&kind) {
                slot.endpoint = Some(master.try_clone()?);
            }
        }
        for kind in [StreamKind::Stdin, StreamKind::Stdout] {
            if let Some(slot) = slots.get_mut(&kind) {
                start_copy_if_ready(kind, slot);
            }
        }
        *self.pty.lock().unwrap_or_else(|e| e.into_inner()) = Some(master);
        Ok(())
    }

    /// Sets the pty's window size; false without a pty.
    pub fn resize(&self, width: u16, height: u16) -> io::Result<bool> {
        let pty = self.pty.lock().unwrap_or_else(|e| e.into_inner());
        let Some(master) = pty.as_ref() else {
            return Ok(false);
        };
        let size = libc::winsize {
            ws_row: height,
            ws_col: width,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize from the pointer, which is valid for the call.
        if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(true)
    }

    /// Closes the process's stdin: drops the agent's end, or ends the attached connection's
    /// input so its copy thread closes it.
    pub fn close_stdin(&self) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get_mut(&StreamKind::Stdin) {
            slot.taken = true;
            slot.endpoint = None;
            slot.conn = None;
            if let Some(conn) = slot.attached.take() {
                shutdown(&conn, libc::SHUT_RD);
            }
        }
    }

    /// Pairs a host connection with a stream. Err: no such stream, or already attached.
    fn attach(&self, kind: StreamKind, conn: Conn) -> Result<(), &'static str> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots
            .get_mut(&kind)
            .ok_or("the process has no such stream")?;
        if slot.taken {
            return Err("the stream is already attached or closed");
        }
        slot.taken = true;
        if kind == StreamKind::Stdin {
            slot.attached = conn.try_clone().ok();
        }
        slot.conn = Some(conn);
        start_copy_if_ready(kind, slot);
        Ok(())
    }
}

fn start_copy_if_ready(kind: StreamKind, slot: &mut Slot) {
    if slot.endpoint.is_none() || slot.conn.is_none() {
        return;
    }
    let (Some(endpoint), Some(conn)) = (slot.endpoint.take(), slot.conn.take()) else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name(format!("stdio-{kind}"))
        .spawn(move || match kind {
            StreamKind::Stdin => copy_stdin(conn, endpoint),
            StreamKind::Stdout | StreamKind::Stderr => copy_output(endpoint, conn),
        });
    if let Err(err) = spawned {
        log::warn!("stdio: no thread for {kind}: {err}");
    }
}

fn copy_stdin(mut conn: Conn, mut endpoint: Endpoint) {
    let mut buf = vec![0u8; COPY_CHUNK];
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if endpoint.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    // Dropping the endpoint closes the process's stdin (the last write end).
}

fn copy_output(mut endpoint: Endpoint, mut conn: Conn) {
    let mut buf = vec![0u8; COPY_CHUNK];
    loop {
        let n = match endpoint.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // EIO: the pty's last slave fd closed.
            Err(_) => break,
        };
        if conn.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    shutdown(&conn, libc::SHUT_WR);
}

/// Finds a process's streams by (container id, exec id).
pub trait StreamLookup: Send + Sync + 'static {
    fn streams(&self, container_id: &str, exec_id: &str) -> Option<Arc<Streams>>;
}

/// Reads the header line (what follows is stdin data), bounded in size and time.
fn read_header(conn: &mut Conn) -> Result<StreamHeader, String> {
    let line = listener::read_line(conn, MAX_HEADER_LEN, HEADER_TIMEOUT)?;
    StreamHeader::parse(&line).map_err(|e| e.to_string())
}

fn handle_connection(mut conn: Conn, lookup: &dyn StreamLookup) {
    let header = match read_header(&mut conn) {
        Ok(h) => h,
        Err(e) => {
            log::warn!("stdio connection refused: {e}");
            return;
        }
    };
    let Some(streams) = lookup.streams(&header.container_id, &header.exec_id) else {
        log::warn!(
            "stdio connection refused: no process {} {:?}",
            header.container_id,
            header.exec_id
        );
        return;
    };
    if let Err(e) = streams.attach(header.kind, conn) {
        log::warn!(
            "stdio connection refused: {} {:?} {}: {e}",
            header.container_id,
            header.exec_id,
            header.kind
        );
    }
}

/// The default stdio address in the guest.
pub fn default_address() -> String {
    format!("vsock://-1:{}", agent_protocol::AGENT_STDIO_PORT)
}

/// Binds `address` (`vsock://-1:PORT` or `unix:///path`) and serves stdio connections for the
/// agent's whole life.
pub fn serve(address: &str, lookup: Arc<dyn StreamLookup>) -> Result<(), StdioError> {
    listener::serve(address, "stdio", move |conn| {
        handle_connection(conn, lookup.as_ref())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    struct One(Arc<Streams>);

    impl StreamLookup for One {
        fn streams(&self, container_id: &str, exec_id: &str) -> Option<Arc<Streams>> {
            (container_id == "c1" && exec_id.is_empty()).then(|| self.0.clone())
        }
    }

    #[test]
    fn pipes_reach_connections_in_either_order() {
        let dir = std::env::temp_dir().join(format!("agent-stdio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let sock = dir.join("stdio.sock");
        let (streams, child) = Streams::new(false, true, true, false).expect("streams");
        let child = child.expect("pipes");
        serve(
            &format!("unix://{}", sock.display()),
            Arc::new(One(streams.clone())),
        )
        .expect("serve");

        // Output written before the connection waits in the pipe.
        let mut out = File::from(child.stdout);
        out.write_all(b"early ").expect("write");
        let mut conn = UnixStream::connect(&sock).expect("connect");
        conn.write_all(b"c1 - stdout\n").expect("header");
        out.write_all(b"late").expect("write");
        drop(out);
        let mut got = String::new();
        conn.read_to_string(&mut got).expect("read to EOF");
        assert_eq!(got, "early late");

        // Stdin: data then EOF reach the process's end.
        let mut stdin = UnixStream::connect(&sock).expect("connect");
        stdin.write_all(b"c1 - stdin\nhello").expect("write");
        stdin.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut input = String::new();
        File::from(child.stdin)
            .read_to_string(&mut input)
            .expect("read to EOF");
        assert_eq!(input, "hello");

        // Refused: second attach, absent stream, unknown process, garbage. Each is closed.
        for header in [
            &b"c1 - stdout\n"[..],
            b"c1 - stderr\n",
            b"c2 - stdout\n",
            b"garbage\n",
        ] {
            let mut conn = UnixStream::connect(&sock).expect("connect");
            conn.write_all(header).expect("header");
            let mut rest = Vec::new();
            conn.read_to_end(&mut rest).expect("closed");
            assert!(rest.is_empty());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
