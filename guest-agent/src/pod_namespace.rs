//! The pod's shared PID namespace inside the guest (Kubernetes `shareProcessNamespace`).
//!
//! On a runc node the pod's containers join the pause container's PID namespace. Here the pod
//! is the VM and has no pause process, so the agent makes one on first use: a child cloned
//! into a new PID namespace, where it is PID 1, reaps orphans and otherwise sleeps. Containers
//! whose spec names the namespace [`POD_PID_NAMESPACE`] (the shim writes it for the sandbox's
//! `/proc/<pid>/ns/pid`) join that child's namespace, so they see each other's processes and
//! not the agent's.

use std::io;
use std::path::PathBuf;
use std::sync::Mutex;

use nix::sched::CloneFlags;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

pub use agent_protocol::POD_PID_NAMESPACE;

/// Stack of the holder's first instructions (it runs only `wait` and `sleep`).
const HOLDER_STACK: usize = 64 * 1024;

/// The holder's pid (in the agent's namespace), once it runs.
static HOLDER: Mutex<Option<Pid>> = Mutex::new(None);

/// `/proc/<holder>/ns/pid`, starting the holder if it does not run (first use, or it died).
pub fn pid_namespace_path() -> io::Result<PathBuf> {
    let mut holder = HOLDER.lock().unwrap_or_else(|e| e.into_inner());
    let alive = holder.is_some_and(|pid| {
        // A dead holder was reaped by the agent's reaper: its /proc entry is gone.
        std::path::Path::new(&format!("/proc/{pid}/ns/pid")).exists()
    });
    if !alive {
        let pid = spawn_holder()?;
        log::info!("pod PID namespace: holder pid {pid}");
        *holder = Some(pid);
    }
    let pid = holder.ok_or_else(|| io::Error::other("no pod PID namespace holder"))?;
    Ok(PathBuf::from(format!("/proc/{pid}/ns/pid")))
}

fn spawn_holder() -> io::Result<Pid> {
    let mut stack = vec![0u8; HOLDER_STACK];
    // SAFETY: the child gets its own copy of the address space (no CLONE_VM) and runs only
    // `holder_main`, which calls async-signal-safe functions (wait, sleep) and never returns,
    // so nothing of the parent's threads or locks is used in it. The stack outlives the call
    // in the parent; the child has its own copy of it.
    let pid = unsafe {
        nix::sched::clone(
            Box::new(holder_main),
            &mut stack,
            CloneFlags::CLONE_NEWPID,
            Some(Signal::SIGCHLD as i32),
        )
    }
    .map_err(io::Error::from)?;
    Ok(pid)
}

/// PID 1 of the pod's PID namespace: reaps whatever ends up its child, forever.
fn holder_main() -> isize {
    loop {
        // SAFETY: wait(2) with a null status pointer and sleep(3) have no preconditions.
        unsafe {
            if libc::wait(std::ptr::null_mut()) < 0 {
                libc::sleep(1);
            }
        }
    }
}
