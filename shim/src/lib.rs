//! The microvm host side: the containerd shim v2 (`containerd-shim-microvm-v1`) and the
//! `microvm` command-line tool. docs/shim.md describes the layout; in short, a request flows
//! [`task`] (containerd's task API, thin) -> [`sandbox`] (the pod: boot, containers, teardown)
//! -> [`resources`] (host resources, each recording its undo in [`state`]), [`vm`] (the VM
//! backends) and [`agent`] (the guest agent over hybrid vsock, async). [`error`] maps every
//! failure to one ttrpc status; [`config`] is the typed config; [`oci`] reads the OCI spec
//! containerd hands over (below both `task` and `sandbox`).
//!
//! Also here: [`host_check`] (what this host can run), [`artifacts`] (where the built guest
//! kernel, initrd and test guests are found: the `microvm` tool's defaults and the tests'), and
//! [`host_fs`] (file and mount operations that never follow a symlink, under [`resources`] and
//! [`state`]).

pub mod agent;
pub mod artifacts;
pub mod config;
pub mod error;
pub mod host_check;
pub mod host_fs;
pub mod install;
pub mod oci;
pub mod resources;
pub mod sandbox;
pub mod state;
pub mod task;
pub mod vm;
