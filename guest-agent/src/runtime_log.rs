//! libcontainer's own account of a failure, and error chains in full.
//!
//! A container's init (and an exec's process) is a clone of the build process
//! ([`crate::build_process`]). When it fails, it reports to libcontainer only its error's outer
//! message (`failed to prepare rootfs`, `failed to unix syscall`): the cause, with the value at
//! fault (the mount, the errno), libcontainer logs with `tracing` in the clone just before. The
//! build process installs a `tracing` subscriber that, while the container or exec is being built
//! ([`capture`]), writes libcontainer's error events to a pipe it reads afterwards and sends to the
//! agent with the error. The clone inherits the subscriber, the thread-local naming the pipe (a
//! clone copies the calling thread) and the pipe itself (until it execs: close-on-exec). Outside
//! a capture, and on every other thread, events go nowhere.

use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata};

/// Bounds on what one capture keeps: bytes read, lines, bytes per line.
const MAX_CAPTURE_BYTES: u64 = 64 * 1024;
const MAX_LINES: usize = 12;
const MAX_LINE_BYTES: usize = 1000;
/// Sources followed at most in [`error_chain`].
const MAX_CHAIN: usize = 16;

thread_local! {
    /// The write end of the capturing pipe of this thread (and of its clones), or -1.
    static SINK: Cell<RawFd> = const { Cell::new(-1) };
}

/// Writes the error events of a capturing thread to its pipe.
struct ErrorEvents;

/// One event as a line: its message, then its other fields as `name=value`.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

impl tracing::Subscriber for ErrorEvents {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        // Asked again at each event (`enabled`): a capture is on only now and then.
        if *meta.level() == Level::ERROR {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        *meta.level() == Level::ERROR && SINK.with(Cell::get) >= 0
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::ERROR)
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let fd = SINK.with(Cell::get);
        if fd < 0 {
            return;
        }
        let mut line = Line::default();
        event.record(&mut line);
        let mut text = format!("{}{}", line.message, line.fields).replace('\n', " ");
        truncate(&mut text, MAX_LINE_BYTES);
        text.push('\n');
        // SAFETY: write(2) of a buffer valid for its length to the capture's pipe, which is
        // non-blocking: a full pipe loses the line rather than stopping the process.
        let _ = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

fn truncate(text: &mut String, max: usize) {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
}

/// Installs the subscriber (once, at start; later calls change nothing).
pub fn install() {
    let _ = tracing::subscriber::set_global_default(ErrorEvents);
}

/// Runs `f` (a libcontainer build on this thread) and returns what libcontainer logged as
/// errors meanwhile, here and in the processes it cloned: distinct lines, bounded.
pub fn capture<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    let mut fds = [-1 as RawFd; 2];
    // SAFETY: pipe2(2) writes two fds into the array on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return (f(), Vec::new());
    }
    // SAFETY: pipe2 returned two fresh fds that nothing else owns.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    SINK.with(|s| s.set(write.as_raw_fd()));
    let out = f();
    SINK.with(|s| s.set(-1));
    drop(write);
    let mut bytes = Vec::new();
    // Non-blocking: what the clones wrote before reporting is there; a clone still alive (a
    // successful build's init, waiting for Start) keeps its end open until it execs.
    let _ = std::fs::File::from(read)
        .take(MAX_CAPTURE_BYTES)
        .read_to_end(&mut bytes);
    (out, distinct_lines(&String::from_utf8_lossy(&bytes)))
}

/// The beginnings of libcontainer's error events that only repeat, on the way out, the outer
/// message the error already carries.
const RE_REPORTS: &[&str] = &[
    "failed to initialize container process:",
    "failed to wait for init ready:",
    "failed to run container process",
];

fn distinct_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let fresh = |l: &&str| !l.is_empty() && !RE_REPORTS.iter().any(|r| l.starts_with(r));
    for line in text.lines().map(str::trim).filter(fresh) {
        if !lines.iter().any(|l| l == line) && lines.len() < MAX_LINES {
            lines.push(line.to_string());
        }
    }
    lines
}

/// `err` and each of its sources, `: `-separated, skipping a source whose words the chain
/// already holds (transparent wrappers repeat them).
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut next = err.source();
    for _ in 0..MAX_CHAIN {
        let Some(e) = next else { break };
        let text = e.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = e.source();
    }
    out
}

/// What [`capture`] found, for an error message: empty, or `; libcontainer: a; b`.
pub fn describe(events: &[String]) -> String {
    if events.is_empty() {
        String::new()
    } else {
        format!("; libcontainer: {}", events.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Inner {
        #[error("mount {0:?} failed")]
        Mount(String, #[source] std::io::Error),
    }

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("failed to prepare rootfs")]
        Rootfs(#[source] Inner),
        #[error(transparent)]
        Transparent(Inner),
    }

    #[test]
    fn the_chain_names_every_source_once() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOTDIR);
        let err = Outer::Rootfs(Inner::Mount("/bin".into(), io()));
        let chain = error_chain(&err);
        assert!(chain.starts_with("failed to prepare rootfs: mount \"/bin\" failed: "));
        assert!(chain.contains("Not a directory"), "{chain}");
        let err = Outer::Transparent(Inner::Mount("/x".into(), io()));
        let chain = error_chain(&err);
        assert_eq!(chain.matches("mount \"/x\" failed").count(), 1, "{chain}");
    }

    #[test]
    fn a_capture_collects_error_events_of_its_thread_only() {
        install();
        let ((), lines) = capture(|| {
            tracing::error!(path = "/bin", "failed to mount");
            tracing::error!(path = "/bin", "failed to mount");
            tracing::warn!("not an error");
            std::thread::spawn(|| tracing::error!("another thread"))
                .join()
                .unwrap();
        });
        assert_eq!(lines, vec!["failed to mount path=\"/bin\"".to_string()]);
        let ((), lines) = capture(|| {
            tracing::error!("failed to initialize container process: failed to prepare rootfs");
        });
        assert!(lines.is_empty(), "a re-report is left out: {lines:?}");
        tracing::error!("outside any capture");
        let ((), lines) = capture(|| ());
        assert!(lines.is_empty(), "{lines:?}");
        assert_eq!(describe(&[]), "");
        assert_eq!(describe(&["a".into(), "b".into()]), "; libcontainer: a; b");
    }

    #[test]
    fn long_lines_are_cut_at_a_char_boundary() {
        let mut s = "é".repeat(800);
        truncate(&mut s, MAX_LINE_BYTES);
        assert!(s.len() <= MAX_LINE_BYTES + '…'.len_utf8());
        assert!(s.ends_with('…'));
    }
}
