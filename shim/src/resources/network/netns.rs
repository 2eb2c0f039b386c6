//! Running work inside the pod netns: on a dedicated OS thread that `setns`es (never a thread
//! of the shim's tokio runtime), with its own current-thread runtime and netlink connection.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use rtnetlink::Handle;

use super::NetworkError;

/// What a missing netns means to the caller.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum NetnsMissing {
    Error,
    /// Answer `None` (teardown: the netns, and everything in it, is gone).
    Gone,
}

/// The netns thread's view: the path and a netlink handle inside the netns.
pub(super) struct NetnsCtx {
    pub(super) path: PathBuf,
    pub(super) handle: Handle,
}

/// Runs `work` on a new OS thread that has entered `netns`, with a current-thread tokio runtime
/// and a netlink connection opened there. `Ok(None)`: the netns is missing and `missing` is
/// [`NetnsMissing::Gone`].
pub(super) async fn in_netns<T, F, Fut>(
    netns: &Path,
    missing: NetnsMissing,
    work: F,
) -> Result<Option<T>, NetworkError>
where
    T: Send + 'static,
    F: FnOnce(NetnsCtx) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, NetworkError>>,
{
    let path = netns.to_path_buf();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread_path = path.clone();
    std::thread::Builder::new()
        .name("pod-netns".into())
        .spawn(move || {
            let _ = tx.send(run_in_netns(thread_path, missing, work));
        })
        .map_err(|source| NetworkError::Thread {
            path: path.clone(),
            source,
        })?;
    rx.await.map_err(|_| NetworkError::ThreadLost(path))?
}

fn run_in_netns<T, F, Fut>(
    path: PathBuf,
    missing: NetnsMissing,
    work: F,
) -> Result<Option<T>, NetworkError>
where
    F: FnOnce(NetnsCtx) -> Fut,
    Fut: std::future::Future<Output = Result<T, NetworkError>>,
{
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return match missing {
                NetnsMissing::Gone => Ok(None),
                NetnsMissing::Error => Err(NetworkError::NetnsMissing(path)),
            }
        }
        Err(source) => return Err(NetworkError::NetnsOpen { path, source }),
    };
    // SAFETY: `file` is an open fd for the call's duration; setns only changes this thread's
    // network namespace, and this thread is ours alone and ends after `work`.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let source = io::Error::last_os_error();
        // EINVAL: not a network namespace (e.g. the file left after containerd unmounted it).
        if missing == NetnsMissing::Gone && source.raw_os_error() == Some(libc::EINVAL) {
            return Ok(None);
        }
        return Err(NetworkError::NetnsEnter { path, source });
    }
    drop(file);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|source| NetworkError::Connection {
            path: path.clone(),
            source,
        })?;
    runtime.block_on(async move {
        // The socket is opened here, after setns: it belongs to the pod netns.
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|source| NetworkError::Connection {
                path: path.clone(),
                source,
            })?;
        let conn = tokio::spawn(connection);
        let result = work(NetnsCtx { path, handle }).await;
        conn.abort();
        result.map(Some)
    })
}
