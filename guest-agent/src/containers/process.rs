//! Acting on one process of a container, its init or an exec: signals, its exit cell, its
//! terminal's size, its stdin.

use std::io;
use std::sync::Arc;

use super::error::{io_err, ContainerError};
use super::table::Containers;
use crate::reaper::{self, ExitCell};

impl Containers {
    pub fn signal(
        &self,
        id: &str,
        exec_id: &str,
        signal: u32,
        all: bool,
    ) -> Result<(), ContainerError> {
        let (entry, proc) = self.process(id, exec_id)?;
        let signo = libc::c_int::try_from(signal)
            .ok()
            .filter(|s| (1..=64).contains(s))
            .ok_or_else(|| ContainerError::Spec(format!("no signal {signal}")))?;
        if all && exec_id.is_empty() {
            let sig = nix::sys::signal::Signal::try_from(signo)
                .map_err(|_| ContainerError::Spec(format!("no signal {signal}")))?;
            return entry
                .runtime
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .kill(sig, true)
                .map_err(|source| ContainerError::Runtime {
                    what: "signalling the container",
                    source,
                });
        }
        // Holding the reaper's lock: an unreaped pid cannot be reused under us.
        let _table = reaper::processes();
        if proc.exit.get().is_some() {
            return Ok(());
        }
        let pid = proc
            .pid()
            .ok_or_else(|| ContainerError::NotStarted(exec_id.to_owned()))?;
        // SAFETY: kill(2) on a live (unreaped) child of ours.
        if unsafe { libc::kill(pid, signo) } != 0 {
            return Err(ContainerError::Signal {
                signal,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// The process's exit cell, once it was started.
    pub fn exit_cell(&self, id: &str, exec_id: &str) -> Result<Arc<ExitCell>, ContainerError> {
        let (_, proc) = self.process(id, exec_id)?;
        if proc.pid().is_none() {
            return Err(ContainerError::NotStarted(exec_id.to_owned()));
        }
        Ok(proc.exit.clone())
    }

    pub fn resize(
        &self,
        id: &str,
        exec_id: &str,
        width: u32,
        height: u32,
    ) -> Result<(), ContainerError> {
        let (_, proc) = self.process(id, exec_id)?;
        let clamp = |v: u32| u16::try_from(v).unwrap_or(u16::MAX);
        match proc.streams.resize(clamp(width), clamp(height)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(ContainerError::NoTerminal),
            Err(e) => Err(io_err("resizing the pty")(e)),
        }
    }

    pub fn close_stdin(&self, id: &str, exec_id: &str) -> Result<(), ContainerError> {
        let (_, proc) = self.process(id, exec_id)?;
        proc.streams.close_stdin();
        Ok(())
    }
}
