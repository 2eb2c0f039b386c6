//! Guest faults end the VM promptly with the reason named (needs /dev/kvm and the built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use std::time::{Duration, Instant};
use vmm::VmmError;

const PROMPT: Duration = Duration::from_secs(20);

#[test]
fn triple_fault_is_a_guest_fault() {
    let (cfg, cap) = config("triple-fault", 1, 64);
    let t = Instant::now();
    let err = run(cfg, &cap).unwrap_err();
    assert!(t.elapsed() < PROMPT, "took {:?}", t.elapsed());
    let out = cap.text();
    eprintln!("triple-fault ended with: {err}");
    assert!(result_line(&out).is_none(), "the guest survived: {out}");
    match &err {
        VmmError::GuestFault { vcpu: 0, reason } => {
            assert!(
                reason.contains("triple fault") && reason.contains("KVM_EXIT_SHUTDOWN"),
                "{reason}"
            )
        }
        other => panic!("expected a triple-fault GuestFault, got {other:?}; console:\n{out}"),
    }
}

/// On kvm-pvm `lock cmpxchg16b` cannot be emulated: KVM_EXIT_INTERNAL_ERROR. On hardware KVM it
/// runs and the guest reports `RESULT: FAIL instruction unexpectedly emulated`: then this host is
/// not kvm-pvm and the test says so.
#[test]
fn unemulatable_instruction_is_an_internal_error() {
    let (cfg, cap) = config("emul-fail", 1, 64);
    let t = Instant::now();
    let r = run(cfg, &cap);
    assert!(t.elapsed() < PROMPT, "took {:?}", t.elapsed());
    let out = cap.text();
    eprintln!("emul-fail ended with: {r:?}");
    match r {
        Err(VmmError::GuestFault { vcpu: 0, reason }) => {
            assert!(reason.contains("KVM_EXIT_INTERNAL_ERROR"), "{reason}");
            assert!(out.contains("executing lock cmpxchg16b"), "{out}");
        }
        Ok(_) if out.contains("unexpectedly emulated") => {
            eprintln!("this host's KVM emulated cmpxchg16b: not kvm-pvm; nothing to check");
        }
        other => panic!("unexpected end {other:?}; console:\n{out}"),
    }
}
