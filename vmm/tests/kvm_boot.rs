//! Boots the hello test guest through both entry protocols (needs /dev/kvm and the built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use vmm::VmExit;

#[test]
fn hello_boots_linux64() {
    let (cfg, cap) = config("hello", 1, 64);
    let mut cfg = linux64(cfg);
    cfg.cmdline = "foo=bar".into();
    let exit = run(cfg, &cap);
    let out = cap.text();
    assert_eq!(exit.unwrap(), VmExit::Reset, "console:\n{out}");
    assert!(out.contains("hello from the guest"), "{out}");
    assert!(out.contains("entry: linux64"), "{out}");
    assert!(out.contains("cmdline: foo=bar"), "{out}");
    assert_eq!(result_line(&out), Some("RESULT: PASS linux64"), "{out}");
}

#[test]
fn hello_boots_pvh() {
    let (cfg, cap) = config("hello", 1, 64);
    let mut cfg = pvh(cfg);
    cfg.cmdline = "via=pvh".into();
    let exit = run(cfg, &cap);
    let out = cap.text();
    assert_eq!(exit.unwrap(), VmExit::Reset, "console:\n{out}");
    assert!(out.contains("entry: pvh"), "{out}");
    assert!(out.contains("cmdline: via=pvh"), "{out}");
    assert_eq!(result_line(&out), Some("RESULT: PASS pvh"), "{out}");
}
