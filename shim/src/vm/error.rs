//! [`GuestVmError`]: why a guest could not be started or run, on either backend.

use std::path::PathBuf;

use super::qemu::QemuError;
use super::ready::ReadyError;

/// Errors of starting or running a guest.
#[derive(Debug, thiserror::Error)]
pub enum GuestVmError {
    /// The embedded VMM failed.
    #[error(transparent)]
    Vmm(#[from] vmm::VmmError),
    /// The QEMU backend failed.
    #[error(transparent)]
    Qemu(#[from] QemuError),
    /// The work folder could not be made.
    #[error("cannot create the VM's work folder {path}: {source}")]
    WorkDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A NIC's tap fd could not be duplicated for the VMM.
    #[error("cannot duplicate a network card's tap fd: {0}")]
    Tap(std::io::Error),
    /// A disk's file could not be duplicated for the VMM.
    #[error("cannot duplicate a disk's file: {0}")]
    Disk(std::io::Error),
    /// The VMM process failed.
    #[error("the VMM process: {0}")]
    Process(String),
    /// The backend cannot give the guest this.
    #[error("this backend does not support {0}")]
    Unsupported(&'static str),
    /// The memory size does not fit the backend.
    #[error("memory of {0} MiB is out of range for this backend")]
    Memory(u64),
    /// The agent's ready event did not come.
    #[error("{source}; last console lines:\n{tail}")]
    AgentNotReady { source: ReadyError, tail: String },
}
