//! Ends the VM: sync, then `reboot(RB_AUTOBOOT)` (LINUX_REBOOT_CMD_RESTART).
//!
//! Why restart and not power-off: neither our VMM nor QEMU `-M microvm` gives the kernel a
//! power-off method (no ACPI in our guests), and without one the kernel turns POWER_OFF into a
//! halt: the vCPUs stop and the VM never exits. A restart does end the VM on both:
//! - our VMM: the kernel resets through the i8042 (`reboot=k`, 0xFE to port 0x64), which the VMM
//!   treats as a clean VM exit;
//! - QEMU: with `reboot=t` (triple fault; needed on `-M microvm`) and `-no-reboot`, QEMU exits on
//!   the reset instead of rebooting.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum PowerError {
    #[error("not PID 1: refusing to reboot")]
    NotPid1,
    #[error("reboot(RB_AUTOBOOT): {0}")]
    Reboot(io::Error),
}

/// Syncs filesystems and resets the VM. Returns only on failure.
pub fn end_vm() -> PowerError {
    if !crate::init::is_pid1() {
        return PowerError::NotPid1;
    }
    // SAFETY: sync has no preconditions; reboot with a valid command only affects this VM (we are
    // its init, checked above).
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
    PowerError::Reboot(io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_outside_pid1() {
        assert!(matches!(end_vm(), PowerError::NotPid1));
    }
}
