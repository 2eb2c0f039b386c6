//! How a VM ended, typed: why ([`EndReason`]), the status its task reports, and when
//! ([`VmEnd`]).

use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::SystemTime;

/// Why a VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    /// Stopped because the host asked (sandbox Kill, Delete, a failed create).
    Stopped,
    /// The guest reset or powered off by itself (reboot, a panic with `panic=-1`, the agent's
    /// Shutdown); under QEMU that is QEMU exiting 0 (`-no-reboot`).
    GuestReset,
    /// The backend process ended by itself with this status (QEMU failed or was killed).
    BackendExited(ExitStatus),
    /// Watching the VM failed; it was stopped.
    Lost(String),
}

impl EndReason {
    /// The exit status a VM that ended this way reports when nobody asked for one: QEMU's own
    /// (its code, or 128 + the signal that killed it); 255 where there is no process status
    /// (a guest reset, a lost VM), as for a process that ended without one.
    pub fn status(&self) -> u32 {
        match self {
            EndReason::BackendExited(s) => match (s.code(), s.signal()) {
                (Some(code), _) => u32::try_from(code).unwrap_or(UNKNOWN_STATUS),
                (None, Some(sig)) => 128u32.saturating_add(u32::try_from(sig).unwrap_or(0)),
                (None, None) => UNKNOWN_STATUS,
            },
            EndReason::Stopped | EndReason::GuestReset | EndReason::Lost(_) => UNKNOWN_STATUS,
        }
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::Stopped => f.write_str("stopped by the host"),
            EndReason::GuestReset => f.write_str("the guest reset or powered off"),
            EndReason::BackendExited(s) => write!(f, "the VM process exited ({s})"),
            EndReason::Lost(e) => write!(f, "lost: {e}"),
        }
    }
}

/// The status reported for an end without a process status of its own.
pub const UNKNOWN_STATUS: u32 = 255;

/// How a VM ended: why, the status its task reports (128 + the signal for a Kill, else
/// [`EndReason::status`]), and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmEnd {
    pub reason: EndReason,
    pub status: u32,
    pub at: SystemTime,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_reports_the_real_status_or_255() {
        assert_eq!(
            EndReason::BackendExited(ExitStatus::from_raw(1 << 8)).status(),
            1
        );
        // Killed by SIGKILL (raw wait status 9): 128 + 9.
        assert_eq!(
            EndReason::BackendExited(ExitStatus::from_raw(9)).status(),
            137
        );
        assert_eq!(EndReason::GuestReset.status(), 255);
        assert_eq!(EndReason::Lost("x".into()).status(), 255);
    }
}
