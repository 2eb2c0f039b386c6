//! The host side of the agent channel: hybrid vsock (Firecracker's protocol) to reach the guest
//! agent through the VM's Unix socket, then the `microvm.agent.v1.Agent` ttrpc service on top.
//!
//! Hybrid vsock: connect to the VM's `uds_path`, write `CONNECT <port>\n`; the VMM (or
//! vhost-device-vsock) answers `OK <host_port>\n` once the guest accepted, or closes the socket
//! (nobody listens in the guest yet: the VM is still booting). [`AgentClient::connect`] retries
//! with a short backoff until its timeout.
//!
//! Whatever comes back from the VM is hostile: the handshake line is bounded in length and time,
//! ttrpc bounds messages (4 MiB), every call has a timeout, reply fields are length-checked, and
//! every failure is an [`AgentError`], never a panic.

use std::io::{self, Read, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_protocol::agent::{CheckRequest, CheckResponse, ShutdownRequest};
use agent_protocol::agent_ttrpc;

pub use agent_protocol::AGENT_VSOCK_PORT;

/// Timeout of one RPC unless [`AgentClient::set_call_timeout`] changes it.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest handshake reply accepted, newline included (`OK 4294967295\n` is 14 bytes).
const MAX_HANDSHAKE_LINE: usize = 32;

/// Backoff between connection attempts while the VM boots.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// Bounds on the strings of a Check reply.
const MAX_VERSION_LEN: usize = 64;
const MAX_KERNEL_RELEASE_LEN: usize = 256;
const MAX_BOOT_ID_LEN: usize = 64;

/// One failed hybrid-vsock handshake.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connecting to {path}: {source}")]
    Connect { path: PathBuf, source: io::Error },
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

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("hybrid vsock to {path} port {port}: {source}")]
    Handshake {
        path: PathBuf,
        port: u32,
        source: HandshakeError,
    },
    #[error("no agent on {path} port {port} within {waited:?} (last attempt: {last})")]
    ConnectTimeout {
        path: PathBuf,
        port: u32,
        waited: Duration,
        last: HandshakeError,
    },
    #[error("setting up the ttrpc client: {0}")]
    Client(ttrpc::Error),
    #[error("agent call {method}: {}", describe_rpc_error(source))]
    Rpc {
        method: &'static str,
        source: ttrpc::Error,
    },
    #[error("agent reply to {method}: {reason}")]
    BadReply {
        method: &'static str,
        reason: String,
    },
}

/// An RPC failure as a user reads it: the agent's own message for a status it returned, "no
/// reply" for ttrpc's timeout, ttrpc's words otherwise.
pub fn describe_rpc_error(err: &ttrpc::Error) -> String {
    match err {
        ttrpc::Error::RpcStatus(status) => status.message().to_string(),
        other if is_timeout(other) => format!("the agent did not reply in time ({other})"),
        other => other.to_string(),
    }
}

/// What Check reports about the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentInfo {
    pub agent_version: String,
    pub kernel_release: String,
    pub online_vcpus: u32,
    pub mem_total_kib: u64,
    pub boot_id: String,
}

/// A connected agent.
pub struct AgentClient {
    rpc: agent_ttrpc::AgentClient,
    call_timeout: Duration,
}

impl AgentClient {
    /// Reaches the agent on guest vsock `port` through the VM's hybrid-vsock socket `uds_path`,
    /// retrying while the VM boots, for at most `timeout` in all.
    pub fn connect(uds_path: &Path, port: u32, timeout: Duration) -> Result<Self, AgentError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut backoff = FIRST_BACKOFF;
        let stream = loop {
            let err = match handshake(uds_path, port, deadline) {
                Ok(stream) => break stream,
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
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
        };
        // ttrpc drives the socket itself: no timeouts left on it.
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(None))
            .map_err(|e| AgentError::Client(ttrpc::Error::Others(e.to_string())))?;
        // ttrpc's client takes ownership of the descriptor and closes it on drop.
        let client = ttrpc::Client::new(stream.into_raw_fd()).map_err(AgentError::Client)?;
        Ok(Self {
            rpc: agent_ttrpc::AgentClient::new(client),
            call_timeout: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// Changes the timeout of each later call.
    pub fn set_call_timeout(&mut self, timeout: Duration) {
        self.call_timeout = timeout;
    }

    fn context(&self) -> ttrpc::context::Context {
        ttrpc::context::with_duration(self.call_timeout)
    }

    /// Asks the agent for the guest's facts.
    pub fn check(&self) -> Result<AgentInfo, AgentError> {
        let method = "Check";
        let reply = self
            .rpc
            .check(self.context(), &CheckRequest::new())
            .map_err(|source| AgentError::Rpc { method, source })?;
        info_from_reply(reply).map_err(|reason| AgentError::BadReply { method, reason })
    }

    /// Asks the agent to end the VM. The agent replies, then syncs and resets the VM; a
    /// connection that breaks instead of carrying the reply (the reset won the race) also counts
    /// as done. Callers confirm by waiting for the VM to exit.
    pub fn shutdown(&self) -> Result<(), AgentError> {
        match self.rpc.shutdown(self.context(), &ShutdownRequest::new()) {
            Ok(_) => Ok(()),
            Err(e @ (ttrpc::Error::Socket(_) | ttrpc::Error::LocalClosed)) => {
                log::debug!("agent connection closed during Shutdown: {e}");
                Ok(())
            }
            Err(source) => Err(AgentError::Rpc {
                method: "Shutdown",
                source,
            }),
        }
    }
}

/// Host side of the agent's stdio port: each stream of a process is its own connection.
pub use agent_protocol::stdio::StreamKind;
pub use agent_protocol::AGENT_STDIO_PORT;

/// Opens one stdio stream of a process (exec_id "" = the container's init) through the VM's
/// hybrid-vsock socket: handshake to [`AGENT_STDIO_PORT`], then the header line. The returned
/// stream carries raw bytes (write to stdin, shut down its write side for EOF; read stdout or
/// stderr to EOF). Call after CreateContainer / ExecProcess.
pub fn open_stdio_stream(
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
    let mut stream =
        handshake(uds_path, AGENT_STDIO_PORT, Instant::now() + timeout).map_err(handshake_err)?;
    stream
        .write_all(header.as_bytes())
        .map_err(|e| handshake_err(HandshakeError::Send(e)))?;
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_write_timeout(None))
        .map_err(|e| handshake_err(HandshakeError::Send(e)))?;
    Ok(stream)
}

/// Typed calls of the container RPCs (agent.proto documents each). Blocking calls
/// (`wait_process`, `get_oom_event`) take their own timeout.
impl AgentClient {
    fn ctx_for(timeout: Duration) -> ttrpc::context::Context {
        ttrpc::context::with_duration(timeout)
    }

    pub fn create_container(
        &self,
        req: &agent_protocol::agent::CreateContainerRequest,
    ) -> Result<u32, AgentError> {
        self.rpc
            .create_container(self.context(), req)
            .map(|r| r.pid)
            .map_err(|source| AgentError::Rpc {
                method: "CreateContainer",
                source,
            })
    }

    pub fn start_container(&self, container_id: &str) -> Result<u32, AgentError> {
        let req = agent_protocol::agent::StartContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .start_container(self.context(), &req)
            .map(|r| r.pid)
            .map_err(|source| AgentError::Rpc {
                method: "StartContainer",
                source,
            })
    }

    pub fn exec_process(
        &self,
        req: &agent_protocol::agent::ExecProcessRequest,
    ) -> Result<(), AgentError> {
        self.rpc
            .exec_process(self.context(), req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "ExecProcess",
                source,
            })
    }

    pub fn start_exec(&self, container_id: &str, exec_id: &str) -> Result<u32, AgentError> {
        let req = agent_protocol::agent::StartExecRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .start_exec(self.context(), &req)
            .map(|r| r.pid)
            .map_err(|source| AgentError::Rpc {
                method: "StartExec",
                source,
            })
    }

    pub fn signal_process(
        &self,
        container_id: &str,
        exec_id: &str,
        signal: u32,
        all: bool,
    ) -> Result<(), AgentError> {
        let req = agent_protocol::agent::SignalProcessRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            signal,
            all,
            ..Default::default()
        };
        self.rpc
            .signal_process(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "SignalProcess",
                source,
            })
    }

    /// Exit status (n, or 128+signal) and exit time (Unix ns); DEADLINE_EXCEEDED while the
    /// process still runs after `timeout`.
    pub fn wait_process(
        &self,
        container_id: &str,
        exec_id: &str,
        timeout: Duration,
    ) -> Result<(u32, u64), AgentError> {
        let req = agent_protocol::agent::WaitProcessRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .wait_process(Self::ctx_for(timeout), &req)
            .map(|r| (r.exit_status, r.exited_at_unix_nanos))
            .map_err(|source| AgentError::Rpc {
                method: "WaitProcess",
                source,
            })
    }

    pub fn resize_pty(
        &self,
        container_id: &str,
        exec_id: &str,
        width: u32,
        height: u32,
    ) -> Result<(), AgentError> {
        let req = agent_protocol::agent::ResizePtyRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            width,
            height,
            ..Default::default()
        };
        self.rpc
            .resize_pty(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "ResizePty",
                source,
            })
    }

    pub fn close_stdin(&self, container_id: &str, exec_id: &str) -> Result<(), AgentError> {
        let req = agent_protocol::agent::CloseStdinRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .close_stdin(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "CloseStdin",
                source,
            })
    }

    pub fn remove_container(&self, container_id: &str) -> Result<(), AgentError> {
        let req = agent_protocol::agent::RemoveContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .remove_container(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "RemoveContainer",
                source,
            })
    }

    /// The guest pids of the processes in the container's cgroup.
    pub fn list_pids(&self, container_id: &str) -> Result<Vec<u32>, AgentError> {
        let req = agent_protocol::agent::ListPidsRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        let method = "ListPids";
        let reply = self
            .rpc
            .list_pids(self.context(), &req)
            .map_err(|source| AgentError::Rpc { method, source })?;
        if reply.pids.len() > MAX_PIDS {
            return Err(AgentError::BadReply {
                method,
                reason: format!("{} pids (max {MAX_PIDS})", reply.pids.len()),
            });
        }
        Ok(reply.pids)
    }

    /// The container's cgroup v2 figures.
    pub fn stats(
        &self,
        container_id: &str,
    ) -> Result<agent_protocol::agent::StatsResponse, AgentError> {
        let req = agent_protocol::agent::StatsRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .stats(self.context(), &req)
            .map_err(|source| AgentError::Rpc {
                method: "Stats",
                source,
            })
    }

    /// Applies OCI `LinuxResources` (JSON) to the container's cgroup.
    pub fn update_container(
        &self,
        container_id: &str,
        resources_json: Vec<u8>,
    ) -> Result<(), AgentError> {
        let req = agent_protocol::agent::UpdateContainerRequest {
            container_id: container_id.to_owned(),
            resources_json,
            ..Default::default()
        };
        self.rpc
            .update_container(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "UpdateContainer",
                source,
            })
    }

    pub fn pause_container(&self, container_id: &str) -> Result<(), AgentError> {
        let req = agent_protocol::agent::PauseContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .pause_container(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "PauseContainer",
                source,
            })
    }

    pub fn resume_container(&self, container_id: &str) -> Result<(), AgentError> {
        let req = agent_protocol::agent::ResumeContainerRequest {
            container_id: container_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .resume_container(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "ResumeContainer",
                source,
            })
    }

    /// Long poll for the next OOM kill: the container's id, or `None` when none came within
    /// `timeout`.
    pub fn get_oom_event(&self, timeout: Duration) -> Result<Option<String>, AgentError> {
        let method = "GetOomEvent";
        let req = agent_protocol::agent::GetOomEventRequest::new();
        match self.rpc.get_oom_event(Self::ctx_for(timeout), &req) {
            Ok(reply) => {
                if !agent_protocol::stdio::valid_id(&reply.container_id) {
                    return Err(AgentError::BadReply {
                        method,
                        reason: format!("container id {:?}", reply.container_id),
                    });
                }
                Ok(Some(reply.container_id))
            }
            Err(source) if is_timeout(&source) => Ok(None),
            Err(source) => Err(AgentError::Rpc { method, source }),
        }
    }

    /// Forgets an exec process that has exited (or never started).
    /// Writes the pod's sysctls in the guest (name -> value).
    pub fn set_sysctls(
        &self,
        sysctls: std::collections::HashMap<String, String>,
    ) -> Result<(), AgentError> {
        let req = agent_protocol::agent::SetSysctlsRequest {
            sysctls,
            ..Default::default()
        };
        self.rpc
            .set_sysctls(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "SetSysctls",
                source,
            })
    }

    /// Gives the guest its network: lo up, and each NIC (found by MAC) the CNI interface's
    /// name, MTU, addresses and routes.
    pub fn configure_network(
        &self,
        req: &agent_protocol::agent::ConfigureNetworkRequest,
    ) -> Result<(), AgentError> {
        self.rpc
            .configure_network(self.context(), req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "ConfigureNetwork",
                source,
            })
    }

    pub fn remove_exec(&self, container_id: &str, exec_id: &str) -> Result<(), AgentError> {
        let req = agent_protocol::agent::RemoveExecRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            ..Default::default()
        };
        self.rpc
            .remove_exec(self.context(), &req)
            .map(|_| ())
            .map_err(|source| AgentError::Rpc {
                method: "RemoveExec",
                source,
            })
    }
}

/// Most pids a ListPids reply may carry.
const MAX_PIDS: usize = 65_536;

/// Whether an RPC failed only because its long poll ended: ttrpc's own deadline or the agent's
/// DEADLINE_EXCEEDED answer.
pub fn is_timeout(err: &ttrpc::Error) -> bool {
    match err {
        ttrpc::Error::Others(m) => m.contains("imeout"),
        ttrpc::Error::RpcStatus(s) => s.code() == ttrpc::Code::DEADLINE_EXCEEDED,
        _ => false,
    }
}

impl AgentError {
    /// Whether this is only the end of a long poll (see [`is_timeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, AgentError::Rpc { source, .. } if is_timeout(source))
    }
}

fn info_from_reply(reply: CheckResponse) -> Result<AgentInfo, String> {
    let bounded = |name: &str, value: &str, max: usize| {
        if value.len() > max {
            Err(format!("{name} is {} bytes (max {max})", value.len()))
        } else {
            Ok(())
        }
    };
    bounded("agent_version", &reply.agent_version, MAX_VERSION_LEN)?;
    bounded(
        "kernel_release",
        &reply.kernel_release,
        MAX_KERNEL_RELEASE_LEN,
    )?;
    bounded("boot_id", &reply.boot_id, MAX_BOOT_ID_LEN)?;
    if reply.online_vcpus == 0 {
        return Err("online_vcpus is 0".into());
    }
    Ok(AgentInfo {
        agent_version: reply.agent_version,
        kernel_release: reply.kernel_release,
        online_vcpus: reply.online_vcpus,
        mem_total_kib: reply.mem_total_kib,
        boot_id: reply.boot_id,
    })
}

/// One hybrid-vsock handshake attempt: connect, `CONNECT <port>\n`, read `OK <n>\n` by
/// `deadline`. Returns the stream, positioned right after the reply line.
pub fn handshake(
    uds_path: &Path,
    port: u32,
    deadline: Instant,
) -> Result<UnixStream, HandshakeError> {
    let mut stream = UnixStream::connect(uds_path).map_err(|source| HandshakeError::Connect {
        path: uds_path.to_owned(),
        source,
    })?;
    let remaining = remaining(deadline)?;
    stream
        .set_write_timeout(Some(remaining))
        .map_err(HandshakeError::Send)?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(HandshakeError::Send)?;
    read_reply(&mut stream, deadline)?;
    Ok(stream)
}

fn remaining(deadline: Instant) -> Result<Duration, HandshakeError> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or(HandshakeError::TimedOut)
}

/// Reads the reply one byte at a time (the bytes after the newline belong to ttrpc) and returns
/// the host-side port it names.
fn read_reply(stream: &mut UnixStream, deadline: Instant) -> Result<u32, HandshakeError> {
    let mut line = Vec::with_capacity(MAX_HANDSHAKE_LINE);
    loop {
        stream
            .set_read_timeout(Some(remaining(deadline)?))
            .map_err(HandshakeError::Read)?;
        let mut byte = [0u8; 1];
        match stream.read(&mut byte) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(HandshakeError::TimedOut)
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(HandshakeError::Closed)
            }
            Err(e) => return Err(HandshakeError::Read(e)),
        }
        line.push(byte[0]);
        if byte[0] == b'\n' {
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
mod tests {
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;
    use std::sync::Arc;
    use std::thread::JoinHandle;

    use agent_protocol::agent::ShutdownResponse;
    use agent_protocol::agent_ttrpc::Agent;

    use super::*;

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("shim-agent-client-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp dir");
            Self(dir)
        }
        fn sock(&self) -> PathBuf {
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
    fn vmm(listener: UnixListener, replies: Vec<Option<&'static [u8]>>) -> JoinHandle<UnixStream> {
        std::thread::spawn(move || {
            let mut last = None;
            for reply in replies {
                let (stream, _) = listener.accept().expect("accept");
                let mut reader = io::BufReader::new(stream.try_clone().expect("clone"));
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

    #[test]
    fn handshake_good_reply_leaves_following_bytes_unread() {
        let dir = TempDir::new("good");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let vmm = vmm(listener, vec![Some(b"OK 52\nrest")]);
        let mut stream = handshake(&dir.sock(), 1024, soon()).expect("handshake");
        let mut rest = [0u8; 4];
        stream.read_exact(&mut rest).expect("rest");
        assert_eq!(&rest, b"rest");
        drop(vmm.join());
    }

    #[test]
    fn handshake_rejects_garbage_overlong_and_eof() {
        let dir = TempDir::new("bad");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let long: &'static [u8] = &[b'A'; 100];
        let vmm = vmm(
            listener,
            vec![Some(b"NOPE\n"), Some(long), None, Some(b"OK 1")],
        );
        let err = handshake(&dir.sock(), 1024, soon()).expect_err("garbage");
        assert!(
            matches!(err, HandshakeError::Garbage(ref s) if s == "NOPE\n"),
            "{err:?}"
        );
        assert!(!err.is_transient());
        let err = handshake(&dir.sock(), 1024, soon()).expect_err("overlong");
        assert!(matches!(err, HandshakeError::TooLong), "{err:?}");
        let err = handshake(&dir.sock(), 1024, soon()).expect_err("eof");
        assert!(matches!(err, HandshakeError::Closed), "{err:?}");
        assert!(err.is_transient());
        // A reply that never ends: bounded in time.
        let started = Instant::now();
        let err = handshake(
            &dir.sock(),
            1024,
            Instant::now() + Duration::from_millis(200),
        )
        .expect_err("no newline");
        assert!(matches!(err, HandshakeError::TimedOut), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(vmm.join());
    }

    #[test]
    fn connect_fails_fast_on_garbage() {
        let dir = TempDir::new("fast");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let vmm = vmm(listener, vec![Some(b"HELLO\n")]);
        let started = Instant::now();
        let err = AgentClient::connect(&dir.sock(), 1024, Duration::from_secs(30))
            .err()
            .expect("garbage is final");
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

    #[test]
    fn connect_times_out_when_nothing_listens() {
        let dir = TempDir::new("absent");
        let started = Instant::now();
        let err = AgentClient::connect(&dir.sock(), 1024, Duration::from_millis(300))
            .err()
            .expect("no socket");
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

    #[test]
    fn stdio_stream_handshakes_then_sends_its_header() {
        let dir = TempDir::new("stdio");
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let peer = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = io::BufReader::new(stream.try_clone().expect("clone"));
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
        .expect_err("bad id");
        assert!(matches!(err, AgentError::BadReply { .. }), "{err}");
    }

    /// A test peer of the client's ttrpc layer, answering with given values.
    struct Peer(CheckResponse);

    impl Agent for Peer {
        fn check(
            &self,
            _ctx: &ttrpc::TtrpcContext,
            _req: CheckRequest,
        ) -> ttrpc::Result<CheckResponse> {
            Ok(self.0.clone())
        }
        fn shutdown(
            &self,
            _ctx: &ttrpc::TtrpcContext,
            _req: ShutdownRequest,
        ) -> ttrpc::Result<ShutdownResponse> {
            Ok(ShutdownResponse::new())
        }
    }

    /// The VMM side for the ttrpc tests: closes the first connection (agent not up yet), then
    /// answers OK and relays the connection's bytes to a ttrpc server on a second Unix socket,
    /// as a vsock device relays them to the guest.
    fn serve_after_one_refusal(dir: &TempDir, reply: CheckResponse) -> JoinHandle<()> {
        let listener = UnixListener::bind(dir.sock()).expect("bind");
        let agent_sock = dir.0.join("agent.sock");
        let address = format!("unix://{}", agent_sock.display());
        let mut server = ttrpc::Server::new()
            .bind(&address)
            .expect("bind agent")
            .register_service(agent_ttrpc::create_agent(Arc::new(Peer(reply))));
        server.start().expect("start agent");
        std::thread::spawn(move || {
            let vmm = vmm(listener, vec![None, Some(b"OK 7\n")]);
            let guest_side = vmm.join().expect("vmm");
            // Relay between the host's stream and the agent's socket, like a vsock device.
            let agent = UnixStream::connect(&agent_sock).expect("connect agent");
            let (mut a_in, mut a_out) = (agent.try_clone().expect("clone"), agent);
            let (mut g_in, mut g_out) = (guest_side.try_clone().expect("clone"), guest_side);
            let up = std::thread::spawn(move || io::copy(&mut g_in, &mut a_out));
            let _ = io::copy(&mut a_in, &mut g_out);
            let _ = up.join();
            server.shutdown();
        })
    }

    fn sample() -> CheckResponse {
        CheckResponse {
            agent_version: "0.1.0".into(),
            kernel_release: "6.1.0-microvm".into(),
            online_vcpus: 2,
            mem_total_kib: 250_000,
            boot_id: "0b5f5c3e-1d2a-4c39-9a0e-6f1d2e3c4b5a".into(),
            ..Default::default()
        }
    }

    #[test]
    fn check_and_shutdown_through_handshake_and_ttrpc() {
        let dir = TempDir::new("rpc");
        let _vmm = serve_after_one_refusal(&dir, sample());
        let client = AgentClient::connect(&dir.sock(), 1024, Duration::from_secs(10))
            .expect("connect after a refusal");
        let info = client.check().expect("check");
        assert_eq!(
            info,
            AgentInfo {
                agent_version: "0.1.0".into(),
                kernel_release: "6.1.0-microvm".into(),
                online_vcpus: 2,
                mem_total_kib: 250_000,
                boot_id: "0b5f5c3e-1d2a-4c39-9a0e-6f1d2e3c4b5a".into(),
            }
        );
        client.shutdown().expect("shutdown");
    }

    #[test]
    fn oversized_reply_fields_are_errors() {
        let dir = TempDir::new("huge");
        let mut reply = sample();
        reply.kernel_release = "x".repeat(100_000);
        let _vmm = serve_after_one_refusal(&dir, reply);
        let client =
            AgentClient::connect(&dir.sock(), 1024, Duration::from_secs(10)).expect("connect");
        let err = client.check().expect_err("too long");
        assert!(
            matches!(
                err,
                AgentError::BadReply {
                    method: "Check",
                    ..
                }
            ),
            "{err}"
        );
    }
}
