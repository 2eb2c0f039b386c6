//! Copying a process's stdio between containerd's FIFOs and the agent's stdio streams: each
//! stream is its own hybrid-vsock connection to the agent's stdio port carrying raw bytes.
//! One tokio task per stream (no thread parked per stream); each ends at
//! EOF of its source.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{open_stdio_stream, AgentError, StreamKind};

/// How long a closing stdin copy waits for more bytes before it ends the stream.
const STDIN_IDLE: Duration = Duration::from_millis(100);
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

impl Fifos {
    /// Which streams the agent is to offer for these FIFOs (a terminal has no stderr).
    pub fn agent_stdio(&self) -> agent_protocol::agent::Stdio {
        agent_protocol::agent::Stdio {
            terminal: self.terminal,
            stdin: !self.stdin.is_empty(),
            stdout: !self.stdout.is_empty(),
            stderr: !self.stderr.is_empty() && !self.terminal,
            ..Default::default()
        }
    }
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
    task: JoinHandle<()>,
    closing: watch::Sender<bool>,
    fifo: String,
}

impl StdinCopy {
    /// CloseIO: ends the copy once what containerd wrote has been read; waits at most
    /// `timeout`. True if the copy ended (the process's stdin is closed after all its bytes).
    pub async fn close(self, timeout: Duration) -> bool {
        let _ = self.closing.send(true);
        // A copy that never saw a writer: give it EOF.
        release_stdin_fifo(&self.fifo);
        tokio::time::timeout(timeout, self.task).await.is_ok()
    }
}

/// The copy tasks of one process's stdio.
#[derive(Debug, Default)]
pub struct Attached {
    pub stdin: Option<StdinCopy>,
    /// Streams to FIFOs; each ends when the process's side of the stream closes.
    pub outputs: Vec<JoinHandle<()>>,
}

impl Attached {
    /// Waits, at most `timeout`, until the output copies ended (everything the process wrote
    /// reached containerd); true if they did.
    pub async fn wait_outputs(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while let Some(mut task) = self.outputs.pop() {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                self.outputs.push(task);
                return false;
            }
        }
        true
    }

    /// Ends the output copies still running: their FIFO ends close, and containerd's readers
    /// see EOF.
    pub fn abort_outputs(&mut self) {
        for task in self.outputs.drain(..) {
            task.abort();
        }
    }
}

/// Gives a stdin copy that no writer ever opened its FIFO for EOF (a process deleted before
/// anyone wrote to it): a writer that opens and closes at once. Harmless if a writer is
/// attached (its own end stays open) or the FIFO is gone.
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
/// starts copying. Returns the copy tasks.
pub async fn attach(
    agent_socket: &Path,
    container_id: &str,
    exec_id: &str,
    fifos: &Fifos,
) -> Result<Attached, StdioError> {
    let mut attached = Attached::default();
    let fifo_err = |path: &str| {
        let path = PathBuf::from(path);
        move |source| StdioError::Fifo { path, source }
    };
    if !fifos.stdin.is_empty() {
        let stream = open_stdio_stream(
            agent_socket,
            container_id,
            exec_id,
            StreamKind::Stdin,
            STREAM_TIMEOUT,
        )
        .await?;
        // Non-blocking open: no writer yet is fine; the FIFO reads nothing (and no EOF) until
        // containerd has opened its end and closed it again.
        let fifo = pipe::OpenOptions::new()
            .open_receiver(&fifos.stdin)
            .map_err(fifo_err(&fifos.stdin))?;
        let (closing, closed) = watch::channel(false);
        let task = tokio::spawn(async move {
            if let Err(e) = copy_stdin(fifo, stream, closed).await {
                log::debug!("stdio stdin copy ended: {e}");
            }
        });
        attached.stdin = Some(StdinCopy {
            task,
            closing,
            fifo: fifos.stdin.clone(),
        });
    }
    // A terminal has one output stream: stdout.
    let outputs = [
        (StreamKind::Stdout, &fifos.stdout),
        (StreamKind::Stderr, &fifos.stderr),
    ];
    for (kind, path) in outputs {
        if path.is_empty() || (fifos.terminal && kind == StreamKind::Stderr) {
            continue;
        }
        let opened = async {
            let stream =
                open_stdio_stream(agent_socket, container_id, exec_id, kind, STREAM_TIMEOUT)
                    .await?;
            // Read-write: opening never blocks and the FIFO is never at EOF for containerd's
            // reader while we hold it.
            let fifo = pipe::OpenOptions::new()
                .read_write(true)
                .open_sender(path)
                .map_err(fifo_err(path))?;
            Ok::<_, StdioError>((stream, fifo))
        };
        let (stream, fifo) = match opened.await {
            Ok(pair) => pair,
            Err(e) => {
                // Nothing will write to the process: the stdin copy must not wait for containerd.
                if let Some(stdin) = attached.stdin.take() {
                    stdin.task.abort();
                }
                return Err(e);
            }
        };
        attached.outputs.push(tokio::spawn(async move {
            if let Err(e) = copy_output(stream, fifo).await {
                log::debug!("stdio output copy ended: {e}");
            }
        }));
    }
    Ok(attached)
}

/// stdin: FIFO to stream until the FIFO's EOF, or until `closing` turns true and nothing is
/// left to read; then the stream's write side is shut down (the process sees EOF).
async fn copy_stdin(
    mut fifo: pipe::Receiver,
    mut stream: impl AsyncWrite + Unpin,
    mut closing: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut buf = vec![0u8; 32 * 1024];
    let mut watching = true;
    loop {
        tokio::select! {
            read = fifo.read(&mut buf) => {
                let n = read?;
                if n == 0 {
                    break;
                }
                stream.write_all(&buf[..n]).await?;
            }
            asked = async { closing.wait_for(|c| *c).await.map(drop) }, if watching => {
                if asked.is_err() {
                    // Nobody can ask any more: copy until EOF.
                    watching = false;
                    continue;
                }
                // What containerd already wrote goes through, then the stream ends: read
                // until the FIFO stays empty for a moment (the readiness tokio caches may lag
                // behind a write that just happened, so an instant look could miss it).
                loop {
                    match tokio::time::timeout(STDIN_IDLE, fifo.read(&mut buf)).await {
                        Err(_) | Ok(Ok(0)) => break,
                        Ok(Ok(n)) => stream.write_all(&buf[..n]).await?,
                        Ok(Err(e)) => return Err(e),
                    }
                }
                break;
            }
        }
    }
    stream.shutdown().await
}

/// stdout/stderr: stream to FIFO until the process's side closes.
async fn copy_output(
    mut stream: impl AsyncRead + Unpin,
    mut fifo: impl AsyncWrite + Unpin,
) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return fifo.flush().await;
        }
        fifo.write_all(&buf[..n]).await?;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use tokio::net::UnixStream;

    use super::*;

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    fn spawn_stdin_copy(fifo: &Path, ours: UnixStream) -> StdinCopy {
        let receiver = pipe::OpenOptions::new().open_receiver(fifo).unwrap();
        let (closing, closed) = watch::channel(false);
        StdinCopy {
            task: tokio::spawn(async move { copy_stdin(receiver, ours, closed).await.unwrap() }),
            closing,
            fifo: fifo.to_string_lossy().into_owned(),
        }
    }

    /// CloseIO while the writer keeps its end open (as `ctr task exec` does): what was written
    /// is delivered, then the stream ends.
    #[tokio::test]
    async fn close_delivers_what_was_written_then_ends_the_stream() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdin");
        mkfifo(&fifo);
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let copy = spawn_stdin_copy(&fifo, ours);
        let mut writer = OpenOptions::new().write(true).open(&fifo).unwrap();
        writer.write_all(b"abc\n").unwrap();
        assert!(
            copy.close(Duration::from_secs(5)).await,
            "the copy did not end"
        );
        let mut got = String::new();
        theirs.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "abc\n");
        drop(writer);
    }

    /// A copy whose FIFO no writer ever opened waits (no EOF), until released.
    #[tokio::test]
    async fn release_ends_a_copy_that_never_had_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdin");
        mkfifo(&fifo);
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let copy = spawn_stdin_copy(&fifo, ours);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!copy.task.is_finished(), "EOF before any writer");
        release_stdin_fifo(&fifo.to_string_lossy());
        tokio::time::timeout(Duration::from_secs(5), copy.task)
            .await
            .expect("released")
            .unwrap();
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).await.unwrap();
        assert!(got.is_empty());
    }

    #[tokio::test]
    async fn copies_stdin_to_eof_and_output_until_closed() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdin");
        mkfifo(&fifo);
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let copy = spawn_stdin_copy(&fifo, ours);
        let mut writer = OpenOptions::new().write(true).open(&fifo).unwrap();
        writer.write_all(b"hello\n").unwrap();
        drop(writer);
        tokio::time::timeout(Duration::from_secs(5), copy.task)
            .await
            .expect("EOF ends the copy")
            .unwrap();
        let mut got = String::new();
        theirs.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "hello\n");

        let out = dir.path().join("out");
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let file = tokio::fs::File::create(&out).await.unwrap();
        let t = tokio::spawn(copy_output(ours, file));
        theirs.write_all(b"line 1\nline 2\n").await.unwrap();
        drop(theirs);
        t.await.unwrap().unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "line 1\nline 2\n");
    }

    /// An output copy whose process side stays open (a leftover child in the guest) holds the
    /// FIFO; aborting it gives containerd's reader EOF after what was copied.
    #[tokio::test]
    async fn aborted_output_copies_release_the_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdout");
        mkfifo(&fifo);
        let mut reader = pipe::OpenOptions::new().open_receiver(&fifo).unwrap();
        let sender = pipe::OpenOptions::new()
            .read_write(true)
            .open_sender(&fifo)
            .unwrap();
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut copies = Attached {
            stdin: None,
            outputs: vec![tokio::spawn(async move {
                let _ = copy_output(ours, sender).await;
            })],
        };
        theirs.write_all(b"before\n").await.unwrap();
        assert!(!copies.wait_outputs(Duration::from_millis(200)).await);
        copies.abort_outputs();
        let mut got = String::new();
        tokio::time::timeout(Duration::from_secs(5), reader.read_to_string(&mut got))
            .await
            .expect("EOF once the copy is aborted")
            .unwrap();
        assert_eq!(got, "before\n");
        drop(theirs);
    }
}
