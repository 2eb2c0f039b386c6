//! Reclaiming the host side of a pod whose shim died (`kill -9`, a crash, the OOM killer): its
//! network undone, VM processes killed, host cgroup, mounts and state directory removed, and the
//! dead shim's socket, all from the records in its state directory ([`crate::state`]).
//!
//! Two ways in, both through [`reclaim`], serialized by the state directory's lock:
//!
//! - **`<shim> delete`**, which containerd runs when a shim's connection closes. containerd kills
//!   it after `io.containerd.timeout.shim.cleanup` (5 s by default), and a pod under load can
//!   take longer than that (its shim still exiting, QEMU's memory being freed). So `delete`
//!   starts the work in a process of its own ([`spawn_detached`], the hidden action
//!   [`RECLAIM_ACTION`]) that containerd's kill does not reach, waits for it within
//!   [`DELETE_WAIT`], and says on stderr (containerd's log) if it goes on in the background.
//! - **The sweep** ([`sweep`]) each new shim runs once it serves: any pod under the state root
//!   whose recorded shim is gone and that nobody is reclaiming. It covers a `delete` that never
//!   ran at all (containerd down when the shim died, or killed itself).

use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::state::{StateDir, StateError};

/// The hidden first argument of the shim binary that runs [`reclaim`] for one pod (never one
/// of containerd's actions).
pub const RECLAIM_ACTION: &str = "reclaim-dead-pod";
/// How long a shim whose connection closed may take to finish exiting.
pub const DYING_SHIM_WAIT: Duration = Duration::from_secs(5);
/// How long `<shim> delete` waits for its reclaim before it answers containerd: within
/// containerd's default cleanup timeout (5 s), so its answer, not its kill, ends the call.
pub const DELETE_WAIT: Duration = Duration::from_secs(4);
/// At most this much of a reclaim's stderr is passed on.
const REPORT_LIMIT: u64 = 16 * 1024;

/// Why a reclaim failed.
#[derive(Debug, thiserror::Error)]
pub enum ReclaimError {
    #[error("{0}")]
    State(#[from] StateError),
    #[error("cleaning up pod {pod}: {message}")]
    Release { pod: String, message: String },
    #[error("starting the reclaim of pod {pod}: {source}")]
    Spawn {
        pod: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the reclaim of pod {pod}: {source}")]
    Wait {
        pod: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the reclaim of pod {pod} failed ({status}): {report}")]
    Failed {
        pod: String,
        status: std::process::ExitStatus,
        report: String,
    },
}

/// What a reclaim found and did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reclaimed {
    /// The pod's host resources were released; the report says what was undone.
    Released(String),
    /// Nothing was left (another reclaim, or the shim's own teardown, got there first).
    NothingLeft,
    /// The shim still serves or runs after [`DYING_SHIM_WAIT`]: it is alive (hung, perhaps),
    /// and its pod is its own.
    ShimAlive { serving: bool },
}

/// What [`spawn_detached`] saw within its wait.
#[derive(Debug)]
pub enum Detached {
    /// The reclaim ended; its stderr (its one-line report).
    Finished(String),
    /// It still runs, in the background, with this pid.
    StillRunning(u32),
}

/// Reclaims the pod of `state` once its shim is gone: waits up to [`DYING_SHIM_WAIT`] for a
/// shim that is still exiting, takes the directory's lock, releases the host resources (the
/// same undo as a pod's teardown) and removes the dead shim's socket at `address` (the bundle's
/// address file, else the one the state directory recorded).
pub async fn reclaim(state: &StateDir, address: Option<&str>) -> Result<Reclaimed, ReclaimError> {
    let recorded = state.socket_address();
    let address = address.filter(|a| !a.is_empty()).or(recorded.as_deref());
    let deadline = Instant::now() + DYING_SHIM_WAIT;
    loop {
        let serving = match address {
            Some(a) => socket_serves(a).await,
            None => false,
        };
        if !serving && !state.shim_alive() {
            break;
        }
        if Instant::now() >= deadline {
            return Ok(Reclaimed::ShimAlive { serving });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another reclaim of the pod may hold the lock for seconds: wait for it off the runtime.
    let waiter = state.clone();
    let lock = tokio::task::spawn_blocking(move || waiter.lock())
        .await
        .map_err(|e| ReclaimError::Release {
            pod: pod_name(state.path()),
            message: format!("waiting for the state directory's lock: {e}"),
        })??;
    let outcome = match lock {
        None => Ok(Reclaimed::NothingLeft),
        Some(_held) => super::release_host_resources(state)
            .await
            .map(Reclaimed::Released)
            .map_err(|message| ReclaimError::Release {
                pod: pod_name(state.path()),
                message,
            }),
    };
    // The shim is gone either way: its socket goes even when a step of the release failed.
    if let Some(a) = address {
        remove_dead_socket(a, Duration::ZERO).await;
    }
    outcome
}

/// Reclaims every pod under `root` whose recorded shim is gone and that nobody is reclaiming
/// now; returns what it did, by pod. A directory without a shim record (one being created) and
/// `own` (the caller's pod) are left alone.
pub async fn sweep(
    root: &Path,
    own: Option<&str>,
) -> Vec<(String, Result<Reclaimed, ReclaimError>)> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return done;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if Some(name.as_str()) == own || !entry.path().is_dir() {
            continue;
        }
        let Ok(state) = StateDir::new(root, &name) else {
            continue;
        };
        if !state.has_shim_record() || state.shim_alive() {
            continue;
        }
        // Someone holds the lock: that reclaim is theirs.
        match state.try_lock() {
            Ok(Some(probe)) => drop(probe),
            Ok(None) => continue,
            Err(e) => {
                done.push((name, Err(e.into())));
                continue;
            }
        }
        let outcome = reclaim(&state, None).await;
        done.push((name, outcome));
    }
    done
}

/// Starts [`reclaim`] of pod `pod_id` in a process of its own (this binary with
/// [`RECLAIM_ACTION`]), in its own process group, stdin and stdout closed, and waits for it up to
/// `wait`. The state root it uses comes with the environment.
pub fn spawn_detached(
    pod_id: &str,
    address: &str,
    wait: Duration,
) -> Result<Detached, ReclaimError> {
    let pod = pod_id.to_string();
    let exe = std::env::current_exe().map_err(|source| ReclaimError::Spawn {
        pod: pod.clone(),
        source,
    })?;
    let mut cmd = Command::new(exe);
    cmd.arg(RECLAIM_ACTION)
        .arg(pod_id)
        .arg(address)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|source| ReclaimError::Spawn {
        pod: pod.clone(),
        source,
    })?;
    let deadline = Instant::now() + wait;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut report = String::new();
                if let Some(err) = child.stderr.take() {
                    let _ = err.take(REPORT_LIMIT).read_to_string(&mut report);
                }
                let report = report.trim().to_string();
                return if status.success() {
                    Ok(Detached::Finished(report))
                } else {
                    Err(ReclaimError::Failed {
                        pod,
                        status,
                        report,
                    })
                };
            }
            Ok(None) if Instant::now() >= deadline => {
                // Its stderr is dropped with `child`: what it writes later is lost (EPIPE),
                // which it ignores.
                return Ok(Detached::StillRunning(child.id()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(source) => return Err(ReclaimError::Wait { pod, source }),
        }
    }
}

/// The hidden action: reclaims pod `pod_id` and reports on stderr in one line; exits 0 when
/// done (or nothing was left, or the shim is alive), 1 on failure.
pub async fn run_action(pod_id: &str, address: &str) -> i32 {
    use std::io::Write;
    let outcome = match StateDir::new(&crate::state::state_root(), pod_id) {
        Ok(state) => reclaim(&state, Some(address)).await,
        Err(e) => Err(e.into()),
    };
    let (line, code) = match outcome {
        Ok(Reclaimed::Released(report)) => (format!("pod {pod_id}: reclaimed: {report}"), 0),
        Ok(Reclaimed::NothingLeft) => (String::new(), 0),
        Ok(Reclaimed::ShimAlive { serving }) => (
            format!(
                "pod {pod_id}: its shim still {} {DYING_SHIM_WAIT:?} after its connection closed: left to it",
                if serving { "serves" } else { "runs" }
            ),
            0,
        ),
        Err(e) => (e.to_string(), 1),
    };
    if !line.is_empty() {
        // Nobody may read it any more (delete answered containerd): ignore EPIPE.
        let _ = writeln!(std::io::stderr(), "{line}");
    }
    code
}

/// Waits up to `wait` for the socket at `address` to stop serving (a shim shutting down still
/// serves for a moment), then removes it if nobody serves it and it is a socket.
pub async fn remove_dead_socket(address: &str, wait: Duration) {
    let deadline = Instant::now() + wait;
    while socket_serves(address).await && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !socket_serves(address).await {
        remove_socket(address);
    }
}

/// Removes the socket at `address` if it is one.
pub fn remove_socket(address: &str) {
    let path = socket_path(address);
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        if let Err(e) = std::fs::remove_file(path) {
            log::warn!("removing the shim socket {path}: {e}");
        }
    }
}

/// Whether something accepts on the socket at `address` now.
pub async fn socket_serves(address: &str) -> bool {
    tokio::net::UnixStream::connect(socket_path(address))
        .await
        .is_ok()
}

/// A socket address's path (`unix://` stripped).
pub fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

fn pod_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A state directory whose recorded shim has exited.
    fn dead_pod(root: &Path, id: &str) -> StateDir {
        let state = StateDir::new(root, id).unwrap();
        let mut shim = Command::new("sleep").arg("60").spawn().unwrap();
        state.create(shim.id()).unwrap();
        shim.kill().unwrap();
        shim.wait().unwrap();
        state
    }

    #[tokio::test]
    async fn the_sweep_reclaims_dead_pods_only_and_their_sockets() {
        let root = tempfile::tempdir().unwrap();
        let dead = dead_pod(root.path(), "dead");
        let socket = root.path().join("dead.sock");
        drop(UnixListener::bind(&socket).unwrap());
        dead.record_socket(&format!("unix://{}", socket.display()))
            .unwrap();
        std::fs::create_dir(dead.shared_dir()).unwrap();
        // A live shim (this process), a directory being created (no shim record), a dead pod
        // someone is reclaiming (its lock held), and the sweeper's own pod.
        let live = StateDir::new(root.path(), "live").unwrap();
        live.create(std::process::id()).unwrap();
        let creating = StateDir::new(root.path(), "creating").unwrap();
        std::fs::create_dir(creating.path()).unwrap();
        let busy = dead_pod(root.path(), "busy");
        let held = busy.lock().unwrap().unwrap();
        let own = dead_pod(root.path(), "own");

        let done = sweep(root.path(), Some("own")).await;

        let names: Vec<&str> = done.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["dead"], "{done:?}");
        assert!(matches!(done[0].1, Ok(Reclaimed::Released(_))), "{done:?}");
        assert!(!dead.path().exists());
        assert!(!socket.exists(), "the dead shim's socket is removed");
        for kept in [&live, &creating, &busy, &own] {
            assert!(kept.path().exists(), "{} kept", kept.path().display());
        }
        drop(held);
        // Once free, the dead pod nobody reclaimed is the next sweep's.
        let done = sweep(root.path(), Some("own")).await;
        let names: Vec<&str> = done.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["busy"], "{done:?}");
    }

    #[tokio::test]
    async fn a_shim_that_still_runs_is_left_to_itself() {
        let root = tempfile::tempdir().unwrap();
        let state = StateDir::new(root.path(), "alive").unwrap();
        state.create(std::process::id()).unwrap();
        let started = Instant::now();
        let outcome = reclaim(&state, None).await.unwrap();
        assert_eq!(outcome, Reclaimed::ShimAlive { serving: false });
        assert!(started.elapsed() >= DYING_SHIM_WAIT);
        assert!(state.path().exists());
    }
}
