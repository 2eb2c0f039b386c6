//! The VM's configuration, as the embedding program (the shim's CLI) gives it, and its checks.

use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::layout::{MAX_MEMORY_MIB, MAX_VCPUS};
use crate::VmmError;

/// Where the guest's serial console output goes.
pub enum SerialSink {
    /// Dropped.
    Null,
    /// The process's standard output.
    Stdout,
    /// A console log of bounded size on disk, created or truncated: `path` and `<path>.1`
    /// hold at most `max_bytes` together, the newest bytes ([`crate::console_log`]).
    File { path: PathBuf, max_bytes: u64 },
    /// Any writer (a pipe, a buffer shared with a test...).
    Writer(Box<dyn Write + Send>),
}

impl fmt::Debug for SerialSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SerialSink::Null => f.write_str("Null"),
            SerialSink::Stdout => f.write_str("Stdout"),
            SerialSink::File { path, max_bytes } => f
                .debug_struct("File")
                .field("path", path)
                .field("max_bytes", max_bytes)
                .finish(),
            SerialSink::Writer(_) => f.write_str("Writer(..)"),
        }
    }
}

impl SerialSink {
    /// Opens the sink as a writer.
    pub(crate) fn into_writer(self) -> Result<Box<dyn Write + Send>, VmmError> {
        Ok(match self {
            SerialSink::Null => Box::new(io::sink()),
            SerialSink::Stdout => Box::new(io::stdout()),
            SerialSink::File { path, max_bytes } => {
                let log =
                    crate::console_log::ConsoleLog::create(&path, max_bytes).map_err(|source| {
                        VmmError::Io {
                            op: format!("create the serial output file {}", path.display()),
                            source,
                        }
                    })?;
                Box::new(log)
            }
            SerialSink::Writer(w) => w,
        })
    }
}

/// A host PCI device passed through with VFIO. It must be bound to vfio-pci already; the VMM
/// opens its IOMMU group (/dev/vfio/<group>) and the container /dev/vfio/vfio.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VfioConfig {
    /// The device's sysfs directory, e.g. /sys/bus/pci/devices/0000:00:04.0.
    pub sysfs_path: PathBuf,
}

/// The hybrid vsock device: the guest's CID and the host Unix socket it listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    pub guest_cid: u32,
    pub uds_path: PathBuf,
}

/// The virtio-fs device: a host directory the guest mounts with `mount -t virtiofs <tag> <dir>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedFsConfig {
    /// The name the guest mounts (1 to 36 bytes, no NUL).
    pub tag: String,
    /// The host directory served to the guest (FUSE passthrough; the guest cannot leave it).
    pub host_dir: PathBuf,
}

/// A virtio-net device on a tap the embedder opened.
///
/// The VMM never enters a network namespace: open the tap wherever its frames belong (e.g. with
/// [`crate::open_tap`] from a thread inside the pod's netns) with
/// `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` and pass the descriptor. The VMM sets the vnet header
/// size, offloads (none) and non-blocking mode itself, and closes the descriptor when the VM ends
/// (a non-persistent tap then disappears).
#[derive(Debug)]
pub struct NetConfig {
    /// The tap's descriptor.
    pub tap: std::os::fd::OwnedFd,
    /// The guest's MAC address (unicast).
    pub mac: [u8; 6],
    /// The MTU the guest is told (68..=65535); `None`: the guest's default (1500 for Linux).
    pub mtu: Option<u16>,
}

/// The virtio-balloon device (docs/virtio-balloon.md). Its `num_pages` stays 0: the host never
/// asks the guest for memory; the device is there for what the guest gives back by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalloonConfig {
    /// Offer free page reporting: the guest reports the blocks its allocator holds free and the
    /// VMM drops their host pages (`MADV_DONTNEED`), so freed guest memory returns to the host.
    pub free_page_reporting: bool,
}

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BootProtocol {
    /// PVH if the ELF has a PVH entry note, otherwise the 64-bit Linux boot protocol.
    #[default]
    Auto,
    /// 64-bit Linux boot protocol (long mode, zero page in RSI).
    Linux64,
    /// PVH (32-bit protected mode, hvm_start_info in EBX); the ELF must have the note.
    Pvh,
}

/// How the kernel and the initrd get into guest RAM (`vmm::boot_files`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BootFiles {
    /// Whole pages mapped from the files, private and copy-on-write: the host's page cache holds
    /// one copy for all VMs booted from the same files. Pages that cannot be mapped (partial
    /// pages, a file whose mapping fails, a kernel the mapping path does not read) are copied.
    #[default]
    Map,
    /// Copied into each VM's anonymous memory.
    Copy,
}

/// A boot file (the kernel, the initrd): a path the VMM opens when the VM starts, or a file the
/// embedder opened, which the VMM reads and maps without opening any path. A VMM process gets
/// its boot files so ([`crate::jail::split`]): it boots the file the embedder opened, whatever
/// is at the path by then.
#[derive(Debug)]
pub enum BootFile {
    /// A path, opened read-only by [`crate::Vm::start`] (once: everything that reads the file
    /// later, page sharing among them, reads that open file).
    Path(PathBuf),
    /// A regular file open for reading. `name` (the path it was opened from) only names it in
    /// messages: the VMM never opens it.
    Open { file: File, name: PathBuf },
}

impl BootFile {
    /// Opens the regular file at `path` read-only (close-on-exec, and non-blocking, so that a
    /// FIFO put at the path cannot hang the opener: it is refused as not a regular file); the
    /// reason if it cannot.
    pub fn open_path(path: &Path) -> Result<BootFile, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(|e| e.to_string())?;
        check_open_file(&file)?;
        Ok(BootFile::Open {
            file,
            name: path.to_path_buf(),
        })
    }

    /// What names the file in messages: its path, or the path the open file came from.
    pub fn name(&self) -> &Path {
        match self {
            Self::Path(p) | Self::Open { name: p, .. } => p,
        }
    }

    /// The file to read: the path opened read-only, or a new descriptor of the open file (the
    /// same open file: it shares its offset, so each reader seeks before it reads).
    pub(crate) fn open(&self) -> io::Result<File> {
        match self {
            Self::Path(p) => File::open(p),
            Self::Open { file, .. } => file.try_clone(),
        }
    }

    /// Whether the file can be read as a boot file; the reason if not.
    fn check(&self) -> Result<(), String> {
        match self {
            Self::Path(p) => check_readable(p),
            Self::Open { file, .. } => check_open_file(file),
        }
    }
}

impl From<PathBuf> for BootFile {
    fn from(p: PathBuf) -> Self {
        Self::Path(p)
    }
}

impl From<&PathBuf> for BootFile {
    fn from(p: &PathBuf) -> Self {
        Self::Path(p.clone())
    }
}

impl From<&Path> for BootFile {
    fn from(p: &Path) -> Self {
        Self::Path(p.to_path_buf())
    }
}

impl From<&str> for BootFile {
    fn from(p: &str) -> Self {
        Self::Path(p.into())
    }
}

impl From<String> for BootFile {
    fn from(p: String) -> Self {
        Self::Path(p.into())
    }
}

/// A virtio-blk disk, in the order the guest sees them (vda, vdb, ...).
#[derive(Debug)]
pub struct BlockConfig {
    /// The serial the guest reads (VIRTIO_BLK_T_GET_ID; /sys/block/vdX/serial), <= 20 bytes.
    pub serial: String,
    pub backing: BlockBacking,
}

/// What is behind a disk slot at boot.
#[derive(Debug)]
pub enum BlockBacking {
    /// A reserved, empty slot (capacity 0) to be filled while the VM runs
    /// ([`VmHandle::attach_block`](crate::VmHandle::attach_block)).
    Empty { read_only: bool },
    /// A regular file or a block device the embedder opened (O_RDWR, or O_RDONLY when
    /// read_only); the VMM never opens host paths itself.
    File {
        file: std::fs::File,
        read_only: bool,
    },
}

impl BlockBacking {
    /// Whether the slot is read-only (fixed for the VM's life: the guest negotiates it at probe).
    pub fn read_only(&self) -> bool {
        match self {
            Self::Empty { read_only } | Self::File { read_only, .. } => *read_only,
        }
    }
}

/// Everything needed to boot a VM.
#[derive(Debug)]
pub struct VmConfig {
    pub vcpus: u8,
    pub memory_mib: u64,
    /// An uncompressed ELF kernel (vmlinux, or one of our test guests).
    pub kernel: BootFile,
    pub initrd: Option<BootFile>,
    /// `/dev/kvm`, opened by the embedder (read-write); `None`: the VMM opens `/dev/kvm`.
    pub kvm: Option<OwnedFd>,
    /// The user's part of the kernel command line; the VMM appends its device arguments.
    pub cmdline: String,
    pub serial: SerialSink,
    pub vsock: Option<VsockConfig>,
    /// A shared directory (virtio-fs), if any.
    pub shared_fs: Option<SharedFsConfig>,
    /// Network cards (virtio-net on taps), in the order the guest sees them.
    pub nets: Vec<NetConfig>,
    /// Disks (virtio-blk), in the order the guest sees them (vda, vdb, ...).
    pub blocks: Vec<BlockConfig>,
    pub boot_protocol: BootProtocol,
    /// Kernel and initrd mapped from their files (the default) or copied.
    pub boot_files: BootFiles,
    /// Host PCI devices passed through on the guest's PCI bus 0 (a PCI root exists only when
    /// this is not empty).
    pub vfio: Vec<VfioConfig>,
    /// A virtio-balloon device, after the disks (not with `vfio`: a device's DMA goes to the
    /// pages the IOMMU pinned, which dropping would take from the guest).
    pub balloon: Option<BalloonConfig>,
    /// Page sharing ([`crate::page_sharing`], docs/page-sharing.md): when set,
    /// [`crate::VmHandle::share_pages`] drops zero pages and maps guest pages equal to public
    /// templates (the initrd's files, the kernel text) from shared template files. Not with
    /// `vfio` (pinned pages).
    pub page_sharing: Option<crate::page_sharing::PageSharingConfig>,
    /// Each vCPU thread and the device event-loop thread install their role's seccomp filter
    /// as they start, before they touch guest data ([`crate::jail`], docs/security.md "The
    /// VMM's confinement"). On by default; off only to find a missing system call.
    pub jail: bool,
}

impl VmConfig {
    /// A config with 1 vCPU, 128 MiB, no initrd, console on stdout.
    pub fn new(kernel: impl Into<BootFile>) -> Self {
        Self {
            vcpus: 1,
            memory_mib: 128,
            kernel: kernel.into(),
            initrd: None,
            kvm: None,
            cmdline: String::new(),
            serial: SerialSink::Stdout,
            vsock: None,
            shared_fs: None,
            nets: Vec::new(),
            blocks: Vec::new(),
            vfio: Vec::new(),
            balloon: None,
            boot_protocol: BootProtocol::Auto,
            boot_files: BootFiles::Map,
            page_sharing: None,
            jail: true,
        }
    }

    /// Checks the config before anything is created: vCPU count, memory size, readable files.
    pub fn validate(&self) -> Result<(), VmmError> {
        if self.vcpus == 0 {
            return Err(VmmError::Config(
                "a VM needs at least 1 vCPU, 0 given".into(),
            ));
        }
        if self.vcpus > MAX_VCPUS {
            return Err(VmmError::Config(format!(
                "{} vCPUs requested, at most {MAX_VCPUS} are supported",
                self.vcpus
            )));
        }
        if self.memory_mib == 0 {
            return Err(VmmError::Config("guest memory of 0 MiB requested".into()));
        }
        if self.memory_mib < 2 {
            return Err(VmmError::Config(format!(
                "guest memory of {} MiB is too small: at least 2 MiB (the kernel loads at 1 MiB)",
                self.memory_mib
            )));
        }
        if self.memory_mib > MAX_MEMORY_MIB {
            return Err(VmmError::Config(format!(
                "guest memory of {} MiB exceeds the limit of {MAX_MEMORY_MIB} MiB",
                self.memory_mib
            )));
        }
        if let Some(host) = host_memory_mib() {
            if self.memory_mib > host {
                return Err(VmmError::Config(format!(
                    "guest memory of {} MiB exceeds the host's {host} MiB of RAM",
                    self.memory_mib
                )));
            }
        }
        self.kernel.check().map_err(|reason| VmmError::Kernel {
            path: self.kernel.name().to_path_buf(),
            reason,
        })?;
        if let Some(initrd) = &self.initrd {
            initrd.check().map_err(|reason| VmmError::Initrd {
                path: initrd.name().to_path_buf(),
                reason,
            })?;
        }
        if let Some(kvm) = &self.kvm {
            crate::kvm_vm::check_kvm_device(kvm.as_fd())?;
        }
        if let Some(v) = &self.vsock {
            if v.guest_cid < 3 {
                return Err(VmmError::Config(format!(
                    "vsock guest CID {} is reserved (CIDs 0-2); use 3 or more",
                    v.guest_cid
                )));
            }
            if v.uds_path.as_os_str().is_empty() {
                return Err(VmmError::Config("vsock socket path is empty".into()));
            }
        }
        if let Some(fs) = &self.shared_fs {
            vmm_devices::virtio::fs::validate_tag(&fs.tag)
                .map_err(|e| VmmError::Config(e.to_string()))?;
            match std::fs::metadata(&fs.host_dir) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(VmmError::Config(format!(
                        "shared directory {} is not a directory",
                        fs.host_dir.display()
                    )))
                }
                Err(e) => {
                    return Err(VmmError::Config(format!(
                        "shared directory {}: {e}",
                        fs.host_dir.display()
                    )))
                }
            }
        }
        for (i, net) in self.nets.iter().enumerate() {
            use vmm_devices::virtio::net::{validate_mac, validate_mtu};
            validate_mac(&net.mac)
                .and_then(|()| net.mtu.map_or(Ok(()), validate_mtu))
                .map_err(|e| VmmError::Config(format!("network card {i}: {e}")))?;
        }
        for (i, b) in self.blocks.iter().enumerate() {
            vmm_devices::virtio::block::validate_serial(&b.serial)
                .map_err(|e| VmmError::Config(format!("disk {i}: {e}")))?;
        }
        if self.balloon.is_some() && !self.vfio.is_empty() {
            return Err(VmmError::Config(
                "a balloon cannot be combined with VFIO devices: their DMA goes to pinned guest \
                 pages that dropping would take from the guest"
                    .into(),
            ));
        }
        if self.page_sharing.is_some() && !self.vfio.is_empty() {
            return Err(VmmError::Config(
                "page sharing cannot be combined with VFIO devices: their DMA goes to pinned \
                 guest pages, which remapping would take from the device"
                    .into(),
            ));
        }
        for v in &self.vfio {
            // The IOMMU group link says the device exists and the kernel gave it a group.
            std::fs::read_link(v.sysfs_path.join("iommu_group")).map_err(|e| {
                VmmError::Config(format!(
                    "VFIO device {}: no IOMMU group: {e}",
                    v.sysfs_path.display()
                ))
            })?;
        }
        Ok(())
    }
}

/// Whether `path` is a regular file we can open for reading; the reason if not.
fn check_readable(path: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    File::open(path).map(|_| ()).map_err(|e| e.to_string())
}

/// Whether `file` is a regular file open for reading; the reason if not.
fn check_open_file(file: &File) -> Result<(), String> {
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mode = rustix::fs::fcntl_getfl(file).map_err(|e| e.to_string())?;
    if mode & rustix::fs::OFlags::ACCMODE == rustix::fs::OFlags::WRONLY {
        return Err("not open for reading".into());
    }
    Ok(())
}

/// Total RAM of the host in MiB (from sysinfo), if known.
fn host_memory_mib() -> Option<u64> {
    // SAFETY: sysinfo only writes into the struct we pass; a zeroed sysinfo is a valid value.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable sysinfo struct.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return None;
    }
    #[allow(clippy::useless_conversion)] // totalram is u32 on 32-bit targets
    let bytes = u64::from(info.totalram).checked_mul(u64::from(info.mem_unit))?;
    Some(bytes >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg_with_kernel() -> (VmConfig, tempfile_lite::TempFile) {
        let k = tempfile_lite::TempFile::new("kernel", b"\x7fELF");
        (VmConfig::new(k.path()), k)
    }

    /// A tiny temporary file helper (std only).
    mod tempfile_lite {
        use std::path::{Path, PathBuf};
        pub struct TempFile(PathBuf);
        impl TempFile {
            pub fn new(name: &str, content: &[u8]) -> Self {
                let p = std::env::temp_dir().join(format!(
                    "vmm-config-test-{}-{name}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                std::fs::write(&p, content).unwrap();
                Self(p)
            }
            pub fn path(&self) -> &Path {
                &self.0
            }
        }
        impl Drop for TempFile {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn accepts_a_sane_config() {
        let (c, _k) = cfg_with_kernel();
        c.validate().unwrap();
    }

    #[test]
    fn rejects_bad_vcpus_and_memory() {
        let (mut c, _k) = cfg_with_kernel();
        c.vcpus = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("at least 1 vCPU"));
        c.vcpus = 255;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("at most 254"));
        c.vcpus = 1;
        c.memory_mib = 0;
        assert!(c.validate().unwrap_err().to_string().contains("0 MiB"));
        c.memory_mib = MAX_MEMORY_MIB + 1;
        assert!(c.validate().unwrap_err().to_string().contains("exceeds"));
        if let Some(host) = host_memory_mib() {
            if host < MAX_MEMORY_MIB {
                c.memory_mib = host + 1;
                assert!(c.validate().unwrap_err().to_string().contains("host"));
            }
        }
    }

    #[test]
    fn rejects_missing_files_naming_them() {
        let (mut c, _k) = cfg_with_kernel();
        c.initrd = Some("/nonexistent/initrd.img".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/initrd.img"), "{e}");
        c.initrd = None;
        c.kernel = "/nonexistent/vmlinux".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/vmlinux") && e.contains("No such file"),
            "{e}"
        );
        c.kernel = std::env::temp_dir().into();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("not a regular file"));
    }

    #[test]
    fn an_open_boot_file_is_checked_as_a_file_and_named_by_its_path() {
        let k = tempfile_lite::TempFile::new("open-kernel", b"\x7fELF");
        let opened = BootFile::open_path(k.path()).unwrap();
        assert_eq!(opened.name(), k.path());
        let mut c = VmConfig::new(opened);
        c.validate().unwrap();
        // The open file is what counts: the path may be gone.
        std::fs::remove_file(k.path()).unwrap();
        c.validate().unwrap();
        let e = BootFile::open_path(k.path()).unwrap_err();
        assert!(e.contains("No such file"), "{e}");
        // A directory, or a file open for writing only, is no boot file.
        let dir = std::env::temp_dir();
        assert_eq!(BootFile::open_path(&dir).unwrap_err(), "not a regular file");
        c.kernel = BootFile::Open {
            file: File::open(&dir).unwrap(),
            name: "the-dir".into(),
        };
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "kernel the-dir: not a regular file");
        let w = tempfile_lite::TempFile::new("write-only", b"");
        c.kernel = w.path().into();
        c.initrd = Some(BootFile::Open {
            file: std::fs::OpenOptions::new()
                .write(true)
                .open(w.path())
                .unwrap(),
            name: "initrd.img".into(),
        });
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "initrd initrd.img: not open for reading");
    }

    #[test]
    fn a_fifo_at_a_boot_files_path_is_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("vmm-config-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &dir,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = BootFile::open_path(&dir).unwrap_err();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(e, "not a regular file");
    }

    #[test]
    fn rejects_reserved_vsock_cid() {
        let (mut c, _k) = cfg_with_kernel();
        c.vsock = Some(VsockConfig {
            guest_cid: 2,
            uds_path: "/tmp/x.sock".into(),
        });
        assert!(c.validate().unwrap_err().to_string().contains("reserved"));
    }

    #[test]
    fn checks_each_network_cards_mac_and_mtu() {
        let (mut c, _k) = cfg_with_kernel();
        let fd = || std::os::fd::OwnedFd::from(File::open("/dev/null").unwrap());
        let net = |mac, mtu| NetConfig {
            tap: fd(),
            mac,
            mtu,
        };
        let good = [0x02, 0, 0, 0, 0, 1];
        c.nets = vec![net(good, None), net(good, Some(68)), net(good, Some(65535))];
        c.validate().unwrap();
        c.nets.push(net([0x03, 0, 0, 0, 0, 1], None));
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("network card 3") && e.contains("03:00:00:00:00:01 is not a unicast"),
            "{e}"
        );
        c.nets = vec![net([0; 6], Some(1500))];
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("network card 0"), "{e}");
        c.nets = vec![net(good, Some(67))];
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("MTU 67 is below the minimum of 68"), "{e}");
    }

    #[test]
    fn checks_each_disks_serial() {
        let (mut c, _k) = cfg_with_kernel();
        let disk = |serial: &str| BlockConfig {
            serial: serial.into(),
            backing: BlockBacking::Empty { read_only: true },
        };
        c.blocks = vec![disk(""), disk(&"s".repeat(20))];
        c.validate().unwrap();
        assert!(c.blocks[0].backing.read_only());
        c.blocks.push(disk(&"s".repeat(21)));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("disk 2") && e.contains("longer than 20"), "{e}");
    }

    #[test]
    fn checks_the_shared_fs_tag_and_directory() {
        let (mut c, k) = cfg_with_kernel();
        let dir = std::env::temp_dir();
        c.shared_fs = Some(SharedFsConfig {
            tag: "shared".into(),
            host_dir: dir.clone(),
        });
        c.validate().unwrap();
        for bad in ["", &"x".repeat(37)] {
            c.shared_fs = Some(SharedFsConfig {
                tag: bad.to_string(),
                host_dir: dir.clone(),
            });
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("invalid virtio-fs tag"), "{e}");
        }
        c.shared_fs = Some(SharedFsConfig {
            tag: "shared".into(),
            host_dir: k.path().to_path_buf(),
        });
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
        c.shared_fs = Some(SharedFsConfig {
            tag: "shared".into(),
            host_dir: "/nonexistent/shared".into(),
        });
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/shared") && e.contains("No such file"),
            "{e}"
        );
        drop(k);
    }

    #[test]
    fn a_balloon_is_refused_beside_vfio_devices() {
        let (mut c, _k) = cfg_with_kernel();
        c.balloon = Some(BalloonConfig {
            free_page_reporting: true,
        });
        c.validate().unwrap();
        // The balloon check comes before the devices' own, so any path shows it.
        c.vfio = vec![VfioConfig {
            sysfs_path: "/nonexistent/0000:00:04.0".into(),
        }];
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("balloon") && e.contains("VFIO"), "{e}");
    }
}
