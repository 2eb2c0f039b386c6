//! A container once it runs: pause and resume, what its init leaves when it exits, and its
//! removal (its libcontainer state, bundle and volumes).

use super::error::ContainerError;
use super::table::{Containers, PidNamespace};

impl Containers {
    pub fn pause(&self, id: &str) -> Result<(), ContainerError> {
        self.entry(id)?
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pause()
            .map_err(|source| ContainerError::Runtime {
                what: "pausing",
                source,
            })
    }

    pub fn resume(&self, id: &str) -> Result<(), ContainerError> {
        self.entry(id)?
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .resume()
            .map_err(|source| ContainerError::Runtime {
                what: "resuming",
                source,
            })
    }

    /// Container `id`'s init has exited (its exit was reaped). If it shared its PID namespace,
    /// what it left running in the container is killed, so that the container's output streams
    /// end and nothing outlives it.
    pub fn init_exited(&self, id: &str) {
        let Ok(entry) = self.entry(id) else {
            return;
        };
        if entry.pid_namespace == PidNamespace::Own {
            return;
        }
        let killed = entry
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kill(nix::sys::signal::Signal::SIGKILL, true);
        match killed {
            Ok(()) => log::info!(
                "container {id}: its init shared a PID namespace and exited; the processes it left \
                 were killed"
            ),
            Err(e) => log::warn!("container {id}: killing what its init left running: {e}"),
        }
    }

    pub fn remove(&self, id: &str) -> Result<(), ContainerError> {
        let entry = self.entry(id)?;
        entry
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .delete(true)
            .map_err(|source| ContainerError::Runtime {
                what: "removing the container",
                source,
            })?;
        let _ = std::fs::remove_dir_all(&entry.bundle);
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        self.volumes.release(id);
        Ok(())
    }
}
