//! The shim binary's entry point: containerd's shim v2 bootstrap (`start`, `delete`, the
//! daemon) around our own ttrpc server, which serves two services on the pod's socket:
//!
//! - `containerd.task.v2.Task` ([`crate::task::service`]): every containerd release;
//! - `containerd.runtime.sandbox.v1.Sandbox` ([`crate::task::sandbox_service`]): containerd
//!   2.x with `sandboxer = "shim"` on the runtime handler.
//!
//! containerd-shim 0.11's `asynchronous::run` builds its server with the task service only, so
//! this module does its part itself, the same way: the flags, the `TTRPC_ADDRESS` publisher,
//! SIGTERM/SIGINT/SIGPIPE taken (logged, never fatal: the shim ends when containerd says so),
//! the socket bound (a live shim already on it is reused), stdout closed once it serves (what
//! `start` waits for), and the socket removed on exit. The `start` and `delete` actions are
//! [`MicrovmShim`]'s.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::asynchronous::Shim;
use containerd_shim::{Error, Flags, StartOpts};
use containerd_shim_protos::protobuf::Message;
use containerd_shim_protos::sandbox_async::create_sandbox;
use containerd_shim_protos::shim_async::create_task;
use containerd_shim_protos::ttrpc::r#async::transport::Listener;
use containerd_shim_protos::ttrpc::r#async::Server;
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{signal, SignalKind};

use crate::sandbox::reclaim::{self, remove_socket, socket_path, Reclaimed, RECLAIM_ACTION};
use crate::state::state_root;
use crate::task::sandbox_service::SandboxService;
use crate::task::shim::{shim_config, MicrovmShim, RUNTIME_ID};

/// The environment variable containerd gives its ttrpc address (events) in.
const TTRPC_ADDRESS_ENV: &str = "TTRPC_ADDRESS";
/// Time for the reply of the call that ended the shim to leave before the server closes.
const REPLY_GRACE: Duration = Duration::from_millis(200);
/// How long a daemon whose socket is taken waits for the shim on it to answer.
const SOCKET_IN_USE_WAIT: Duration = Duration::from_secs(1);

/// Runs the shim: the action of the command line, or the daemon. Exits 1 with the error on
/// stderr (containerd logs it) when it fails.
pub async fn run() {
    // `<shim> delete`'s reclaim of a dead pod, in a process of its own (sandbox/reclaim.rs):
    // `reclaim-dead-pod <pod id> <socket address>`.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(RECLAIM_ACTION) {
        let pod = args.get(2).map(String::as_str).unwrap_or_default();
        let address = args.get(3).map(String::as_str).unwrap_or_default();
        std::process::exit(reclaim::run_action(pod, address).await);
    }
    if let Err(e) = bootstrap().await {
        eprintln!("{RUNTIME_ID}: {e}");
        std::process::exit(1);
    }
}

async fn bootstrap() -> Result<(), Error> {
    let os_args: Vec<_> = std::env::args_os().collect();
    let flags = containerd_shim::parse(os_args.get(1..).unwrap_or_default())?;
    let ttrpc_address = std::env::var(TTRPC_ADDRESS_ENV)
        .map_err(|_| Error::InvalidArgument(format!("{TTRPC_ADDRESS_ENV} is not set")))?;
    // Before anything else: a SIGTERM from containerd's process group must not kill a pod.
    take_signals()?;
    let mut config = shim_config();
    let mut shim = MicrovmShim::new(RUNTIME_ID, &flags, &mut config).await;
    match flags.action.as_str() {
        "start" => {
            let address = shim
                .start_shim(StartOpts {
                    id: flags.id.clone(),
                    publish_binary: flags.publish_binary.clone(),
                    address: flags.address.clone(),
                    ttrpc_address,
                    namespace: flags.namespace.clone(),
                    debug: flags.debug,
                })
                .await?;
            let mut stdout = tokio::io::stdout();
            stdout
                .write_all(address.as_bytes())
                .await
                .map_err(|e| io_error("writing the address to stdout", e))?;
            stdout
                .flush()
                .await
                .map_err(|e| io_error("flushing stdout", e))?;
            Ok(())
        }
        "delete" => {
            let response = shim.delete_shim().await?;
            let bytes = response.write_to_bytes()?;
            tokio::io::stdout()
                .write_all(&bytes)
                .await
                .map_err(|e| io_error("writing the delete response", e))?;
            Ok(())
        }
        _ => daemon(shim, &flags, &config, &ttrpc_address).await,
    }
}

/// The long-lived shim: serves both services until the shim's exit signal.
async fn daemon(
    mut shim: MicrovmShim,
    flags: &Flags,
    config: &containerd_shim::Config,
    ttrpc_address: &str,
) -> Result<(), Error> {
    if flags.socket.is_empty() {
        return Err(Error::InvalidArgument(
            "the shim socket cannot be empty".into(),
        ));
    }
    if !config.no_setup_logger {
        crate::task::log_guard::init(
            flags.debug,
            &config.default_log_level,
            &flags.namespace,
            &flags.id,
        )?;
    }
    let publisher = RemotePublisher::new(ttrpc_address).await?;
    let task = shim.create_task_service(publisher).await;
    let sandbox = SandboxService::new(task.clone());
    let Some(listener) = bind(&flags.socket).await? else {
        // Another shim serves this pod's socket: it is the pod's.
        signal_server_started();
        return Ok(());
    };
    let mut server = Server::new()
        .add_listener(listener)
        .register_service(create_task(Arc::new(task)))
        .register_service(create_sandbox(Arc::new(sandbox)));
    server.start().await?;
    signal_server_started();
    // Pods whose shims died with nobody to reclaim them (sandbox/reclaim.rs), in the background.
    let own_id = flags.id.clone();
    tokio::spawn(async move {
        for (pod, outcome) in reclaim::sweep(&state_root(), Some(&own_id)).await {
            match outcome {
                Ok(Reclaimed::Released(report)) => {
                    log::warn!("pod {pod}: its shim had died: reclaimed {report}")
                }
                Ok(_) => {}
                Err(e) => log::warn!("pod {pod}: its shim had died: {e}"),
            }
        }
    });
    log::info!(
        "shim serving the task and sandbox services on {}",
        flags.socket
    );
    shim.wait().await;
    log::info!("shutting down the shim");
    // The call that let the shim go (Shutdown, ShutdownSandbox) is still answering: ttrpc's
    // shutdown closes the connections without waiting for replies in flight, and containerd
    // 2.x's RemovePodSandbox fails on a ShutdownSandbox answered with `ttrpc: closed`.
    tokio::time::sleep(REPLY_GRACE).await;
    if let Err(e) = server.shutdown().await {
        log::warn!("stopping the ttrpc server: {e}");
    }
    // Its own socket (not the bundle's address file: containerd may have removed the bundle
    // by now, once `<shim> delete` answered).
    remove_socket(&flags.socket);
    Ok(())
}

/// Binds the shim socket; `None` if a live shim already serves it (a stale socket is removed
/// and bound again).
async fn bind(address: &str) -> Result<Option<Listener>, Error> {
    let path = socket_path(address);
    let listener = match listen(path) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            if serves(path).await {
                tokio::fs::write("address", address)
                    .await
                    .map_err(|e| io_error("writing the address file", e))?;
                return Ok(None);
            }
            remove_socket(address);
            listen(path).map_err(|e| io_error(&format!("binding {path}"), e))?
        }
        Err(e) => return Err(io_error(&format!("binding {path}"), e)),
    };
    Listener::try_from(listener)
        .map(Some)
        .map_err(|e| io_error("making the ttrpc listener", e))
}

fn listen(path: &str) -> std::io::Result<std::os::unix::net::UnixListener> {
    if let Some(parent) = Path::new(path).parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::os::unix::net::UnixListener::bind(path)
}

/// Whether something accepts on the socket within [`SOCKET_IN_USE_WAIT`].
async fn serves(path: &str) -> bool {
    let deadline = tokio::time::Instant::now() + SOCKET_IN_USE_WAIT;
    loop {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Tells `start` the daemon serves: stdout (`start`'s pipe) becomes stderr, closing the pipe.
fn signal_server_started() {
    // SAFETY: dup2 on the process's own standard descriptors, which stay open; nothing else
    // holds a Rust handle that assumes ownership of descriptor 1.
    if unsafe { libc::dup2(libc::STDERR_FILENO, libc::STDOUT_FILENO) } < 0 {
        log::warn!(
            "closing the start pipe: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// SIGTERM, SIGINT and SIGPIPE are taken and logged: the shim ends when containerd says so
/// (Shutdown, ShutdownSandbox), never because its process group was signalled.
fn take_signals() -> Result<(), Error> {
    for kind in [
        SignalKind::terminate(),
        SignalKind::interrupt(),
        SignalKind::pipe(),
    ] {
        let mut stream = signal(kind).map_err(|e| io_error("setting up signals", e))?;
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                log::debug!("received signal {}", kind.as_raw_value());
            }
        });
    }
    Ok(())
}

fn io_error(context: &str, err: std::io::Error) -> Error {
    Error::IoError {
        context: context.to_string(),
        err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_live_socket_is_reused_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s").join("shim.sock");
        let address = format!("unix://{}", sock.display());
        // Fresh: bound (the parent folder made).
        let first = listen(socket_path(&address)).unwrap();
        assert!(serves(socket_path(&address)).await);
        // A stale socket (nothing listens any more) is removed and bound again.
        drop(first);
        assert!(!serves(socket_path(&address)).await);
        let again = bind(&address).await.unwrap();
        assert!(again.is_some());
        remove_socket(&address);
        assert!(!sock.exists());
    }
}
