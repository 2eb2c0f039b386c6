//! What a QEMU VM boots and how ([`QemuConfig`]), checked before anything starts.

use std::fs::File;
use std::os::fd::{OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::qemu::{default_virtiofsd_binary, jail_id, DEFAULT_JAIL_ID_BASE, DEFAULT_QEMU};

use super::error::QemuError;

/// Which accelerator QEMU uses: what `vm::backend::choose_backend` decided for this host
/// (`vm::backend::qemu_accel_for`), passed down with the VM so that the backend never probes
/// the host itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// `-accel kvm -cpu host`.
    Kvm,
    /// `-accel tcg`: software emulation, works everywhere.
    Tcg,
}

/// What to boot and how. [`QemuConfig::new`] fills in the defaults.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// Uncompressed ELF `vmlinux` (booted through its PVH note) or a bzImage.
    pub kernel: PathBuf,
    /// The initramfs (the agent as `/init`).
    pub initrd: PathBuf,
    /// vCPUs, 1..=255.
    pub vcpus: u32,
    /// Guest memory in MiB, 16..=1 TiB.
    pub memory_mib: u32,
    /// Appended to the kernel command line after ours.
    pub cmdline_extra: String,
    /// Default `qemu-system-x86_64` (looked up on PATH).
    pub qemu_binary: PathBuf,
    /// The `vhost-device-vsock` binary (scripts/install-vhost-device-vsock.sh prints its path).
    pub vhost_vsock_binary: PathBuf,
    /// Where the sockets and logs live; created if missing. One VM per work dir.
    pub work_dir: PathBuf,
    /// The guest's vsock CID (default 3).
    pub guest_cid: u32,
    /// Default [`Accel::Kvm`]; the shim passes what `vm::backend::choose_backend` decided.
    pub accel: Accel,
    /// Where the guest's serial console goes (with `<path>.1`, a bounded pair:
    /// `vmm::console_log`); kept after the VM ends. `None`: a file in the work dir, removed
    /// with the VM.
    pub console_log: Option<PathBuf>,
    /// The bound of the console log pair in bytes (default
    /// `vmm::console_log::DEFAULT_CONSOLE_LOG_BYTES`).
    pub console_log_bytes: u64,
    /// How long [`QemuVm::start`] waits for the guest's first console output (default 60 s).
    pub start_timeout: Duration,
    /// A host directory exported to the guest over virtio-fs (served by `virtiofsd`).
    pub shared_fs: Option<QemuSharedFs>,
    /// The Rust virtiofsd binary (default `config::qemu::default_virtiofsd_binary`:
    /// scripts/install-virtiofsd.sh installs it). QEMU 7.2's C virtiofsd takes other options
    /// and is not supported.
    pub virtiofsd_binary: PathBuf,
    /// Network cards, in order (eth0 first).
    pub nics: Vec<QemuNic>,
    /// virtio-blk disks, in order (vda first).
    pub disks: Vec<QemuDisk>,
    /// A virtio-balloon with free page reporting (`free-page-reporting=on`): QEMU drops the
    /// pages the guest reports free (docs/virtio-balloon.md).
    pub free_page_reporting: bool,
    /// The uid and gid QEMU and vhost-device-vsock run as once set up (QEMU's `-runas`, after it
    /// opened everything; vhost-device-vsock from its start). Never 0. Default:
    /// [`jail_id`] of [`DEFAULT_JAIL_ID_BASE`].
    pub jail_id: u32,
    /// The binary run as the VM's init (`<binary> __pod-init`, [`super::init`]): PID 1 of the
    /// PID namespace the VM's processes run in, which dies with the process that started the
    /// VM and takes them all with it. Default: the running binary (the shim and the `microvm`
    /// tool answer `__pod-init`); another program embedding the backend names the shim's.
    pub init_binary: PathBuf,
}

/// A virtio-blk disk on a host file or block device the caller opened; QEMU gets a copy as fd
/// [`disk_fd`] (`-add-fd`, then `-blockdev ...,filename=/dev/fdset/N`), so it opens no host path.
#[derive(Debug, Clone)]
pub struct QemuDisk {
    /// The serial the guest reads (at most 20 bytes, no commas).
    pub serial: String,
    /// Opened read-write, or read-only when `read_only` (QEMU's fdset hands out an fd only to
    /// an open with the same access mode).
    pub file: Arc<File>,
    pub read_only: bool,
}

/// At most this many disks.
pub const MAX_DISKS: usize = 16;

/// The fd number QEMU finds disk `i` at, after the NICs' range.
pub fn disk_fd(i: usize) -> RawFd {
    NIC_FD_BASE + (MAX_NICS + i) as RawFd
}

/// A network card: a virtio-net device on a tap the caller opened in the pod netns.
#[derive(Debug, Clone)]
pub struct QemuNic {
    /// The tap (opened with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`); QEMU gets a copy as fd
    /// [`NIC_FD_BASE`] + its index (`-netdev tap,fd=`).
    pub tap: Arc<OwnedFd>,
    /// The guest NIC's MAC.
    pub mac: [u8; 6],
    /// The guest NIC's MTU (virtio-net's `host_mtu`).
    pub mtu: u16,
}

/// The fd number QEMU finds its first NIC's tap at (then one more per NIC): above the few fds
/// QEMU has open when it parses `-netdev`.
pub const NIC_FD_BASE: RawFd = 100;

/// At most this many NICs.
pub const MAX_NICS: usize = 8;

/// The fd number QEMU finds its end of the console socket at (`-chardev socket,fd=`), after
/// the disks' range.
pub const CONSOLE_FD: RawFd = NIC_FD_BASE + (MAX_NICS + MAX_DISKS) as RawFd;

/// A directory the guest mounts with `mount -t virtiofs <tag> <dir>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuSharedFs {
    /// The virtio-fs tag.
    pub tag: String,
    /// The host directory served.
    pub host_dir: PathBuf,
}

impl QemuConfig {
    /// A config with the defaults: 1 vCPU, 256 MiB, CID 3, [`Accel::Kvm`].
    #[expect(
        clippy::expect_used,
        reason = "jail_id(DEFAULT_JAIL_ID_BASE) is Some: qemu::config::tests checks it"
    )]
    pub fn new(
        kernel: impl Into<PathBuf>,
        initrd: impl Into<PathBuf>,
        vhost_vsock_binary: impl Into<PathBuf>,
        work_dir: impl Into<PathBuf>,
    ) -> Self {
        QemuConfig {
            kernel: kernel.into(),
            initrd: initrd.into(),
            vcpus: 1,
            memory_mib: 256,
            cmdline_extra: String::new(),
            qemu_binary: PathBuf::from(DEFAULT_QEMU),
            vhost_vsock_binary: vhost_vsock_binary.into(),
            work_dir: work_dir.into(),
            guest_cid: 3,
            accel: Accel::Kvm,
            console_log: None,
            console_log_bytes: vmm::console_log::DEFAULT_CONSOLE_LOG_BYTES,
            start_timeout: Duration::from_secs(60),
            shared_fs: None,
            nics: Vec::new(),
            disks: Vec::new(),
            free_page_reporting: false,
            virtiofsd_binary: default_virtiofsd_binary(),
            jail_id: jail_id(DEFAULT_JAIL_ID_BASE).expect("the default jail id range fits"),
            init_binary: PathBuf::from(super::init::DEFAULT_BINARY),
        }
    }

    pub(super) fn validate(&self) -> Result<(), QemuError> {
        if self.jail_id == 0 || self.jail_id == u32::MAX {
            return Err(QemuError::InvalidConfig(format!(
                "jail_id must be neither 0 (root) nor {}, got {}",
                u32::MAX,
                self.jail_id
            )));
        }
        if self.nics.len() > MAX_NICS {
            return Err(QemuError::InvalidConfig(format!(
                "{} network cards, at most {MAX_NICS}",
                self.nics.len()
            )));
        }
        if self.disks.len() > MAX_DISKS {
            return Err(QemuError::InvalidConfig(format!(
                "{} disks, at most {MAX_DISKS}",
                self.disks.len()
            )));
        }
        if let Some(d) = self.disks.iter().find(|d| {
            d.serial.is_empty()
                || d.serial.len() > 20
                || !d
                    .serial
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        }) {
            return Err(QemuError::InvalidConfig(format!(
                "disk serial {:?}: 1 to 20 letters, digits or '-'",
                d.serial
            )));
        }
        if !(1..=255).contains(&self.vcpus) {
            return Err(QemuError::InvalidConfig(format!(
                "vcpus must be 1..=255, got {}",
                self.vcpus
            )));
        }
        if !(16..=1 << 20).contains(&self.memory_mib) {
            return Err(QemuError::InvalidConfig(format!(
                "memory_mib must be 16..=1048576, got {}",
                self.memory_mib
            )));
        }
        // CIDs 0..=2 are reserved (hypervisor, local, host); u32::MAX is VMADDR_CID_ANY.
        if self.guest_cid < 3 || self.guest_cid == u32::MAX {
            return Err(QemuError::InvalidConfig(format!(
                "guest_cid must be >= 3 and not {}, got {}",
                u32::MAX,
                self.guest_cid
            )));
        }
        if let Some(fs) = &self.shared_fs {
            // virtio-fs tags are at most 36 bytes; a comma would end QEMU's option value.
            if fs.tag.is_empty() || fs.tag.len() > 36 || fs.tag.contains([',', '\0']) {
                return Err(QemuError::InvalidConfig(format!(
                    "shared_fs tag must be 1..=36 bytes without commas, got {:?}",
                    fs.tag
                )));
            }
            if !fs.host_dir.is_dir() {
                return Err(QemuError::InvalidConfig(format!(
                    "shared_fs directory {} is not a directory",
                    fs.host_dir.display()
                )));
            }
        }
        for (what, path) in [("kernel", &self.kernel), ("initrd", &self.initrd)] {
            File::open(path).map_err(|source| QemuError::Unreadable {
                what,
                path: path.clone(),
                source,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::qemu::JAIL_ID_RANGE;

    #[test]
    fn jail_ids_are_the_base_plus_the_pid_and_never_root_or_minus_one() {
        let pid = std::process::id();
        assert_eq!(jail_id(5), Some(5 + pid));
        assert_eq!(jail_id(0), None);
        assert_eq!(jail_id(u32::MAX - JAIL_ID_RANGE), None);
        assert_eq!(
            jail_id(u32::MAX - JAIL_ID_RANGE - 1),
            Some(u32::MAX - JAIL_ID_RANGE - 1 + pid)
        );
        let mut cfg = QemuConfig::new("/k", "/i", "/v", "/w");
        assert_eq!(cfg.jail_id, DEFAULT_JAIL_ID_BASE + pid);
        cfg.jail_id = 0;
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("jail_id"), "{e}");
    }
}
