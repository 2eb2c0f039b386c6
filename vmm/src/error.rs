//! The VMM's error type.

use std::path::PathBuf;

/// Why a VM could not be created, or how it ended badly.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The configuration is invalid (vCPUs, memory, vsock...).
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// The VM did not end within the time it was given ([`crate::VmHandle::wait_or_stop`]); it
    /// was stopped.
    #[error("the VM did not end within {0:?}; stopped it")]
    TimedOut(std::time::Duration),
    /// The kernel file is missing, unreadable, or not a loadable ELF.
    #[error("kernel {}: {reason}", path.display())]
    Kernel { path: PathBuf, reason: String },
    /// The initrd is missing, unreadable or does not fit.
    #[error("initrd {}: {reason}", path.display())]
    Initrd { path: PathBuf, reason: String },
    /// Guest memory could not be created or written.
    #[error("guest memory: {0}")]
    Memory(String),
    /// A KVM ioctl failed.
    #[error("{op} failed: {source}")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A host I/O operation failed (eventfds, threads, files).
    #[error("cannot {op}: {source}")]
    Io {
        op: String,
        #[source]
        source: std::io::Error,
    },
    /// A device could not be set up.
    #[error("device setup: {0}")]
    Device(String),
    /// The guest did something that ends the VM: triple fault (KVM_EXIT_SHUTDOWN), an instruction
    /// KVM cannot emulate (KVM_EXIT_INTERNAL_ERROR), a failed VM entry, an unknown exit.
    #[error("vCPU {vcpu}: {reason}")]
    GuestFault { vcpu: u8, reason: String },
    /// A disk slot could not be changed (attach/detach while running).
    #[error("disk slot {index}: {source}")]
    Block {
        index: usize,
        #[source]
        source: vmm_devices::virtio::block::BlockError,
    },
    /// There is no disk slot with this index.
    #[error("no disk slot {index} (the VM has {count})")]
    NoBlockSlot { index: usize, count: usize },
    /// A VFIO device could not be passed through.
    #[error("VFIO: {0}")]
    Vfio(#[from] crate::vfio::VfioError),
    /// The feature is not available in this build.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The VM's threads could not be paused ([`crate::VmHandle::with_paused`]).
    #[error("pausing the VM: {0}")]
    Pause(#[from] crate::pause::PauseError),
    /// Page sharing failed ([`crate::VmHandle::share_pages`]).
    #[error("page sharing: {0}")]
    PageSharing(#[from] crate::page_sharing::PageSharingError),
    /// A VM thread's seccomp filter could not be built or installed ([`crate::jail`]).
    #[error("confining the VM's threads: {0}")]
    Jail(#[from] crate::jail::JailError),
    /// A step of the process jail failed ([`crate::jail::process`]).
    #[error("confining the VMM process: {0}")]
    ProcessJail(#[from] crate::jail::process::ProcessJailError),
    /// An earlier wait already took the VM's result.
    #[error("the VM's result was already taken by an earlier wait")]
    AlreadyWaited,
}

impl VmmError {
    pub(crate) fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
        move |source| VmmError::Kvm { op, source }
    }

    pub(crate) fn io(op: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
        let op = op.into();
        move |source| VmmError::Io { op, source }
    }
}
