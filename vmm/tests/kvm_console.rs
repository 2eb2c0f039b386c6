//! The serial's file sink is a bounded console log (`vmm::console_log`): a guest flooding COM1
//! keeps the log on the host within its bound, with the newest lines (needs /dev/kvm and the
//! built guests).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

mod kvm_common;
use kvm_common::*;
use vmm::{SerialSink, Vm, VmConfig, VmExit};

#[test]
fn a_serial_flood_keeps_the_console_log_within_its_bound() {
    const BOUND: u64 = 32 << 10;
    const FLOOD: u64 = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("console.log");
    let mut cfg = VmConfig::new(guest("console-flood"));
    cfg.memory_mib = 64;
    cfg.cmdline = format!("flood={FLOOD}");
    cfg.serial = SerialSink::File {
        path: path.clone(),
        max_bytes: BOUND,
    };
    let h = Vm::start(cfg).expect("VM starts");
    let tail = || vmm::console_log::tail(&path, 4096, 3);
    let size = || {
        [path.clone(), vmm::console_log::previous_path(&path)]
            .iter()
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .sum::<u64>()
    };
    let exit = loop {
        assert!(size() <= BOUND, "{} bytes on disk, bound {BOUND}", size());
        if let Some(r) = h.wait_timeout(std::time::Duration::from_millis(20)) {
            break r;
        }
    };
    assert_eq!(
        exit.unwrap(),
        VmExit::Reset,
        "console ends with:\n{}",
        tail()
    );
    assert!(size() <= BOUND, "{} bytes on disk, bound {BOUND}", size());
    let end = tail();
    let done = end
        .lines()
        .find(|l| l.starts_with("flood done "))
        .unwrap_or_else(|| panic!("no `flood done` line in:\n{end}"));
    let written: u64 = done.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(written >= FLOOD, "{done}");
    assert_eq!(result_line(&end), Some("RESULT: PASS flooded"), "{end}");
    // The line before `flood done` is the last numbered one: the newest bytes were kept.
    let lines: u64 = done.split(' ').nth(2).unwrap().parse().unwrap();
    assert!(
        end.contains(&format!("flood {} x", lines - 1)),
        "the last numbered line is not kept:\n{end}"
    );
}
