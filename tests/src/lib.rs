//! Test support shared by the integration tests.
//!
//! The host side of the vsock-echo test guest lives in the shim crate (the `microvm` tool's
//! `run-test-guest` uses it too); it is re-exported here under its old name.

pub use shim::test_guest_peer as vsock_peer;

pub mod containerd;
pub mod cri;
pub mod images;
pub mod lifecycle;
pub mod microvm_pods;
pub mod netns;
pub mod pod_net;
