//! The seam between the host side and a VM backend: one [`GuestSpec`] says what to
//! boot, [`Vm`] is the running VM of either backend (the embedded VMM, the product's default, or
//! [`qemu`] for hosts whose KVM cannot boot a Linux guest), [`GuestVm`] adds what both share (work
//! folder, console log, agent socket, the agent's ready event), and a VM's end is typed
//! ([`EndReason`], [`VmEnd`]) instead of a bool. [`thread`] owns a pod's VM on its own thread.
//!
//! Kept narrow on purpose: boot from a spec, agent socket, shared directory, stop, wait.

pub mod process;
pub mod qemu;
pub mod ready;
pub mod thread;

use std::fmt;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use qemu::{Accel, QemuConfig, QemuVm};
use ready::{ReadyError, ReadyListener};

/// Which VM backend runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The VMM embedded in this process, on /dev/kvm.
    Kvm,
    /// Debian's QEMU (`-M microvm`) with vhost-device-vsock; KVM if it can, else TCG.
    Qemu,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Kvm => "kvm",
            Backend::Qemu => "qemu",
        })
    }
}

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
    /// QEMU's accelerator, as `host_check::choose_backend` decided it (the default
    /// [`Accel::Kvm`]: software emulation is chosen only there).
    pub accel: Accel,
    /// The uid and gid QEMU and vhost-device-vsock run as (`qemu::QemuConfig::jail_id`).
    pub jail_id: u32,
}

impl Default for QemuPrograms {
    #[expect(
        clippy::expect_used,
        reason = "DEFAULT_JAIL_ID_BASE is neither 0 nor near u32::MAX, so jail_id gives Some \
                  (qemu::tests::jail_ids_are_the_base_plus_the_pid_and_never_root_or_minus_one)"
    )]
    fn default() -> Self {
        QemuPrograms {
            qemu: PathBuf::from(qemu::DEFAULT_QEMU),
            vhost_vsock: qemu::default_vhost_vsock_binary(),
            virtiofsd: qemu::default_virtiofsd_binary(),
            accel: Accel::Kvm,
            jail_id: qemu::jail_id(qemu::DEFAULT_JAIL_ID_BASE)
                .expect("the default jail id range fits"),
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
    fn page_sharing_config(&self) -> Option<vmm::PageSharingConfig> {
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
    fn wants_balloon(&self) -> bool {
        self.free_page_reporting && self.vfio.is_empty()
    }

    /// Words this spec adds to the kernel command line.
    fn cmdline_extra(&self) -> String {
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

/// Errors of starting or running a guest.
#[derive(Debug, thiserror::Error)]
pub enum GuestVmError {
    /// The embedded VMM failed.
    #[error(transparent)]
    Vmm(#[from] vmm::VmmError),
    /// The QEMU backend failed.
    #[error(transparent)]
    Qemu(#[from] qemu::QemuError),
    /// The work folder could not be made.
    #[error("cannot create the VM's work folder {path}: {source}")]
    WorkDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A NIC's tap fd could not be duplicated for the VMM.
    #[error("cannot duplicate a network card's tap fd: {0}")]
    Tap(std::io::Error),
    /// A disk's file could not be duplicated for the VMM.
    #[error("cannot duplicate a disk's file: {0}")]
    Disk(std::io::Error),
    /// The VMM process failed.
    #[error("the VMM process: {0}")]
    Process(String),
    /// The backend cannot give the guest this.
    #[error("this backend does not support {0}")]
    Unsupported(&'static str),
    /// The memory size does not fit the backend.
    #[error("memory of {0} MiB is out of range for this backend")]
    Memory(u64),
    /// The agent's ready event did not come.
    #[error("{source}; last console lines:\n{tail}")]
    AgentNotReady { source: ReadyError, tail: String },
}

/// A running VM of either backend. The QEMU variant is boxed: it is twice the size of the
/// embedded VMM's handle.
pub enum Vm {
    Embedded(vmm::VmHandle),
    /// The embedded VMM in a process of its own.
    Process(Box<std::sync::Mutex<vmm::jail::split::VmmProcess>>),
    Qemu(Box<QemuVm>),
}

impl Vm {
    /// Waits up to `timeout` for the guest to end by itself; why, once it has.
    fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<EndReason>, GuestVmError> {
        match self {
            Vm::Embedded(h) => match h.wait_timeout(timeout) {
                None => Ok(None),
                Some(Ok(vmm::VmExit::Reset)) => Ok(Some(EndReason::GuestReset)),
                Some(Ok(vmm::VmExit::Stopped)) => Ok(Some(EndReason::Stopped)),
                Some(Err(vmm::VmmError::AlreadyWaited)) => Ok(Some(EndReason::Stopped)),
                Some(Err(e)) => Err(e.into()),
            },
            Vm::Process(p) => Ok(lock(p).wait_timeout(timeout).map(|end| process_end(&end))),
            Vm::Qemu(vm) => Ok(vm.wait_timeout(timeout)?.map(|s| {
                if s.success() {
                    EndReason::GuestReset
                } else {
                    EndReason::BackendExited(s)
                }
            })),
        }
    }

    /// Fills empty disk slot `index` with `file` (embedded VMM only: QEMU has no runtime
    /// virtio-blk change here, docs/devices.md).
    fn attach_block(&self, index: usize, serial: String, file: File) -> Result<(), GuestVmError> {
        match self {
            Vm::Embedded(h) => Ok(h.attach_block(index, serial, file)?),
            Vm::Process(p) => lock(p)
                .attach_block(index, serial, &file, REQUEST_TIMEOUT)
                .map_err(|e| GuestVmError::Process(e.to_string())),
            Vm::Qemu(_) => Err(GuestVmError::Unsupported(
                "block hot-plug on the QEMU backend",
            )),
        }
    }

    /// Empties disk slot `index`.
    fn detach_block(&self, index: usize) -> Result<(), GuestVmError> {
        match self {
            Vm::Embedded(h) => Ok(h.detach_block(index)?),
            Vm::Process(p) => lock(p)
                .detach_block(index, REQUEST_TIMEOUT)
                .map_err(|e| GuestVmError::Process(e.to_string())),
            Vm::Qemu(_) => Err(GuestVmError::Unsupported(
                "block hot-plug on the QEMU backend",
            )),
        }
    }

    /// One page sharing pass (embedded VMM with page sharing on; `None` otherwise).
    fn share_pages(&self) -> Option<Result<(), GuestVmError>> {
        match self {
            Vm::Embedded(h) => match h.share_pages() {
                Err(vmm::VmmError::PageSharing(vmm::page_sharing::PageSharingError::Off)) => None,
                r => Some(r.map(drop).map_err(Into::into)),
            },
            Vm::Process(p) => {
                let mut p = lock(p);
                if !p.shares_pages() {
                    return None;
                }
                Some(
                    p.share_pages(SHARING_TIMEOUT)
                        .map_err(|e| GuestVmError::Process(e.to_string())),
                )
            }
            Vm::Qemu(_) => None,
        }
    }

    /// Whether the VM's kernel text template is still to be captured (embedded VMM with page
    /// sharing on; `None` otherwise).
    fn kernel_text_template_missing(&self) -> Option<Result<bool, GuestVmError>> {
        match self {
            Vm::Embedded(h) => match h.kernel_text_template_missing() {
                Err(vmm::VmmError::PageSharing(vmm::page_sharing::PageSharingError::Off)) => None,
                r => Some(r.map_err(Into::into)),
            },
            Vm::Process(p) => {
                let mut p = lock(p);
                if !p.shares_pages() {
                    return None;
                }
                Some(
                    p.kernel_text_template_missing(REQUEST_TIMEOUT)
                        .map_err(|e| GuestVmError::Process(e.to_string())),
                )
            }
            Vm::Qemu(_) => None,
        }
    }

    /// Captures the kernel text template from this VM (one that saw no pod input).
    fn capture_kernel_text(&self) -> Result<bool, GuestVmError> {
        match self {
            Vm::Embedded(h) => Ok(h.capture_kernel_text()?),
            Vm::Process(_) => Err(GuestVmError::Unsupported(
                "capturing the kernel text in a VMM process (the capture VM runs in the shim)",
            )),
            Vm::Qemu(_) => Err(GuestVmError::Unsupported(
                "page sharing on the QEMU backend",
            )),
        }
    }

    /// Stops the guest (bounded) and waits for it to end.
    fn stop(&mut self) -> Result<(), GuestVmError> {
        match self {
            Vm::Embedded(h) => {
                h.stop();
                match h.wait() {
                    Ok(_) | Err(vmm::VmmError::AlreadyWaited) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            Vm::Process(p) => {
                let end = lock(p).stop(STOP_TIMEOUT);
                if end.said.is_none() && end.exit != Err(libc::SIGKILL) {
                    log::warn!("stopping the VMM process: {}", end.describe());
                }
                Ok(())
            }
            Vm::Qemu(vm) => vm.stop().map(drop).map_err(Into::into),
        }
    }
}

/// How long a request to a VMM process (disk attach, detach) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a page sharing pass in a VMM process may take.
const SHARING_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a VMM process may take to stop before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a VMM process's VM ended. A seccomp kill is logged as the doc says (the line of the
/// VMM's report handler is in the log just before).
fn process_end(end: &vmm::jail::split::VmmEnd) -> EndReason {
    use vmm::jail::channel::EndKind;
    if end.by_seccomp() {
        log::error!("{}", end.describe());
    }
    match (&end.said, end.exit) {
        (Some((EndKind::Reset, _)), Ok(_)) => EndReason::GuestReset,
        (Some((EndKind::Stopped, _)), Ok(_)) => EndReason::Stopped,
        _ => EndReason::Lost(end.describe()),
    }
}

/// A running guest with its files. Dropping it stops the VM and removes its work folder.
pub struct GuestVm {
    vm: Vm,
    backend: Backend,
    agent_socket: PathBuf,
    console_log: PathBuf,
    work_dir: PathBuf,
    started_at: Instant,
    detail: String,
    /// The host end of the agent's ready port, until the event came: then it is closed, and
    /// later connections of the guest to that port find nobody.
    ready: Option<ReadyListener>,
}

/// The console log a VM started from a spec with `work_dir` writes: a bounded pair,
/// `console.log` and `console.log.1`, of at most [`CONSOLE_LOG_BYTES`] on both backends
/// (`vmm::console_log`).
pub fn console_log_in(work_dir: &Path) -> PathBuf {
    work_dir.join("console.log")
}

/// The bound of a VM's console log pair on the host.
pub const CONSOLE_LOG_BYTES: u64 = vmm::console_log::DEFAULT_CONSOLE_LOG_BYTES;
/// The most of a console's end quoted in an error message or a log line.
pub const CONSOLE_TAIL_BYTES: usize = 4096;

/// The last `lines` of a console log (empty if it cannot be read), for error messages: read
/// from its end, at most [`CONSOLE_TAIL_BYTES`], control characters escaped.
pub fn console_tail(console_log: &Path, lines: usize) -> String {
    vmm::console_log::tail(console_log, CONSOLE_TAIL_BYTES, lines)
}

/// The kernel command line our Linux guest gets under the embedded VMM (the VMM appends its
/// virtio-mmio devices). `reboot=k` makes the guest's reboot go through the i8042, which ends
/// the VM cleanly.
pub const KVM_GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet";

/// Console lines quoted in errors.
const TAIL_LINES: usize = 20;

impl GuestVm {
    /// Boots `spec` with `backend`; the host listens for the agent's ready event before the
    /// guest runs.
    pub fn start(backend: Backend, spec: &GuestSpec) -> Result<GuestVm, GuestVmError> {
        std::fs::create_dir_all(&spec.work_dir).map_err(|source| GuestVmError::WorkDir {
            path: spec.work_dir.clone(),
            source,
        })?;
        let started_at = Instant::now();
        let console_log = console_log_in(&spec.work_dir);
        let uds = match backend {
            Backend::Kvm => spec.work_dir.join(VSOCK_UDS_NAME),
            // In a folder of its own, which the jailed vhost-device-vsock may write.
            Backend::Qemu => qemu::vsock_uds_in(&spec.work_dir),
        };
        if let Some(dir) = uds.parent() {
            std::fs::create_dir_all(dir).map_err(|source| GuestVmError::WorkDir {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let result = ReadyListener::bind(&uds)
            .map_err(|source| GuestVmError::AgentNotReady {
                source,
                tail: String::new(),
            })
            .and_then(|ready| {
                let (vm, detail) = match backend {
                    Backend::Kvm if spec.vmm_process => {
                        Self::start_kvm_process(spec, &console_log, &uds)?
                    }
                    Backend::Kvm => Self::start_kvm(spec, &console_log, &uds)?,
                    Backend::Qemu => Self::start_qemu(spec, &console_log)?,
                };
                Ok((vm, detail, ready))
            });
        match result {
            Ok((vm, detail, ready)) => Ok(GuestVm {
                vm,
                backend,
                agent_socket: uds,
                console_log,
                work_dir: spec.work_dir.clone(),
                started_at,
                detail,
                ready: Some(ready),
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&spec.work_dir);
                Err(e)
            }
        }
    }

    fn start_kvm(
        spec: &GuestSpec,
        console_log: &Path,
        uds: &Path,
    ) -> Result<(Vm, String), GuestVmError> {
        let mut cfg = vmm::VmConfig::new(&spec.kernel);
        cfg.vcpus = spec.vcpus;
        cfg.memory_mib = spec.memory_mib;
        cfg.initrd = Some(spec.initrd.clone().into());
        cfg.boot_files = spec.boot_files;
        cfg.cmdline = format!("{KVM_GUEST_CMDLINE} {}", spec.cmdline_extra())
            .trim_end()
            .to_string();
        cfg.serial = vmm::SerialSink::File {
            path: console_log.to_path_buf(),
            max_bytes: CONSOLE_LOG_BYTES,
        };
        cfg.vsock = Some(vmm::VsockConfig {
            guest_cid: GUEST_CID,
            uds_path: uds.to_path_buf(),
        });
        cfg.shared_fs = spec.shared.as_ref().map(|s| vmm::SharedFsConfig {
            tag: s.tag.clone(),
            host_dir: s.host_dir.clone(),
        });
        for nic in &spec.nics {
            let tap = nic
                .tap
                .as_fd()
                .try_clone_to_owned()
                .map_err(GuestVmError::Tap)?;
            cfg.nets.push(vmm::NetConfig {
                tap,
                mac: nic.mac,
                mtu: Some(nic.mtu),
            });
        }
        // Host PCI devices (bound to vfio-pci) the pod holds, on the VM's PCI root
        // (docs/vfio.md); the VMM opens their IOMMU groups.
        cfg.vfio = spec
            .vfio
            .iter()
            .map(|sysfs_path| vmm::VfioConfig {
                sysfs_path: sysfs_path.clone(),
            })
            .collect();
        cfg.page_sharing = spec.page_sharing_config();
        cfg.balloon = spec.wants_balloon().then_some(vmm::BalloonConfig {
            free_page_reporting: true,
        });
        for d in &spec.disks {
            let backing = match &d.backing {
                DiskBacking::Empty { read_only } => vmm::BlockBacking::Empty {
                    read_only: *read_only,
                },
                DiskBacking::File { file, read_only } => vmm::BlockBacking::File {
                    file: file.try_clone().map_err(GuestVmError::Disk)?,
                    read_only: *read_only,
                },
            };
            cfg.blocks.push(vmm::BlockConfig {
                serial: d.serial.clone(),
                backing,
            });
        }
        let handle = vmm::Vm::start(cfg)?;
        let detail = format!("embedded vmm on /dev/kvm, {} entry", handle.boot_entry());
        Ok((Vm::Embedded(handle), detail))
    }

    fn start_kvm_process(
        spec: &GuestSpec,
        console_log: &Path,
        uds: &Path,
    ) -> Result<(Vm, String), GuestVmError> {
        let cmdline = format!("{KVM_GUEST_CMDLINE} {}", spec.cmdline_extra())
            .trim_end()
            .to_string();
        let p = process::start(spec, cmdline, console_log, uds)?;
        let detail = format!("{} (pid {})", p.detail(), p.pid());
        Ok((Vm::Process(Box::new(std::sync::Mutex::new(p))), detail))
    }

    fn start_qemu(spec: &GuestSpec, console_log: &Path) -> Result<(Vm, String), GuestVmError> {
        let memory_mib =
            u32::try_from(spec.memory_mib).map_err(|_| GuestVmError::Memory(spec.memory_mib))?;
        let mut cfg = QemuConfig::new(
            &spec.kernel,
            &spec.initrd,
            &spec.qemu.vhost_vsock,
            &spec.work_dir,
        );
        cfg.qemu_binary = spec.qemu.qemu.clone();
        cfg.virtiofsd_binary = spec.qemu.virtiofsd.clone();
        cfg.vcpus = u32::from(spec.vcpus);
        cfg.memory_mib = memory_mib;
        cfg.guest_cid = GUEST_CID;
        cfg.accel = spec.qemu.accel;
        cfg.jail_id = spec.qemu.jail_id;
        cfg.console_log = Some(console_log.to_path_buf());
        cfg.console_log_bytes = CONSOLE_LOG_BYTES;
        cfg.cmdline_extra = spec.cmdline_extra();
        cfg.shared_fs = spec.shared.as_ref().map(|s| qemu::QemuSharedFs {
            tag: s.tag.clone(),
            host_dir: s.host_dir.clone(),
        });
        if !spec.vfio.is_empty() {
            return Err(GuestVmError::Unsupported(
                "VFIO devices on the QEMU backend",
            ));
        }
        cfg.free_page_reporting = spec.wants_balloon();
        cfg.disks = spec
            .disks
            .iter()
            .map(|d| match &d.backing {
                DiskBacking::File { file, read_only } => Ok(qemu::QemuDisk {
                    serial: d.serial.clone(),
                    file: file.clone(),
                    read_only: *read_only,
                }),
                DiskBacking::Empty { .. } => Err(GuestVmError::Unsupported(
                    "empty block slots on the QEMU backend (it cannot hot-plug)",
                )),
            })
            .collect::<Result<_, _>>()?;
        cfg.nics = spec
            .nics
            .iter()
            .map(|n| qemu::QemuNic {
                tap: n.tap.clone(),
                mac: n.mac,
                mtu: n.mtu,
            })
            .collect();
        let accel = match cfg.accel.resolve() {
            Accel::Kvm => "KVM",
            _ => "TCG (software emulation)",
        };
        let vm = QemuVm::start(cfg)?;
        let detail = format!("qemu -M microvm, {accel}");
        Ok((Vm::Qemu(Box::new(vm)), detail))
    }

    /// The backend running the guest.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// One line on how the guest runs (backend, accelerator, boot entry).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Host processes running this guest besides the current one (QEMU and its helpers; none
    /// for the embedded VMM, which runs in this process). Recorded so that a cleanup after a
    /// crash of this process can find them.
    pub fn pids(&self) -> Vec<u32> {
        match &self.vm {
            Vm::Embedded(_) => Vec::new(),
            Vm::Process(p) => vec![lock(p).pid()],
            Vm::Qemu(vm) => vm.pids(),
        }
    }

    /// The hybrid-vsock Unix socket of the guest's vsock device.
    pub fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    /// The guest's console log.
    pub fn console_log(&self) -> &Path {
        &self.console_log
    }

    /// When the backend was asked to start.
    pub fn started_at(&self) -> Instant {
        self.started_at
    }

    /// The last `lines` of the console, for error messages.
    pub fn console_tail(&self, lines: usize) -> String {
        console_tail(&self.console_log, lines)
    }

    /// Waits (bounded) for the agent's ready event ([`ready`]); fails at once if the guest ends
    /// first. Errors carry the console's tail.
    pub fn wait_agent_ready(&mut self, timeout: Duration) -> Result<(), GuestVmError> {
        let GuestVm { vm, ready, .. } = self;
        let Some(listener) = ready.as_ref() else {
            // It came already.
            return Ok(());
        };
        let mut gone = None;
        let waited = listener.wait(timeout, || match vm.wait_timeout(Duration::ZERO) {
            Ok(None) => false,
            Ok(Some(reason)) => {
                gone = Some(reason);
                true
            }
            Err(e) => {
                gone = Some(EndReason::Lost(e.to_string()));
                true
            }
        });
        if let Some(reason) = gone {
            log::warn!("the guest ended before its agent was ready: {reason}");
        }
        if waited.is_ok() {
            *ready = None;
        }
        waited.map_err(|source| GuestVmError::AgentNotReady {
            source,
            tail: self.console_tail(TAIL_LINES),
        })
    }

    /// Waits up to `timeout` for the guest to end by itself; why, once it has.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<EndReason>, GuestVmError> {
        self.vm.wait_timeout(timeout)
    }

    /// Fills empty disk slot `index` (of [`GuestSpec::disks`]) with `file`; blocks while the
    /// device runs a batch of requests.
    pub fn attach_block(
        &self,
        index: usize,
        serial: String,
        file: File,
    ) -> Result<(), GuestVmError> {
        self.vm.attach_block(index, serial, file)
    }

    /// One page sharing pass over the guest's memory (docs/page-sharing.md): `None` when the
    /// VM does not share pages (off, VFIO devices, the QEMU backend).
    pub fn share_pages(&self) -> Option<Result<(), GuestVmError>> {
        self.vm.share_pages()
    }

    /// Whether this VM's kernel text template is still to be captured
    /// ([`GuestSpec::kernel_text_capture`]); `None` when it shares no pages.
    pub fn kernel_text_template_missing(&self) -> Option<Result<bool, GuestVmError>> {
        self.vm.kernel_text_template_missing()
    }

    /// Captures the kernel text template from this VM, which must be one that saw no pod input
    /// (started from [`GuestSpec::kernel_text_capture`]); whether it captured.
    pub fn capture_kernel_text(&self) -> Result<bool, GuestVmError> {
        self.vm.capture_kernel_text()
    }

    /// Empties disk slot `index`.
    pub fn detach_block(&self, index: usize) -> Result<(), GuestVmError> {
        self.vm.detach_block(index)
    }

    /// Stops the guest (bounded) and waits for it to end.
    pub fn stop(&mut self) -> Result<(), GuestVmError> {
        self.vm.stop()
    }
}

impl Drop for GuestVm {
    fn drop(&mut self) {
        let _ = self.stop();
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

/// A fresh private work folder for one VM under the system's temporary folder.
pub fn new_work_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "microvm-{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
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
