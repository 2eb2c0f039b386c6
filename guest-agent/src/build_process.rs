//! libcontainer's builds (a container's init, an exec's process) run in a build process: a
//! fresh, single-threaded process of the agent's own binary (`/proc/self/exe` with [`ARG`]).
//!
//! libcontainer makes a container's processes with the raw `clone3` system call. In a
//! multi-threaded process that is not safe: the clone is a copy of the calling thread only, and
//! every lock another thread held at that instant (an allocator arena, stdio, the logger) stays
//! locked in the clone for ever, since no `pthread_atfork` handler runs. The agent has many
//! threads (the ttrpc server's, the reaper, the stdio copiers), so now and then a container's init
//! or an exec's process deadlocked before it reported to libcontainer, libcontainer waited for it
//! for ever while the agent held the reaper's lock, and the agent answered nothing more: the shim
//! saw "the agent did not reply in time" on CreateContainer or StartExec, then on every call.
//!
//! The build process is started with `std::process::Command` (fork and exec, which is safe in a
//! threaded program), so it has a single thread when libcontainer clones. It reads one
//! [`BuildRequest`] as JSON on stdin, finds the container's stdio at fds 3, 4 and 5 when the
//! request says so, runs the build, writes one [`BuildReply`] line on stdout and exits. The
//! processes it made are re-parented to the agent (PID 1, or a child subreaper in tests), which
//! reaps them as before: the caller holds the reaper's lock until it has registered the new pid.
//! The agent bounds the whole build ([`BUILD_TIMEOUT`]): a build process that does not answer is
//! killed with its process group and the call fails saying so.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use libcontainer::container::builder::ContainerBuilder;
use libcontainer::syscall::syscall::SyscallType;
use serde::{Deserialize, Serialize};

use crate::executor::{AgentExecutor, ExecSeccomp};
use crate::runtime_log;
use crate::stdio::ChildStdio;

/// The first argument that makes the agent's binary a build process.
pub const ARG: &str = "--libcontainer-build";

/// The agent's own binary.
const SELF_EXE: &str = "/proc/self/exe";

/// How long a build may take, answer included. Below the shim's bound on CreateContainer and
/// StartExec (shim/src/agent/client.rs `BUILD_CALL_TIMEOUT`), so that the shim hears why.
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(20);

/// Bounds on the request (a spec path and at most a seccomp profile) and the reply.
const MAX_REQUEST_BYTES: u64 = 4 << 20;
const MAX_REPLY_BYTES: usize = 256 << 10;

/// Where the build process finds the container's stdin, stdout and stderr.
const STDIO_FDS: [RawFd; 3] = [3, 4, 5];
/// Descriptors at or above this are out of the way of [`STDIO_FDS`] while they are placed.
const SCRATCH_FD_FLOOR: RawFd = 10;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("starting the build process ({SELF_EXE} {ARG}): {0}")]
    Spawn(io::Error),
    #[error("sending the build request: {0}")]
    Request(io::Error),
    #[error("reading the build process's answer: {0}")]
    Reply(io::Error),
    #[error("the build process did not answer within {0:?}; it was killed")]
    Timeout(Duration),
    #[error("the build process ended without answering")]
    NoReply,
    #[error("the build process's answer is longer than {MAX_REPLY_BYTES} bytes")]
    ReplyTooLong,
    #[error("the build process's answer is not valid: {0}")]
    BadReply(serde_json::Error),
    /// libcontainer's error chain, then what it logged as errors in the processes it cloned (the
    /// cause, with the value at fault).
    #[error("{error}{}", runtime_log::describe(.events))]
    Failed { error: String, events: Vec<String> },
}

/// What to build.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum BuildKind {
    /// A container's init from the bundle's config.json, waiting for Start.
    Init { bundle: PathBuf },
    /// An exec's process in a running container, from an OCI process file.
    Exec {
        process: PathBuf,
        seccomp: Option<Box<ExecSeccomp>>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildRequest {
    pub id: String,
    /// libcontainer's state root (the container's state is `<root>/<id>`).
    pub state_root: PathBuf,
    /// The console socket of a process with a terminal.
    pub console_socket: Option<PathBuf>,
    /// Whether fds 3, 4 and 5 hold the process's stdin, stdout and stderr.
    pub stdio: bool,
    pub kind: BuildKind,
}

#[derive(Debug, Serialize, Deserialize)]
enum BuildReply {
    Built { pid: libc::pid_t },
    Failed { error: String, events: Vec<String> },
}

/// Runs `request` in a build process and returns the new process's pid (the init's, the
/// exec's). `stdio` must be given exactly when `request.stdio` is set.
pub fn build(request: &BuildRequest, stdio: Option<ChildStdio>) -> Result<libc::pid_t, BuildError> {
    let text = serde_json::to_vec(request).map_err(|e| BuildError::Request(e.into()))?;
    let (mut reply, reply_end) = io::pipe().map_err(BuildError::Spawn)?;
    let mut command = Command::new(SELF_EXE);
    command
        .arg(ARG)
        .stdin(Stdio::piped())
        .stdout(reply_end)
        .stderr(Stdio::inherit())
        .process_group(0);
    if let Some(stdio) = &stdio {
        let fds = [
            stdio.stdin.as_raw_fd(),
            stdio.stdout.as_raw_fd(),
            stdio.stderr.as_raw_fd(),
        ];
        // SAFETY: the closure runs in the forked child before exec; it only calls fcntl(2),
        // dup2(2) and close(2), which are async-signal-safe, and allocates nothing.
        unsafe {
            command.pre_exec(move || place_stdio(fds));
        }
    }
    let mut child = command.spawn().map_err(BuildError::Spawn)?;
    // Our ends of the reply pipe's write side and of the container's stdio are the child's now.
    drop(command);
    drop(stdio);
    let pid = libc::pid_t::try_from(child.id()).unwrap_or(libc::pid_t::MAX);
    let deadline = Instant::now() + BUILD_TIMEOUT;
    let sent = match child.stdin.take() {
        Some(mut stdin) => stdin.write_all(&text).map_err(BuildError::Request),
        None => Err(BuildError::Request(io::Error::other("no stdin pipe"))),
    };
    let answer = sent.and_then(|()| read_line(&mut reply, deadline));
    if answer.is_err() {
        // Whatever it was doing, it is not finishing: end it with what it started in its group.
        // SAFETY: kill(2) of the process group the build process leads (process_group(0)).
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
    // The agent's reaper collects the build process (an unknown pid to it).
    drop(child);
    match serde_json::from_slice(&answer?).map_err(BuildError::BadReply)? {
        BuildReply::Built { pid } => Ok(pid),
        BuildReply::Failed { error, events } => Err(BuildError::Failed { error, events }),
    }
}

/// Puts `fds` at [`STDIO_FDS`] in a freshly forked child. Goes through copies above
/// [`SCRATCH_FD_FLOOR`] first, so that placing one cannot overwrite another still to place.
fn place_stdio(fds: [RawFd; 3]) -> io::Result<()> {
    let mut scratch = [-1; 3];
    for (copy, fd) in scratch.iter_mut().zip(fds) {
        // SAFETY: fcntl(F_DUPFD) on a descriptor this process holds.
        *copy = unsafe { libc::fcntl(fd, libc::F_DUPFD, SCRATCH_FD_FLOOR) };
        if *copy < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    for (copy, target) in scratch.into_iter().zip(STDIO_FDS) {
        // SAFETY: dup2(2) and close(2) of descriptors this process holds; the copy is not used
        // afterwards. dup2 leaves the target without close-on-exec, so it survives exec.
        unsafe {
            if libc::dup2(copy, target) < 0 {
                return Err(io::Error::last_os_error());
            }
            libc::close(copy);
        }
    }
    Ok(())
}

/// One line from `pipe`, without its newline, by `deadline`. The pipe's write end stays open in
/// the processes the build made (until they exec), so the line, not the end of the pipe, ends
/// the answer.
fn read_line(pipe: &mut io::PipeReader, deadline: Instant) -> Result<Vec<u8>, BuildError> {
    let mut line = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = line.iter().position(|b| *b == b'\n') {
            line.truncate(end);
            return Ok(line);
        }
        if line.len() > MAX_REPLY_BYTES {
            return Err(BuildError::ReplyTooLong);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(BuildError::Timeout(BUILD_TIMEOUT));
        }
        let mut pollfd = libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: poll(2) of one valid pollfd for at most `millis`.
        let ready = unsafe { libc::poll(&mut pollfd, 1, millis) };
        if ready < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(BuildError::Reply(err));
        }
        if ready == 0 {
            continue;
        }
        match pipe.read(&mut chunk) {
            Ok(0) => return Err(BuildError::NoReply),
            Ok(n) => line.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BuildError::Reply(e)),
        }
    }
}

/// The build process's `main`: serves one request and exits.
pub fn main() -> ! {
    let code = match serve() {
        Ok(()) => 0,
        Err(err) => {
            log::error!("build process: {err}");
            1
        }
    };
    std::process::exit(code)
}

#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("the request is longer than {MAX_REQUEST_BYTES} bytes")]
    RequestTooLong,
    #[error("invalid request: {0}")]
    Request(serde_json::Error),
}

fn io_error(what: &'static str) -> impl FnOnce(io::Error) -> ServeError {
    move |source| ServeError::Io { what, source }
}

fn serve() -> Result<(), ServeError> {
    // The answer goes to a close-on-exec copy of stdout; stdin and stdout become /dev/null, so
    // that the container's processes do not keep the request or answer pipes once they exec.
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) of stdout, which this process holds.
    let reply_fd = unsafe { libc::fcntl(1, libc::F_DUPFD_CLOEXEC, SCRATCH_FD_FLOOR) };
    if reply_fd < 0 {
        return Err(io_error("keeping the answer pipe")(
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: a descriptor fcntl just made, owned by nothing else.
    let mut reply = File::from(unsafe { OwnedFd::from_raw_fd(reply_fd) });
    let mut text = Vec::new();
    io::stdin()
        .lock()
        .take(MAX_REQUEST_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(io_error("reading the request"))?;
    if u64::try_from(text.len()).unwrap_or(u64::MAX) > MAX_REQUEST_BYTES {
        return Err(ServeError::RequestTooLong);
    }
    let null = File::options()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(io_error("opening /dev/null"))?;
    for fd in [0, 1] {
        // SAFETY: dup2(2) of /dev/null, which we hold, over stdin or stdout.
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            return Err(io_error("closing stdin and stdout")(
                io::Error::last_os_error(),
            ));
        }
    }
    let request: BuildRequest = serde_json::from_slice(&text).map_err(ServeError::Request)?;
    let stdio = if request.stdio {
        for fd in STDIO_FDS {
            // SAFETY: fcntl(F_SETFD) on the descriptors our parent placed for us.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                return Err(io_error("taking the container's stdio")(
                    io::Error::last_os_error(),
                ));
            }
        }
        // SAFETY: the agent placed the process's stdio at these descriptors for us alone
        // (`place_stdio`); nothing else in this process owns them.
        Some(unsafe {
            ChildStdio {
                stdin: OwnedFd::from_raw_fd(STDIO_FDS[0]),
                stdout: OwnedFd::from_raw_fd(STDIO_FDS[1]),
                stderr: OwnedFd::from_raw_fd(STDIO_FDS[2]),
            }
        })
    } else {
        None
    };
    let (built, events) = runtime_log::capture(|| run(&request, stdio));
    let answer = match built {
        Ok(pid) => BuildReply::Built { pid },
        Err(error) => BuildReply::Failed { error, events },
    };
    let mut line = serde_json::to_vec(&answer).map_err(|e| io_error("answering")(e.into()))?;
    line.push(b'\n');
    reply.write_all(&line).map_err(io_error("answering"))?;
    Ok(())
}

/// The build itself, with libcontainer's error chain as the error.
fn run(request: &BuildRequest, stdio: Option<ChildStdio>) -> Result<libc::pid_t, String> {
    let chain = |e: libcontainer::error::LibcontainerError| runtime_log::error_chain(&e);
    let builder = ContainerBuilder::new(request.id.clone(), SyscallType::default())
        .with_root_path(&request.state_root)
        .map_err(|e| format!("state root: {}", chain(e)))?
        .with_console_socket(request.console_socket.as_deref());
    let builder = match stdio {
        Some(stdio) => builder
            .with_stdin(stdio.stdin)
            .with_stdout(stdio.stdout)
            .with_stderr(stdio.stderr),
        None => builder,
    };
    match &request.kind {
        BuildKind::Init { bundle } => {
            let container = builder
                .with_executor(AgentExecutor::default())
                .as_init(bundle)
                .with_systemd(false)
                .with_detach(true)
                .build()
                .map_err(chain)?;
            container
                .pid()
                .map(|pid| pid.as_raw())
                .ok_or_else(|| "no init pid after create".to_owned())
        }
        BuildKind::Exec { process, seccomp } => builder
            .with_executor(AgentExecutor {
                seccomp: seccomp.as_deref().cloned(),
            })
            .as_tenant()
            .with_process(Some(process))
            .with_detach(true)
            .build()
            .map(|pid| pid.as_raw())
            .map_err(chain),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_survives_the_trip() {
        let request = BuildRequest {
            id: "c1".into(),
            state_root: "/run/microvm/containers".into(),
            console_socket: Some("/run/microvm/bundles/c1/console-1.sock".into()),
            stdio: true,
            kind: BuildKind::Exec {
                process: "/run/microvm/bundles/c1/exec-e1.json".into(),
                seccomp: None,
            },
        };
        let back: BuildRequest =
            serde_json::from_slice(&serde_json::to_vec(&request).expect("to JSON"))
                .expect("from JSON");
        assert_eq!(back.id, "c1");
        assert!(back.stdio);
        assert!(matches!(back.kind, BuildKind::Exec { seccomp: None, .. }));
    }

    #[test]
    fn an_answer_is_one_line_by_the_deadline_and_no_more() {
        let (mut rx, mut tx) = io::pipe().expect("pipe");
        tx.write_all(b"{\"Built\":{\"pid\":42}}\nrest")
            .expect("write");
        let line = read_line(&mut rx, Instant::now() + Duration::from_secs(5)).expect("line");
        assert_eq!(line, b"{\"Built\":{\"pid\":42}}");

        // A writer that stays open and silent: the deadline ends the wait.
        let (mut rx, _tx) = io::pipe().expect("pipe");
        let err = read_line(&mut rx, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, BuildError::Timeout(_)), "{err}");

        // A writer that goes away without a line.
        let (mut rx, mut tx) = io::pipe().expect("pipe");
        tx.write_all(b"partial").expect("write");
        drop(tx);
        let err = read_line(&mut rx, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, BuildError::NoReply), "{err}");

        // A writer that never ends its line is cut off.
        let (mut rx, mut tx) = io::pipe().expect("pipe");
        let writer = std::thread::spawn(move || {
            let _ = tx.write_all(&vec![b'x'; MAX_REPLY_BYTES + 8192]);
        });
        let err = read_line(&mut rx, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, BuildError::ReplyTooLong), "{err}");
        drop(rx);
        writer.join().expect("writer");
    }

    #[test]
    fn a_failure_reads_as_libcontainers_chain_then_its_events() {
        let err = BuildError::Failed {
            error: "failed to prepare rootfs: mount \"/x\" failed".into(),
            events: vec!["mount failed path=\"/x\"".into()],
        };
        assert_eq!(
            err.to_string(),
            "failed to prepare rootfs: mount \"/x\" failed; libcontainer: mount failed path=\"/x\""
        );
    }
}
