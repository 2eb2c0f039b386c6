//! The smp guest starts every AP with INIT-SIPI-SIPI (needs /dev/kvm and the built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use vmm::VmExit;

fn smp(vcpus: u8, memory_mib: u64, entry: fn(vmm::VmConfig) -> vmm::VmConfig) {
    let (cfg, cap) = config("smp", vcpus, memory_mib);
    let exit = run(entry(cfg), &cap);
    let out = cap.text();
    assert_eq!(exit.unwrap(), VmExit::Reset, "console:\n{out}");
    let want = format!("RESULT: PASS cpus={vcpus}");
    assert_eq!(result_line(&out), Some(want.as_str()), "console:\n{out}");
}

#[test]
fn smp_1_vcpu() {
    smp(1, 64, linux64);
}

#[test]
fn smp_2_vcpus() {
    smp(2, 64, linux64);
}

#[test]
fn smp_4_vcpus_512_mib() {
    smp(4, 512, linux64);
}

#[test]
fn smp_2_vcpus_pvh() {
    smp(2, 64, pvh);
}
