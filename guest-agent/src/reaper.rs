//! Reaps children as PID 1: orphans of the whole guest are re-parented to init and would stay
//! zombies otherwise. SIGCHLD is blocked in every thread (the mask is set before any thread is
//! spawned and inherited), and one reaper thread takes it synchronously with `sigwait`, then
//! collects every exited child with `waitpid(-1, WNOHANG)`.
//!
//! The exit status of a process the agent started (container init, exec) goes to its
//! [`ExitCell`], registered in [`PROCESSES`]. Whoever starts such a process holds the
//! [`PROCESSES`] lock from before the build process starts ([`crate::build_process`]) until the
//! new pid is registered; the reaper holds the same lock while it reaps, so an exit can never be
//! collected before its cell is known (a quick exec may end before the build process has
//! answered: it is then re-parented to the agent as a zombie and waits for the lock).
//!
//! Outside PID 1 (tests) the agent makes itself a child subreaper, so the same holds.

use std::collections::BTreeMap;
use std::io;
use std::mem::MaybeUninit;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// How a process ended, as the shim sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// n for exit(n), 128+s when killed by signal s.
    pub code: u32,
    pub at_unix_nanos: u64,
}

impl ExitStatus {
    /// From a raw wait status; stopped/continued statuses are not exits.
    pub fn from_wait_status(status: libc::c_int) -> Option<Self> {
        let code = if libc::WIFEXITED(status) {
            u32::try_from(libc::WEXITSTATUS(status)).ok()?
        } else if libc::WIFSIGNALED(status) {
            128 + u32::try_from(libc::WTERMSIG(status)).ok()?
        } else {
            return None;
        };
        let at_unix_nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Some(Self {
            code,
            at_unix_nanos,
        })
    }
}

/// Where one process's exit status lands; any number of waiters.
#[derive(Debug, Default)]
pub struct ExitCell {
    status: Mutex<Option<ExitStatus>>,
    changed: Condvar,
}

impl ExitCell {
    pub fn set(&self, status: ExitStatus) {
        let mut slot = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(status);
        }
        self.changed.notify_all();
    }

    pub fn get(&self) -> Option<ExitStatus> {
        *self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until the process has exited, or `timeout` passed (None).
    pub fn wait(&self, timeout: Duration) -> Option<ExitStatus> {
        let slot = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let (slot, _) = self
            .changed
            .wait_timeout_while(slot, timeout, |s| s.is_none())
            .unwrap_or_else(|e| e.into_inner());
        *slot
    }
}

/// The processes the agent waits for, by pid. See the module doc for the locking rule.
pub static PROCESSES: Mutex<BTreeMap<libc::pid_t, Arc<ExitCell>>> = Mutex::new(BTreeMap::new());

/// Takes the [`PROCESSES`] lock (held across a fork until the new pid is registered).
pub fn processes() -> MutexGuard<'static, BTreeMap<libc::pid_t, Arc<ExitCell>>> {
    PROCESSES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes this process the reaper of its orphaned descendants (no-op for PID 1).
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer flag only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reaps what has exited and hands statuses to their cells.
fn reap_and_dispatch() {
    let mut table = processes();
    for child in reap_exited() {
        match (
            table.remove(&child.pid),
            ExitStatus::from_wait_status(child.status),
        ) {
            (Some(cell), Some(status)) => {
                log::debug!("pid {} exited with {}", child.pid, status.code);
                cell.set(status);
            }
            (Some(cell), None) => {
                table.insert(child.pid, cell);
            }
            (None, _) => log::debug!("reaped pid {} (status {:#x})", child.pid, child.status),
        }
    }
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
            // A periodic pass as well: a SIGCHLD that arrives while one is pending merges with it.
            let timeout = libc::timespec {
                tv_sec: 1,
                tv_nsec: 0,
            };
            loop {
                // SAFETY: `set` and `timeout` are initialised; no siginfo is asked for.
                let rc = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) };
                if rc < 0 {
                    let err = io::Error::last_os_error();
                    if !matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                        log::warn!("sigtimedwait: {err}");
                    }
                }
                reap_and_dispatch();
            }
        })
        .map_err(ReaperError::Spawn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_status_codes() {
        // Raw statuses as the kernel encodes them: exit code << 8, or the signal number.
        assert_eq!(
            ExitStatus::from_wait_status(3 << 8).map(|s| s.code),
            Some(3)
        );
        assert_eq!(ExitStatus::from_wait_status(0).map(|s| s.code), Some(0));
        assert_eq!(
            ExitStatus::from_wait_status(libc::SIGKILL).map(|s| s.code),
            Some(137)
        );
        assert_eq!(
            ExitStatus::from_wait_status(libc::SIGTERM | 0x80).map(|s| s.code),
            Some(143)
        );
        // Stopped by SIGSTOP: 0x137f.
        assert_eq!(ExitStatus::from_wait_status(0x137f), None);
    }

    #[test]
    fn exit_cell_wakes_waiters() {
        let cell = Arc::new(ExitCell::default());
        assert_eq!(cell.wait(Duration::from_millis(10)), None);
        let waiter = {
            let cell = cell.clone();
            std::thread::spawn(move || cell.wait(Duration::from_secs(10)))
        };
        let status = ExitStatus {
            code: 7,
            at_unix_nanos: 1,
        };
        cell.set(status);
        cell.set(ExitStatus {
            code: 9,
            at_unix_nanos: 2,
        });
        assert_eq!(waiter.join().expect("waiter"), Some(status));
        assert_eq!(cell.get(), Some(status));
    }

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
