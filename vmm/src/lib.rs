//! Embeddable KVM microVM monitor.
//!
//! [`Vm::start`] boots a VM from a [`VmConfig`] (an ELF kernel, via the 64-bit Linux or the PVH
//! boot protocol) and returns a [`VmHandle`] to wait for it or stop it. Threads: one per vCPU
//! running KVM_RUN, one device event loop. The guest physical layout is in [`layout`].

pub mod boot;
pub mod boot_files;
pub mod capabilities;
pub mod config;
pub mod console_log;
pub mod cpuid;
pub mod devices;
mod error;
pub mod event_loop;
mod handle;
pub mod jail;
mod kick;
pub mod kvm_vm;
pub mod layout;
pub mod memory;
pub mod mptable;
pub mod msrs;
pub mod page_sharing;
mod pause;
pub mod regs;
mod vcpu;
pub mod vfio;
mod vm;

pub use config::{
    BalloonConfig, BlockBacking, BlockConfig, BootFiles, BootProtocol, NetConfig, SerialSink,
    SharedFsConfig, VfioConfig, VmConfig, VsockConfig,
};
pub use error::VmmError;
pub use handle::VmHandle;
pub use page_sharing::{PageSharingConfig, SharingReport};
pub use pause::PauseError;
pub use vm::Vm;
/// `log::log!` under a per-call-site rate limit ([`log_limit`]).
pub use vmm_devices::limited;
/// Rate limits for log lines a guest can trigger (shared with the embedder).
pub use vmm_devices::log_limit;
/// What the balloon did ([`VmHandle::balloon_stats`]).
pub use vmm_devices::virtio::balloon::BalloonStats;
/// What a disk slot did ([`VmHandle::block_stats`]).
pub use vmm_devices::virtio::block::BlockStats;
/// Opens a tap for a [`NetConfig`] in the calling thread's network namespace.
pub use vmm_devices::virtio::net::{open_tap, TapError};

/// How a VM ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmExit {
    /// The guest reset the machine (i8042 0xFE, or a KVM reset/shutdown system event).
    Reset,
    /// [`VmHandle::stop`] was called (or the handle dropped).
    Stopped,
}
