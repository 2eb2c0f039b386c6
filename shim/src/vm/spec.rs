//! What to boot: [`GuestSpec`] and its parts (disks, network cards, the shared folder, the QEMU
//! backend's programs), the words it adds to the guest's kernel command line, and the spec of
//! the VM that captures the kernel text template for page sharing. Each backend turns a spec
//! into its own devices (`launch`).
//!
//! Why a spec of our own rather than `vmm::VmConfig`: a pod's VM has two backends, and the
//! spec says what the pod needs, not how one VMM is configured. QEMU takes it too (programs,
//! accelerator, jail ids that the embedded VMM has no use for), and `launch::start_kvm` derives
//! the embedded VMM's config from it by the pod's rules (the kernel command line, the console's
//! bound, the vsock CID, the balloon and page sharing only without VFIO), so `vmm` stays free of
//! pods, QEMU and the agent.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::qemu::Accel;
use crate::config::qemu::{
    default_vhost_vsock_binary, default_virtiofsd_binary, jail_id, DEFAULT_JAIL_ID_BASE,
    DEFAULT_QEMU,
};

/// Guest CID of every VM (each VM has its own vsock device, so they need not differ).
pub const GUEST_CID: u32 = 3;

/// The hybrid-vsock socket's name in a VM's work folder (both backends).
pub const VSOCK_UDS_NAME: &str = "vsock.sock";

/// What to boot. Network interfaces and drives join here as fields of their own when they come;
/// each backend turns the spec into its own devices.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// The guest kernel (uncompressed vmlinux ELF).
    pub kernel: PathBuf,
    /// The initramfs with the agent as /init.
    pub initrd: PathBuf,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Private folder for this VM's sockets and console log; created, and removed on drop.
    pub work_dir: PathBuf,
    /// The guest agent's log level (error, warn, info, debug, trace), passed on the kernel
    /// command line as `MICROVM_AGENT_LOG=`; `None` keeps the agent's default (info).
    pub agent_log_level: Option<String>,
    /// The guest's hostname (the pod's, from the sandbox spec), passed as `microvm.hostname=`;
    /// containers share the VM's UTS namespace. A name that is not a valid hostname is dropped.
    pub hostname: Option<String>,
    /// A host directory exported over virtio-fs (the pod's shared folder).
    pub shared: Option<SharedDir>,
    /// The programs of the QEMU backend (unused by the embedded VMM).
    pub qemu: QemuPrograms,
    /// Network cards (virtio-net on taps in the pod netns), eth0 first.
    pub nics: Vec<GuestNic>,
    /// virtio-blk disks, in the order the guest sees them (vda, vdb, ...).
    pub disks: Vec<GuestDisk>,
    /// Host PCI devices (`/sys/bus/pci/devices/<address>`) to pass through with VFIO.
    pub vfio: Vec<PathBuf>,
    /// Embedded VMM: kernel and initrd mapped from their files (the default) or copied.
    pub boot_files: vmm::BootFiles,
    /// A virtio-balloon on which the guest reports its free memory, whose host pages are then
    /// dropped (docs/virtio-balloon.md). Left out when `vfio` is not empty: the pages a device
    /// DMAs into are pinned, and dropping them would take them from the guest.
    pub free_page_reporting: bool,
    /// Embedded VMM: the page sharing of the VM (template root and the pod's trust domain)
    /// when guest pages equal to public templates are shared (docs/page-sharing.md); `None`:
    /// off. Left out when `vfio` is not empty.
    pub page_sharing: Option<vmm::PageSharingConfig>,
    /// Embedded VMM: run the VM in a process of its own, jailed (`vmm_process` in the config,
    /// docs/security.md "The VMM's confinement"), instead of in this one.
    pub vmm_process: bool,
}

/// A virtio-blk disk of the guest; the guest finds it by its serial
/// (`/sys/block/vdX/serial`, at most 20 bytes).
#[derive(Debug, Clone)]
pub struct GuestDisk {
    pub serial: String,
    pub backing: DiskBacking,
}

/// What a disk holds.
#[derive(Debug, Clone)]
pub enum DiskBacking {
    /// A reserved empty slot (capacity 0), filled while the VM runs.
    Empty { read_only: bool },
    /// A host file or block device the shim opened (read-write, or read-only).
    File { file: Arc<File>, read_only: bool },
}

impl DiskBacking {
    /// Whether the guest may only read the disk.
    pub fn read_only(&self) -> bool {
        match self {
            DiskBacking::Empty { read_only } | DiskBacking::File { read_only, .. } => *read_only,
        }
    }
}

/// A network card of the guest: a tap opened in the pod netns (`IFF_TAP | IFF_NO_PI |
/// IFF_VNET_HDR`) and the MAC and MTU the guest NIC gets (the CNI interface's).
#[derive(Debug, Clone)]
pub struct GuestNic {
    pub tap: Arc<OwnedFd>,
    pub mac: [u8; 6],
    pub mtu: u16,
}

/// The programs the QEMU backend runs (the config's `[qemu]` table) and how QEMU runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuPrograms {
    /// `qemu-system-x86_64` (looked up on PATH unless a path).
    pub qemu: PathBuf,
    /// `vhost-device-vsock`.
    pub vhost_vsock: PathBuf,
    /// The Rust `virtiofsd`.
    pub virtiofsd: PathBuf,
    /// QEMU's accelerator, as `vm::backend::choose_backend` decided it (the default
    /// [`Accel::Kvm`]: software emulation is chosen only there).
    pub accel: Accel,
    /// The uid and gid QEMU and vhost-device-vsock run as (`QemuConfig::jail_id`).
    pub jail_id: u32,
}

impl Default for QemuPrograms {
    #[expect(
        clippy::expect_used,
        reason = "DEFAULT_JAIL_ID_BASE is neither 0 nor near u32::MAX, so jail_id gives Some \
                  (qemu::config::tests::jail_ids_are_the_base_plus_the_pid_and_never_root_or_minus_one)"
    )]
    fn default() -> Self {
        QemuPrograms {
            qemu: PathBuf::from(DEFAULT_QEMU),
            vhost_vsock: default_vhost_vsock_binary(),
            virtiofsd: default_virtiofsd_binary(),
            accel: Accel::Kvm,
            jail_id: jail_id(DEFAULT_JAIL_ID_BASE).expect("the default jail id range fits"),
        }
    }
}

impl GuestSpec {
    /// A spec with no log level, hostname or share, and the default QEMU programs.
    pub fn new(
        kernel: PathBuf,
        initrd: PathBuf,
        vcpus: u8,
        memory_mib: u64,
        work_dir: PathBuf,
    ) -> Self {
        GuestSpec {
            kernel,
            initrd,
            vcpus,
            memory_mib,
            work_dir,
            agent_log_level: None,
            hostname: None,
            shared: None,
            qemu: QemuPrograms::default(),
            nics: Vec::new(),
            disks: Vec::new(),
            vfio: Vec::new(),
            boot_files: vmm::BootFiles::Map,
            free_page_reporting: false,
            page_sharing: None,
            vmm_process: false,
        }
    }

    /// The page sharing of the VM: asked for, and no VFIO device (pinned pages).
    pub(super) fn page_sharing_config(&self) -> Option<vmm::PageSharingConfig> {
        self.page_sharing.clone().filter(|_| self.vfio.is_empty())
    }

    /// The spec of the VM that captures the kernel text template for this one's page sharing
    /// (docs/page-sharing.md): a VM that sees no pod input. It has this spec's kernel, initrd,
    /// size, boot files, balloon and agent log level, and the same kinds and numbers of devices
    /// (the guest kernel patches its text by what it finds), but nothing of the pod behind them:
    /// no hostname; the share is `empty_share` (an empty directory of the caller's) under the
    /// same tag; each network card is one of `taps` (reaching nothing: the caller's, in a
    /// network namespace of their own) with a fixed local MAC and the pod card's MTU; each disk
    /// an empty slot; no VFIO device. Its work folder is its own, beside this one's. `None` when
    /// this VM shares no pages.
    pub fn kernel_text_capture(
        &self,
        empty_share: &Path,
        taps: Vec<Arc<OwnedFd>>,
    ) -> Option<GuestSpec> {
        let sharing = self.page_sharing_config()?;
        let mut work_dir = self.work_dir.clone().into_os_string();
        work_dir.push("-capture");
        let mut spec = GuestSpec::new(
            self.kernel.clone(),
            self.initrd.clone(),
            self.vcpus,
            self.memory_mib,
            PathBuf::from(work_dir),
        );
        spec.agent_log_level = self.agent_log_level.clone();
        spec.boot_files = self.boot_files;
        spec.free_page_reporting = self.free_page_reporting;
        spec.shared = self.shared.as_ref().map(|s| SharedDir {
            tag: s.tag.clone(),
            host_dir: empty_share.to_path_buf(),
        });
        spec.nics = self
            .nics
            .iter()
            .zip(taps)
            .enumerate()
            .map(|(i, (nic, tap))| GuestNic {
                tap,
                mac: [0x02, 0, 0, 0, 0, u8::try_from(i + 1).unwrap_or(u8::MAX)],
                mtu: nic.mtu,
            })
            .collect();
        spec.disks = self
            .disks
            .iter()
            .enumerate()
            .map(|(i, d)| GuestDisk {
                serial: format!("capture{i}"),
                backing: DiskBacking::Empty {
                    read_only: d.backing.read_only(),
                },
            })
            .collect();
        spec.page_sharing = Some(vmm::PageSharingConfig {
            capture_kernel_text: true,
            ..sharing
        });
        Some(spec)
    }

    /// Whether the VM gets the balloon: asked for, and no VFIO device.
    pub(super) fn wants_balloon(&self) -> bool {
        self.free_page_reporting && self.vfio.is_empty()
    }

    /// Words this spec adds to the kernel command line.
    pub(super) fn cmdline_extra(&self) -> String {
        let mut words = Vec::new();
        // Only plain level names and hostnames: nothing a config or a pod spec can smuggle onto
        // the command line.
        if let Some(level) = &self.agent_log_level {
            if !level.is_empty() && level.bytes().all(|b| b.is_ascii_alphabetic()) {
                words.push(format!("MICROVM_AGENT_LOG={level}"));
            }
        }
        if let Some(name) = &self.hostname {
            if agent_protocol::is_valid_hostname(name) {
                words.push(format!("microvm.hostname={name}"));
            }
        }
        words.join(" ")
    }
}

/// A host directory exported to the guest over virtio-fs: the embedded VMM's own device, or
/// virtiofsd under QEMU. The guest mounts it with `mount -t virtiofs <tag> <dir>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDir {
    /// The virtio-fs tag (1 to 36 bytes).
    pub tag: String,
    /// The host directory.
    pub host_dir: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(level: Option<&str>, hostname: Option<&str>) -> GuestSpec {
        let mut spec = GuestSpec::new("/k".into(), "/i".into(), 1, 128, "/w".into());
        spec.agent_log_level = level.map(str::to_owned);
        spec.hostname = hostname.map(str::to_owned);
        spec
    }

    #[test]
    fn cmdline_extra_passes_only_clean_words() {
        assert_eq!(spec(None, None).cmdline_extra(), "");
        assert_eq!(
            spec(Some("debug"), Some("pod-a.example")).cmdline_extra(),
            "MICROVM_AGENT_LOG=debug microvm.hostname=pod-a.example"
        );
        // Anything that could add words or options to the command line is dropped.
        assert_eq!(
            spec(Some("info init=/bin/sh"), Some("a b")).cmdline_extra(),
            ""
        );
        assert_eq!(spec(None, Some(&"x".repeat(65))).cmdline_extra(), "");
        assert_eq!(spec(None, Some("")).cmdline_extra(), "");
    }

    #[test]
    fn the_balloon_is_left_out_beside_vfio_devices() {
        let mut s = spec(None, None);
        assert!(!s.wants_balloon(), "off unless asked");
        s.free_page_reporting = true;
        assert!(s.wants_balloon());
        s.vfio = vec!["/sys/bus/pci/devices/0000:00:04.0".into()];
        assert!(!s.wants_balloon());
    }

    #[test]
    fn page_sharing_is_left_out_beside_vfio_devices() {
        let mut s = spec(None, Some("pod"));
        assert_eq!(s.page_sharing_config(), None, "off unless asked");
        assert!(s.kernel_text_capture(Path::new("/e"), Vec::new()).is_none());
        let sharing = vmm::PageSharingConfig {
            template_dir: PathBuf::from("/run/t"),
            domain: vmm::page_sharing::namespace_domain("shop"),
            capture_kernel_text: false,
        };
        s.page_sharing = Some(sharing.clone());
        assert_eq!(s.page_sharing_config(), Some(sharing.clone()));
        s.vfio
            .push(PathBuf::from("/sys/bus/pci/devices/0000:00:01.0"));
        assert_eq!(s.page_sharing_config(), None);
        assert!(s.kernel_text_capture(Path::new("/e"), Vec::new()).is_none());
    }

    /// The VM that captures the kernel text gets the pod's kinds of devices with nothing of the
    /// pod behind them.
    #[test]
    fn the_capture_vm_gets_nothing_of_the_pod() {
        let mut s = spec(Some("debug"), Some("pod-host"));
        s.page_sharing = Some(vmm::PageSharingConfig {
            template_dir: PathBuf::from("/run/t"),
            domain: vmm::page_sharing::namespace_domain("shop"),
            capture_kernel_text: false,
        });
        s.shared = Some(SharedDir {
            tag: "share".into(),
            host_dir: PathBuf::from("/run/microvm/p/shared"),
        });
        let pod_file = Arc::new(File::open("/dev/null").unwrap());
        s.disks.push(GuestDisk {
            serial: "pod-disk".into(),
            backing: DiskBacking::File {
                file: pod_file,
                read_only: true,
            },
        });
        s.disks.push(GuestDisk {
            serial: "slot".into(),
            backing: DiskBacking::Empty { read_only: false },
        });
        let pod_tap: Arc<OwnedFd> = Arc::new(File::open("/dev/null").unwrap().into());
        s.nics.push(GuestNic {
            tap: pod_tap.clone(),
            mac: [0x0a, 1, 2, 3, 4, 5],
            mtu: 1450,
        });
        s.free_page_reporting = true;
        let inert: Arc<OwnedFd> = Arc::new(File::open("/dev/null").unwrap().into());
        let c = s
            .kernel_text_capture(Path::new("/run/empty"), vec![inert.clone()])
            .expect("a capture spec");
        let share = c.shared.as_ref().expect("a share, empty");
        assert_eq!(
            (share.tag.as_str(), share.host_dir.as_path()),
            ("share", Path::new("/run/empty"))
        );
        assert_eq!(c.disks.len(), 2);
        for (d, ro) in c.disks.iter().zip([true, false]) {
            assert!(
                matches!(d.backing, DiskBacking::Empty { read_only } if read_only == ro),
                "{d:?}"
            );
            assert!(d.serial.starts_with("capture"), "{}", d.serial);
        }
        assert_eq!(c.nics.len(), 1);
        assert!(Arc::ptr_eq(&c.nics[0].tap, &inert));
        assert_eq!((c.nics[0].mac, c.nics[0].mtu), ([2, 0, 0, 0, 0, 1], 1450));
        assert!(c.vfio.is_empty() && c.hostname.is_none());
        assert_eq!(c.cmdline_extra(), "MICROVM_AGENT_LOG=debug");
        assert_eq!((c.vcpus, c.memory_mib), (s.vcpus, s.memory_mib));
        assert!(c.free_page_reporting);
        assert_ne!(c.work_dir, s.work_dir);
        assert_eq!(c.work_dir.parent(), s.work_dir.parent());
        let sharing = c.page_sharing.expect("sharing");
        assert!(sharing.capture_kernel_text);
        assert_eq!(sharing.domain, vmm::page_sharing::namespace_domain("shop"));
    }
}
