//! The shim's log, guarded against the guest. containerd copies the shim's log FIFO into its
//! own log as it is, line by line, and many of the shim's lines quote what the guest said (an
//! agent's error, the console's last lines, a container id from an event). So every record
//! goes through [`GuardedLogger`] before containerd-shim's `FifoLogger` writes it:
//!
//! - **one line**: newlines, quotes and every other control character are escaped (`\n`,
//!   `\"`, `\u{1b}`), as logrus quotes a value; a guest cannot start a line of its own in
//!   containerd's log or add a `level=` of its own inside `msg="..."`;
//! - **bounded**: a message longer than [`MAX_LINE_BYTES`] is cut, saying how much was cut;
//! - **rate-limited per call site**: at most `vmm::log_limit::DEFAULT_LINES` lines per
//!   `DEFAULT_INTERVAL` from one `log!` call site (file and line); the lines over that are
//!   counted and the next one let through is preceded by one line with the count. A guest that
//!   repeats what makes the shim log (an event, an error) fills no disk.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use log::{Log, Metadata, Record};
use vmm::log_limit::{Window, DEFAULT_INTERVAL, DEFAULT_LINES};

/// The longest message written, in bytes, before the note of what was cut.
pub const MAX_LINE_BYTES: usize = 16 << 10;

/// Wraps `inner` (containerd-shim's FIFO logger): escapes, bounds and rate-limits each record.
pub struct GuardedLogger<L> {
    inner: L,
    max_lines: u32,
    interval: Duration,
    sites: Mutex<HashMap<(&'static str, u32), Window>>,
}

impl<L: Log> GuardedLogger<L> {
    /// `max_lines` per `interval` from each call site.
    pub fn new(inner: L, max_lines: u32, interval: Duration) -> Self {
        GuardedLogger {
            inner,
            max_lines,
            interval,
            sites: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line of the call site `record` comes from may be written now (`Some(n)`: yes,
    /// after saying `n` were dropped).
    fn admit(&self, record: &Record) -> Option<u64> {
        // Every `log!` call site has a static file and line; records without (hand-built) share
        // one window.
        let site = (
            record.file_static().unwrap_or(""),
            record.line().unwrap_or(0),
        );
        self.sites
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(site)
            .or_default()
            .admit(Instant::now(), self.max_lines, self.interval)
    }

    fn write(&self, record: &Record, message: &str) {
        self.inner.log(
            &Record::builder()
                .args(format_args!("{message}"))
                .level(record.level())
                .target(record.target())
                .module_path_static(record.module_path_static())
                .file_static(record.file_static())
                .line(record.line())
                .build(),
        );
    }
}

impl<L: Log> Log for GuardedLogger<L> {
    fn enabled(&self, metadata: &Metadata) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if !self.inner.enabled(record.metadata()) {
            return;
        }
        let Some(dropped) = self.admit(record) else {
            return;
        };
        if dropped > 0 {
            let site = format!(
                "{}:{}",
                record.file_static().unwrap_or("?"),
                record.line().unwrap_or(0)
            );
            self.write(
                record,
                &format!("{dropped} lines like the next were suppressed ({site})"),
            );
        }
        let message = record.args().to_string();
        self.write(record, &one_line(&message, MAX_LINE_BYTES));
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

/// `text` as one line: `\\`, `"` and control characters escaped, at most `max` bytes of that
/// (cut on a char boundary), with what was cut said at the end.
pub fn one_line(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max) + 32);
    let mut taken = 0;
    let mut piece = String::new();
    for c in text.chars() {
        piece.clear();
        match c {
            '\\' => piece.push_str("\\\\"),
            '"' => piece.push_str("\\\""),
            '\n' => piece.push_str("\\n"),
            '\r' => piece.push_str("\\r"),
            '\t' => piece.push_str("\\t"),
            c if c.is_control() => piece.extend(c.escape_unicode()),
            c => piece.push(c),
        }
        if out.len() + piece.len() > max {
            break;
        }
        out.push_str(&piece);
        taken += c.len_utf8();
    }
    if taken < text.len() {
        out.push_str(&format!(" [... {} more bytes cut]", text.len() - taken));
    }
    out
}

/// Installs the guarded FIFO logger of the shim daemon, at the level containerd-shim's own
/// `logger::init` would set (`RUST_LOG`, else `default_level`; at least debug with `debug`).
pub fn init(
    debug: bool,
    default_level: &str,
    _namespace: &str,
    _id: &str,
) -> Result<(), containerd_shim::Error> {
    // The log fifo containerd reads (as containerd_shim::logger::FifoLogger::new opens it),
    // and a second descriptor of it for the VMM's seccomp report: a VM thread that makes a
    // forbidden system call kills the shim, and this is where the line saying so goes.
    let log = std::fs::OpenOptions::new()
        .write(true)
        .open("log")
        .map_err(|e| containerd_shim::Error::Other(format!("failed to init logger: {e}")))?;
    if let Ok(report) = log.try_clone() {
        vmm::jail::report_violations_to(report.into());
    }
    let fifo = containerd_shim::logger::FifoLogger::with_file(log);
    let level = std::env::var(containerd_shim::logger::LOG_ENV)
        .unwrap_or_else(|_| default_level.to_string());
    let level = level
        .parse::<log::LevelFilter>()
        .unwrap_or(log::LevelFilter::Info);
    let level = if debug {
        level.max(log::LevelFilter::Debug)
    } else {
        level
    };
    log::set_max_level(level);
    log::set_boxed_logger(Box::new(GuardedLogger::new(
        fifo,
        DEFAULT_LINES,
        DEFAULT_INTERVAL,
    )))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeps what the guarded logger writes.
    #[derive(Default)]
    struct Capture(Mutex<Vec<String>>);

    impl Log for &Capture {
        fn enabled(&self, _: &Metadata) -> bool {
            true
        }
        fn log(&self, record: &Record) {
            self.0.lock().unwrap().push(record.args().to_string());
        }
        fn flush(&self) {}
    }

    fn record_at<'a>(args: std::fmt::Arguments<'a>, line: u32) -> Record<'a> {
        Record::builder()
            .args(args)
            .level(log::Level::Warn)
            .file_static(Some("shim/src/x.rs"))
            .line(Some(line))
            .build()
    }

    #[test]
    fn a_forged_line_stays_inside_one_escaped_line() {
        let capture = Capture::default();
        let logger = GuardedLogger::new(&capture, 10, Duration::from_secs(10));
        let forged = "oops\ntime=\"2000-01-01T00:00:00Z\" level=error msg=\"forged\"\r\x1b[2J";
        logger.log(&record_at(format_args!("agent said: {forged}"), 1));
        let lines = capture.0.lock().unwrap().clone();
        assert_eq!(
            lines,
            vec![
                "agent said: oops\\ntime=\\\"2000-01-01T00:00:00Z\\\" level=error \
                 msg=\\\"forged\\\"\\r\\u{1b}[2J"
            ]
        );
        assert!(!lines[0].contains(['\n', '\r', '\x1b']));
        // Every quote is escaped: none can end FifoLogger's `msg="..."`.
        assert!(lines[0]
            .match_indices('"')
            .all(|(i, _)| &lines[0][i - 1..i] == "\\"));
    }

    #[test]
    fn a_long_message_is_cut_on_a_char_boundary() {
        let s = "é".repeat(10_000); // 20000 bytes
        let out = one_line(&s, 4097);
        assert!(out.starts_with(&"é".repeat(2048)));
        assert!(
            out.ends_with(" [... 15904 more bytes cut]"),
            "{}",
            &out[4090..]
        );
        assert_eq!(one_line("short", 4096), "short");
        // The bound holds after escaping.
        let out = one_line(&"\n".repeat(10_000), 100);
        assert!(out.starts_with("\\n\\n") && out.len() < 140, "{out}");
    }

    #[test]
    fn a_flood_from_one_site_is_cut_and_counted_others_pass() {
        let capture = Capture::default();
        let logger = GuardedLogger::new(&capture, 3, Duration::from_millis(300));
        for i in 0..1000 {
            logger.log(&record_at(format_args!("event {i}"), 7));
        }
        logger.log(&record_at(format_args!("another site"), 8));
        assert_eq!(
            capture.0.lock().unwrap().clone(),
            vec!["event 0", "event 1", "event 2", "another site"]
        );
        std::thread::sleep(Duration::from_millis(350));
        logger.log(&record_at(format_args!("later"), 7));
        let lines = capture.0.lock().unwrap().clone();
        assert_eq!(
            &lines[4..],
            &[
                "997 lines like the next were suppressed (shim/src/x.rs:7)".to_string(),
                "later".to_string()
            ]
        );
    }
}
