//! Copying a process's stdio between containerd's FIFOs and the agent's stdio streams: each
//! stream is its own hybrid-vsock connection to the agent's stdio port carrying raw bytes
//! (design.md 2, step 6). One plain thread per stream; each ends at EOF of its source.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
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

/// Opens the agent's streams for the wanted FIFOs of process (`container_id`, `exec_id`) and
/// starts copying. Returns the copy threads (joined by whoever wants to know they ended).
pub fn attach(
    agent_socket: &Path,
    container_id: &str,
    exec_id: &str,
    fifos: &Fifos,
) -> Result<Vec<JoinHandle<()>>, StdioError> {
    let mut threads = Vec::new();
    let open = |kind| open_stdio_stream(agent_socket, container_id, exec_id, kind, STREAM_TIMEOUT);
    if !fifos.stdin.is_empty() {
        let stream = open(StreamKind::Stdin)?;
        let path = PathBuf::from(&fifos.stdin);
        threads.push(spawn_copy("stdin", move || {
            // Blocks until containerd opens its write end; EOF when it closes it.
            let fifo = File::open(&path)?;
            copy_then_close(fifo, stream)
        })?);
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
        threads.push(spawn_copy("output", move || copy_output(stream, fifo))?);
    }
    Ok(threads)
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

/// stdin: FIFO to stream; at EOF the stream's write side is shut down (the process sees EOF).
fn copy_then_close(mut fifo: File, mut stream: UnixStream) -> io::Result<()> {
    io::copy(&mut fifo, &mut stream)?;
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

    #[test]
    fn copies_stdin_to_eof_and_output_until_closed() {
        let dir = tempfile::tempdir().unwrap();
        // stdin: a file stands in for the FIFO.
        let input = dir.path().join("in");
        std::fs::write(&input, b"hello\n").unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        copy_then_close(File::open(&input).unwrap(), ours).unwrap();
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
