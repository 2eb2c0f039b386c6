//! A minimal `log` backend: one line per record on stderr (the console when the agent is PID 1),
//! prefixed `microvm-agent:`. The level comes from `MICROVM_AGENT_LOG` (error, warn, info, debug,
//! trace; default info); as PID 1 the kernel passes `MICROVM_AGENT_LOG=debug` from its command line
//! into the environment.

use std::io::Write;

use log::{Level, LevelFilter, Log, Metadata, Record};

struct ConsoleLogger;

static LOGGER: ConsoleLogger = ConsoleLogger;

impl Log for ConsoleLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        // Libraries (ttrpc logs every server start at info) only get warnings and errors through,
        // so the console carries the agent's own lines, and libcontainer's (how a container was
        // set up is the agent's business).
        let target = metadata.target();
        let ours =
            target.starts_with(env!("CARGO_CRATE_NAME")) || target.starts_with("libcontainer");
        metadata.level() <= log::max_level() && (ours || metadata.level() <= Level::Warn)
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            Level::Error => "error",
            Level::Warn => "warning",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        };
        // One write per line so concurrent threads do not interleave; a console error is ignored
        // (there is nowhere else to report it).
        let line = format!("microvm-agent: {level}: {}\n", record.args());
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// Installs the logger; a second call is a no-op.
pub fn init() {
    let level = std::env::var("MICROVM_AGENT_LOG")
        .ok()
        .and_then(|v| v.parse::<LevelFilter>().ok())
        .unwrap_or(LevelFilter::Info);
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
        log::debug!("log level {level}");
    }
}
