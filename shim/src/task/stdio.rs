//! Copying a process's stdio between containerd's FIFOs and the agent's stdio streams: each
//! stream is its own hybrid-vsock connection to the agent's stdio port carrying raw bytes
//! (design.md 2, step 6). One plain thread per stream; each ends at EOF of its source.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::agent_client::{open_stdio_stream, AgentError, StreamKind};

/// How long opening a stdio stream to the agent may take.
const STREAM_TIMEOUT: Duration = Duration::from_secs(10);

/// The FIFO paths containerd gave for a process (empty: not wanted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fifos {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

/// Why stdio could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("opening {path}: {source}")]
    Fifo { path: PathBuf, source: io::Error },
}

/// The stdin copy of a process: FIFO to stream. It ends at the FIFO's EOF (containerd closed
/// its write end) or, once [`StdinCopy::close`] was called, as soon as the FIFO holds nothing
/// more to read; then it shuts down the stream's write side (the process sees EOF after every
/// byte written before).
#[derive(Debug)]
pub struct StdinCopy {
    thread: JoinHandle<()>,
    closing: Arc<AtomicBool>,
    fifo: String,
}

impl StdinCopy {
    /// CloseIO: ends the copy once what containerd wrote has been read; waits at most
    /// `timeout`. True if the copy ended (the process's stdin is closed after all its bytes).
    pub fn close(self, timeout: Duration) -> bool {
        self.closing.store(true, Ordering::SeqCst);
        // A copy still waiting for containerd to open the FIFO: give it EOF.
        release_stdin_fifo(&self.fifo);
        wait_threads(&mut vec![self.thread], timeout)
    }
}

/// The copy threads of one process's stdio.
#[derive(Debug, Default)]
pub struct Attached {
    pub stdin: Option<StdinCopy>,
    /// Streams to FIFOs; each ends when the process's side of the stream closes.
    pub outputs: Vec<JoinHandle<()>>,
}

impl Attached {
    /// Waits, at most `timeout`, until the output copies ended (everything the process wrote
    /// reached containerd); true if they did.
    pub fn wait_outputs(&mut self, timeout: Duration) -> bool {
        wait_threads(&mut self.outputs, timeout)
    }
}

fn wait_threads(threads: &mut Vec<JoinHandle<()>>, timeout: Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let (done, running): (Vec<_>, Vec<_>) =
            threads.drain(..).partition(JoinHandle::is_finished);
        for t in done {
            let _ = t.join();
        }
        *threads = running;
        if threads.is_empty() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Unblocks a stdin copy thread still waiting for containerd to open `path` (a process deleted
/// before anyone wrote to it): a writer that opens and closes at once gives it EOF. Harmless if
/// a writer is attached (its own end stays open) or the FIFO is gone.
pub fn release_stdin_fifo(path: &str) {
    if path.is_empty() {
        return;
    }
    let _ = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path);
}

/// Opens the agent's streams for the wanted FIFOs of process (`container_id`, `exec_id`) and
/// starts copying. Returns the copy threads.
pub fn attach(
    agent_socket: &Path,
    container_id: &str,
    exec_id: &str,
    fifos: &Fifos,
) -> Result<Attached, StdioError> {
    let mut threads = Attached::default();
    let open = |kind| open_stdio_stream(agent_socket, container_id, exec_id, kind, STREAM_TIMEOUT);
    if !fifos.stdin.is_empty() {
        let stream = open(StreamKind::Stdin)?;
        let path = PathBuf::from(&fifos.stdin);
        let closing = Arc::new(AtomicBool::new(false));
        let flag = closing.clone();
        let thread = spawn_copy("stdin", move || {
            // Blocks until containerd opens its write end; EOF when it closes it.
            let fifo = File::open(&path)?;
            copy_then_close(fifo, stream, &flag)
        })?;
        threads.stdin = Some(StdinCopy {
            thread,
            closing,
            fifo: fifos.stdin.clone(),
        });
    }
    if let Err(e) = attach_outputs(&mut threads, &open, fifos) {
        // Nothing will write to the process: the stdin thread must not wait for containerd.
        release_stdin_fifo(&fifos.stdin);
        return Err(e);
    }
    Ok(threads)
}

fn attach_outputs(
    threads: &mut Attached,
    open: &dyn Fn(StreamKind) -> Result<UnixStream, AgentError>,
    fifos: &Fifos,
) -> Result<(), StdioError> {
    // A terminal has one output stream: stdout.
    let outputs = [
        (StreamKind::Stdout, &fifos.stdout),
        (StreamKind::Stderr, &fifos.stderr),
    ];
    for (kind, path) in outputs {
        if path.is_empty() || (fifos.terminal && kind == StreamKind::Stderr) {
            continue;
        }
        let stream = open(kind)?;
        // O_RDWR: opening never blocks and the FIFO is never at EOF for containerd's reader
        // while we hold it.
        let fifo = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| StdioError::Fifo {
                path: PathBuf::from(path),
                source,
            })?;
        threads
            .outputs
            .push(spawn_copy("output", move || copy_output(stream, fifo))?);
    }
    Ok(())
}

fn spawn_copy(
    what: &'static str,
    f: impl FnOnce() -> io::Result<()> + Send + 'static,
) -> Result<JoinHandle<()>, StdioError> {
    std::thread::Builder::new()
        .name(format!("stdio-{what}"))
        .spawn(move || {
            if let Err(e) = f() {
                log::debug!("stdio {what} copy ended: {e}");
            }
        })
        .map_err(|source| StdioError::Fifo {
            path: PathBuf::from(what),
            source,
        })
}

/// How often an idle stdin copy looks at its closing flag.
const STDIN_POLL_MS: libc::c_int = 100;

/// stdin: FIFO to stream until the FIFO's EOF, or until `closing` is set and nothing is left
/// to read; then the stream's write side is shut down (the process sees EOF).
fn copy_then_close(mut fifo: File, mut stream: UnixStream, closing: &AtomicBool) -> io::Result<()> {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let mut pfd = libc::pollfd {
            fd: fifo.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd that lives across the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, STDIN_POLL_MS) };
        if ready < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if ready == 0 {
            if closing.load(Ordering::SeqCst) {
                break;
            }
            continue;
        }
        let n = fifo.read(&mut buf)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
    }
    stream.shutdown(Shutdown::Write)
}

/// stdout/stderr: stream to FIFO until the process's side closes.
fn copy_output(mut stream: UnixStream, mut fifo: File) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return fifo.flush();
        }
        fifo.write_all(&buf[..n])?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    /// CloseIO while the writer keeps its end open (as `ctr task exec` does): what was written
    /// is delivered, then the stream ends.
    #[test]
    fn close_delivers_what_was_written_then_ends_the_stream() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdin");
        mkfifo(&fifo);
        let (ours, theirs) = UnixStream::pair().unwrap();
        let closing = Arc::new(AtomicBool::new(false));
        let flag = closing.clone();
        let path = fifo.clone();
        let thread = std::thread::spawn(move || {
            let f = File::open(&path).unwrap();
            copy_then_close(f, ours, &flag)
        });
        let mut writer = OpenOptions::new().write(true).open(&fifo).unwrap();
        writer.write_all(b"abc\n").unwrap();
        let copy = StdinCopy {
            thread: std::thread::spawn(move || thread.join().unwrap().unwrap()),
            closing,
            fifo: fifo.to_string_lossy().into_owned(),
        };
        assert!(copy.close(Duration::from_secs(5)), "the copy did not end");
        let mut got = String::new();
        (&theirs).read_to_string(&mut got).unwrap();
        assert_eq!(got, "abc\n");
        drop(writer);
    }

    /// A copy still waiting for containerd to open the FIFO is released.
    #[test]
    fn release_unblocks_a_copy_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdin");
        mkfifo(&fifo);
        let path = fifo.clone();
        let t = std::thread::spawn(move || File::open(&path).map(|_| ()));
        // (Until the thread is inside open(2) there is no reader and a release is a no-op.)
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !t.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "still blocked in open"
            );
            release_stdin_fifo(&fifo.to_string_lossy());
            std::thread::sleep(Duration::from_millis(20));
        }
        t.join().unwrap().unwrap();
    }

    #[test]
    fn copies_stdin_to_eof_and_output_until_closed() {
        let dir = tempfile::tempdir().unwrap();
        // stdin: a file stands in for the FIFO.
        let input = dir.path().join("in");
        std::fs::write(&input, b"hello\n").unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        copy_then_close(File::open(&input).unwrap(), ours, &AtomicBool::new(false)).unwrap();
        let mut got = String::new();
        (&theirs).read_to_string(&mut got).unwrap();
        assert_eq!(got, "hello\n");

        let out = dir.path().join("out");
        let (ours, theirs) = UnixStream::pair().unwrap();
        let t = std::thread::spawn({
            let f = File::create(&out).unwrap();
            move || copy_output(ours, f)
        });
        (&theirs).write_all(b"line 1\nline 2\n").unwrap();
        drop(theirs);
        t.join().unwrap().unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "line 1\nline 2\n");
    }
}
