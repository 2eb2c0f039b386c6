//! The microvm host side: the `microvm` command-line tool, and next the containerd shim v2.
//!
//! Modules: [`host_check`] (what this host can run), [`artifacts`] (where the built guest kernel,
//! initrd and test guests are found).

pub mod agent_client;
pub mod artifacts;
pub mod host_check;
pub mod qemu;
