//! The ttrpc server: the [`AgentService`] on a listening socket, served by ttrpc's own threads.
//! In the guest the address is `vsock://-1:1024` (any CID, [`AGENT_VSOCK_PORT`]); tests and
//! debug runs on a host use `unix:///path`.

use std::sync::Arc;

use agent_protocol::agent_ttrpc::create_agent;
use agent_protocol::{AGENT_READY_PORT, AGENT_VSOCK_PORT};

use crate::service::AgentService;

/// The guest's listening address (ttrpc syntax; -1 is VMADDR_CID_ANY).
pub fn default_address() -> String {
    format!("vsock://-1:{AGENT_VSOCK_PORT}")
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {address}: {source}")]
    Bind {
        address: String,
        source: ttrpc::Error,
    },
    #[error("starting the ttrpc server on {address}: {source}")]
    Start {
        address: String,
        source: ttrpc::Error,
    },
}

/// Tells the host the server is up: connects to host (CID 2) vsock port [`AGENT_READY_PORT`],
/// writes `line` and closes. Under hybrid vsock the connection reaches the shim's Unix socket
/// `<uds>_1026`, where it waits for exactly this event (no host knocks on a booting guest).
/// Only for a vsock server; an error (no host listening, e.g. a plain `microvm boot` of an old
/// shim) is the caller's to log, never fatal.
pub fn announce_ready(address: &str, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, VsockAddr};

    if !address.starts_with("vsock://") {
        return Ok(());
    }
    let fd = socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    connect(
        fd.as_raw_fd(),
        &VsockAddr::new(libc::VMADDR_CID_HOST, AGENT_READY_PORT),
    )?;
    let mut stream = std::fs::File::from(fd);
    stream.write_all(format!("{line}\n").as_bytes())
}

/// Handler threads per connection: WaitProcess and GetOomEvent each hold one while they block.
const MAX_HANDLER_THREADS: usize = 128;

/// Binds `address` and starts serving; returns once the socket listens.
pub fn start(address: &str, service: AgentService) -> Result<ttrpc::Server, ServerError> {
    let mut server = ttrpc::Server::new()
        .bind(address)
        .map_err(|source| ServerError::Bind {
            address: address.to_owned(),
            source,
        })?
        .set_thread_count_max(MAX_HANDLER_THREADS)
        .register_service(create_agent(Arc::new(service)));
    server.start().map_err(|source| ServerError::Start {
        address: address.to_owned(),
        source,
    })?;
    Ok(server)
}

/// The console's ready line for a listening address.
pub fn ready_line(address: &str) -> String {
    match address
        .strip_prefix("vsock://")
        .and_then(|a| a.rsplit_once(':'))
    {
        Some((_, port)) => format!("microvm-agent: ready (vsock port {port})"),
        None => format!("microvm-agent: ready ({address})"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use agent_protocol::agent::{CheckRequest, ShutdownRequest};
    use agent_protocol::agent_ttrpc::AgentClient;

    use super::*;
    use crate::service::ShutdownRequested;

    fn ctx() -> ttrpc::context::Context {
        ttrpc::context::with_duration(Duration::from_secs(10))
    }

    fn test_service(tx: mpsc::Sender<ShutdownRequested>) -> AgentService {
        let state = std::env::temp_dir().join(format!("agent-server-state-{}", std::process::id()));
        AgentService::new(
            tx,
            Arc::new(crate::containers::Containers::new(&state)),
            Arc::new(crate::oom::OomEvents::default()),
        )
    }

    #[test]
    fn ready_line_names_the_vsock_port() {
        assert_eq!(
            ready_line(&default_address()),
            "microvm-agent: ready (vsock port 1024)"
        );
        assert_eq!(
            ready_line("unix:///tmp/a.sock"),
            "microvm-agent: ready (unix:///tmp/a.sock)"
        );
    }

    #[test]
    fn serves_check_and_shutdown_over_a_unix_socket() {
        let dir = std::env::temp_dir().join(format!("agent-server-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("agent.sock");
        let _ = std::fs::remove_file(&path);
        let address = format!("unix://{}", path.display());
        let (tx, rx) = mpsc::channel();
        let server = start(&address, test_service(tx)).expect("server starts");

        let client = AgentClient::new(ttrpc::Client::connect(&address).expect("connect"));
        let resp = client.check(ctx(), &CheckRequest::new()).expect("check");
        let facts = crate::check::gather().expect("gather");
        assert_eq!(resp.agent_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(resp.kernel_release, facts.kernel_release);
        assert_eq!(resp.online_vcpus, facts.online_vcpus);
        assert_eq!(resp.mem_total_kib, facts.mem_total_kib);
        assert_eq!(resp.boot_id, facts.boot_id);

        assert!(rx.try_recv().is_err(), "no shutdown before it is asked for");
        client
            .shutdown(ctx(), &ShutdownRequest::new())
            .expect("shutdown replies");
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)),
            Ok(ShutdownRequested)
        );

        // With the main thread gone (receiver dropped), Shutdown fails instead of panicking.
        drop(rx);
        let err = client
            .shutdown(ctx(), &ShutdownRequest::new())
            .expect_err("no one to stop");
        assert!(
            matches!(err, ttrpc::Error::RpcStatus(ref s) if s.code() == ttrpc::Code::UNAVAILABLE),
            "{err:?}"
        );

        drop(client);
        server.shutdown();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn binds_vsock_with_any_cid() {
        // The host side of the project needs AF_VSOCK too (the shim's vsock listeners), so a
        // host without it fails here rather than passing untested.
        let port = 40_000 + std::process::id() % 20_000;
        let (tx, _rx) = mpsc::channel();
        let server = start(&format!("vsock://-1:{port}"), test_service(tx))
            .expect("bind vsock with VMADDR_CID_ANY");
        server.shutdown();
    }
}
