//! No fd or thread leaks over many boots (needs /dev/kvm and the built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use vmm::VmExit;

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map(|d| d.count()).unwrap_or(0)
}

/// 20 boots in a row leave no fds or threads behind (the only test of this binary, so nothing
/// else opens fds or starts threads meanwhile).
#[test]
fn twenty_boots_leak_nothing() {
    // Warm-up: one-time process state (signal handler, KVM module handles) is not a leak.
    let (cfg, cap) = config("hello", 2, 64);
    assert_eq!(run(cfg, &cap).unwrap(), VmExit::Reset);
    let fds = count_dir("/proc/self/fd");
    let threads = count_dir("/proc/self/task");
    for i in 0..20 {
        let (cfg, cap) = config("hello", 2, 64);
        assert_eq!(
            run(cfg, &cap).unwrap(),
            VmExit::Reset,
            "boot {i}: {}",
            cap.text()
        );
    }
    assert_eq!(count_dir("/proc/self/fd"), fds, "fds leaked");
    assert_eq!(count_dir("/proc/self/task"), threads, "threads leaked");
}
