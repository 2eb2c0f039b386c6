//! A VM's console log on the host (both backends): where it is, its bound, and its tail for
//! error messages.

use std::path::{Path, PathBuf};

/// The console log a VM started from a spec with `work_dir` writes: a bounded pair,
/// `console.log` and `console.log.1`, of at most [`CONSOLE_LOG_BYTES`] on both backends
/// (`vmm::console_log`).
pub fn console_log_in(work_dir: &Path) -> PathBuf {
    work_dir.join("console.log")
}

/// The bound of a VM's console log pair on the host.
pub const CONSOLE_LOG_BYTES: u64 = vmm::console_log::DEFAULT_CONSOLE_LOG_BYTES;
/// The most of a console's end quoted in an error message or a log line.
pub const CONSOLE_TAIL_BYTES: usize = 4096;

/// The last `lines` of a console log (empty if it cannot be read), for error messages: read
/// from its end, at most [`CONSOLE_TAIL_BYTES`], control characters escaped.
pub fn console_tail(console_log: &Path, lines: usize) -> String {
    vmm::console_log::tail(console_log, CONSOLE_TAIL_BYTES, lines)
}
