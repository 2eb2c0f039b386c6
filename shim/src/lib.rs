//! The microvm host side: the `microvm` command-line tool, and next the containerd shim v2.
//!
//! Modules: [`host_check`] (what this host can run), [`artifacts`] (where the built guest kernel,
//! initrd and test guests are found), [`vm`] (the seam to a VM backend: the embedded VMM or
//! QEMU), [`agent`] (the guest agent over hybrid vsock, async), [`test_guest_peer`] (the host
//! side of the vsock-echo test guest).

pub mod agent;
pub mod artifacts;
pub mod config;
pub mod host_check;
pub mod task;
pub mod test_guest_peer;
pub mod vm;
