//! The guest's hostname: `microvm.hostname=NAME` on the kernel command line, else
//! [`DEFAULT_HOSTNAME`]. (The pod's own hostname arrives later with the sandbox's OCI spec.)

use std::io;

pub const DEFAULT_HOSTNAME: &str = "microvm";

const CMDLINE_KEY: &str = "microvm.hostname=";

#[derive(Debug, thiserror::Error)]
pub enum HostnameError {
    #[error("setting hostname {name:?}: {source}")]
    Set { name: String, source: io::Error },
}

/// The value of `microvm.hostname=` in a kernel command line, if present, non-empty and valid.
pub fn from_cmdline(cmdline: &str) -> Option<&str> {
    cmdline
        .split_ascii_whitespace()
        .filter_map(|word| word.strip_prefix(CMDLINE_KEY))
        .next_back()
        .filter(|name| agent_protocol::is_valid_hostname(name))
}

/// Sets the hostname. Only for PID 1 (callers go through [`super::setup_system`]).
pub fn set(name: &str) -> Result<(), HostnameError> {
    // SAFETY: the pointer and length describe `name`'s bytes, which outlive the call.
    let rc = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(HostnameError::Set {
            name: name.to_owned(),
            source: io::Error::last_os_error(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_last_valid_key() {
        assert_eq!(
            from_cmdline("console=ttyS0 microvm.hostname=pod-a\n"),
            Some("pod-a")
        );
        assert_eq!(
            from_cmdline("microvm.hostname=a microvm.hostname=b quiet"),
            Some("b")
        );
        assert_eq!(from_cmdline("console=ttyS0 reboot=k"), None);
        assert_eq!(from_cmdline("microvm.hostname="), None);
        assert_eq!(from_cmdline("microvm.hostname=bad/name"), None);
        assert_eq!(
            from_cmdline(&format!("microvm.hostname={}", "x".repeat(65))),
            None
        );
    }
}
