//! The container table: each container's [`Entry`] (its libcontainer handle, its init and execs
//! as [`Proc`]s, and what its execs and updates need from its spec), the lookups the other files
//! of the folder share, and the stream lookup the stdio server attaches through.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agent_protocol::stdio::valid_id;
use libcontainer::container::Container;
use oci_spec::runtime::{LinuxDeviceCgroup, LinuxNamespaceType, LinuxSeccomp, Process, Spec};

use super::error::ContainerError;
use crate::reaper::ExitCell;
use crate::stdio::{StreamLookup, Streams};

/// Which stdio streams the host will attach.
#[derive(Debug, Clone, Copy, Default)]
pub struct StdioRequest {
    pub terminal: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

/// One process: the init or an exec.
pub struct Proc {
    pub streams: Arc<Streams>,
    pub exit: Arc<ExitCell>,
    pub(super) pid: Mutex<Option<libc::pid_t>>,
    pub(super) terminal: bool,
    /// Exec only: the OCI process and its child stdio, until StartExec.
    pub(super) pending: Mutex<Option<(Process, Option<crate::stdio::ChildStdio>)>>,
}

impl Proc {
    pub fn pid(&self) -> Option<libc::pid_t> {
        *self.pid.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether a container's init has a PID namespace of its own. The kernel ends every process of
/// a namespace when its init exits; an init that shares one (the pod's, another container's, the
/// agent's) leaves its children running, holding the container's output open. Those are killed
/// when the init exits, as runc's shim does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PidNamespace {
    Own,
    Shared,
}

impl PidNamespace {
    /// A `pid` entry without a path makes a new namespace; a path joins one; no entry at all
    /// stays in the agent's.
    pub(super) fn of(spec: &Spec) -> Self {
        let own = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().as_ref())
            .is_some_and(|namespaces| {
                namespaces.iter().any(|ns| {
                    ns.typ() == LinuxNamespaceType::Pid
                        && ns.path().as_ref().is_none_or(|p| p.as_os_str().is_empty())
                })
            });
        if own {
            Self::Own
        } else {
            Self::Shared
        }
    }
}

/// One container of the table.
pub(super) struct Entry {
    pub(super) runtime: Mutex<Container>,
    pub(super) init: Arc<Proc>,
    pub(super) pid_namespace: PidNamespace,
    pub(super) execs: Mutex<HashMap<String, Arc<Proc>>>,
    pub(super) bundle: PathBuf,
    /// The container's seccomp filter, for its execs.
    pub(super) seccomp: Option<LinuxSeccomp>,
    /// The container's device rules as created (with the guest's numbers), for its updates.
    pub(super) device_rules: Option<Vec<LinuxDeviceCgroup>>,
}

/// The agent's containers by id; its methods, spread over this folder, are the agent's
/// container calls.
pub struct Containers {
    pub(super) state_root: PathBuf,
    pub(super) bundle_root: PathBuf,
    pub(super) entries: Mutex<HashMap<String, Arc<Entry>>>,
    pub(super) volumes: crate::volumes::Volumes,
}

pub(super) fn check_id(id: &str) -> Result<(), ContainerError> {
    if valid_id(id) {
        Ok(())
    } else {
        Err(ContainerError::BadId(id.to_owned()))
    }
}

impl Containers {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            state_root: state_dir.join("containers"),
            bundle_root: state_dir.join("bundles"),
            entries: Mutex::new(HashMap::new()),
            volumes: crate::volumes::Volumes::new(Path::new(crate::volumes::VOLUMES_ROOT)),
        }
    }

    pub(super) fn entry(&self, id: &str) -> Result<Arc<Entry>, ContainerError> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| ContainerError::NoContainer(id.to_owned()))
    }

    pub(super) fn process(
        &self,
        id: &str,
        exec_id: &str,
    ) -> Result<(Arc<Entry>, Arc<Proc>), ContainerError> {
        let entry = self.entry(id)?;
        if exec_id.is_empty() {
            let init = entry.init.clone();
            return Ok((entry, init));
        }
        let proc = entry
            .execs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(exec_id)
            .cloned()
            .ok_or_else(|| ContainerError::NoExec {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            })?;
        Ok((entry, proc))
    }

    /// The ids of the containers, for the OOM watcher.
    pub fn ids(&self) -> Vec<String> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }
}

impl StreamLookup for Containers {
    fn streams(&self, container_id: &str, exec_id: &str) -> Option<Arc<Streams>> {
        self.process(container_id, exec_id)
            .ok()
            .map(|(_, p)| p.streams.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_init_owns_its_pid_namespace_only_with_a_pid_entry_without_path() {
        let spec = |namespaces: serde_json::Value| -> Spec {
            serde_json::from_value(serde_json::json!({
                "ociVersion": "1.0.2",
                "root": {"path": "/r"},
                "linux": {"namespaces": namespaces},
            }))
            .unwrap()
        };
        let own = spec(serde_json::json!([{"type": "mount"}, {"type": "pid"}]));
        assert_eq!(PidNamespace::of(&own), PidNamespace::Own);
        let pod = spec(serde_json::json!([{"type": "pid", "path": "/proc/7/ns/pid"}]));
        assert_eq!(PidNamespace::of(&pod), PidNamespace::Shared);
        let agents = spec(serde_json::json!([{"type": "mount"}]));
        assert_eq!(PidNamespace::of(&agents), PidNamespace::Shared);
    }
}
