//! Test support shared by the integration tests, the benchmark, the demo and
//! `microvm-test-guest` (the C test guests on the embedded VMM).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

pub mod containerd;
pub mod cri;
pub mod guest_console;
pub mod host_cgroup;
pub mod images;
pub mod lifecycle;
pub mod loop_device;
pub mod microvm_pods;
pub mod netns;
pub mod pod_net;
pub mod podresources;
pub mod port_forward;
pub mod vsock_peer;
