//! Unix-socket plumbing of the hybrid-vsock backend: the `sockaddr_un` path limit and a
//! connect that never blocks the event loop. The muxer uses both: the limit for its listener's
//! path, the connect for guest connections to `<uds_path>_<port>`.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Longest path of a `sockaddr_un` (without the terminating NUL).
pub(super) const MAX_SOCKET_PATH: usize = 107;

/// Connects to a Unix stream socket without blocking: a listener with a full backlog gives
/// `WouldBlock` instead of stalling the event loop.
pub(super) fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() > MAX_SOCKET_PATH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    // SAFETY: plain syscall with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket we own; OwnedFd closes it on every path.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un, NUL-terminated (the path is at most 107 bytes of
    // the zeroed 108), and `len` does not exceed its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn connects_to_a_listener_and_refuses_long_or_missing_paths() {
        let dir = tempfile::tempdir().unwrap();
        let long = dir.path().join("x".repeat(MAX_SOCKET_PATH + 1));
        let err = connect_nonblocking(&long).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let missing = dir.path().join("missing");
        let err = connect_nonblocking(&missing).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);

        let path = dir.path().join("l.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut stream = connect_nonblocking(&path).unwrap();
        // The stream is non-blocking: nothing to read yet is WouldBlock, not a wait.
        let mut byte = [0u8; 1];
        let err = stream.read(&mut byte).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        drop(listener);
    }
}
