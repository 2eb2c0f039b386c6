//! The pod netns's loopback, for port-forward (`kubectl port-forward`, CRI PortForward).
//!
//! containerd serves PortForward itself: it enters the pod's netns on the host and dials
//! `localhost:<port>` there. On a runc node the pod's processes listen in that netns; here they
//! listen in the guest, and nothing would accept on the host side's loopback. So the shim makes
//! one TCP socket listen in the pod netns (`127.0.0.1`, a port of the kernel's choice) and
//! attaches a BPF `sk_lookup` program to the netns ([`sk_lookup`](super::sk_lookup)) that
//! hands it every TCP connection to 127.0.0.1, whatever the port. Each accepted connection's
//! local address is what containerd dialed; the sandbox carries it to that port in the guest
//! through the agent.
//!
//! Nothing here touches the netns's configuration (no address, route, iptables rule): the
//! socket and the program live as long as the shim's fds, so a teardown, or the shim's death,
//! leaves the netns exactly as CNI made it. The pod's own traffic never meets the socket: it
//! goes through the tc redirects straight between the CNI interface and the tap.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use super::sk_lookup::{redirect_loopback, LoopbackRedirect, SkLookupError};

/// Why the pod's loopback could not be caught.
#[derive(Debug, thiserror::Error)]
pub enum LoopbackError {
    #[error("opening pod netns {path}: {source}")]
    NetnsOpen { path: PathBuf, source: io::Error },
    #[error("entering pod netns {path}: {source}")]
    NetnsEnter { path: PathBuf, source: io::Error },
    #[error("listening on 127.0.0.1 in pod netns {path}: {source}")]
    Listen { path: PathBuf, source: io::Error },
    #[error("a thread for pod netns {path}: {source}")]
    Thread { path: PathBuf, source: io::Error },
    #[error(
        "pod netns {0} is the shim's own network namespace: its loopback is the host's, never \
         caught"
    )]
    HostNetns(PathBuf),
    #[error("pod netns {path}: {source} (the host's kernel needs BPF sk_lookup, Linux 5.9+)")]
    Redirect {
        path: PathBuf,
        source: SkLookupError,
    },
}

/// A listening socket in the pod netns that receives every TCP connection made there to
/// 127.0.0.1; dropping it closes the socket and detaches the program.
#[derive(Debug)]
pub struct LoopbackListener {
    listener: TcpListener,
    redirect: LoopbackRedirect,
}

impl LoopbackListener {
    /// The listening socket (non-blocking); an accepted connection's `local_addr()` is the
    /// address and port the connecting side asked for.
    pub fn into_parts(self) -> (TcpListener, LoopbackRedirect) {
        (self.listener, self.redirect)
    }
}

/// Catches TCP to 127.0.0.1 in the netns at `netns` (see the module doc). Blocking: a short
/// thread enters the netns to create the socket.
pub fn catch_loopback(netns: &Path) -> Result<LoopbackListener, LoopbackError> {
    let path = netns.to_path_buf();
    let ns = File::open(netns).map_err(|source| LoopbackError::NetnsOpen {
        path: path.clone(),
        source,
    })?;
    // Never the host's own loopback: that would take every TCP connection to 127.0.0.1 on the
    // node. (A hostNetwork pod is refused before this; a netns path that names the host's
    // namespace anyway is refused here.)
    if same_file(&ns, Path::new("/proc/thread-self/ns/net")) {
        return Err(LoopbackError::HostNetns(path));
    }
    let ns_for_thread = ns.try_clone().map_err(|source| LoopbackError::NetnsOpen {
        path: path.clone(),
        source,
    })?;
    let thread_path = path.clone();
    let listener = std::thread::Builder::new()
        .name("pod-netns-lo".into())
        .spawn(move || listen_in(&ns_for_thread, &thread_path))
        .map_err(|source| LoopbackError::Thread {
            path: path.clone(),
            source,
        })?
        .join()
        .map_err(|_| LoopbackError::Thread {
            path: path.clone(),
            source: io::Error::other("the thread panicked"),
        })??;
    let redirect = redirect_loopback(ns.as_fd(), listener.as_fd())
        .map_err(|source| LoopbackError::Redirect { path, source })?;
    Ok(LoopbackListener { listener, redirect })
}

/// Whether `file` and the file at `other` are the same inode (an unreadable `other`: not).
fn same_file(file: &File, other: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(other)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// On a thread of its own (setns changes only the calling thread, which ends right after):
/// the socket is created inside the netns and stays there.
fn listen_in(ns: &File, path: &Path) -> Result<TcpListener, LoopbackError> {
    // SAFETY: `ns` is an open fd for the call; setns changes only this thread's network
    // namespace, and this thread is ours alone and ends after this function.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(LoopbackError::NetnsEnter {
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    let listen_err = |source| LoopbackError::Listen {
        path: path.to_path_buf(),
        source,
    };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(listen_err)?;
    listener.set_nonblocking(true).map_err(listen_err)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_own_netns_is_never_caught() {
        for path in ["/proc/self/ns/net", "/proc/thread-self/ns/net"] {
            let err = catch_loopback(Path::new(path)).expect_err("the host's netns");
            assert!(matches!(err, LoopbackError::HostNetns(_)), "{path}: {err}");
            assert!(err.to_string().contains("never caught"), "{err}");
        }
    }
}
