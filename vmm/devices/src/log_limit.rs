//! Rate limits for log lines a guest can trigger.
//!
//! A guest that repeats what makes a device log (a bad ring address, a refused feature set, a
//! disk error at an offset it picks) must not flood the host's log. Each such call site gets a
//! [`LineLimit`]: at most `max_lines` lines per `interval`; the lines over that are counted,
//! and the next line let through is preceded by one line saying how many were dropped. The
//! [`limited!`](crate::limited) macro gives a call site its own limit; an embedder's logger
//! can keep one [`Window`] per call site of its own (the shim does, for every line it writes).
//!
//! Hand-written rather than a rate-limiting crate: the part that matters here is the count of
//! suppressed lines, which the token-bucket crates do not keep, and the whole is a counter and
//! a timestamp behind a mutex.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines one call site may log per [`DEFAULT_INTERVAL`].
pub const DEFAULT_LINES: u32 = 10;
/// The window of [`DEFAULT_LINES`].
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// The state of one limited call site: when its window began, the lines let through in it, and
/// the lines dropped since the last one let through.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    start: Option<Instant>,
    count: u32,
    suppressed: u64,
}

impl Window {
    /// A fresh window (nothing logged yet).
    pub const fn new() -> Self {
        Window {
            start: None,
            count: 0,
            suppressed: 0,
        }
    }

    /// Whether a line at `now` may be logged under `max_lines` per `interval`: `Some(n)` with
    /// the number of lines dropped before it (to be reported first), `None` to drop it.
    pub fn admit(&mut self, now: Instant, max_lines: u32, interval: Duration) -> Option<u64> {
        let expired = match self.start {
            None => true,
            Some(start) => now.saturating_duration_since(start) >= interval,
        };
        if expired {
            self.start = Some(now);
            self.count = 0;
        }
        if self.count >= max_lines {
            self.suppressed = self.suppressed.saturating_add(1);
            return None;
        }
        self.count += 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// A rate limit for one call site, usable in a `static`.
#[derive(Debug)]
pub struct LineLimit {
    max_lines: u32,
    interval: Duration,
    window: Mutex<Window>,
}

impl LineLimit {
    /// At most `max_lines` lines per `interval`.
    pub const fn new(max_lines: u32, interval: Duration) -> Self {
        LineLimit {
            max_lines,
            interval,
            window: Mutex::new(Window::new()),
        }
    }

    /// [`DEFAULT_LINES`] per [`DEFAULT_INTERVAL`].
    pub const fn per_site() -> Self {
        Self::new(DEFAULT_LINES, DEFAULT_INTERVAL)
    }

    /// Whether a line may be logged now: `Some(n)` with the lines dropped before it, `None` to
    /// drop it (see [`Window::admit`]).
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    /// [`Self::admit`] at a given time.
    pub fn admit_at(&self, now: Instant) -> Option<u64> {
        self.window.lock().unwrap_or_else(|e| e.into_inner()).admit(
            now,
            self.max_lines,
            self.interval,
        )
    }
}

#[doc(hidden)]
pub use log as __log;

/// `log::log!` for a line the guest can trigger: at most [`DEFAULT_LINES`] per
/// [`DEFAULT_INTERVAL`] from this call site, then one line with the count of those dropped.
///
/// `limited!(log::Level::Warn, "virtio-blk: read at {off}: {e}")`
#[macro_export]
macro_rules! limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMIT: $crate::log_limit::LineLimit = $crate::log_limit::LineLimit::per_site();
        let level = $level;
        if $crate::log_limit::__log::log_enabled!(level) {
            if let Some(dropped) = LIMIT.admit() {
                if dropped > 0 {
                    $crate::log_limit::__log::log!(
                        level,
                        "{dropped} lines like the next were suppressed ({}:{})",
                        file!(),
                        line!()
                    );
                }
                $crate::log_limit::__log::log!(level, $($arg)+);
            }
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_cut_to_the_limit_and_the_drop_is_counted() {
        let limit = LineLimit::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let admitted: Vec<_> = (0..100)
            .map(|i| limit.admit_at(t0 + Duration::from_millis(i)))
            .collect();
        assert_eq!(&admitted[..3], &[Some(0), Some(0), Some(0)]);
        assert!(admitted[3..].iter().all(Option::is_none));
        // The next window lets lines through again, the first one carrying the count.
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(10)), Some(97));
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(11)), Some(0));
    }

    #[test]
    fn windows_are_independent() {
        let t0 = Instant::now();
        let (mut a, mut b) = (Window::new(), Window::new());
        for _ in 0..5 {
            a.admit(t0, 2, Duration::from_secs(1));
        }
        assert_eq!(b.admit(t0, 2, Duration::from_secs(1)), Some(0));
        assert_eq!(
            a.admit(t0 + Duration::from_secs(1), 2, Duration::from_secs(1)),
            Some(3)
        );
    }

    #[test]
    fn the_macro_compiles_for_every_level() {
        for i in 0..50 {
            crate::limited!(log::Level::Warn, "line {i}");
            crate::limited!(log::Level::Error, "line {i}");
        }
    }
}
