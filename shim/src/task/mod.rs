//! The containerd shim v2 (`containerd-shim-microvm-v1`): one long-lived shim per pod, which
//! runs the pod's VM. See docs/shim.md for how containerd calls it.
//!
//! - [`service`]: `start` (spawn or reuse the pod's shim, print its address), `delete`
//!   (cleanup after a shim that is gone), the daemon's setup.
//! - [`task_service`]: the task API (Create, Start, Kill, Wait, State, Delete, ...) and events.
//! - [`sandbox_vm`]: the pod's VM ([`crate::vm::thread`]) with its checked agent.
//! - [`state_dir`]: the pod's on-disk state (`/run/microvm/<pod-id>`) and crash cleanup.
//! - [`bundle`]: the container's role (sandbox, app, standalone) from its spec's annotations.
//! - [`options`]: the handler's `ConfigPath` from the runtime options.
//! - [`guest_spec`]: an app container's OCI spec rewritten for the guest.
//! - [`share`]: an app container's rootfs and bind sources mounted into the pod's shared folder.
//! - [`exec`]: exec processes of app containers, and the waiter reporting process exits.
//! - [`metrics`]: an app container's cgroup v2 figures as containerd's Stats `Any`.

pub mod bundle;
pub mod exec;
pub mod guest_spec;
pub mod metrics;
pub mod options;
pub mod sandbox_vm;
pub mod service;
pub mod share;
pub mod state_dir;
pub mod task_service;
