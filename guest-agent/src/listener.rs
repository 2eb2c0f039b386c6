//! The agent's stream listeners beside ttrpc (stdio on [`agent_protocol::AGENT_STDIO_PORT`],
//! port-forward on [`agent_protocol::AGENT_FORWARD_PORT`]): a vsock socket listening on any CID
//! in the guest, a Unix socket in tests and debug runs on a host. Each accepted connection gets
//! a thread of its own that first reads one header line, bounded in length and time.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::time::Duration;

/// A connection from the host (a vsock or Unix stream socket, used through read/write/shutdown).
pub type Conn = File;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("listening on {address}: {source}")]
    Listen { address: String, source: io::Error },
    #[error("unsupported address {0:?} (vsock://-1:PORT or unix:///path)")]
    Address(String),
    #[error("spawning a thread: {0}")]
    Thread(io::Error),
}

/// `shutdown(2)` of one or both directions; errors (e.g. an already closed peer) are harmless.
pub fn shutdown(conn: &Conn, how: libc::c_int) {
    // SAFETY: shutdown(2) on a socket fd we own.
    unsafe { libc::shutdown(conn.as_raw_fd(), how) };
}

/// Reads one line byte by byte (what follows belongs to the stream), newline included: at most
/// `max` bytes, within `timeout`; the read timeout is cleared again afterwards.
pub fn read_line(conn: &mut Conn, max: usize, timeout: Duration) -> Result<Vec<u8>, String> {
    set_read_timeout(conn, Some(timeout)).map_err(|e| e.to_string())?;
    let mut line = Vec::with_capacity(64);
    loop {
        let mut byte = [0u8; 1];
        match conn.read(&mut byte) {
            Ok(0) => return Err("closed before the header".into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("reading the header: {e}")),
        }
        line.push(byte[0]);
        if byte[0] == b'\n' {
            break;
        }
        if line.len() >= max {
            return Err("header too long".into());
        }
    }
    set_read_timeout(conn, None).map_err(|e| e.to_string())?;
    Ok(line)
}

fn set_read_timeout(conn: &Conn, timeout: Option<Duration>) -> io::Result<()> {
    let tv = match timeout {
        Some(t) => libc::timeval {
            tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_usec: 0,
        },
        None => libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
    };
    // SAFETY: SO_RCVTIMEO takes a timeval, valid for the call; the fd is a socket we own.
    let rc = unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(0),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

enum Listener {
    Unix(UnixListener),
    Vsock(OwnedFd),
}

impl Listener {
    fn bind(address: &str) -> Result<Self, ListenError> {
        let listen_err = |source| ListenError::Listen {
            address: address.to_owned(),
            source,
        };
        if let Some(path) = address.strip_prefix("unix://") {
            let _ = std::fs::remove_file(path);
            return UnixListener::bind(path).map(Self::Unix).map_err(listen_err);
        }
        let port: u32 = address
            .strip_prefix("vsock://-1:")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| ListenError::Address(address.to_owned()))?;
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(listen_err(io::Error::last_os_error()));
        }
        // SAFETY: socket succeeded; the fd is new and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_vm is plain data; all-zero is a valid value to fill in.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_port = port;
        addr.svm_cid = libc::VMADDR_CID_ANY;
        let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_vm>())
            .map_err(|_| ListenError::Address(address.to_owned()))?;
        // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                len,
            )
        };
        // SAFETY: listen on our bound socket.
        if rc != 0 || unsafe { libc::listen(fd.as_raw_fd(), 64) } != 0 {
            return Err(listen_err(io::Error::last_os_error()));
        }
        Ok(Self::Vsock(fd))
    }

    fn accept(&self) -> io::Result<Conn> {
        match self {
            Self::Unix(listener) => listener.accept().map(|(s, _)| File::from(OwnedFd::from(s))),
            Self::Vsock(fd) => {
                // SAFETY: accept4 on our listening socket; the peer address is not needed.
                let conn = unsafe {
                    libc::accept4(
                        fd.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC,
                    )
                };
                if conn < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: accept4 returned a new fd that is ours.
                Ok(unsafe { File::from_raw_fd(conn) })
            }
        }
    }
}

/// Binds `address` (`vsock://-1:PORT` or `unix:///path`) and, on a thread named `name` for the
/// agent's whole life, hands each accepted connection to `handle` on a thread of its own.
pub fn serve<H>(address: &str, name: &str, handle: H) -> Result<(), ListenError>
where
    H: Fn(Conn) + Clone + Send + 'static,
{
    let listener = Listener::bind(address)?;
    let conn_name = format!("{name}-conn");
    let accept_name = format!("{name}-accept");
    std::thread::Builder::new()
        .name(accept_name.clone())
        .spawn(move || loop {
            match listener.accept() {
                Ok(conn) => {
                    let handle = handle.clone();
                    let spawned = std::thread::Builder::new()
                        .name(conn_name.clone())
                        .spawn(move || handle(conn));
                    if let Err(e) = spawned {
                        log::warn!("{accept_name}: no thread for a connection: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("{accept_name}: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
        .map_err(ListenError::Thread)?;
    Ok(())
}
