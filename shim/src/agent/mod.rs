//! The host side of the agent channel, on tokio: hybrid vsock (Firecracker's protocol) to reach
//! the guest agent through the VM's Unix socket, the `microvm.agent.v1.Agent` ttrpc service on
//! top (ttrpc's async client), and the agent's stdio streams.
//!
//! - [`connection`]: the hybrid-vsock handshake (`CONNECT <port>\n`, `OK <n>\n`), bounded in
//!   length and time, with the retrying connect of a booting VM.
//! - [`client`]: [`AgentClient`], one typed method per RPC over one generic call helper.
//! - [`stdio`]: a process's FIFOs copied to and from its stdio streams, as tokio tasks.
//! - [`forward`]: a port-forward stream to a TCP port on the guest's loopback.
//!
//! Whatever comes back from the VM is hostile: the handshake line is bounded in length and time,
//! ttrpc bounds messages (4 MiB: a longer frame is read and dropped, never held), every call has
//! a timeout, reply fields are length-checked, pids are checked to be pids, and every failure is
//! an [`AgentError`], never a panic. Text from the agent (an error status's message, any string
//! quoted in an error) passes [`agent_text`] once, in the client's call helper, before it can
//! reach containerd, a CRI error or a log line: at most [`MAX_AGENT_TEXT`] bytes, control
//! characters escaped.

pub mod client;
pub mod connection;
pub mod forward;
pub mod stdio;

use std::path::PathBuf;
use std::time::Duration;

pub use agent_protocol::stdio::StreamKind;
pub use agent_protocol::{AGENT_STDIO_PORT, AGENT_VSOCK_PORT};
pub use client::{AgentClient, AgentInfo, DEFAULT_CALL_TIMEOUT};
pub use connection::{handshake, open_stdio_stream, HandshakeError};

/// The most of one string from the agent that the shim passes on (error messages, ids quoted
/// in errors), in bytes, before the note of what was cut.
pub const MAX_AGENT_TEXT: usize = 4096;

/// The largest pid a Linux guest can have (`PID_MAX_LIMIT` on 64-bit).
pub const MAX_GUEST_PID: u32 = 4 << 20;

/// A string from the agent as the shim may pass it on: every control character but newline
/// and tab escaped (`\u{1b}`), so that it cannot drive a terminal, and at most
/// [`MAX_AGENT_TEXT`] bytes of that, cut on a char boundary with a note of the size the agent
/// sent. The shim's log
/// escapes newlines too (`task::log_guard`); a CRI error keeps them.
pub fn agent_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_AGENT_TEXT) + 48);
    let mut taken = 0;
    let mut escaped = String::new();
    for c in text.chars() {
        escaped.clear();
        if c.is_control() && c != '\n' && c != '\t' {
            escaped.extend(c.escape_unicode());
        } else {
            escaped.push(c);
        }
        // The bound is on what is passed on, escapes included.
        if out.len() + escaped.len() > MAX_AGENT_TEXT {
            break;
        }
        out.push_str(&escaped);
        taken += c.len_utf8();
    }
    if taken < text.len() {
        out.push_str(&format!(" [... cut: the agent sent {} bytes]", text.len()));
    }
    out
}

/// A ttrpc error with every string the agent could have put in it through [`agent_text`]; a
/// status keeps its code and loses its details.
pub fn bounded_rpc_error(err: ttrpc::Error) -> ttrpc::Error {
    match err {
        ttrpc::Error::RpcStatus(status) => ttrpc::Error::RpcStatus(ttrpc::get_status(
            status.code(),
            agent_text(status.message()),
        )),
        ttrpc::Error::Others(m) => ttrpc::Error::Others(agent_text(&m)),
        ttrpc::Error::Socket(m) => ttrpc::Error::Socket(agent_text(&m)),
        other => other,
    }
}

/// A pid the agent reported, checked to be one a guest can have.
pub fn guest_pid(method: &'static str, pid: u32) -> Result<u32, AgentError> {
    if (1..=MAX_GUEST_PID).contains(&pid) {
        Ok(pid)
    } else {
        Err(AgentError::BadReply {
            method,
            reason: format!("pid {pid} (a guest pid is 1..={MAX_GUEST_PID})"),
        })
    }
}

/// A failed agent operation.
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

impl AgentError {
    /// Whether this is only the end of a long poll (see [`is_timeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, AgentError::Rpc { source, .. } if is_timeout(source))
    }
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

/// Whether an RPC failed only because its long poll ended: ttrpc's own deadline ("Receive
/// packet timeout") or the agent's DEADLINE_EXCEEDED answer.
pub fn is_timeout(err: &ttrpc::Error) -> bool {
    match err {
        ttrpc::Error::Others(m) => m.contains("imeout"),
        ttrpc::Error::RpcStatus(s) => s.code() == ttrpc::Code::DEADLINE_EXCEEDED,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_told_apart_from_failures() {
        assert!(is_timeout(&ttrpc::Error::Others(
            "Receive packet timeout Elapsed(())".into()
        )));
        assert!(is_timeout(&ttrpc::Error::RpcStatus(ttrpc::get_status(
            ttrpc::Code::DEADLINE_EXCEEDED,
            "still running"
        ))));
        assert!(!is_timeout(&ttrpc::Error::RemoteClosed));
        let e = AgentError::Rpc {
            method: "Stats",
            source: ttrpc::Error::RpcStatus(ttrpc::get_status(ttrpc::Code::NOT_FOUND, "no c1")),
        };
        assert_eq!(e.to_string(), "agent call Stats: no c1");
        assert!(!e.is_timeout());
    }

    #[test]
    fn agent_text_is_cut_on_a_char_boundary_and_escapes_controls() {
        assert_eq!(agent_text("plain\nline\ttab"), "plain\nline\ttab");
        assert_eq!(agent_text("a\x1b[2Jb\r"), "a\\u{1b}[2Jb\\u{d}");
        let huge = "€".repeat(2 << 20); // 6 MiB, 3 bytes a char
        let out = agent_text(&huge);
        assert!(out.len() < MAX_AGENT_TEXT + 64, "{}", out.len());
        assert!(out.starts_with(&"€".repeat(MAX_AGENT_TEXT / 3)));
        assert!(
            out.ends_with(" [... cut: the agent sent 6291456 bytes]"),
            "{}",
            &out[4000..]
        );
        // Escapes count: 4 MiB of escape characters still give at most the bound.
        let escapes = "\x1b".repeat(4 << 20);
        let out = agent_text(&escapes);
        assert!(out.len() < MAX_AGENT_TEXT + 64, "{}", out.len());
        assert!(out.starts_with("\\u{1b}\\u{1b}"));
    }

    #[test]
    fn a_status_keeps_its_code_with_its_message_bounded() {
        let big = format!("boom\n{}", "x".repeat(4 << 20));
        let e = bounded_rpc_error(ttrpc::Error::RpcStatus(ttrpc::get_status(
            ttrpc::Code::DEADLINE_EXCEEDED,
            big,
        )));
        assert!(is_timeout(&e));
        let ttrpc::Error::RpcStatus(s) = e else {
            panic!("not a status")
        };
        assert!(s.message().starts_with("boom\nxxx"));
        assert!(s.message().len() < MAX_AGENT_TEXT + 64);
        assert!(s.details.is_empty());
    }

    #[test]
    fn pids_are_guest_pids() {
        assert_eq!(guest_pid("M", 1).unwrap(), 1);
        assert_eq!(guest_pid("M", MAX_GUEST_PID).unwrap(), MAX_GUEST_PID);
        for bad in [0, MAX_GUEST_PID + 1, u32::MAX] {
            assert!(guest_pid("M", bad).is_err(), "{bad}");
        }
    }
}
