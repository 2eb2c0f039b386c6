//! Waiting for descriptors to be readable (`ppoll`), with a timeout: the embedder waits on the
//! channel and the VMM process's pidfd, the VMM process's control thread on the channel.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// Which of `fds` are readable (or hung up) within `timeout`: all false when it passed.
pub(super) fn wait_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Duration,
) -> std::io::Result<Vec<bool>> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    loop {
        // SAFETY: `polls` is a valid array of its length; the timeout and no signal mask.
        let n = unsafe {
            libc::ppoll(
                polls.as_mut_ptr(),
                polls.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        if n >= 0 {
            return Ok(polls.iter().map(|p| p.revents != 0).collect());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
