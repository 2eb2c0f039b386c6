//! The agent's duties as the guest's init (PID 1): leaving the initramfs for a tmpfs root, the
//! base mounts, the pod's shared directory
//! (virtio-fs) and the hostname. (The console
//! on fds 0-2 is the kernel's, opened from the initramfs's /dev/console node before /init runs.)
//! Everything here refuses to run unless the process really is PID 1, so a unit test or a debug
//! run on a host can never mount over the host's `/proc` or rename it.

pub mod hostname;
pub mod mounts;
pub mod switch_root;

/// Whether this process is the system's init.
pub fn is_pid1() -> bool {
    std::process::id() == 1
}

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("not PID 1: refusing to {0}")]
    NotPid1(&'static str),
}

/// Prepares the guest system: base mounts, hostname. Failures of single steps
/// are logged and skipped (a missing cgroup2 must not stop the agent from serving Check); only
/// running outside PID 1 is an error.
pub fn setup_system() -> Result<(), InitError> {
    if !is_pid1() {
        return Err(InitError::NotPid1("set up the system"));
    }
    // Containers pivot_root into their rootfs, which the kernel refuses from the initramfs.
    if switch_root::root_is_initramfs() {
        if let Err(err) = switch_root::switch_to_tmpfs() {
            log::error!("{err}: containers will not start");
        }
    }
    for err in mounts::mount_base() {
        log::warn!("{err}");
    }
    match mounts::mount_shared() {
        Ok(()) => log::info!(
            "pod share {} mounted on {}",
            mounts::SHARED_MOUNT.source,
            mounts::SHARED_MOUNT.target
        ),
        // Boot checks run without a share; containers then fail with the missing rootfs named.
        Err(err) => log::info!("no pod share: {err}"),
    }
    let name = std::fs::read_to_string("/proc/cmdline")
        .ok()
        .and_then(|cmdline| hostname::from_cmdline(&cmdline).map(str::to_owned))
        .unwrap_or_else(|| hostname::DEFAULT_HOSTNAME.to_owned());
    if let Err(err) = hostname::set(&name) {
        log::warn!("{err}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_outside_pid1() {
        assert!(!is_pid1());
        assert!(matches!(setup_system(), Err(InitError::NotPid1(_))));
    }
}
