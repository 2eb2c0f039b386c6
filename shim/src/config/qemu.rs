//! The config's `[qemu]` table ([`QemuSettings`]) and its defaults: the QEMU binary, where
//! scripts/install-*.sh put vhost-device-vsock and the Rust virtiofsd, and the uid/gid range the
//! QEMU backend's guest-facing processes run in ([`jail_id`]). Facts of the QEMU backend that the
//! config needs, kept here so that the config knows nothing of `vm`; `vm::qemu` re-exports them
//! for its own users.

use std::path::PathBuf;

use serde::Deserialize;

/// Settings of the QEMU backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QemuSettings {
    /// The QEMU binary.
    pub binary: PathBuf,
    /// The vhost-device-vsock binary.
    pub vhost_vsock_binary: PathBuf,
    /// The Rust virtiofsd binary (scripts/install-virtiofsd.sh); QEMU 7.2's C virtiofsd is not
    /// supported.
    pub virtiofsd_binary: PathBuf,
    /// The first id of the uid/gid range the QEMU backend's guest-facing processes (QEMU,
    /// vhost-device-vsock) run as: each pod's are `jail_id_base + its shim's pid`, a range of
    /// [`JAIL_ID_RANGE`] ids that need no passwd entry and that nothing else on the
    /// node may use.
    pub jail_id_base: u32,
}

impl Default for QemuSettings {
    fn default() -> Self {
        QemuSettings {
            binary: PathBuf::from(DEFAULT_QEMU),
            vhost_vsock_binary: default_vhost_vsock_binary(),
            virtiofsd_binary: default_virtiofsd_binary(),
            jail_id_base: DEFAULT_JAIL_ID_BASE,
        }
    }
}

/// The QEMU binary, looked up on PATH.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";

/// The first uid (and gid) of the range the QEMU backend's guest-facing processes run as
/// (`[qemu] jail_id_base`): a process's VMs get `base + its pid` ([`jail_id`]). No passwd entry
/// is needed; nothing else on the node may use the range.
pub const DEFAULT_JAIL_ID_BASE: u32 = 2_000_000_000;

/// How many ids the range holds: Linux's largest pid (`PID_MAX_LIMIT` on 64-bit), so that every
/// shim process (one per pod) gets an id of its own.
pub const JAIL_ID_RANGE: u32 = 1 << 22;

/// The uid and gid of this process's VMs: `base` + this process's pid, so two pods' QEMUs never
/// share an id (one shim process per pod). `None` when the range would pass `u32::MAX - 1`
/// (`(uid_t)-1` means "unchanged" to the kernel) or `base` is 0.
pub fn jail_id(base: u32) -> Option<u32> {
    if base == 0 || base.checked_add(JAIL_ID_RANGE)? == u32::MAX {
        return None;
    }
    Some(base + std::process::id() % JAIL_ID_RANGE)
}

/// The vhost-device-vsock version scripts/install-vhost-device-vsock.sh installs.
pub const VHOST_DEVICE_VSOCK_VERSION: &str = "0.3.0";

/// Where scripts/install-vhost-device-vsock.sh puts the binary (a static PIE: it runs with its
/// vsock folder as its root, `vm::qemu::backend_jail`): `MICROVM_VHOST_VSOCK` if set, else
/// `${MICROVM_CACHE:-/var/cache/microvm}/vhost-device-vsock-0.3.0-static/bin/vhost-device-vsock`.
pub fn default_vhost_vsock_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MICROVM_VHOST_VSOCK").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    cache_dir()
        .join(format!(
            "vhost-device-vsock-{VHOST_DEVICE_VSOCK_VERSION}-static"
        ))
        .join("bin/vhost-device-vsock")
}

/// The virtiofsd version scripts/install-virtiofsd.sh installs: the Rust virtiofsd (crates.io
/// `virtiofsd`), which loads its seccomp filter and drops its capabilities before it starts any
/// thread. QEMU 7.2's C virtiofsd (`/usr/lib/qemu/virtiofsd`) is no longer supported: it starts
/// a thread before its filter that keeps every capability it began with (docs/security.md).
pub const VIRTIOFSD_VERSION: &str = "1.14.0";

/// The cache scripts/install-*.sh install into: `MICROVM_CACHE` if set, else
/// `/var/cache/microvm`.
fn cache_dir() -> PathBuf {
    std::env::var_os("MICROVM_CACHE")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/microvm"))
}

/// Where scripts/install-virtiofsd.sh puts the binary: `MICROVM_VIRTIOFSD` if set, else
/// `${MICROVM_CACHE:-/var/cache/microvm}/virtiofsd-1.14.0/bin/virtiofsd`.
pub fn default_virtiofsd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MICROVM_VIRTIOFSD").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    cache_dir()
        .join(format!("virtiofsd-{VIRTIOFSD_VERSION}"))
        .join("bin/virtiofsd")
}
