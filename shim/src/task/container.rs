//! The containers one pod's shim serves: the pod's sandbox (its VM, which runs no processes of
//! its own) and the app containers in the VM, each with its init [`Process`] and, for app
//! containers, their exec processes. [`Containers`] is the task service's table of them and of
//! the pod's [`Sandbox`].

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sandbox::Sandbox;
use crate::task::process::Process;

/// A pod created through the Sandbox API (`sandbox_service`), from CreateSandbox until
/// ShutdownSandbox.
#[derive(Debug)]
pub struct ApiPod {
    pub id: String,
    pub pod: crate::sandbox::pod_config::PodConfig,
    /// The shim's config, read at CreateSandbox; taken by StartSandbox.
    pub config: Option<crate::config::Config>,
    pub created_at: std::time::SystemTime,
    /// The pod's life: Created, Running once its VM booted, Exited when the VM ended.
    pub process: Process,
}

/// What a container is.
#[derive(Debug)]
pub enum Kind {
    /// The pod's sandbox: its "process" is the VM.
    Sandbox,
    /// A container in the VM, with its exec processes by exec id.
    App { execs: HashMap<String, Process> },
}

/// A container this shim serves.
#[derive(Debug)]
pub struct Container {
    pub bundle: String,
    pub kind: Kind,
    /// Its init process (the sandbox's: the VM, with the shim's pid).
    pub init: Process,
}

impl Container {
    /// Whether it is an app container (not the sandbox).
    pub fn is_app(&self) -> bool {
        matches!(self.kind, Kind::App { .. })
    }

    /// Its exec processes (none for the sandbox).
    pub fn execs(&self) -> Option<&HashMap<String, Process>> {
        match &self.kind {
            Kind::App { execs } => Some(execs),
            Kind::Sandbox => None,
        }
    }

    /// Its exec processes, to change (none for the sandbox).
    pub fn execs_mut(&mut self) -> Option<&mut HashMap<String, Process>> {
        match &mut self.kind {
            Kind::App { execs } => Some(execs),
            Kind::Sandbox => None,
        }
    }
}

/// The pod's sandbox and containers.
#[derive(Default)]
pub struct Containers {
    pub pod: Option<Arc<Sandbox>>,
    pub map: HashMap<String, Container>,
    /// The pod containerd created through the Sandbox API, until ShutdownSandbox: the shim
    /// stays for it even with no container left.
    pub api_pod: Option<ApiPod>,
}

impl Containers {
    /// Container `id`.
    pub fn get(&self, id: &str) -> Result<&Container> {
        self.map
            .get(id)
            .ok_or_else(|| Error::container_not_found(id))
    }

    /// Container `id`, to change.
    pub fn get_mut(&mut self, id: &str) -> Result<&mut Container> {
        self.map
            .get_mut(id)
            .ok_or_else(|| Error::container_not_found(id))
    }

    /// App container `id` (the sandbox is not one: it has no processes of its own).
    pub fn app(&self, id: &str) -> Result<&Container> {
        let c = self.get(id)?;
        if !c.is_app() {
            return Err(Error::FailedPrecondition(format!(
                "{id} is the pod sandbox (the VM), which runs no processes of its own"
            )));
        }
        Ok(c)
    }

    /// Exec `exec_id` of app container `id`.
    pub fn exec(&self, id: &str, exec_id: &str) -> Result<&Process> {
        self.app(id)?
            .execs()
            .and_then(|e| e.get(exec_id))
            .ok_or_else(|| exec_not_found(id, exec_id))
    }

    /// The process `exec_id` names ("" = the container's init).
    pub fn process(&self, id: &str, exec_id: &str) -> Result<&Process> {
        if exec_id.is_empty() {
            Ok(&self.get(id)?.init)
        } else {
            self.exec(id, exec_id)
        }
    }

    /// The pod's sandbox.
    pub fn sandbox(&self) -> Result<Arc<Sandbox>> {
        self.pod
            .clone()
            .ok_or_else(|| Error::FailedPrecondition("no pod VM".into()))
    }

    /// The guest pids of the pod's app containers, by pid.
    pub fn app_pids(&self) -> HashMap<u32, String> {
        self.map
            .iter()
            .filter(|(_, c)| c.is_app() && c.init.pid != 0)
            .map(|(id, c)| (c.init.pid, id.clone()))
            .collect()
    }
}

/// "exec E of container X not found".
pub fn exec_not_found(id: &str, exec_id: &str) -> Error {
    Error::NotFound(format!("exec {exec_id} of container {id} not found"))
}

/// "container X" or "exec E of container X", for errors.
pub fn process_name(id: &str, exec_id: &str) -> String {
    if exec_id.is_empty() {
        format!("container {id}")
    } else {
        format!("exec {exec_id} of container {id}")
    }
}
