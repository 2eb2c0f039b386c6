//! Reaps children as PID 1: orphans of the whole guest are re-parented to init and would stay
//! zombies otherwise. SIGCHLD is blocked in every thread (the mask is set before any thread is
//! spawned and inherited), and one reaper thread takes it synchronously with `sigwait`, then
//! collects every exited child with `waitpid(-1, WNOHANG)`.
//!
//! Later (containers, exec) the reaper will hand exit statuses to whoever waits for a given pid;
//! for now it logs them.

use std::io;
use std::mem::MaybeUninit;
use std::thread::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error("blocking SIGCHLD: {0}")]
    Block(io::Error),
    #[error("spawning the reaper thread: {0}")]
    Spawn(io::Error),
}

/// A child that was reaped, with its raw wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    pub pid: libc::pid_t,
    pub status: libc::c_int,
}

fn sigchld_set() -> libc::sigset_t {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set; sigaddset with a valid signal cannot fail.
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigaddset(set.as_mut_ptr(), libc::SIGCHLD);
        set.assume_init()
    }
}

/// Blocks SIGCHLD in the calling thread. Call before spawning any thread, so all inherit it.
pub fn block_sigchld() -> Result<(), ReaperError> {
    let set = sigchld_set();
    // SAFETY: `set` is an initialised signal set; the old mask is not needed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(ReaperError::Block(io::Error::from_raw_os_error(rc)))
    }
}

/// Collects every child that has exited, without blocking.
pub fn reap_exited() -> Vec<Reaped> {
    let mut reaped = Vec::new();
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid out-pointer; WNOHANG keeps the call non-blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            reaped.push(Reaped { pid, status });
            continue;
        }
        if pid < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        // 0: children remain but none has exited; -1/ECHILD: no children at all.
        return reaped;
    }
}

/// Starts the reaper thread. SIGCHLD must already be blocked ([`block_sigchld`]).
pub fn spawn() -> Result<JoinHandle<()>, ReaperError> {
    std::thread::Builder::new()
        .name("reaper".into())
        .spawn(|| {
            let set = sigchld_set();
            loop {
                let mut sig: libc::c_int = 0;
                // SAFETY: `set` is initialised and `sig` a valid out-pointer.
                let rc = unsafe { libc::sigwait(&set, &mut sig) };
                if rc != 0 {
                    log::warn!("sigwait: {}", io::Error::from_raw_os_error(rc));
                }
                for child in reap_exited() {
                    log::debug!("reaped pid {} (status {:#x})", child.pid, child.status);
                }
            }
        })
        .map_err(ReaperError::Spawn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaps_an_exited_child() {
        // The only test in this binary that creates children, so waitpid(-1) sees just ours.
        let child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits");
        drop(child); // std does not wait on drop: the child becomes ours to reap
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut seen = Vec::new();
        while std::time::Instant::now() < deadline && !seen.iter().any(|r: &Reaped| r.pid == pid) {
            seen.extend(reap_exited());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let reaped = seen.iter().find(|r| r.pid == pid).expect("child reaped");
        assert!(libc::WIFEXITED(reaped.status));
        assert_eq!(libc::WEXITSTATUS(reaped.status), 0);
        assert!(reap_exited().is_empty());
    }
}
