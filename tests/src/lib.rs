//! Test support.

pub mod vsock_peer;
