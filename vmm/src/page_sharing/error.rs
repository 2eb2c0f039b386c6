//! The errors of page sharing ([`PageSharingError`]) and the helper that wraps an I/O error
//! with what was being done. The files of the folder that can fail report through it; it
//! imports none of them.

use std::path::PathBuf;

/// Errors of page sharing.
#[derive(Debug, thiserror::Error)]
pub enum PageSharingError {
    #[error("template directory {}: {reason}", dir.display())]
    TemplateDir { dir: PathBuf, reason: String },
    #[error("template {name} in {}: {reason}; refused", dir.display())]
    Template {
        dir: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{domain:?} cannot name a page sharing domain")]
    Domain { domain: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not for a VM with VFIO devices: their DMA goes to pinned guest pages")]
    Vfio,
    #[error("page sharing is off for this VM")]
    Off,
    #[error("this VM may not capture a kernel text template: it is a pod's")]
    NoCapture,
    #[error(
        "restoring guest memory at {addr:#x} after a failed mapping failed too: {source}; \
         the VM cannot continue"
    )]
    Restore {
        addr: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Wraps an I/O error as [`PageSharingError::Io`] saying `what` failed.
pub(super) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PageSharingError {
    let what = what.into();
    move |source| PageSharingError::Io { what, source }
}
