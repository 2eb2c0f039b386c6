//! The host side of the agent channel, on tokio: hybrid vsock (Firecracker's protocol) to reach
//! the guest agent through the VM's Unix socket, the `microvm.agent.v1.Agent` ttrpc service on
//! top (ttrpc's async client), and the agent's stdio streams.
//!
//! - [`connection`]: the hybrid-vsock handshake (`CONNECT <port>\n`, `OK <n>\n`), bounded in
//!   length and time, with the retrying connect of a booting VM.
//! - [`client`]: [`AgentClient`], one typed method per RPC over one generic call helper.
//! - [`stdio`]: a process's FIFOs copied to and from its stdio streams, as tokio tasks.
//!
//! Whatever comes back from the VM is hostile: the handshake line is bounded in length and time,
//! ttrpc bounds messages (4 MiB), every call has a timeout, reply fields are length-checked, and
//! every failure is an [`AgentError`], never a panic.

pub mod client;
pub mod connection;
pub mod stdio;

use std::path::PathBuf;
use std::time::Duration;

pub use agent_protocol::stdio::StreamKind;
pub use agent_protocol::{AGENT_STDIO_PORT, AGENT_VSOCK_PORT};
pub use client::{AgentClient, AgentInfo, DEFAULT_CALL_TIMEOUT};
pub use connection::{handshake, open_stdio_stream, HandshakeError};

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
}
