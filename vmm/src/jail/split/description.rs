//! What a VMM process is given: the VM it runs ([`VmDescription`], the embedder's
//! [`VmConfig`](crate::VmConfig) with descriptor numbers where the embedder opened the
//! resource; sent as JSON in `Start`), and the host files the embedder opens for it
//! ([`HostFiles`]: the kernel, the initrd, `/dev/kvm`), which it gets as descriptors and never
//! by their paths.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::BootFile;
use crate::VmmError;

/// The VM a VMM process runs: what [`VmConfig`](crate::VmConfig) says, with descriptor numbers (inherited
/// through `execve`) where the embedder opened the resource.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmDescription {
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The kernel, opened read-only by the embedder ([`HostFiles`]).
    pub kernel: FileDescription,
    /// The initrd, opened read-only by the embedder.
    pub initrd: Option<FileDescription>,
    /// `/dev/kvm`, opened read-write by the embedder.
    pub kvm_fd: RawFd,
    /// Copy the boot files instead of mapping them ([`BootFiles::Copy`](crate::config::BootFiles::Copy)).
    pub copy_boot_files: bool,
    pub cmdline: String,
    /// The console log (a bounded pair, [`crate::console_log`]) and its bound.
    pub console_log: PathBuf,
    pub console_log_bytes: u64,
    /// The VM's work folder: its vsock socket is in it, and vsock's guest-to-host connections
    /// go to sockets next to it. The only host folder of the jail besides the templates'.
    pub work_dir: PathBuf,
    pub vsock: Option<VsockDescription>,
    pub shared_fs: Option<SharedFsDescription>,
    pub nets: Vec<NetDescription>,
    pub blocks: Vec<BlockDescription>,
    /// Host PCI devices (sysfs paths) passed through with VFIO.
    pub vfio: Vec<PathBuf>,
    /// A virtio-balloon, with free page reporting or not.
    pub balloon: Option<bool>,
    pub page_sharing: Option<PageSharingDescription>,
}

/// A file the embedder opened: its descriptor number (in the embedder and, inherited, in the
/// VMM process) and the path it was opened from, which only names it in messages.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileDescription {
    pub fd: RawFd,
    pub name: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VsockDescription {
    pub guest_cid: u32,
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SharedFsDescription {
    pub tag: String,
    pub host_dir: PathBuf,
}

/// A network card: the tap's descriptor number in the embedder (and, inherited, in the VMM
/// process).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetDescription {
    pub fd: RawFd,
    pub mac: [u8; 6],
    pub mtu: Option<u16>,
}

/// A disk slot: its file's descriptor number, or none for an empty slot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BlockDescription {
    pub serial: String,
    pub read_only: bool,
    pub fd: Option<RawFd>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PageSharingDescription {
    pub template_dir: PathBuf,
    pub domain: String,
    pub capture_kernel_text: bool,
}

impl VmDescription {
    /// The descriptor numbers the description names, in order (the kernel, the initrd, KVM,
    /// the taps, the disk files).
    pub fn fds(&self) -> Vec<RawFd> {
        std::iter::once(self.kernel.fd)
            .chain(self.initrd.as_ref().map(|i| i.fd))
            .chain(std::iter::once(self.kvm_fd))
            .chain(self.nets.iter().map(|n| n.fd))
            .chain(self.blocks.iter().filter_map(|b| b.fd))
            .collect()
    }
}

/// The host files the embedder opens for a VMM process, which gets them as descriptors and
/// never their paths: the kernel and the initrd read-only, `/dev/kvm` read-write, each
/// close-on-exec here. Keep it until [`VmmProcess::spawn`](super::VmmProcess::spawn) returned (the process has its copies
/// then); dropping it closes the embedder's.
#[derive(Debug)]
pub struct HostFiles {
    kernel: (std::fs::File, PathBuf),
    initrd: Option<(std::fs::File, PathBuf)>,
    kvm: OwnedFd,
}

impl HostFiles {
    /// Opens the kernel at `kernel`, the initrd at `initrd` (regular files, read-only) and
    /// `/dev/kvm`; an error names the file that failed and why.
    pub fn open(kernel: &Path, initrd: Option<&Path>) -> Result<HostFiles, VmmError> {
        let open = |path: &Path| match BootFile::open_path(path)? {
            BootFile::Open { file, name } => Ok((file, name)),
            BootFile::Path(_) => Err("not opened".to_string()),
        };
        let kernel = open(kernel).map_err(|reason| VmmError::Kernel {
            path: kernel.to_path_buf(),
            reason,
        })?;
        let initrd = match initrd {
            Some(p) => Some(open(p).map_err(|reason| VmmError::Initrd {
                path: p.to_path_buf(),
                reason,
            })?),
            None => None,
        };
        let kvm = crate::kvm_vm::open_kvm()?;
        Ok(HostFiles {
            kernel,
            initrd,
            kvm,
        })
    }

    /// The kernel's part of a description.
    pub fn kernel(&self) -> FileDescription {
        FileDescription {
            fd: self.kernel.0.as_raw_fd(),
            name: self.kernel.1.clone(),
        }
    }

    /// The initrd's part of a description.
    pub fn initrd(&self) -> Option<FileDescription> {
        self.initrd.as_ref().map(|(file, name)| FileDescription {
            fd: file.as_raw_fd(),
            name: name.clone(),
        })
    }

    /// KVM's descriptor number.
    pub fn kvm_fd(&self) -> RawFd {
        self.kvm.as_raw_fd()
    }
}
