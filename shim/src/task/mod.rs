//! The containerd shim v2 (`containerd-shim-microvm-v1`): one long-lived shim per pod, which
//! runs the pod's VM. See docs/shim.md for how containerd calls it.
//!
//! - [`serve`]: the binary's entry point: the bootstrap and our ttrpc server with both
//!   services on the pod's socket.
//! - [`sandbox_service`]: containerd 2.x's Sandbox API (`sandboxer = "shim"`), thin over
//!   [`crate::sandbox`] like the task service.
//! - [`shim`]: `start` (spawn or reuse the pod's shim, print its address), `delete`
//!   (cleanup after a shim that is gone), the daemon's setup.
//! - [`service`]: the task API (Create, Start, Kill, Wait, State, Delete, ...), thin: it
//!   validates, calls the [`crate::sandbox`] or the agent, and maps errors.
//! - [`container`]: the containers this shim serves (the sandbox, app containers) and the
//!   Sandbox API's record of its pod.
//! - [`create`]: Create for each role (sandbox, app container, standalone container).
//! - [`process`]: one process's watched state (Created, Running, Paused, Exited), and the
//!   protobuf timestamps of its times.
//! - [`exec`]: exec processes of app containers.
//! - [`events`]: events to containerd and the watchers that produce them (VM exit, process
//!   exits, OOM kills).
//! - [`bundle`]: the container's role (sandbox, app, standalone) from its spec's annotations.
//! - [`options`]: the handler's `ConfigPath` from the runtime options.
//! - [`metrics`]: an app container's cgroup v2 figures as containerd's Stats `Any`.
//! - [`log_guard`]: the daemon's log, one escaped, bounded line per record, rate-limited per
//!   call site (the shim's lines quote what the guest says).

pub mod bundle;
pub mod container;
pub mod create;
pub mod events;
pub mod exec;
pub mod log_guard;
pub mod metrics;
pub mod options;
pub mod process;
pub mod sandbox_service;
pub mod serve;
pub mod service;
pub mod shim;
