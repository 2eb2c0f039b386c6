//! What the tests that boot a guest on the embedded VMM directly (tests/tests/kvm_*.rs) share:
//! the guest's serial console kept for inspection, and where the C test guests are.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A serial sink (`vmm::SerialSink`) that keeps everything the guest wrote; clones share it.
#[derive(Clone, Default)]
pub struct Console(Arc<Mutex<Vec<u8>>>);

impl io::Write for Console {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Console {
    /// Everything written so far, without carriage returns.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).replace('\r', "")
    }

    /// Waits until `done` holds of the console text; fails with the console when `timeout`
    /// passes or `ended` says the guest has finished without it.
    pub fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&str) -> bool,
        ended: impl Fn(&str) -> bool,
    ) {
        let end = Instant::now() + timeout;
        loop {
            let text = self.text();
            if done(&text) {
                return;
            }
            assert!(
                !ended(&text) && Instant::now() < end,
                "no {what} on the console within {timeout:?}; console:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A C test guest built by `make -C tests/guests OUT=$PWD/build/guests` (`MICROVM_GUEST_DIR`
/// overrides the folder); fails saying how to build it when it is missing.
pub fn test_guest_elf(name: &str) -> PathBuf {
    let dir = std::env::var_os("MICROVM_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../build/guests"));
    let elf = dir.join(name);
    assert!(
        elf.is_file(),
        "{} is missing: build the test guests with `make -C tests/guests OUT=$PWD/build/guests`",
        elf.display()
    );
    elf
}
