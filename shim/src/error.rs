//! The shim's errors as containerd sees them: [`Error`] is what a Task RPC fails with, and its
//! one mapping to a ttrpc status (code and message) is [`Error::code`] with `From<Error> for
//! ttrpc::Error`. Messages start with `microvm:` (a config error names its file instead) and say
//! what was being done; the lower modules' errors are kept as sources.

use containerd_shim_protos::ttrpc::{self, Code};

use crate::agent::AgentError;
use crate::config::ConfigError;
use crate::sandbox::SandboxError;

/// Why a Task RPC failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request names something this shim does not serve.
    #[error("{0}")]
    NotFound(String),
    /// The container or exec exists already.
    #[error("{0}")]
    AlreadyExists(String),
    /// The request does not fit where the container or process is in its life.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request itself is wrong.
    #[error("{0}")]
    InvalidArgument(String),
    /// The runtime options or config file cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The pod's sandbox failed (boot, container create, ...).
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// An agent call failed while doing `what`.
    #[error("{what}: {source}")]
    Agent { what: String, source: AgentError },
    /// Something of the shim's own failed.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    /// The ttrpc status code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::NotFound(_) => Code::NOT_FOUND,
            Error::AlreadyExists(_) => Code::ALREADY_EXISTS,
            Error::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            Error::InvalidArgument(_) | Error::Config(_) => Code::INVALID_ARGUMENT,
            Error::Sandbox(e) => e.code(),
            Error::Agent { .. } => Code::UNKNOWN,
            Error::Internal(_) => Code::INTERNAL,
        }
    }

    /// A container this shim does not serve.
    pub fn container_not_found(id: &str) -> Error {
        Error::NotFound(format!("container {id} not found"))
    }

    /// `call` failed while doing `what`.
    pub fn agent(what: impl Into<String>) -> impl FnOnce(AgentError) -> Error {
        let what = what.into();
        move |source| Error::Agent { what, source }
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> Self {
        let message = match &e {
            // The config's own message names its file: "microvm config <path>: ...".
            Error::Config(c) => c.to_string(),
            other => format!("microvm: {other}"),
        };
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), message))
    }
}

/// A Task RPC's result.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    fn status_of(e: Error) -> (Code, String) {
        match ttrpc::Error::from(e) {
            ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_string()),
            other => panic!("not a status: {other:?}"),
        }
    }

    #[test]
    fn each_error_maps_to_one_code_and_a_microvm_message() {
        assert_eq!(
            status_of(Error::container_not_found("c1")),
            (Code::NOT_FOUND, "microvm: container c1 not found".into())
        );
        let agent = Error::agent("starting container c1")(AgentError::BadReply {
            method: "StartContainer",
            reason: "pid 0".into(),
        });
        assert_eq!(
            status_of(agent),
            (
                Code::UNKNOWN,
                "microvm: starting container c1: agent reply to StartContainer: pid 0".into()
            )
        );
        let config = Error::Config(ConfigError::Parse {
            path: "/etc/microvm/config.toml".into(),
            message: "unknown field `x`".into(),
        });
        assert_eq!(
            status_of(config),
            (
                Code::INVALID_ARGUMENT,
                "microvm config /etc/microvm/config.toml: unknown field `x`".into()
            )
        );
    }
}
