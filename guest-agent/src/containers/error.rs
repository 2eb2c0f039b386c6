//! What can go wrong with a container or one of its processes ([`ContainerError`]), with the
//! ttrpc code each error answers with, and [`io_err`], the I/O error of a named step.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("invalid id {0:?}")]
    BadId(String),
    #[error("container {0} already exists")]
    Exists(String),
    #[error("no container {0}")]
    NoContainer(String),
    #[error("no exec {exec_id:?} in container {container_id}")]
    NoExec {
        container_id: String,
        exec_id: String,
    },
    #[error("exec {0:?} already exists")]
    ExecExists(String),
    #[error("process {0:?} was already started")]
    AlreadyStarted(String),
    #[error("process {0:?} has not been started")]
    NotStarted(String),
    #[error("process {0:?} is still running")]
    StillRunning(String),
    #[error("invalid {what} JSON: {source}")]
    Json {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("invalid spec: {0}")]
    Spec(String),
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("{0}")]
    Stdio(#[from] crate::stdio::StdioError),
    #[error("{what}: {}", crate::runtime_log::error_chain(.source))]
    Runtime {
        what: &'static str,
        source: libcontainer::error::LibcontainerError,
    },
    /// A failed build of a container or exec (in the build process, see [`crate::build_process`]).
    #[error("{what}: {source}")]
    Build {
        what: &'static str,
        source: crate::build_process::BuildError,
    },
    #[error("updating cgroup: {0}")]
    Cgroup(String),
    #[error("sending signal {signal}: {source}")]
    Signal { signal: u32, source: io::Error },
    #[error("the process has no terminal")]
    NoTerminal,
    #[error("container rootfs {path}: {reason}")]
    Rootfs { path: PathBuf, reason: String },
    #[error("creating the working directory {path} (process.cwd) in the rootfs: {reason}")]
    Cwd { path: PathBuf, reason: String },
    #[error("privileged container: {0}")]
    Privileged(#[from] crate::privileged::PrivilegedError),
    #[error("{0}")]
    Volume(#[from] crate::volumes::VolumeError),
}

impl ContainerError {
    /// The ttrpc code that fits.
    pub fn code(&self) -> ttrpc::Code {
        match self {
            Self::BadId(_) | Self::Json { .. } | Self::Spec(_) | Self::NoTerminal => {
                ttrpc::Code::INVALID_ARGUMENT
            }
            Self::Exists(_) | Self::ExecExists(_) => ttrpc::Code::ALREADY_EXISTS,
            Self::NoContainer(_) | Self::NoExec { .. } => ttrpc::Code::NOT_FOUND,
            Self::AlreadyStarted(_) | Self::NotStarted(_) | Self::StillRunning(_) => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            _ => ttrpc::Code::INTERNAL,
        }
    }
}

pub(super) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ContainerError {
    let what = what.into();
    move |source| ContainerError::Io { what, source }
}
