//! Creating a container ([`Containers::create`]): the spec as the shim sent it gets the pod's
//! block devices, a privileged container's guest devices and the pod's shared volumes, then the
//! agent's rewrite ([`super::spec`]); the build process builds its init, registered with the
//! reaper, waiting for [`Containers::start`], which is here too. A failed create leaves nothing
//! behind.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use libcontainer::container::Container;
use oci_spec::runtime::Spec;

use super::cgroup::cgroup_dir;
use super::console::with_console;
use super::error::{io_err, ContainerError};
use super::spec;
use super::table::{check_id, Containers, Entry, PidNamespace, Proc, StdioRequest};
use crate::build_process::{self, BuildKind, BuildRequest};
use crate::reaper::{self, ExitCell};
use crate::stdio::Streams;

/// libcgroups raises RLIMIT_MEMLOCK to 128 MiB (soft and hard) in libcontainer's intermediate
/// process before it loads a container's device program, and the container's init, forked from
/// there, inherits it (runc's init keeps runc's own; the container's execs keep the agent's).
/// Unless the spec sets RLIMIT_MEMLOCK itself, the init (waiting for Start, its program not yet
/// run) gets the agent's limit back.
fn restore_memlock(pid: libc::pid_t, spec: &Spec) -> Result<(), ContainerError> {
    use oci_spec::runtime::PosixRlimitType;
    let set_by_spec = spec
        .process()
        .as_ref()
        .and_then(|p| p.rlimits().as_ref())
        .is_some_and(|r| r.iter().any(|l| l.typ() == PosixRlimitType::RlimitMemlock));
    if set_by_spec {
        return Ok(());
    }
    let mut own = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one rlimit into `own`, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut own) } != 0 {
        return Err(io_err("reading the agent's RLIMIT_MEMLOCK")(
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: prlimit(2) reads `own`, alive for the call, and writes nothing back. `pid` is the
    // container's init, which the caller holds the reaper's lock for: not reaped, not reused.
    if unsafe { libc::prlimit(pid, libc::RLIMIT_MEMLOCK, &own, std::ptr::null_mut()) } != 0 {
        return Err(io_err("setting the container init's RLIMIT_MEMLOCK")(
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

impl Containers {
    pub fn create(
        &self,
        id: &str,
        spec_json: &[u8],
        stdio: StdioRequest,
        blocks: &[crate::blockdev::BlockRequest],
    ) -> Result<u32, ContainerError> {
        check_id(id)?;
        if self.entry(id).is_ok() {
            return Err(ContainerError::Exists(id.to_owned()));
        }
        let mut value: serde_json::Value =
            serde_json::from_slice(spec_json).map_err(|source| ContainerError::Json {
                what: "OCI spec",
                source,
            })?;
        if !blocks.is_empty() {
            crate::blockdev::apply(
                &mut value,
                blocks,
                Path::new("/sys/block"),
                Path::new("/dev"),
            )
            .map_err(|e| ContainerError::Spec(format!("block device: {e}")))?;
        }
        if crate::privileged::is_privileged(&value) {
            let added = crate::privileged::add_guest_devices(&mut value, Path::new("/dev"))?;
            log::info!("container {id}: privileged: the guest's {added} other devices are given");
        }
        self.volumes.attach(id, &mut value)?;
        let result = self.create_parsed(id, value, stdio);
        if result.is_err() {
            self.volumes.release(id);
        }
        result
    }

    /// [`Containers::create`] from the spec the agent rewrote.
    fn create_parsed(
        &self,
        id: &str,
        value: serde_json::Value,
        stdio: StdioRequest,
    ) -> Result<u32, ContainerError> {
        let mut spec: Spec =
            serde_json::from_value(value).map_err(|source| ContainerError::Json {
                what: "OCI spec",
                source,
            })?;
        log::info!("container {id}: creating");
        spec::rewrite(id, &mut spec, |other| {
            self.entry(other).ok().and_then(|e| e.init.pid())
        })?;
        if let Some(caps) = spec
            .process()
            .as_ref()
            .and_then(|p| p.capabilities().as_ref())
        {
            crate::privileged::check_capabilities(caps, crate::privileged::last_cap()?)?;
        }
        spec::check_rootfs(&spec)?;
        log::debug!("container {id}: rootfs present");
        spec::ensure_cwd(&spec)?;
        let mut process = spec
            .process()
            .clone()
            .ok_or_else(|| ContainerError::Spec("no process".into()))?;
        process.set_terminal(Some(stdio.terminal));
        spec.set_process(Some(process));

        let bundle = self.bundle_root.join(id);
        std::fs::create_dir_all(&bundle).map_err(io_err("creating the bundle"))?;
        std::fs::create_dir_all(&self.state_root).map_err(io_err("creating the state root"))?;
        let result = self.create_in(id, &bundle, &spec, stdio);
        if result.is_err() {
            // A build cut off (or created but not loadable) may have left an init waiting for
            // Start: libcontainer's forced delete kills it and removes its cgroup.
            if let Ok(mut partial) = Container::load(self.state_root.join(id)) {
                let _ = partial.delete(true);
            }
            let _ = std::fs::remove_dir_all(&bundle);
            let _ = std::fs::remove_dir_all(self.state_root.join(id));
            let _ = std::fs::remove_dir(cgroup_dir(id));
        }
        result
    }

    fn create_in(
        &self,
        id: &str,
        bundle: &Path,
        spec: &Spec,
        stdio: StdioRequest,
    ) -> Result<u32, ContainerError> {
        spec.save(bundle.join("config.json"))
            .map_err(|e| ContainerError::Spec(e.to_string()))?;
        let (streams, child) =
            Streams::new(stdio.terminal, stdio.stdin, stdio.stdout, stdio.stderr)?;
        let exit = Arc::new(ExitCell::default());
        let ((container, pid), master) = with_console(
            bundle,
            |console| {
                let request = BuildRequest {
                    id: id.to_owned(),
                    state_root: self.state_root.clone(),
                    console_socket: console.map(Path::to_owned),
                    stdio: child.is_some(),
                    kind: BuildKind::Init {
                        bundle: bundle.to_owned(),
                    },
                };
                let mut table = reaper::processes();
                log::debug!("container {id}: building from {}", bundle.display());
                let pid = build_process::build(&request, child).map_err(|source| {
                    ContainerError::Build {
                        what: "creating the container",
                        source,
                    }
                })?;
                table.insert(pid, exit.clone());
                // Under the reaper's lock: the pid cannot be reaped and reused meanwhile.
                let restored = restore_memlock(pid, spec);
                drop(table);
                restored?;
                let container = Container::load(self.state_root.join(id)).map_err(|source| {
                    ContainerError::Runtime {
                        what: "loading the created container's state",
                        source,
                    }
                })?;
                log::info!("container {id}: created, init pid {pid}");
                Ok((container, pid))
            },
            stdio.terminal,
        )?;
        if let Some(master) = master {
            streams
                .set_pty(master)
                .map_err(io_err("sharing the pty master"))?;
        }
        let init = Arc::new(Proc {
            streams,
            exit,
            pid: Mutex::new(Some(pid)),
            terminal: stdio.terminal,
            pending: Mutex::new(None),
        });
        let entry = Arc::new(Entry {
            runtime: Mutex::new(container),
            init,
            pid_namespace: PidNamespace::of(spec),
            execs: Mutex::new(HashMap::new()),
            bundle: bundle.to_owned(),
            seccomp: spec.linux().as_ref().and_then(|l| l.seccomp().clone()),
            device_rules: spec
                .linux()
                .as_ref()
                .and_then(|l| l.resources().as_ref())
                .and_then(|r| r.devices().clone()),
        });
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), entry);
        u32::try_from(pid).map_err(|_| ContainerError::Spec("negative pid".into()))
    }

    pub fn start(&self, id: &str) -> Result<u32, ContainerError> {
        let entry = self.entry(id)?;
        entry
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .start()
            .map_err(|source| ContainerError::Runtime {
                what: "starting the container",
                source,
            })?;
        let pid = entry.init.pid().unwrap_or(0);
        Ok(u32::try_from(pid).unwrap_or(0))
    }
}
