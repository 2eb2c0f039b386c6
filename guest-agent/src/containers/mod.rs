//! Containers inside the guest, run with youki's `libcontainer` from their OCI spec.
//!
//! State: libcontainer's under `<state>/containers/<id>`, our bundles (the spec as config.json,
//! exec process files) under `<state>/bundles/<id>`. Each container's cgroup is
//! `/sys/fs/cgroup/microvm/<id>` whatever the spec says (the host's cgroup paths mean nothing in
//! the guest). Every process the agent starts is registered with the reaper under its lock (see
//! [`crate::reaper`]), so exit statuses are exact.
//!
//! The folder: [`Containers`], the table, is in `table.rs`; each group of its calls has a file.
//! - `table.rs`: the container table, each container's entry and processes, the lookups.
//! - `create.rs`: create (the spec the shim sent, rewritten, built into a waiting init) and start.
//! - `spec.rs`: the checks and rewrites of a spec before its build.
//! - `exec.rs`: exec processes: add, start, remove.
//! - `process.rs`: one process (init or exec): signal, exit cell, terminal size, stdin.
//! - `console.rs`: receiving a terminal's pty master from libcontainer's init.
//! - `lifecycle.rs`: pause, resume, the init's exit, remove.
//! - `resources.rs`: a container's processes, figures and resource updates.
//! - `cgroup.rs`: where the cgroups are, and reading their figures and the guest's.
//! - `error.rs`: [`ContainerError`].

mod cgroup;
mod console;
mod create;
mod error;
mod exec;
mod lifecycle;
mod process;
mod resources;
mod spec;
mod table;

pub use cgroup::{cgroup_dir, guest_stats, read_stats};
pub use error::ContainerError;
pub use table::{Containers, StdioRequest};
