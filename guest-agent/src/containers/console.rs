//! A process's terminal: when the host asked for one, libcontainer's init opens the pty and sends
//! its master over a console socket the agent binds in the bundle ([`with_console`]).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};

use super::error::{io_err, ContainerError};

/// Time for libcontainer's init to hand over the pty master.
const CONSOLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds a console socket, runs `build`, then receives the pty master libcontainer's init sends.
pub(super) fn with_console<T>(
    dir: &Path,
    build: impl FnOnce(Option<&Path>) -> Result<T, ContainerError>,
    terminal: bool,
) -> Result<(T, Option<File>), ContainerError> {
    if !terminal {
        return build(None).map(|t| (t, None));
    }
    let path = dir.join(format!("console-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(io_err("binding the console socket"))?;
    let built = build(Some(&path));
    let _ = std::fs::remove_file(&path);
    let built = built?;
    let master = receive_fd(&listener).map_err(io_err("receiving the pty master"))?;
    Ok((built, Some(File::from(master))))
}

fn receive_fd(listener: &UnixListener) -> io::Result<OwnedFd> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + CONSOLE_TIMEOUT;
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(CONSOLE_TIMEOUT))?;
    let mut buf = [0u8; 4096];
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = nix::sys::socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    for cmsg in msg.cmsgs().map_err(io::Error::from)? {
        if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = cmsg {
            let owned: Vec<OwnedFd> = fds
                .into_iter()
                .map(|fd| {
                    // SAFETY: SCM_RIGHTS delivered these fds to us; nobody else owns them.
                    unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
                })
                .collect();
            if let Some(first) = owned.into_iter().next() {
                return Ok(first);
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "no fd in the console message",
    ))
}
