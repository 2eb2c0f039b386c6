//! A container's exec processes: added with their OCI process ([`Containers::add_exec`]), built
//! in the container by the build process with the container's seccomp filter
//! ([`Containers::start_exec`]), and forgotten once they exited or never started.

use std::path::Path;
use std::sync::{Arc, Mutex};

use oci_spec::runtime::Process;

use super::console::with_console;
use super::error::{io_err, ContainerError};
use super::table::{check_id, Containers, Proc, StdioRequest};
use crate::build_process::{self, BuildKind, BuildRequest};
use crate::executor::ExecSeccomp;
use crate::reaper::{self, ExitCell};
use crate::stdio::Streams;

impl Containers {
    pub fn add_exec(
        &self,
        id: &str,
        exec_id: &str,
        process_json: &[u8],
        stdio: StdioRequest,
    ) -> Result<(), ContainerError> {
        check_id(exec_id)?;
        let entry = self.entry(id)?;
        let mut process: Process =
            serde_json::from_slice(process_json).map_err(|source| ContainerError::Json {
                what: "OCI process",
                source,
            })?;
        process.set_terminal(Some(stdio.terminal));
        let mut execs = entry.execs.lock().unwrap_or_else(|e| e.into_inner());
        if execs.contains_key(exec_id) {
            return Err(ContainerError::ExecExists(exec_id.to_owned()));
        }
        let (streams, child) =
            Streams::new(stdio.terminal, stdio.stdin, stdio.stdout, stdio.stderr)?;
        execs.insert(
            exec_id.to_owned(),
            Arc::new(Proc {
                streams,
                exit: Arc::new(ExitCell::default()),
                pid: Mutex::new(None),
                terminal: stdio.terminal,
                pending: Mutex::new(Some((process, child))),
            }),
        );
        Ok(())
    }

    pub fn start_exec(&self, id: &str, exec_id: &str) -> Result<u32, ContainerError> {
        check_id(exec_id)?;
        let (entry, proc) = self.process(id, exec_id)?;
        let (process, child) = proc
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| ContainerError::AlreadyStarted(exec_id.to_owned()))?;
        let forget = || {
            // A failed exec is forgotten, so that the shim can report it and retry cleanly.
            entry
                .execs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(exec_id);
        };
        let (process, seccomp) = ExecSeccomp::plan(entry.seccomp.as_ref(), process)
            .map_err(|e| ContainerError::Spec(e.to_string()))
            .inspect_err(|_| forget())?;
        let process_path = entry.bundle.join(format!("exec-{exec_id}.json"));
        let text = serde_json::to_vec(&process).map_err(|source| ContainerError::Json {
            what: "OCI process",
            source,
        })?;
        std::fs::write(&process_path, text).map_err(io_err("writing the exec process"))?;
        let result = with_console(
            &entry.bundle,
            |console| {
                let request = BuildRequest {
                    id: id.to_owned(),
                    state_root: self.state_root.clone(),
                    console_socket: console.map(Path::to_owned),
                    stdio: child.is_some(),
                    kind: BuildKind::Exec {
                        process: process_path.clone(),
                        seccomp: seccomp.map(Box::new),
                    },
                };
                let mut table = reaper::processes();
                let pid = build_process::build(&request, child).map_err(|source| {
                    ContainerError::Build {
                        what: "starting the exec process",
                        source,
                    }
                })?;
                table.insert(pid, proc.exit.clone());
                *proc.pid.lock().unwrap_or_else(|e| e.into_inner()) = Some(pid);
                Ok(pid)
            },
            proc.terminal,
        );
        let _ = std::fs::remove_file(&process_path);
        let (pid, master) = result.inspect_err(|_| forget())?;
        if let Some(master) = master {
            proc.streams
                .set_pty(master)
                .map_err(io_err("sharing the pty master"))?;
        }
        Ok(u32::try_from(pid).unwrap_or(0))
    }

    /// Forgets exec `exec_id` of container `id` once it has exited or if it never started.
    pub fn remove_exec(&self, id: &str, exec_id: &str) -> Result<(), ContainerError> {
        check_id(exec_id)?;
        let (entry, proc) = self.process(id, exec_id)?;
        let started = proc.pid().is_some();
        if started && proc.exit.get().is_none() {
            return Err(ContainerError::StillRunning(exec_id.to_owned()));
        }
        // A never-started exec still holds its stdio: close stdin so that nothing waits on it.
        proc.streams.close_stdin();
        entry
            .execs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(exec_id);
        Ok(())
    }
}
