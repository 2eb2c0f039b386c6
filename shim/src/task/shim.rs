//! The shim's process-level commands (containerd's shim v2 protocol, run by
//! [`crate::task::serve`]): `start` spawns or reuses the pod's long-lived shim and prints its
//! socket address; `delete` cleans up after a shim that is gone; the daemon serves the task API
//! ([`crate::task::service`]).
//!
//! One shim per pod: the socket address is derived from the pod id (the sandbox id), so every
//! container of a pod gets the same address; a container outside a pod gets its own.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use containerd_shim::asynchronous::{ExitSignal, Shim};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, Error, Flags, StartOpts};
use containerd_shim_protos::api::DeleteResponse;

use crate::oci;
use crate::sandbox::reclaim::{self, Detached};
use crate::state::{state_root, StateDir};
use crate::task::bundle::Role;
use crate::task::options;
use crate::task::service::TaskService;

/// The runtime id containerd maps to `containerd-shim-microvm-v1`.
pub const RUNTIME_ID: &str = "io.containerd.microvm.v1";
/// Environment variable carrying the handler's `ConfigPath` from `start` to the daemon.
pub const CONFIG_PATH_ENV: &str = "MICROVM_CONFIG_PATH";
/// How long `start` waits for a freshly spawned daemon to serve.
const DAEMON_START_TIMEOUT: Duration = Duration::from_secs(10);

/// The shim: `start`, `delete`, and the daemon's task service.
pub struct MicrovmShim {
    id: String,
    namespace: String,
    bundle: PathBuf,
    exit: Arc<ExitSignal>,
    /// The socket the daemon serves on (`-socket`), recorded in each pod's state directory.
    socket: Option<String>,
}

#[async_trait]
impl Shim for MicrovmShim {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        let bundle = if args.bundle.is_empty() {
            std::env::current_dir().unwrap_or_default()
        } else {
            PathBuf::from(&args.bundle)
        };
        MicrovmShim {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            bundle,
            exit: Arc::new(ExitSignal::default()),
            socket: Some(args.socket.clone()).filter(|s| !s.is_empty()),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        // stdin: the handler's runtime options (runtimeoptions.v1.Options with ConfigPath).
        let mut stdin = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut stdin);
        // No `ConfigPath` in the options (a handler without an `options` table, as
        // `sandboxer = "shim"` needs on containerd 2.1): `MICROVM_CONFIG_PATH` in containerd's
        // environment, which its shims inherit, else the default file.
        let config_path = options::config_path_from_any_bytes(&stdin)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?
            .or_else(|| {
                std::env::var_os(CONFIG_PATH_ENV)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            });
        // containerd 2.x's Sandbox API (`sandboxer = "shim"`) starts a pod's shim with a bundle
        // without a spec: the pod itself (CreateSandbox follows on the socket).
        let pod_id = if self.bundle.join("config.json").exists() {
            let spec = oci::read_spec(&self.bundle).map_err(|e| Error::Other(e.to_string()))?;
            let role = Role::from_annotations(&opts.id, &oci::annotations(&spec));
            role.pod_id(&opts.id).to_string()
        } else {
            opts.id.clone()
        };
        let address = containerd_shim::socket_address(&opts.address, &opts.namespace, &pod_id);
        if !reclaim::socket_serves(&address).await {
            spawn_daemon(&opts, &address, config_path.as_deref()).await?;
        }
        // containerd reads the address back from the bundle when it restarts.
        let _ = std::fs::write(self.bundle.join("address"), &address);
        Ok(address)
    }

    async fn delete_shim(&mut self) -> Result<DeleteResponse, Error> {
        // Runs after the ttrpc connection closed. A pod whose shim still runs is left alone
        // (its VM may run other containers); a pod whose shim is gone is cleaned up whole.
        let pod_id = oci::read_spec(&self.bundle)
            .map(|spec| {
                Role::from_annotations(&self.id, &oci::annotations(&spec))
                    .pod_id(&self.id)
                    .to_string()
            })
            .unwrap_or_else(|_| self.id.clone());
        let state =
            StateDir::new(&state_root(), &pod_id).map_err(|e| Error::Other(e.to_string()))?;
        let address = std::fs::read_to_string(self.bundle.join("address")).unwrap_or_default();
        let address = address.trim();
        // A healthy shim (it serves and runs) is left alone at once: containerd also runs this
        // when one container's connection to a live pod shim closes.
        // A pod left alone here is cleaned up by nobody else until its shim ends: say so on
        // stderr, which containerd logs ("cleanup warnings").
        if !address.is_empty() && reclaim::socket_serves(address).await && state.shim_alive() {
            eprintln!(
                "pod {pod_id} ({}): its shim still serves {address} and runs: left alone",
                self.id
            );
            return Ok(exit_response());
        }
        if !state.path().exists() {
            // The pod was torn down (or reclaimed) already. A shim that is shutting down still
            // serves for a moment and removes its socket itself; one that died leaves it.
            if !address.is_empty() {
                reclaim::remove_dead_socket(address, reclaim::DELETE_WAIT).await;
            }
            return Ok(exit_response());
        }
        // The shim died, or is dying: reclaim its pod in a process containerd's cleanup
        // timeout does not kill (sandbox/reclaim.rs), and answer within that timeout.
        let (pod, addr) = (pod_id.clone(), address.to_string());
        let detached = tokio::task::spawn_blocking(move || {
            reclaim::spawn_detached(&pod, &addr, reclaim::DELETE_WAIT)
        })
        .await
        .map_err(|e| Error::Other(format!("reclaiming pod {pod_id}: {e}")))?;
        match detached {
            Ok(Detached::Finished(report)) => {
                if !report.is_empty() {
                    eprintln!("{report}");
                }
            }
            Ok(Detached::StillRunning(pid)) => eprintln!(
                "pod {pod_id}: reclaiming its host resources goes on in the background (pid {pid})"
            ),
            Err(e) => return Err(Error::Other(e.to_string())),
        }
        Ok(exit_response())
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        let config_path = std::env::var_os(CONFIG_PATH_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        TaskService::new(
            self.namespace.clone(),
            publisher,
            self.exit.clone(),
            config_path,
            self.socket.clone(),
        )
    }
}

/// The containerd-shim crate's settings for this shim ([`crate::task::serve`] reads them). The VM
/// backends wait for their
/// own children (QEMU, vhost-device-vsock, virtiofsd): the crate's SIGCHLD reaper
/// (`waitpid(-1)`) would steal their exit statuses, so it is off, and so is the subreaper (the
/// shim has no grandchildren to adopt).
pub fn shim_config() -> Config {
    Config {
        no_reaper: true,
        no_sub_reaper: true,
        ..Config::default()
    }
}

/// What `<shim> delete` answers: the pod's process was killed (SIGKILL's status), now.
fn exit_response() -> DeleteResponse {
    let mut resp = DeleteResponse::new();
    resp.exit_status = 137;
    resp.exited_at = Some(crate::task::process::timestamp(SystemTime::now())).into();
    resp
}

/// Spawns the daemon (this binary without an action, with `-socket`) and waits until it serves:
/// the daemon closes its stdout (our pipe) once its ttrpc server listens.
async fn spawn_daemon(
    opts: &StartOpts,
    address: &str,
    config_path: Option<&Path>,
) -> Result<(), Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Other(format!("current_exe: {e}")))?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args([
        "-namespace",
        &opts.namespace,
        "-id",
        &opts.id,
        "-address",
        &opts.address,
        "-socket",
        address,
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    // Its own process group: signals to containerd's group do not reach it.
    .process_group(0)
    .kill_on_drop(false);
    if opts.debug {
        cmd.arg("-debug");
    }
    match config_path {
        Some(p) => cmd.env(CONFIG_PATH_ENV, p),
        None => cmd.env_remove(CONFIG_PATH_ENV),
    };
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::Other(format!("spawning the shim daemon: {e}")))?;
    let mut out = child
        .stdout
        .take()
        .ok_or_else(|| Error::Other("shim daemon has no stdout pipe".into()))?;
    let mut sink = Vec::new();
    let read = tokio::time::timeout(
        DAEMON_START_TIMEOUT,
        tokio::io::AsyncReadExt::read_to_end(&mut out, &mut sink),
    )
    .await;
    if read.is_err() {
        let _ = child.start_kill();
        return Err(Error::Other(format!(
            "the shim daemon did not serve {address} within {DAEMON_START_TIMEOUT:?}"
        )));
    }
    if let Ok(Some(status)) = child.try_wait() {
        if !status.success() {
            return Err(Error::Other(format!("the shim daemon exited: {status}")));
        }
    }
    Ok(())
}
