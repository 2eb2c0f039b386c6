//! Port-forward into the pod: each TCP connection containerd's PortForward makes to
//! `127.0.0.1:<port>` in the pod netns on the host arrives at the pod's loopback listener
//! (`resources::network::loopback`) and is carried to the same port on the guest's loopback
//! through an agent stream (`agent::forward`); the bytes are then copied both ways, each
//! direction's EOF passed on as a half-close, until both ended.
//!
//! When the guest cannot reach the port (nothing listens there, the agent does not answer in
//! time), the host connection is reset, so that containerd's copy fails and says so on the
//! stream's error channel (`kubectl port-forward` prints it), and the shim logs one warn line
//! with the agent's reason. At most [`MAX_FORWARDS`] connections are carried at once per pod;
//! the next ones are reset with a warn line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::agent::forward::open_forward_stream;
use crate::resources::network::loopback::LoopbackListener;
use crate::resources::network::sk_lookup::LoopbackRedirect;

/// Connections carried at once per pod.
pub const MAX_FORWARDS: usize = 128;
/// How long reaching the guest's port may take (the agent answers at once when nothing
/// listens there).
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// The pod's port-forward: the accept loop, and the redirect that feeds it. Dropping it (or
/// [`PortForward::stop`]) ends the loop and the connections it carries.
#[derive(Debug)]
pub struct PortForward {
    task: JoinHandle<()>,
    _redirect: LoopbackRedirect,
}

impl PortForward {
    /// Starts serving `loopback` for pod `id`, whose agent is reached through the VM's
    /// hybrid-vsock socket `uds`. Must run inside the shim's tokio runtime.
    pub fn start(
        id: &str,
        loopback: LoopbackListener,
        uds: PathBuf,
    ) -> std::io::Result<PortForward> {
        let (listener, redirect) = loopback.into_parts();
        let listener = TcpListener::from_std(listener)?;
        let task = tokio::spawn(accept_loop(id.to_owned(), listener, uds));
        Ok(PortForward {
            task,
            _redirect: redirect,
        })
    }

    /// Ends the accept loop and every connection it carries.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(id: String, listener: TcpListener, uds: PathBuf) {
    let slots = Arc::new(Semaphore::new(MAX_FORWARDS));
    let mut carried = tokio::task::JoinSet::new();
    loop {
        let conn = tokio::select! {
            accepted = listener.accept() => accepted,
            // Reap finished connections as they end, so the set stays as small as what runs.
            Some(_) = carried.join_next(), if !carried.is_empty() => continue,
        };
        let conn = match conn {
            Ok((conn, _)) => conn,
            Err(e) => {
                log::warn!("sandbox {id}: port-forward: accepting: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            log::warn!(
                "sandbox {id}: port-forward: {MAX_FORWARDS} connections are carried already; \
                 resetting a new one"
            );
            reset(conn);
            continue;
        };
        let (id, uds) = (id.clone(), uds.clone());
        carried.spawn(async move {
            carry(&id, conn, &uds).await;
            drop(slot);
        });
    }
}

/// Carries one connection to its port in the guest.
async fn carry(id: &str, mut conn: TcpStream, uds: &std::path::Path) {
    let port = match conn.local_addr() {
        Ok(addr) => addr.port(),
        Err(e) => {
            log::warn!("sandbox {id}: port-forward: the connection's address: {e}");
            return reset(conn);
        }
    };
    let mut guest = match open_forward_stream(uds, port, OPEN_TIMEOUT).await {
        Ok(stream) => stream,
        Err(e) => {
            log::warn!("sandbox {id}: port-forward to port {port} in the guest: {e}");
            return reset(conn);
        }
    };
    log::debug!("sandbox {id}: port-forward to port {port}: connected");
    if let Err(e) = tokio::io::copy_bidirectional(&mut conn, &mut guest).await {
        log::debug!("sandbox {id}: port-forward to port {port} ended: {e}");
    }
}

/// Closes `conn` with a reset (SO_LINGER 0): the connecting side reads an error, not an EOF
/// that would look like an empty answer.
fn reset(conn: TcpStream) {
    if let Ok(std) = conn.into_std() {
        let _ = socket_linger_zero(&std);
    }
}

fn socket_linger_zero(conn: &std::net::TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: SO_LINGER takes a `struct linger`, valid for the call; the fd is a socket we own.
    let rc = unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::linger>()).unwrap_or(0),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
