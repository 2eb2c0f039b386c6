//! Shared helpers of the /dev/kvm tests (included with `mod` by each kvm_*.rs file).
#![allow(dead_code)]

use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::{BootProtocol, SerialSink, Vm, VmConfig, VmExit, VmmError};

/// Upper bound for any single guest run.
pub const GUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Serial output captured in memory.
#[derive(Clone, Default)]
pub struct Capture(pub Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Capture {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).replace('\r', "")
    }
}

pub use testkit::guests::guest;

pub fn config(name: &str, vcpus: u8, memory_mib: u64) -> (VmConfig, Capture) {
    let cap = Capture::default();
    let mut cfg = VmConfig::new(guest(name));
    cfg.vcpus = vcpus;
    cfg.memory_mib = memory_mib;
    cfg.serial = SerialSink::Writer(Box::new(cap.clone()));
    (cfg, cap)
}

/// Boots `cfg` and waits (bounded) for the end.
pub fn run(cfg: VmConfig, cap: &Capture) -> Result<VmExit, VmmError> {
    let h = Vm::start(cfg).expect("VM starts");
    match h.wait_timeout(GUEST_TIMEOUT) {
        Some(r) => r,
        None => {
            h.stop();
            panic!(
                "guest did not finish within {GUEST_TIMEOUT:?}; console:\n{}",
                cap.text()
            );
        }
    }
}

/// The guest's RESULT line.
pub fn result_line(out: &str) -> Option<&str> {
    out.lines().rev().find(|l| l.starts_with("RESULT: "))
}

pub fn pvh(mut cfg: VmConfig) -> VmConfig {
    cfg.boot_protocol = BootProtocol::Pvh;
    cfg
}

pub fn linux64(mut cfg: VmConfig) -> VmConfig {
    cfg.boot_protocol = BootProtocol::Linux64;
    cfg
}
