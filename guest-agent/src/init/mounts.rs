//! The base filesystems of the guest: /proc, /sys, /dev (devtmpfs), /run (tmpfs) and the cgroup2
//! hierarchy. The initramfs holds their empty mount points; missing ones are created.

use std::ffi::CString;
use std::io;
use std::path::Path;

/// One mount of the base set.
#[derive(Debug, Clone, Copy)]
pub struct MountSpec {
    pub source: &'static str,
    pub target: &'static str,
    pub fstype: &'static str,
    pub flags: libc::c_ulong,
    pub data: Option<&'static str>,
}

const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

/// In order: later targets may live inside earlier ones (/sys/fs/cgroup inside /sys).
pub const BASE_MOUNTS: &[MountSpec] = &[
    MountSpec {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
    },
    MountSpec {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
    },
    MountSpec {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: libc::MS_NOSUID,
        data: Some("mode=0755"),
    },
    MountSpec {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: Some("mode=0755"),
    },
    MountSpec {
        source: "cgroup2",
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
    },
];

/// The pod's shared directory (virtio-fs), mounted after the base set (it lives in /run). Not
/// noexec: container rootfs live in it. A VM without the device (the shim's boot checks) has no
/// such tag, which is not an error of the guest.
pub const SHARED_MOUNT: MountSpec = MountSpec {
    source: agent_protocol::SHARED_FS_TAG,
    target: agent_protocol::GUEST_SHARED_DIR,
    fstype: "virtiofs",
    flags: libc::MS_NOSUID | libc::MS_NODEV,
    data: None,
};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("creating mount point {target}: {source}")]
    CreateTarget {
        target: &'static str,
        source: io::Error,
    },
    #[error("mounting {fstype} on {target}: {source}")]
    Mount {
        fstype: &'static str,
        target: &'static str,
        source: io::Error,
    },
    #[error("mount argument for {target} contains a NUL byte")]
    Nul { target: &'static str },
}

/// Mounts [`BASE_MOUNTS`] in order and returns the failures (an already mounted target is not
/// one). Only for PID 1: callers go through [`super::setup_system`].
pub fn mount_base() -> Vec<MountError> {
    BASE_MOUNTS
        .iter()
        .filter_map(|spec| mount_one(spec).err())
        .collect()
}

/// Mounts [`SHARED_MOUNT`].
pub fn mount_shared() -> Result<(), MountError> {
    mount_one(&SHARED_MOUNT)
}

fn mount_one(spec: &MountSpec) -> Result<(), MountError> {
    std::fs::create_dir_all(Path::new(spec.target)).map_err(|source| MountError::CreateTarget {
        target: spec.target,
        source,
    })?;
    let nul = |_| MountError::Nul {
        target: spec.target,
    };
    let source = CString::new(spec.source).map_err(nul)?;
    let target = CString::new(spec.target).map_err(nul)?;
    let fstype = CString::new(spec.fstype).map_err(nul)?;
    let data = spec.data.map(CString::new).transpose().map_err(nul)?;
    let data_ptr = data
        .as_ref()
        .map_or(std::ptr::null(), |d| d.as_ptr().cast::<libc::c_void>());
    // SAFETY: all pointers are valid NUL-terminated strings (or null for `data`) that outlive the
    // call; mount(2) does not keep them.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            spec.flags,
            data_ptr,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EBUSY) {
        return Ok(()); // already mounted (e.g. devtmpfs mounted by the kernel)
    }
    Err(MountError::Mount {
        fstype: spec.fstype,
        target: spec.target,
        source: err,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_set_covers_what_the_agent_needs_in_order() {
        let targets: Vec<&str> = BASE_MOUNTS.iter().map(|m| m.target).collect();
        assert_eq!(targets, ["/proc", "/sys", "/dev", "/run", "/sys/fs/cgroup"]);
        // the share lives inside /run, which must be mounted first
        assert!(SHARED_MOUNT.target.starts_with("/run/"));
        for (i, m) in BASE_MOUNTS.iter().enumerate() {
            // a mount inside another must come after it
            for later in &BASE_MOUNTS[i + 1..] {
                assert!(!m.target.starts_with(&format!("{}/", later.target)));
            }
        }
    }
}
