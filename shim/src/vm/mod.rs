//! The seam between the host side and a VM backend: one [`GuestSpec`] says what to
//! boot, [`Vm`] is the running VM of either backend (the embedded VMM, the product's default, or
//! [`qemu`] for hosts whose KVM cannot boot a Linux guest), [`GuestVm`] adds what both share (work
//! folder, console log, agent socket, the agent's ready event), and a VM's end is typed
//! ([`EndReason`], [`VmEnd`]) instead of a bool. [`thread`] owns a pod's VM on its own thread.
//! Which backend runs a pod is chosen here too ([`backend`]), from the config and one probe of
//! the host (`host_check`, which knows nothing of this layer).
//!
//! Kept narrow on purpose: boot from a spec, agent socket, shared directory, stop, wait.
//!
//! The folder:
//! - `backend.rs`: [`Backend`], the rule that chooses it ([`choose_backend`]) and a pod's
//!   step 1 ([`choose_pod_backend`]: the host probed once, off the async threads);
//! - `spec.rs`: [`GuestSpec`] and its parts (disks, NICs, the share, the QEMU programs);
//! - `launch.rs`: a spec turned into each backend's config and started;
//! - `running.rs`: [`Vm`], each request dispatched to the backend that runs the guest;
//! - `guest.rs`: [`GuestVm`], the running guest with its files, and its work folder;
//! - `console.rs`: the console log's place, bound and tail;
//! - `end.rs`: how a VM ended ([`EndReason`], [`VmEnd`]);
//! - `error.rs`: [`GuestVmError`];
//! - [`ready`]: the agent's ready event; [`thread`]: a pod's VM on its own thread;
//!   [`process`]: the embedded VMM in a jailed process of its own; [`qemu`]: the QEMU backend.

pub mod backend;
mod console;
mod end;
mod error;
mod guest;
mod launch;
pub mod process;
pub mod qemu;
pub mod ready;
mod running;
mod spec;
pub mod thread;

pub use backend::{
    choose_backend, choose_pod_backend, Backend, BackendChoice, BackendRefusal, PodBackendError,
};
pub use console::{console_log_in, console_tail, CONSOLE_LOG_BYTES, CONSOLE_TAIL_BYTES};
pub use end::{EndReason, VmEnd, UNKNOWN_STATUS};
pub use error::GuestVmError;
pub use guest::{new_work_dir, GuestVm};
pub use launch::KVM_GUEST_CMDLINE;
pub use running::Vm;
pub use spec::{
    DiskBacking, GuestDisk, GuestNic, GuestSpec, QemuPrograms, SharedDir, GUEST_CID, VSOCK_UDS_NAME,
};
