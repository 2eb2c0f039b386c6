//! What the shim's kvm_vmm_process_* tests share: the test guests, the shim binary, the
//! console wait. Each test binary includes it with `mod common;`.

use std::path::Path;
use std::time::{Duration, Instant};

pub use testkit::guests::guest;

/// The shim binary, which runs the VMM process (`__vmm`).
#[allow(dead_code, reason = "kvm_vmm_process_climb is its own VMM process")]
pub fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_containerd-shim-microvm-v1"))
}

/// Waits up to 30 s until the console log `log` holds `needle`; returns the log's text.
#[allow(dead_code, reason = "kvm_vmm_process_climb reads no console")]
pub fn wait_for_console(log: &Path, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(Instant::now() < deadline, "no {needle:?} in {text:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
